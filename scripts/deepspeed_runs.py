"""Issue 16's done-when: N DeepSpeed runs in a row through ``%%dist_train`` all end clean.

Runs the natural AdamW cell (``model, opt = jd.wrap(model, torch.optim.AdamW(...))``) in a real IPython shell with
``%%dist_train --nproc 2`` on CPU, cycling ZeRO-2, ZeRO-3, ZeRO-2-offload and ZeRO-3-offload, and checks after each:
status ``succeeded``, exit code 0 on every rank, an ``ok`` exit record per rank, the loss fell, no process of the
run left. Stops at the first run that breaks a rule, printing its summary and logs; prints one line per run.

    PYTHONPATH=$PWD python scripts/deepspeed_runs.py [-n 12] [--runs-dir DIR]

Exit status 0 when all runs passed. The DeepSpeed C++ ops are cached in ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/jupyter-dist/torch_extensions``); the first run builds them (~2 min on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

STRATEGIES = ("zero2", "zero3", "zero2-offload", "zero3-offload")

CELL = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
model, opt = jd.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, betas=(0.9, 0.95)))
g = torch.Generator().manual_seed(jd.rank)
X = torch.randn(64, 16, generator=g)
y = X.sum(1, keepdim=True)
for step in range(15):
    loss = torch.nn.functional.mse_loss(model(X), y)
    jd.backward(loss)
    jd.step(opt)
    jd.log(step, loss=loss)
print("final loss", loss.item(), "with", type(model).__name__, type(opt.optimizer).__name__)
"""


def leftover(run_dir: Path) -> list[int]:
    """PIDs of live processes started for the run (they all carry its JD_RUN_DIR)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "environ"]):
        try:
            if (proc.info["environ"] or {}).get("JD_RUN_DIR") == str(run_dir) and proc.status() != "zombie":
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def check(run: object) -> str | None:
    """What is wrong with a finished run, or None."""
    from jupyter_dist.launch.run import Run

    assert isinstance(run, Run)
    if run.status != "succeeded":
        return f"status {run.status}"
    if run.exit_codes != {0: 0, 1: 0}:
        return f"exit codes {run.exit_codes}"
    exits = {r["rank"]: r["status"] for r in run.records("exit")}
    if exits != {0: "ok", 1: "ok"}:
        return f"exit records {exits}"
    for rank in (0, 1):
        if "terminate called" in run.logs(rank):
            return f"rank {rank} log says 'terminate called'"
    frame = run.metrics()
    losses = frame[frame["rank"] == 0].sort_values("step")["loss"].tolist()
    if len(losses) != 15 or not losses[-1] < 0.5 * losses[0]:
        return f"loss did not fall: {losses}"
    deadline = time.monotonic() + 10
    while (pids := leftover(run.dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return f"processes left: {pids}" if pids else None


def main(argv: list[str] | None = None) -> int:
    """Run the runs; 0 when all passed, 1 at the first that did not."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=12, help="number of runs (default 12: three of each strategy)")
    parser.add_argument("--runs-dir", default=None, help="where the run directories go (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error(f"-n must be >= 1, got {args.n}")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache/jupyter-dist/torch_extensions"))
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "jupyter_dist")
    runs_dir = args.runs_dir or tempfile.mkdtemp(prefix="ds-runs-")
    ip.magics_manager.registry["DistMagics"].runs_dir = runs_dir
    print(f"{args.n} DeepSpeed runs through %%dist_train (runs in {runs_dir})", flush=True)
    t_all = time.monotonic()
    for i in range(args.n):
        strategy = STRATEGIES[i % len(STRATEGIES)]
        line = f"--nproc 2 --strategy {strategy} --env DS_ACCELERATOR=cpu --timeout 600 --telemetry-interval 0"
        t0 = time.monotonic()
        run = ip.run_cell_magic("dist_train", line, CELL)
        run.wait(660)
        problem = check(run)
        took = time.monotonic() - t0
        if problem:
            print(f"run {i + 1}/{args.n} {strategy}: FAILED after {took:.0f} s: {problem}\n{run.summary()}")
            for rank in (0, 1):
                print(f"--- rank {rank} log (tail)\n{run.logs(rank, tail=40)}")
            print(f"FAILED at run {i + 1} of {args.n} ({i} passed before it)")
            return 1
        print(f"run {i + 1}/{args.n} {strategy}: ok in {took:.0f} s (exit codes {run.exit_codes})", flush=True)
    print(f"all {args.n} runs succeeded, every rank exit 0, no process left ({time.monotonic() - t_all:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
