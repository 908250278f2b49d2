"""Route a remote job's log stream into the run directory, so remote runs have the files local runs have.

A cluster job's output arrives as lines (a SLURM output file, SkyPilot's log tailing). :class:`LogRouter` takes them
and writes:

* every line, cleaned of ANSI colours and of SkyPilot's ``(head, rank=0, pid=123)`` / ``(worker1, ...)`` prefix, to
  ``logs/launcher.log``;
* lines a worker printed with the ``[rank K]`` prefix (the bootstrap adds it in stream mode) to ``logs/rank-K.log``;
* telemetry records (lines with the sentinel, anywhere in the line) through a
  :class:`~jupyter_dist.telemetry.reader.TelemetryReader` (``feed``), de-duplicated by (rank, seq), appended to
  ``telemetry/rank-K.jsonl``; an ``exit`` record also writes ``logs/rank-K.exit.json`` when the rank left none.

So ``Run.records()``, ``Run.metrics()``, ``Run.logs()`` and the dashboard (which follows ``telemetry/``) work
unchanged. Reattaching replays the stream from its start: records already in ``telemetry/`` are skipped (the
reader is seeded with them) and the stream logs are rewritten, not appended twice.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

from ...telemetry.reader import FileFollower, TelemetryReader
from ...telemetry.records import SENTINEL, encode
from ..rundir import RunDir

__all__ = ["LogRouter", "clean_line", "RANK_PREFIX"]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_SKY_PREFIX = re.compile(r"^\((?:head|worker\d*|task)[^()]*?(?:rank=\d+)?[^()]*\)\s?")
RANK_PREFIX = re.compile(r"^\[rank (\d+)\] ?")
"""What the bootstrap puts before each line a rank prints when its output goes to a shared stream."""


def clean_line(line: str) -> str:
    """Without ANSI escapes, carriage-return progress overwrites, SkyPilot's node prefix and the trailing newline."""
    line = _ANSI.sub("", line.rstrip("\r\n"))
    if "\r" in line:
        line = line.rsplit("\r", 1)[-1]
    return _SKY_PREFIX.sub("", line, count=1)


class LogRouter:
    """Callable with a batch of raw lines; writes them into the run directory (thread-safe)."""

    def __init__(self, run_dir: RunDir, *, launcher_log: str = "launcher.log") -> None:
        self.rd = run_dir.create()
        self.reader = TelemetryReader(None, maxlen=16)
        seed = FileFollower(self.rd.telemetry).poll()  # records already routed (reattach): never write them twice
        self.reader.records.parse(seed)
        self.reader.add_listener(self._write_records)
        self.lines = 0
        self.records = 0
        self._lock = threading.Lock()
        self._logs: dict[str, Any] = {}
        self._launcher_log = launcher_log
        self._truncated: set[Path] = set()

    def __call__(self, lines: list[str]) -> None:
        """Route one batch."""
        with self._lock:
            cleaned = [clean_line(ln) for ln in lines]
            self.reader.feed(cleaned)
            self.reader.poll()  # records go to telemetry/ now, in arrival order
            for line in cleaned:
                self.lines += 1
                if SENTINEL in line:
                    continue
                self._write(self.rd.logs / self._launcher_log, line)
                m = RANK_PREFIX.match(line)
                if m:
                    self._write(self.rd.rank_log(int(m.group(1))), line[m.end() :])
            for fh in self._logs.values():
                fh.flush()

    def _write(self, path: Path, line: str) -> None:
        fh = self._logs.get(str(path))
        if fh is None:
            # the stream is replayed from its start on reattach: rewrite what this router writes, once
            fh = self._logs[str(path)] = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        fh.write(line + "\n")

    def _write_records(self, records: list[dict[str, Any]]) -> None:
        by_rank: dict[int, list[dict[str, Any]]] = {}
        for rec in records:
            by_rank.setdefault(int(rec["rank"]), []).append(rec)
        for rank, recs in by_rank.items():
            with open(self.rd.telemetry / f"rank-{rank}.jsonl", "a", encoding="utf-8") as fh:
                fh.writelines(encode(r) + "\n" for r in recs)
            self.records += len(recs)
            for rec in recs:
                exit_file = self.rd.exit_file(rank)
                if rec.get("kind") == "exit" and not exit_file.exists():
                    code = 0 if rec.get("status") == "ok" else 1
                    error = f"{rec.get('error_type')}: {rec.get('error')}" if rec.get("error_type") else None
                    exit_file.write_text(json.dumps({"rank": rank, "code": code, "error": error, "t": rec.get("t")}))

    def close(self) -> None:
        """Flush and close the log files."""
        with self._lock:
            for fh in self._logs.values():
                fh.close()
            self._logs.clear()
