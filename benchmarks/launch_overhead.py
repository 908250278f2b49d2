"""%%dist_train's launch path against plain torchrun on the same 2-process gloo script, measured in one run.

Run: python benchmarks/launch_overhead.py [--repeat 3] [--steps 30]
Prints time-to-first-step and total wall time for each, and the ratios (jupyter-dist / torchrun), medians over
``--repeat`` alternating runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jupyter_dist.launch.backends.local import find_torchrun
from jupyter_dist.launch.session import start_run

SCRIPT = """
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range({steps}):
    loss = model(torch.randn(32, 256)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if step == 0 and dist.get_rank() == 0:
        with open(os.environ["BENCH_FIRST_STEP"], "w") as fh:
            fh.write(repr(time.time()))
dist.destroy_process_group()
"""


def plain_torchrun(code: str, tmp: Path) -> tuple[float, float]:
    script = tmp / "plain.py"
    script.write_text(code)
    marker = tmp / "plain.first"
    env = {**os.environ, "BENCH_FIRST_STEP": str(marker), "OMP_NUM_THREADS": "1"}
    t0 = time.time()
    subprocess.run([find_torchrun(), "--standalone", "--nproc-per-node", "2", str(script)], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return float(marker.read_text()) - t0, time.time() - t0


def dist_train(code: str, tmp: Path) -> tuple[float, float]:
    marker = tmp / "jd.first"
    t0 = time.time()
    run = start_run(code, nproc=2, strategy="none", runs_dir=tmp / "runs", env={"BENCH_FIRST_STEP": str(marker)})
    status = run.wait(600)  # type: ignore[union-attr]
    if status != "succeeded":
        sys.exit(f"run failed: {run.summary()}")  # type: ignore[union-attr]
    return float(marker.read_text()) - t0, time.time() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    code = SCRIPT.format(steps=args.steps)
    res: dict[str, list[tuple[float, float]]] = {"torchrun": [], "dist_train": []}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for _ in range(args.repeat):  # alternate, so machine noise hits both alike
            res["torchrun"].append(plain_torchrun(code, tmp))
            res["dist_train"].append(dist_train(code, tmp))
    med = {k: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v)) for k, v in res.items()}
    print(f"{'launcher':12} {'first step s':>13} {'total s':>9}   (median of {args.repeat}, 2 procs, gloo, CPU)")
    for k, (first, total) in med.items():
        print(f"{k:12} {first:13.2f} {total:9.2f}")
    print(f"ratio jupyter-dist / torchrun: first step {med['dist_train'][0] / med['torchrun'][0]:.2f}x, "
          f"total {med['dist_train'][1] / med['torchrun'][1]:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
