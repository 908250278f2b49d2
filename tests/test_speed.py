"""Execution speed where it is safe (issue 31): the fused optimizer and regional compilation, on CPU.

On CUDA both are on by default; here (CPU) they are off unless forced (``JD_FUSED=1``, ``JD_COMPILE=1``), which is
how these tests check the switch, the wiring and that the losses equal the default run's.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from jupyter_dist.worker import _speed  # noqa: E402
from jupyter_dist.worker._env import WorkerEnv, WorkerError  # noqa: E402
from jupyter_dist.worker._runtime import Runtime  # noqa: E402

FUSED_RTOL = 1e-5
"""Fused and foreach AdamW are the same update; measured on this model: identical losses over 4 steps."""
COMPILE_RTOL = 1e-4
"""Inductor reorders float sums; measured on this model: relative loss difference below 1e-6 over 4 steps."""


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, 2 * d)
        self.down = torch.nn.Linear(2 * d, d)

    def forward(self, x: Any) -> Any:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Tiny(torch.nn.Module):
    def __init__(self, d: int = 16, n: int = 2) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(n))
        self.out = torch.nn.Linear(d, 4)

    def forward(self, x: Any) -> Any:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def env(tmp_path: Path, **kw: Any) -> WorkerEnv:
    return WorkerEnv(distributed=False, run_dir=str(tmp_path), heartbeat_s=0, **kw)


def train(tmp_path: Path, steps: int = 4, opt_cls: Any = None, opt_kw: Any = None,
          **kw: Any) -> tuple[list[float], Runtime]:  # fmt: skip
    torch.manual_seed(0)
    model = Tiny()
    opt = (opt_cls or torch.optim.AdamW)(model.parameters(), lr=1e-2, **(opt_kw or {}))
    rt = Runtime(env(tmp_path, **kw))
    rt.wrap(model, opt)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        losses.append(float(rt.train_step(x, y, torch.nn.functional.mse_loss)))
    rt.emitter.close()
    return losses, rt


def adamw_losses(model: Any, steps: int = 3) -> list[float]:
    """``steps`` plain AdamW steps (lr 1e-2) of ``model`` on the seeded (8, 8) -> (8, 4) batches ``train`` uses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def speed_lines(caplog: Any, what: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if what in r.getMessage()]


# ------------------------------------------------------------------------------------------------ fused optimizer
def test_env_reads_and_writes_the_switches() -> None:
    e = WorkerEnv.from_environ({"JD_FUSED": "0", "JD_COMPILE": "1"})
    assert (e.fused, e.compile) == ("0", "1")
    assert e.to_environ()["JD_FUSED"] == "0" and e.to_environ()["JD_COMPILE"] == "1"
    assert "JD_FUSED" not in WorkerEnv(distributed=False).to_environ()  # auto: not written
    with pytest.raises(WorkerError, match=r"JD_COMPILE='yes' is not valid; valid: auto, 1, 0"):
        WorkerEnv.from_environ({"JD_COMPILE": "yes"})
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert [_speed.speed_on(v, cpu) for v in ("auto", "1", "0")] == [False, True, False]
    assert [_speed.speed_on(v, cuda) for v in ("auto", "1", "0")] == [True, True, False]


@pytest.mark.parametrize("cls", ["AdamW", "Adam", "SGD"])
def test_fused_optimizer_is_switched_once_and_trains_the_same(tmp_path: Path, caplog: Any, cls: str,
                                                             monkeypatch: Any) -> None:  # fmt: skip
    opt_cls = getattr(torch.optim, cls)
    module = importlib.import_module("torch.optim.sgd" if cls == "SGD" else "torch.optim.adam")
    name = "_fused_sgd" if cls == "SGD" else "_fused_adam"
    kernel, calls = getattr(module, name), []
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or kernel(*a, **k))
    kw = {"momentum": 0.9} if cls == "SGD" else {}
    caplog.set_level(logging.INFO, logger="jupyter_dist.worker")
    base, rt0 = train(tmp_path / "a", opt_cls=opt_cls, opt_kw=kw)  # CPU default: unchanged
    assert not rt0.optimizer.param_groups[0]["fused"]
    assert not speed_lines(caplog, "fused implementation") and not calls
    fused, rt = train(tmp_path / "b", opt_cls=opt_cls, opt_kw=kw, fused="1")
    assert all(g["fused"] is True and g["foreach"] is None for g in rt.optimizer.param_groups)
    assert rt.optimizer._step_supports_amp_scaling
    assert speed_lines(caplog, "fused implementation") == [
        f"jd.wrap: torch.optim.{cls} steps with its fused implementation (the same update in one kernel; "
        "--no-fused or JD_FUSED=0 keeps the default)"
    ]
    assert calls == [1] * 4  # the fused kernel ran, once per step
    assert fused == pytest.approx(base, rel=FUSED_RTOL)


def test_fused_is_left_alone_when_the_user_chose_or_asked_no(tmp_path: Path) -> None:
    _, rt = train(tmp_path / "a", steps=1, opt_kw={"foreach": True}, fused="1")
    assert rt.optimizer.param_groups[0]["foreach"] is True and not rt.optimizer.param_groups[0]["fused"]
    _, rt = train(tmp_path / "b", steps=1, opt_kw={"foreach": False}, fused="1")
    assert not rt.optimizer.param_groups[0]["fused"]
    _, rt = train(tmp_path / "c", steps=1, opt_cls=torch.optim.RMSprop, fused="1")
    assert "fused" not in rt.optimizer.param_groups[0] or not rt.optimizer.param_groups[0]["fused"]
    _, rt = train(tmp_path / "d", steps=1, fused="0")
    assert not rt.optimizer.param_groups[0]["fused"]
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 8)).sum().backward()
    opt.step()
    with pytest.raises(WorkerError, match=r"already has state.*JD_FUSED=0"):
        _speed.fuse_optimizer(env(tmp_path, fused="1"), opt, torch.device("cpu"))


# ------------------------------------------------------------------------------------------- regional compilation
def test_compile_wraps_each_block_and_equals_eager(tmp_path: Path, caplog: Any) -> None:
    caplog.set_level(logging.INFO, logger="jupyter_dist.worker")
    eager, rt0 = train(tmp_path / "a")
    assert all(b._compiled_call_impl is None for b in rt0.model.blocks)  # CPU default: eager
    compiled, rt = train(tmp_path / "b", compile="1")
    model = rt.model
    assert [n for n, m in model.named_modules() if m._compiled_call_impl is not None] == ["blocks.0", "blocks.1"]
    assert [n for n, _ in model.named_parameters()][:2] == ["inp.weight", "inp.bias"]  # names unchanged
    assert speed_lines(caplog, "torch.compile") == ["jd.wrap: torch.compile of 2 blocks (Block)"]
    assert compiled == pytest.approx(eager, rel=COMPILE_RTOL)


def test_compile_failure_falls_back_to_eager_with_one_line(tmp_path: Path, caplog: Any, monkeypatch: Any) -> None:
    caplog.set_level(logging.INFO, logger="jupyter_dist.worker")
    eager, _ = train(tmp_path / "a")

    seen = []

    def broken(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen.append(torch._functorch.config.force_non_lazy_backward_lowering)  # the backward compiles here too
            raise RuntimeError("inductor: no C++ compiler\nsecond line")

        return call

    monkeypatch.setattr(_speed, "_compile", broken)  # fails at the first call (the first step)
    losses, rt = train(tmp_path / "b", compile="1")
    assert losses == eager and seen == [True]  # the first call failed; the blocks never tried again
    assert all(b._compiled_call_impl is None for b in rt.model.blocks)
    assert speed_lines(caplog, "failed") == [
        "jd.wrap: torch.compile of the blocks failed (RuntimeError: inductor: no C++ compiler); they run eager"
    ]

    def refused(fn: Any) -> Any:
        raise RuntimeError("torch.compile is not supported on this Python")

    caplog.clear()
    monkeypatch.setattr(_speed, "_compile", refused)  # fails at wrap
    losses, rt = train(tmp_path / "c", compile="1")
    assert losses == eager and all(b._compiled_call_impl is None for b in rt.model.blocks)
    assert len(speed_lines(caplog, "failed")) == 1


def test_the_flags_of_the_magic_and_of_launch_give_the_switches() -> None:
    import argparse
    import shlex

    from jupyter_dist.launch.scriptrun import add_launch_arguments, speed_fields
    from jupyter_dist.magics.dist import _train_parser

    magic = _train_parser()
    assert speed_fields(magic.parse_args(shlex.split("--no-fused --compile"))) == {"fused": "0", "compile": "1"}
    assert speed_fields(magic.parse_args(shlex.split("--no-compile"))) == {"compile": "0"}
    assert speed_fields(magic.parse_args([])) == {}  # the defaults: on CUDA, off elsewhere
    cli = argparse.ArgumentParser()
    add_launch_arguments(cli)
    assert speed_fields(cli.parse_args(["--no-fused", "--no-compile", "train.py"])) == {"fused": "0", "compile": "0"}
    fields = {"fused": "0", "compile": "1"}
    assert WorkerEnv.for_launch(world_size=2, **fields).to_environ()["JD_FUSED"] == "0"


SCRIPT = '''
import json, os, sys
import torch
import jupyter_dist.worker as jd
sys.path.insert(0, os.environ["TEST_DIR"])
from test_speed import Tiny

torch.manual_seed(0)
model = Tiny()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, opt = jd.wrap(model, opt)
compiled = [n for n, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]
g = torch.Generator().manual_seed(1 + jd.rank)
losses = []
for _ in range(3):
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    losses.append(float(jd.train_step(x, y, torch.nn.functional.mse_loss)))
out = os.path.join(os.environ["JD_RUN_DIR"], f"losses-{jd.rank}.json")
json.dump({"losses": losses, "compiled": compiled}, open(out, "w"))
'''


@pytest.mark.slow
def test_fsdp2_two_processes_compiled_equals_eager(tmp_path: Path) -> None:
    import json

    from test_worker import explain, torchrun

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    runs = {}
    for flag in ("0", "1"):
        run_dir = tmp_path / f"run{flag}"
        proc = torchrun(script, run_dir, timeout=600, JD_STRATEGY="fsdp2", JD_COMPILE=flag,
                        TEST_DIR=str(Path(__file__).parent))  # fmt: skip
        assert proc.returncode == 0, explain(proc, run_dir)
        runs[flag] = [json.loads((run_dir / f"losses-{r}.json").read_text()) for r in (0, 1)]
        assert "failed" not in "".join(p.read_text() for p in (run_dir / "logs").glob("rank-*.log"))
    for eager, compiled in zip(runs["0"], runs["1"], strict=True):
        assert eager["compiled"] == [] and compiled["compiled"] == ["blocks.0", "blocks.1"]
        assert compiled["losses"] == pytest.approx(eager["losses"], rel=COMPILE_RTOL)


# ------------------------------------------------------------- compiled == eager under DDP and TP, in one process
@pytest.fixture()
def one_rank_mesh() -> Any:
    """A real 1-process gloo group in this process (a store in memory) and its 1-rank device mesh, destroyed after."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["ddp", "tp"])
def test_compiled_blocks_equal_eager_under_ddp_and_tp(strategy: str, one_rank_mesh: Any, tmp_path: Path) -> None:
    """The worker's order (tensor parallelism, then compile_blocks, then the DDP wrapper) on a real 1-rank group: the
    compiled blocks run (inductor, through DDP's hooks or on DTensors) and the losses equal eager's."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    def run(compile_: str) -> tuple[list[float], Any]:
        torch.manual_seed(0)
        model = Tiny()
        if strategy == "tp":
            plan = {f"blocks.{i}.{n}": s for i in (0, 1) for n, s in (("up", ColwiseParallel()),
                                                                        ("down", RowwiseParallel()))}  # fmt: skip
            model = parallelize_module(model, one_rank_mesh, plan)
        state = _speed.compile_blocks(env(tmp_path, compile=compile_), list(model.blocks), torch.device("cpu"))
        if strategy == "ddp":
            model = DistributedDataParallel(model)
        return adamw_losses(model), state

    eager, none = run("0")
    compiled, state = run("1")
    assert none is None and state is not None and state.failed is None and len(state.blocks) == 2
    if strategy == "tp":
        assert isinstance(state.blocks[0].up.weight, DTensor)
    assert compiled == pytest.approx(eager, rel=COMPILE_RTOL)


def test_compiled_blocks_equal_eager_in_a_pipeline_stage(one_rank_mesh: Any, tmp_path: Path) -> None:
    """A pipeline stage (torch.distributed.pipelining, one stage on a 1-rank pp group, GPipe over 2 micro-batches)
    whose blocks the worker's compile_blocks compiled: the losses equal eager's."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    def run(compile_: str) -> tuple[list[float], Any]:
        torch.manual_seed(0)
        model = Tiny()
        state = _speed.compile_blocks(env(tmp_path, compile=compile_), list(model.blocks), torch.device("cpu"))
        stage = PipelineStage(model, 0, 1, torch.device("cpu"), group=one_rank_mesh.get_group())
        schedule = ScheduleGPipe(stage, 2, loss_fn=torch.nn.functional.mse_loss)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
            parts: list[Any] = []
            schedule.step(x, target=y, losses=parts)
            opt.step()
            opt.zero_grad()
            losses.append(float(torch.stack(parts).detach().mean()))
        return losses, state

    eager, _ = run("0")
    compiled, state = run("1")
    assert state is not None and state.failed is None
    assert compiled == pytest.approx(eager, rel=COMPILE_RTOL)
