"""Pipeline parallelism with ``torch.distributed.pipelining``, alone and composed with FSDP2 and TP, proven by equal
math: losses and gathered parameters of a parallel run equal one process's on the same global batches.

Also the pure stage split (``plan/pipeline.py``) and the one-step form ``jd.train_step`` that runs under every plan:
its gradient accumulation (``JD_MICROBATCHES``) under ddp, fsdp2 and DeepSpeed ZeRO-2 equals one process taking the
whole global batch in one step, with one gradient reduction per step (counted by the runtime's comm stats).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_tensor_parallel import RTOL, SAVE_AT, STEPS, Launches, assert_equal_math, assert_resumed, run_singles

from jupyter_dist.errors import ParallelismError
from jupyter_dist.plan.pipeline import stage_bounds, stage_costs

torch = pytest.importorskip("torch")


# ------------------------------------------------------------------------------------------- the split (pure)
def test_stages_are_contiguous_cover_every_layer_and_balance_the_edges() -> None:
    assert stage_bounds(8, 2) == [(0, 4), (4, 8)]
    assert stage_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    # a head worth 3 blocks: the last stage gets fewer blocks
    bounds = stage_bounds(16, 4, last_extra=3.0)
    assert bounds[0][0] == 0 and bounds[-1][1] == 16
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert bounds[-1][1] - bounds[-1][0] < bounds[0][1] - bounds[0][0]
    costs = stage_costs(bounds, last_extra=3.0)
    assert max(costs) == 5.0  # 19 units over 4 stages: no split does better than 5
    # the even split when nothing is extra, whatever the layer count
    assert [e - s for s, e in stage_bounds(10, 4)] in ([3, 3, 2, 2], [2, 3, 3, 2], [3, 2, 2, 3], [2, 2, 3, 3],
                                                       [3, 2, 3, 2], [2, 3, 2, 3])  # fmt: skip


def test_bad_splits_get_one_line() -> None:
    with pytest.raises(ParallelismError, match="4 pipeline stages need at least 4 layers, the model has 2"):
        stage_bounds(2, 4)
    with pytest.raises(ParallelismError, match="positive integer"):
        stage_bounds(4, 0)


def test_the_schedule_order_is_pytorchs_interleaved_1f1b() -> None:
    """The planner's order of a rank's forwards and backwards under interleaved 1F1B (what its memory counts from)
    is the order PyTorch's ``ScheduleInterleaved1F1B`` computes for every rank, for 987 shapes (pp, m, virtual)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    from jupyter_dist.plan.pipeline import schedule_actions

    shapes = 0
    for pp in (2, 3, 4, 8):
        for m in range(1, 33):
            rounds = max(1, m // pp)
            if m % rounds:
                with pytest.raises(ParallelismError, match="multiple of"):
                    schedule_actions("interleaved-1f1b", pp=pp, microbatches=m, rank=0, virtual=2)
                continue
            for v in (2, 3, 4):
                torch_side = SimpleNamespace(pp_group_size=pp, n_local_stages=v, _n_microbatches=m,
                                             number_of_rounds=rounds, microbatches_per_round=m // rounds)  # fmt: skip
                for rank in range(pp):
                    ops = ScheduleInterleaved1F1B._calculate_single_rank_operations(torch_side, rank)
                    want = [("F" if a.computation_type == _ComputationType.FORWARD else "B", a.stage_index)
                            for a in ops if a is not None]  # fmt: skip
                    assert schedule_actions("interleaved-1f1b", pp=pp, microbatches=m, rank=rank, virtual=v) == want
                    shapes += 1
    assert shapes == 987


def test_the_planner_counts_what_each_schedule_holds() -> None:
    """GPipe holds all m micro-batches on every stage, 1F1B min(pp, m) on the first, interleaved 1F1B its warm-up
    plus one forward over the rank's stages; the bubble is (p-1)/m, interleaved (p-1)/(v m)."""
    from jupyter_dist.plan import Hardware, TrainingShape, plan

    hw = Hardware.from_names("h100", gpus_per_node=8)
    got = {}
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        shape = TrainingShape(grad_accum=8, pp_schedule=schedule)
        c = plan("llama-3-8b", hw, shape, strategy="fsdp2", pp=4).candidate("fsdp2+pp4")
        got[schedule] = c
    detail = {k: (c.memory.detail["activations_in_flight"], c.memory.detail["activations_blocks_in_flight"])
              for k, c in got.items()}  # fmt: skip
    from jupyter_dist.plan.memory import pipeline_blocks
    from jupyter_dist.plan.planner import resolve_model

    four, eight = pipeline_blocks(resolve_model("llama-3-8b"), 4), pipeline_blocks(resolve_model("llama-3-8b"), 8)
    # interleaved (rank 0 holds stages 0 and 4 of 8, of 5 and 4 blocks): rounds of 4 micro-batches, a warm-up of
    # (2 - 1) x 4 + 2 x 3 = 10 forwards (4 on stage 0, 4 on stage 4, 2 on stage 0), then forward-backward pairs hold
    # 11; the most blocks once stage 0 holds all 8 micro-batches and stage 4 three
    assert eight[0] != eight[4]
    assert detail == {"gpipe": (8, 8 * four[0]), "1f1b": (4, 4 * four[0]),
                      "interleaved-1f1b": (11, 8 * eight[0] + 3 * eight[4])}  # fmt: skip
    acts = {k: c.memory.activations for k, c in got.items()}
    assert acts["1f1b"] < acts["interleaved-1f1b"] < acts["gpipe"]
    # the bubble idles the forward and backward work; the optimizer step runs once after it
    bubble = {k: c.time.breakdown["pp_bubble"] / (c.time.compute_s - c.time.breakdown.get("optimizer", 0.0))
              for k, c in got.items()}  # fmt: skip
    assert bubble["gpipe"] == pytest.approx(3 / 8) and bubble["1f1b"] == pytest.approx(3 / 8)
    assert bubble["interleaved-1f1b"] == pytest.approx(3 / 16)
    with pytest.raises(ParallelismError, match="stages per rank"):
        plan("gpt2", hw, TrainingShape(pp_schedule="interleaved-1f1b", pp_virtual=4), pp=4)


# ----------------------------------------------------------------------------------------- equal math (slow)
CONFIGS = {
    # name: (processes, JD_* degrees); EQ_MEASURE: each rank also writes the bytes it holds and, on the first
    # pipeline rank, the micro-batches in flight (test_memory_and_in_flight_equal_the_plan_per_schedule)
    "pp2-gpipe": (2, {"JD_PP": "2", "JD_PP_SCHEDULE": "gpipe", "JD_MICROBATCHES": "4", "EQ_MEASURE": "1"}),
    "pp2-1f1b": (2, {"JD_PP": "2", "JD_PP_SCHEDULE": "1f1b", "JD_MICROBATCHES": "4", "EQ_MEASURE": "1"}),
    "pp2-interleaved": (
        2,
        {"JD_PP": "2", "JD_PP_SCHEDULE": "interleaved-1f1b", "JD_MICROBATCHES": "4", "EQ_MEASURE": "1"},
    ),
    "pp2xdp2": (4, {"JD_PP": "2", "JD_MICROBATCHES": "2"}),
    "tp2xpp2-sp": (4, {"JD_PP": "2", "JD_TP": "2", "JD_SP": "1", "JD_MICROBATCHES": "4", "EQ_MEASURE": "1"}),
    "dp2xtp2xpp2-sp-ac": (8, {"JD_PP": "2", "JD_TP": "2", "JD_SP": "1", "JD_AC": "full", "JD_MICROBATCHES": "2"}),
}
EXPECTED_MESH = {
    "pp2-gpipe": "pp=2 x dp_shard=1", "pp2-1f1b": "pp=2 x dp_shard=1", "pp2-interleaved": "pp=2 x dp_shard=1",
    "pp2xdp2": "pp=2 x dp_shard=2", "tp2xpp2-sp": "pp=2 x dp_shard=1 x tp=2",
    "dp2xtp2xpp2-sp-ac": "pp=2 x dp_shard=2 x tp=2",
}  # fmt: skip


@pytest.fixture(scope="module")
def singles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every one-process reference of this module (the reference model and the Hugging Face Llama and Mixtral, 4
    layers, SGD), trained in one process."""
    refs = {"ref": ("ref", {"EQ_OPT": "sgd", "EQ_LAYERS": "4"})}
    refs.update({m: (m, {"EQ_OPT": "sgd", "EQ_LAYERS": "4"}) for m in ("llama", "mixtral")})
    return run_singles(tmp_path_factory.mktemp("singles"), refs)


@pytest.fixture(scope="module")
def single4(singles: dict[str, dict]) -> dict[str, dict]:
    return {"sgd": singles["ref"]}


CKPT_RESUMES = {"dp4": {}, "tp2xpp2": {"JD_PP": "2", "JD_TP": "2", "JD_MICROBATCHES": "4"}}
ZERO1 = {"JD_STRATEGY": "zero1", "JD_TP": "2", "JD_PP": "2", "JD_CP": "1", "JD_EP": "1", "JD_SP": "1",
         "JD_DP_REPLICATE": "1"}  # fmt: skip
"""What ``--strategy zero1+tp2+pp2+sp`` on 8 processes sets (checked against ``resolve_launch`` in its test)."""


ACCUM = {
    # jd.train_step, 4 micro-batches per step on each of 2 ranks: name -> (JD_STRATEGY, the gradient reduction and how
    # many of them one step issues); one per DDP bucket (the model's gradients fit one), one per FSDP2 group (4 blocks
    # and the root). Without no_sync / set_requires_gradient_sync each micro-batch would reduce: 4 times as many.
    "ddp-accum4": ("ddp", "all_reduce (DDP buckets)", 1),
    "fsdp2-accum4": ("fsdp2", "reduce_scatter_single", 5),
}


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    """Every equal-math run of this module: one launch each of 2, 4 and 8 processes."""
    import importlib.util
    import json

    where = tmp_path_factory.mktemp("launches")
    base = {"JD_STRATEGY": "fsdp2", "EQ_OPT": "sgd", "EQ_LAYERS": "4"}
    configs: dict[str, tuple[int, str, dict[str, str]]] = {
        name: (nproc, "ref", {**base, **degrees}) for name, (nproc, degrees) in CONFIGS.items()
    }
    configs["memory"] = (4, "ref", {"JD_STRATEGY": "fsdp2", "JD_PP": "2", "JD_MICROBATCHES": "4",
                                    "JD_PP_SCHEDULE": "1f1b", "EQ_OPT": "adamw", "EQ_MEASURE": "1", "EQ_STEPS": "2",
                                    "EQ_LAYERS": "4"})  # fmt: skip
    configs["zero1"] = (8, "ref", {"EQ_OPT": "sgd", "EQ_LAYERS": "4", "EQ_MEASURE": "1", "JD_MICROBATCHES": "4",
                                   **ZERO1})  # fmt: skip
    common = {"JD_STRATEGY": "fsdp2", "EQ_OPT": "adamw", "EQ_CKPT": str(where / "ckpt"), "EQ_LAYERS": "4"}
    configs["ckpt-full"] = (4, "ref", {"JD_PP": "2", "JD_MICROBATCHES": "2", "EQ_SAVE_AT": str(SAVE_AT), **common})
    for name, degrees in CKPT_RESUMES.items():  # after the save, in the same launch
        configs[f"ckpt-{name}"] = (4, "ref", {"EQ_RESUME": "1", **degrees, **common})
    hf = {"JD_STRATEGY": "fsdp2", "EQ_OPT": "sgd", "EQ_LAYERS": "4", "EQ_CKPT": str(where / "hf-ckpt")}
    for name, (nproc, model, degrees) in HF_CONFIGS.items():  # in the same launches (the save before its resume)
        configs[name] = (nproc, model, {**hf, **degrees})
    for name, (strategy, _, _) in ACCUM.items():  # the runtime counts collectives where it has a run directory
        accum = {**base, "JD_STRATEGY": strategy, "JD_MICROBATCHES": "4", "EQ_STEP_FORM": "1", "EQ_COUNT_COMM": "1"}
        configs[name] = (2, "ref", {**accum, "JD_RUN_DIR": str(where / f"run-{name}")})
        configs[f"{name}-sync-every"] = (2, "ref", {**accum, "JD_RUN_DIR": str(where / f"run-{name}-sync-every"),
                                                    "EQ_SYNC_EVERY_MICROBATCH": "1", "EQ_STEPS": "2"})  # fmt: skip
    (where / "pp_errors.py").write_text(SCRIPT_ERRORS)  # run whole, in a fresh runtime
    configs["pp-errors"] = (2, "ref", {"JD_STRATEGY": "fsdp2", "JD_PP": "2", "JD_MICROBATCHES": "2",
                                       "EQ_SCRIPT": str(where / "pp_errors.py")})  # fmt: skip
    if importlib.util.find_spec("deepspeed") is not None:  # last: DeepSpeed's import patches torch for the process
        from test_every_strategy import EXTENSIONS, ds_config

        # what %%dist_train writes for zero2 (clipping off): 4 micro-batches of 1 sample on each rank
        (where / "ds_config.json").write_text(json.dumps(ds_config("zero2", accum=4, per_rank=4)))
        configs["zero2-accum4"] = (2, "ref", {**base, "JD_STRATEGY": "zero2", "EQ_STEP_FORM": "1",
                                              "JD_DS_CONFIG": str(where / "ds_config.json"), "DS_ACCELERATOR": "cpu",
                                              "TORCH_EXTENSIONS_DIR": str(EXTENSIONS)})  # fmt: skip
    return Launches(where, configs)


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
def test_pipelined_run_equals_single_process(config: str, single4: dict, launches: Launches) -> None:
    got = launches[config]
    assert got["mesh"] == EXPECTED_MESH[config]
    assert_equal_math(single4["sgd"], got)


@pytest.mark.slow
def test_checkpoint_saved_under_pp2_dp2_resumes_without_pipeline_and_under_tp2_pp2(launches: Launches) -> None:
    """DCP checkpoints of a pipelined model keep the whole model's names: saved at step 2 under pp2 x dp2, resumed
    under dp4 and under tp2 x pp2, the next 2 losses equal the uninterrupted run's."""
    full = launches["ckpt-full"]
    for name in CKPT_RESUMES:
        assert_resumed(full, launches[f"ckpt-{name}"], name)


# ------------------------------------------------------------------------- Hugging Face causal LMs (slow)
HF_CONFIGS = {
    # name: (processes, model, JD_* degrees); real transformers models built from small configs (4 layers, fp32)
    "hf-pp2-1f1b": (2, "llama", {"JD_PP": "2", "JD_PP_SCHEDULE": "1f1b", "JD_MICROBATCHES": "4"}),
    "hf-mixtral-pp2-gpipe": (2, "mixtral", {"JD_PP": "2", "JD_PP_SCHEDULE": "gpipe", "JD_MICROBATCHES": "4"}),
    "hf-pp2xdp2": (4, "llama", {"JD_PP": "2", "JD_MICROBATCHES": "2", "EQ_SAVE_AT": str(SAVE_AT)}),
    # 4 stages of one block: each splits its input along the sequence and gathers its output for the next stage
    "hf-tp2xpp2-sp-interleaved": (4, "llama", {"JD_PP": "2", "JD_TP": "2", "JD_SP": "1", "JD_MICROBATCHES": "4",
                                               "JD_PP_SCHEDULE": "interleaved-1f1b", "JD_PP_VIRTUAL": "2"}),
    "hf-resume-dp4": (4, "llama", {"EQ_RESUME": "1"}),  # from hf-pp2xdp2's checkpoint at step 2
}  # fmt: skip
HF_MESH = {"hf-pp2-1f1b": "pp=2 x dp_shard=1", "hf-mixtral-pp2-gpipe": "pp=2 x dp_shard=1",
           "hf-pp2xdp2": "pp=2 x dp_shard=2", "hf-tp2xpp2-sp-interleaved": "pp=2 x dp_shard=1 x tp=2"}  # fmt: skip


@pytest.fixture(scope="module")
def single_hf(singles: dict[str, dict]) -> dict[str, dict]:
    return {m: singles[m] for m in ("llama", "mixtral")}


@pytest.mark.slow
@pytest.mark.parametrize("config", list(HF_MESH))
def test_pipelined_hugging_face_model_equals_single_process(config: str, single_hf: dict, launches: Launches) -> None:
    """A real ``LlamaForCausalLM`` (and ``MixtralForCausalLM``) cut into stages at decoder-layer boundaries: the
    first stage embeds, the others take hidden states as ``inputs_embeds``, only the last applies the final norm and
    head; rotary angles and the causal mask come from each stage's own forward. Losses and gathered parameters (named
    as in the whole model) equal one process under pp2 (1F1B, GPipe), pp2 x dp2 and tp2 x pp2 + sp interleaved."""
    got = launches[config]
    assert got["mesh"] == HF_MESH[config]
    assert_equal_math(single_hf[HF_CONFIGS[config][1]], got)


@pytest.mark.slow
def test_hugging_face_checkpoint_saved_under_pp2_dp2_resumes_under_dp4(launches: Launches) -> None:
    """The stages keep the whole model's names (``model.layers.2...``): a DCP checkpoint saved at step 2 under pp2 x
    dp2 resumes into the unsplit Hugging Face model under dp4, and the next 2 losses equal the uninterrupted run's."""
    full, resumed = launches["hf-pp2xdp2"], launches["hf-resume-dp4"]
    assert resumed["mesh"] == "dp_shard=4"
    assert_resumed(full, resumed, "dp4")


def _hf(kind: str, layers: int = 4, **extra: object) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(kind, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, attn_implementation="sdpa",
                               **{"tie_word_embeddings": False, **extra})  # fmt: skip
    return AutoModelForCausalLM.from_config(cfg)


HF_KINDS = {"llama": {}, "mistral": {}, "qwen2": {"use_sliding_window": True, "sliding_window": 4,
                                                  "max_window_layers": 2},
            "qwen3": {}, "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
            "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2},
            "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2}}  # fmt: skip


@pytest.mark.parametrize("kind", list(HF_KINDS))
def test_hugging_face_stages_chained_give_the_whole_models_logits(kind: str) -> None:
    """No processes: every family the pipeline takes, split over 2 ranks and over 2 x 2 virtual stages; each rank
    keeps only its layers (under the whole model's names) and its stages, run one after the other, give the whole
    model's logits exactly (Qwen2 with sliding-window layers on the second stage only: per-stage layer types)."""
    import copy

    pytest.importorskip("transformers")
    from jupyter_dist.worker._pipeline import prune

    torch.manual_seed(0)
    whole = _hf(kind, **HF_KINDS[kind])
    names = {n for n, _ in whole.named_parameters()}
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        want = whole(tokens).logits
        for virtual in (1, 2):
            views, kept = {}, set()
            for rank in range(2):
                part = copy.deepcopy(whole)
                stages = prune(part, pp=2, pp_rank=rank, virtual=virtual)
                kept |= {n for n, _ in part.named_parameters()}
                views.update(stages.views(part))
            assert kept == names
            h = tokens
            for i in range(2 * virtual):
                h = views[i](h)
            assert torch.equal(h, want), (kind, virtual)


def test_hugging_face_models_the_pipeline_cannot_run_get_one_line() -> None:
    pytest.importorskip("transformers")
    from jupyter_dist.worker import WorkerError
    from jupyter_dist.worker._pipeline import prune

    with pytest.raises(WorkerError, match=r"LlamaForCausalLM ties them \(one tensor\); build it with tie_word_emb"):
        prune(_hf("llama", tie_word_embeddings=True), pp=2, pp_rank=0, virtual=1)
    with pytest.raises(
        WorkerError,
        match=r"or a Hugging Face decoder-only causal LM \(llama, mistral, .*\); "
        r"Gemma2ForCausalLM is a Hugging Face model of type 'gemma2', not proven",
    ):
        prune(_hf("gemma2"), pp=2, pp_rank=0, virtual=1)


@pytest.mark.slow
@pytest.mark.parametrize("config", list(ACCUM))
def test_train_step_accumulation_equals_one_big_step_with_one_reduction(
    config: str, single4: dict, launches: Launches
) -> None:
    """``jd.train_step`` over 4 micro-batches per rank (``JD_MICROBATCHES=4``, 2 ranks) equals one process taking the
    global batch of 8 in one step (losses of 5 steps, parameters element-wise, 1e-5), and each step reduces the
    gradients once (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync``): the comm stats count one bucket
    all-reduce (DDP) or one reduce-scatter per FSDP2 group, not one per micro-batch. The count can fail: with those
    two made no-ops (the math unchanged), every micro-batch reduces, 4 times as often."""
    strategy, op, per_step = ACCUM[config]
    got = launches[config]
    assert got["mesh"] == ("dp_shard=2" if strategy == "fsdp2" else "None")
    assert_equal_math(single4["sgd"], got)
    assert [c.get(op) for c in got["comm"]] == [per_step] * STEPS, got["comm"]
    every = launches[f"{config}-sync-every"]
    assert [c.get(op) for c in every["comm"]] == [4 * per_step] * 2, every["comm"]
    torch.testing.assert_close(torch.tensor(every["losses"]), torch.tensor(got["losses"][:2]), rtol=RTOL, atol=0)


@pytest.mark.slow
@pytest.mark.deepspeed
def test_train_step_under_deepspeed_accumulation_equals_one_big_step(single4: dict, launches: Launches) -> None:
    """DeepSpeed ZeRO-2 with ``gradient_accumulation_steps=4`` (the config ``%%dist_train`` writes) through
    ``jd.train_step``: the engine takes the 4 micro-batches (``4 * STEPS`` micro-steps, ``STEPS`` optimizer steps)
    and the run equals one process taking the global batch in one step (losses and parameters, 1e-5)."""
    pytest.importorskip("deepspeed")
    got = launches["zero2-accum4"]
    assert got["engine_steps"] == [STEPS, 4 * STEPS]
    assert_equal_math(single4["sgd"], got)


SCRIPT_ERRORS = """
import torch
import jupyter_dist.worker as jd
from jupyter_dist.models import Transformer
from jupyter_dist.worker import WorkerError

model, opt = jd.wrap(Transformer(vocab_size=64, dim=32, n_layers=4, n_heads=2))
try:
    model(torch.zeros(2, 4, dtype=torch.long))
except WorkerError as e:
    print("CASE call:", e, flush=True)
try:
    jd.train_step(torch.zeros(3, 4, dtype=torch.long), torch.zeros(3, 4, dtype=torch.long), lambda o, y: o.sum())
except WorkerError as e:
    print("CASE batch:", e, flush=True)
"""


@pytest.mark.slow
def test_a_pipelined_model_refuses_direct_calls_and_odd_batches(launches: Launches) -> None:
    """``SCRIPT_ERRORS`` under pp2, run whole in the 2-process launch (before DeepSpeed's configuration)."""
    assert launches["pp-errors"] == {"script": str(launches.where / "pp_errors.py")}
    out = launches.stdout[2]
    assert "CASE call: under pipeline parallelism (pp2) the model runs stage by stage" in out, out[-4000:]
    assert "use loss = jd.train_step(inputs, targets, loss_fn)" in out
    assert "CASE batch: jd.train_step: a batch of 3 does not split into 2 micro-batches" in out, out[-4000:]


@pytest.mark.slow
def test_zero1_tp2_pp2_sp_runs_as_fsdp2_without_resharding_equal_to_one_process_and_the_plan(
    single4: dict, launches: Launches
) -> None:
    """The 3-D notebook's fastest shape (zero1+tp8+pp32+sp for Llama-3.1-405B) scaled down: ``zero1+tp2+pp2+sp``
    on 8 processes runs as FSDP2 with ``reshard_after_forward=False`` over dp (announced once, on rank 0), equals one
    process, and each rank's parameters, gradients and SGD momentum equal the plan's figures for that candidate (the
    worst stage to the byte: sharded over dp, not whole as DeepSpeed's ZeRO-1 would keep parameters and gradients)."""
    import json

    from jupyter_dist.models import Transformer
    from jupyter_dist.plan import Hardware, ModelSpec, TrainingShape, get_accelerator, plan
    from jupyter_dist.plan.candidates import resolve_launch

    choice = resolve_launch("zero1+tp2+pp2+sp", None, 8)
    env = {f"JD_{k.upper()}": str(int(v) if isinstance(v, bool) else v) for k, v in choice.worker_fields().items()}
    assert env == ZERO1
    got = launches["zero1"]
    assert launches.stdout[8].count("zero1 with model parallelism runs as FSDP2 with reshard_after_forward=False") == 1
    assert got["mesh"] == "pp=2 x dp_shard=2 x tp=2"
    assert_equal_math(single4["sgd"], got)
    spec = ModelSpec.from_module(Transformer, vocab_size=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2)
    shape = TrainingShape(micro_batch=1, seq_len=16, precision="fp32", grad_accum=4, optimizer="sgd")
    p = plan(spec, Hardware(accelerator=get_accelerator("cpu"), gpus_per_node=8), shape, strategy="zero1", tp=2, pp=2)
    cand = p.candidate("zero1+tp2+pp2+sp")
    want = {"params": cand.memory.params, "grads": cand.memory.grads, "optimizer": cand.memory.optimizer}
    ranks = [json.loads(Path(f"{launches.path('zero1')}.rank{r}.json").read_text()) for r in range(8)]
    worst = max(ranks, key=lambda g: g["params"])
    assert {k: worst[k] for k in want} == want, (ranks, want)
    assert cand.memory.detail["gathered_params"] > 0  # the parameters kept from forward to backward are counted


# ---------------------------------------------------------------------------------- one cell, every plan (slow)
STEP_CELL = """
import torch
import torch.nn as nn

from jupyter_dist.models import MoETransformer

VOCAB, SEQ, BATCH = 64, 16, 8
torch.manual_seed(0)
net = MoETransformer(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_experts=4, top_k=2, ffn_dim=32)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # next-token cross-entropy plus the experts' load-balancing loss (net itself: DDP's wrapper hides aux_loss)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)) + 0.01 * net.aux_loss()


opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
model, opt = jd.wrap(net, opt)
for step in range(STEPS):
    g = torch.Generator().manual_seed(step * jd.dp_size + jd.dp_rank)
    tokens = ((torch.randint(0, VOCAB, (BATCH, 1), generator=g) + torch.arange(SEQ + 1)) % VOCAB).to(jd.device)
    loss = jd.train_step(tokens[:, :-1], tokens[:, 1:], loss_fn)
    jd.log(step, loss=loss, tokens=BATCH * SEQ)
if jd.is_main:
    print(f"final loss {loss.item():.3f} mesh {jd.mesh and jd.mesh.describe()}")
"""
"""The recommended loop on the mixture-of-experts reference (a model every plan can run), with its balance loss."""
STEP_PLANS = {  # --strategy: the mesh rank 0 reports (None: no device mesh)
    "ddp": "None", "fsdp2": "dp_shard=2", "zero2": "None", "fsdp2+tp2+sp": "dp_shard=1 x tp=2",
    "fsdp2+pp2": "pp=2 x dp_shard=1", "fsdp2+ep2": "dp_shard=2 (experts: efsdp=1 x ep=2)",
}  # fmt: skip


STEP_DRIVER = """
import json, os
from jupyter_dist.worker._runtime import fresh_runtime

# Each plan's ranks run the cell in turn, with the JD_* variables its own %%dist_train gives them (its --dry-run),
# in a fresh runtime (the next jd.wrap builds that plan's mesh) and without the run's directory; rank 0 prints the
# plan's losses after the cell's own output. DeepSpeed last: its import patches torch for the process.
PLANS, CELL = json.loads(PLANS_JSON), CELL_TEXT
real_log = jd.log
for strategy, env in PLANS.items():
    for key in {k for e in PLANS.values() for k in e} | {"JD_RUN_DIR"}:
        os.environ.pop(key, None)
    os.environ.update(env)
    fresh_runtime()
    losses = []

    def log(step, loss=None, **metrics):
        losses.append(float(loss))
        return real_log(step, loss=loss, **metrics)

    jd.log = log
    if jd.is_main:
        print("PLAN", strategy, flush=True)
    exec(compile(CELL, f"<cell under {strategy}>", "exec"), {"__name__": "__main__", "jd": jd})
    if jd.is_main:
        print("LOSSES", strategy, json.dumps(losses), flush=True)
    jd.barrier()
jd.log = real_log
"""


@pytest.mark.slow
def test_the_step_form_cell_runs_unchanged_under_every_plan(ip, runs: Path) -> None:  # noqa: ANN001
    """One cell, unchanged, through ``jd.train_step`` under ddp, fsdp2, DeepSpeed ZeRO-2, tensor (tp2+sp), pipeline
    (pp2: the stages carry the balance loss) and expert parallelism (ep2): on every rank it exits 0, the loss falls,
    and the run used the plan's mesh. (Equal math for each lives in the parallelism tests.)

    One launch: each plan's ``%%dist_train --dry-run`` gives the ``JD_*`` variables (and DeepSpeed config) its launch
    would give the ranks, and one real ``%%dist_train`` launch of 2 processes runs the cell under each in turn, each
    from a fresh runtime (as the equal-math launches train their configurations), instead of six launches."""
    pytest.importorskip("deepspeed")
    import json

    from conftest import descendants_gone

    cell = "STEPS = 16\n" + STEP_CELL
    plans: dict[str, dict[str, str]] = {}
    for i, strategy in enumerate(sorted(STEP_PLANS, key=lambda s: s.startswith("zero"))):  # DeepSpeed last
        dry = ip.run_cell_magic("dist_train", f"--strategy {strategy} --nproc 2 --no-dashboard --dry-run", cell)
        env = {k: v for k, v in dry.env.items() if k.startswith("JD_") and k not in ("JD_RUN_DIR", "JD_PATH")}
        assert env["JD_STRATEGY"] == strategy.split("+")[0], (strategy, env)
        for name, text in dry.files.items():  # DeepSpeed's config, written where the ranks can read it
            (runs / f"{i}-{name}").write_text(text)
            env = {k: str(runs / f"{i}-{v}") if v == name else v for k, v in env.items()}
        plans[strategy] = env
    assert list(plans)[-1] == "zero2" and "JD_DS_CONFIG" in plans["zero2"]
    driver = f"PLANS_JSON = {json.dumps(plans)!r}\nCELL_TEXT = {cell!r}\n" + STEP_DRIVER
    run = ip.run_cell_magic("dist_train", "--strategy ddp --nproc 2 --name every_plan --timeout 600 --no-dashboard",
                            driver)  # fmt: skip
    assert run.wait(600) == "succeeded", run.logs()
    assert run.exit_codes == {0: 0, 1: 0}
    out = run.logs(0)
    parts = out.split("PLAN ")[1:]
    assert [p.split()[0] for p in parts] == list(plans), out[-3000:]
    for strategy, mesh in STEP_PLANS.items():
        part = next(p for p in parts if p.split()[0] == strategy)
        assert f"mesh {mesh}" in part, (strategy, part[-2000:])
        losses = json.loads(part.split(f"LOSSES {strategy} ")[1].splitlines()[0])
        assert len(losses) == 16 and losses[-1] < losses[0], (strategy, losses)
    assert descendants_gone(run)


@pytest.mark.slow
def test_per_stage_memory_and_micro_batches_in_flight_equal_the_plan(launches: Launches) -> None:
    """Under pp2 x dp2 with 1F1B over 4 micro-batches: the worst stage's parameters, gradients and AdamW states equal
    the planner's per-GPU figures to the byte (the other stage holds less), and the first stage holds the planned
    number of micro-batches in flight (min(pp, micro-batches) = 2; counted from forwards whose backward has not run)."""
    import json

    from jupyter_dist.models import Transformer
    from jupyter_dist.plan import Hardware, ModelSpec, TrainingShape, get_accelerator, plan

    launches["memory"]
    spec = ModelSpec.from_module(Transformer, vocab_size=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2)
    shape = TrainingShape(micro_batch=1, seq_len=16, precision="fp32", grad_accum=4)
    p = plan(spec, Hardware(accelerator=get_accelerator("cpu"), gpus_per_node=4), shape, strategy="fsdp2", pp=2)
    cand = p.candidate("fsdp2+pp2")
    want = {"params": cand.memory.params, "grads": cand.memory.grads, "optimizer": cand.memory.optimizer}
    got = [json.loads(Path(f"{launches.path('memory')}.rank{r}.json").read_text()) for r in range(4)]
    worst = max(got, key=lambda g: g["params"])
    assert {k: worst[k] for k in want} == want, (got, want)
    assert all(g[k] <= want[k] for g in got for k in want)
    first_stage = [g["in_flight"] for g in got if g["in_flight"]]  # ranks 0 and 1 (dp2) run stage 0
    assert first_stage == [cand.memory.detail["activations_in_flight"]] * 2 == [2, 2]


MEASURED_SCHEDULES = {  # config: (candidate, tp, schedule, first rank's forwards held, their blocks)
    "pp2-gpipe": ("fsdp2+pp2", None, "gpipe", 4, 8),  # all 4 forwards before any backward, 2 blocks each
    "pp2-1f1b": ("fsdp2+pp2", None, "1f1b", 2, 4),  # warm-up of pp = 2 forwards, then one backward per forward
    # 2 stages of 1 block per rank: warm-up (2 - 1) x 2 + 2 x (2 - 1) = 4 forwards, plus the first steady forward
    "pp2-interleaved": ("fsdp2+pp2", None, "interleaved-1f1b", 5, 5),
    "tp2xpp2-sp": ("fsdp2+tp2+pp2+sp", 2, "1f1b", 2, 4),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("config", list(MEASURED_SCHEDULES))
def test_memory_and_in_flight_equal_the_plan_per_schedule(config: str, launches: Launches) -> None:
    """Under GPipe, 1F1B and interleaved 1F1B (and tp2 x pp2 + sp), 4 micro-batches: the worst pipeline rank's
    parameters, gradients and SGD momentum equal the plan's per-GPU figures to the byte, and the first rank holds
    the forwards (and blocks) the plan counts for that schedule at once (hooks on each of its stages)."""
    import json

    from jupyter_dist.models import Transformer
    from jupyter_dist.plan import Hardware, ModelSpec, TrainingShape, get_accelerator, plan

    name, tp, schedule, forwards, blocks = MEASURED_SCHEDULES[config]
    nproc = CONFIGS[config][0]
    launches[config]
    spec = ModelSpec.from_module(Transformer, vocab_size=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2)
    shape = TrainingShape(micro_batch=8 // 4, seq_len=16, precision="fp32", grad_accum=4, optimizer="sgd",
                          pp_schedule=schedule)  # fmt: skip
    p = plan(spec, Hardware(accelerator=get_accelerator("cpu"), gpus_per_node=nproc), shape, strategy="fsdp2", pp=2,
             tp=tp)  # fmt: skip
    cand = p.candidate(name)
    want = {"params": cand.memory.params, "grads": cand.memory.grads, "optimizer": cand.memory.optimizer}
    got = [json.loads(Path(f"{launches.path(config)}.rank{r}.json").read_text()) for r in range(nproc)]
    worst = max(got, key=lambda g: g["params"])
    assert {k: worst[k] for k in want} == want, (got, want)
    planned = (cand.memory.detail["activations_in_flight"], cand.memory.detail["activations_blocks_in_flight"])
    assert planned == (forwards, blocks)
    first = [(g["in_flight"], g["in_flight_blocks"]) for g in got if g["in_flight"]]  # the first pp rank's tp ranks
    assert first == [planned] * (tp or 1), (first, planned)
