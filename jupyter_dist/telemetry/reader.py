"""Read telemetry records from a run's ``telemetry/rank-<k>.jsonl`` files (or any lines carrying the sentinel).

Records are de-duplicated by (rank, seq); torn, partial or foreign lines are counted, never fatal.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .records import SENTINEL, decode

__all__ = ["SENTINEL", "RecordSet", "read_run_records"]

@dataclass
class RecordSet:
    """Records seen so far, in arrival order, de-duplicated by (rank, seq)."""

    records: list[dict[str, Any]] = field(default_factory=list)
    """Accepted records."""
    bad_lines: int = 0
    """Torn or foreign lines skipped."""
    duplicates: int = 0
    """Records dropped because their (rank, seq) was seen already."""
    _seen: set[tuple[int, int]] = field(default_factory=set, repr=False)

    def add_lines(self, lines: Iterable[str]) -> int:
        """Parse and add lines; returns how many records were accepted."""
        added = 0
        for line in lines:
            if not line.strip():
                continue
            rec = decode(line)
            if rec is None:
                self.bad_lines += 1
                continue
            key = (int(rec["rank"]), int(rec["seq"]))
            if key in self._seen:
                self.duplicates += 1
                continue
            self._seen.add(key)
            self.records.append(rec)
            added += 1
        return added

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        """Records of one kind (``step``, ``exit``, ...)."""
        return [r for r in self.records if r.get("kind") == kind]


def read_run_records(telemetry_dir: str | os.PathLike[str]) -> RecordSet:
    """All records of a run directory's ``telemetry/`` folder (complete lines only)."""
    rs = RecordSet()
    folder = Path(telemetry_dir)
    if not folder.is_dir():
        return rs
    for path in sorted(folder.glob("rank-*.jsonl")):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        lines = text.split("\n")
        if lines and lines[-1] and not text.endswith("\n"):
            lines = lines[:-1]  # a line still being written
        rs.add_lines(lines)
    return rs
