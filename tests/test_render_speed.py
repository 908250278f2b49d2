"""The generated train.py runs what ``%%dist_train`` runs (issue 31): the fused optimizer, regional compilation of
the blocks, and FP8 through torchao where the worker allows it.

Fast: each flavour with these options renders, compiles and passes ruff, and the options appear only where they are
valid; the script's ``compile_blocks()`` and ``convert_float8()`` (templates) do what the worker's do on the same
model (:mod:`jupyter_dist.worker._speed`, :mod:`jupyter_dist.worker._float8`). Slow: one 2-process run of the
generated fsdp2 script in fp8 (torchao's emulation) against its bf16-mixed run.
"""

from __future__ import annotations

import argparse
import ast
import functools
import logging
from pathlib import Path
from typing import Any

import pytest
from test_render_torch import Script, _dims, _plan, _steps, _train, ruff_folder

from jupyter_dist.plan.training import fp8_strategy_problem
from jupyter_dist.render.common import RenderError, RenderOptions, layout_of
from jupyter_dist.render.torch_code import render_train_script
from jupyter_dist.render.train import speed_tpl
from jupyter_dist.render.train.text import fill

# candidate, gpus per node, precision, optimizer
FLAVOURS = [
    ("ddp", 4, "fp8", "adamw"),
    ("ddp", 4, "bf16-mixed", "sgd"),
    ("fsdp-full-shard", 4, "fp8", "sgd"),
    ("fsdp2", 4, "fp8", "adamw"),
    ("fsdp2", 4, "fp16-mixed", "adamw-8bit"),
    ("fsdp2-hybrid", 2, "fp8", "adamw"),
    ("fsdp2+pp2", 4, "fp8", "adamw"),
    ("fsdp2+tp2+sp", 4, "bf16-mixed", "adamw"),
    ("fsdp2+tp2+pp2+sp", 4, "fp16-mixed", "sgd"),
    ("fsdp2+cp2", 4, "fp8", "adamw"),
    ("zero2", 4, "bf16-mixed", "adamw"),
]
"""Every parallelize() / main() the options go into, each optimizer, fp8 wherever the worker runs it."""


def _render(cand: str, gpus: int, precision: str, optimizer: str) -> str:
    p = _plan(2 if cand == "fsdp2-hybrid" else 1, gpus, precision=precision, optimizer=optimizer, **_dims(cand))
    return render_train_script(p, RenderOptions(candidate=cand))


def _name(cand: str, precision: str, optimizer: str) -> str:
    return "_".join(x.replace("-", "_").replace("+", "_") for x in (cand, precision, optimizer))


@pytest.fixture(scope="module")
def ruff_findings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Every flavour's script checked by one ruff run with the project's rules."""
    folder = tmp_path_factory.mktemp("speed_scripts")
    for cand, gpus, precision, optimizer in FLAVOURS:
        (folder / f"{_name(cand, precision, optimizer)}.py").write_text(_render(cand, gpus, precision, optimizer))
    return ruff_folder(folder, timeout=120)


@pytest.mark.parametrize(
    ("cand", "gpus", "precision", "optimizer"), FLAVOURS, ids=["-".join(map(str, f)) for f in FLAVOURS]
)
def test_the_speed_options_render_where_valid_and_pass_ruff(
    cand: str, gpus: int, precision: str, optimizer: str, ruff_findings: dict[str, list[str]]
) -> None:
    source = _render(cand, gpus, precision, optimizer)
    compile(source, f"{cand}.py", "exec")
    assert ruff_findings.get(_name(cand, precision, optimizer), []) == []
    s = Script(source)
    flags = {a.value for c in s.calls("add_argument") for a in c.args if isinstance(a, ast.Constant)}
    ds = cand.startswith("zero2")
    fp8 = precision == "fp8"
    # regional compilation: every script, on CUDA by default (the flag's default None means "on CUDA")
    assert "--compile" in flags and s.flag_default("--compile") is None
    (call,) = s.calls("compile_blocks")
    assert ast.unparse(call.args[1]) == "on_cuda(args.compile)"
    # the fused optimizer: a torch AdamW or SGD, not under DeepSpeed's engine
    fused = optimizer in ("adamw", "sgd") and not ds
    assert ("--fused" in flags) == fused
    optim = s.calls({"adamw": "AdamW", "sgd": "SGD", "adamw-8bit": "AdamW8bit"}[optimizer])
    assert any(k.arg == "fused" for k in optim[0].keywords) == fused
    # fp8: the flags, the constants and the conversion only in fp8 scripts
    assert ({"--fp8-recipe", "--fp8-emulate"} <= flags) == fp8
    assert ({"--fp8-recipe", "--fp8-emulate"} & flags == set()) == (not fp8)
    assert len(s.calls("convert_float8")) == (1 if fp8 else 0)
    if fp8:
        assert s.constants["FP8_RECIPES"] == speed_tpl.FP8_RECIPES and s.flag_default("--fp8-recipe") == "tensorwise"
        gather = "enable_fsdp_float8_all_gather" in source
        assert gather == layout_of(_plan(2 if cand == "fsdp2-hybrid" else 1, gpus, precision=precision,
                                         optimizer=optimizer, **_dims(cand)),
                                   RenderOptions(candidate=cand)).strategy.family.startswith("fsdp2")  # fmt: skip
        # in parallelize(): float8 first, then checkpointing and compile, then the wrapper
        body = next(n for n in s.tree.body if isinstance(n, ast.FunctionDef) and n.name == "parallelize")
        order = [c.func.id for c in ast.walk(body) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)]
        wrapper = next(x for x in order if x in ("DistributedDataParallel", "FSDP", "fully_shard"))
        assert order.index("convert_float8") < order.index(wrapper)
        # compile after checkpointing: FSDP1 checkpoints (and so compiles) the blocks inside its wrapper
        assert (order.index("compile_blocks") < order.index(wrapper)) == (wrapper != "FSDP")


@pytest.mark.parametrize("cand", ["zero2", "zero3-offload", "fsdp2+tp2+sp", "fsdp2+tp2+pp2+sp"])
def test_fp8_is_refused_in_one_line_where_the_worker_refuses_it(cand: str) -> None:
    p = _plan(1, 4, precision="fp8", **_dims(cand))
    lay = layout_of(p, RenderOptions(candidate=cand))
    problem = fp8_strategy_problem(lay.strategy.family, lay.dims.tp)
    assert problem is not None and "\n" not in problem
    with pytest.raises(RenderError) as e:
        render_train_script(p, RenderOptions(candidate=cand))
    assert str(e.value) == f"candidate {cand}: {problem}"


# -------------------------------------------------------------------------------- the templates against the worker
def _template(*sections: str, **names: Any) -> dict[str, Any]:
    """The template sections executed as the script would define them (``BLOCK_CLASS`` and the rest in ``names``)."""
    import dataclasses

    import torch
    from torch import nn

    ns: dict[str, Any] = {"torch": torch, "nn": nn, "argparse": argparse, "dataclasses": dataclasses, "Any": Any,
                          "__name__": "train_tpl", **names}  # fmt: skip
    source = "from __future__ import annotations\n" + "\n\n".join(sections)
    exec(compile(source, "speed_tpl", "exec"), ns)
    return ns


class _Rank0:
    @staticmethod
    def get_rank() -> int:
        return 0


def test_the_scripts_compile_blocks_does_what_the_workers_does(tmp_path: Path, monkeypatch: Any,
                                                                capsys: Any, caplog: Any) -> None:  # fmt: skip
    """Same blocks compiled, same losses as the worker's compile and as eager; the same fallback on a failure.

    The compiler is ``aot_eager`` in both (AOTAutograd's forward and backward graphs, run eagerly): the wrapping,
    guard and fallback are the templates', without inductor's C++ build, which ``tests/test_speed.py`` runs.
    """
    torch = pytest.importorskip("torch")
    from test_speed import COMPILE_RTOL, Block, Tiny, adamw_losses

    from jupyter_dist.worker import _speed
    from jupyter_dist.worker._env import WorkerEnv

    real = torch.compile
    monkeypatch.setattr(torch, "compile", functools.partial(real, backend="aot_eager"))
    monkeypatch.setattr(_speed, "_compile", functools.partial(real, backend="aot_eager"))
    ns = _template(fill(speed_tpl.COMPILE_BLOCKS), BLOCK_CLASS=Block, dist=_Rank0)

    def model() -> Any:
        torch.manual_seed(0)
        return Tiny()

    eager = adamw_losses(model())
    scripted = model()
    ns["compile_blocks"](scripted, True)
    worker = model()
    _speed.compile_blocks(WorkerEnv(distributed=False, compile="1"), list(worker.blocks), torch.device("cpu"))
    compiled = [[n for n, m in x.named_modules() if m._compiled_call_impl is not None] for x in (scripted, worker)]
    assert compiled == [["blocks.0", "blocks.1"]] * 2
    from_script = adamw_losses(scripted)
    assert from_script == adamw_losses(worker)
    assert from_script == pytest.approx(eager, rel=COMPILE_RTOL)
    off = model()
    ns["compile_blocks"](off, False)
    assert all(m._compiled_call_impl is None for m in off.modules())

    def broken(fn: Any, **kwargs: Any) -> Any:
        def call(*args: Any, **kw: Any) -> Any:
            raise RuntimeError("inductor: no C++ compiler\nsecond line")

        return call

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(_speed, "_compile", broken)
    caplog.set_level(logging.WARNING, logger="jupyter_dist.worker")
    failing = model()
    ns["compile_blocks"](failing, True)
    worker = model()
    _speed.compile_blocks(WorkerEnv(distributed=False, compile="1"), list(worker.blocks), torch.device("cpu"))
    assert adamw_losses(failing) == eager == adamw_losses(worker)
    assert all(m._compiled_call_impl is None for m in failing.modules())
    printed = capsys.readouterr().out.splitlines()
    logged = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert printed == ["torch.compile of the blocks failed (RuntimeError: inductor: no C++ compiler); they run eager"]
    assert logged == [f"jd.wrap: {printed[0]}"]


def test_the_scripts_float8_conversion_is_the_workers(tmp_path: Path, capsys: Any) -> None:
    """The same layers become Float8Linear with the same config as under the worker, recipe by recipe."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchao.float8")
    from test_float8 import Block, Tiny

    from jupyter_dist.worker._env import FP8_RECIPES, WorkerEnv
    from jupyter_dist.worker._float8 import convert_float8

    assert speed_tpl.FP8_RECIPES == FP8_RECIPES
    for gather in (False, True):
        config = "config = dataclasses.replace(config, emulate=args.fp8_emulate)"
        if gather:
            config = ('config = dataclasses.replace(config, emulate=args.fp8_emulate, '
                      'enable_fsdp_float8_all_gather=args.fp8_recipe == "tensorwise")')  # fmt: skip
        ns = _template(fill(speed_tpl.FLOAT8, config=config, all_gather_doc=""), BLOCK_CLASS=Block, dist=_Rank0)
        for recipe in FP8_RECIPES:
            torch.manual_seed(0)
            scripted, worker = Tiny(), Tiny()
            ns["convert_float8"](scripted, argparse.Namespace(fp8_recipe=recipe, fp8_emulate=True))
            env = WorkerEnv(distributed=False, precision="fp8", fp8_emulate=True, fp8_recipe=recipe)
            names = convert_float8(env, worker, list(worker.blocks), torch.device("cpu"),
                                   family="fsdp2" if gather else "ddp")  # fmt: skip
            converted = [n for n, m in scripted.named_modules() if type(m).__name__ == "Float8Linear"]
            assert converted == names == ["blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down"]
            for name in names:
                assert scripted.get_submodule(name).config == worker.get_submodule(name).config, (gather, recipe)
            assert worker.blocks[0].up.config.enable_fsdp_float8_all_gather == (gather and recipe == "tensorwise")
            assert capsys.readouterr().out == (f"fp8 ({recipe}, emulated) of 4 linear layers in the blocks (2 kept in "
                                               "bf16: dimensions not multiples of 16); the rest in bf16\n")  # fmt: skip
    with pytest.raises(SystemExit, match=r"^precision fp8 needs a GPU with FP8 matmuls .* not a CPU; use bf16-mixed"):
        ns["convert_float8"](Tiny(), argparse.Namespace(fp8_recipe="tensorwise", fp8_emulate=False))


# ------------------------------------------------------------------------------------------------- one real launch
@pytest.mark.slow
def test_the_generated_fsdp2_script_in_fp8_trains_like_its_bf16_run(tmp_path: Path) -> None:
    """Two processes on CPU (gloo), torchao's emulation: the fp8 script's losses equal the bf16-mixed script's."""
    from test_float8 import FP8_RTOL

    runs = {}
    for precision, extra in (("bf16-mixed", ()), ("fp8", ("--fp8-emulate",))):
        folder = tmp_path / precision
        folder.mkdir()
        p = _plan(1, 2, precision=precision)
        runs[precision] = _train(folder, p, "fsdp2", 4, extra_args=extra)
    bf16, fp8 = (_steps(runs[k]) for k in ("bf16-mixed", "fp8"))
    assert [s for s, _ in fp8] == [s for s, _ in bf16] == [1, 2, 3, 4]
    assert "fp8 (tensorwise, emulated) of 12 linear layers in the blocks; the rest in bf16" in runs["fp8"]
    assert "fp8 (" not in runs["bf16-mixed"]
    assert [x for _, x in fp8] != [x for _, x in bf16]
    assert [x for _, x in fp8] == pytest.approx([x for _, x in bf16], rel=FP8_RTOL)
