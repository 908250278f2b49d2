"""DeepSpeed's CPU Adam (``DeepSpeedCPUAdam``, and ``FusedAdam`` under ``DS_ACCELERATOR=cpu``) resumed mid-run.

Run with ``DS_ACCELERATOR=cpu``. For each optimizer it trains one tensor for 15 steps and for 30 steps straight,
hands the 15-step state (parameter and ``state_dict()``) to a fresh optimizer as a restarted process would, and
trains 15 more, once as loaded and once after ``replay_cpu_adam_steps``. A fresh ``DeepSpeedCPUAdam`` has a fresh
C++ optimizer (one per ``opt_id``), as in a restarted process; ``FusedAdam``'s CPU op keeps one C++ optimizer per
process, whose step counter the straight run left at 30, so the resumed step 16 is a step jump there too.
Prints one JSON line: ``{name: {"loaded": max |diff|, "replayed": max |diff|, "steps": replayed steps}}``.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

from jupyter_dist.worker._checkpoint import replay_cpu_adam_steps

KW = {"lr": 3e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


def train(make: Any, start: int, stop: int, state: dict[str, Any] | None = None, replay: bool = False) -> Any:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000))
    opt = make([p])
    if state is not None:
        p.data.copy_(state["p"])
        opt.load_state_dict(copy.deepcopy(state["opt"]))  # its tensors would be stepped in place otherwise
        if replay:
            state["steps"] = replay_cpu_adam_steps(opt)
    for step in range(start, stop):
        p.grad = torch.randn(1000, generator=torch.Generator().manual_seed(step))
        opt.step()
    return {"p": p.detach().clone(), "opt": opt.state_dict()}


def main() -> None:
    out = {}
    makers = {
        "DeepSpeedCPUAdam": lambda ps: DeepSpeedCPUAdam(ps, adamw_mode=True, **KW),
        "FusedAdam": lambda ps: FusedAdam(ps, adam_w_mode=True, **KW),
    }
    for name, make in makers.items():
        half = train(make, 0, 15)
        straight = train(make, 0, 30)["p"]  # after the half run: FusedAdam's C++ step counter ends at 30
        loaded = train(make, 15, 30, dict(half))["p"]
        box = dict(half)
        replayed = train(make, 15, 30, box, replay=True)["p"]
        out[name] = {
            "loaded": (loaded - straight).abs().max().item(),
            "replayed": (replayed - straight).abs().max().item(),
            "steps": box["steps"],
        }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
