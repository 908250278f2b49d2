"""Issue 23: the public surface keeps its promises.

``jupyter_dist.plan()`` twice and the lazy top-level classes; one owner for every list of names (candidate names,
precision spellings, FSDP1 sharding, the JD_* variables); composite candidate names (``fsdp2+tp2+sp``) carried to the
workers without dropping a dimension; single-typed ``Run.diagnosis()`` and ``jd.start_step()``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from IPython.core.error import UsageError

from jupyter_dist.errors import JupyterDistError, ParallelismError, PlanInputError
from jupyter_dist.plan import Hardware, TrainingShape, plan
from jupyter_dist.plan.candidates import RUNNABLE, CandidateName, parse_candidate, resolve_launch, runnable_problem
from jupyter_dist.worker._env import WorkerEnv

ROOT = Path(__file__).resolve().parents[1]


def _run_py(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


# --------------------------------------------------------------------------- item 1: plan() twice, lazy classes
def test_every_public_entry_point_works_twice_whatever_was_imported_first() -> None:
    out = _run_py(
        """
        import json, sys
        from jupyter_dist.plan import ModelSpec          # the README's import, before the first call
        import jupyter_dist
        heavy = ("torch", "IPython", "ipywidgets", "jupyter_dist.launch.run", "jupyter_dist.ui.wizard")
        light = sorted(m for m in heavy if m in sys.modules)
        p1 = jupyter_dist.plan("gpt2", "cpu")
        p2 = jupyter_dist.plan("gpt2", "cpu")
        p3 = jupyter_dist.plan.plan(ModelSpec.from_params(1e6), "cpu")
        from jupyter_dist import Plan, Run, Pool, Wizard, Dashboard, open_run, start_run, render_bundle
        from jupyter_dist.errors import JupyterDistError
        res = {"light": light, "plans": [isinstance(p, jupyter_dist.Plan) for p in (p1, p2, p3)],
               "same": p1.recommended == p2.recommended,
               "classes": [isinstance(c, type) for c in (Plan, Run, Pool, Wizard, Dashboard)]}
        w1, w2 = jupyter_dist.Wizard(model="gpt2", gpu="cpu"), jupyter_dist.Wizard(model="gpt2", gpu="cpu")
        res["wizards"] = [isinstance(w, Wizard) for w in (w1, w2)]
        errs = []
        for _ in range(2):
            for f in (lambda: jupyter_dist.open_run("/nonexistent/run"),
                      lambda: jupyter_dist.Dashboard("/nonexistent/run")):
                try:
                    f()
                except JupyterDistError as e:
                    errs.append(type(e).__name__)
        res["errors"] = errs
        res["bundle"] = [type(jupyter_dist.render_bundle(p1)).__name__ for _ in range(2)]
        res["dir"] = all(n in dir(jupyter_dist) for n in ("Plan", "Run", "Pool", "Wizard", "Dashboard"))
        print(json.dumps(res))
        """
    )
    res = json.loads(out.strip().splitlines()[-1])
    assert res["light"] == [], "importing jupyter_dist.plan / jupyter_dist must stay light"
    assert res["plans"] == [True, True, True] and res["same"]
    assert res["classes"] == [True] * 5 and res["wizards"] == [True, True]
    assert len(res["errors"]) == 4, res
    assert res["bundle"] == ["Bundle", "Bundle"] and res["dir"]


def test_an_unknown_top_level_name_is_an_attribute_error() -> None:
    import jupyter_dist

    with pytest.raises(AttributeError, match="no attribute 'Plans'"):
        jupyter_dist.Plans  # noqa: B018


# --------------------------------------------------------------------------- item 3: candidate names
PLANS = [
    ("gpt2", Hardware.from_names("cpu", gpus_per_node=4), None),
    ("llama-3-70b", Hardware.from_names("a100-80gb", gpus_per_node=8, nodes=4), None),
    ("mixtral-8x7b", Hardware.from_names("h100-80gb", gpus_per_node=8, nodes=2), None),
    ("llama-3-8b", Hardware.from_names("h100-80gb", gpus_per_node=8, nodes=2), TrainingShape(seq_len=65536)),
]


@pytest.mark.parametrize("model,hw,shape", PLANS, ids=[p[0] for p in PLANS])
def test_every_candidate_name_the_planner_prints_parses_back_to_its_dims(model: str, hw: Hardware, shape: Any) -> None:
    p = plan(model, hw, shape)
    assert len(p.candidates) > 5
    for c in p.candidates:
        parsed = parse_candidate(c.name)
        assert parsed.name == c.name and parsed.strategy == c.strategy
        assert (parsed.tp, parsed.pp, parsed.cp, parsed.ep, parsed.sp) == (c.dims.tp, c.dims.pp, c.dims.cp,
                                                                          c.dims.ep, c.dims.sp)  # fmt: skip
        assert parsed.dims_for(p.world_size) == c.dims


def test_parse_candidate_is_strict_and_says_what_is_valid() -> None:
    assert parse_candidate("FSDP2+sp+tp2").name == "fsdp2+tp2+sp"  # any order, canonical name back
    assert parse_candidate("hsdp+tp2").name == "fsdp2-hybrid+tp2"  # aliases of the base
    assert parse_candidate("none+tp2").spec is None
    for bad, msg in [("zero2+tp2", "zero2 does not combine with tp/pp/cp/ep"), ("fsdp2+tp2+tp4", "tp appears twice"),
                     ("fsdp2+sp", "needs tp >= 2"), ("fsdp2+tp0", "tp must be a positive integer"),
                     ("fsdp2+xx2", "'xx2' in 'fsdp2+xx2' is not a degree"), ("nope+tp2", "unknown strategy 'nope'"),
                     ("", "empty strategy name")]:  # fmt: skip
        with pytest.raises(PlanInputError, match=re.escape(msg)) as info:
            parse_candidate(bad)
        assert "\n" not in str(info.value)
        if "degree" in msg or "unknown" in msg or "empty" in msg or "twice" in msg:
            assert "fsdp2+tp2+sp" in str(info.value)  # the valid forms, by example


# a shape where the plan's answer is fsdp2+tp2+sp: with every second block checkpointed at sequence 2048 plain fsdp2
# fits since FSDP2's gradients reuse memory backward frees (docs/gpu.md); at 4096 tensor parallelism is needed again
P70_SHAPE = TrainingShape(seq_len=4096, checkpointing="layer:2")


def test_a_plan_on_fewer_processes_is_a_rehearsal_that_keeps_every_model_parallel_degree() -> None:
    p = plan("llama-3-70b", PLANS[1][1], P70_SHAPE)
    assert p.recommended == "fsdp2+tp2+sp" and p.world_size == 32
    c = resolve_launch("auto", p, 4, nproc_per_node=4)
    assert c.worker_fields() == {"strategy": "fsdp2", "tp": 2, "pp": 1, "cp": 1, "ep": 1, "sp": True,
                                 "dp_replicate": 1}  # fmt: skip
    assert c.mesh() == "mesh: dp_shard=2 x tp=2 (4 processes), sequence parallel on"
    assert c.note == "rehearsal of fsdp2+tp2+sp (planned for 32 processes) on 4: keeps tp2+sp; dp from 16 to 2"
    assert resolve_launch("auto", p, 32, nproc_per_node=8).note is None
    with pytest.raises(ParallelismError, match=r"needs a multiple of tp x pp x cp = 2 processes; 3 given"):
        resolve_launch("auto", p, 3)
    with pytest.raises(ParallelismError, match=r"tp x pp x cp = 8 processes; 4 given"):
        resolve_launch("fsdp2+tp8+sp", p, 4)


def test_what_cannot_run_yet_is_refused_in_one_line_from_one_table() -> None:
    refusals = {
        "ddp+tp2": "tensor parallelism with ddp (tp2) cannot run (torch's DDP cannot take DTensors); run the "
                   "fsdp2+tp2 or zero1+tp2 candidate",
        "ddp+pp2": "pipeline parallelism with ddp (pp2) cannot run; run the fsdp2+pp2 or zero1+pp2 candidate",
        "ddp+cp2": "context parallelism with ddp (cp2) cannot run; run the fsdp2+cp2 candidate",
        "ddp+ep4": "expert parallelism with ddp (ep4) cannot run; run the fsdp2+ep4 candidate",
    }  # fmt: skip
    for name, msg in refusals.items():
        assert msg in (runnable_problem(parse_candidate(name)) or "")
        with pytest.raises(ParallelismError, match=re.escape(msg)):
            resolve_launch(name, None, 8)
    runnable = ("fsdp2+tp2+sp", "none+tp2", "fsdp2-hybrid+tp2", "fsdp-shard-grad-op", "zero3", "fsdp2+cp2",
                "fsdp2+tp2+cp2+sp", "fsdp2+tp4+pp2+sp", "fsdp2+pp2", "fsdp2+ep4", "fsdp2+pp2+cp2",
                # zero1 with model parallelism: FSDP2 without resharding after forward (ZeRO-1's memory or less)
                "zero1+tp4+pp2+sp", "zero1+tp2+sp", "zero1+cp2", "zero1+ep4")  # fmt: skip
    for name in runnable:
        assert runnable_problem(parse_candidate(name)) is None, name
    # the table is the one switch: flipping pp off makes fsdp2+pp2 refused
    saved = RUNNABLE["pp"]
    try:
        RUNNABLE["pp"] = (frozenset(), saved[1])
        assert "pipeline parallelism" in (runnable_problem(parse_candidate("fsdp2+pp2")) or "")
    finally:
        RUNNABLE["pp"] = saved
    # explicit degrees override the name's, on purpose; --sp alone needs a tp
    assert resolve_launch("fsdp2+tp4+pp2+sp", None, 8, degrees={"pp": 1}).candidate.name == "fsdp2+tp4+sp"
    assert resolve_launch("fsdp2+tp2+sp", None, 4, degrees={"tp": 1}).candidate.name == "fsdp2"
    with pytest.raises(ParallelismError, match="--sp needs tensor parallelism"):
        resolve_launch("fsdp2", None, 4, degrees={"sp": True})
    with pytest.raises(ParallelismError, match="--tp must be a positive integer"):
        resolve_launch("fsdp2", None, 4, degrees={"tp": 0})


def test_hybrid_with_tp_replicates_across_nodes() -> None:
    c = resolve_launch("fsdp2-hybrid+tp2+sp", None, 16, nproc_per_node=4)  # 4 nodes x 4: tp2 inside, dp 8
    assert (c.dims.dp, c.dp_replicate) == (8, 4)
    assert c.mesh() == "mesh: dp_replicate=4 x dp_shard=2 x tp=2 (16 processes), sequence parallel on"
    env = WorkerEnv.for_launch(world_size=16, **c.worker_fields()).to_environ()
    assert env["JD_DP_REPLICATE"] == "4" and env["JD_TP"] == "2" and env["JD_STRATEGY"] == "fsdp2-hybrid"


def test_the_degrees_divide_the_world_check_is_one_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 34: the planner, a launch and the worker (its contract and its mesh) ask ``ParallelDims.split`` whether
    tp x pp x cp divides the processes; each words the same refusal for its reader, from the numbers it carries."""
    pytest.importorskip("torch")
    from jupyter_dist.plan.parallel import DegreesDoNotDivide, ParallelDims
    from jupyter_dist.worker._env import WorkerError
    from jupyter_dist.worker._parallel import build_mesh

    calls: list[tuple[int, int]] = []
    real = ParallelDims.split

    def spy(world_size: int, **degrees: Any) -> int:
        calls.append((world_size, degrees.get("tp", 1)))
        return real(world_size, **degrees)

    monkeypatch.setattr(ParallelDims, "split", staticmethod(spy))
    torchrun = {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    sites: list[tuple[Any, type[Exception], str]] = [
        (lambda: ParallelDims.from_world(4, tp=3), DegreesDoNotDivide,
         "tp (3) x pp (1) x cp (1) = 3 does not divide world size 4; choose degrees whose product divides 4"),
        (lambda: parse_candidate("fsdp2+tp3").dims_for(4), ParallelismError,
         "fsdp2+tp3 needs a multiple of tp x pp x cp = 3 processes; 4 given"),
        (lambda: WorkerEnv.from_environ({**torchrun, "JD_TP": "3"}), WorkerError,
         "pp (1) x dp_replicate (1) x cp (1) x tp (3) = 3 does not divide WORLD_SIZE=4; launch a multiple of 3 "
         "processes"),
        (lambda: build_mesh(WorkerEnv(distributed=False, world_size=4, tp=3, strategy="fsdp2-hybrid"), "cpu"),
         WorkerError, "fsdp2-hybrid: LOCAL_WORLD_SIZE 1 does not divide WORLD_SIZE 4, or pp x cp x tp (3) does not"),
    ]  # fmt: skip
    for site, kind, message in sites:
        calls.clear()
        with pytest.raises(kind) as info:
            site()
        assert str(info.value) == message and calls == [(4, 3)], (message, calls)
    assert WorkerEnv.from_environ({**torchrun, "JD_TP": "2", "JD_SP": "1"}).dims == ParallelDims(dp=2, tp=2, sp=True)


# --------------------------------------------------------------------------- item 2: one owner per list
def test_to_environ_is_read_back_by_from_environ_and_writes_only_what_differs() -> None:
    env = WorkerEnv.for_launch(world_size=8, strategy="fsdp2", precision="bf16-mixed", tp=2, pp=2, sp=True,
                               dp_replicate=2, heartbeat_s=0.5, checkpoint_every=10, keep=3, async_save=True,
                               ds_config="/x/ds.json", run_dir="/x")  # fmt: skip
    out = env.to_environ()
    assert out["JD_TP"] == "2" and out["JD_PP"] == "2" and out["JD_SP"] == "1" and out["JD_DP_REPLICATE"] == "2"
    assert "JD_CP" not in out and "JD_EP" not in out and "JD_LOG_STDIO" not in out
    torchrun = {"RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "h", "MASTER_PORT": "1", "LOCAL_WORLD_SIZE": "1"}
    back = WorkerEnv.from_environ({**out, **torchrun})
    for f in ("strategy", "precision", "tp", "pp", "cp", "ep", "sp", "dp_replicate", "heartbeat_s",
              "checkpoint_every", "keep", "async_save", "ds_config", "run_dir"):  # fmt: skip
        assert getattr(back, f) == getattr(env, f), f
    assert WorkerEnv.for_launch(strategy="ddp").to_environ() == {"JD_STRATEGY": "ddp", "JD_PRECISION": "fp32"}
    with pytest.raises(JupyterDistError, match="does not divide WORLD_SIZE=6"):
        WorkerEnv.for_launch(world_size=6, strategy="fsdp2", tp=4)


def test_no_launch_path_types_the_jd_contract_variables_by_hand() -> None:
    contract = ["JD_STRATEGY", "JD_PRECISION", "JD_DS_CONFIG", "JD_TP", "JD_PP", "JD_CP", "JD_EP", "JD_SP",
                "JD_DP_REPLICATE", "JD_CHECKPOINT_EVERY", "JD_KEEP", "JD_ASYNC_SAVE", "JD_HEARTBEAT_S",
                "JD_TELEMETRY_INTERVAL_S", "JD_TELEMETRY_STDOUT"]  # fmt: skip
    offenders = []
    pkg = ROOT / "jupyter_dist"
    for path in [*(pkg / "launch").rglob("*.py"), *(pkg / "ui").glob("*.py"), *(pkg / "magics").glob("*.py"),
                 *(pkg / "pool").glob("*.py")]:  # fmt: skip
        for var in contract:
            for m in re.finditer(rf"[\"']{var}[\"']\s*[:\]]", path.read_text()):  # a dict key or a subscript write
                offenders.append(f"{path.name}: {m.group(0)}")
    assert offenders == [], "write JD_* through WorkerEnv.to_environ(): " + ", ".join(offenders)


def test_precision_and_fsdp1_names_have_one_owner() -> None:
    from jupyter_dist.plan.strategies import FSDP1_SHARDING, STRATEGIES
    from jupyter_dist.plan.training import Precision, precision_names
    from jupyter_dist.render import torch_code
    from jupyter_dist.worker._env import PRECISIONS

    assert list(PRECISIONS) == precision_names() == [p.value for p in Precision]
    assert torch_code.FSDP1_SHARDING is FSDP1_SHARDING
    assert set(FSDP1_SHARDING) == {s.name for s in STRATEGIES.values() if s.family == "fsdp"}
    for src in ("jupyter_dist/cli/flags.py", "jupyter_dist/ui/wizard.py", "jupyter_dist/render/torch_code.py",
                "jupyter_dist/worker/_env.py"):  # fmt: skip
        text = (ROOT / src).read_text()
        assert '"bf16-mixed", "fp16-mixed"' not in text and "bf16-mixed, fp16-mixed, bf16-true" not in text, src
        assert '"SHARD_GRAD_OP"' not in text, src


# --------------------------------------------------------------------------- item 3 through the magic
@pytest.fixture()
def big_plan(ip: Any) -> Any:
    p = plan("llama-3-70b", PLANS[1][1], P70_SHAPE)
    ip.user_ns["p70"] = p
    return p


def test_dist_train_plan_on_fewer_processes_carries_tp_and_sp_and_says_so(ip: Any, runs: Path, big_plan: Any) -> None:
    dry = ip.run_cell_magic("dist_train", "--plan p70 --nproc 4 --dry-run", "pass")
    assert {k: dry.env[k] for k in dry.env if k.startswith("JD_") and k not in ("JD_RUN_DIR", "JD_PATH")} == {
        "JD_STRATEGY": "fsdp2", "JD_PRECISION": "bf16-mixed", "JD_TP": "2", "JD_SP": "1",
        "JD_AC": "layer:2"}  # fmt: skip
    text = dry.to_text()
    assert "# mesh: dp_shard=2 x tp=2 (4 processes), sequence parallel on" in text
    assert "# rehearsal of fsdp2+tp2+sp (planned for 32 processes) on 4: keeps tp2+sp; dp from 16 to 2" in text
    with pytest.raises(UsageError, match=r"fsdp2\+tp2\+sp needs a multiple of tp x pp x cp = 2 processes; 3 given"):
        ip.run_cell_magic("dist_train", "--plan p70 --nproc 3 --dry-run", "pass")
    # a named candidate of the plan, and the flags
    dry = ip.run_cell_magic("dist_train", "--plan p70 --strategy fsdp2+tp4+sp --nproc 8 --dry-run", "pass")
    assert dry.env["JD_TP"] == "4" and "dp from 8 to 2" in dry.to_text()
    dry = ip.run_cell_magic("dist_train", "--strategy fsdp2 --tp 2 --sp --nproc 4 --heartbeat 0.5 --dry-run", "pass")
    assert dry.env["JD_TP"] == "2" and dry.env["JD_SP"] == "1" and dry.env["JD_HEARTBEAT_S"] == "0.5"
    dry = ip.run_cell_magic("dist_train", "--strategy zero1+tp2+pp2+sp --nproc 8 --dry-run", "pass")
    assert {k: dry.env.get(k) for k in ("JD_STRATEGY", "JD_TP", "JD_PP", "JD_SP", "JD_DS_CONFIG")} == {
        "JD_STRATEGY": "zero1", "JD_TP": "2", "JD_PP": "2", "JD_SP": "1", "JD_DS_CONFIG": None}  # fmt: skip
    assert "ds_config.json" not in dry.files  # runs as FSDP2 without resharding: no DeepSpeed engine
    with pytest.raises(UsageError, match=re.escape("tensor parallelism with ddp (tp2) cannot run")):
        ip.run_cell_magic("dist_train", "--strategy ddp+tp2 --nproc 4 --dry-run", "pass")
    dry = ip.run_cell_magic("dist_train", "--strategy fsdp2+tp2+pp2+sp --nproc 4 --dry-run", "pass")
    assert dry.env["JD_PP"] == "2" and "pp=2" in dry.to_text()
    dry = ip.run_cell_magic("dist_train", "--strategy fsdp2+tp2+pp2+sp --pp 1 --nproc 4 --dry-run", "pass")
    assert "JD_PP" not in dry.env and dry.env["JD_TP"] == "2"
    with pytest.raises(UsageError, match="argument --tp: want an integer in 1..1024, got '0'"):
        ip.run_cell_magic("dist_train", "--tp 0 --nproc 2 --dry-run", "pass")


def test_every_name_the_cpu_planner_prints_is_known_to_dist_train(ip: Any, runs: Path) -> None:
    p = plan("gpt2", Hardware.from_names("cpu", gpus_per_node=4))
    for c in p.candidates:
        problem = runnable_problem(parse_candidate(c.name))
        try:
            dry = ip.run_cell_magic("dist_train", f"--strategy {c.name} --nproc 4 --dry-run", "pass")
        except UsageError as exc:
            assert problem is not None and str(exc) == problem, (c.name, str(exc))
            continue
        assert problem is None, c.name
        assert dry.env["JD_STRATEGY"] == c.strategy
        assert dry.env.get("JD_TP", "1") == str(c.dims.tp) and dry.env.get("JD_SP") == ("1" if c.dims.sp else None)
        assert WorkerEnv.from_environ({**dry.env, "JD_RUN_DIR": ""}).strategy == c.strategy  # the worker reads it


LARGE_PLANS = {  # model: (gpus per node, nodes, training shape, what its candidates must include)
    "mixtral-8x7b": (8, 2, {}, ("ep",)),  # expert parallelism
    "llama-3-8b": (8, 2, {"seq_len": 65536}, ("cp",)),  # context parallelism; recommended fsdp2-hybrid+cp16
    "llama-3-70b": (8, 4, {}, ("tp", "pp")),
    "llama-3.1-405b": (8, 32, {}, ("tp", "pp")),
}  # fmt: skip


@pytest.mark.parametrize("model", list(LARGE_PLANS))
def test_every_candidate_of_a_large_plan_dry_runs_with_its_mesh(ip: Any, runs: Path, model: str) -> None:
    """Every candidate the planner prints for an MoE model (ep), a long sequence (cp) and 70B / 405B (tp, pp) on
    H100 nodes is accepted by ``%%dist_train --plan p --strategy NAME --dry-run`` in a real shell, and the launch
    environment carries its degrees: JD_TP/PP/CP/EP/SP as the name says, and for the hybrid strategies the replica
    count whose shard groups are the ones the planner's memory assumed."""
    gpn, nodes, shape, kinds = LARGE_PLANS[model]
    p = plan(model, Hardware.from_names("h100", gpus_per_node=gpn, nodes=nodes), TrainingShape(**shape))
    ip.user_ns["p"] = p
    names = [c.name for c in p.candidates]
    for kind in kinds:
        assert any(re.search(rf"\+{kind}\d", n) for n in names), (kind, names)
    if model == "llama-3-8b":
        assert p.recommended == "fsdp2-hybrid+cp16"
    defaults = {"JD_TP": "1", "JD_PP": "1", "JD_CP": "1", "JD_EP": "1", "JD_SP": "0", "JD_DP_REPLICATE": "1"}
    for c in p.candidates:
        line = f"--plan p --strategy {c.name} --nproc {gpn} --nodes {nodes} --dry-run"
        try:
            dry = ip.run_cell_magic("dist_train", line, "pass")
        except UsageError as exc:
            pytest.fail(f"{model}: %%dist_train {line} refused: {exc}")
        d = c.dims
        want = {"JD_STRATEGY": c.strategy, "JD_TP": str(d.tp), "JD_PP": str(d.pp), "JD_CP": str(d.cp),
                "JD_EP": str(d.ep), "JD_SP": "1" if d.sp else "0",
                "JD_DP_REPLICATE": str(d.hybrid_replicas(gpn) if c.strategy == "fsdp2-hybrid" else 1)}  # fmt: skip
        got = {k: dry.env.get(k, defaults.get(k)) for k in want}
        assert got == want, (model, c.name, got, want)
        env = WorkerEnv.from_environ({**dry.env, "JD_RUN_DIR": ""})  # the worker reads it back
        assert (env.strategy, env.tp, env.pp, env.cp, env.ep, env.sp) == (c.strategy, d.tp, d.pp, d.cp, d.ep, d.sp)
        if c.strategy == "fsdp2-hybrid":  # FSDP2 shards over dp_shard x cp: the group the plan's memory counted
            dp_shard = gpn * nodes // (d.pp * int(want["JD_DP_REPLICATE"]) * d.cp * d.tp)
            assert dp_shard * d.cp == c.settings["shard_group_size"], (c.name, dp_shard, c.settings)
    # the plan's pipeline schedule travels with it (its memory and bubble are that schedule's)
    if "pp" in kinds:
        q = plan(model, Hardware.from_names("h100", gpus_per_node=gpn, nodes=nodes),
                 TrainingShape(**shape, pp_schedule="interleaved-1f1b"))  # fmt: skip
        ip.user_ns["q"] = q
        name = next(c.name for c in q.candidates if c.dims.pp > 1)
        dry = ip.run_cell_magic("dist_train", f"--plan q --strategy {name} --nproc {gpn} --nodes {nodes} --dry-run",
                                "pass")  # fmt: skip
        assert dry.env["JD_PP_SCHEDULE"] == "interleaved-1f1b"


CP_CELL = """
import torch
import torch.nn.functional as F

from jupyter_dist.models import Transformer

VOCAB, SEQ, BATCH = 64, 16, 4
torch.manual_seed(0)
net = Transformer(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2)
model, opt = jd.wrap(net, torch.optim.AdamW(net.parameters(), lr=3e-3))
for step in range(12):
    g = torch.Generator().manual_seed(step * jd.dp_size + jd.dp_rank)
    tokens = (torch.randint(0, VOCAB, (BATCH, 1), generator=g) + torch.arange(SEQ + 1)) % VOCAB
    loss = jd.train_step(tokens[:, :-1], tokens[:, 1:],
                         lambda out, y: F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1)))
    jd.log(step, loss=loss, tokens=BATCH * SEQ)
if jd.is_main:
    print(f"final loss {loss.item():.3f} mesh {jd.mesh.describe()}")
"""


@pytest.mark.slow
def test_a_cp_candidate_launches_from_the_magic(ip: Any, runs: Path) -> None:
    """``%%dist_train --strategy fsdp2+cp2`` (what the planner prints for long sequences, scaled down) in a real
    shell: 2 CPU processes on gloo with PyTorch's ring attention, the loss falls, the mesh is the candidate's."""
    from conftest import descendants_gone

    run = ip.run_cell_magic("dist_train", "--strategy fsdp2+cp2 --nproc 2 --name cp_launch --timeout 300 "
                            "--no-dashboard", CP_CELL)  # fmt: skip
    assert run.wait(300) == "succeeded", run.logs()
    assert json.loads((run.dir / "run.json").read_text())["env"]["JD_CP"] == "2"
    steps = [r for r in run.records("step") if r["rank"] == 0]  # coalesced by the telemetry interval
    assert max(r["step"] for r in steps) == 11 and steps[-1]["loss"] < steps[0]["loss"], steps
    assert "mesh dp_shard=1 x cp=2" in run.logs(0), run.logs(0)[-2000:]
    assert descendants_gone(run)


@pytest.mark.slow
def test_the_wizard_launches_a_pipeline_candidate(ip: Any, runs: Path) -> None:
    """The wizard's Launch of the ``fsdp2+pp2`` candidate it lists for gpt2 on 2 CPU processes runs the step-form
    cell as a pipeline (JD_PP=2, the plan's schedule, stage meshes) and finishes."""
    from conftest import descendants_gone
    from test_pipeline_parallel import STEP_CELL

    from jupyter_dist.ui.wizard import Wizard

    w = Wizard(model="gpt2", gpu="cpu", gpus_per_node=2, code="STEPS = 6\n" + STEP_CELL, runs_dir=runs, shell=ip)
    assert "fsdp2+pp2" in [c.name for c in w.plan.candidates]
    w.candidate.value = "fsdp2+pp2"
    w.run_name.value = "wiz_pp2"
    run = w.launch(timeout=300)
    assert run is not None, w.launch_msg.value
    assert run.candidate == "fsdp2+pp2" and "--strategy fsdp2+pp2" in w.train_line
    assert run.wait(300) == "succeeded", run.logs()
    env = json.loads((run.dir / "run.json").read_text())["env"]
    assert (env["JD_STRATEGY"], env["JD_PP"]) == ("fsdp2", "2")
    assert "mesh pp=2 x dp_shard=1" in run.logs(0), run.logs(0)[-2000:]
    assert max(r["step"] for r in run.records("step") if r["rank"] == 0) == 5
    if w.dashboard is not None:
        w.dashboard.stop() if hasattr(w.dashboard, "stop") else None
    assert descendants_gone(run)


def test_a_pool_carries_a_composite_candidate_too(runs: Path) -> None:
    from jupyter_dist.pool.kernel import Pool

    pool = Pool(nproc=4, strategy="fsdp2+tp2+sp", runs_dir=runs)
    env = pool.dry_run().env
    assert (env["JD_STRATEGY"], env["JD_TP"], env["JD_SP"], env["JD_POOL"]) == ("fsdp2", "2", "1", "1")
    assert Pool(nproc=4, strategy="fsdp2+ep2", runs_dir=runs).dry_run().env["JD_EP"] == "2"
    assert Pool(nproc=4, strategy="zero1+ep2", runs_dir=runs).dry_run().env["JD_EP"] == "2"  # FSDP2, no reshard
    with pytest.raises(JupyterDistError, match="expert parallelism with ddp"):
        Pool(nproc=4, strategy="ddp+ep2", runs_dir=runs)


@pytest.mark.slow
def test_the_wizard_launches_fsdp1_and_composite_candidates(ip: Any, runs: Path) -> None:
    from conftest import descendants_gone

    from jupyter_dist.ui.wizard import Wizard

    w = Wizard(model="gpt2", gpu="cpu", gpus_per_node=2, code="print('hello', jd.rank)", runs_dir=runs, shell=ip)
    names = [c.name for c in w.plan.candidates]
    assert "fsdp-shard-grad-op" in names and "fsdp2+tp2+sp" in names
    for name, env in (("fsdp-shard-grad-op", {"JD_STRATEGY": "fsdp-shard-grad-op"}),
                      ("fsdp2+tp2+sp", {"JD_STRATEGY": "fsdp2", "JD_TP": "2", "JD_SP": "1"})):  # fmt: skip
        w.candidate.value = name
        w.run_name.value = "wiz_" + re.sub(r"\W", "_", name)
        run = w.launch(timeout=120)
        assert run is not None, w.launch_msg.value
        assert run.candidate == name and f"({name}, 1 x 2 processes)" in w.launch_msg.value
        assert f"--strategy {name}" in w.train_line
        assert run.wait(120) == "succeeded", run.logs()
        meta_env = json.loads((run.dir / "run.json").read_text())["env"]
        assert {k: meta_env.get(k) for k in env} == env
        assert descendants_gone(run)


# --------------------------------------------------------------------------- item 4: single-typed results
def test_diagnosis_of_a_hung_run_is_a_diagnosis(tmp_path: Path) -> None:
    from jupyter_dist.launch.run import open_run
    from jupyter_dist.telemetry.diagnose import Diagnosis

    rd = tmp_path / "run-hung"
    (rd / "logs").mkdir(parents=True)
    (rd / "telemetry").mkdir()
    (rd / "run.json").write_text(json.dumps({"name": "run-hung", "status": "hung", "world_size": 2, "nproc": 2,
                                             "nodes": 1, "strategy": "none", "candidate": "none"}))  # fmt: skip
    report = {"kind": "hang", "culprit": 1, "stalled_s": 4.2, "reason": "rank 1 issued fewer collectives",
              "where": {"1": "script.py:7: time.sleep(600)"}, "stacks": {"0": "...", "1": "..."}}  # fmt: skip
    (rd / "diagnosis.json").write_text(json.dumps(report))
    run = open_run(rd)
    d = run.diagnosis()
    assert isinstance(d, Diagnosis) and d.first_rank == 1 and d.basis == "hang" and d.hang == report
    assert d.summary().startswith("Hung: no step for 4.2 s (rank 1 fell behind)") and "script.py:7" in d.summary()
    assert d.to_dict()["hang"]["culprit"] == 1 and run.strategy == "none" and run.candidate == "none"


def test_start_step_is_an_int_before_and_after_a_checkpoint(tmp_path: Path) -> None:
    out = _run_py(
        f"""
        import torch, jupyter_dist.worker as jd
        model = torch.nn.Linear(2, 2)
        model, opt = jd.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
        root = {str(tmp_path / "ck")!r}
        first = jd.start_step(root=root)
        jd.save({{"model": model, "optimizer": opt}}, 4, root=root)
        print(first, jd.start_step(root=root), jd.resume(root=root)[1])
        """
    )
    assert out.split()[-3:] == ["0", "5", "4"]  # start at 0, then the step after the checkpoint; resume() unchanged


def test_candidate_name_validates_its_fields() -> None:
    with pytest.raises(PlanInputError, match="unknown strategy 'zero9'"):
        CandidateName(strategy="zero9")
    assert CandidateName(strategy="fsdp2", tp=2, sp=True).with_degrees(tp=1).name == "fsdp2"
