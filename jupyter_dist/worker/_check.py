"""The preflight check as it runs inside every rank.

Versions, a correctness all-reduce, then collective timings over a range of message sizes, measured the way
nccl-tests does (warm-up, then the mean of ``iters`` calls, the slowest rank's time). Rank 0 writes
``<run dir>/check.json``; :mod:`jupyter_dist.launch.check` reads and judges it.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
from typing import Any

__all__ = ["run_check", "OPS"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
"""Collectives the check times (all-gather and reduce-scatter use the ``*_tensor`` forms)."""


def _rank_info(dist: Any, torch: Any) -> dict[str, Any]:
    info: dict[str, Any] = {
        "rank": dist.get_rank(), "host": socket.gethostname(), "pid": os.getpid(), "python": platform.python_version(),
        "torch": torch.__version__, "backend": str(dist.get_backend()), "cuda": torch.version.cuda,
        "nccl": None, "device": "cpu", "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
        "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
    }  # fmt: skip
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(torch.cuda.current_device())
        try:
            v = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:
            info["nccl"] = None
    return info


def run_check(sizes: list[int], ops: list[str], *, iters: int = 5, warmup: int = 1, delay_rank: int = -1,
              delay_s: float = 0.0) -> dict[str, Any] | None:  # fmt: skip
    """Run the check on this rank; returns the report on rank 0 (also written to ``check.json``), else ``None``.

    ``delay_rank``/``delay_s`` make one rank sleep before each timed call (to test straggler detection).
    """
    import torch
    import torch.distributed as dist

    import jupyter_dist.worker as jd

    jd.init()
    rank, n = dist.get_rank(), dist.get_world_size()
    device = jd.device
    infos: list[Any] = [None] * n
    dist.all_gather_object(infos, _rank_info(dist, torch))
    probe = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(probe)
    correct = bool(torch.allclose(probe.cpu(), torch.full((4,), n * (n + 1) / 2)))
    results: list[dict[str, Any]] = []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for op in ops:
        for size in sizes:
            numel = max(n, size // 4) // n * n  # float32 elements, divisible by the world size
            entry: dict[str, Any] = {"op": op, "bytes": numel * 4}
            try:
                call = _collective(dist, torch, op, numel, n, device)
                for _ in range(warmup):
                    call()
                sync()
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    if rank == delay_rank:
                        time.sleep(delay_s)
                    call()
                sync()
                mine = (time.perf_counter() - t0) / iters
                times = torch.tensor([mine], dtype=torch.float64, device=device)
                gathered = [torch.zeros_like(times) for _ in range(n)]
                dist.all_gather(gathered, times)
                entry["seconds_per_rank"] = [float(t.item()) for t in gathered]
                entry["seconds"] = max(entry["seconds_per_rank"])
            except Exception as exc:  # an op the backend lacks is reported, not fatal
                entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            results.append(entry)
            if "error" in entry:
                break
    report = {"world_size": n, "ranks": infos, "correct": correct, "results": results, "iters": iters,
              "python_executable": sys.executable, "t": time.time()}  # fmt: skip
    if rank == 0:
        run_dir = os.environ.get("JD_RUN_DIR")
        if run_dir:
            path = os.path.join(run_dir, "check.json")
            with open(path + ".tmp", "w") as f:
                json.dump(report, f)
            os.replace(path + ".tmp", path)
        return report
    return None


def _collective(dist: Any, torch: Any, op: str, numel: int, n: int, device: Any) -> Any:
    if op == "all_reduce":
        t = torch.ones(numel, device=device)
        return lambda: dist.all_reduce(t)
    if op == "broadcast":
        t = torch.ones(numel, device=device)
        return lambda: dist.broadcast(t, 0)
    if op == "all_gather":  # nccl-tests' size: the gathered (output) buffer
        out = torch.empty(numel, device=device)
        inp = torch.ones(numel // n, device=device)
        return lambda: dist.all_gather_into_tensor(out, inp)
    if op == "reduce_scatter":  # nccl-tests' size: the input buffer
        out = torch.empty(numel // n, device=device)
        inp = torch.ones(numel, device=device)
        return lambda: dist.reduce_scatter_tensor(out, inp)
    raise ValueError(f"unknown collective {op!r}; valid: {', '.join(OPS)}")
