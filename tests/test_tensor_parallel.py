"""Tensor and sequence parallelism composed with FSDP2 on one device mesh, proven by equal math.

Each parallel run (real torchrun processes on gloo/CPU, the JD_* contract the launcher sets) trains the same model on
the same global batches as a single process; its losses and its final parameters, gathered to one rank, must equal
the single-process run's. The worker script is ``tests/numerics/parallel_train.py``; adding a model to these tests is
adding a builder to its ``MODELS`` and a name to ``MODELS`` below.

SGD with momentum is the optimizer of the element-wise checks: it carries rounding differences linearly, so 1e-5
relative on every element is a check that catches a wrong layout (a wrong split, a missing all-reduce, a doubled
gradient) and nothing else. Adam divides each gradient by its own running magnitude, which turns rounding noise in
near-zero gradients into full-size updates; with AdamW the tests compare each tensor's norm-relative error instead.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_worker import clean_env, run_bounded

torch = pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parent / "numerics" / "parallel_train.py"
MODELS = ("ref", "llama")
RTOL = 1e-5
STEPS = 5
"""Steps of every equal-math run (``parallel_train.py``'s default ``EQ_STEPS``; the hand-written cells' loops)."""
SAVE_AT = 2
"""The step a checkpoint-resume configuration saves at: its resume trains steps ``SAVE_AT + 1`` to ``STEPS - 1``."""
TP_ERRORS = SCRIPT.parent / "tp_errors.py"

pytestmark = pytest.mark.slow


def run(out: Path, model: str, nproc: int | None, timeout: float = 240, **env: str) -> dict:
    """Train with ``nproc`` torchrun processes (``None``: one plain process, no strategy); return the saved result."""
    if nproc is None:
        argv = [sys.executable, str(SCRIPT), str(out), model]
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                str(SCRIPT), str(out), model]  # fmt: skip
    proc = run_bounded(argv, clean_env(**env), timeout, cwd=out.parent)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return torch.load(out, weights_only=False)


def run_singles(where: Path, refs: dict[str, tuple[str, dict[str, str]]], timeout: float = 240) -> dict[str, dict]:
    """One-process references ``{name: (model, env)}``, all trained in one plain process (``parallel_train.py
    --many``, no torchrun, no strategy): each from a fresh runtime and ``torch.manual_seed(0)``, exactly what one
    :func:`run` per reference gives, with the interpreter's start and torch's import paid once instead of per
    reference. Returns ``{name: result}``."""
    spec = [{"out": str(where / f"{name}.pt"), "model": model, "env": env} for name, (model, env) in refs.items()]
    spec_path = where / "singles.json"
    spec_path.write_text(json.dumps(spec))
    proc = run_bounded([sys.executable, str(SCRIPT), "--many", str(spec_path)], clean_env(), timeout * len(refs),
                       cwd=where)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:]
    return {name: torch.load(where / f"{name}.pt", weights_only=False) for name in refs}


def assert_equal_math(ref: dict, got: dict, *, elementwise: bool = True) -> None:
    ref_l, got_l = torch.tensor(ref["losses"]), torch.tensor(got["losses"])
    assert len(got_l) == len(ref_l) == STEPS
    torch.testing.assert_close(got_l, ref_l, rtol=RTOL, atol=0)
    assert sorted(got["params"]) == sorted(ref["params"])
    for name, want in ref["params"].items():
        have = got["params"][name]
        assert have.shape == want.shape, name
        if elementwise:
            scale = want.abs().max()
            err = (have - want).abs().max() / scale
        else:
            err = (have - want).norm() / want.norm()
        assert err <= RTOL, f"{name}: relative error {err:.2e} > {RTOL:.0e} under mesh {got['mesh']}"


def assert_resumed(full: dict, resumed: dict, label: str) -> None:
    """A configuration resumed from ``full``'s checkpoint at step :data:`SAVE_AT` starts at the next step and trains
    the losses the uninterrupted run trained from there (1e-5 relative)."""
    assert resumed["first"] == SAVE_AT + 1, label
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"][SAVE_AT + 1 :]),
                               rtol=RTOL, atol=0, msg=lambda m: f"resumed under {label}: {m}")  # fmt: skip


class Launches:
    """Equal-math configurations of one test module, run in one torchrun launch per world size.

    ``Launches(where, {name: (processes, model, env)})``; ``launches[name]`` is that configuration's result (what
    :func:`run` returns), launching its world size's group on first use: the worker trains the group's
    configurations in sequence (``parallel_train.py --many``), each from a fresh runtime with its own mesh, so the
    start of N processes (interpreters, imports, the process group) is paid once per world size, not per
    configuration. Configurations keep their order (a checkpoint's save runs before its resumes); every assertion
    stays in its own test.
    """

    def __init__(self, where: Path, configs: dict[str, tuple[int, str, dict[str, str]]],
                 per_config_s: float = 120) -> None:  # fmt: skip
        self.where, self.configs, self.per_config_s = where, configs, per_config_s
        self.results: dict[str, dict] = {}
        self.failed: dict[int, str] = {}
        self.stdout: dict[int, str] = {}
        """Each launch's output (every configuration of that world size), by world size."""

    def path(self, name: str) -> Path:
        """Where ``name``'s result is saved (memory measurements sit beside it, ``.rank<r>.json``)."""
        return self.where / f"{name}.pt"

    def __getitem__(self, name: str) -> dict:
        nproc = self.configs[name][0]
        if name not in self.results:
            if nproc in self.failed:
                pytest.fail(self.failed[nproc])
            self._launch(nproc)
        return self.results[name]

    def _launch(self, nproc: int) -> None:
        group = {n: c for n, c in self.configs.items() if c[0] == nproc}
        spec = [{"out": str(self.path(n)), "model": model, "env": env} for n, (_, model, env) in group.items()]
        spec_path = self.where / f"configs-{nproc}.json"
        spec_path.write_text(json.dumps(spec))
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                str(SCRIPT), "--many", str(spec_path)]  # fmt: skip
        try:
            proc = run_bounded(argv, clean_env(), 60 + self.per_config_s * len(group), cwd=self.where)
        except BaseException as e:
            self.failed[nproc] = f"the {nproc}-process launch of {list(group)}: {e}"
            raise
        self.stdout[nproc] = proc.stdout
        if proc.returncode != 0:
            self.failed[nproc] = f"the {nproc}-process launch of {list(group)} failed:\n{proc.stdout[-6000:]}"
            pytest.fail(self.failed[nproc])
        for n in group:
            self.results[n] = torch.load(self.path(n), weights_only=False)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict]:
    """The single-process reference of every model, with SGD and with AdamW."""
    refs = {f"{m}-{opt}": (m, {"EQ_OPT": opt}) for m in MODELS for opt in ("sgd", "adamw")}
    got = run_singles(tmp_path_factory.mktemp("single"), refs)
    return {(m, opt): got[f"{m}-{opt}"] for m in MODELS for opt in ("sgd", "adamw")}


CONFIGS = {
    # name: (processes, JD_* degrees)
    "tp2": (2, {"JD_TP": "2"}),
    "tp2-sp": (2, {"JD_TP": "2", "JD_SP": "1"}),
    "dp2xtp2": (4, {"JD_TP": "2"}),
    "dp2xtp2-sp-ac": (4, {"JD_TP": "2", "JD_SP": "1", "JD_AC": "full"}),
    "hsdp2x2": (4, {"JD_DP_REPLICATE": "2"}),
    "hsdp2xtp2-sp-sac": (4, {"JD_DP_REPLICATE": "2", "JD_TP": "2", "JD_SP": "1", "JD_AC": "selective"}),
}
EXPECTED_MESH = {
    "tp2": "dp_shard=1 x tp=2", "tp2-sp": "dp_shard=1 x tp=2", "dp2xtp2": "dp_shard=2 x tp=2",
    "dp2xtp2-sp-ac": "dp_shard=2 x tp=2", "hsdp2x2": "dp_replicate=2 x dp_shard=2",
    "hsdp2xtp2-sp-sac": "dp_replicate=2 x dp_shard=1 x tp=2",
}  # fmt: skip


MEMORY_CONFIGS = ("dp2xtp2-sp-ac", "hsdp2xtp2-sp-sac")
CKPT_RESUMES = {"dp4": {}, "dp2xtp2": {"JD_TP": "2"}}


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    """Every multi-process run of this module: one launch of 2 processes, one of 4."""
    where = tmp_path_factory.mktemp("launches")
    configs: dict[str, tuple[int, str, dict[str, str]]] = {}
    for model in MODELS:
        for config, (nproc, degrees) in CONFIGS.items():
            configs[f"{model}-{config}"] = (nproc, model, {"JD_STRATEGY": "fsdp2", "EQ_OPT": "sgd", **degrees})
        configs[f"{model}-adamw"] = (4, model, {"JD_STRATEGY": "fsdp2", "JD_TP": "2", "JD_SP": "1", "EQ_OPT": "adamw"})
    configs["bad-data"] = (2, "ref", {"JD_STRATEGY": "fsdp2", "JD_TP": "2", "EQ_OPT": "sgd", "EQ_BAD_DATA": "1"})
    for config in MEMORY_CONFIGS:
        nproc, degrees = CONFIGS[config]
        configs[f"memory-{config}"] = (nproc, "ref", {"JD_STRATEGY": "fsdp2", "EQ_OPT": "adamw", "EQ_MEASURE": "1",
                                                      "EQ_STEPS": "2", **degrees})  # fmt: skip
    common = {"JD_STRATEGY": "fsdp2", "EQ_OPT": "adamw", "EQ_CKPT": str(where / "ckpt")}
    configs["ckpt-full"] = (4, "ref", {"JD_TP": "2", "JD_SP": "1", "EQ_SAVE_AT": str(SAVE_AT), **common})
    for name, degrees in CKPT_RESUMES.items():  # after the save, in the same launch
        configs[f"ckpt-{name}"] = (4, "ref", {"EQ_RESUME": "1", **degrees, **common})
    torch.manual_seed(1)  # not the workers' seed: the weights must come from the folder
    _parallel_train().llama_model().save_pretrained(where / "pre")
    configs["pretrained-meta"] = (4, "llama", {"JD_STRATEGY": "fsdp2", "JD_TP": "2", "JD_SP": "1", "EQ_STEPS": "0",
                                               "EQ_META": "1", "EQ_PRETRAINED": str(where / "pre"),
                                               "EQ_LOGITS": "1"})  # fmt: skip
    # last in the 2-process launch: tp_errors.py run whole, in a fresh runtime
    configs["tp-errors"] = (2, "ref", {"JD_STRATEGY": "fsdp2", "JD_TP": "2", "EQ_SCRIPT": str(TP_ERRORS)})
    return Launches(where, configs)


def _parallel_train():  # noqa: ANN202
    """The worker module, imported here (its model builders and batches)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import parallel_train
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return parallel_train


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("model", MODELS)
def test_parallel_run_equals_single_process(model: str, config: str, single: dict, launches: Launches) -> None:
    got = launches[f"{model}-{config}"]
    assert got["mesh"] == EXPECTED_MESH[config]
    assert_equal_math(single[(model, "sgd")], got)


@pytest.mark.parametrize("model", MODELS)
def test_adamw_under_dp2_tp2_sp_equals_single_process(model: str, single: dict, launches: Launches) -> None:
    got = launches[f"{model}-adamw"]
    assert_equal_math(single[(model, "adamw")], got, elementwise=False)


def test_the_check_catches_tp_ranks_loading_different_batches(single: dict, launches: Launches) -> None:
    """The check can fail: the classic mistake of sharding data by global rank (each tensor-parallel rank sees a
    different batch) runs without an error, but its math differs from the single process."""
    got = launches["bad-data"]
    with pytest.raises(AssertionError):
        assert_equal_math(single[("ref", "sgd")], got)


@pytest.mark.parametrize("config", MEMORY_CONFIGS)
def test_per_rank_memory_equals_the_plan_to_the_byte(config: str, launches: Launches) -> None:
    """Parameters, gradients and AdamW states each rank holds equal the planner's per-rank figures exactly."""
    import json

    from jupyter_dist.models import Transformer
    from jupyter_dist.plan import Hardware, ModelSpec, TrainingShape, get_accelerator, plan

    nproc, degrees = CONFIGS[config]
    launches[f"memory-{config}"]
    out = launches.path(f"memory-{config}")
    spec = ModelSpec.from_module(Transformer, vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2)
    hybrid = "JD_DP_REPLICATE" in degrees
    # HSDP: 2 "nodes" of 2 processes, sharded inside a node (one dp rank there, with tp2), replicated across
    hw = Hardware(accelerator=get_accelerator("cpu"), gpus_per_node=2 if hybrid else 4, nodes=2 if hybrid else 1)
    p = plan(spec, hw, TrainingShape(micro_batch=4, seq_len=16, precision="fp32"),
             strategy="fsdp2-hybrid" if hybrid else "fsdp2", tp=2)  # fmt: skip
    cand = p.candidate(("fsdp2-hybrid" if hybrid else "fsdp2") + "+tp2+sp")
    for rank in range(nproc):
        got = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        want = {"params": cand.memory.params, "grads": cand.memory.grads, "optimizer": cand.memory.optimizer}
        assert got == want, (rank, got, want)


def test_pretrained_hf_checkpoint_loads_sharded_from_meta_with_the_same_logits(launches: Launches) -> None:
    """A tiny HF Llama saved with save_pretrained (seed 1, in the fixture), built on the meta device and loaded under
    dp2 x tp2 + sp (each rank reading its own slices through DCP's HuggingFaceStorageReader), gives the unsharded
    model's logits."""
    from transformers import LlamaForCausalLM

    reference = LlamaForCausalLM.from_pretrained(launches.where / "pre")
    with torch.no_grad():
        want = reference(_parallel_train().batch(0, 8, 16)[:, :-1]).logits
    got = launches["pretrained-meta"]
    assert got["mesh"] == "dp_shard=2 x tp=2"
    torch.testing.assert_close(got["logits"], want, rtol=RTOL, atol=1e-6)


def test_checkpoint_saved_under_tp2_dp2_resumes_under_dp4_and_tp2_dp2(launches: Launches) -> None:
    """DCP checkpoints reshard: saved at step 2 under dp2 x tp2 + sp, resumed under dp4 (no tp) and under dp2 x tp2;
    the next 2 losses equal the uninterrupted run's."""
    full = launches["ckpt-full"]
    assert (launches.where / "ckpt" / f"step-{SAVE_AT}" / "COMPLETE").exists()
    for name in CKPT_RESUMES:
        assert_resumed(full, launches[f"ckpt-{name}"], name)


def test_wrong_tensor_parallel_inputs_get_one_line_each(launches: Launches) -> None:
    """``tp_errors.py`` (each wrong input to ``jd.wrap`` under JD_TP=2), last in the 2-process launch."""
    assert launches["tp-errors"] == {"script": str(TP_ERRORS)}
    out = launches.stdout[2].splitlines()
    lines = {ln.split(":", 1)[0][5:]: ln.split(":", 1)[1] for ln in out if ln.startswith("CASE ")}
    assert "needs a layout for NoPlan" in lines["no-plan"] and "tp_plan=" in lines["no-plan"]
    assert "tp=2 does not divide the attention heads" in lines["heads"] and "(3)" in lines["heads"]
    assert "tp=2 does not divide the vocabulary of Transformer (63)" in lines["vocab"]
    assert "'layers.*.attn.q' matches no submodule" in lines["bad-key"]
    assert "style 'diagonal'" in lines["bad-style"] and "colwise" in lines["bad-style"]
    assert "is not a folder" in lines["no-folder"]


# --------------------------------------------------------------------------------------------- from the notebook
def test_fsdp2_tp2_sp_from_dist_train_plan_and_the_wizard_launch_with_panels_for_four_ranks(ip, runs) -> None:  # noqa: ANN001
    """The planner's fsdp2+tp2+sp candidate, launched from `%%dist_train --plan` and from the wizard's Launch (its
    default cell, the reference transformer), runs on 4 processes as dp2 x tp2 with sequence parallelism, and the
    live panels show all four ranks."""
    pytest.importorskip("anywidget")
    from conftest import descendants_gone

    from jupyter_dist.launch.examples import DEMO_CELL
    from jupyter_dist.models import Transformer
    from jupyter_dist.plan import Hardware, ModelSpec, TrainingShape, get_accelerator, plan
    from jupyter_dist.ui.wizard import Wizard

    spec = ModelSpec.from_module(Transformer, vocab_size=64, dim=64, n_layers=2, n_heads=4)
    p = plan(spec, Hardware(accelerator=get_accelerator("cpu"), gpus_per_node=4),
             TrainingShape(micro_batch=16, seq_len=32, precision="fp32"), strategy="fsdp2", tp=2)  # fmt: skip
    assert p.recommended == "fsdp2+tp2+sp"
    ip.user_ns["tp_plan_p"] = p
    magics = ip.magics_manager.registry["DistMagics"]
    magics.dashboard = "on"
    steps = 12
    try:
        run = ip.run_cell_magic("dist_train", "--plan tp_plan_p --nproc 4 --name tp_magic --heartbeat 0.25 "
                                "--telemetry-interval 0.2 --timeout 240", DEMO_CELL.format(steps=steps))  # fmt: skip
    finally:
        magics.dashboard = "auto"
    assert run.wait(240) == "succeeded", run.logs()
    env = json.loads((run.dir / "run.json").read_text())["env"]
    assert (env["JD_STRATEGY"], env["JD_TP"], env["JD_SP"]) == ("fsdp2", "2", "1")
    dash = run.shown_dashboard
    assert dash is not None and dash.finished.wait(30)
    loss = {t["name"]: t for t in {f["id"]: f for f in dash.figures()}["loss"]["traces"]}
    for rank in range(4):
        assert loss[f"rank {rank}"]["x"][-1] == steps - 1, sorted(loss)
    assert loss["rank 0"]["y"][-1] < loss["rank 0"]["y"][0]
    # ranks of one tensor-parallel group compute the same loss on the same batch; the two groups differ
    last = {r: loss[f"rank {r}"]["y"][-1] for r in range(4)}
    assert last[0] == pytest.approx(last[1], rel=1e-5) and last[2] == pytest.approx(last[3], rel=1e-5)
    assert last[0] != pytest.approx(last[2], rel=1e-5)
    assert descendants_gone(run)

    w = Wizard(model=Transformer, gpu="cpu", gpus_per_node=4, seq_len=32, micro_batch=16, precision="fp32",
               runs_dir=runs, shell=ip, code=DEMO_CELL.format(steps=6))  # fmt: skip
    w.candidate.value = "fsdp2+tp2+sp"
    w.run_name.value = "tp_wizard"
    w.nproc.value = 4
    wrun = w.launch(timeout=240)
    assert wrun is not None, w.launch_msg.value
    assert wrun.wait(240) == "succeeded", wrun.logs()
    assert {r["rank"] for r in wrun.records("step")} == {0, 1, 2, 3}
    if w.dashboard is not None:  # the live panels under the Launch button show every rank
        assert w.launch_area.children == (w.dashboard.widget,)
        assert w.dashboard.finished.wait(30)
        names = {t["name"] for t in {f["id"]: f for f in w.dashboard.figures()}["loss"]["traces"]}
        assert {f"rank {r}" for r in range(4)} <= names
    assert descendants_gone(wrun)
