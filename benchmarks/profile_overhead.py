"""What ``--profile`` costs: nothing outside the window, and how much inside it (one process, CPU).

Run: python benchmarks/profile_overhead.py [--steps 300] [--dim 256]

Times a small training step (an MLP forward, backward and SGD step) followed by ``jd.log`` with the worker's own
``Runtime`` (telemetry to a temporary run directory), three ways:

1. no profiler (no ``JD_PROFILE``): the runtime holds no profiler object;
2. a window armed far ahead (``JD_PROFILE=100000:100001``): steps outside the window, what a run pays before and
   after its window;
3. inside a window: every step recorded by ``torch.profiler``;

taking turns step by step, and prints the median step time of each, the per-call cost of ``jd.log`` with and
without an armed window, and the size of the trace a window of 5 steps writes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def runtime(run_dir: str, profile: str = "") -> object:
    from jupyter_dist.worker._env import WorkerEnv
    from jupyter_dist.worker._runtime import Runtime

    os.makedirs(os.path.join(run_dir, "telemetry"), exist_ok=True)
    return Runtime(WorkerEnv(distributed=False, run_dir=run_dir, heartbeat_s=0.0, profile=profile))


def step_times(rts: list[object], steps: int, dim: int, start: int = 0) -> list[list[float]]:
    """Per runtime, the time of each step; the runtimes take turns step by step (load drifts hit all alike)."""
    import torch

    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.ReLU(), torch.nn.Linear(4 * dim, dim))
              for _ in rts]  # fmt: skip
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in models]
    x = torch.randn(64, dim)
    out: list[list[float]] = [[] for _ in rts]
    for step in range(start, start + steps):
        for i, (rt, model, opt) in enumerate(zip(rts, models, opts, strict=True)):
            t = time.perf_counter()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            rt.log(step, {"loss": loss})  # type: ignore[attr-defined]
            out[i].append(time.perf_counter() - t)
    return out


def log_cost(rt: object, calls: int) -> float:
    t = time.perf_counter()
    for step in range(calls):
        rt.log(step, {"loss": 1.0})  # type: ignore[attr-defined]
    return (time.perf_counter() - t) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--dim", type=int, default=256)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        plain = runtime(os.path.join(d, "a"))
        armed = runtime(os.path.join(d, "b"), "100000:100001")
        inside = runtime(os.path.join(d, "c"), f"1:{args.steps + 1}")
        step_times([plain], 20, args.dim)  # warm-up
        a_t, b_t = step_times([plain, armed], args.steps, args.dim)  # no profiler runs in either: interleaved
        a, b = statistics.median(a_t), statistics.median(b_t)
        # a running profiler records every thread of the process, so "inside" is timed in its own block, between
        # two blocks without it
        before = step_times([plain], args.steps, args.dim, start=args.steps)[0]
        c = statistics.median(step_times([inside], args.steps + 1, args.dim)[0][1:])
        after = step_times([plain], args.steps, args.dim, start=2 * args.steps)[0]
        a2 = statistics.median(before + after)
        print(f"median step, no profiler:               {a * 1e6:8.1f} us")
        print(f"median step, window armed (outside it): {b * 1e6:8.1f} us ({(b / a - 1) * 100:+.1f}%)")
        print(f"median step, inside the window:         {c * 1e6:8.1f} us ({(c / a2 - 1) * 100:+.1f}% against "
              f"{a2 * 1e6:.1f} us in the blocks around it)")  # fmt: skip
        la = log_cost(runtime(os.path.join(d, "d")), 20_000)
        lb = log_cost(runtime(os.path.join(d, "e"), "100000:100001"), 20_000)
        print(f"jd.log per call: {la * 1e6:.2f} us without a window, {lb * 1e6:.2f} us with one armed ahead")
        small = runtime(os.path.join(d, "f"), "1:6")
        step_times([small], 7, args.dim)
        trace = Path(d, "f", "profile", "rank-0.pt.trace.json")
        print(f"trace of 5 steps: {trace.stat().st_size / 1024:.0f} KiB ({trace})")
        for rt in (plain, armed, inside, small):
            rt.emitter.close()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
