"""The :class:`Run` handle: status, per-rank exit codes, logs, metrics, wait, stop; reattachable from its directory.

A background thread watches the torchrun agents, so the kernel never blocks. Stopping ends the whole process tree
(torchrun starts workers in sessions of their own, so the tree is collected with psutil before anything is killed).

A run on a cluster back-end (a :class:`~.base.RemoteLauncher`: SLURM, SkyPilot) is watched by job id instead: the
thread polls the scheduler, and the job's output stream is routed into the run directory (logs, telemetry records,
exit codes) by a :class:`~.stream.LogRouter`, so records, metrics, logs and the dashboard work the same way.

What the background thread runs (the ``_watch*`` methods, early-exit and hang handling, the final settle,
``kill_tree``/``kill_strays``) is in :mod:`.watch`; this module is the handle a user holds: status, logs, metrics,
stop and display. One piece (about 600 lines): each method is one thing a user asks of a run, over the one state
the watcher keeps.
"""

from __future__ import annotations

import atexit
import html
import json
import os
import subprocess
import threading
import time
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import JupyterDistError
from ..telemetry.reader import read_run_records
from .backends.local import LocalLauncher
from .backends.stream import LogRouter
from .base import RemoteLauncher, runs_here
from .rundir import RunDir
from .watch import (  # re-exported: the states and kill_tree have always been importable from here
    FAILED,
    FINAL,
    HUNG,
    PENDING,
    RUNNING,
    STOPPED,
    SUCCEEDED,
    TIMED_OUT,
    RunStatus,
    RunWatching,
    kill_strays,
    kill_tree,
)

if TYPE_CHECKING:
    from ..telemetry.diagnose import Diagnosis
    from .record import RunRecord

__all__ = ["Run", "RunStatus", "open_run", "kill_tree", "kill_strays"]

_LIVE: weakref.WeakSet[Run] = weakref.WeakSet()


def _tail_lines(path: Path, n: int, *, block: int = 1 << 16) -> str:
    """The last ``n`` lines of a (possibly huge) log, reading only its end."""
    if n == 0:
        return ""
    try:
        with open(path, "rb") as fh:
            end = fh.seek(0, os.SEEK_END)
            data, pos = b"", end
            while pos > 0 and data.count(b"\n") <= n:
                step = min(block, pos)
                pos -= step
                fh.seek(pos)
                data = fh.read(step) + data
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", errors="replace").splitlines()[-n:])


class Run(RunWatching):
    """A distributed job started from the notebook (or reopened from its run directory)."""

    def __init__(self, run_dir: RunDir, meta: dict[str, Any], *, procs: list[subprocess.Popen[bytes]] | None = None,
                 launcher: LocalLauncher | RemoteLauncher | None = None, timeout: float | None = None,
                 plan: Any = None) -> None:  # fmt: skip
        self.dir = run_dir.path
        self._rd = run_dir
        self._meta = meta
        self._procs = procs or []
        self._launcher = launcher
        self._timeout = timeout
        self._lock = threading.RLock()
        self._done = threading.Event()
        self._poll_now = threading.Event()  # a remote run's watcher polls its job at once (asked to stop)
        self._stop_reason: str | None = None
        self.plan = plan
        self._dashboard: Any = None
        self._output: Any = None
        self._skip_display = False
        self._plan_check_cache: dict[str, Any] | None = None
        self.router: LogRouter | None = None
        """Where a remote job's output stream goes (``None`` for local runs)."""
        self.sinks: Any = None
        """The :class:`~jupyter_dist.telemetry.sinks.SinkForwarder` of :meth:`log_to` (``None`` without one)."""
        self._profile_cache: tuple[Any, Any] | None = None
        if self._meta.get("status") in FINAL:
            self._done.set()
        elif isinstance(launcher, RemoteLauncher):
            _LIVE.add(self)
            self._thread = threading.Thread(target=self._watch_remote, name=f"jd-run-{self.dir.name}", daemon=True)
            self._thread.start()
        elif self._procs or self._meta.get("pids"):
            _LIVE.add(self)
            self._thread = threading.Thread(target=self._watch, name=f"jd-run-{self.dir.name}", daemon=True)
            self._thread.start()

    # ---- state ----------------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The run's name (its directory's)."""
        return self.dir.name

    @property
    def remote(self) -> bool:
        """Whether the run is a cluster job (SLURM, SkyPilot) followed through its log stream."""
        kind = (self._meta.get("launcher") or {}).get("kind")
        return isinstance(self._launcher, RemoteLauncher) or (kind is not None and not runs_here(kind))

    @property
    def job_id(self) -> str | None:
        """The scheduler's job id of a cluster run (``None`` for local runs)."""
        if isinstance(self._launcher, RemoteLauncher):
            return self._launcher.job_id
        return (self._meta.get("launcher") or {}).get("job_id") if self.remote else None

    @property
    def status(self) -> RunStatus:
        """One of: pending, running, hung, succeeded, failed, stopped, timed out.

        ``hung`` while the watchdog finds every rank stuck in its phase past the limit (it goes back to ``running``
        if a rank moves on), and as the final status of a run ``--hang-timeout`` stopped.
        """
        with self._lock:
            status = str(self._meta.get("status", PENDING))
            return HUNG if status == RUNNING and self._meta.get("hung") and not self.done else status

    @property
    def world_size(self) -> int:
        """Number of ranks (a reattached job of unknown size: the highest rank seen in its telemetry, plus one)."""
        if self._meta.get("world_size"):
            return int(self._meta["world_size"])
        ranks = [int(p.stem.split("-", 1)[1]) for p in self._rd.telemetry.glob("rank-*.jsonl")
                 if p.stem.split("-", 1)[1].isdigit()]  # fmt: skip
        return max(ranks, default=0) + 1

    @property
    def strategy(self) -> str | None:
        """The base strategy the ranks apply (``JD_STRATEGY``: ``"fsdp2"``, ``"zero3"``, ``"none"``)."""
        value = self._meta.get("strategy")
        return str(value) if value else None

    @property
    def candidate(self) -> str | None:
        """The candidate the ranks run, with its degrees (``"fsdp2+tp2+sp"``); ``None`` for older runs."""
        value = self._meta.get("candidate")
        return str(value) if value else None

    @property
    def notes(self) -> list[str]:
        """What runs, in words: the mesh line, then a rehearsal note when a plan runs on fewer processes."""
        return [str(n) for n in self._meta.get("notes") or []]

    @property
    def mesh(self) -> str:
        """The mesh line as it is (``"mesh: dp_replicate=2 (2 processes)"`` for DDP, which shards nothing).

        Runs recorded before the mesh line said so (``dp_shard=2`` under DDP) are named correctly here.
        """
        from ..plan.candidates import replicates

        line = self.notes[0] if self.notes else ""
        if line and replicates(self.strategy or "") and "dp_replicate=" not in line:
            line = line.replace("dp_shard=", "dp_replicate=")
        return line

    @property
    def record(self) -> RunRecord:
        """The run's :class:`~.record.RunRecord` as this handle holds it, with rank 0's ``hparams.json`` merged."""
        from .record import RunRecord, read_hparams

        with self._lock:
            rec = RunRecord.from_dict(self._meta)
        return rec.with_hparams(read_hparams(self.dir))

    @property
    def hparams(self) -> dict[str, Any]:
        """Hyperparameters: scalars shipped to the cell, ``jd.config(...)``, a Trainer's arguments, Lightning's."""
        return dict(self.record.hparams)

    # ---- tags and notes -------------------------------------------------------------------------------------
    @property
    def tags(self) -> list[str]:
        """The run's tags (``annotations.json`` in its directory), in the order given."""
        return list(self._rd.read_annotations()["tags"])

    def tag(self, *tags: str, remove: bool = False) -> list[str]:
        """Add (``remove=True``: remove) tags; kept in the run directory, shown and filterable in ``runs()``.

        A tag is 1-64 characters without commas or newlines. Returns the tags after the change.
        """
        for t in tags:
            if not isinstance(t, str) or not 0 < len(t) <= 64 or any(c in t for c in ",\n\r"):
                raise JupyterDistError(f"tag {t!r} is not valid: give 1-64 characters without commas or newlines")
        with self._lock:
            data = self._rd.read_annotations()
            current = data["tags"]
            if remove:
                current = [t for t in current if t not in tags]
            else:
                current += [t for t in dict.fromkeys(tags) if t not in current]
            data["tags"] = current
            self._write_annotations(data)
        return list(current)

    @property
    def notes_text(self) -> list[str]:
        """The notes given with :meth:`note`, oldest first."""
        return [str(n["text"]) for n in self._rd.read_annotations()["notes"]]

    def note(self, text: str) -> list[str]:
        """Append a free-text note (what was tried, why it was stopped); returns every note, oldest first."""
        if not isinstance(text, str) or not text.strip():
            raise JupyterDistError("a note is a non-empty string")
        with self._lock:
            data = self._rd.read_annotations()
            data["notes"].append({"t": time.time(), "text": text.strip()})
            self._write_annotations(data)
        return [str(n["text"]) for n in data["notes"]]

    def _write_annotations(self, data: dict[str, Any]) -> None:
        try:
            self._rd.write_annotations(data)
        except OSError as exc:
            raise JupyterDistError(f"cannot write {self._rd.annotations}: {exc.strerror or exc}") from None

    def profile(self) -> Any:
        """The per-rank summary of the profiled window (``--profile`` / ``jd.profile``).

        Compute, communication and idle time per step, top operators, who waits on whom
        (:class:`~jupyter_dist.telemetry.profile.ProfileSummary`).
        """
        from ..telemetry.profile import profile_summary

        files = sorted(self._rd.profile.glob("rank-*.pt.trace.json"))
        key = tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in files)
        cached = self._profile_cache
        if cached is not None and cached[0] == key:  # the card is drawn again on every display: parse traces once
            return cached[1]
        summary = profile_summary(self.dir)
        self._profile_cache = (key, summary)
        return summary

    def run_summary(self) -> dict[str, Any]:
        """Steps, last and best loss, throughput, peak memory per rank, restarts (``summary.json`` once it ended)."""
        from ..telemetry.summary import read_summary, summarize_dir

        saved = read_summary(self.dir) if self.done else None
        return saved if saved is not None else summarize_dir(self.dir)

    @property
    def exit_codes(self) -> dict[int, int | None]:
        """Exit code per rank: its exit file, else torchrun's (``-N``: signal N killed it); None: unknown."""
        from .exits import rank_exits

        codes = self._rd.exit_codes(self.world_size)
        for r, ex in rank_exits(self._rd, self.world_size).items():
            if codes.get(r) is None:
                codes[r] = ex.code
        return codes

    @property
    def done(self) -> bool:
        """Whether the run reached a final status."""
        return self._done.is_set()

    def failed_rank(self) -> int | None:
        """The rank that failed first: one killed by a signal (SIGKILL, SIGSEGV...), else the earliest non-zero exit."""
        from .exits import culprit, rank_exits

        killed = culprit(rank_exits(self._rd, self.world_size))
        if killed is not None:
            return killed.rank
        first: tuple[float, int] | None = None
        for r in range(self.world_size):
            try:
                rec = json.loads(self._rd.exit_file(r).read_text())
            except (OSError, ValueError):
                continue
            if rec.get("code"):
                key = (float(rec.get("t", 0.0)), r)
                first = key if first is None or key < first else first
        return first[1] if first else None

    # ---- output ---------------------------------------------------------------------------------------------
    def logs(self, rank: int | None = None, *, tail: int | None = None) -> str:
        """The log of ``rank`` (default: the failing rank, else rank 0); ``tail`` keeps the last lines."""
        if rank is None:
            rank = self.failed_rank() or 0
        if not 0 <= rank < self.world_size:
            raise JupyterDistError(f"rank {rank} is not in this run (ranks 0..{self.world_size - 1})")
        path = self._rd.rank_log(rank)
        if tail is not None:
            if tail < 0:
                raise JupyterDistError(f"tail must be >= 0 lines, got {tail}")
            return _tail_lines(path, tail)
        try:
            return path.read_text(errors="replace")
        except OSError:  # no log (yet), or the run directory was deleted
            return ""

    def launcher_log(self) -> str:
        """What torchrun itself printed."""
        try:
            return (self._rd.logs / "launcher.log").read_text(errors="replace")
        except OSError:
            return ""

    def records(self, kind: str | None = None) -> list[dict[str, Any]]:
        """Telemetry records (all, or of one kind)."""
        rs = read_run_records(self._rd.telemetry)
        return rs.records if kind is None else rs.of_kind(kind)

    def metrics(self) -> Any:
        """Every ``jd.log`` call of every rank as a pandas DataFrame, sorted by step and rank.

        Columns: ``rank``, ``step``, ``t`` (unix time of the call), every logged metric (exactly as logged; NaN where
        a call did not log it), and ``step_time`` / ``tokens_per_s`` / ``samples_per_s`` derived from the time since
        the rank's previous call (as in the ``step`` records; a logged metric of the same name is kept instead).
        """
        try:
            import numpy as np
            import pandas as pd
        except ImportError:
            raise JupyterDistError('Run.metrics() needs pandas: pip install "jupyter-dist[notebook]"') from None
        from ..telemetry.reader import read_run_columns

        frames = []
        for rank, cols in sorted(read_run_columns(self._rd.telemetry).steps.items()):
            data: dict[str, Any] = {"rank": np.full(len(cols), rank, dtype="int64"),
                                    "step": np.frombuffer(cols.step, dtype=np.int64),
                                    "t": np.frombuffer(cols.t, dtype=np.float64)}  # fmt: skip
            data.update({k: cols.column(k) for k in cols.metrics})  # NaN where a call did not log it
            data.update(cols.derived())  # the step records' step_time / tokens_per_s, from the same function
            frames.append(pd.DataFrame(data))
        if not frames:
            return pd.DataFrame()
        frame = pd.concat(frames, ignore_index=True)
        return frame.sort_values(["step", "rank"], kind="stable").reset_index(drop=True)

    def log_to(self, sinks: str | Iterable[str], *, secrets: Iterable[str] = (), project: str = "jupyter-dist",
               interval: float = 1.0) -> Any:  # fmt: skip
        """Forward this run's ``step`` records to TensorBoard, W&B, MLflow or Trackio from the kernel.

        Returns the :class:`~jupyter_dist.telemetry.sinks.SinkForwarder` (also kept as :attr:`sinks`).

        ``sinks`` is ``"tensorboard,wandb"`` or a list of names; ``secrets`` names environment variables of this
        kernel the sinks need (checked now, never written). A thread follows the run's telemetry and closes the
        sinks when the run ends (a finished run: at once, after forwarding everything). See
        :mod:`jupyter_dist.telemetry.sinks`.
        """
        from ..telemetry.sinks import SINKS, SinkContext, SinkForwarder, check_sinks, parse_log_to

        names = parse_log_to(sinks)
        if not names:
            raise JupyterDistError(f"log_to: name at least one sink; valid: {', '.join(SINKS)}")
        secrets = tuple(secrets)
        check_sinks(names, secrets)
        if self.sinks is not None and not self.sinks.finished.is_set():
            raise JupyterDistError(f"run {self.name} already forwards its metrics ({', '.join(self.sinks.names)})")
        config = {k: self._meta.get(k) for k in ("strategy", "candidate", "world_size", "nproc", "nodes")
                  if self._meta.get(k) is not None}  # fmt: skip
        ctx = SinkContext(run_name=self.name, run_dir=self.dir, project=project, config=config, secrets=secrets,
                          hparams=self.hparams)  # fmt: skip
        self.sinks = SinkForwarder(self._rd.telemetry, names, ctx, done=self._done.is_set, interval=interval,
                                   hparams=lambda: self.hparams)  # fmt: skip
        with self._lock:
            self._meta["log_to"] = list(names)
            self._meta["sink_secrets"] = list(secrets)  # names only
            try:
                self._rd.write_meta(self._meta)
            except OSError:  # a deleted or read-only run directory: the forwarder still reads what is there
                pass
        return self.sinks.start()

    # ---- control --------------------------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> RunStatus:
        """Block until the run ends (or ``timeout`` s); an interrupt (Ctrl-C, kernel interrupt) stops a local run.

        A cluster job keeps running when the wait is interrupted (as with ``sky logs``): ``stop()`` cancels it.
        """
        try:
            self._done.wait(timeout)
        except KeyboardInterrupt:
            if not isinstance(self._launcher, RemoteLauncher):
                self.stop()
            raise
        return self.status

    def stop(self, *, reason: str = STOPPED, grace: float | None = None) -> RunStatus:
        """End every process of the run (SIGTERM, then SIGKILL after ``grace`` s).

        With ``--checkpoint-every`` the ranks save a checkpoint at their next ``jd.checkpoint`` call before they
        exit, so the default grace is then 40 s (else 5 s).
        """
        if grace is None:
            grace = 40.0 if (self._meta.get("env") or {}).get("JD_CHECKPOINT_EVERY") else 5.0
        with self._lock:
            if self.done:
                return self.status
            self._stop_reason = reason
        self._note_where()  # each rank's phase and cell line, for the summary
        if isinstance(self._launcher, RemoteLauncher):  # scancel / sky cancel; the watcher sees the job end
            self._launcher.cancel()
            self._poll_now.set()
            self._done.wait(grace + 60.0)
            if not self.done:
                self._finalize()
            return self.status
        kill_tree(self._pids(), grace=grace)
        self._done.wait(grace + 5.0)
        if not self.done:  # reattached runs have no Popen to reap: finalize here
            self._finalize()
        return self.status

    def diagnosis(self) -> Diagnosis | None:
        """Why the run failed or hung, always a :class:`~jupyter_dist.telemetry.diagnose.Diagnosis` (or ``None``).

        ``None`` while it runs or after it succeeded; else the ranks' logs classified, first failing rank first, or
        for a hung run the hang report (``diagnosis().hang``, with the culprit as ``first_rank``).
        """
        from ..telemetry.diagnose import Diagnosis, diagnose_ranks

        path = self.dir / "diagnosis.json"
        if path.exists():
            return Diagnosis.from_report(json.loads(path.read_text()))
        if self.status not in (FAILED, TIMED_OUT):
            return None

        from .exits import rank_exits

        times, codes = {}, {}
        for r, ex in rank_exits(self._rd, self.world_size).items():
            codes[r] = ex.code
            if ex.code and ex.t is not None:
                times[r] = ex.t
        logs = {r: self.logs(r) for r in range(self.world_size)}
        killed = self._meta.get("killed") or {}
        notes = {int(killed["rank"]): str(killed["reason"])} if killed.get("reason") else None
        return diagnose_ranks(logs, times or None, exit_codes=codes, exit_notes=notes)

    # ---- display --------------------------------------------------------------------------------------------
    def summary(self) -> str:
        """One paragraph: status, ranks, exit codes, the failing rank's last lines."""
        lines = [f"Run {self.name}: {self.status} ({self.world_size} ranks, strategy {self._meta.get('strategy')})",
                 f"  dir: {self.dir}"]  # fmt: skip
        if self.mesh:
            lines.insert(1, f"  {self.mesh}")
        if isinstance(self._launcher, RemoteLauncher):
            lines.insert(1, f"  {self._launcher.describe()}")
        if self._meta.get("meta_error"):
            lines.append(f"  {self._meta['meta_error']}")
        if self._meta.get("reason"):
            lines.append(f"  why: {self._meta['reason']}")
        if self.sinks is not None:
            lines.append(f"  {self.sinks.describe()}")
        if self._meta.get("strays_killed"):
            lines.append(f"  ended {len(self._meta['strays_killed'])} process(es) the ranks left behind: "
                         f"pids {self._meta['strays_killed']}")  # fmt: skip
        if self.done:
            lines.append(f"  exit codes: {self.exit_codes}")
            try:  # how the plan did: never let a damaged record hide the run's card
                lines += self._measured_lines()
                lines += self._plan_lines()
            except Exception as exc:
                lines.append(f"  (plan vs measured unavailable: {type(exc).__name__}: {exc})")
            bad = self.failed_rank()
            if bad is not None:
                lines.append(f"  rank {bad} failed first; its last lines:")
                lines += ["    " + ln for ln in self.logs(bad, tail=12).splitlines()]
            if self.status == TIMED_OUT:
                lines.append(f"  timed out after {self._timeout} s; last lines per rank are in run.json")
            if self.status == STOPPED and self._meta.get("stopped_at"):
                lines += self._where_lines("when stopped, ", self._meta["stopped_at"])
        d = self._meta.get("diagnosis") or {}
        if self.status == HUNG or d.get("kind") == "hang":
            progress = "no step for" if d.get("last_step") is not None or "last_step" not in d else "no progress for"
            lines.append(f"  hung: {progress} {d.get('stalled_s')} s; {d.get('reason')}")
            limits = d.get("limits") or {}
            if limits:
                lines += self._where_lines("", {r: {"phase": p, "stalled_s": (d.get("stalled") or {}).get(r),
                                                    "where": (d.get("where") or {}).get(str(r)), "limit": limits.get(r)}
                                                for r, p in (d.get("phases") or {}).items()})  # fmt: skip
            else:
                lines += [f"  rank {r} was at {w}" for r, w in (d.get("where") or {}).items()]
            lines.append(f"  phases {d.get('phases')}, collectives issued {d.get('issued')}; stacks in "
                         "diagnosis.json")  # fmt: skip
            if not self.done and d.get("explicit") is None:
                lines.append("  (reported, not stopped: run.stop() ends it; --hang-timeout S stops a hung run)")
        if self.done:
            if self.status == FAILED:
                try:
                    diag = self.diagnosis()
                except Exception:  # a diagnosis must never hide the failure itself
                    diag = None
                if diag is not None and diag.findings:
                    lines.append("  diagnosis: " + diag.summary().replace("\n", "\n  "))
        return "\n".join(lines)

    @staticmethod
    def _where_lines(head: str, where: dict[Any, Any]) -> list[str]:
        """One line per rank: its phase, how long without progress, and the cell line it was on."""
        out = []
        for r, w in where.items():
            text = f"  {head}rank {r} was in phase {w.get('phase')}"
            if w.get("stalled_s") is not None:
                text += f" for {w['stalled_s']} s" + (f" (limit {w['limit']:g} s)" if w.get("limit") else "")
            out.append(text + (f", at {w['where']}" if w.get("where") else ", at an unknown line (no stack)"))
        return out

    def plan_check(self) -> dict[str, Any] | None:
        """Predicted against measured step time, tokens/s and peak memory per rank (see :mod:`.tune`).

        ``None`` when the run has no plan or logged no step. ``comparable`` is false when the plan is for other
        hardware than the run had (a rehearsal of a GPU plan on CPU processes, or on fewer processes).
        """
        if self.plan is None:
            return None
        if self._plan_check_cache is not None:  # a finished run's telemetry does not change: read it once
            return self._plan_check_cache
        from .measure import measure_run

        try:
            cand = self.plan.candidate(self.candidate) if self.candidate else self.plan.best
        except KeyError:
            cand = self.plan.best
        if cand is None:
            return None
        measured = measure_run(self)
        if measured.step_time_s is None and not measured.peak_bytes:
            return None
        hw = self.plan.hardware
        on_cpu = measured.memory_kind == "rss"
        comparable = hw.world_size == self.world_size and (hw.accelerator.vendor == "cpu") == on_cpu
        check = {"candidate": cand.name, "predicted": cand, "measured": measured, "comparable": comparable}
        if self.done:
            self._plan_check_cache = check
        return check

    def save_calibration(self) -> Any:
        """Fit a calibration of this hardware from this run against its plan and save it; returns it.

        Later plans on the same hardware (``%dist_plan``) use it and say so. Needs a finished run with a plan made
        for the hardware it ran on.
        """
        from .measure import Trial, fit_calibration

        check = self.plan_check()
        if check is None or not check["comparable"] or check["measured"].step_time_s is None:
            raise JupyterDistError(
                "no calibration from this run: it needs a plan (--plan) for the hardware it ran on and logged steps "
                "(jd.log); %dist_tune measures candidates and calibrates in one go"
            )
        trial = Trial(candidate=check["candidate"], micro_batch=self.plan.training.micro_batch,
                      predicted=check["predicted"], status="ok", measured=check["measured"], run_dir=str(self.dir),
                      accelerator=self.plan.hardware.accelerator)  # fmt: skip
        from dataclasses import replace

        from ..plan.calibration import options_key

        # keyed by the speed options the run was planned with (compiled blocks, fused optimizer, fp8): a compiled
        # run's rates calibrate compiled plans only
        options = options_key(self.plan.training, self.plan.hardware.accelerator.vendor)
        cal = replace(fit_calibration([trial], source=str(self.dir)), options=options)
        cal.save()
        return cal

    def _measured_lines(self) -> list[str]:
        """What the run measured, in the numbers every view shows (the one measurement, ``measure_run``)."""
        from .measure import measure_run

        check = self.plan_check()
        m = check["measured"] if check is not None else measure_run(self)
        parts = []
        if m.step_time_s is not None:
            parts.append(f"{m.step_time_s:.4g} s/step")
        rate, unit = m.throughput
        if rate is not None and unit != "steps/s":
            replicas = f" ({m.dp_size} data-parallel replica{'s' if m.dp_size != 1 else ''})" if m.dp_size else ""
            parts.append(f"{rate:,.0f} {unit}{replicas}")
        if m.mfu is not None:
            parts.append(f"MFU {100 * m.mfu:.1f}%")
        return [f"  measured: {', '.join(parts)}"] if parts else []

    def _plan_lines(self) -> list[str]:
        from .measure import planned_peak

        check = self.plan_check()
        if check is None:
            return []
        p, m = check["predicted"], check["measured"]
        if not check["comparable"]:
            hw = self.plan.hardware
            return [f"  plan vs measured: the plan ({p.name}) is for {hw.world_size} x {hw.accelerator.label}; this "
                    f"run had {self.world_size} {'CPU processes' if m.memory_kind == 'rss' else 'GPUs'}: "
                    "not compared"]  # fmt: skip
        mib = 2**20
        parts = []
        if m.step_time_s is not None:
            parts.append(f"step {p.time.step_time_s:.3g} s / {m.step_time_s:.3g} s "
                         f"({m.step_time_s / p.time.step_time_s:.2g}x the plan)")  # fmt: skip
        if m.tokens_per_s:
            parts.append(f"tokens/s {p.time.tokens_per_s:,.0f} / {m.tokens_per_s:,.0f}")
        if m.peak_bytes:
            ranks = ", ".join(f"{v / mib:,.0f}" for _, v in sorted(m.peak_bytes.items()))
            what = "CUDA peak allocated" if m.memory_kind == "cuda" else "process max RSS"
            planned = planned_peak(p.memory, m.memory_kind) / mib
            parts.append(f"peak per rank {planned:,.0f} MiB / {ranks} MiB ({what})")
        lines = [f"  plan vs measured ({p.name}, predicted / measured): " + "; ".join(parts)]
        if m.step_time_s is not None:
            lines.append("  calibrate the plans of this hardware from this run: run.save_calibration()")
        return lines

    def dashboard(self, **kwargs: Any) -> Any:
        """The live panels of this run (:class:`~jupyter_dist.ui.dashboard.Dashboard`), following it until it ends.

        Display the result in a notebook; a finished run's panels are drawn from its telemetry files. The panels
        come through the live view subscribed in :mod:`.views` (the notebook's, unless a front-end subscribed another).
        """
        from .views import live_view  # the ui layer's panels, subscribed by the package root (launch imports no ui)

        dash = live_view()(self, **kwargs)
        if not self.done:
            dash.start()
        return dash

    def show_dashboard(self, **kwargs: Any) -> Any:
        """Display the live panels under the current cell and keep them as :attr:`shown_dashboard`.

        The Run's own card is then not displayed a second time (the dashboard's status line replaces it).
        """
        dash = self.dashboard(**kwargs)
        dash.show()
        self._dashboard = dash
        self._skip_display = True
        return dash

    @property
    def shown_dashboard(self) -> Any:
        """The dashboard :meth:`show_dashboard` displayed (``None`` when none was)."""
        return self._dashboard

    def show_output(self, ranks: Any = "0", *, sink: Any = None, **kwargs: Any) -> Any:
        """Show what ``ranks`` print while the run goes: under the current cell in a notebook, else on stdout.

        ``ranks``: ``"0"`` (default), ``"all"``, ``"none"``, ``"0,2"`` or a list. Each line is prefixed
        ``[rank<k>] ``, at most 50 lines/s are shown (the rest are counted in a note), telemetry lines are never
        shown; the ranks' log files are followed, so nothing here can slow or block a rank (:mod:`.output`).
        Returns the :class:`~.output.RankOutput` (also :attr:`shown_output`), or ``None`` when no rank is chosen or
        the run has ended. ``sink`` and ``kwargs`` (``rate``, ``burst``, ``interval``) go to it.
        """
        from .output import RankOutput, default_sink, parse_output

        chosen = parse_output(ranks).resolve(self.world_size)
        if self._output is not None:  # shown again (other ranks): one follower at a time
            self._output.stop()
            self._output = None
        if not chosen or self.done:
            return None
        follower = RankOutput(self._rd.logs, chosen, sink=sink if sink is not None else default_sink(chosen),
                              done=lambda: self.done, **kwargs)  # fmt: skip
        self._output = follower.start()
        return follower

    @property
    def shown_output(self) -> Any:
        """The :class:`~.output.RankOutput` :meth:`show_output` started (``None`` when none was)."""
        return self._output

    def expect_stop(self, reason: str = STOPPED) -> None:
        """Say the run is being ended on purpose (a pool shutting down): its final status is ``reason``, not failed.

        Signals nothing; the caller ends the processes (or :meth:`stop` does). A finished run is left as it is.
        """
        with self._lock:
            if not self.done and self._stop_reason is None:
                self._stop_reason = reason

    def _ipython_display_(self) -> None:
        if self._skip_display:  # %%dist_train just showed the live dashboard for this run: no second card
            self._skip_display = False
            return
        from IPython.display import display

        display(self._repr_mimebundle_(), raw=True)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        colour = {
            SUCCEEDED: "#2e7d32",
            FAILED: "#c62828",
            RUNNING: "#1565c0",
            TIMED_OUT: "#c62828",
            HUNG: "#c62828",
        }.get(self.status, "#555")
        body = html.escape(self.summary())
        card = (f'<div style="border-left:4px solid {colour};padding:4px 8px"><pre style="margin:0">{body}</pre>'
                "</div>")  # fmt: skip
        from .views import static_view

        static = static_view()
        if static is not None and self.done and self._rd.telemetry.is_dir():
            try:  # the final panels, drawn without JavaScript (they survive export)
                card += static(self)
            except Exception as exc:  # never let a damaged telemetry file hide the run's card
                card += f"<p>(panels unavailable: {html.escape(str(exc))})</p>"
        if self.done and any(self._rd.profile.glob("rank-*.pt.trace.json")):
            try:  # the profiled window, summarised
                card += self.profile().html()
            except Exception as exc:
                card += f"<p>(profile summary unavailable: {html.escape(str(exc))})</p>"
        return {"text/plain": self.summary(), "text/html": card}

    def __repr__(self) -> str:
        return f"Run(name={self.name!r}, status={self.status!r}, world_size={self.world_size})"


def open_run(path: str | Path) -> Run:
    """Reopen a run from its directory (after a kernel restart): a live run is watched again.

    A local run whose record says pending or running but whose processes are all gone is settled first
    (:func:`~.record.settle_stale`: its status from the exit files the ranks left), and the record rewritten.
    """
    from .record import settle_stale

    rd = RunDir(Path(path).expanduser().resolve())
    if not rd.run_json.is_file():
        raise JupyterDistError(f"{rd.path} is not a jupyter-dist run directory (no run.json)")
    record = rd.read_record()  # a damaged run.json is a JupyterDistError saying so
    settled = settle_stale(rd.path, record)
    if settled is not record:
        try:
            settled = rd.write_meta(settled)
        except OSError:  # a read-only or deleted run directory: the corrected status lives on in this handle
            pass
    meta = settled.to_dict()
    plan = None
    if meta.get("plan"):
        from ..plan.plan import Plan

        try:
            plan = Plan.from_dict(meta["plan"])
        except (KeyError, TypeError, ValueError):
            plan = None
    launcher = None
    saved = meta.get("launcher") or {}
    if saved.get("kind") is not None and not runs_here(saved["kind"]) and meta.get("status") not in FINAL:
        from .base import launcher_from_dict

        launcher = launcher_from_dict(saved)  # a cluster job: follow it again by id
    return Run(rd, meta, timeout=meta.get("timeout"), plan=plan, launcher=launcher)


@atexit.register
def _stop_live_runs() -> None:  # the kernel is going away: leave no worker behind
    for run in list(_LIVE):
        if not run.done and not run.remote:  # a cluster job outlives the kernel: %dist_attach finds it again
            run.stop(grace=2.0)
