"""Stale build locks of PyTorch C++ extensions, removed before DeepSpeed loads its ops.

Every load of a DeepSpeed op on CPU (``deepspeed_shm_comm`` at ``deepspeed.initialize``, ``cpu_adam`` for offload)
goes through ``torch.utils.cpp_extension``, which takes ``<TORCH_EXTENSIONS_DIR>/<op>/lock`` (a ``FileBaton``: a
file created with ``O_EXCL``, no owner recorded) while ninja checks or rebuilds the op, and removes it after. A
process killed in that window (a run stopped or timed out while its ranks start, a kernel restarted) leaves the file
behind, and every later run that loads the op waits for it forever: a hang with no message (seen here twice, each
time after a killed test run). :func:`clear_stale_locks` removes a lock that is older than :data:`STALE_AFTER` and
that no live process is building under (ninja and the compilers it starts run with the op's folder as their working
directory), and says so once in the rank's log.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["STALE_AFTER", "clear_stale_locks", "extensions_root", "stale_lock_guard"]

_log = logging.getLogger("jupyter_dist.worker")

STALE_AFTER = 60.0
"""Seconds after which a build lock with no process building under its folder is taken as left by a killed process.
The lock's holder either builds (ninja and the compilers run with the op's folder as their working directory, which
:func:`_building_under` sees, however long a cold build of ``cpu_adam`` takes) or only checks the built op and loads
it, well under a second; a minute leaves room for a loaded machine. (It was 300 s: a lock left by a run stopped while
its ranks loaded the op then held every DeepSpeed run of the next five minutes.)"""


def extensions_root() -> Path:
    """Where PyTorch builds C++ extensions: ``$TORCH_EXTENSIONS_DIR``, else torch's default build root."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def _building_under(folder: Path) -> bool:
    """Whether a live process works in ``folder`` (its working directory is there or below it)."""
    import psutil

    target = str(folder.resolve())
    for proc in psutil.process_iter(["cwd"]):
        cwd = proc.info.get("cwd")
        if cwd and (cwd == target or cwd.startswith(target + os.sep)):
            return True
    return False


def clear_stale_locks(root: Path | None = None, *, stale_after: float = STALE_AFTER) -> list[Path]:
    """Remove the stale ``<op>/lock`` files under ``root`` (default :func:`extensions_root`); returns those removed."""
    try:
        base = extensions_root() if root is None else root
        locks = sorted(base.glob("*/lock"))
    except (OSError, ImportError):
        return []
    removed = []
    now = time.time()
    for lock in locks:
        try:
            age = now - lock.stat().st_mtime
        except OSError:
            continue  # released meanwhile
        if age < stale_after or _building_under(lock.parent):
            continue
        try:
            lock.unlink()
        except OSError:
            continue
        removed.append(lock)
        _log.warning(
            "jupyter-dist: removed a stale build lock %s (%.0f s old, no process building there): a load of this "
            "op was killed before it finished, and every later load would have waited for it forever",
            lock, age,
        )  # fmt: skip
    return removed


GUARD_INTERVAL = 15.0
"""Seconds between two looks for stale locks while DeepSpeed loads its ops (:func:`stale_lock_guard`)."""


@contextmanager
def stale_lock_guard(interval: float = GUARD_INTERVAL, root: Path | None = None) -> Iterator[None]:
    """Clear stale locks now and every ``interval`` s until the block ends (``deepspeed.initialize``).

    One look before the load is not enough: a lock that was young, or that a build was working under, may be
    abandoned a moment later (its builder killed), and the load that waits on it would then wait forever.
    """
    clear_stale_locks(root)
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(interval):
            clear_stale_locks(root)

    thread = threading.Thread(target=watch, name="jd-oplocks", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
