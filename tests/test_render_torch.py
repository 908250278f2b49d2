"""The generated training scripts: every flavour renders, compiles and passes ruff; its numbers are the plan's
(read back from the script's syntax tree); the DDP, FSDP, FSDP2 and DeepSpeed scripts train for real on two CPU
processes (gloo), write a checkpoint and resume from it."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from jupyter_dist.plan.hardware import Hardware
from jupyter_dist.plan.plan import Plan
from jupyter_dist.plan.planner import plan as make_plan
from jupyter_dist.plan.training import Checkpointing, Precision, TrainingShape
from jupyter_dist.render.commands import Command, deepspeed_command, torchrun_command
from jupyter_dist.render.common import RenderError, RenderOptions, layout_of
from jupyter_dist.render.skypilot import render_skypilot_task
from jupyter_dist.render.slurm import render_sbatch
from jupyter_dist.render.torch_code import FSDP1_SHARDING, render_train_script

ROOT = Path(__file__).resolve().parents[1]

# (candidate, nodes, gpus per node): hybrid strategies need two nodes to exist, with 2 GPUs each to shard over
CANDIDATES = [
    ("ddp", 1, 4), ("fsdp-no-shard", 1, 4), ("fsdp-shard-grad-op", 1, 4), ("fsdp-full-shard", 1, 4),
    ("fsdp-hybrid-shard", 2, 2), ("fsdp2", 1, 4), ("fsdp2-hybrid", 2, 2), ("zero1", 1, 4), ("zero2", 1, 4),
    ("zero3", 1, 4), ("zero2-offload", 1, 4), ("zero3-offload-params", 1, 4),
    # tensor parallelism with FSDP2: tp2 inside a node of 4 (dp 2), and HSDP on 2 nodes (mesh 2 x 2 x 2)
    ("fsdp2+tp2", 1, 4), ("fsdp2+tp2+sp", 1, 4), ("fsdp2-hybrid+tp2", 2, 4), ("fsdp2-hybrid+tp2+sp", 2, 4),
    # pipeline parallelism with FSDP2, alone, with tp(+sp), and HSDP x tp x pp on 2 nodes (mesh 2 x 2 x 1 x 2 ... )
    ("fsdp2+pp2", 1, 4), ("fsdp2+tp2+pp2", 1, 8), ("fsdp2+tp2+pp2+sp", 1, 8), ("fsdp2-hybrid+tp2+pp2+sp", 2, 4),
    # context parallelism: alone, with HSDP, tp, a pipeline; expert parallelism (a MoE plan): alone, with a pipeline,
    # tp, cp and HSDP; zero1 with any of them runs as FSDP2 keeping the gathered parameters (no DeepSpeed)
    ("fsdp2+cp2", 1, 4), ("fsdp2-hybrid+cp2", 2, 2), ("fsdp2+tp2+cp2+sp", 1, 8), ("fsdp2+pp2+cp2", 1, 4),
    ("fsdp2+ep2", 1, 4), ("fsdp2+pp2+ep2", 1, 4), ("fsdp2+tp2+ep2+sp", 1, 4), ("fsdp2+cp2+ep2", 1, 4),
    ("fsdp2-hybrid+pp2+ep2", 2, 4), ("zero1+tp2+sp", 1, 4), ("zero1+pp2", 1, 4), ("zero1+cp2", 1, 4),
    ("zero1+pp2+ep2", 1, 4),
]  # fmt: skip
MATRIX = [
    (cand, nodes, gpus, precision, ckpt)
    for cand, nodes, gpus in CANDIDATES
    for precision in Precision
    if precision is not Precision.FP8  # the generated train.py refuses fp8 (test_fp8_plan.py)
    for ckpt in Checkpointing
]


@cache
def _plan(
    nodes: int = 1,
    gpus: int = 4,
    *,
    micro_batch: int = 3,
    grad_accum: int = 5,
    seq_len: int = 96,
    precision: str = "bf16-mixed",
    checkpointing: str = "none",
    optimizer: str = "adamw",
    model: str = "gpt2",
    **dims: int,
) -> Plan:
    hw = Hardware.from_names("h100-80gb", gpus_per_node=gpus, nodes=nodes)
    shape = TrainingShape(micro_batch=micro_batch, grad_accum=grad_accum, seq_len=seq_len, precision=precision,
                          checkpointing=checkpointing, optimizer=optimizer)  # fmt: skip
    return make_plan(model, hw, shape, **dims)


def _dims(cand: str) -> dict[str, Any]:
    """The planner arguments that make ``cand`` a candidate (``tp``, ``sp``, ``pp``, ``cp``, ``ep``; with ep a
    mixture-of-experts model) from its name."""
    out: dict[str, Any] = {}
    if m := re.search(r"\+tp(\d+)", cand):
        out.update(tp=int(m.group(1)), sp=cand.endswith("+sp"))
    for dim in ("pp", "cp", "ep"):
        if m := re.search(rf"\+{dim}(\d+)", cand):
            out[dim] = int(m.group(1))
    if "ep" in out:
        out["model"] = "mixtral-8x7b"
    return out


def _with_settings(plan: Plan, name: str, **settings: Any) -> Plan:
    """The plan with one candidate's compiler settings changed (so a test sees them travel into the code)."""
    cands = tuple(
        dataclasses.replace(c, settings={**c.settings, **settings}) if c.name == name else c for c in plan.candidates
    )
    return dataclasses.replace(plan, candidates=cands)


# ---------------------------------------------------------------------------------------------------------------
# Reading a generated script back
# ---------------------------------------------------------------------------------------------------------------
class Script:
    """The syntax tree of a generated script, with its module-level constants resolved."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.tree = ast.parse(source)
        self.constants: dict[str, Any] = {}
        for node in self.tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                try:
                    self.constants[node.targets[0].id] = ast.literal_eval(node.value)
                except ValueError:
                    pass

    def value(self, node: ast.expr) -> Any:
        """A literal, or a module-level constant's value."""
        if isinstance(node, ast.Name):
            return self.constants[node.id]
        return ast.literal_eval(node)

    def calls(self, name: str) -> list[ast.Call]:
        """Calls of ``name`` or ``<anything>.name``."""
        out = []
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if called == name:
                    out.append(node)
        return out

    def keyword(self, call: ast.Call, name: str) -> ast.expr:
        for kw in call.keywords:
            if kw.arg == name:
                return kw.value
        raise AssertionError(f"{ast.unparse(call)} has no keyword {name}")

    def flag_default(self, flag: str) -> Any:
        """The default of ``parser.add_argument(flag, ...)``."""
        for call in self.calls("add_argument"):
            if any(isinstance(a, ast.Constant) and a.value == flag for a in call.args):
                return self.value(self.keyword(call, "default"))
        raise AssertionError(f"no flag {flag}")

    def has_call(self, name: str) -> bool:
        return bool(self.calls(name))

    def functions(self) -> set[str]:
        return {n.name for n in self.tree.body if isinstance(n, ast.FunctionDef)}


# ---------------------------------------------------------------------------------------------------------------
# Fast: every flavour renders, compiles, passes ruff, and carries the plan's numbers
# ---------------------------------------------------------------------------------------------------------------
def _name(cand: str, precision: Precision, ckpt: Checkpointing) -> str:
    return f"{cand}-{precision.value}-{ckpt.value}".replace("-", "_")


@pytest.fixture(scope="module")
def ruff_findings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Every script of the matrix written to one folder and checked by one ruff run with the project's rules."""
    if shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists():
        pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
    folder = tmp_path_factory.mktemp("scripts")
    for cand, nodes, gpus, precision, ckpt in MATRIX:
        p = _plan(nodes, gpus, precision=precision.value, checkpointing=ckpt.value, **_dims(cand))
        (folder / f"{_name(cand, precision, ckpt)}.py").write_text(
            render_train_script(p, RenderOptions(candidate=cand))
        )
    res = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "json", "--config",
         str(ROOT / "pyproject.toml"), str(folder)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    findings: dict[str, list[str]] = {}
    for item in json.loads(res.stdout or "[]"):
        findings.setdefault(Path(item["filename"]).stem, []).append(
            f"{item['code']} line {item['location']['row']}: {item['message']}"
        )
    assert res.returncode in (0, 1), res.stderr
    return findings


@pytest.mark.parametrize(
    ("cand", "nodes", "gpus", "precision", "ckpt"), MATRIX,
    ids=[f"{c}-{p.value}-{k.value}" for c, _, _, p, k in MATRIX],
)  # fmt: skip
def test_every_flavour_renders_compiles_and_passes_ruff(
    cand: str, nodes: int, gpus: int, precision: Precision, ckpt: Checkpointing, ruff_findings: dict[str, list[str]]
) -> None:
    p = _plan(nodes, gpus, precision=precision.value, checkpointing=ckpt.value, **_dims(cand))
    source = render_train_script(p, RenderOptions(candidate=cand))
    compile(source, f"{cand}.py", "exec")
    assert cand in source
    assert ruff_findings.get(_name(cand, precision, ckpt), []) == []
    assert "TODO" not in source
    s = Script(source)
    lay = layout_of(p, RenderOptions(candidate=cand))
    family = lay.strategy.family
    assert s.constants["STRATEGY"] == lay.strategy.name
    assert s.constants["PRECISION"] == precision.value
    assert s.constants["ACTIVATION_CHECKPOINTING"] == ckpt.value
    assert {"build_model", "build_dataset", "main", "save_checkpoint", "load_checkpoint"} <= s.functions()
    assert "REPLACE" in s.source
    assert s.has_call("set_epoch") and s.has_call("DistributedSampler")

    # precision
    mixed = precision in (Precision.BF16_MIXED, Precision.FP16_MIXED)
    dtype = "torch.float16" if precision is Precision.FP16_MIXED else "torch.bfloat16"
    scaled = s.has_call("GradScaler") or s.has_call("ShardedGradScaler")
    assert scaled == (precision is Precision.FP16_MIXED and family != "deepspeed")
    if family == "ddp":
        autocasts = s.calls("autocast")
        assert bool(autocasts) == mixed
        if mixed:
            assert ast.unparse(s.keyword(autocasts[0], "dtype")) == dtype
    if family == "fsdp" and mixed:
        (mp,) = s.calls("MixedPrecision")
        assert ast.unparse(s.keyword(mp, "param_dtype")) == dtype
        assert ast.unparse(s.keyword(mp, "reduce_dtype")) == "torch.float32"
    if family == "fsdp2":
        assert s.has_call("MixedPrecisionPolicy") == mixed
        # per block, then the root (under pp: of each stage); with ep the experts first, over their own mesh
        assert len(s.calls("fully_shard")) == 2 + (lay.dims.ep > 1)
        # zero1 with model parallelism runs as FSDP2 keeping the gathered parameters from forward to backward
        keep = [ast.unparse(c) for c in s.calls("fully_shard") if "reshard_after_forward=False" in ast.unparse(c)]
        assert len(keep) == (len(s.calls("fully_shard")) if cand.startswith("zero1") else 0)
    if precision is Precision.BF16_TRUE and family != "deepspeed":  # bf16 weights, no fp32 master copy
        assert any("torch.bfloat16" in ast.unparse(c) for c in s.calls("to"))

    # activation checkpointing: FSDP1 through apply_activation_checkpointing, the others through torch.utils.checkpoint
    applied = s.calls("apply_activation_checkpointing") + s.calls("checkpoint_activations")
    if ckpt is Checkpointing.NONE:
        assert applied == []
    else:
        (call,) = applied
        assert ("apply_activation_checkpointing" in ast.unparse(call)) == (family == "fsdp")
        expected = "ATTENTION_CLASS" if ckpt is Checkpointing.SELECTIVE else "BLOCK_CLASS"
        assert expected in ast.unparse(call)
        # layer:K checkpoints every K-th block (K = 2 for "layer"), op passes torchtitan's op-level policy
        assert ("2" in ast.unparse(call)) == (ckpt is Checkpointing.LAYER) or family == "fsdp"
        assert ("op_sac_context" in ast.unparse(call)) == (ckpt is Checkpointing.OP)
        assert s.has_call("create_selective_checkpoint_contexts") == (ckpt is Checkpointing.OP)

    # gradient accumulation without redundant communication
    if family in ("ddp", "fsdp"):
        assert s.has_call("no_sync")
    if family == "fsdp2" and lay.dims.pp == 1:
        assert s.has_call("set_requires_gradient_sync")  # (under pp the schedule syncs after the last backward)

    # tensor parallelism: the plan's degree, the demo model's layout, data by data-parallel rank
    tp, pp, cp, ep = lay.dims.tp, lay.dims.pp, lay.dims.cp, lay.dims.ep
    assert s.constants.get("TP", 1) == tp and s.constants.get("PP", 1) == pp
    assert s.constants.get("CP", 1) == cp and s.constants.get("EP", 1) == ep
    assert s.has_call("parallelize_module") == (tp > 1 or ep > 1)
    assert (tp > 1) == ("def tp_plan(" in source)
    assert "jupyter_dist" not in source  # self-contained: the script is what a user takes to a cluster
    (sampler,) = s.calls("DistributedSampler")
    if not lay.dims.is_data_parallel_only:
        (mesh,) = s.calls("init_device_mesh")
        names = ("pp",) * (pp > 1) + ("dp_replicate",) * lay.strategy.hybrid + ("dp_shard",) + ("cp",) * (cp > 1)
        names += ("tp",) * (tp > 1)
        assert s.value(s.keyword(mesh, "mesh_dim_names")) == names
        assert ast.unparse(s.keyword(sampler, "num_replicas")) == "dp_size"
        assert ast.unparse(s.keyword(sampler, "rank")) == "dp_rank"
    if tp > 1:
        assert s.constants["SEQUENCE_PARALLEL"] is lay.dims.sp
        parallelize = s.calls("parallelize_module")[0]  # (with ep a second call splits the experts)
        layout = "held(model, tp_plan(SEQUENCE_PARALLEL))" if pp > 1 else "tp_plan(SEQUENCE_PARALLEL)"
        assert [ast.unparse(a) for a in parallelize.args[1:]] == ["mesh['tp']", layout]
    if cp > 1:  # PyTorch's context_parallel around forward and backward, on the flattened (dp_shard x cp) mesh
        (ctx,) = s.calls("context_parallel")
        assert ast.unparse(ctx.args[0]) == "cp_mesh" and s.has_call("sequence_split")
        assert 'mesh["dp_shard", "cp"]._flatten("dp_shard_cp")' in source
        assert s.has_call("cpu_ring_attention")  # the CPU kernels through the same ring, on CPU only
    if ep > 1:  # a mixture-of-experts demo model, its experts split over ep and sharded over efsdp
        classes = {n.name for n in s.tree.body if isinstance(n, ast.ClassDef)}
        assert {"GroupedExperts", "MoE", "ExpertParallel"} <= classes
        assert s.constants["EXPERTS"] == lay.plan.model.experts and s.constants["TOP_K"] == lay.plan.model.top_k
        assert s.has_call("all_to_all_single_autograd") and s.has_call("set_gradient_divide_factor")
    else:
        assert "class MoE" not in source
    if pp > 1 and cp > 1:
        assert "dp_size = world_size // (PP * CP * TP)\n    dp_rank = (rank // (CP * TP)) % dp_size" in source
    if pp > 1:
        assert cp > 1 or "dp_size = world_size // (PP * TP)\n    dp_rank = (rank // TP) % dp_size" in source
        assert s.constants["SCHEDULE"] == "1f1b" and s.flag_default("--schedule") == "1f1b"
        assert {"split_model", "keep_stage_part", "stage_bounds", "build_schedule"} <= s.functions()
        (stage,) = s.calls("PipelineStage")
        assert ast.unparse(s.keyword(stage, "group")) == "group"
        options = s.calls("StateDictOptions")  # pipelined checkpoints keep one key per parameter
        assert [ast.unparse(c) for c in options] == ["StateDictOptions(flatten_optimizer_state_dict=True)"]
    elif cp > 1:
        assert "dp_rank, dp_size = rank // (CP * TP), world_size // (CP * TP)" in source
    elif tp > 1:
        assert "dp_rank, dp_size = rank // TP, world_size // TP" in source
    elif ep > 1:
        assert "dp_rank, dp_size = rank, world_size" in source
    else:
        assert ast.unparse(s.keyword(sampler, "num_replicas")) == "world_size"


@pytest.mark.parametrize("cand", ["ddp", "fsdp-full-shard", "fsdp2"])
def test_the_numbers_in_the_script_are_the_layouts(cand: str) -> None:
    p = _with_settings(_plan(micro_batch=3, grad_accum=5, seq_len=96), "ddp", bucket_cap_mb=37)
    opts = RenderOptions(candidate=cand, lr=2e-4, weight_decay=0.05, grad_clip=0.7, checkpoint_dir="/data/ckpt")
    lay = layout_of(p, opts)
    s = Script(render_train_script(p, opts))
    assert s.flag_default("--micro-batch") == lay.micro_batch == 3
    assert s.flag_default("--grad-accum") == lay.grad_accum == 5
    assert s.flag_default("--seq-len") == lay.seq_len == 96
    assert s.flag_default("--lr") == 2e-4
    assert s.flag_default("--weight-decay") == 0.05
    assert s.flag_default("--grad-clip") == 0.7
    assert s.flag_default("--checkpoint-dir") == "/data/ckpt"
    (adamw,) = s.calls("AdamW")
    assert ast.unparse(s.keyword(adamw, "lr")) == "args.lr"
    if cand == "ddp":
        (ddp,) = s.calls("DistributedDataParallel")
        assert s.value(s.keyword(ddp, "bucket_cap_mb")) == lay.settings["bucket_cap_mb"] == 37
        assert s.value(s.keyword(ddp, "gradient_as_bucket_view")) is True
    if cand.startswith("fsdp-"):
        (fsdp,) = s.calls("FSDP")
        assert ast.unparse(s.keyword(fsdp, "sharding_strategy")) == f"ShardingStrategy.{FSDP1_SHARDING[cand]}"
        assert ast.unparse(s.keyword(fsdp, "device_id")) == "device"


@pytest.mark.parametrize("cand", ["fsdp-hybrid-shard", "fsdp2-hybrid"])
def test_hybrid_sharding_uses_the_plans_group_size_on_a_2d_mesh(cand: str) -> None:
    p = _with_settings(_plan(2, 8), cand, shard_group_size=4)
    s = Script(render_train_script(p, RenderOptions(candidate=cand)))
    assert s.constants["SHARD_GROUP_SIZE"] == 4
    (mesh,) = s.calls("init_device_mesh")
    assert ast.unparse(mesh.args[1]) == "(world_size // SHARD_GROUP_SIZE, SHARD_GROUP_SIZE)"
    if cand == "fsdp-hybrid-shard":
        (fsdp,) = s.calls("FSDP")
        assert ast.unparse(s.keyword(fsdp, "sharding_strategy")) == "ShardingStrategy.HYBRID_SHARD"
        assert ast.unparse(s.keyword(fsdp, "device_mesh")) == "mesh"
    else:
        for call in s.calls("fully_shard"):
            assert ast.unparse(s.keyword(call, "mesh")) == "mesh"


@pytest.mark.parametrize("cand", ["fsdp2+tp2+sp", "fsdp2+tp4", "fsdp2-hybrid+tp2", "fsdp2-hybrid+tp2+sp", "fsdp2+pp2",
                                  "fsdp2+pp4", "fsdp2+tp2+pp2+sp", "fsdp2-hybrid+tp2+pp2+sp"])  # fmt: skip
def test_the_scripts_mesh_covers_the_processes_every_launcher_starts(cand: str) -> None:
    """torchrun, SLURM and SkyPilot start nodes x GPUs processes; the script's mesh on that many is the plan's."""
    p = _plan(2, 4, **_dims(cand))
    opts = RenderOptions(candidate=cand)
    lay = layout_of(p, opts)
    s = Script(render_train_script(p, opts))
    argv = torchrun_command(p, opts).argv
    nodes = int(argv[argv.index("--nnodes") + 1]) if "--nnodes" in argv else 1
    world = int(argv[argv.index("--nproc-per-node") + 1]) * nodes
    sbatch = render_sbatch(p, opts)
    per_node = re.search(r"#SBATCH --gpus-per-node=(\d+)", sbatch)
    nodes = re.search(r"#SBATCH --nodes=(\d+)", sbatch)
    assert per_node and nodes and int(per_node.group(1)) * int(nodes.group(1)) == world
    task = render_skypilot_task(p, opts)
    assert task["num_nodes"] * sum(task["resources"]["accelerators"].values()) == world == lay.world_size == 8
    # build_mesh()'s sizes, evaluated with the script's own constants on that world size
    build = next(n for n in s.tree.body if isinstance(n, ast.FunctionDef) and n.name == "build_mesh")
    expr = next(n.value for n in ast.walk(build) if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "sizes")
    unit = next(  # world_size, unit = dist.get_world_size(), <ranks of one replica>
        n.value.elts[1] for n in ast.walk(build) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Tuple)
    )
    names = s.value(s.keyword(s.calls("init_device_mesh")[0], "mesh_dim_names"))
    env = {**s.constants, "world_size": world, "unit": eval(compile(ast.Expression(unit), "unit", "eval"), s.constants)}
    sizes = dict(zip(names, eval(compile(ast.Expression(expr), "sizes", "eval"), env), strict=True))
    assert math.prod(sizes.values()) == world
    assert (sizes.get("pp", 1), sizes.get("tp", 1)) == (lay.dims.pp, lay.dims.tp)
    assert list(sizes)[-1] == ("tp" if lay.dims.tp > 1 else "dp_shard")  # tp innermost
    assert sizes.get("dp_replicate", 1) * sizes["dp_shard"] == lay.dims.dp
    if lay.strategy.hybrid:
        assert sizes["dp_shard"] == lay.settings["shard_group_size"]
    if lay.dims.pp > 1:  # the script's data split: dp_size = world_size // (PP * TP)
        assert world // (s.constants["PP"] * s.constants["TP"]) == lay.dims.dp


def test_deepspeed_script_takes_its_config_from_the_launcher() -> None:
    p = _plan(micro_batch=3, grad_accum=5)
    s = Script(render_train_script(p, RenderOptions(candidate="zero3")))
    assert s.constants["MICRO_BATCH"] == 3 and s.constants["GRAD_ACCUM"] == 5
    (init,) = s.calls("initialize")
    assert ast.unparse(s.keyword(init, "config")) == "args.deepspeed_config"
    # the deepspeed launcher line the project renders is accepted by the script's parser
    argv = deepspeed_command(p, RenderOptions(candidate="zero3")).argv
    assert "--deepspeed_config" in argv and "--deepspeed" in argv
    assert s.has_call("save_checkpoint") and not s.has_call("get_state_dict")  # DeepSpeed's own format


@pytest.mark.parametrize(
    ("optimizer", "call", "extra"),
    [("adamw", "AdamW", "weight_decay"), ("sgd", "SGD", "momentum"), ("adamw-8bit", "AdamW8bit", "weight_decay")],
)
def test_the_optimizer_is_the_plans(optimizer: str, call: str, extra: str) -> None:
    s = Script(render_train_script(_plan(optimizer=optimizer), RenderOptions(candidate="ddp")))
    (c,) = s.calls(call)
    assert ast.unparse(s.keyword(c, "lr")) == "args.lr"
    s.keyword(c, extra)
    top_level = {a.name.split(".")[0] for n in s.tree.body if isinstance(n, ast.Import) for a in n.names}
    assert "bitsandbytes" not in top_level  # imported lazily, with an install hint
    if optimizer == "adamw-8bit":
        assert "pip install bitsandbytes" in s.source


@pytest.mark.slow
def test_8bit_adamw_without_bitsandbytes_exits_with_the_install_hint(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("bitsandbytes is installed here")
    path = tmp_path / "train8.py"
    path.write_text(render_train_script(_plan(optimizer="adamw-8bit"), RenderOptions(candidate="ddp")))
    code = (
        "import runpy, torch\n"
        f"ns = runpy.run_path({str(path)!r})\n"
        "args = ns['parse_args']([])\n"
        "ns['build_optimizer'](torch.nn.Linear(2, 2), args)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1
    assert "needs bitsandbytes: pip install bitsandbytes" in res.stderr


# ---------------------------------------------------------------------------------------------------------------
# Error paths
# ---------------------------------------------------------------------------------------------------------------
def test_context_parallel_candidates_are_generated_with_the_sequence_split_around_forward_and_backward() -> None:
    p = _plan(2, 4, cp=2)
    cands = [c.name for c in p.candidates if c.dims.cp == 2]
    assert {"fsdp2+cp2", "fsdp2-hybrid+cp2", "zero1+cp2"} <= set(cands)
    for cand in cands:
        s = Script(render_train_script(p, RenderOptions(candidate=cand)))
        assert s.constants["CP"] == 2
        (split,) = s.calls("sequence_split")  # forward and backward inside it, on the mesh's cp dimension
        assert ast.unparse(split.args[0]) == "mesh['cp']"
        assert [ast.unparse(a) for a in split.args[1:]] == ["inputs", "targets", "positions"]
        # the model takes this rank's positions (the head-tail chunks), the loss is computed on its tokens
        assert "loss = loss_fn(model(inputs, positions), targets) / args.grad_accum" in s.source


def test_a_refusal_names_the_plans_own_model_parallel_candidates_which_compile() -> None:
    """Llama-2-70B on 4 x 8 H100: tp x pp candidates, and (from the same model with cp2 asked for) a cp candidate;
    tensor parallelism under a strategy that cannot run it (a hand-made ddp+tp8 candidate) is refused with a line that
    lists the plan's model-parallel candidates, which compile (the cp one included)."""
    hw = Hardware.from_names("h100-80gb", gpus_per_node=8, nodes=4)
    p = make_plan("llama-2-70b", hw, TrainingShape(seq_len=4096))
    cp = make_plan("llama-2-70b", hw, TrainingShape(seq_len=4096), cp=2).candidate("fsdp2+cp2")
    tp = next(c for c in p.candidates if c.name.startswith("fsdp2+tp8"))
    ddp = dataclasses.replace(tp, name="ddp+tp8", strategy="ddp")
    p = dataclasses.replace(p, candidates=(cp, *p.candidates, ddp))
    with pytest.raises(RenderError, match=r"^candidate ddp\+tp8: tensor parallelism is generated with FSDP2 only: "
                       r"fsdp2, fsdp2-hybrid or zero1 \(run as FSDP2\) with .* \(this plan has: ") as err:  # fmt: skip
        render_train_script(p, RenderOptions(candidate="ddp+tp8"))
    listed = re.search(r"this plan has: ([^)]*)\)", str(err.value)).group(1).split(", ")  # type: ignore[union-attr]
    assert listed[0] == "fsdp2+cp2" and "ddp+tp8" not in listed
    assert all(re.fullmatch(r"(fsdp2|fsdp2-hybrid|zero1)(\+tp\d+)?(\+pp\d+)?(\+cp\d+)?(\+sp)?", n) for n in listed[:-1])
    assert len(listed) == 7 and listed[-1] == "..."  # six names, then an ellipsis
    for name in listed[:-1]:
        render_train_script(p, RenderOptions(candidate=name))


@pytest.mark.parametrize(("cand", "dims"), [("zero1+pp2", {"pp": 2}), ("zero1+tp2+sp", {"tp": 2, "sp": True})])
def test_zero1_with_model_parallelism_is_fsdp2_keeping_the_gathered_parameters(cand: str, dims: dict[str, Any]) -> None:
    """As the workers run it (plan.strategies.runs_as): FSDP2 with reshard_after_forward=False, no DeepSpeed."""
    p = _plan(1, 4, **dims)
    source = render_train_script(p, RenderOptions(candidate=cand))
    s = Script(source)
    assert s.constants["STRATEGY"] == "zero1"
    shards = s.calls("fully_shard")
    assert shards and all(ast.unparse(s.keyword(c, "reshard_after_forward")) == "False" for c in shards)
    assert "deepspeed" not in source.split('"""', 2)[2]  # only the docstring names it: why it is not used
    assert "runs as FSDP2 with reshard_after_forward=False" in source


def test_expert_parallel_candidates_are_generated_with_a_mixture_of_experts_model() -> None:
    p = make_plan("mixtral-8x7b", Hardware.from_names("h100-80gb", gpus_per_node=8, nodes=2), ep=2)
    s = Script(render_train_script(p, RenderOptions(candidate="fsdp2+ep2")))
    assert (s.constants["EP"], s.constants["EXPERTS"], s.constants["TOP_K"]) == (2, 8, 2)
    assert "self.mlp = MoE(dim, EXPERTS, TOP_K)" in s.source
    (split,) = [c for c in s.calls("parallelize_module") if "expert_mesh" in ast.unparse(c)]
    assert ast.unparse(split.args[1]) == "expert_mesh(mesh)['ep']"


def test_a_plan_where_nothing_fits_needs_an_explicit_candidate() -> None:
    hw = Hardware.from_names("h100-80gb", gpus_per_node=1)
    p = make_plan("llama-2-70b", hw, TrainingShape(seq_len=4096))
    assert p.best is None
    with pytest.raises(RenderError, match="nothing fits"):
        render_train_script(p)


def test_an_unknown_candidate_lists_the_ones_there_are() -> None:
    with pytest.raises(RenderError, match=r"no candidate 'fsdp2\+tp8'; have: .*ddp"):
        render_train_script(_plan(), RenderOptions(candidate="fsdp2+tp8"))


def test_fsdp1_hybrid_shard_over_one_gpu_per_node_is_refused() -> None:
    p = _plan(2, 1, grad_accum=1)
    with pytest.raises(KeyError):  # the planner no longer offers it
        p.candidate("fsdp-hybrid-shard")
    hacked = dataclasses.replace(p, candidates=(*p.candidates, dataclasses.replace(
        p.candidate("fsdp2-hybrid"), name="fsdp-hybrid-shard", strategy="fsdp-hybrid-shard")))  # fmt: skip
    with pytest.raises(RenderError, match="groups of 1 GPU.*fsdp-no-shard, ddp or fsdp2-hybrid"):
        render_train_script(hacked, RenderOptions(candidate="fsdp-hybrid-shard"))  # and the renderer refuses it
    render_train_script(p, RenderOptions(candidate="fsdp2-hybrid"))  # FSDP2 handles the (2, 1) mesh


# ---------------------------------------------------------------------------------------------------------------
# Every candidate the planner prints gets a train.py, and the bundle's files agree with what runs
# ---------------------------------------------------------------------------------------------------------------
def _big_plans() -> dict[str, Plan]:
    """Plans whose candidates cover every composition the planner makes: MoE (ep x pp), long sequences (cp x tp),
    a dense 70B (tp x pp) and 405B on 64 nodes (tp x pp up to pp64)."""
    hw = Hardware.from_names("h100-80gb", gpus_per_node=8, nodes=2)
    return {
        "mixtral-8x7b": make_plan("mixtral-8x7b", hw),
        "llama-3-8b-seq65536": make_plan("llama-3-8b", hw, TrainingShape(seq_len=65536)),
        "llama-3-70b": make_plan("llama-3-70b", hw),
        "llama-3.1-405b": make_plan("llama-3.1-405b", Hardware.from_names("h100-80gb", gpus_per_node=8, nodes=64)),
    }


@pytest.fixture(scope="module")
def big_bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, dict[str, list[str]]]]:
    """Every candidate of the big plans compiled by render_bundle; the train.py files checked by one ruff run."""
    from jupyter_dist.render.bundle import render_bundle

    if shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists():
        pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
    folder = tmp_path_factory.mktemp("big")
    bundles = {}
    for plan_name, p in _big_plans().items():
        for c in p.candidates:
            key = re.sub(r"\W", "_", f"{plan_name}__{c.name}")
            b = render_bundle(p, RenderOptions(candidate=c.name))
            bundles[key] = b
            if "train.py" in b.files:
                (folder / f"{key}.py").write_text(b.files["train.py"])
    findings = ruff_folder(folder, timeout=300)
    return {key: (b, findings.get(key, [])) for key, b in bundles.items()}


def ruff_folder(folder: Path, *, timeout: float) -> dict[str, list[str]]:
    """One ruff run with the project's rules over the scripts in ``folder``: file stem -> ``"CODE line N"`` each."""
    res = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "json", "--config",
         str(ROOT / "pyproject.toml"), str(folder)],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert res.returncode in (0, 1), res.stderr
    findings: dict[str, list[str]] = {}
    for item in json.loads(res.stdout or "[]"):
        findings.setdefault(Path(item["filename"]).stem, []).append(f"{item['code']} line {item['location']['row']}")
    return findings


@pytest.mark.slow  # the fast tier (-m 'not slow') stays under 5 minutes
def test_every_candidate_of_the_planners_big_plans_gets_a_train_py_that_compiles_and_passes_ruff(
    big_bundles: dict[str, tuple[Any, dict[str, list[str]]]],
) -> None:
    counts = {name: len(p.candidates) for name, p in _big_plans().items()}
    assert sum(counts.values()) == len(big_bundles) and min(counts.values()) > 40
    missing = {key: b.notes for key, (b, _) in big_bundles.items() if "train.py" not in b.files}
    assert missing == {}
    dirty = {key: found for key, (_, found) in big_bundles.items() if found}
    assert dirty == {}
    for key, (b, _) in big_bundles.items():
        source = b.files["train.py"]
        compile(source, f"{key}.py", "exec")
        s = Script(source)
        d = b.layout.dims
        assert s.constants["STRATEGY"] == b.candidate.strategy, key
        assert [s.constants.get(n, 1) for n in ("TP", "PP", "CP", "EP")] == [d.tp, d.pp, d.cp, d.ep], key
    plans = _big_plans()
    recommended = {name: p.best.name for name, p in plans.items() if p.best is not None}
    # the compositions the issue names are among the candidates; since FSDP2's gradients reuse memory backward frees
    # (measured: docs/gpu.md), Mixtral fits without the pipeline (zero1+pp2+ep8 was the best before)
    assert "zero1+pp2+ep8" in {c.name for c in plans["mixtral-8x7b"].candidates}
    assert recommended["mixtral-8x7b"] == "fsdp2+ep8"
    assert recommended["llama-3-8b-seq65536"] == "fsdp2-hybrid+cp16"


def test_the_bundle_writes_a_deepspeed_config_only_where_deepspeed_runs(
    big_bundles: dict[str, tuple[Any, dict[str, list[str]]]],
) -> None:
    """zero1 with tp/pp/cp/ep runs as FSDP2 with reshard_after_forward=False (the workers, and train.py): no
    ds_config.json, no --deepspeed_config, an FSDP accelerate config (where accelerate can run it), and a note."""
    seen = set()
    for key, (b, _) in big_bundles.items():
        lay, files = b.layout, b.files
        deepspeed = lay.strategy.family == "deepspeed"
        assert ("ds_config.json" in files) == deepspeed, key
        assert ("--deepspeed_config" in files["launch.sh"]) == deepspeed, key
        assert ("--deepspeed_config" in files["job.sbatch"]) == deepspeed, key
        assert ("deepspeed" in files["skypilot.yaml"]) == deepspeed, key
        accelerate = files.get("accelerate_config.yaml", "")
        assert ("DEEPSPEED" in accelerate) == deepspeed, key
        if b.candidate.strategy == "zero1" and not lay.dims.is_data_parallel_only:
            seen.add(key.split("__")[0])
            assert lay.strategy.family == "fsdp2" and lay.strategy.keeps_gathered_params
            assert any("runs as FSDP2 with reshard_after_forward=False" in n for n in b.notes), b.notes
            assert "reshard_after_forward=False" in files["train.py"]
            if accelerate:  # tp/cp only: pp and ep are refused by accelerate, with a note
                assert "distributed_type: FSDP" in accelerate and "fsdp_reshard_after_forward: false" in accelerate
        else:
            assert "reshard_after_forward=False" not in files["train.py"], key
    assert seen == {"mixtral_8x7b", "llama_3_8b_seq65536", "llama_3_70b", "llama_3_1_405b"}


# ---------------------------------------------------------------------------------------------------------------
# Real execution: 2 CPU processes with gloo
# ---------------------------------------------------------------------------------------------------------------
TINY = ("--model-dim", "32", "--layers", "2", "--heads", "2", "--vocab-size", "64", "--num-workers", "0",
        "--log-every", "1")  # fmt: skip
STEP_RE = re.compile(r"^step (\d+)/(\d+) loss ([0-9.]+) grad-norm (\S+) tokens/s", re.M)
RESUMED_RE = re.compile(r"^resumed from (\S+) at step (\d+)$", re.M)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own, out of its group)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _run(cmd: Command, cwd: Path, *, extra_env: dict[str, str] | None = None, timeout: float = 180) -> tuple[int, str]:
    """Run the rendered command; past ``timeout`` kill it, its process group and every worker it started."""
    env = {**os.environ, **cmd.env, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    log = cwd / f"run-{len(list(cwd.glob('run-*.log')))}.log"  # a file, not a pipe: orphans cannot block reading
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd.argv, cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip
        try:
            proc.wait(timeout=timeout)
        except BaseException as err:
            for pid in [*_descendants(proc.pid), proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if isinstance(err, subprocess.TimeoutExpired):
                pytest.fail(f"{cmd.shell()} ran past {timeout} s:\n{log.read_text()[-4000:]}")
            raise
    return proc.returncode, log.read_text()


def _steps(out: str) -> list[tuple[int, float]]:
    return [(int(m.group(1)), float(m.group(3))) for m in STEP_RE.finditer(out)]


def _train(
    tmp_path: Path,
    p: Plan,
    cand: str,
    steps: int,
    *,
    launcher: str = "torchrun",
    extra_env: dict[str, str] | None = None,
    extra_args: tuple[str, ...] = (),
) -> str:
    """Render the script and the project's launch command for it, run them, return the output."""
    script = tmp_path / "train.py"
    args = (*TINY, "--steps", str(steps), *extra_args)
    config = tmp_path / "ds_config.json"
    if launcher == "torchrun" and layout_of(p, RenderOptions(candidate=cand)).strategy.family == "deepspeed":
        args += ("--deepspeed_config", str(config))
    opts = RenderOptions(candidate=cand, script=str(script), lr=0.01, checkpoint_dir=str(tmp_path / "ckpt"),
                         master_port=_free_port(), script_args=args)  # fmt: skip
    script.write_text(render_train_script(p, opts))
    cmd = deepspeed_command(p, opts, config_path=str(config)) if launcher == "deepspeed" else torchrun_command(p, opts)
    rc, out = _run(cmd, tmp_path, extra_env=extra_env)
    assert rc == 0, out[-6000:]
    return out


def _assert_trained(out: str, first: int, last: int) -> list[tuple[int, float]]:
    steps = _steps(out)
    assert [s for s, _ in steps] == list(range(first, last + 1)), out[-3000:]
    return steps


def _assert_first_half(a: str, first: int) -> list[tuple[int, float]]:
    """The first run of a train-and-resume check: ``first`` steps from scratch, the loss falls."""
    steps_a = _assert_trained(a, 1, first)
    assert steps_a[-1][1] < steps_a[0][1] - 0.2, f"the loss did not go down: {steps_a}"
    assert RESUMED_RE.search(a) is None
    return steps_a


def _assert_resumed(a: str, b: str, first: int, second: int) -> None:
    """The second run resumed at step ``first`` from the first run's trained weights and went on to ``second``."""
    steps_a = _assert_first_half(a, first)
    resumed = RESUMED_RE.search(b)
    assert resumed is not None and int(resumed.group(2)) == first, b[-3000:]
    steps_b = _assert_trained(b, first + 1, second)  # the step counter continues
    assert steps_b[0][1] < steps_a[0][1]  # from the trained weights, not from scratch


def _train_twice(
    tmp_path: Path,
    p: Plan,
    cand: str,
    *,
    first: int = 4,
    second: int = 6,
    launchers: tuple[str, str] = ("torchrun", "torchrun"),
    extra_env: dict[str, str] | None = None,
) -> tuple[str, str]:
    """Run ``first`` steps, then run again up to ``second``: the loss falls, and the second run resumes."""
    a = _train(tmp_path, p, cand, first, launcher=launchers[0], extra_env=extra_env)
    _assert_first_half(a, first)
    b = _train(tmp_path, p, cand, second, launcher=launchers[1], extra_env=extra_env)
    _assert_resumed(a, b, first, second)
    return a, b


def _tiny_plan(precision: str, checkpointing: str, grad_accum: int) -> Plan:
    return _plan(1, 2, micro_batch=2, grad_accum=grad_accum, seq_len=32, precision=precision,
                 checkpointing=checkpointing)  # fmt: skip


needs_torch = pytest.mark.skipif(shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun")
                                 .exists(), reason="torch is not installed")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Shared launches: every torchrun run of one world size trains in one launch (tests/_script_driver.py)
# ---------------------------------------------------------------------------------------------------------------
DRIVER = Path(__file__).with_name("_script_driver.py")


@dataclasses.dataclass(frozen=True)
class ScriptRun:
    """One generated script's run in a shared launch: its source, the arguments torchrun would pass it, its folder
    (checkpoints under ``folder/ckpt``; a resumed run shares its first run's folder)."""

    name: str
    world: int
    folder: Path
    source: str
    argv: tuple[str, ...]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    expect_failure: bool = False


def _planned(
    root: Path, name: str, p: Plan, cand: str, steps: int, *, folder: str = "", extra_args: tuple[str, ...] = ()
) -> ScriptRun:
    """``cand``'s script rendered for ``p`` as ``_train`` renders it, with the arguments and process count of the
    project's torchrun command for it."""
    d = root / (folder or name)
    d.mkdir(parents=True, exist_ok=True)
    script = d / f"{name}.py"
    opts = RenderOptions(candidate=cand, script=str(script), lr=0.01, checkpoint_dir=str(d / "ckpt"),
                         script_args=(*TINY, "--steps", str(steps), *extra_args))  # fmt: skip
    cmd = torchrun_command(p, opts)
    argv = cmd.argv
    nodes = int(argv[argv.index("--nnodes") + 1]) if "--nnodes" in argv else 1
    world = int(argv[argv.index("--nproc-per-node") + 1]) * nodes
    after = argv[argv.index(str(script)) + 1 :]
    return ScriptRun(name, world, d, render_train_script(p, opts), tuple(after), dict(cmd.env))


def _local(root: Path, name: str, world: int, source: str, *args: str, expect_failure: bool = False) -> ScriptRun:
    """``source`` run on ``world`` local processes for 5 steps (the plan's command is for its cluster)."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    argv = (*TINY, "--steps", "5", "--checkpoint-dir", str(d / "ckpt"), *args)
    return ScriptRun(name, world, d, source, argv, expect_failure=expect_failure)


def _no_device_id_source(p: Plan, opts: RenderOptions) -> str:
    """The FSDP1 script without its ``device_id=device,`` line."""
    source = render_train_script(p, opts)
    line = next(x for x in source.splitlines() if x.strip().startswith("device_id=device,"))
    return source.replace(line + "\n", "")


def _shared_runs(root: Path) -> list[ScriptRun]:
    """Every torchrun run of this file but DeepSpeed's, in launch order (references first, then each resumed run
    after its first run)."""
    tiny_bf16 = _tiny_plan("bf16-mixed", "selective", 2)
    moe = render_train_script(_moe_plan(2, ep=2), RenderOptions(candidate="fsdp2+ep2", lr=0.01))
    assert "\nEP = 2  #" in moe
    one_fsdp1 = _plan(1, 1, micro_batch=2, grad_accum=1, seq_len=32, precision="bf16-mixed")
    runs = [
        # one process: the cp and ep references, FSDP1 without device_id
        _planned(root, "one", _tp_plan(1, 1), "fsdp2", 5),
        _local(root, "one-moe", 1, moe.replace("\nEP = 2  #", "\nEP = 1  #"), "--micro-batch", "4"),
        _local(root, "fsdp1-no-device-id", 1, _no_device_id_source(one_fsdp1, RenderOptions(
            candidate="fsdp-full-shard")), "--steps", "1", expect_failure=True),  # fmt: skip
        # two processes
        _planned(root, "dp", _dp_plan(), "fsdp2", 5),
        _planned(root, "ddp", tiny_bf16, "ddp", 4),
        _planned(root, "ddp-resumed", tiny_bf16, "ddp", 6, folder="ddp"),
        _planned(root, "fsdp2", _tiny_plan("bf16-mixed", "full", 2), "fsdp2", 4),
        _planned(root, "fsdp2-resumed", _tiny_plan("bf16-mixed", "full", 2), "fsdp2", 6, folder="fsdp2"),
        _planned(root, "fsdp1", tiny_bf16, "fsdp-full-shard", 4),
        _planned(root, "fsdp1-resumed", tiny_bf16, "fsdp-full-shard", 6, folder="fsdp1"),
        *(_planned(root, f"pp-fsdp2+pp2-{s}", _pp_plan(2, pp=2), "fsdp2+pp2", 5, extra_args=("--schedule", s))
          for s in ("1f1b", "gpipe")),  # fmt: skip
        *(_planned(root, f"pp-interleaved{tail}", _pp_plan(2, "bf16-mixed", "full", pp=2), "fsdp2+pp2", steps,
                   folder="pp-interleaved", extra_args=("--schedule", "interleaved-1f1b", "--layers", "4"))
          for tail, steps in (("", 4), ("-resumed", 6))),  # fmt: skip
        _planned(root, "fp16-pp", _pp_plan(2, "fp16-mixed", pp=2), "fsdp2+pp2", 5),
        _planned(root, "cp-fsdp2+cp2", _tp_plan(1, 2, cp=2), "fsdp2+cp2", 5),
        _planned(root, "ep-fsdp2+ep2", _moe_plan(2, ep=2), "fsdp2+ep2", 5),
    ]
    for cand, model, checkpointing in BF16_CP_EP:
        dims = {"model": model, **_dims(cand)}
        p = _plan(1, 2, micro_batch=2, grad_accum=2, seq_len=32, precision="bf16-mixed", checkpointing=checkpointing,
                  **dims)  # fmt: skip
        runs += [_planned(root, f"bf16-{cand}", p, cand, 4),
                 _planned(root, f"bf16-{cand}-resumed", p, cand, 6, folder=f"bf16-{cand}")]  # fmt: skip
    # four processes
    hybrid_opts = RenderOptions(candidate="fsdp2-hybrid+tp2", lr=0.01)
    hybrid = render_train_script(_tp_plan(2, 2, **_dims("fsdp2-hybrid+tp2")), hybrid_opts)
    p = _tp_plan(1, 4, "bf16-mixed", "full", tp=2, sp=True)
    runs += [
        _planned(root, "tp-fsdp2+tp2+sp", _tp_plan(1, 4, tp=2, sp=True), "fsdp2+tp2+sp", 5),
        _local(root, "tp-fsdp2-hybrid+tp2", 4, hybrid),  # one machine standing in for the plan's two nodes
        _planned(root, "tp-sp", p, "fsdp2+tp2+sp", 4),
        _planned(root, "tp-sp-resumed", p, "fsdp2+tp2+sp", 6, folder="tp-sp"),
        _planned(root, "pp-fsdp2+tp2+pp2+sp-1f1b", _pp_plan(4, tp=2, sp=True, pp=2), "fsdp2+tp2+pp2+sp", 5,
                 extra_args=("--schedule", "1f1b")),  # fmt: skip
        *(_planned(root, f"cp-{cand}", _tp_plan(1, 4, **_dims(cand)), cand, 5)
          for cand in ("fsdp2+tp2+cp2+sp", "fsdp2+pp2+cp2")),  # fmt: skip
        _planned(root, "ep-zero1+pp2+ep2", _moe_plan(4, **_dims("zero1+pp2+ep2")), "zero1+pp2+ep2", 5),
    ]
    return runs


class SharedLaunches:
    """The runs of :func:`_shared_runs`, one torchrun launch per world size, started when a test first asks for one
    of its runs; each test reads its own run's output (every rank's prints, rank 0 first).

    A run that fails ends its launch: its test fails with its traceback, the tests of the runs after it with the
    launch's log."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs = {r.name: r for r in _shared_runs(root)}
        self.launched: dict[int, str] = {}  # world size -> the launch's log

    def _launch(self, world: int) -> str:
        if world not in self.launched:
            folder = self.root / f"launch-{world}"
            folder.mkdir()
            spec = []
            for r in self.runs.values():
                if r.world == world:
                    script = r.folder / f"{r.name}.py"
                    script.write_text(r.source)
                    spec.append({"name": r.name, "script": str(script), "argv": list(r.argv), "env": r.env,
                                 "cwd": str(r.folder), "log": str(r.folder / f"{r.name}.log"),
                                 "expect_failure": r.expect_failure})  # fmt: skip
            (folder / "spec.json").write_text(json.dumps(spec, indent=1))
            argv = ["torchrun", "--standalone", "--nproc-per-node", str(world), str(DRIVER), str(folder / "spec.json")]
            self.launched[world] = "the launch did not end"
            rc, out = _run(Command(argv=argv), folder, timeout=900)
            failed = [f"{r.name} failed:\n{json.loads(f.read_text())['error'][-3000:]}" for r in self.runs.values()
                      if r.world == world and not r.expect_failure for f in r.folder.glob(f"{r.name}.log.rank*.json")
                      if json.loads(f.read_text())["rc"] != 0][:1]  # fmt: skip
            self.launched[world] = f"the {world}-process launch ended with {rc}: {''.join(failed)}\n{out[-3000:]}"
        return self.launched[world]

    def result(self, name: str) -> tuple[int, str]:
        """The run's exit status (the highest of its ranks') and output."""
        run = self.runs[name]
        launch = self._launch(run.world)
        outcomes = [run.folder / f"{name}.log.rank{rank}.json" for rank in range(run.world)]
        if not all(f.exists() for f in outcomes):
            pytest.fail(f"run {name} did not finish in its shared launch; {launch}")
        out = "".join((run.folder / f"{name}.log.rank{rank}").read_text() for rank in range(run.world))
        return max(json.loads(f.read_text())["rc"] for f in outcomes), out

    def output(self, name: str) -> str:
        """The output of a run that must succeed."""
        rc, out = self.result(name)
        assert rc == 0, out[-6000:]
        return out

    def folder(self, name: str) -> Path:
        return self.runs[name].folder


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> SharedLaunches:
    """This file's torchrun runs (but DeepSpeed's), three launches in all (1, 2 and 4 processes), once per module."""
    return SharedLaunches(tmp_path_factory.mktemp("shared"))


@pytest.mark.slow
@needs_torch
def test_ddp_script_trains_and_resumes_bf16_selective_accumulation(shared: SharedLaunches) -> None:
    """Train 4 steps, then resume to 6. Both runs train in the shared 2-process launch, one after the other: the
    second is a fresh run of the script (its own ``runpy`` execution, new model and optimizer, a new process group)
    whose only way to the first run's weights and step is the checkpoint the first run wrote to disk, so it proves
    the resume as a second launch did."""
    _assert_resumed(shared.output("ddp"), shared.output("ddp-resumed"), 4, 6)
    assert (shared.folder("ddp") / "ckpt" / "step-4" / ".metadata").exists()
    assert (shared.folder("ddp") / "ckpt" / "step-6" / ".metadata").exists()


@pytest.mark.slow
@needs_torch
def test_fsdp2_script_trains_and_resumes_bf16_full_checkpointing_accumulation(shared: SharedLaunches) -> None:
    """Train then resume in the shared launch (why that proves the resume: the ddp test above)."""
    a = shared.output("fsdp2")
    _assert_resumed(a, shared.output("fsdp2-resumed"), 4, 6)
    assert "fsdp2 on 2 ranks (cpu), bf16-mixed" in a
    ckpt = shared.folder("fsdp2") / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-4", "step-6"]
    assert len(list((ckpt / "step-6").glob("*.distcp"))) == 2  # one shard file per rank


@pytest.mark.slow
@needs_torch
def test_fsdp2_script_trains_fp32_without_accumulation(shared: SharedLaunches) -> None:
    """The data-parallel reference's own run (``dp``: fsdp2, fp32, accumulation 1, 5 steps) read here."""
    out = shared.output("dp")
    assert layout_of(_dp_plan(), RenderOptions(candidate="fsdp2")).grad_accum == 1
    steps = _assert_trained(out, 1, 5)
    assert steps[-1][1] < steps[0][1] - 0.2, f"the loss did not go down: {steps}"
    assert "fsdp2 on 2 ranks (cpu), fp32" in out
    assert (shared.folder("dp") / "ckpt" / "step-5" / ".metadata").exists()


@pytest.mark.slow
@needs_torch
def test_fsdp1_script_trains_and_resumes_on_cpu_with_device_id(shared: SharedLaunches) -> None:
    """FSDP1 runs on CPU when it is given ``device_id=torch.device("cpu")``, which the script always passes (train
    then resume in the shared launch: why that proves the resume, the ddp test above)."""
    _assert_resumed(shared.output("fsdp1"), shared.output("fsdp1-resumed"), 4, 6)


@pytest.mark.slow
@needs_torch
def test_fsdp1_script_needs_an_accelerator_on_cpu_without_device_id(shared: SharedLaunches) -> None:
    """Why the script passes ``device_id``: without it PyTorch's FSDP1 refuses to run where there is no GPU.

    One process is enough (the plan made for one GPU: one rank, in the shared 1-process launch): FSDP's constructor
    refuses before any communication, whatever the world size; the two-process FSDP1 runs are the resume test
    above."""
    rc, out = shared.result("fsdp1-no-device-id")
    assert "device_id=device," not in shared.runs["fsdp1-no-device-id"].source
    assert rc != 0
    assert "FSDP needs a non-CPU accelerator device" in out


@pytest.fixture()
def ds_env() -> Iterator[dict[str, str]]:
    pytest.importorskip("deepspeed")
    yield {
        "DS_ACCELERATOR": "cpu",
        "TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"],
    }


@pytest.mark.slow
@pytest.mark.deepspeed
def test_deepspeed_script_trains_and_resumes_zero2_bf16_with_either_launcher(
    tmp_path: Path, ds_env: dict[str, str]
) -> None:
    p = _tiny_plan("bf16-mixed", "full", 2)
    lay = layout_of(p, RenderOptions(candidate="zero2"))
    config = {
        "train_micro_batch_size_per_gpu": lay.micro_batch,
        "gradient_accumulation_steps": lay.grad_accum,
        "train_batch_size": lay.global_batch,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
        "gradient_clipping": 1.0,
    }  # fmt: skip  (no optimizer section: the script's torch AdamW, no C++ op to build)
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    # the first run through the deepspeed launcher (as the project renders it), the resumed one through torchrun
    a, b = _train_twice(tmp_path, p, "zero2", first=3, second=4, launchers=("deepspeed", "torchrun"),
                        extra_env=ds_env)  # fmt: skip
    assert "note:" not in a  # the config agrees with the plan
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-4"


# ---------------------------------------------------------------------------------------------------------------
# Tensor parallelism: 4 CPU processes (gloo), the same math as data parallelism on the same global batch
# ---------------------------------------------------------------------------------------------------------------
def _tp_plan(nodes: int, gpus: int, precision: str = "fp32", checkpointing: str = "none", **dims: Any) -> Plan:
    return _plan(nodes, gpus, micro_batch=2, grad_accum=2, seq_len=32, precision=precision,
                 checkpointing=checkpointing, **dims)  # fmt: skip


def _dp_plan() -> Plan:
    """The data-parallel reference's plan: 2 processes x micro-batch 4, no accumulation (global batch 8)."""
    return _plan(1, 2, micro_batch=4, grad_accum=1, seq_len=32, precision="fp32")


@pytest.fixture(scope="module")
def dp_losses(shared: SharedLaunches) -> list[float]:
    """The data-parallel reference's losses: fsdp2 on 2 processes (dp 2), fp32, 5 steps of micro-batch 4 without
    accumulation (the ``dp`` run; test_fsdp2_script_trains_fp32_without_accumulation reads the same run). Each
    replica's micro-batch of 4 is the 4 samples a micro-batch 2 x accumulation 2 run takes in two micro-steps
    (DistributedSampler's order), so the tp, pp and cp scripts (which accumulate) compare against the same mean: the
    two references' losses agree to 3e-7 here, inside the 1e-5 of the comparisons."""
    return [loss for _, loss in _assert_trained(shared.output("dp"), 1, 5)]


@pytest.mark.slow
@needs_torch
@pytest.mark.parametrize(
    ("cand", "nodes", "gpus", "mesh"),
    [("fsdp2+tp2+sp", 1, 4, "dp_shard=2 x tp=2"), ("fsdp2-hybrid+tp2", 2, 2, "dp_replicate=2 x dp_shard=1 x tp=2")],
)
def test_tp_script_on_4_processes_has_the_losses_of_the_data_parallel_script(
    shared: SharedLaunches, dp_losses: list[float], cand: str, nodes: int, gpus: int, mesh: str
) -> None:
    """Equal math: dp 2 x tp 2 (tp ranks load the same batch) trains like dp 2 alone, fp32, to 1e-5 relative.

    Both scripts seed the weights the same way and draw each data-parallel replica's samples with the same
    DistributedSampler (num_replicas = dp size, rank = dp rank), so any wrong layout, gradient reduction or data split
    shows in the losses. The HSDP plan is made for 2 nodes x 2 GPUs; here its 4 processes run on one machine.
    """
    p = _tp_plan(nodes, gpus, **_dims(cand))
    opts = RenderOptions(candidate=cand)
    assert layout_of(p, opts).global_batch == layout_of(_dp_plan(), RenderOptions(candidate="fsdp2")).global_batch
    out = shared.output(f"tp-{cand}")
    assert f"fsdp2{'-hybrid' * (nodes > 1)} on 4 ranks (cpu), fp32" in out and f"mesh {mesh}" in out
    losses = [loss for _, loss in _assert_trained(out, 1, 5)]
    assert losses[-1] < losses[0] - 0.2, f"the loss did not go down: {losses}"
    assert losses == pytest.approx(dp_losses, rel=1e-5)


@pytest.mark.slow
@needs_torch
def test_tp_sp_script_trains_and_resumes_bf16_full_checkpointing_accumulation(shared: SharedLaunches) -> None:
    """fsdp2+tp2+sp with the plan's bf16-mixed and full activation checkpointing saves through DCP and resumes (train
    then resume in the shared 4-process launch: why that proves the resume, the ddp test)."""
    a = shared.output("tp-sp")
    _assert_resumed(a, shared.output("tp-sp-resumed"), 4, 6)
    assert "mesh dp_shard=2 x tp=2" in a
    assert len(list((shared.folder("tp-sp") / "ckpt" / "step-6").glob("*.distcp"))) == 4  # one shard file per rank


# ---------------------------------------------------------------------------------------------------------------
# Pipeline parallelism: stages on CPU processes (gloo), the same math as data parallelism on the same global batch
# ---------------------------------------------------------------------------------------------------------------
def _pp_plan(gpus: int, precision: str = "fp32", checkpointing: str = "none", **dims: Any) -> Plan:
    """Micro-batch 2 x 4 micro-batches: with dp 1 the global batch of the dp 2 reference (2 x 2 x 2 = 8)."""
    return _plan(1, gpus, micro_batch=2, grad_accum=4, seq_len=32, precision=precision, checkpointing=checkpointing,
                 **dims)  # fmt: skip


def test_the_scripts_stage_bounds_are_the_planners() -> None:
    """The script inlines the stage split (it imports nothing of jupyter_dist); it cuts as plan/pipeline.py does."""
    from jupyter_dist.plan.pipeline import stage_bounds

    s = Script(render_train_script(_pp_plan(2, pp=2), RenderOptions(candidate="fsdp2+pp2")))
    fn = next(n for n in s.tree.body if isinstance(n, ast.FunctionDef) and n.name == "stage_bounds")
    namespace: dict[str, Any] = {}
    exec(f"import functools\n{ast.get_source_segment(s.source, fn)}", namespace)
    for layers in (2, 5, 8, 13, 32):
        for stages in range(1, min(layers, 8) + 1):
            for extra in (0.0, 0.3, 1.0, 2.5, 7.0):
                got = namespace["stage_bounds"](layers, stages, last_extra=extra)
                assert got == stage_bounds(layers, stages, last_extra=extra), (layers, stages, extra)


@pytest.mark.slow
@needs_torch
@pytest.mark.parametrize(
    ("cand", "gpus", "schedule", "mesh"),
    [("fsdp2+pp2", 2, "1f1b", "pp=2 x dp_shard=1"), ("fsdp2+pp2", 2, "gpipe", "pp=2 x dp_shard=1"),
     ("fsdp2+tp2+pp2+sp", 4, "1f1b", "pp=2 x dp_shard=1 x tp=2")],
)  # fmt: skip
def test_pp_script_has_the_losses_of_the_data_parallel_script(
    shared: SharedLaunches, dp_losses: list[float], cand: str, gpus: int, schedule: str, mesh: str
) -> None:
    """Equal math: pp 2 (x tp 2 + sp) over 4 micro-batches of 2 trains like dp 2 x micro-batch 4, fp32, 1e-5.

    The first stage reads the inputs and the last the targets of the same 8 sequences the dp 2 reference's two
    replicas read; the schedule's mean over micro-batches is the reference's mean over samples and replicas, and the
    gradient norm (clipped at 1.0) is summed over the stages. A wrong stage cut, data split, loss scaling or gradient
    reduction shows in the losses.
    """
    p = _pp_plan(gpus, **_dims(cand))
    lay = layout_of(p, RenderOptions(candidate=cand))
    assert lay.global_batch == layout_of(_dp_plan(), RenderOptions(candidate="fsdp2")).global_batch == 8
    run = f"pp-{cand}-{schedule}"
    assert shared.runs[run].world == gpus and shared.runs[run].argv[-2:] == ("--schedule", schedule)
    out = shared.output(run)
    assert f"fsdp2 on {gpus} ranks (cpu), fp32" in out and f"mesh {mesh} schedule {schedule}, 4 micro-batches" in out
    assert "pipeline stages (blocks): 0: 0..0, 1: 1..1" in out
    losses = [loss for _, loss in _assert_trained(out, 1, 5)]
    assert losses[-1] < losses[0] - 0.2, f"the loss did not go down: {losses}"
    assert losses == pytest.approx(dp_losses, rel=1e-5)


@pytest.mark.slow
@needs_torch
def test_pp_script_trains_and_resumes_interleaved_bf16_full_checkpointing(shared: SharedLaunches) -> None:
    """fsdp2+pp2 with interleaved 1F1B (2 stages per rank, 4 blocks), bf16-mixed and full activation checkpointing
    saves one flattened DCP checkpoint of both ranks' stages and resumes from it (train then resume in the shared
    launch: why that proves the resume, the ddp test)."""
    a = shared.output("pp-interleaved")
    assert "pipeline stages (blocks): 0: 0..0, 1: 1..1, 2: 2..2, 3: 3..3" in a
    _assert_resumed(a, shared.output("pp-interleaved-resumed"), 4, 6)
    import torch.distributed.checkpoint as dcp

    step6 = shared.folder("pp-interleaved") / "ckpt" / "step-6"
    keys = set(dcp.FileSystemReader(str(step6)).read_metadata().state_dict_metadata)
    for layer in range(4):  # every stage's parameters under their whole-model names, one optimizer key each
        assert f"model.blocks.{layer}.attn.q_proj.weight" in keys
        assert f"optim.state.blocks.{layer}.attn.q_proj.weight.exp_avg" in keys
    assert "model.tok_emb.weight" in keys and "model.head.weight" in keys


@pytest.mark.slow
@needs_torch
def test_pp_script_refuses_a_1f1b_schedule_with_fewer_micro_batches_than_stages(tmp_path: Path) -> None:
    p = _pp_plan(2, pp=2)
    script = tmp_path / "train.py"
    script.write_text(render_train_script(p, RenderOptions(candidate="fsdp2+pp2")))
    res = subprocess.run([sys.executable, str(script), "--grad-accum", "1"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)  # fmt: skip
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1] == (
        "1F1B needs at least as many micro-batches (--grad-accum 1) as pipeline stages (2); raise --grad-accum or "
        "use --schedule gpipe"
    )


# ---------------------------------------------------------------------------------------------------------------
# Context and expert parallelism: CPU processes (gloo), the same math as one process on the same global batch
# ---------------------------------------------------------------------------------------------------------------
def _moe_plan(gpus: int, **dims: Any) -> Plan:
    dims = {"model": "mixtral-8x7b", **dims}
    return _plan(1, gpus, micro_batch=2, grad_accum=2, seq_len=32, precision="fp32", **dims)


@pytest.fixture(scope="module")
def one_process_losses(shared: SharedLaunches) -> list[float]:
    """The reference of the cp runs (dp 1): fsdp2 on one process, fp32, 5 steps of micro-batch 2 x accumulation 2."""
    return [loss for _, loss in _assert_trained(shared.output("one"), 1, 5)]


@pytest.fixture(scope="module")
def one_process_moe_losses(shared: SharedLaunches) -> list[float]:
    """The reference of the ep runs (dp 2): the fsdp2+ep2 script with EP = 1 on one process and micro-batch 4.

    The same samples per step as dp 2 x micro-batch 2 (DistributedSampler's two replicas take alternate indices of
    the same permutation), every expert on the one rank (the all-to-alls go nowhere).
    """
    assert "\nEP = 1  #" in shared.runs["one-moe"].source
    out = shared.output("one-moe")
    assert "fsdp2 on 1 ranks (cpu), fp32" in out
    return [loss for _, loss in _assert_trained(out, 1, 5)]


@pytest.mark.slow
@needs_torch
@pytest.mark.parametrize(
    ("cand", "gpus", "mesh"),
    [("fsdp2+cp2", 2, "dp_shard=1 x cp=2"), ("fsdp2+tp2+cp2+sp", 4, "dp_shard=1 x cp=2 x tp=2"),
     ("fsdp2+pp2+cp2", 4, "pp=2 x dp_shard=1 x cp=2")],
)  # fmt: skip
def test_cp_script_has_the_losses_of_one_process(
    shared: SharedLaunches, one_process_losses: list[float], cand: str, gpus: int, mesh: str
) -> None:
    """Equal math: cp 2 (with tp 2 + sp, or 2 pipeline stages) trains like one process, fp32, to 1e-5 relative.

    PyTorch's context_parallel cuts each sequence into 4 chunks, rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2
    (causal load balancing), ring attention runs over the two (on CPU through the script's CPU kernel route); the
    model sees the positions of its own tokens. A wrong split, position, attention merge or gradient average (cp
    ranks shard the model states with the data-parallel ones) shows in the losses.
    """
    p = _tp_plan(1, gpus, **_dims(cand))
    assert layout_of(p, RenderOptions(candidate=cand)).global_batch == 4
    assert shared.runs[f"cp-{cand}"].world == gpus
    out = shared.output(f"cp-{cand}")
    assert f"fsdp2 on {gpus} ranks (cpu), fp32" in out and f"mesh {mesh}" in out
    losses = [loss for _, loss in _assert_trained(out, 1, 5)]
    assert losses[-1] < losses[0] - 0.2, f"the loss did not go down: {losses}"
    assert losses == pytest.approx(one_process_losses, rel=1e-5)


@pytest.mark.slow
@needs_torch
@pytest.mark.parametrize(
    ("cand", "gpus", "mesh"), [("fsdp2+ep2", 2, "dp_shard=2"), ("zero1+pp2+ep2", 4, "pp=2 x dp_shard=2")]
)
def test_ep_script_has_the_losses_of_one_process(
    shared: SharedLaunches, one_process_moe_losses: list[float], cand: str, gpus: int, mesh: str
) -> None:
    """Equal math: ep 2 over 2 data-parallel ranks (and zero1+pp2+ep2, Mixtral's recommended composition scaled
    down to 4 processes) trains the mixture of experts like one process holding every expert, fp32, to 1e-5.

    Each rank keeps 4 of the 8 experts; tokens travel to their experts' rank and back by all-to-all; the experts'
    gradients sum every rank's tokens and are divided by the data-parallel size. A wrong dispatch, regrouping,
    combine or gradient scale shows in the losses.
    """
    assert shared.runs[f"ep-{cand}"].world == gpus
    out = shared.output(f"ep-{cand}")
    assert f"{cand.split('+')[0]} on {gpus} ranks (cpu), fp32" in out and f"mesh {mesh}" in out
    losses = [loss for _, loss in _assert_trained(out, 1, 5)]
    assert losses[-1] < losses[0] - 0.2, f"the loss did not go down: {losses}"
    assert losses == pytest.approx(one_process_moe_losses, rel=1e-5)


BF16_CP_EP = [("fsdp2+cp2", "gpt2", "selective"), ("fsdp2+ep2", "mixtral-8x7b", "full")]


@pytest.mark.slow
@needs_torch
@pytest.mark.parametrize(("cand", "model", "checkpointing"), BF16_CP_EP)
def test_cp_and_ep_scripts_train_and_resume_bf16_with_activation_checkpointing(
    shared: SharedLaunches, cand: str, model: str, checkpointing: str
) -> None:
    """bf16-mixed, activation checkpointing (recomputed inside the sequence split / with the all-to-alls), DCP
    checkpoints of the sequence-sharded and expert-split states, resumed (train then resume in the shared launch:
    why that proves the resume, the ddp test)."""
    _assert_resumed(shared.output(f"bf16-{cand}"), shared.output(f"bf16-{cand}-resumed"), 4, 6)
    assert len(list((shared.folder(f"bf16-{cand}") / "ckpt" / "step-6").glob("*.distcp"))) == 2  # one per rank


@pytest.mark.slow
@needs_torch
def test_fp16_pp_script_scales_the_loss_across_stages_and_trains_like_data_parallelism(
    shared: SharedLaunches, dp_losses: list[float]
) -> None:
    """fp16-mixed under pp2: the last stage scales the loss, every stage unscales its gradients with the one
    ShardedGradScaler (overflow checks on all ranks); the losses follow the fp32 dp 2 reference to fp16's precision."""
    source = shared.runs["fp16-pp"].source
    assert "def scaled_loss(" in source and "scaler.update()" in source
    out = shared.output("fp16-pp")
    assert "fsdp2 on 2 ranks (cpu), fp16-mixed" in out
    losses = [loss for _, loss in _assert_trained(out, 1, 5)]
    assert losses[-1] < losses[0] - 0.2, f"the loss did not go down: {losses}"
    assert losses == pytest.approx(dp_losses, rel=1e-4)
