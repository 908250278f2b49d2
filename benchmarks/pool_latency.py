"""The interactive pool's costs on this machine: start, a trivial cell's round trip, push/pull of a large tensor, stop.

Run: python benchmarks/pool_latency.py [--nproc 2] [--cells 200] [--mb 100]
Prints the time to start the pool (torchrun, process group, every rank connected), the round-trip latency of a
trivial cell (``pass`` on every rank: request signed, sent, executed, answered, verified) as median and p90, an
all-reduce cell, push of an ``--mb`` MB float32 tensor to every rank, pull of one back from one rank, and stop.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    """Measure and print."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--cells", type=int, default=200)
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3, help="push/pull repetitions (median)")
    args = ap.parse_args()

    import torch

    from jupyter_dist.pool.kernel import start_pool

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        pool = start_pool(nproc=args.nproc, runs_dir=tmp, strategy="none")
        start_s = time.perf_counter() - t0
        try:
            pool.execute("import torch, torch.distributed as dist\nt = torch.ones(1024)")
            for _ in range(10):  # warm up
                pool.execute("pass")
            trivial = []
            for _ in range(args.cells):
                t = time.perf_counter()
                pool.execute("pass")
                trivial.append(time.perf_counter() - t)
            allreduce = []
            for _ in range(50):
                t = time.perf_counter()
                pool.execute("dist.all_reduce(t)")
                allreduce.append(time.perf_counter() - t)
            big = torch.randn(args.mb * 1024 * 1024 // 4)
            push, pull = [], []
            for _ in range(args.repeat):
                t = time.perf_counter()
                pool.push({"big": big})
                push.append(time.perf_counter() - t)
                t = time.perf_counter()
                back = pool.pull("big", rank=pool.world_size - 1)
                pull.append(time.perf_counter() - t)
                assert torch.equal(back, big)
                del back
        finally:
            t = time.perf_counter()
            pool.stop()
            stop_s = time.perf_counter() - t

    ms = 1000.0
    print(f"pool of {args.nproc} ranks (CPU, gloo), torch {torch.__version__}")
    print(f"start (torchrun, process group, all ranks connected): {start_s:.2f} s")
    print(f"trivial cell round trip ({args.cells} cells): median {statistics.median(trivial) * ms:.2f} ms, "
          f"p90 {_quantile(trivial, 0.9) * ms:.2f} ms")  # fmt: skip
    print(f"all_reduce of 1024 floats as a cell: median {statistics.median(allreduce) * ms:.2f} ms")
    print(f"push {args.mb} MB tensor to {args.nproc} ranks: median {statistics.median(push):.2f} s "
          f"({args.mb * args.nproc / statistics.median(push):.0f} MB/s delivered)")  # fmt: skip
    print(f"pull {args.mb} MB tensor from one rank: median {statistics.median(pull):.2f} s "
          f"({args.mb / statistics.median(pull):.0f} MB/s)")  # fmt: skip
    print(f"stop (every process gone): {stop_s:.2f} s")


if __name__ == "__main__":
    main()
