"""Render train.py for thousands of candidates into a folder, to prove a refactor of the compiler changes nothing.

    git stash; python scripts/render_snapshot.py /tmp/before; git stash pop
    python scripts/render_snapshot.py /tmp/after && diff -r /tmp/before /tmp/after

Covers every candidate of the Mixtral-8x7B (2 x 8 H100), Llama-3-8B at sequence 65536, Llama-3-70B and Llama-3.1-405B
(64 x 8) plans, and GPT-2 plans over node shapes x precisions x activation checkpointing x optimizers x tp/pp
degrees. A candidate the compiler refuses is written as its refusal, so a change in what is refused shows too.
Pure: no torch needed (the renderers are stdlib only); about 30 s.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jupyter_dist.errors import JupyterDistError  # noqa: E402
from jupyter_dist.plan.hardware import Hardware  # noqa: E402
from jupyter_dist.plan.plan import Plan  # noqa: E402
from jupyter_dist.plan.planner import plan as make_plan  # noqa: E402
from jupyter_dist.plan.training import Checkpointing, Precision, TrainingShape  # noqa: E402
from jupyter_dist.render.common import RenderError, RenderOptions  # noqa: E402
from jupyter_dist.render.torch_code import render_train_script  # noqa: E402


def plans() -> Iterator[tuple[str, Plan]]:
    """(name, plan) for every plan of the snapshot."""
    hw = Hardware.from_names("h100-80gb", gpus_per_node=8, nodes=2)
    yield "mixtral", make_plan("mixtral-8x7b", hw)
    yield "l3-8b-64k", make_plan("llama-3-8b", hw, TrainingShape(seq_len=65536))
    yield "l3-70b", make_plan("llama-3-70b", hw)
    yield "405b", make_plan("llama-3.1-405b", Hardware.from_names("h100-80gb", gpus_per_node=8, nodes=64))
    for nodes, gpus in ((1, 4), (2, 2), (2, 4), (1, 8)):
        hw = Hardware.from_names("h100-80gb", gpus_per_node=gpus, nodes=nodes)
        for prec in Precision:
            for ckpt in Checkpointing:
                for opt in ("adamw", "sgd", "adamw-8bit"):
                    shape = TrainingShape(micro_batch=3, grad_accum=5, seq_len=96, precision=prec.value,
                                          checkpointing=ckpt.value, optimizer=opt)  # fmt: skip
                    for dims in ({}, {"tp": 2}, {"tp": 2, "sp": True}, {"pp": 2}, {"tp": 2, "pp": 2, "sp": True}):
                        label = "_".join(f"{k}{v}" for k, v in dims.items())
                        try:
                            p = make_plan("gpt2", hw, shape, **dims)
                        except JupyterDistError:
                            continue
                        yield f"gpt2-{nodes}x{gpus}-{prec.value}-{ckpt.value}-{opt}-{label}", p


def main(out: Path) -> int:
    """Write ``<plan>--<candidate>.py`` for every candidate; return how many."""
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    for name, p in plans():
        for c in p.candidates:
            try:
                text = render_train_script(p, RenderOptions(candidate=c.name))
            except RenderError as exc:
                text = f"REFUSED: {exc}"
            (out / f"{name}--{c.name}.py").write_text(text)
            n += 1
    return n


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python scripts/render_snapshot.py OUT_DIR")
    print(main(Path(sys.argv[1])), "files")
