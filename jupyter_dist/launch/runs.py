"""The runs under a runs folder as one table: sortable, filterable, one call to open a run's panels.

:func:`runs` reads, per run directory, ``run.json`` (a few KiB), ``annotations.json`` (tags, notes) and the small
``summary.json`` a run writes when it ends (:mod:`jupyter_dist.telemetry.summary`). A run that is still going has
its telemetry followed: each table reads only the lines written since the previous one (kept per run directory in
this process); one that ended before summaries existed is read once and its summary saved.

:class:`RunTable` is a plain value (no pandas): ``.sort("best_loss")``, ``.filter(status="succeeded",
tag="baseline")``, ``.open("run-2026...")``; every hyperparameter of the runs' records is a column too
(``.sort("-lr")``, ``.filter(lr=3e-4)``; ``hp.lr`` where a name is also a field), and the table shows those that
differ between runs; it displays itself as an HTML table, and ``.widget()`` gives the
interactive view the notebook front-end subscribed (``jupyter_dist.ui.runs_view``).
"""

from __future__ import annotations

import html
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..errors import JupyterDistError
from ..telemetry.reader import FileFollower, RecordSet
from ..telemetry.summary import SummaryBuilder, read_summary, summarize_dir, write_summary
from .base import DEFAULT_BACKEND, runs_here
from .record import settle_stale
from .rundir import RunDir

__all__ = ["RunRow", "RunTable", "runs", "COLUMNS", "FINAL_STATES", "Orphan", "orphans", "orphans_notice"]

FINAL_STATES = ("succeeded", "failed", "stopped", "timed out", "hung")
"""Statuses of a run that has ended (its summary is final)."""
GIB = float(1 << 30)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunRow:
    """One run of the table: what its directory says, without reading its telemetry lines."""

    name: str
    """The run directory's name."""
    path: str
    """The run directory."""
    backend: str
    """``local``, ``slurm`` or ``skypilot``."""
    strategy: str
    """The base strategy (``ddp``, ``fsdp2``, ``zero3``, ``none``)."""
    candidate: str
    """The candidate with its degrees (``fsdp2+tp2+sp``); the strategy when the run predates candidates."""
    mesh: str
    """The mesh line the run was started with (its first note), e.g. ``"2 ranks: dp_shard 2"``."""
    status: str
    """pending, running, succeeded, failed, stopped, timed out or hung."""
    world_size: int
    """Ranks."""
    steps: int
    """Highest logged step + 1."""
    last_loss: float | None
    """Loss of the last logged step (mean over ranks)."""
    best_loss: float | None
    """Lowest loss of a logged step (mean over ranks)."""
    throughput: float | None
    """Tokens/s (else samples/s, else steps/s; see :attr:`throughput_unit`), each data-parallel replica counted once."""
    throughput_unit: str | None
    """``tokens/s``, ``samples/s`` or ``steps/s``."""
    peak_mem: tuple[int, ...]
    """Peak memory per rank in bytes (rank order)."""
    started: float | None
    """Unix time the run started."""
    duration: float | None
    """Seconds from start to end (to now for a running run)."""
    restarts: int
    """Elastic restarts seen in the telemetry."""
    tags: tuple[str, ...] = ()
    """Tags given with ``Run.tag``."""
    notes: tuple[str, ...] = field(default=(), repr=False)
    """Notes given with ``Run.note``."""
    hparams: dict[str, Any] = field(default_factory=dict)
    """The run's hyperparameters (its record's: shipped scalars, ``jd.config``, a Trainer's, Lightning's)."""

    def value(self, column: str) -> Any:
        """A column's value: a field, ``peak_mem_max``, or a hyperparameter (``lr`` or ``hp.lr``; ``None`` if unset)."""
        if column in _SORTABLE:
            return getattr(self, column)
        return self.hparams.get(column[3:] if column.startswith("hp.") else column)

    @property
    def peak_mem_max(self) -> int | None:
        """The largest per-rank peak (bytes), or ``None``."""
        return max(self.peak_mem) if self.peak_mem else None

    def open(self) -> Any:
        """The :class:`~jupyter_dist.launch.run.Run` (reopened from its directory)."""
        from .run import open_run

        return open_run(self.path)


COLUMNS = tuple(f.name for f in fields(RunRow) if f.name != "hparams")
"""Fields a table can be sorted and filtered by (plus ``peak_mem_max`` and every hyperparameter's name)."""
_SORTABLE = (*COLUMNS, "peak_mem_max")


class _LiveSummary:
    """A run still going: its telemetry followed from where the last table stopped reading (new lines only)."""

    def __init__(self, path: Path) -> None:
        self.follower = FileFollower(path / "telemetry")
        self.records = RecordSet()
        self.builder = SummaryBuilder()

    def update(self) -> dict[str, Any]:
        self.builder.add(self.records.parse(self.follower.poll()))
        return self.builder.result()


_LIVE: dict[str, _LiveSummary] = {}
_LIVE_LOCK = threading.Lock()


def _live_summary(path: Path) -> dict[str, Any]:
    with _LIVE_LOCK:
        live = _LIVE.get(str(path))
        if live is None:
            live = _LIVE[str(path)] = _LiveSummary(path)
        return live.update()


def _row(path: Path, now: float) -> RunRow | None:
    rd = RunDir(path)
    try:
        record = settle_stale(path, rd.read_record())  # a run whose processes are gone is not shown as running
    except JupyterDistError:
        return None
    meta = record.to_dict()
    status = record.status
    summary = read_summary(path)
    if summary is None and status not in FINAL_STATES:  # still going: read only what was written since last time
        summary = _live_summary(path)
    elif summary is None:  # a finished run predating summaries: read it once, save its summary
        summary = summarize_dir(path)
        try:
            write_summary(path, summary)
        except OSError:
            pass
    if status in FINAL_STATES:
        with _LIVE_LOCK:
            _LIVE.pop(str(path), None)
    ann = rd.read_annotations()
    launcher = meta.get("launcher") or {}
    notes = [str(n) for n in meta.get("notes") or []]
    started = meta.get("started") if isinstance(meta.get("started"), (int, float)) else summary.get("first_t")
    ended = meta.get("ended") if isinstance(meta.get("ended"), (int, float)) else None
    if ended is None and status not in FINAL_STATES and started is not None:
        ended = now
    ended = ended if ended is not None else summary.get("last_t")
    peaks = summary.get("peak_mem") or {}
    world = int(meta.get("world_size") or summary.get("ranks") or 0)
    return RunRow(
        name=path.name, path=str(path), backend=str(launcher.get("kind") or DEFAULT_BACKEND),
        strategy=str(meta.get("strategy") or "none"),
        candidate=str(meta.get("candidate") or meta.get("strategy") or ""),
        mesh=notes[0] if notes else "", status=status, world_size=world, steps=int(summary.get("steps") or 0),
        last_loss=summary.get("last_loss"), best_loss=summary.get("best_loss"), throughput=summary.get("throughput"),
        throughput_unit=summary.get("throughput_unit"),
        peak_mem=tuple(int(peaks[k]) for k in sorted(peaks, key=lambda k: int(k)) if str(k).isdigit()),
        started=float(started) if started is not None else None,
        duration=float(ended) - float(started) if ended is not None and started is not None else None,
        restarts=int(summary.get("restarts") or 0), tags=tuple(ann["tags"]),
        notes=tuple(str(n["text"]) for n in ann["notes"]), hparams=dict(record.hparams),
    )  # fmt: skip


def _run_folders(root: Path) -> list[Path]:
    """The sub-folders of ``root`` that hold a ``run.json``, newest name first."""
    with os.scandir(root) as it:
        entries = sorted((e.path for e in it if e.is_dir()), reverse=True)
    return [Path(e) for e in entries if (Path(e) / "run.json").is_file()]


def runs(folder: str | os.PathLike[str] | None = None) -> RunTable:
    """The runs under ``folder`` (default ``runs``, the magics' default runs folder), newest first.

    Every direct sub-folder with a ``run.json`` is a run; a damaged one is skipped (counted in
    :attr:`RunTable.skipped`).
    """
    root = Path(folder if folder is not None else "runs").expanduser()
    if not root.is_dir():
        raise JupyterDistError(f"runs folder {os.fspath(root)!r} does not exist; pass the folder your runs went to "
                               "(%%dist_train --runs-dir, default 'runs')")  # fmt: skip
    now = time.time()
    rows, skipped = [], 0
    for path in _run_folders(root):
        row = _row(path.resolve(), now)
        if row is None:
            skipped += 1
        else:
            rows.append(row)
    rows.sort(key=lambda r: r.started or 0.0, reverse=True)
    return RunTable(rows, folder=str(root.resolve()), skipped=skipped)


@dataclass(frozen=True, kw_only=True, slots=True)
class Orphan:
    """A local run still running on this machine that this kernel did not start (an earlier kernel did)."""

    path: str
    """The run directory."""
    world_size: int
    """Ranks."""
    started: float | None
    """Unix time the run started."""
    kernel_pid: int | None
    """The kernel that started it (``None``: a run recorded before kernels were)."""
    kernel_alive: bool
    """Whether that kernel process still lives (another notebook's kernel, say)."""


def orphans(folder: str | os.PathLike[str] | None = None) -> list[Orphan]:
    """Local runs under ``folder`` whose record says running, whose processes live, and that another kernel started.

    Reads only each ``run.json`` (no telemetry), so it is cheap enough for ``%load_ext``. A run recorded on another
    host (a shared runs folder) is not this machine's and is left out; so are runs this process started.
    """
    import socket

    import psutil

    from .record import local_pids_alive

    root = Path(folder if folder is not None else "runs").expanduser()
    if not root.is_dir():
        return []
    me, host = os.getpid(), socket.gethostname()
    out = []
    for path in _run_folders(root):
        try:
            record = RunDir(path).read_record()
        except (JupyterDistError, OSError):
            continue
        if not runs_here(record.backend) or not record.active or not record.pids:
            continue
        kernel = record.extra.get("kernel") if isinstance(record.extra.get("kernel"), dict) else {}
        pid = kernel.get("pid") if isinstance(kernel.get("pid"), int) else None
        if pid == me or (kernel.get("host") not in (None, host)):
            continue
        if not local_pids_alive(record.pids, record.started):
            continue
        out.append(Orphan(path=str(path.resolve()), world_size=int(record.world_size or 0), started=record.started,
                          kernel_pid=pid, kernel_alive=pid is not None and psutil.pid_exists(pid)))  # fmt: skip
    return out


def orphans_notice(found: Sequence[Orphan], *, now: float | None = None) -> str:
    """What the notebook says about :func:`orphans`: one line each, with the commands to attach or stop them."""
    if not found:
        return ""
    now = time.time() if now is None else now
    n = len(found)
    lines = [f"jupyter-dist: {n} run{'s' * (n != 1)} started by {'earlier kernels' if n != 1 else 'an earlier kernel'} "
             f"{'are' if n != 1 else 'is'} still running on this machine:"]  # fmt: skip
    for o in found:
        age = f", running {_duration(now - o.started)}" if o.started else ""
        who = ("its kernel is gone" if o.kernel_pid is None or not o.kernel_alive
               else f"its kernel (pid {o.kernel_pid}) still runs")  # fmt: skip
        lines.append(f"  {o.path} ({o.world_size} ranks{age}; {who}): watch it with %dist_attach {o.path}, "
                     "then stop it with %dist_stop")  # fmt: skip
    return "\n".join(lines)


class RunTable(Sequence[RunRow]):
    """Rows of :class:`RunRow`; every operation returns a new table (the rows are never changed in place)."""

    def __init__(self, rows: Sequence[RunRow], *, folder: str = "", skipped: int = 0) -> None:
        self.rows: tuple[RunRow, ...] = tuple(rows)
        self.folder = folder
        self.skipped = skipped
        """Run directories whose ``run.json`` could not be read."""

    # ---- sequence -------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[RunRow]:
        return iter(self.rows)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return self.row(key)
        if isinstance(key, slice):
            return RunTable(self.rows[key], folder=self.folder)
        return self.rows[key]

    def row(self, name: str) -> RunRow:
        """The row of run ``name`` (its directory name; a unique prefix will do)."""
        exact = [r for r in self.rows if r.name == name]
        found = exact or [r for r in self.rows if r.name.startswith(name)]
        if len(found) != 1:
            what = "no run" if not found else f"{len(found)} runs"
            names = ", ".join(r.name for r in (found or self.rows)[:8])
            raise JupyterDistError(f"{what} named {name!r} in this table; runs: {names or '(none)'}")
        return found[0]

    # ---- operations -----------------------------------------------------------------------------------------
    def sort(self, by: str = "started", *, descending: bool | None = None) -> RunTable:
        """Sorted by a column (``-best_loss`` for descending); missing values go last.

        ``descending`` defaults to True for ``started`` (newest first), else False.
        """
        key = by.lstrip("-")
        self._check_columns([key], "sort by")
        desc = by.startswith("-") or (descending if descending is not None else key == "started")
        present = [r for r in self.rows if r.value(key) is not None]
        missing = [r for r in self.rows if r.value(key) is None]
        present.sort(key=lambda r: _sort_key(r.value(key)), reverse=desc)
        return RunTable(present + missing, folder=self.folder, skipped=self.skipped)

    def filter(self, predicate: Callable[[RunRow], bool] | None = None, /, *, tag: str | None = None,
               text: str | None = None, **equals: Any) -> RunTable:  # fmt: skip
        """Rows for which ``predicate(row)`` is true and every condition holds.

        ``tag="x"`` keeps runs tagged x; ``text="fsdp"`` keeps runs whose name, strategy, candidate, mesh, status,
        tags or notes contain it (case-insensitive); ``status="running"`` (any column) keeps equal values; a list or
        tuple value keeps any of them (``status=["failed", "hung"]``).
        """
        self._check_columns(list(equals), "filter by")
        out = []
        needle = text.lower() if text else None
        for r in self.rows:
            if predicate is not None and not predicate(r):
                continue
            if tag is not None and tag not in r.tags:
                continue
            if needle is not None:
                hay = " ".join([r.name, r.strategy, r.candidate, r.mesh, r.status, r.backend, *r.tags, *r.notes,
                                *(f"{k}={v}" for k, v in r.hparams.items())])  # fmt: skip
                if needle not in hay.lower():
                    continue
            ok = True
            for k, want in equals.items():
                have = r.value(k)
                if isinstance(want, (list, tuple, set, frozenset)):
                    ok = have in want
                else:
                    ok = have == want
                if not ok:
                    break
            if ok:
                out.append(r)
        return RunTable(out, folder=self.folder, skipped=self.skipped)

    @property
    def hparam_names(self) -> tuple[str, ...]:
        """Every hyperparameter name of the rows, sorted (each is a column to sort and filter by)."""
        return tuple(sorted({k for r in self.rows for k in r.hparams}))

    def hparam_columns(self, limit: int = 8) -> tuple[str, ...]:
        """The hyperparameters the table shows: those whose values differ between rows first, at most ``limit``."""
        names = self.hparam_names
        varying = [k for k in names if len({repr(r.hparams.get(k)) for r in self.rows}) > 1]
        return tuple((varying + [k for k in names if k not in varying])[:limit])

    def _check_columns(self, keys: list[str], what: str) -> None:
        names = set(self.hparam_names)
        bad = [k for k in keys if k not in _SORTABLE and (k[3:] if k.startswith("hp.") else k) not in names]
        if bad:
            hp = f"; hyperparameters: {', '.join(sorted(names))}" if names else ""
            shown = repr(bad[0]) if what == "sort by" else ", ".join(bad)
            raise JupyterDistError(f"cannot {what} {shown}; columns: {', '.join(_SORTABLE)}{hp}")

    def open(self, name: str | int = 0, **kwargs: Any) -> Any:
        """The live panels of one run (its :meth:`Run.dashboard`), by name or position; display the result."""
        row = self.rows[name] if isinstance(name, int) else self.row(name)
        return row.open().dashboard(**kwargs)

    def runs(self) -> list[Any]:
        """Every row's :class:`~jupyter_dist.launch.run.Run` (e.g. for ``jupyter_dist.compare(*table.runs())``)."""
        return [r.open() for r in self.rows]

    def refresh(self) -> RunTable:
        """The same folder read again (newest first; sorting and filters are not kept)."""
        return runs(self.folder)

    def with_rows(self, rows: Sequence[RunRow]) -> RunTable:
        """A table of other rows of the same folder."""
        return RunTable(rows, folder=self.folder, skipped=self.skipped)

    def records(self) -> list[dict[str, Any]]:
        """Each row as a plain dict (for ``pandas.DataFrame(table.records())``)."""
        return [{**{k: v for k, v in r.hparams.items() if k not in COLUMNS}, **{f: getattr(r, f) for f in COLUMNS}}
                for r in self.rows]  # fmt: skip

    def widget(self) -> Any:
        """The interactive view (sort, filter, open) subscribed by the notebook front-end."""
        from .views import table_view

        return table_view()(self)

    # ---- display --------------------------------------------------------------------------------------------
    def text(self) -> str:
        """A fixed-width text table."""
        hp = self.hparam_columns()
        head = ("name", "backend", "strategy", "status", "steps", "last loss", "best loss", "throughput", "peak mem",
                "duration", "restarts", "tags", *hp)  # fmt: skip
        lines = [head] + [_cells(r) + [_hp(r.hparams.get(k)) for k in hp] for r in self.rows]
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines)

    def html(self, *, max_rows: int = 500) -> str:
        """An HTML table (escaped text; no scripts), ``max_rows`` rows at most."""
        hp = self.hparam_columns()
        head = ("name", "backend", "strategy / mesh", "status", "steps", "last loss", "best loss", "throughput",
                "peak mem / rank", "duration", "restarts", "tags", *hp)  # fmt: skip
        th = "".join(f'<th style="text-align:left;padding:2px 6px;white-space:nowrap">{h}</th>' for h in head)
        body = []
        for r in self.rows[:max_rows]:
            c = _cells(r) + [_hp(r.hparams.get(k)) for k in hp]
            c[2] = f"{r.candidate or r.strategy}" + (f" ({r.mesh})" if r.mesh else "")
            c[8] = " / ".join(_gib(b) for b in r.peak_mem) or "-"
            tds = "".join(f'<td style="padding:2px 6px{";white-space:nowrap" if i in (0, 4, 7) else ""}">'
                          f"{html.escape(x)}</td>" for i, x in enumerate(c))  # fmt: skip
            body.append(f'<tr data-run="{html.escape(r.name)}">{tds}</tr>')
        more = len(self.rows) - max_rows
        tail = f"<p>... and {more} more runs</p>" if more > 0 else ""
        cap = f"{len(self.rows)} run{'' if len(self.rows) == 1 else 's'} in {html.escape(self.folder)}"
        if self.skipped:
            cap += f" ({self.skipped} unreadable skipped)"
        return (f'<div class="jd-runs-table"><div style="color:#555">{cap}</div><table style="border-collapse:'
                f'collapse;font-size:12px"><thead><tr>{th}</tr></thead><tbody>{"".join(body)}</tbody></table>'
                f"{tail}</div>")  # fmt: skip

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": self.text(), "text/html": self.html()}

    def __repr__(self) -> str:
        return f"RunTable({len(self.rows)} runs in {self.folder!r})"


def _sort_key(value: Any) -> Any:
    if isinstance(value, tuple):
        return (0, max(value) if value else -1.0)
    if isinstance(value, (int, float)):  # numbers before strings when a hyperparameter holds both
        return (0, float(value))
    return (1, str(value))


def _hp(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return _fmt(value)
    return str(value)


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    a = abs(v)
    if a != 0 and (a < 1e-3 or a >= 1e5):
        return f"{v:.3g}"
    return f"{v:.4g}"


def _gib(b: int) -> str:
    return f"{b / GIB:.2f} GiB"


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = max(0.0, s)
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60)} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60)} min"


def _cells(r: RunRow) -> list[str]:
    rate = f"{_fmt(r.throughput)} {r.throughput_unit}" if r.throughput is not None else "-"
    peak = _gib(r.peak_mem_max) if r.peak_mem_max is not None else "-"
    return [r.name, r.backend, r.candidate or r.strategy, r.status, str(r.steps), _fmt(r.last_loss),
            _fmt(r.best_loss), rate, peak, _duration(r.duration), str(r.restarts), ",".join(r.tags)]  # fmt: skip
