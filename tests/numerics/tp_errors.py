"""Under torchrun with JD_TP=2: each wrong input to jd.wrap gets one line; print them for the test to read."""

from __future__ import annotations

import torch
from torch import nn

import jupyter_dist.worker as jd
from jupyter_dist.models import Transformer
from jupyter_dist.worker import WorkerError


class NoPlan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


cases = {
    "no-plan": lambda: jd.wrap(NoPlan()),
    "heads": lambda: jd.wrap(Transformer(vocab_size=64, dim=48, n_heads=3, n_kv_heads=3)),
    "vocab": lambda: jd.wrap(Transformer(vocab_size=63, dim=64, n_heads=4)),
    "bad-key": lambda: jd.wrap(Transformer(vocab_size=64, dim=64), tp_plan={"layers.*.attn.q": "colwise"}),
    "bad-style": lambda: jd.wrap(Transformer(vocab_size=64, dim=64), tp_plan={"output": "diagonal"}),
    "no-folder": lambda: jd.wrap(Transformer(vocab_size=64, dim=64), pretrained="/nonexistent/model"),
}
for name, call in cases.items():
    try:
        call()
    except WorkerError as e:
        assert "\n" not in str(e), str(e)
        if jd.rank == 0:
            print(f"CASE {name}: {e}", flush=True)
    else:
        print(f"CASE {name}: no error", flush=True)
