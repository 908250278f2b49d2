"""The :class:`Run` handle: status, per-rank exit codes, logs, metrics, wait, stop; reattachable from its directory.

A background thread watches the torchrun agents, so the kernel never blocks. Stopping ends the whole process tree
(torchrun starts workers in sessions of their own, so the tree is collected with psutil before anything is killed).

A run on a cluster back-end (a :class:`~.base.RemoteLauncher`: SLURM, SkyPilot) is watched by job id instead: the
thread polls the scheduler, and the job's output stream is routed into the run directory (logs, telemetry records,
exit codes) by a :class:`~.stream.LogRouter`, so records, metrics, logs and the dashboard work the same way.

Planned split: the watching (the ``_watch*`` methods, early-exit and hang handling, ``kill_tree``/``kill_strays``)
moves to a watcher module beside the handle; the handle keeps status, logs, metrics and display.
"""

from __future__ import annotations

import atexit
import html
import json
import os
import re
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from ..errors import JupyterDistError
from ..telemetry.reader import read_run_records
from .backends.local import LocalLauncher
from .backends.stream import LogRouter
from .base import RemoteLauncher
from .rundir import RunDir

if TYPE_CHECKING:
    from ..telemetry.diagnose import Diagnosis

__all__ = ["Run", "RunStatus", "open_run", "kill_tree"]

PENDING, RUNNING, SUCCEEDED, FAILED = "pending", "running", "succeeded", "failed"
STOPPED, TIMED_OUT, HUNG = "stopped", "timed out", "hung"
FINAL = (SUCCEEDED, FAILED, STOPPED, TIMED_OUT, HUNG)
REMOTE_FINAL = (SUCCEEDED, FAILED, STOPPED, TIMED_OUT)
RunStatus = str

_LIVE: weakref.WeakSet[Run] = weakref.WeakSet()


def kill_tree(pids: list[int], *, grace: float = 5.0) -> list[int]:
    """SIGTERM the whole tree (launchers and ranks), then SIGKILL whatever is left after ``grace`` s.

    The tree is collected before anything is signalled: torchrun starts ranks in sessions of their own, and a rank
    whose launcher died is re-parented and could no longer be found.

    Returns the PIDs that had to be killed with SIGKILL.
    """
    procs: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            root = psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue
        procs[pid] = root
        try:
            for child in root.children(recursive=True):
                procs[child.pid] = child
        except psutil.NoSuchProcess:
            pass
    for proc in procs.values():  # roots first (dict order), so launchers see their ranks end as a stop
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(procs.values()), timeout=grace)
    killed = []
    for p in alive:
        try:
            for child in p.children(recursive=True):
                child.kill()
            p.kill()
            killed.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=2.0)
    return killed


EARLY_EXIT_GRACE = 60.0
"""Seconds of silence (nothing printed) from the other ranks, after one rank left with ``os._exit(0)``, before the run
is stopped: they are most likely waiting for it in a collective (a rank that prints goes on)."""


def kill_strays(run_dir: str | os.PathLike[str], *, grace: float = 2.0) -> list[int]:
    """End the processes a finished run left behind; returns their PIDs.

    Every process of this user (but this one and its ancestors) whose environment carries the run's ``JD_RUN_DIR``:
    e.g. a child a rank forked (even one that called setsid) and did not wait for. SIGTERM, then SIGKILL after
    ``grace`` s.
    """
    target = os.fspath(run_dir)
    mine = {os.getpid()} | {p.pid for p in psutil.Process().parents()}
    found = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid in mine:
            continue
        try:
            if proc.environ().get("JD_RUN_DIR") == target and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    for proc in found:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(found, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=2.0)
    return [p.pid for p in found]


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


class Run:
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
        self._stop_reason: str | None = None
        self.plan = plan
        self._dashboard: Any = None
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
        return isinstance(self._launcher, RemoteLauncher) or kind not in (None, "local")

    @property
    def job_id(self) -> str | None:
        """The scheduler's job id of a cluster run (``None`` for local runs)."""
        if isinstance(self._launcher, RemoteLauncher):
            return self._launcher.job_id
        return (self._meta.get("launcher") or {}).get("job_id") if self.remote else None

    @property
    def status(self) -> RunStatus:
        """One of: pending, running, succeeded, failed, stopped, timed out."""
        with self._lock:
            return str(self._meta.get("status", PENDING))

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
        """Exit code per rank (None: the rank left none, e.g. it was killed)."""
        return self._rd.exit_codes(self.world_size)

    @property
    def done(self) -> bool:
        """Whether the run reached a final status."""
        return self._done.is_set()

    def failed_rank(self) -> int | None:
        """The rank that failed first (earliest non-zero exit), if any."""
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
        """``step`` records as a pandas DataFrame (columns: rank, step, t, and every logged metric)."""
        try:
            import pandas as pd
        except ImportError:
            raise JupyterDistError('Run.metrics() needs pandas: pip install "jupyter-dist[notebook]"') from None
        rows = [{k: v for k, v in r.items() if k not in ("v", "kind", "seq")} for r in self.records("step")]
        frame = pd.DataFrame(rows)
        if not frame.empty and "step" in frame:
            frame = frame.sort_values(["step", "rank"]).reset_index(drop=True)
        return frame

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
        ctx = SinkContext(run_name=self.name, run_dir=self.dir, project=project, config=config, secrets=secrets)
        self.sinks = SinkForwarder(self._rd.telemetry, names, ctx, done=self._done.is_set, interval=interval)
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
        if isinstance(self._launcher, RemoteLauncher):  # scancel / sky cancel; the watcher sees the job end
            self._launcher.cancel()
            self._done.wait(grace + 60.0)
            if not self.done:
                self._finalize()
            return self.status
        kill_tree(self._pids(), grace=grace)
        self._done.wait(grace + 5.0)
        if not self.done:  # reattached runs have no Popen to reap: finalize here
            self._finalize()
        return self.status

    def _pids(self) -> list[int]:
        return [p.pid for p in self._procs] or [int(p) for p in self._meta.get("pids", [])]

    def _alive(self) -> bool:
        if self._procs:
            return any(p.poll() is None for p in self._procs)
        for pid in self._pids():
            try:
                proc = psutil.Process(pid)
                same = proc.create_time() <= float(self._meta.get("started", 0)) + 5  # not a recycled PID
                if proc.status() != psutil.STATUS_ZOMBIE and same:
                    return True
            except psutil.NoSuchProcess:
                continue
        return False

    def _watch(self) -> None:
        try:
            self._watch_local()
        except Exception as exc:  # never die silently (a run that never ends would hang wait()): fail with why
            self._meta["error"] = f"the run's watcher failed: {type(exc).__name__}: {exc}"
            if self._stop_reason is None:
                self._stop_reason = FAILED
            kill_tree(self._pids(), grace=2.0)
        finally:
            self._finalize()

    def _early_exit(self) -> dict[str, Any] | None:
        """A rank that left with ``os._exit(0)`` (the bootstrap marks it ``early``) while its peers still run."""
        for r in range(self.world_size):
            try:
                rec = json.loads(self._rd.exit_file(r).read_text())
            except (OSError, ValueError):
                continue
            if isinstance(rec, dict) and rec.get("early") and rec.get("code") == 0:
                return {"rank": r, **rec}
        return None

    def _output_size(self, *, skip: int) -> int:
        """Bytes the ranks but ``skip`` have written to their logs so far (a sign of life)."""
        total = 0
        for r in range(self.world_size):
            if r != skip:
                try:
                    total += self._rd.rank_log(r).stat().st_size
                except OSError:
                    pass
        return total

    def _early_reason(self, rec: dict[str, Any], waiting: list[int], stopped: bool) -> str:
        where = f" at {rec['where']}" if rec.get("where") else ""
        text = (f"rank {rec['rank']} ended with os._exit({rec.get('code')}){where} before the script finished (no "
                "process-group teardown)")  # fmt: skip
        if stopped:
            return (f"{text} while rank(s) {', '.join(map(str, waiting)) or '-'} still ran; they printed nothing for "
                    f"{EARLY_EXIT_GRACE:g} s (waiting for it in a collective?), so the run was stopped")  # fmt: skip
        return f"{text}; the other ranks lost their peer"

    def _on_early_exit(self, rec: dict[str, Any]) -> None:
        """Stop a run one of whose ranks skipped its normal end: its peers would wait for it in the next collective."""
        self._stop_reason = FAILED
        waiting = [r for r, c in self.exit_codes.items() if c is None]
        reason = self._early_reason(rec, waiting, stopped=True)
        diagnosis = {"kind": "early_exit", "rank": rec["rank"], "code": rec.get("code"), "waiting": waiting,
                     "where": rec.get("where"), "reason": reason, "t": time.time()}  # fmt: skip
        self._meta["diagnosis"] = diagnosis
        self._meta["reason"] = reason
        try:
            (self.dir / "diagnosis.json").write_text(json.dumps(diagnosis, indent=1, default=str))
        except OSError:
            pass
        kill_tree(self._pids())

    def _watch_local(self) -> None:
        started = float(self._meta.get("started", time.time()))
        hang_timeout = self._meta.get("hang_timeout")
        tracker = reader = None
        if hang_timeout:
            from ..telemetry.health import HealthTracker
            from ..telemetry.reader import TelemetryReader

            tracker, reader = HealthTracker(), TelemetryReader(self._rd.telemetry, maxlen=16)
        next_check = next_early = quiet_since = 0.0
        last_output = -1
        while self._alive():
            if tracker is not None and reader is not None and self._stop_reason is None and time.time() >= next_check:
                next_check = time.time() + 1.0
                tracker.ingest(reader.poll())
                report = tracker.hang(time.time(), float(hang_timeout))
                if report is not None:
                    self._on_hang(report, tracker)
            if self._timeout is not None and time.time() - started > self._timeout and self._stop_reason is None:
                self._stop_reason = TIMED_OUT
                threading.Thread(target=kill_tree, args=(self._pids(),), daemon=True).start()
            if self._procs and any(p.poll() not in (None, 0) for p in self._procs) and self._stop_reason is None:
                # one simulated node failed: end the others rather than wait for their rendezvous timeout
                self._stop_reason = FAILED
                kill_tree(self._pids())
            if self._stop_reason is None and time.time() >= next_early:
                next_early = time.time() + 1.0
                early = self._early_exit()
                if early is not None:  # stop once the other ranks have been silent for the grace (not while
                    output = self._output_size(skip=int(early["rank"]))  # they print: they may be saving)
                    if output != last_output:
                        last_output, quiet_since = output, time.time()
                    if time.time() - max(quiet_since, float(early.get("t", 0.0))) > EARLY_EXIT_GRACE:
                        self._on_early_exit(early)
            time.sleep(0.2)

    def _watch_remote(self) -> None:
        """Poll the scheduler until the job is final; its output goes through the router meanwhile."""
        lau = self._launcher
        assert isinstance(lau, RemoteLauncher)
        started = float(self._meta.get("started", time.time()))
        self.router = LogRouter(self._rd)
        follower = None
        state = "unknown"
        unknown_since: float | None = None
        saved_job = (self._meta.get("launcher") or {}).get("job_id")
        try:
            follower = lau.follow(self.router)
            while True:
                try:
                    state = lau.poll()
                except JupyterDistError as exc:  # the scheduler did not answer this time: try again
                    self._meta["poll_error"] = str(exc)
                    state = "unknown"
                changed = self._meta.get("status") != state or saved_job != lau.job_id
                if state in ("pending", "running") and changed and self._stop_reason is None:
                    with self._lock:  # the job id goes into run.json as soon as it is known (reattach needs it)
                        self._meta["status"] = state
                        self._meta["launcher"] = lau.to_dict()
                        self._rd.write_meta(self._meta)
                    saved_job = lau.job_id
                if state in REMOTE_FINAL:
                    break
                if state == "unknown":  # forgotten by the controller, no accounting: judge from the exit files
                    unknown_since = unknown_since or time.time()
                    codes = self.exit_codes
                    if all(c is not None for c in codes.values()) or time.time() - unknown_since > lau.unknown_grace:
                        state = SUCCEEDED if codes and all(c == 0 for c in codes.values()) else FAILED
                        break
                else:
                    unknown_since = None
                if self._timeout is not None and time.time() - started > self._timeout and self._stop_reason is None:
                    self._stop_reason = TIMED_OUT
                    lau.cancel()
                time.sleep(lau.poll_interval)
        except Exception as exc:  # never die silently: the run is failed with the reason
            self._meta["error"] = f"{type(exc).__name__}: {exc}"
            state = FAILED
        finally:
            if follower is not None:
                follower.finish(timeout=30.0)
                if follower.error is not None:
                    self._meta["stream_error"] = f"{type(follower.error).__name__}: {follower.error}"
            self.router.close()
        self._meta["job_state"] = state
        self._finalize(remote_state=state)

    def _on_hang(self, report: dict[str, Any], tracker: Any) -> None:
        """Write ``diagnosis.json`` (who is behind, phases, collectives, every rank's thread stacks), then stop."""
        self._stop_reason = HUNG
        marks = {r: len(self.logs(r)) for r in range(self.world_size)}
        for pid in tracker.pids.values():  # bootstrap registered faulthandler on SIGUSR1: stacks go to the log
            try:
                os.kill(pid, signal.SIGUSR1)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(1.5)
        stacks = {str(r): self.logs(r)[marks[r] :][-6000:] for r in range(self.world_size)}
        diagnosis = {"kind": "hang", **report, "where": self._script_lines(stacks), "stacks": stacks, "t": time.time()}
        (self.dir / "diagnosis.json").write_text(json.dumps(diagnosis, indent=1, default=str))
        self._meta["diagnosis"] = {k: v for k, v in diagnosis.items() if k != "stacks"}
        kill_tree(self._pids())

    def _script_lines(self, stacks: dict[str, str]) -> dict[str, str]:
        """Per rank, the cell line its main thread was on (from faulthandler's "Current thread" block)."""
        try:
            source = self._rd.script.read_text().splitlines()
        except OSError:
            return {}
        where = {}
        for rank, text in stacks.items():
            current = text.rsplit("Current thread", 1)[-1]
            m = re.search(r'script\.py", line (\d+)', current)
            if m and 0 < int(m.group(1)) <= len(source):
                where[rank] = f"script.py:{m.group(1)}: {source[int(m.group(1)) - 1].strip()}"
        return where

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

        times, codes = {}, {}
        for r in range(self.world_size):
            try:
                rec = json.loads(self._rd.exit_file(r).read_text())
            except (OSError, ValueError):
                continue
            codes[r] = rec.get("code")
            if rec.get("code"):
                times[r] = float(rec.get("t", 0.0))
        logs = {r: self.logs(r) for r in range(self.world_size)}
        return diagnose_ranks(logs, times or None, exit_codes=codes)

    def _finalize(self, remote_state: str | None = None) -> None:
        with self._lock:
            if self.done:
                return
            try:
                self._settle(remote_state)
            finally:  # whatever happened above, the run is over: wait() and the dashboard must return
                self._done.set()

    def _settle(self, remote_state: str | None) -> None:
        """Final status, exit codes and leftovers into ``run.json`` (kept in memory when it cannot be written)."""
        if not self.remote:
            strays = kill_strays(self.dir)
            if strays:
                self._meta["strays_killed"] = strays
        codes = [p.poll() for p in self._procs]
        rank_codes = self.exit_codes
        if not self._meta.get("reason") and self._stop_reason != STOPPED and any(c for c in codes):
            early = self._early_exit()  # a peer noticed the rank that left early and failed: say who began it
            if early is not None:
                self._meta["reason"] = self._early_reason(early, [], stopped=False)
        if self._stop_reason in (STOPPED, TIMED_OUT, HUNG, FAILED):  # FAILED: a node or an early exit; the agents
            status = self._stop_reason  # may still exit 0 on our SIGTERM
        elif remote_state in REMOTE_FINAL:
            status = str(remote_state)
        elif self._procs:
            status = SUCCEEDED if all(c == 0 for c in codes) else FAILED
        else:  # reattached: judge from what the ranks recorded
            status = SUCCEEDED if rank_codes and all(c == 0 for c in rank_codes.values()) else FAILED
        self._meta.update(status=status, ended=time.time(), agent_exit_codes=codes,
                          exit_codes={str(k): v for k, v in rank_codes.items()})  # fmt: skip
        if isinstance(self._launcher, RemoteLauncher):
            self._meta["launcher"] = self._launcher.to_dict()
        if status == TIMED_OUT:
            self._meta["timeout_report"] = {str(r): self.logs(r, tail=5) for r in range(self.world_size)}
        try:
            self._rd.write_meta(self._meta)
        except OSError as exc:  # deleted or read-only run directory: the status lives on in this handle
            why = "was deleted" if not self.dir.is_dir() else f"is not writable ({exc.strerror or exc})"
            self._meta["meta_error"] = f"run.json not updated: the run directory {why}"
            return
        try:  # the runs table reads this small file instead of every telemetry line
            from ..telemetry.summary import write_summary

            write_summary(self.dir)
        except OSError:
            pass

    # ---- display --------------------------------------------------------------------------------------------
    def summary(self) -> str:
        """One paragraph: status, ranks, exit codes, the failing rank's last lines."""
        lines = [f"Run {self.name}: {self.status} ({self.world_size} ranks, strategy {self._meta.get('strategy')})",
                 f"  dir: {self.dir}"]  # fmt: skip
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
                lines += self._plan_lines()
            except Exception as exc:
                lines.append(f"  (plan vs measured unavailable: {type(exc).__name__}: {exc})")
            bad = self.failed_rank()
            if bad is not None:
                lines.append(f"  rank {bad} failed first; its last lines:")
                lines += ["    " + ln for ln in self.logs(bad, tail=12).splitlines()]
            if self.status == TIMED_OUT:
                lines.append(f"  timed out after {self._timeout} s; last lines per rank are in run.json")
            if self.status == HUNG:
                d = self._meta.get("diagnosis") or {}
                lines.append(f"  hung: no step for {d.get('stalled_s')} s; {d.get('reason')}")
                lines += [f"  rank {r} was at {w}" for r, w in (d.get("where") or {}).items()]
                lines.append(f"  phases {d.get('phases')}, collectives issued {d.get('issued')}; stacks in "
                             "diagnosis.json")  # fmt: skip
            elif self.status == FAILED:
                try:
                    diag = self.diagnosis()
                except Exception:  # a diagnosis must never hide the failure itself
                    diag = None
                if diag is not None and diag.findings:
                    lines.append("  diagnosis: " + diag.summary().replace("\n", "\n  "))
        return "\n".join(lines)

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
        cal = fit_calibration([trial], source=str(self.dir))
        cal.save()
        return cal

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
    """Reopen a run from its directory (after a kernel restart): a live run is watched again."""
    rd = RunDir(Path(path).expanduser().resolve())
    if not rd.run_json.is_file():
        raise JupyterDistError(f"{rd.path} is not a jupyter-dist run directory (no run.json)")
    meta = rd.read_meta()  # a damaged run.json is a JupyterDistError saying so
    plan = None
    if meta.get("plan"):
        from ..plan.plan import Plan

        try:
            plan = Plan.from_dict(meta["plan"])
        except (KeyError, TypeError, ValueError):
            plan = None
    launcher = None
    saved = meta.get("launcher") or {}
    if saved.get("kind") not in (None, "local") and meta.get("status") not in FINAL:
        from .base import launcher_from_dict

        launcher = launcher_from_dict(saved)  # a cluster job: follow it again by id
    return Run(rd, meta, timeout=meta.get("timeout"), plan=plan, launcher=launcher)


@atexit.register
def _stop_live_runs() -> None:  # the kernel is going away: leave no worker behind
    for run in list(_LIVE):
        if not run.done and not run.remote:  # a cluster job outlives the kernel: %dist_attach finds it again
            run.stop(grace=2.0)
