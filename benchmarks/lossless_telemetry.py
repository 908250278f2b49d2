"""Lossless telemetry at scale: every ``jd.log`` call kept, what it costs on disk, in the worker and in the notebook.

Run: python benchmarks/lossless_telemetry.py [--ranks 8] [--steps 100000] [--metrics 5] [--step-ms 5]

Targets (issue 28): 8 ranks x 100k steps x 5 metrics recorded losslessly with the run directory under ~100 MB,
``run.metrics()`` in under 2 s, the panels of the finished run open in under 1 s, and the worker's telemetry
under 1 % of a 5 ms step.

1. **Write.** Each rank's real :class:`~jupyter_dist.telemetry.emitter.Emitter` (a ``JsonlFileSink`` in a run
   directory, the default 1 s interval) is fed ``--steps`` calls of ``--metrics`` metrics (a random loss, a learning
   rate, a gradient norm, ``tokens`` and one more float), its clock advancing ``--step-ms`` per call: the batches
   are what a real run of that speed writes. Reported: the telemetry's bytes, bytes per call, lines, and the CPU
   time of one ``jd.log`` call (``time.process_time`` over all calls of rank 0, the write included) against the
   step: the overhead.
2. **Overhead with tensors.** The same for rank 0 with the loss a one-element torch tensor (read in batches with
   one ``.tolist()``), if torch is importable.
3. **Read.** ``run.metrics()`` of the directory (wall time, rows, and that every rank's values equal what it
   logged), ``read_run_columns``, and the panels: a ``Dashboard`` of the finished run (no widget), opened until its
   figures are built (wall time, points per trace).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jupyter_dist.telemetry.emitter import Emitter, JsonlFileSink, telemetry_path  # noqa: E402


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def metrics_of(rng: random.Random, step: int, n: int) -> dict[str, float]:
    base = {"loss": 3.0 / (1 + step / 1000) + rng.random() * 0.1, "lr": 3e-4 * (1 - step / 1e6),
            "grad_norm": rng.lognormvariate(0, 0.3), "tokens": 8192.0, "aux": rng.random()}  # fmt: skip
    return dict(list(base.items())[:n]) if n <= len(base) else {**base, **{f"m{i}": rng.random() for i in range(n - 5)}}


def write_run(run_dir: Path, ranks: int, steps: int, n_metrics: int, step_s: float) -> dict[str, float]:
    (run_dir / "telemetry").mkdir(parents=True)
    t0 = 1.8e9
    meta = {"name": run_dir.name, "status": "succeeded", "world_size": ranks, "nproc": ranks, "nodes": 1,
            "strategy": "ddp", "started": t0, "ended": t0 + steps * step_s, "backend": "local",
            "exit_codes": {str(r): 0 for r in range(ranks)}}  # fmt: skip
    (run_dir / "run.json").write_text(json.dumps(meta))
    cpu_per_call = 0.0
    for rank in range(ranks):
        rng = random.Random(rank)
        clock = Clock(t0)
        em = Emitter(rank=rank, sinks=[JsonlFileSink(telemetry_path(run_dir, rank))], clock=clock, interval_s=1.0)
        em.emit("start", world_size=ranks, dp_size=ranks, local_rank=rank, pid=1, host="bench", strategy="ddp")
        values = [metrics_of(rng, s, n_metrics) for s in range(steps)]  # made before timing: only jd.log is timed
        c0 = time.process_time()
        for step in range(steps):
            clock.t += step_s
            em.log(values[step], step)
            if step % int(max(1, 2 / step_s)) == 0:  # the monitor thread's records every 2 s
                em.emit("hb", step=step, phase="forward", phase_s=0.001)
                em.emit("mem", device="cpu", rss=2**30, max_rss=2**30)
        em.close()
        if rank == 0:
            cpu_per_call = (time.process_time() - c0) / steps
        (run_dir / "logs").mkdir(exist_ok=True)
        (run_dir / "logs" / f"rank-{rank}.exit.json").write_text(json.dumps({"code": 0}))
    return {"cpu_per_call_s": cpu_per_call}


def tensor_overhead(steps: int, step_s: float) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        clock = Clock(1.8e9)
        em = Emitter(rank=0, sinks=[JsonlFileSink(telemetry_path(tmp, 0))], clock=clock, interval_s=1.0)
        losses = [torch.rand(()) for _ in range(steps)]
        c0 = time.process_time()
        for step in range(steps):
            clock.t += step_s
            em.log({"loss": losses[step], "lr": 3e-4, "tokens": 8192}, step)
        em.close()
        return (time.process_time() - c0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--metrics", type=int, default=5)
    ap.add_argument("--step-ms", type=float, default=5.0)
    args = ap.parse_args()
    step_s = args.step_ms / 1000
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "bench-run"
        t = time.perf_counter()
        w = write_run(run_dir, args.ranks, args.steps, args.metrics, step_s)
        write_s = time.perf_counter() - t
        files = list((run_dir / "telemetry").glob("*.jsonl"))
        size = sum(f.stat().st_size for f in files)
        lines = sum(f.read_bytes().count(b"\n") for f in files)
        calls = args.ranks * args.steps
        print(f"write: {args.ranks} ranks x {args.steps:,} calls x {args.metrics} metrics in {write_s:.1f} s")
        print(f"  telemetry {size / 1e6:,.1f} MB ({size / calls:.1f} B per call), {lines:,} lines")
        print(
            f"  jd.log CPU per call {w['cpu_per_call_s'] * 1e6:.1f} us = {w['cpu_per_call_s'] / step_s:.2%} of a "
            f"{args.step_ms:g} ms step (floats)"
        )
        tens = tensor_overhead(min(args.steps, 20_000), step_s)
        if tens is not None:
            print(
                f"  jd.log CPU per call {tens * 1e6:.1f} us = {tens / step_s:.2%} of a {args.step_ms:g} ms step "
                f"(a torch tensor loss, read once per batch)"
            )

        from jupyter_dist.launch.run import open_run
        from jupyter_dist.telemetry.reader import read_run_columns

        t = time.perf_counter()
        cols = read_run_columns(run_dir / "telemetry")
        cols_s = time.perf_counter() - t
        run = open_run(run_dir)
        t = time.perf_counter()
        frame = run.metrics()
        metrics_s = time.perf_counter() - t
        rng = random.Random(0)
        want0 = [metrics_of(rng, s, args.metrics)["loss"] for s in range(args.steps)]
        got0 = frame[frame["rank"] == 0]["loss"].tolist()
        exact = got0 == want0
        print(f"read: read_run_columns {cols_s:.2f} s ({sum(len(c) for c in cols.steps.values()):,} calls)")
        print(f"  run.metrics() {metrics_s:.2f} s: {len(frame):,} rows; rank 0's losses equal what it logged: {exact}")

        from jupyter_dist.ui.dashboard import Dashboard

        t = time.perf_counter()
        dash = Dashboard(run_dir, widget=False)
        figs = dash.model.figures()
        open_s = time.perf_counter() - t
        points = max(len(tr["x"]) for f in figs if f["kind"] == "line" for tr in f["traces"])
        print(f"  panels of the finished run open in {open_s:.2f} s (the most points in one trace: {points:,})")
        if not exact:
            raise SystemExit("the stored values differ from the logged ones")


if __name__ == "__main__":
    main()
