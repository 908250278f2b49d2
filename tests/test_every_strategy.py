"""One natural training cell, unchanged, under every strategy the planner names on CPU.

The cell is what a user writes: ``torch.optim.AdamW(model.parameters(), lr=..., weight_decay=..., betas=...)``, an LR
scheduler built on it *before* ``jd.wrap``, then ``jd.backward`` / ``jd.step``. Each strategy runs it as a real
2-process torchrun job on gloo/CPU with the JD_* contract (DeepSpeed from the config the renderer generates, as
``%%dist_train`` does). Every rank must exit 0, the loss must fall, the scheduled learning rate must be the one the
optimizer uses, and the data-parallel runs must equal one process training on the global batch.

Also here: ``jd.step()`` under DeepSpeed with gradient accumulation > 1 (every ZeRO stage, offload too) against the
accumulation-1 run on the same global batch, and the optimizer hand-over rules of ``deepspeed_client_optimizer``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from test_worker import explain, torchrun

from jupyter_dist.worker import WorkerError

EXTENSIONS = Path(os.environ["TORCH_EXTENSIONS_DIR"])  # the suite's one folder (tests/conftest.py)
DEEPSPEED = ("zero1", "zero2", "zero3", "zero2-offload", "zero3-offload", "zero3-offload-params")
FSDP1 = ("fsdp-no-shard", "fsdp-shard-grad-op", "fsdp-full-shard", "fsdp-hybrid-shard")
EVERY = ("none", "ddp", *FSDP1, "fsdp2", "fsdp2-hybrid", *DEEPSPEED)
STEPS, LR = 8, 1e-2
LAYER_K = ("fsdp-full-shard", "fsdp-hybrid-shard", "fsdp2", "zero3", "zero2-offload")  # JD_AC=layer:2; others full

MODEL = """
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.layers = nn.ModuleList([Block() for _ in range(2)])
        self.out = nn.Linear(32, 1)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def batch(rank, step, micro=0, accum=1):
    # rank's 8 samples of this step; micro-batch `micro` of `accum` is a slice of them
    g = torch.Generator().manual_seed(rank)  # the same samples every step: the loss must fall
    x = torch.randn(8, 8, generator=g)
    x = x.chunk(accum)[micro]
    return x, x.sum(dim=1, keepdim=True).sin()


def schedule(s):
    return 1.0 / (1.0 + 0.5 * s)
"""

CELL = (
    """
import json, os
import torch
import torch.distributed as dist
import jupyter_dist.worker as jd

ACCUM = int(os.environ.get("TEST_ACCUM", "1"))  # micro-batches per step (DeepSpeed's gradient_accumulation_steps)
STEPS, LR = int(os.environ["TEST_STEPS"]), float(os.environ["TEST_LR"])
"""
    + MODEL
    + """
torch.manual_seed(0)
model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, betas=(0.9, 0.95))
sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)  # built before wrap, on the user's optimizer
model, opt = jd.wrap(model, opt)

losses, lrs = [], []
for step in range(STEPS):
    lrs.append(float(opt.param_groups[0]["lr"]))  # the learning rate this step uses
    total = 0.0
    for micro in range(ACCUM):
        x, y = batch(jd.rank, step, micro, ACCUM)
        loss = nn.functional.mse_loss(model(x.to(jd.device)), y.to(jd.device))
        jd.backward(loss)
        jd.step(opt)  # under DeepSpeed: engine.step(), which steps the optimizer at the accumulation boundary
        total += loss.item() / ACCUM
    sched.step()
    jd.log(step, loss=total)
    losses.append(total)
result = {"model": type(model).__name__, "optimizer": type(opt).__name__,
          "basic": type(getattr(opt, "optimizer", opt)).__name__, "losses": losses, "lrs": lrs,
          "checkpointed": sum(type(m).__name__.endswith("CheckpointWrapper") for m in model.modules())}
if os.environ["JD_STRATEGY"].startswith("zero"):  # the full parameters, gathered under ZeRO-3
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        result["params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
with open(os.path.join(os.environ["JD_RUN_DIR"], f"cell-rank{jd.rank}.json"), "w") as f:
    json.dump(result, f)
"""
)


def reference_losses(steps: int, lr: float, *, sgd: bool = False) -> tuple[list[float], list[float]]:
    """One process training the same model on both ranks' batches together (what data parallelism must equal)."""
    torch = pytest.importorskip("torch")
    ns: dict = {}
    exec(compile(MODEL, "model", "exec"), ns)
    torch.manual_seed(0)
    model = ns["Net"]()
    if sgd:
        opt = torch.optim.SGD(model.parameters(), lr=lr * 10, momentum=0.9, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, ns["schedule"])
    losses, lrs = [], []
    for step in range(steps):
        xs, ys = zip(*(ns["batch"](r, step) for r in (0, 1)), strict=True)
        loss = torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys))
        loss.backward()
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses, lrs


def ds_config(strategy: str, accum: int = 1, clip: float = 0.0, per_rank: int = 8) -> dict:
    """The DeepSpeed JSON ``%%dist_train`` would write for ``strategy`` (fp32, 2 data-parallel ranks, ``per_rank``
    samples per rank and step in ``accum`` micro-batches).

    Clipping is off by default so that the run equals the unclipped one-process reference.
    """
    from jupyter_dist.plan import Hardware, ModelSpec, TrainingShape, plan
    from jupyter_dist.render.common import RenderOptions
    from jupyter_dist.render.deepspeed import render_deepspeed

    shape = TrainingShape(micro_batch=per_rank // accum, grad_accum=accum, seq_len=64, precision="fp32",
                          optimizer="adamw")  # fmt: skip
    p = plan(ModelSpec(name="tiny", layers=2, hidden=64, heads=4, vocab=256),
             Hardware.from_names("h100-80gb", gpus_per_node=2), shape, strategy=strategy)  # fmt: skip
    cfg = render_deepspeed(p, RenderOptions(candidate=strategy, lr=LR, grad_clip=clip))
    assert cfg["gradient_accumulation_steps"] == accum and cfg["train_micro_batch_size_per_gpu"] == per_rank // accum
    return cfg


SGD_CELL = CELL.replace(
    "torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, betas=(0.9, 0.95))",
    "torch.optim.SGD(model.parameters(), lr=LR * 10, momentum=0.9, weight_decay=0.01)",
)
ACCUM_CLIP = 0.5  # the accumulation runs clip too, at the boundary only

DRIVER = """
import json, os, runpy

# Each run of the spec in turn, as its own cell: the launch's environment plus the run's, a fresh runtime (the next
# jd.wrap reads JD_STRATEGY, JD_AC and JD_DS_CONFIG anew), the cell file run as __main__, its results renamed.
with open(os.environ["TEST_SPEC"]) as f:
    spec = json.load(f)
base = dict(os.environ)
for i, run in enumerate(spec):
    os.environ.clear()
    os.environ.update(base)
    os.environ.update(run["env"])
    if i:
        from jupyter_dist.worker._runtime import fresh_runtime

        fresh_runtime()
    runpy.run_path(run["cell"], run_name="__main__")
    import torch.distributed as dist
    import jupyter_dist.worker as jd

    if dist.is_initialized():
        dist.barrier()
    out = os.environ["JD_RUN_DIR"]
    os.replace(os.path.join(out, f"cell-rank{jd.rank}.json"), os.path.join(out, f"{run['name']}-rank{jd.rank}.json"))
"""


def natural_ac(strategy: str) -> tuple[str, int]:
    """The ``JD_AC`` of ``strategy``'s natural run and the number of blocks it must checkpoint."""
    return ("layer:2", 1) if strategy in LAYER_K else ("full", 2)


def runs_of_group(group: str) -> dict[str, dict]:
    """The runs one launch trains in turn: name -> (cell file, strategy, JD_AC, accumulation, clipping).

    ``torch``: the natural cell under every strategy without DeepSpeed; ``deepspeed``: the natural cell under every
    ZeRO strategy, the accumulation-1 and -4 runs with clipping of each ZeRO stage, and SGD under ZeRO-3 offload.
    One launch per group (2 instead of 18): each run has its own model, optimizer, scheduler, ``jd.wrap`` and
    runtime, so what each test asserts of its run is what it asserted of a launch of its own.
    """
    runs: dict[str, dict] = {}
    for s in EVERY:
        if s.startswith("zero") == (group == "deepspeed"):
            runs[s] = {"cell": "cell.py", "strategy": s, "ac": natural_ac(s)[0], "accum": 1, "clip": 0.0}
    if group == "deepspeed":
        for s in ("zero1", "zero2", "zero3"):
            for accum in (1, 4):
                runs[f"{s}-a{accum}"] = {"cell": "cell.py", "strategy": s, "ac": "none", "accum": accum,
                                         "clip": ACCUM_CLIP}  # fmt: skip
        runs["zero3-offload-sgd"] = {"cell": "sgd_cell.py", "strategy": "zero3-offload", "ac": "none", "accum": 1,
                                     "clip": 0.0}  # fmt: skip
    return runs


def launch_group(tmp_path: Path, group: str) -> dict[str, list[dict]]:
    """One 2-process torchrun that trains every run of ``group`` in turn; each run's per-rank results."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "cell.py").write_text(CELL)
    (tmp_path / "sgd_cell.py").write_text(SGD_CELL)
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    runs = runs_of_group(group)
    spec = []
    for name, r in runs.items():
        env = {"JD_STRATEGY": r["strategy"], "JD_AC": r["ac"], "TEST_ACCUM": str(r["accum"])}
        if r["strategy"].startswith("zero"):
            config = f"ds_config-{name}.json"
            (run_dir / config).write_text(json.dumps(ds_config(r["strategy"], r["accum"], r["clip"])))
            env["JD_DS_CONFIG"] = config
        spec.append({"name": name, "cell": str(tmp_path / r["cell"]), "env": env})
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {"TEST_STEPS": str(STEPS), "TEST_LR": str(LR), "TEST_SPEC": str(tmp_path / "spec.json")}
    if group == "deepspeed":
        pytest.importorskip("deepspeed")
        env.update(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(EXTENSIONS))
    proc = torchrun(script, run_dir, 900, **env)
    assert proc.returncode == 0, explain(proc, run_dir)
    assert "Traceback" not in proc.stdout and "terminate called" not in proc.stdout, explain(proc, run_dir)
    return {name: [json.loads((run_dir / f"{name}-rank{k}.json").read_text()) for k in (0, 1)] for name in runs}


@pytest.fixture(scope="module")
def cell_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[dict]]:
    """``cell_runs(name)``: the per-rank results of run ``name``; its group's one launch starts on first use."""
    done: dict[str, dict[str, list[dict]] | str] = {}

    def get(name: str) -> list[dict]:
        group = "deepspeed" if name.startswith("zero") else "torch"
        if group not in done:
            try:
                done[group] = launch_group(tmp_path_factory.mktemp(group), group)
            except (AssertionError, pytest.fail.Exception) as e:  # every test of the group reports its failure
                done[group] = str(e)
        got = done[group]
        if isinstance(got, str):
            pytest.fail(f"the {group} launch failed:\n{got}")
        return got[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("strategy", EVERY)
def test_the_natural_cell_runs_unchanged_under_every_strategy(
    strategy: str, cell_runs: Callable[[str], list[dict]]
) -> None:
    """Also with the plan's activation checkpointing (``JD_AC``), which every strategy must apply (DDP, FSDP1,
    DeepSpeed and no strategy ignored it until session 8) and which must not change the math: ``full`` (both
    blocks) or ``layer:2`` (the second block only: blocks of two classes, which FSDP1's wrap policy must see through).
    """
    ac, wrapped = natural_ac(strategy)
    res = cell_runs(strategy)
    ref_losses, ref_lrs = reference_losses(STEPS, LR)
    for r in res:
        assert r["checkpointed"] == wrapped, (ac, r)
        assert r["lrs"] == pytest.approx(ref_lrs, rel=1e-6), r  # the scheduler built before wrap drives the lr
        assert r["losses"][-1] < 0.6 * r["losses"][0], r["losses"]
    if strategy == "none":  # each process trains alone on its own data
        return
    mean = [(a + b) / 2 for a, b in zip(res[0]["losses"], res[1]["losses"], strict=True)]
    assert mean == pytest.approx(ref_losses, rel=2e-4), (mean, ref_losses)  # equals one process, global batch
    if strategy.startswith("zero"):
        offload = "offload" in strategy
        assert res[0]["model"] == "DeepSpeedEngine"
        assert res[0]["basic"] == ("DeepSpeedCPUAdam" if offload else "AdamW")


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("strategy", ("zero1", "zero2", "zero3"))  # every ZeRO stage; offload adds no step path
def test_jd_step_with_gradient_accumulation_equals_one_big_micro_batch(
    strategy: str, cell_runs: Callable[[str], list[dict]]
) -> None:
    """``gradient_accumulation_steps=4`` through ``jd.backward``/``jd.step(opt)`` equals accumulation 1 (both
    clipping at 0.5, at the boundary only)."""
    whole, accumulated = cell_runs(f"{strategy}-a1"), cell_runs(f"{strategy}-a4")
    for one, four in zip(whole, accumulated, strict=True):
        assert four["lrs"] == pytest.approx(one["lrs"], rel=1e-6)
        assert four["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=1e-7)
        assert four["params"] == pytest.approx(one["params"], rel=1e-5, abs=1e-6)
    assert accumulated[0]["params"] == accumulated[1]["params"]  # the ranks agree


@pytest.mark.slow
@pytest.mark.deepspeed
def test_sgd_under_zero_offload_runs_as_given(cell_runs: Callable[[str], list[dict]]) -> None:
    """SGD has no DeepSpeed CPU twin: it steps the offloaded fp32 partitions itself, and equals one process."""
    assert SGD_CELL != CELL
    res = cell_runs("zero3-offload-sgd")
    assert res[0]["basic"] == "SGD"
    ref_losses, ref_lrs = reference_losses(STEPS, LR, sgd=True)
    mean = [(a + b) / 2 for a, b in zip(res[0]["losses"], res[1]["losses"], strict=True)]
    assert mean == pytest.approx(ref_losses, rel=2e-4) and mean[-1] < 0.6 * mean[0]
    assert res[0]["lrs"] == pytest.approx(ref_lrs, rel=1e-6)


def test_client_optimizer_rules_under_deepspeed() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("deepspeed")
    from jupyter_dist.worker._strategy import deepspeed_client_optimizer

    params = [torch.nn.Parameter(torch.zeros(4))]
    offload = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    sgd = torch.optim.SGD(params, lr=0.1)
    same, cfg = deepspeed_client_optimizer("zero2-offload", sgd, offload)
    assert same is sgd and cfg["zero_force_ds_cpu_optimizer"] is False and cfg["zero_allow_untested_optimizer"]
    assert "zero_force_ds_cpu_optimizer" not in offload  # the caller's dict is left alone
    same, cfg = deepspeed_client_optimizer("zero2", sgd, {"zero_optimization": {"stage": 2}})
    assert same is sgd and cfg == {"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
    adamw = torch.optim.AdamW(params, lr=0.1)
    same, cfg = deepspeed_client_optimizer("zero2", adamw, {"zero_optimization": {"stage": 2}})
    assert same is adamw and cfg == {"zero_optimization": {"stage": 2}}  # DeepSpeed takes AdamW as it is
    with pytest.raises(WorkerError, match=r"zero2-offload .* no amsgrad=True; use torch.optim.Adam\(amsgrad=False\)"):
        deepspeed_client_optimizer("zero2-offload", torch.optim.Adam(params, amsgrad=True), offload)
    with pytest.raises(WorkerError, match=r"zero3 cannot run torch.optim.lbfgs.LBFGS: .* not an element-wise"):
        deepspeed_client_optimizer("zero3", torch.optim.LBFGS(params), {"zero_optimization": {"stage": 3}})
