"""The run directory: ``run.json``, ``script.py``, configs, ``logs/``, ``telemetry/``, ``checkpoints/``.

A run can be reopened from its directory after a kernel restart (``%dist_attach``). ``run.json`` is the run's
:class:`~.record.RunRecord`, written and read only through :mod:`.record` (atomically: a reader never sees half).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._atomic import describe_write_error, write_atomic
from ..errors import JupyterDistError
from ..render.common import SECRET_NAMES
from .record import RunRecord, read_record, write_record

__all__ = ["RunDir", "new_run_dir", "scrub_env"]

MAX_NAME = 64
"""Longest run name kept in a directory name (the rest is cut; file names are limited to 255 bytes)."""

_SECRET_HINTS = ("TOKEN", "SECRET", "PASSWORD", "API_KEY", "APIKEY", "CREDENTIAL")


def scrub_env(env: dict[str, str]) -> dict[str, str]:
    """The environment as saved in run.json: secret-looking values replaced by ``"<redacted>"``."""
    return {
        k: ("<redacted>" if k in SECRET_NAMES or any(h in k.upper() for h in _SECRET_HINTS) else v)
        for k, v in env.items()
    }


@dataclass(frozen=True, slots=True)
class RunDir:
    """Paths inside one run directory."""

    path: Path

    @property
    def run_json(self) -> Path:
        """Metadata: plan, argv, env (scrubbed), status, exit codes."""
        return self.path / "run.json"

    @property
    def script(self) -> Path:
        """The training script (the cell's code)."""
        return self.path / "script.py"

    @property
    def logs(self) -> Path:
        """``rank-<k>.log`` per rank, ``launcher.log`` for torchrun itself."""
        return self.path / "logs"

    @property
    def telemetry(self) -> Path:
        """``rank-<k>.jsonl`` records."""
        return self.path / "telemetry"

    @property
    def checkpoints(self) -> Path:
        """Checkpoints written by ``jd.save``."""
        return self.path / "checkpoints"

    @property
    def annotations(self) -> Path:
        """``annotations.json``: the tags and notes given with ``Run.tag`` / ``Run.note``."""
        return self.path / "annotations.json"

    @property
    def profile(self) -> Path:
        """``rank-<k>.pt.trace.json`` per rank: the ``torch.profiler`` traces of ``--profile`` / ``jd.profile``."""
        return self.path / "profile"

    def read_annotations(self) -> dict[str, Any]:
        """``{"tags": [...], "notes": [{"t": unix s, "text": ...}]}`` (empty lists when none were written)."""
        try:
            data = json.loads(self.annotations.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = {}
        if not isinstance(data, dict):
            data = {}
        tags = [str(t) for t in data.get("tags") or [] if isinstance(t, str)]
        notes = [n for n in data.get("notes") or [] if isinstance(n, dict) and isinstance(n.get("text"), str)]
        return {"tags": tags, "notes": notes}

    def write_annotations(self, data: dict[str, Any]) -> None:
        """Atomically replace ``annotations.json``."""
        write_atomic(self.annotations, json.dumps(data, indent=1))

    def rank_log(self, rank: int) -> Path:
        """Log of one rank."""
        return self.logs / f"rank-{rank}.log"

    def exit_file(self, rank: int) -> Path:
        """Exit status the bootstrap writes for one rank."""
        return self.logs / f"rank-{rank}.exit.json"

    def create(self) -> RunDir:
        """Make the folders."""
        for p in (self.path, self.logs, self.telemetry, self.checkpoints):
            p.mkdir(parents=True, exist_ok=True)
        return self

    def write_meta(self, meta: dict[str, Any] | RunRecord) -> RunRecord:
        """Atomically replace ``run.json`` (through :func:`~.record.write_record`, its one writer); returns it."""
        return write_record(self.path, meta)

    def read_record(self) -> RunRecord:
        """The typed record (:func:`~.record.read_record`); a damaged ``run.json`` is a ``JupyterDistError``."""
        return read_record(self.path)

    def read_meta(self) -> dict[str, Any]:
        """``run.json`` as a dict in its current layout (read through :func:`~.record.read_record`, any layout)."""
        return read_record(self.path).to_dict()

    def exit_codes(self, world_size: int) -> dict[int, int | None]:
        """Per-rank exit codes the bootstrap recorded (None where a rank left none, e.g. killed)."""
        out: dict[int, int | None] = {}
        for r in range(world_size):
            try:
                out[r] = int(json.loads(self.exit_file(r).read_text())["code"])
            except (OSError, ValueError, KeyError, TypeError):
                out[r] = None
        return out


RUNS_DIR_HINT = "free space or choose --runs-dir elsewhere"
"""What a run that cannot write its folder tells the user to do."""


@contextmanager
def removed_on_write_error(rd: RunDir) -> Iterator[RunDir]:
    """Turn a failed write inside into one line and remove the half-made run folder.

    ``no space left on device writing <path>: free space or choose --runs-dir elsewhere``, not a traceback.
    """
    try:
        yield rd
    except OSError as exc:
        shutil.rmtree(rd.path, ignore_errors=True)
        raise JupyterDistError(describe_write_error(exc, rd.path, hint=RUNS_DIR_HINT)) from None


def new_run_dir(root: str | os.PathLike[str], name: str) -> RunDir:
    """A fresh ``<root>/<name>-<YYYYmmdd-HHMMSS>[-n]`` directory, never one another run (or kernel) has.

    The name keeps letters, digits, ``_``, ``.`` and ``-`` (anything else, path separators and NUL included, becomes
    ``-``; no leading dot, so never ``..``) and at most :data:`MAX_NAME` characters. The folder is claimed with an
    exclusive ``mkdir``, so two runs started at once with the same name get distinct directories.
    """
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name)[:MAX_NAME].strip("-.") or "run"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        base = Path(root).expanduser().resolve() / f"{safe}-{stamp}"
        base.parent.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise JupyterDistError(f"cannot use {os.fspath(root)!r} as the runs folder: {why}") from None
    path, n = base, 1
    while True:
        try:
            path.mkdir()  # exclusive: fails if another run claimed this name first
            break
        except FileExistsError:
            n += 1
            path = base.with_name(f"{base.name}-{n}")
        except OSError as exc:
            raise JupyterDistError(f"cannot create a run directory in {base.parent}: {exc.strerror or exc}") from None
    with removed_on_write_error(RunDir(path)) as rd:
        return rd.create()
