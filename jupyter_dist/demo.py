"""The demo job: a small transformer LM trained on 2 CPU processes (gloo) through ``%%dist_train``'s launch path.

Progress is printed as the ranks' telemetry arrives. ``jupyter-dist demo`` runs it.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["DEMO_CELL", "run_demo"]

DEMO_CELL = '''
import math
import torch
import torch.nn as nn

STEPS, VOCAB, DIM, SEQ, BATCH = {steps}, 64, 64, 32, 16
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(step: int) -> torch.Tensor:
    """Synthetic data with structure to learn: each sequence counts up from a random start (mod VOCAB)."""
    g = torch.Generator().manual_seed(step * jd.world_size + jd.rank)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    return (start + torch.arange(SEQ + 1)) % VOCAB


model = TinyLM()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = jd.wrap(model, opt)
for step in range(STEPS):
    tokens = batch(step)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    jd.backward(loss)
    jd.step(opt)
    jd.log(step, loss=loss, tokens=BATCH * SEQ)
if jd.is_main:
    print(f"final loss {{loss.item():.3f}} (random guessing: {{math.log(VOCAB):.3f}})")
'''


def run_demo(*, nproc: int = 2, strategy: str = "ddp", steps: int = 60, runs_dir: str = "runs",
             out: TextIO = sys.stdout, timeout: float = 600.0) -> Any:  # fmt: skip
    """Train the demo model on ``nproc`` fresh processes; print progress; return the finished Run."""
    from .launch.session import start_run

    run = start_run(DEMO_CELL.format(steps=steps), nproc=nproc, strategy=strategy, name="demo", runs_dir=runs_dir,
                    timeout=timeout)  # fmt: skip
    print(f"started {nproc} processes ({strategy}); run directory {run.dir}", file=out)  # type: ignore[union-attr]
    shown = 0
    t0 = time.time()
    while not run.done:  # type: ignore[union-attr]
        time.sleep(0.5)
        steps_seen = [r for r in run.records("step") if r["rank"] == 0]  # type: ignore[union-attr]
        for rec in sorted(steps_seen, key=lambda r: r["step"])[shown:]:
            if rec["step"] % 10 == 0 or rec["step"] == steps - 1:
                print(f"  step {rec['step']:4d}  loss {rec['loss']:.3f}  ({time.time() - t0:5.1f} s)", file=out)
        shown = len(steps_seen)
    print(run.summary(), file=out)  # type: ignore[union-attr]
    return run
