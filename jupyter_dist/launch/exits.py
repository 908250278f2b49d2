"""How each rank ended: its exit file or torchrun's failure table, the signal that killed it, whether it was OOM.

A rank killed by a signal (SIGKILL from the OOM killer, SIGSEGV, SIGBUS) cannot write ``logs/rank-<k>.exit.json``;
torchrun's agent saw its exit code (``-<signal>``) and printed it in its ``ChildFailedError`` table in
``logs/launcher.log``. Such a rank is the cause and its peers' "connection closed by peer" the consequence, so it is
named first (:func:`culprit`). Whether the signal came from the OOM killer is said for sure only where the machine
tells: the cgroup's OOM-kill counter (v2 ``memory.events``, v1 ``memory.oom_control``, read at launch and at the
end) or the kernel log (``dmesg``, often not readable by users).
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .rundir import RunDir

__all__ = ["RankExit", "rank_exits", "culprit", "oom_kill_count", "kernel_oom_line", "peak_rss", "killed_report",
           "STOP_SIGNALS", "SIGNAL_NAMES"]  # fmt: skip

STOP_SIGNALS = frozenset({1, 2, 15})
"""SIGHUP, SIGINT, SIGTERM: how a launcher (or the user) stops ranks; a rank ended by one of these is a consequence."""

SIGNAL_NAMES = {1: "SIGHUP", 2: "SIGINT", 4: "SIGILL", 6: "SIGABRT", 7: "SIGBUS", 8: "SIGFPE", 9: "SIGKILL",
                11: "SIGSEGV", 15: "SIGTERM"}  # fmt: skip

_FIELD = re.compile(r"^\s*(time|rank|exitcode)\s*:\s*(.*)$")


@dataclass(frozen=True, kw_only=True, slots=True)
class RankExit:
    """How one rank ended."""

    rank: int
    """Global rank."""
    code: int
    """Exit code; ``-N`` when signal ``N`` killed it (torchrun's convention)."""
    source: str
    """``exit file`` (the bootstrap wrote it) or ``torchrun`` (the agent's failure table in ``launcher.log``)."""
    t: float | None = None
    """When it ended (the exit file's clock); ``None`` from torchrun's table (whole seconds only)."""
    pid: int | None = None
    """The rank's process id when torchrun printed it."""

    @property
    def signal(self) -> int | None:
        """The signal that ended the rank, if one did."""
        return -self.code if self.code < 0 else None

    @property
    def signal_name(self) -> str:
        """``SIGKILL``, ``SIGSEGV``... (``signal N`` for others)."""
        sig = self.signal
        return SIGNAL_NAMES.get(sig, f"signal {sig}") if sig is not None else ""


def _torchrun_table(text: str) -> dict[int, RankExit]:
    """Each rank's exit code and pid from torchrun's ``ChildFailedError`` table (the last table wins)."""
    out: dict[int, RankExit] = {}
    rank: int | None = None
    for line in text.splitlines():
        m = _FIELD.match(line)
        if not m:
            continue
        key, value = m.groups()
        if key == "rank":
            rank = int(value.split()[0]) if value.split() and value.split()[0].isdigit() else None
        elif key == "exitcode" and rank is not None:
            code = re.match(r"(-?\d+)(?:\s*\(pid:\s*(\d+)\))?", value)
            if code:
                pid = int(code.group(2)) if code.group(2) else None
                out[rank] = RankExit(rank=rank, code=int(code.group(1)), source="torchrun", pid=pid)
            rank = None
    return out


def rank_exits(rd: RunDir, world_size: int) -> dict[int, RankExit]:
    """Every rank that left an exit: its own exit file first, else torchrun's table (a killed rank has no file)."""
    out: dict[int, RankExit] = {}
    for r in range(world_size):
        try:
            rec = json.loads(rd.exit_file(r).read_text())
            out[r] = RankExit(rank=r, code=int(rec["code"]), source="exit file", t=float(rec.get("t") or 0.0))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    try:
        table = _torchrun_table((rd.logs / "launcher.log").read_text(errors="replace"))
    except OSError:
        table = {}
    for r, ex in table.items():
        if r not in out and 0 <= r < world_size:
            out[r] = ex
    return out


def culprit(exits: dict[int, RankExit]) -> RankExit | None:
    """The rank that ended by a signal other than a stop signal (lowest rank when several); ``None`` if none did."""
    killed = [ex for r, ex in sorted(exits.items()) if ex.signal is not None and ex.signal not in STOP_SIGNALS]
    return killed[0] if killed else None


def _cgroup_files() -> list[Path]:
    """Where this process's cgroup keeps its OOM-kill counter (v2 ``memory.events``, v1 ``memory.oom_control``)."""
    root = Path("/sys/fs/cgroup")
    found: list[Path] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        rel = path.lstrip("/")
        if controllers == "":  # v2 unified hierarchy
            found += [root / rel / "memory.events", root / "memory.events"]
        elif "memory" in controllers.split(","):
            found += [root / "memory" / rel / "memory.oom_control", root / "memory" / "memory.oom_control"]
    return found


def oom_kill_count() -> int | None:
    """OOM kills in this process's cgroup so far (the ranks of a local run share it), or ``None`` if unreadable."""
    for path in _cgroup_files():
        try:
            text = path.read_text()
        except OSError:
            continue
        m = re.search(r"^oom_kill (\d+)$", text, re.M)
        if m:
            return int(m.group(1))
    return None


def kernel_oom_line(pid: int | None) -> str | None:
    """The kernel log's line saying the OOM killer killed ``pid`` (``None``: not found, or the log is not readable)."""
    if pid is None:
        return None
    try:
        res = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=3, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if res.returncode != 0:
        return None
    pattern = re.compile(rf"(Killed process {pid}\b|oom-kill:.*\bpid={pid}\b)")
    lines = [ln.strip() for ln in res.stdout.splitlines() if pattern.search(ln)]
    return lines[-1] if lines else None


def peak_rss(telemetry: Path, rank: int) -> int | None:
    """The highest resident memory a rank's ``mem`` records reported (``max_rss`` or ``rss``), in bytes."""
    best: int | None = None
    try:
        fh = open(telemetry / f"rank-{rank}.jsonl", errors="replace")  # noqa: SIM115 - closed below
    except OSError:
        return None
    with fh:
        for line in fh:
            if '"mem"' not in line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("kind") != "mem":
                continue
            for key in ("max_rss", "rss"):
                if isinstance(rec.get(key), int):
                    best = max(best or 0, rec[key])
    return best


def killed_report(ex: RankExit, *, peak: int | None, oom_before: int | None, oom_after: int | None,
                  kernel_line: str | None) -> dict[str, Any]:  # fmt: skip
    """The culprit described: ``reason`` (one sentence for the summary), ``oom`` (True / False / None: unknown)."""
    name = ex.signal_name
    text = f"rank {ex.rank} was killed by {name}"
    oom: bool | None = None
    if ex.signal == 9:
        text += " — the kernel's out-of-memory killer sends this"
        if peak is not None:
            text += f"; its peak RSS was {peak / 2**20:.0f} MiB"
        if kernel_line:
            oom = True
            text += f"; the kernel log confirms it ({kernel_line})"
        elif oom_before is not None and oom_after is not None:
            oom = oom_after > oom_before
            text += (
                f"; the cgroup counted {oom_after - oom_before} OOM kill(s) during the run: it was the OOM killer"
                if oom
                else "; the cgroup counted no OOM kill during the run: most likely another process sent it"
            )
    elif ex.signal == 11:
        text += " (a segmentation fault: a crash in native code)"
    elif ex.signal == 7:
        text += " (a bus error: typically /dev/shm exhausted)"
    if peak is not None and ex.signal != 9:
        text += f"; its peak RSS was {peak / 2**20:.0f} MiB"
    return {"rank": ex.rank, "code": ex.code, "signal": name, "pid": ex.pid, "peak_rss": peak, "oom": oom,
            "kernel_log": kernel_line, "reason": text}  # fmt: skip
