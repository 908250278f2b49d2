"""Collective timings for ``comm`` telemetry records: how long each rank spends inside communication.

Two sources, both opt-out with ``JD_COMM_TIMING=0``:

* a DDP communication hook (``jd.wrap`` with ``ddp``) that does what PyTorch's default ``allreduce_hook`` does
  (divide by the world size, all-reduce the bucket asynchronously) and notes the time from the bucket being ready
  to the all-reduce completing -- that includes waiting for slower ranks, so the straggler is the rank that waits
  least;
* thin wrappers around ``torch.distributed`` collectives called from Python (user code, FSDP2, DeepSpeed's comm
  layer): a blocking call is timed; an ``async_op=True`` call is timed to the completion of its work's future.

The totals go out from the telemetry monitor thread as one ``comm`` record per heartbeat interval.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any

__all__ = ["CommStats", "install_collective_timers", "ddp_timing_hook", "COLLECTIVES", "enabled"]

COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter",
    "barrier",
)  # fmt: skip
"""The ``torch.distributed`` functions timed. FSDP2 (torch 2.13) gathers parameters with ``all_gather_single`` and
reduce-scatters gradients with ``reduce_scatter_single``; a name missing from this version of torch is skipped."""


def enabled() -> bool:
    """Whether collective timing is on (``JD_COMM_TIMING`` is not ``0``)."""
    return os.environ.get("JD_COMM_TIMING", "1") != "0"


class CommStats:
    """Per-op totals since the last :meth:`take` (thread-safe: futures complete on other threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ops: dict[str, list[float]] = {}
        self.issued = 0
        """Collectives issued by this rank so far (a hang shows as the rank whose count stopped lowest)."""
        self._recent: list[list[float]] = []  # [collective number, unix time issued] of the last few
        self._since = time.time()

    def add(self, op: str, seconds: float, nbytes: int = 0) -> None:
        """Note one finished collective."""
        with self._lock:
            entry = self._ops.setdefault(op, [0, 0.0, 0])
            entry[0] += 1
            entry[1] += seconds
            entry[2] += nbytes

    def issue(self) -> None:
        """Note one collective started."""
        with self._lock:
            self.issued += 1
            self._recent.append([self.issued, time.time()])
            del self._recent[:-16]

    def take(self) -> dict[str, Any] | None:
        """The fields of a ``comm`` record for the window since the last call, or ``None`` if nothing happened."""
        with self._lock:
            now = time.time()
            ops, self._ops = self._ops, {}
            window, self._since = now - self._since, now
            if not ops:
                return None
            return {
                "count": int(sum(v[0] for v in ops.values())),
                "seconds": round(sum(v[1] for v in ops.values()), 6),
                "bytes": int(sum(v[2] for v in ops.values())),
                "window_s": round(window, 3),
                "issued": self.issued,
                "recent": [[int(n), round(t, 6)] for n, t in self._recent],
                "ops": {k: {"count": int(v[0]), "seconds": round(v[1], 6), "bytes": int(v[2])} for k, v in ops.items()},
            }


def _nbytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    tensor = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(tensor, (list, tuple)):
        tensor = tensor[0] if tensor else None
    try:
        return int(tensor.numel() * tensor.element_size())  # type: ignore[union-attr]
    except Exception:
        return 0


def install_collective_timers(dist: Any, stats: CommStats) -> list[str]:
    """Wrap ``dist``'s collectives so each call is counted and timed into ``stats``; returns the wrapped names.

    Idempotent: an already wrapped function is not wrapped again, but reports to ``stats`` from now on (a fresh
    runtime in the same process, e.g. the next configuration of a harness, counts its own collectives).
    """
    wrapped = []
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        if getattr(fn, "__jd_timed__", False):
            fn.__jd_stats__ = stats
            continue

        def make(fn: Any, name: str) -> Any:
            @functools.wraps(fn)
            def timed(*args: Any, **kwargs: Any) -> Any:
                stats = timed.__jd_stats__  # type: ignore[attr-defined]
                stats.issue()
                t0 = time.perf_counter()
                work = fn(*args, **kwargs)
                nbytes = _nbytes(args, kwargs)
                if kwargs.get("async_op") and work is not None and hasattr(work, "get_future"):
                    try:
                        work.get_future().add_done_callback(
                            lambda _f: stats.add(name, time.perf_counter() - t0, nbytes)
                        )
                    except Exception:  # some backends' works have no future: count the launch only
                        stats.add(name, time.perf_counter() - t0, nbytes)
                else:
                    stats.add(name, time.perf_counter() - t0, nbytes)
                return work

            timed.__jd_timed__ = True  # type: ignore[attr-defined]
            timed.__jd_stats__ = stats  # type: ignore[attr-defined]
            return timed

        setattr(dist, name, make(fn, name))
        wrapped.append(name)
    return wrapped


def ddp_timing_hook(stats: CommStats) -> Any:
    """A DDP comm hook equal to PyTorch's default all-reduce hook, plus timing (state: the process group or None)."""

    # no annotations: DDP compares them with dist.GradBucket / Future[Tensor], and this module's are strings
    def hook(process_group, bucket):  # type: ignore[no-untyped-def]
        import torch.distributed as dist

        group = process_group if process_group is not None else dist.group.WORLD
        tensor = bucket.buffer()
        tensor.div_(dist.get_world_size(group))
        nbytes = int(tensor.numel() * tensor.element_size())
        stats.issue()
        t0 = time.perf_counter()
        # call the original function object so the bucket is not counted twice by the Python-level wrappers
        all_reduce = getattr(dist.all_reduce, "__wrapped__", dist.all_reduce)
        fut = all_reduce(tensor, group=group, async_op=True).get_future()

        def done(f: Any) -> Any:
            stats.add("all_reduce (DDP buckets)", time.perf_counter() - t0, nbytes)
            return f.value()[0]

        return fut.then(done)

    return hook
