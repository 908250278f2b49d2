"""What a training process's start costs in CPU, with and without jupyter-dist's import of torch outside the collector.

Run: python benchmarks/rank_start.py [--repeat 5] [--steps 20]

Each sample is a fresh interpreter that imports torch, builds a small model and its optimizer (which imports
``torch._dynamo``), imports FSDP2 and trains ``--steps`` steps, in one process (no process group: the start is what is
measured). "plain" imports torch first, as a script does; "jupyter-dist" imports ``jupyter_dist.worker`` first, as
``%%dist_train``'s preamble does, with torchrun's variables set, so torch is imported with the cyclic collector
paused and then frozen (``jupyter_dist._startup.import_torch_outside_the_collector``). Prints each
mode's median CPU seconds (user + system of the child) over ``--repeat`` alternating samples, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys

CHILD = """
import sys
if sys.argv[1] == "jupyter-dist":
    import jupyter_dist.worker  # noqa: F401
import torch
import torch.distributed.fsdp  # noqa: F401
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(int(sys.argv[2])):
    loss = model(torch.randn(16, 64)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def sample(mode: str, steps: int) -> float:
    """CPU seconds (user + system) of one child process in ``mode``."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    env.pop("JD_RUN_DIR", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", CHILD, mode, str(steps)], env=env, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="samples per mode, alternating (default 5)")
    ap.add_argument("--steps", type=int, default=20, help="training steps per sample (default 20)")
    args = ap.parse_args()
    if args.repeat < 1 or args.steps < 0:
        ap.error("--repeat must be >= 1 and --steps >= 0")
    got: dict[str, list[float]] = {"plain": [], "jupyter-dist": []}
    for i in range(args.repeat):
        for mode in got:
            got[mode].append(sample(mode, args.steps))
            print(f"  sample {i + 1}/{args.repeat} {mode:12s} {got[mode][-1]:.2f} CPU-s", flush=True)
    med = {mode: statistics.median(v) for mode, v in got.items()}
    print(f"plain (torch imported first):           {med['plain']:.2f} CPU-s (median of {args.repeat})")
    print(f"jupyter-dist (jupyter_dist.worker first): {med['jupyter-dist']:.2f} CPU-s (median of {args.repeat})")
    print(f"ratio jupyter-dist / plain: {med['jupyter-dist'] / med['plain']:.2f}")


if __name__ == "__main__":
    main()
