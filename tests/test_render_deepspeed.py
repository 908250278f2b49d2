"""The DeepSpeed config renderer: the mapping table, every strategy x precision, the batch identity, every error
path; DeepSpeed's own config class accepts what we generate (and rejects a broken batch); and a real 2-process
DeepSpeed training step on CPU (gloo) driven by the generated config."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from jupyter_dist.plan import Hardware, ModelSpec, Plan, TrainingShape, plan
from jupyter_dist.render.common import RenderError, RenderOptions, layout_of
from jupyter_dist.render.deepspeed import (
    DEEPSPEED_CONFIG_MAP,
    DEEPSPEED_KNOWN_KEYS,
    DEEPSPEED_STRATEGIES,
    check_deepspeed_keys,
    deepspeed_fields,
    nest,
    render_deepspeed,
    render_deepspeed_json,
)

STRATEGIES = ("zero1", "zero2", "zero3", "zero2-offload", "zero3-offload", "zero3-offload-params")
PRECISIONS = ("bf16-mixed", "fp16-mixed", "bf16-true", "fp32")
NODE2 = Hardware.from_names("h100-80gb", gpus_per_node=2)
"""One node with two GPUs: the shape of the real 2-process runs below."""
TINY = ModelSpec(name="tiny", layers=2, hidden=64, heads=4, vocab=256)
"""hidden 64: buckets of 64^2 elements and a ZeRO-3 persistence threshold of 640 elements, so the 64x256 weights
of the test model are really partitioned."""
EXTENSIONS = Path(os.environ["TORCH_EXTENSIONS_DIR"])  # the suite's one folder (tests/conftest.py)
"""DeepSpeed's JIT-built C++ ops (cpu_adam ~80 s, shm_comm ~75 s on 2 cores) are built once into this folder."""


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def get(cfg: dict[str, Any], path: str) -> Any:
    node: Any = cfg
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def make_plan(strategy: str, *, precision: str = "bf16-mixed", optimizer: str = "adamw", checkpointing: str = "none",
              model: ModelSpec | str = TINY, hardware: Hardware = NODE2, micro_batch: int = 2,
              grad_accum: int = 2) -> Plan:  # fmt: skip
    shape = TrainingShape(micro_batch=micro_batch, grad_accum=grad_accum, seq_len=64, precision=precision,
                          optimizer=optimizer, checkpointing=checkpointing)  # fmt: skip
    return plan(model, hardware, shape, strategy=strategy)


# ---------------------------------------------------------------------------------------------------------------
# 1. the mapping table
# ---------------------------------------------------------------------------------------------------------------
def test_table_keys_are_unique_and_none_lies_inside_another() -> None:
    paths = list(DEEPSPEED_CONFIG_MAP.values())
    assert len(set(paths)) == len(paths)
    for a, b in itertools.permutations(paths, 2):
        assert not b.startswith(a + "."), f"{b} lies inside the value of {a}"


def test_table_sections_are_known_to_deepspeed() -> None:
    for path in DEEPSPEED_CONFIG_MAP.values():
        parts = path.split(".")
        assert parts[0] in DEEPSPEED_KNOWN_KEYS[""], path
        for depth in range(1, len(parts)):
            section = ".".join(parts[:depth])
            if section in DEEPSPEED_KNOWN_KEYS:
                assert parts[depth] in DEEPSPEED_KNOWN_KEYS[section], path


@pytest.mark.parametrize(("field", "path"), sorted(DEEPSPEED_CONFIG_MAP.items()))
def test_each_field_lands_at_its_key(field: str, path: str) -> None:
    value = object()
    cfg = nest({field: value})
    assert get(cfg, path) is value
    assert len(flatten(cfg)) == 1


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"zero_stage": 3, "lr": 1e-4}, {"zero_optimization": {"stage": 3}, "optimizer": {"params": {"lr": 1e-4}}}),
        ({"micro_batch": 2, "grad_accum": 4, "global_batch": 64},
         {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "train_batch_size": 64}),
        ({"offload_optimizer_device": "cpu", "offload_param_device": None, "zero_stage": 2},
         {"zero_optimization": {"offload_optimizer": {"device": "cpu"}, "stage": 2}}),
        ({"fp16": True, "loss_scale": 0, "bf16": False}, {"fp16": {"enabled": True, "loss_scale": 0},
                                                           "bf16": {"enabled": False}}),
        ({"partition_activations": None}, {}),
    ],
)  # fmt: skip
def test_nest_examples(fields: dict[str, Any], expected: dict[str, Any]) -> None:
    assert nest(fields) == expected


@pytest.mark.parametrize(("strategy", "precision"), list(itertools.product(STRATEGIES, PRECISIONS)))
def test_every_leaf_of_the_config_comes_from_the_table(strategy: str, precision: str) -> None:
    p = make_plan(strategy, precision=precision)
    opts = RenderOptions(candidate=strategy)
    cfg = render_deepspeed(p, opts)
    fields = deepspeed_fields(layout_of(p, opts), opts)
    assert flatten(cfg) == {DEEPSPEED_CONFIG_MAP[k]: v for k, v in fields.items() if v is not None}


# ---------------------------------------------------------------------------------------------------------------
# every strategy x precision, as a table of expected flat fields
# ---------------------------------------------------------------------------------------------------------------
STRATEGY_ROWS: dict[str, dict[str, Any]] = {
    "zero1": {"zero_stage": 1, "offload_optimizer_device": None, "offload_param_device": None,
              "stage3_gather_16bit_weights_on_model_save": None, "stage3_prefetch_bucket_size": None},
    "zero2": {"zero_stage": 2, "offload_optimizer_device": None, "offload_param_device": None,
              "stage3_gather_16bit_weights_on_model_save": None, "stage3_prefetch_bucket_size": None},
    "zero3": {"zero_stage": 3, "offload_optimizer_device": None, "offload_param_device": None,
              "stage3_gather_16bit_weights_on_model_save": True, "stage3_prefetch_bucket_size": int(0.9 * 64 * 64),
              "stage3_param_persistence_threshold": 640},
    "zero2-offload": {"zero_stage": 2, "offload_optimizer_device": "cpu", "offload_optimizer_pin_memory": True,
                      "offload_param_device": None, "stage3_gather_16bit_weights_on_model_save": None},
    "zero3-offload": {"zero_stage": 3, "offload_optimizer_device": "cpu", "offload_param_device": None,
                      "stage3_gather_16bit_weights_on_model_save": True},
    "zero3-offload-params": {"zero_stage": 3, "offload_optimizer_device": "cpu", "offload_param_device": "cpu",
                             "offload_param_pin_memory": True, "stage3_gather_16bit_weights_on_model_save": True},
}  # fmt: skip
PRECISION_ROWS: dict[str, dict[str, Any]] = {
    "bf16-mixed": {"bf16": True, "fp16": False, "bf16_master_weights": None, "loss_scale": None},
    "fp16-mixed": {"bf16": False, "fp16": True, "loss_scale": 0, "initial_scale_power": 16,
                   "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
    "bf16-true": {"bf16": True, "fp16": False, "bf16_master_weights": True, "bf16_optimizer_states": True},
    "fp32": {"bf16": False, "fp16": False, "loss_scale": None, "bf16_master_weights": None},
}  # fmt: skip


@pytest.mark.parametrize(("strategy", "precision"), list(itertools.product(STRATEGIES, PRECISIONS)))
def test_strategy_x_precision(strategy: str, precision: str) -> None:
    p = make_plan(strategy, precision=precision)
    cfg = render_deepspeed(p, RenderOptions(candidate=strategy))
    expected = {**STRATEGY_ROWS[strategy], **PRECISION_ROWS[precision], "reduce_bucket_size": 64 * 64,
                "allgather_bucket_size": 64 * 64, "overlap_comm": True, "contiguous_gradients": True,
                "wall_clock_breakdown": False, "optimizer_type": "AdamW", "partition_activations": None}  # fmt: skip
    for field, value in expected.items():
        assert get(cfg, DEEPSPEED_CONFIG_MAP[field]) == value, field
    # the buckets are the ones the memory plan counted
    settings = p.candidate(strategy).settings
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        assert cfg["zero_optimization"][key] == settings[key]
    assert p.candidate(strategy).memory.detail["comm_buckets"] == 2 * (
        cfg["zero_optimization"]["reduce_bucket_size"] + cfg["zero_optimization"]["allgather_bucket_size"]
    )
    if strategy.startswith("zero3"):
        for key in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                    "stage3_max_live_parameters", "stage3_max_reuse_distance"):  # fmt: skip
            assert cfg["zero_optimization"][key] == settings[key]
    else:
        assert not any(k.startswith("stage3_") for k in cfg["zero_optimization"])
    assert "activation_checkpointing" not in cfg


@pytest.mark.parametrize(
    ("model", "hardware", "micro", "global_batch", "accum", "strategy", "degrees"),
    [
        ("llama-2-7b", Hardware.from_names("h100-80gb", nodes=2), 2, 512, None, "zero3", {}),
        ("llama-2-7b", Hardware.from_names("h100-80gb", nodes=1), 1, 64, None, "zero2", {}),
        ("gpt2", Hardware.from_names("a100-80gb", nodes=1), 4, None, 3, "zero1", {}),
        ("llama-2-70b", Hardware.from_names("h100-80gb", nodes=4), 1, 256, None, "zero1", {"tp": 4, "pp": 2}),
        ("llama-3-8b", Hardware.from_names("h100-80gb", nodes=2), 1, 1024, None, "zero1", {"tp": 2}),
        ("llama-3-8b", Hardware.from_names("h100-80gb", nodes=2), 2, 96, None, "zero1", {"pp": 4}),
        ("llama-2-13b", Hardware.from_names("h100-80gb", nodes=3), 2, 48, None, "zero3-offload", {}),
        ("gpt2-xl", NODE2, 3, None, 5, "zero2-offload", {}),
        ("llama-2-7b", Hardware.from_names("h100-80gb", gpus_per_node=4, nodes=2), 1, None, 7, "zero3-offload-params",
         {}),
    ],
)  # fmt: skip
def test_batch_identity(model: str, hardware: Hardware, micro: int, global_batch: int | None, accum: int | None,
                        strategy: str, degrees: dict[str, int]) -> None:  # fmt: skip
    p = plan(model, hardware, TrainingShape(micro_batch=micro, global_batch=global_batch, grad_accum=accum),
             strategy=strategy, **degrees)  # fmt: skip
    cand = p.candidates[0]
    cfg = render_deepspeed(p, RenderOptions(candidate=cand.name))
    dp = cand.dims.dp
    assert dp * cand.dims.tp * cand.dims.pp * cand.dims.cp == hardware.world_size
    assert cfg["train_micro_batch_size_per_gpu"] == micro
    assert cfg["train_batch_size"] == micro * cfg["gradient_accumulation_steps"] * dp
    if global_batch is not None:
        assert cfg["train_batch_size"] == global_batch
    else:
        assert cfg["gradient_accumulation_steps"] == accum
    if degrees:  # model parallelism shrinks the data-parallel size, and with it the global batch
        assert dp < hardware.world_size
        assert cfg["train_batch_size"] < micro * cfg["gradient_accumulation_steps"] * hardware.world_size


def test_example_from_the_brief() -> None:
    p = plan("llama-2-7b", Hardware.from_names("h100-80gb", nodes=2), TrainingShape(micro_batch=2, global_batch=512),
             strategy="zero3")  # fmt: skip
    cfg = render_deepspeed(p)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (
        512, 2, 16)  # fmt: skip
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 4096 * 4096
    assert cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


def test_options_reach_the_config() -> None:
    opts = RenderOptions(candidate="zero2", lr=1e-4, weight_decay=0.01, grad_clip=0.5)
    cfg = render_deepspeed(make_plan("zero2"), opts)
    assert cfg["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                            "weight_decay": 0.01}}  # fmt: skip
    assert cfg["gradient_clipping"] == 0.5
    assert render_deepspeed(make_plan("zero2"), RenderOptions(grad_clip=0))["gradient_clipping"] == 0
    assert cfg["steps_per_print"] > 0 and cfg["wall_clock_breakdown"] is False


@pytest.mark.parametrize("optimizer", ["adamw-8bit", "sgd"])
@pytest.mark.parametrize("strategy", ["zero1", "zero3", "zero2-offload", "zero3-offload-params"])
def test_client_optimizers_leave_the_optimizer_section_out(optimizer: str, strategy: str) -> None:
    cfg = render_deepspeed(make_plan(strategy, optimizer=optimizer), RenderOptions(candidate=strategy))
    assert "optimizer" not in cfg
    assert cfg["zero_allow_untested_optimizer"] is True
    if "offload" in strategy:
        assert cfg["zero_force_ds_cpu_optimizer"] is False
    else:
        assert "zero_force_ds_cpu_optimizer" not in cfg


def test_adamw_needs_no_client_optimizer_flags() -> None:
    cfg = render_deepspeed(make_plan("zero2-offload"))
    assert "zero_allow_untested_optimizer" not in cfg and "zero_force_ds_cpu_optimizer" not in cfg


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_activation_checkpointing_section(checkpointing: str) -> None:
    cfg = render_deepspeed(make_plan("zero2", checkpointing=checkpointing))
    assert cfg["activation_checkpointing"] == {
        "partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
        "synchronize_checkpoint_boundary": False,
    }  # fmt: skip
    # with tensor parallelism the saved activations are partitioned across the tp ranks
    p = plan("llama-3-8b", Hardware.from_names("h100-80gb"), TrainingShape(checkpointing=checkpointing),
             strategy="zero1", tp=2)  # fmt: skip
    cfg = render_deepspeed(p, RenderOptions(candidate=p.candidates[0].name))
    assert cfg["activation_checkpointing"]["partition_activations"] is True


@pytest.mark.parametrize(
    ("strategy", "optimizer_device", "param_device"),
    [("zero3-offload", "nvme", None), ("zero3-offload-params", "nvme", "nvme")],
)
def test_nvme_offload(strategy: str, optimizer_device: str, param_device: str | None) -> None:
    cfg = render_deepspeed(make_plan(strategy), RenderOptions(nvme_path="/local_nvme"))
    zero = cfg["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": optimizer_device, "nvme_path": "/local_nvme", "pin_memory": True}
    if param_device:
        assert zero["offload_param"] == {"device": param_device, "nvme_path": "/local_nvme", "pin_memory": True}
    else:
        assert "offload_param" not in zero


def test_json_is_the_dict_with_indent_2() -> None:
    p = make_plan("zero3")
    text = render_deepspeed_json(p)
    assert json.loads(text) == render_deepspeed(p)
    assert text.startswith('{\n  "train_micro_batch_size_per_gpu": 2,') and text.endswith("}\n")


def test_deepspeed_strategies_are_the_deepspeed_family() -> None:
    assert DEEPSPEED_STRATEGIES == STRATEGIES


# ---------------------------------------------------------------------------------------------------------------
# 4. every error path
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["ddp", "fsdp-full-shard", "fsdp2", "fsdp-no-shard"])
def test_non_deepspeed_candidate_is_refused(strategy: str) -> None:
    p = make_plan(strategy)
    expected = rf"has no DeepSpeed config; DeepSpeed configs exist for {', '.join(STRATEGIES)}: pick one"
    with pytest.raises(RenderError, match=expected):
        render_deepspeed(p)
    with pytest.raises(RenderError, match="has no DeepSpeed config"):
        render_deepspeed_json(p)


def test_non_deepspeed_candidate_named_in_options_is_refused() -> None:
    p = plan("gpt2", Hardware.from_names("h100-80gb"))
    with pytest.raises(RenderError, match=r"'fsdp2' \(FSDP2 fully_shard\) has no DeepSpeed config"):
        render_deepspeed(p, RenderOptions(candidate="fsdp2"))
    assert render_deepspeed(p, RenderOptions(candidate="zero2"))["zero_optimization"]["stage"] == 2


def test_nothing_fits_without_a_named_candidate() -> None:
    p = plan("llama-3.1-405b", Hardware.from_names("h100-80gb", gpus_per_node=1), strategy="zero3")
    assert p.recommended is None
    with pytest.raises(RenderError, match="nothing fits in this plan, so there is no recommendation to compile"):
        render_deepspeed(p)
    # naming the candidate compiles it anyway (the user asked for it)
    assert render_deepspeed(p, RenderOptions(candidate="zero3"))["zero_optimization"]["stage"] == 3


def test_unknown_candidate_name() -> None:
    with pytest.raises(RenderError, match="the plan has no candidate 'zero1'; have: zero3"):
        render_deepspeed(make_plan("zero3"), RenderOptions(candidate="zero1"))


def test_nvme_without_offload_is_refused() -> None:
    with pytest.raises(RenderError, match="nvme_path is set but zero3 offloads nothing"):
        render_deepspeed(make_plan("zero3"), RenderOptions(nvme_path="/nvme"))


def test_nvme_with_zero2_offload_is_refused() -> None:
    with pytest.raises(RenderError, match="NVMe offload needs ZeRO-3 .* but zero2-offload is ZeRO-2"):
        render_deepspeed(make_plan("zero2-offload"), RenderOptions(nvme_path="/nvme"))


@pytest.mark.parametrize(("strategy", "missing"), [("zero2", "reduce_bucket_size"),
                                                     ("zero3", "stage3_prefetch_bucket_size")])  # fmt: skip
def test_candidate_without_the_plan_settings_is_refused(strategy: str, missing: str) -> None:
    p = make_plan(strategy)
    cand = p.candidates[0]
    old = dataclasses.replace(cand, settings={k: v for k, v in cand.settings.items() if k != missing})
    p = dataclasses.replace(p, candidates=(old,), recommended=old.name)
    with pytest.raises(RenderError, match=rf"lacks the plan setting\(s\) {missing} .* plan again"):
        render_deepspeed(p)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"train_batch_size": 8, "zero_optimisation": {"stage": 2}},
         "unknown key.* zero_optimisation at the top level"),
        ({"activation_checkpointing": {"partition_activation": True}},
         "partition_activation at section 'activation_checkpointing'"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": 1, "max_grad_norm": 1.0}}},
         "max_grad_norm at section 'optimizer.params'"),
    ],
)  # fmt: skip
def test_unknown_keys_are_refused(config: dict[str, Any], message: str) -> None:
    with pytest.raises(RenderError, match=message):
        check_deepspeed_keys(config)


def test_nest_errors() -> None:
    with pytest.raises(RenderError, match="field 'zero_stag' has no DeepSpeed key; known fields: micro_batch"):
        nest({"zero_stag": 3})
    with pytest.raises(RenderError, match="two fields map to DeepSpeed key 'a.b'"):
        nest({"x": 1, "y": 2}, {"x": "a.b", "y": "a.b"})
    with pytest.raises(RenderError, match="DeepSpeed key 'a.b' of field 'y' lies inside a value"):
        nest({"x": 1, "y": 2}, {"x": "a", "y": "a.b"})


# ---------------------------------------------------------------------------------------------------------------
# 2. DeepSpeed's own config class accepts every generated config (in a subprocess: a 1-process gloo group)
# ---------------------------------------------------------------------------------------------------------------
VALIDATE = r'''
import json, os, sys
import deepspeed
import deepspeed.comm.torch
from deepspeed.runtime.config import DeepSpeedConfig

# deepspeed.init_distributed would JIT-build the shared-memory all-reduce op (~75 s the first time); validating a
# config runs no collective, so that one optimisation is switched off here (the real runs below build and use it).
# Through sys.modules: the attribute ``deepspeed.comm.torch`` is torch itself (deepspeed.comm imports torch).
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
deepspeed.init_distributed(dist_backend="gloo")


class Mpu:
    """What DeepSpeedConfig asks of an mpu: the data-parallel size (the plan's dp, not the world size)."""

    def __init__(self, dp):
        self.dp = dp

    def get_data_parallel_world_size(self):
        return self.dp


results = {}
for case in json.load(open(sys.argv[1])):
    try:
        c = DeepSpeedConfig(case["config"], mpu=Mpu(case["dp"]))
        results[case["id"]] = {
            "ok": True, "world_size": c.world_size, "train_batch_size": c.train_batch_size,
            "micro": c.train_micro_batch_size_per_gpu, "accum": c.gradient_accumulation_steps,
            "stage": c.zero_optimization_stage, "bf16": c.bfloat16_config.enabled, "fp16": c.float16_config.enabled,
            "dynamic_loss_scale": c.float16_config.enabled and c.float16_config.loss_scale == 0,
            "offload_optimizer": str(getattr(c.zero_config.offload_optimizer, "device", None)),
            "offload_param": str(getattr(c.zero_config.offload_param, "device", None)),
            "gather_16bit": c.zero_config.gather_16bit_weights_on_model_save,
            "prefetch": c.zero_config.prefetch_bucket_size, "reduce_bucket": c.zero_config.reduce_bucket_size,
            "optimizer": c.optimizer_name, "optimizer_params": c.optimizer_params, "clip": c.gradient_clipping,
        }
    except Exception as e:  # the test decides which cases must fail
        results[case["id"]] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
print("RESULTS " + json.dumps(results))
'''


def _ds_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(EXTENSIONS), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", **extra)  # fmt: skip
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _validation_cases() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []

    def add(case_id: str, p: Plan, opts: RenderOptions | None = None) -> dict[str, Any]:
        lay = layout_of(p, opts)
        case = {"id": case_id, "config": render_deepspeed(p, opts), "dp": lay.dims.dp}
        cases.append(case)
        return case

    for strategy, precision in itertools.product(STRATEGIES, PRECISIONS):
        add(f"{strategy}/{precision}", make_plan(strategy, precision=precision), RenderOptions(candidate=strategy))
    for strategy, optimizer in itertools.product(("zero1", "zero2-offload", "zero3-offload-params"),
                                                 ("adamw-8bit", "sgd")):  # fmt: skip
        add(f"{strategy}/{optimizer}", make_plan(strategy, optimizer=optimizer), RenderOptions(candidate=strategy))
    add("zero3-offload/nvme", make_plan("zero3-offload"), RenderOptions(nvme_path="/local_nvme"))
    add("zero3-offload-params/nvme", make_plan("zero3-offload-params"), RenderOptions(nvme_path="/local_nvme"))
    add("zero2/full-checkpointing", make_plan("zero2", checkpointing="full"), RenderOptions(candidate="zero2"))
    big = plan("llama-2-7b", Hardware.from_names("h100-80gb", nodes=2), TrainingShape(micro_batch=2, global_batch=512),
               strategy="zero3")  # fmt: skip
    add("brief/zero3-2x8", big)
    tp_pp = plan("llama-2-70b", Hardware.from_names("h100-80gb", nodes=4), TrainingShape(global_batch=256,
                 checkpointing="full"), strategy="zero1", tp=4, pp=2)  # fmt: skip
    add("zero1+tp4+pp2", tp_pp, RenderOptions(candidate=tp_pp.candidates[0].name))
    # the mistake the dp rule prevents: a batch counted over all 32 ranks instead of the 4 data-parallel ones
    world = add("broken/world-batch", tp_pp, RenderOptions(candidate=tp_pp.candidates[0].name))
    c = world["config"]
    world["config"] = {**c, "train_batch_size": c["train_micro_batch_size_per_gpu"] * c["gradient_accumulation_steps"]
                       * tp_pp.world_size}  # fmt: skip
    # proofs that the check can fail: a batch off by one, a misspelt key inside a section
    broken = add("broken/batch", big)
    broken["config"] = {**broken["config"], "train_batch_size": broken["config"]["train_batch_size"] + 1}
    typo = add("broken/zero-key", big)
    zero = dict(typo["config"]["zero_optimization"])
    zero["stage3_prefetch_bucket_sise"] = zero.pop("stage3_prefetch_bucket_size")
    typo["config"] = {**typo["config"], "zero_optimization": zero}
    # ...and why we check top-level keys ourselves: DeepSpeed accepts a misspelt one
    silent = add("silent/top-level-key", big)
    silent["config"] = {**silent["config"], "gradient_clippng": 0.5}
    return cases


CASES = _validation_cases()
VALID_IDS = [c["id"] for c in CASES if not c["id"].startswith(("broken/", "silent/"))]


@pytest.fixture(scope="module")
def deepspeed_verdicts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], Any]]:
    pytest.importorskip("deepspeed")
    d = tmp_path_factory.mktemp("ds-validate")
    cases = CASES
    (d / "cases.json").write_text(json.dumps(cases))
    (d / "validate.py").write_text(VALIDATE)
    for _ in range(3):  # the port is free when picked; another process may bind it before the store does
        env = _ds_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")  # fmt: skip
        res = subprocess.run([sys.executable, str(d / "validate.py"), str(d / "cases.json")], env=env, cwd=d,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        if res.returncode == 0 or "EADDRINUSE" not in res.stdout + res.stderr:
            break
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULTS "))
    verdicts = json.loads(line[len("RESULTS ") :])
    return {c["id"]: (c, verdicts[c["id"]]) for c in cases}


@pytest.mark.deepspeed
@pytest.mark.parametrize("case_id", VALID_IDS)
def test_deepspeed_accepts_the_generated_config(case_id: str, deepspeed_verdicts: dict[str, Any]) -> None:
    case, v = deepspeed_verdicts[case_id]
    cfg = case["config"]
    assert v["ok"], v.get("error")
    assert v["world_size"] == case["dp"]  # the mpu was used: DeepSpeed checked the batch against the plan's dp
    assert v["train_batch_size"] == v["micro"] * v["accum"] * case["dp"] == cfg["train_batch_size"]
    zero = cfg["zero_optimization"]
    assert v["stage"] == zero["stage"]
    assert v["bf16"] == cfg["bf16"]["enabled"] and v["fp16"] == cfg["fp16"]["enabled"]
    assert v["dynamic_loss_scale"] == cfg["fp16"]["enabled"]
    assert v["reduce_bucket"] == zero["reduce_bucket_size"]
    assert v["gather_16bit"] == (zero["stage"] == 3)
    if zero["stage"] == 3:
        assert v["prefetch"] == zero["stage3_prefetch_bucket_size"]
    assert v["offload_optimizer"].endswith(str(get(zero, "offload_optimizer.device")))
    assert v["offload_param"].endswith(str(get(zero, "offload_param.device")))
    assert v["clip"] == cfg["gradient_clipping"]
    if "optimizer" in cfg:
        assert v["optimizer"] == "adamw" and v["optimizer_params"] == cfg["optimizer"]["params"]
    else:
        assert v["optimizer"] is None


@pytest.mark.deepspeed
def test_deepspeed_rejects_a_batch_that_is_off_by_one(deepspeed_verdicts: dict[str, Any]) -> None:
    case, v = deepspeed_verdicts["broken/batch"]
    assert not v["ok"]
    assert "Check batch related parameters" in v["error"]
    assert f"{case['config']['train_batch_size']} != 2 * 16 * 16" in v["error"]


@pytest.mark.deepspeed
def test_deepspeed_rejects_a_batch_counted_over_model_parallel_ranks(deepspeed_verdicts: dict[str, Any]) -> None:
    case, v = deepspeed_verdicts["broken/world-batch"]
    assert case["dp"] == 4 and case["config"]["train_batch_size"] == 2048
    assert not v["ok"] and "2048 != 1 * 64 * 4" in v["error"]


@pytest.mark.deepspeed
def test_deepspeed_rejects_a_misspelt_key_inside_a_section(deepspeed_verdicts: dict[str, Any]) -> None:
    _, v = deepspeed_verdicts["broken/zero-key"]
    assert not v["ok"] and "stage3_prefetch_bucket_sise" in v["error"]


@pytest.mark.deepspeed
def test_deepspeed_ignores_a_misspelt_top_level_key_so_we_check_it(deepspeed_verdicts: dict[str, Any]) -> None:
    case, v = deepspeed_verdicts["silent/top-level-key"]
    assert v["ok"]  # DeepSpeed itself says nothing...
    with pytest.raises(RenderError, match="gradient_clippng"):  # ...our guard does
        check_deepspeed_keys(case["config"])


@pytest.mark.deepspeed
def test_known_keys_are_keys_deepspeed_reads() -> None:
    """Every key of our known-key lists is a string literal in DeepSpeed's runtime (guards against invented keys)."""
    ds = pytest.importorskip("deepspeed")
    import ast

    literals: set[str] = set()
    for path in Path(ds.__file__).parent.rglob("*.py"):
        if "/ops/" in str(path) or "/inference/" in str(path):
            continue
        for node in ast.walk(ast.parse(path.read_text(errors="replace"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                literals.add(node.value)
    for section, keys in DEEPSPEED_KNOWN_KEYS.items():
        missing = sorted(keys - literals)
        assert not missing, f"{section or 'top level'}: {missing} never appear in DeepSpeed's source"


# ---------------------------------------------------------------------------------------------------------------
# 3. a real 2-process DeepSpeed training run on CPU, driven by a generated config
# ---------------------------------------------------------------------------------------------------------------
TRAIN = r"""
import json, os, sys
import torch
import deepspeed

runs = json.load(open(sys.argv[1]))  # [[config path, output folder], ...]: one engine after the other, one launch
deepspeed.init_distributed(dist_backend="gloo")
rank = int(os.environ["RANK"])


def train(cfg, out):
    torch.manual_seed(0)  # same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 1))
    before = [p.detach().clone().float() for p in model.parameters()]
    total = sum(p.numel() for p in model.parameters())
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    dtype = torch.bfloat16 if cfg["bf16"]["enabled"] else torch.float16 if cfg["fp16"]["enabled"] else torch.float32
    stage = cfg["zero_optimization"]["stage"]

    # what is really sharded: ZeRO-3 parameters, the ZeRO-1/2/3 fp32 optimizer partition
    partitioned_params = any(getattr(p, "ds_tensor", None) is not None and p.ds_tensor.numel() < p.ds_numel
                             for p in model.parameters())
    groups = getattr(engine.optimizer, "single_partition_of_fp32_groups", None) or \
        getattr(engine.optimizer, "fp32_partitioned_groups_flat", [])
    fp32_partition = sum(t.numel() for t in groups)

    teacher = torch.Generator().manual_seed(7)
    w_true = torch.randn(64, 1, generator=teacher)
    x_eval = torch.randn(32, 64, generator=teacher)
    y_eval = torch.tanh(x_eval @ w_true)
    data = torch.Generator().manual_seed(100 + rank)  # each rank sees different samples

    def eval_loss():
        with torch.no_grad():
            return torch.nn.functional.mse_loss(engine(x_eval.to(dtype)).float(), y_eval).item()

    first = eval_loss()
    mb, accum, steps = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], 12
    for _ in range(steps * accum):
        x = torch.randn(mb, 64, generator=data)
        loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), torch.tanh(x @ w_true))
        engine.backward(loss)
        engine.step()
    # gather before the last forward: a no-grad ZeRO-3 forward leaves prefetched parameters in flight
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        after = [p.detach().clone().float() for p in model.parameters()]
    saved_shapes = None
    if stage == 3:  # stage3_gather_16bit_weights_on_model_save: the full 16-bit model is gathered on rank 0
        engine.save_16bit_model(out, "model16.bin")
        if rank == 0:
            saved_shapes = {k: list(v.shape) for k, v in torch.load(os.path.join(out, "model16.bin")).items()}
    last = eval_loss()
    changed = sum((a - b).abs().sum().item() for a, b in zip(after, before))
    checksum = sum(a.double().sum().item() for a in after)
    report = {
        "rank": rank, "first": first, "last": last, "changed": changed, "checksum": checksum,
        "global_steps": engine.global_steps, "stage": stage, "partitioned_params": partitioned_params,
        "fp32_partition": fp32_partition, "total": total, "dtype": str(dtype),
        "saved_shapes": saved_shapes, "optimizer": type(engine.basic_optimizer).__name__,
    }
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(report, f)
    engine.destroy()  # its hooks and buffers go before the next engine starts


for cfg_path, out in runs:
    train(json.load(open(cfg_path)), out)
# a clean end, as jupyter_dist.worker's exit hook does: finish every collective and let gloo's worker threads release
# their last work before the interpreter finalises, else one may need the GIL during finalisation and abort the
# process ("terminate called without an active exception"; see Runtime._teardown in jupyter_dist/worker/_runtime.py)
from jupyter_dist.worker._runtime import _drain_gloo_groups

_drain_gloo_groups()
deepspeed.comm.destroy_process_group()
"""

REAL_RUNS = {
    # strategy, precision; ids are what shows in the test report. fp16 is not here: DeepSpeed's CPU accelerator
    # refuses it ("Type fp16 is not supported on your device") unless oneDNN has fp16 kernels (AVX512-FP16/AMX-FP16
    # CPUs); DeepSpeedConfig validates the fp16 configs above. ~20-30 s each on 2 cores once the ops are built.
    "zero1-bf16": ("zero1", "bf16-mixed"),
    "zero2-bf16": ("zero2", "bf16-mixed"),
    "zero3-bf16": ("zero3", "bf16-mixed"),
    "zero2-offload-bf16": ("zero2-offload", "bf16-mixed"),
    "zero3-offload-params-fp32": ("zero3-offload-params", "fp32"),
}


def _session_members(sid: int) -> list[int]:
    """PIDs still alive in the session we started (torchrun and its workers share it)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


@pytest.fixture(scope="module")
def deepspeed_ops(deepspeed_ops: Path | None) -> Path:
    """conftest's ops, built once per worker outside the runs' time limits; these tests skip without DeepSpeed."""
    if deepspeed_ops is None:
        pytest.skip("needs the deepspeed extra")
    return deepspeed_ops


def _real_config(run_id: str) -> dict[str, Any]:
    strategy, precision = REAL_RUNS[run_id]
    p = make_plan(strategy, precision=precision)
    cfg = render_deepspeed(p, RenderOptions(candidate=strategy, lr=1e-2, weight_decay=0.0))
    assert p.candidate(strategy).dims.dp == 2  # pure data parallel over the 2 processes
    if "offload_optimizer" not in cfg["zero_optimization"]:
        # DeepSpeed builds its optimizer from our section; torch_adam makes that torch.optim.AdamW instead of
        # FusedAdam, whose C++ build (~95 s) buys nothing on CPU. Offload runs keep the section as generated and
        # get DeepSpeedCPUAdam, the optimizer ZeRO-Offload runs on GPU machines too.
        cfg["optimizer"]["params"]["torch_adam"] = True
    check_deepspeed_keys(cfg)
    return cfg


@pytest.fixture(scope="module")
def real_runs(deepspeed_ops: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], Path]]:
    """Every config of REAL_RUNS trained in one 2-process launch, one engine after the other (a fresh model, seed and
    engine each, destroyed before the next): the ZeRO flavours share the launch's start-up (torchrun, torch and
    deepspeed imported by each rank, ~15 CPU-seconds) instead of paying it five times. Each flavour's ranks write
    their report into its own folder; the tests below read one flavour each."""
    d = tmp_path_factory.mktemp("ds-real")
    runs: dict[str, tuple[dict[str, Any], Path]] = {}
    for run_id in REAL_RUNS:
        cfg = _real_config(run_id)
        out = d / run_id
        out.mkdir()
        (out / "ds_config.json").write_text(json.dumps(cfg, indent=2))
        runs[run_id] = (cfg, out)
    (d / "runs.json").write_text(json.dumps([[str(out / "ds_config.json"), str(out)] for _, out in runs.values()]))
    (d / "train.py").write_text(TRAIN)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(d / "train.py"), str(d / "runs.json")]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=_ds_env(), cwd=d, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    limit = 120 * len(REAL_RUNS)  # each flavour took 20-45 s alone (its start-up included) under a loaded 2 cores
    try:
        log, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"no exit within {limit} s; killed its process group\n{log[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, f"the runs exited {proc.returncode} after {elapsed:.0f} s\n{log[-6000:]}"
    assert _session_members(proc.pid) == [], "worker processes outlived torchrun"
    print(f"{len(runs)} DeepSpeed runs in one launch: {elapsed:.1f} s")
    return runs


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("run_id", list(REAL_RUNS))
def test_real_two_process_deepspeed_run(run_id: str, real_runs: dict[str, tuple[dict[str, Any], Path]]) -> None:
    cfg, out = real_runs[run_id]
    assert cfg == _real_config(run_id)  # the generated config, as the launch trained it
    reports = [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for r in reports:
        assert r["global_steps"] == 12
        assert r["stage"] == cfg["zero_optimization"]["stage"]
        assert r["last"] < 0.7 * r["first"], r  # it learns
        assert r["changed"] > 0, r
        # each rank holds about half of the fp32 master weights / optimizer states (ZeRO-1/2/3)
        assert 0 < r["fp32_partition"] <= r["total"] // 2 + 64, r
        assert r["partitioned_params"] == (r["stage"] == 3), r
    if cfg["zero_optimization"]["stage"] == 3:
        assert reports[0]["saved_shapes"] == {"0.weight": [256, 64], "0.bias": [256], "2.weight": [64, 256],
                                              "2.bias": [64], "4.weight": [1, 64], "4.bias": [1]}  # fmt: skip
    assert reports[0]["checksum"] == pytest.approx(reports[1]["checksum"], rel=1e-6)  # replicas agree
    if "offload_optimizer" in cfg["zero_optimization"]:
        assert reports[0]["optimizer"] == "DeepSpeedCPUAdam"
    else:
        assert reports[0]["optimizer"] == "AdamW"
    print(f"{run_id}: eval loss {reports[0]['first']:.4f} -> {reports[0]['last']:.4f}")
