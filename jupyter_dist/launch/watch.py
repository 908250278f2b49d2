"""How a :class:`~.run.Run` is watched until it ends: the watcher thread, early exits, hangs, the final status.

Split from :mod:`.run` along the handle's seam: :mod:`.run` is what a user holds (status, logs, metrics, stop,
display); this module is what runs behind it. :class:`RunWatching` is the part of ``Run`` that its background thread
executes -- a local run is watched through its torchrun agents (a node that fails ends the others; a rank that left
with ``os._exit`` while its peers wait silently is stopped after :data:`EARLY_EXIT_GRACE`; a hang found by the health
tracker is diagnosed with every rank's stacks), a remote one through its scheduler's job state -- and
``_finalize`` settles the status, exit codes and leftovers into ``run.json`` exactly once. ``kill_tree`` and
``kill_strays`` end process trees and the strays a finished run left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from .._atomic import write_atomic
from ..errors import JupyterDistError
from .backends.stream import LogRouter
from .base import RemoteLauncher

if TYPE_CHECKING:
    from .backends.local import LocalLauncher
    from .rundir import RunDir

__all__ = ["RunWatching", "RunStatus", "kill_tree", "kill_strays", "EARLY_EXIT_GRACE", "FINAL", "REMOTE_FINAL"]

PENDING, RUNNING, SUCCEEDED, FAILED = "pending", "running", "succeeded", "failed"
STOPPED, TIMED_OUT, HUNG = "stopped", "timed out", "hung"
FINAL = (SUCCEEDED, FAILED, STOPPED, TIMED_OUT, HUNG)
REMOTE_FINAL = (SUCCEEDED, FAILED, STOPPED, TIMED_OUT)
RunStatus = str


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


class RunWatching:
    """The watching half of :class:`~.run.Run` (its background thread's code and the final settle).

    Reads and writes the handle's state, which :class:`~.run.Run` sets up in ``__init__``.
    """

    dir: Path
    world_size: int
    done: bool
    status: str
    remote: bool
    exit_codes: dict[int, int | None]
    router: LogRouter | None
    _rd: RunDir
    _meta: dict[str, Any]
    _procs: list[subprocess.Popen[bytes]]
    _launcher: LocalLauncher | RemoteLauncher | None
    _timeout: float | None
    _lock: threading.RLock
    _done: threading.Event
    _stop_reason: str | None

    def logs(self, rank: int | None = None, *, tail: int | None = None) -> str:
        """One rank's log (:meth:`jupyter_dist.launch.run.Run.logs`)."""
        raise NotImplementedError

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
            write_atomic(self.dir / "diagnosis.json", json.dumps(diagnosis, indent=1, default=str))
        except OSError:
            pass
        kill_tree(self._pids())

    def _watch_local(self) -> None:
        from .exits import oom_kill_count

        self._meta.setdefault("oom_kills_at_start", oom_kill_count())  # the cgroup's counter, before any rank grows
        started = float(self._meta.get("started", time.time()))
        hang_timeout = self._meta.get("hang_timeout")
        from ..telemetry.health import HealthTracker, WatchdogLimits
        from ..telemetry.reader import TelemetryReader

        # the watchdog, from launch to exit: --hang-timeout stops a hung run; the defaults only report it
        limits = WatchdogLimits.from_env(os.environ, explicit=float(hang_timeout) if hang_timeout else None)
        tracker, reader = HealthTracker(), TelemetryReader(self._rd.telemetry, maxlen=16)
        self._tracker, self._reader = tracker, reader
        watchdog = limits.explicit is not None or self._meta.get("kind") != "pool"  # a pool waits for cells: idle
        next_check = next_early = quiet_since = 0.0
        last_output = -1
        while self._alive():
            if watchdog and self._stop_reason is None and time.time() >= next_check:
                next_check = time.time() + 1.0
                with self._lock:  # run.stop() reads them too (_note_where)
                    tracker.ingest(reader.poll())
                report = tracker.stall(time.time(), limits, world_size=self.world_size, started=started)
                if report is not None and limits.explicit is not None:
                    self._on_hang(report, tracker)
                elif report is not None and not self._meta.get("hung"):
                    self._report_hang(report, tracker)
                elif report is None and self._meta.get("hung") and not tracker.exited:  # a rank moved on (an
                    self._hang_cleared()  # exit is the collective timing out: the hang report stays the diagnosis)
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
        unchanged, last, stream_ended = 0, None, False  # polls that answered the state before them
        try:
            follower = lau.follow(self.router)
            while True:
                try:
                    state = lau.poll()
                except JupyterDistError as exc:  # the scheduler did not answer this time: try again
                    self._meta["poll_error"] = str(exc)
                    state = "unknown"
                unchanged = unchanged + 1 if state == last and lau.job_id is not None else 0
                last = state
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
                delay = lau.next_poll_in(unchanged)
                if self._timeout is not None and self._stop_reason is None:  # never past the run's time limit
                    delay = min(delay, max(0.0, started + self._timeout - time.time()) + 0.1)
                deadline = time.monotonic() + delay
                while time.monotonic() < deadline:  # woken early: asked to stop, or the job's stream just ended
                    if self._poll_now.is_set() or (not stream_ended and follower.ended.is_set()):
                        stream_ended = stream_ended or follower.ended.is_set()
                        self._poll_now.clear()
                        unchanged, last = 0, None
                        break
                    time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
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
        raw = str(getattr(lau, "raw_state", "") or "")
        if raw.upper().startswith("OUT_OF_MEMORY") and not self._meta.get("reason"):
            self._meta["reason"] = ("the scheduler ended the job OUT_OF_MEMORY: a rank went over the job's memory "
                                    "limit and its cgroup's OOM killer killed it (raise --mem, or use less host memory "
                                    "per rank)")  # fmt: skip
        self._finalize(remote_state=state)

    def _stacks(self, tracker: Any) -> dict[str, str]:
        """Every rank's thread stacks now (SIGUSR1: the bootstrap registered faulthandler, which prints to the log)."""

        def size(r: int) -> int:
            try:
                return self._rd.rank_log(r).stat().st_size
            except OSError:
                return 0

        def since(r: int, mark: int) -> str:
            try:
                with open(self._rd.rank_log(r), "rb") as fh:
                    fh.seek(max(mark, size(r) - 6000))
                    return fh.read().decode(errors="replace")
            except OSError:
                return ""

        marks = {r: size(r) for r in range(self.world_size)}
        sent = False
        for pid in tracker.pids.values():
            try:  # only a rank of this run (a recycled pid would die of SIGUSR1)
                if psutil.Process(pid).environ().get("JD_RUN_DIR") != os.fspath(self.dir):
                    continue
                os.kill(pid, signal.SIGUSR1)
                sent = True
            except (ProcessLookupError, PermissionError, psutil.Error, OSError):
                pass
        if sent:
            time.sleep(1.5)
        return {str(r): since(r, marks[r]) for r in range(self.world_size)}

    def _hang_diagnosis(self, report: dict[str, Any], tracker: Any) -> dict[str, Any]:
        """The hang report with every rank's stacks and the cell line each was on, written to ``diagnosis.json``."""
        stacks = self._stacks(tracker)
        diagnosis = {"kind": "hang", **report, "where": self._script_lines(stacks), "stacks": stacks, "t": time.time()}
        try:
            write_atomic(self.dir / "diagnosis.json", json.dumps(diagnosis, indent=1, default=str))
        except OSError:
            pass
        return {k: v for k, v in diagnosis.items() if k != "stacks"}

    def _on_hang(self, report: dict[str, Any], tracker: Any) -> None:
        """``--hang-timeout``: write ``diagnosis.json`` (who is behind, phases, collectives, stacks), then stop."""
        self._stop_reason = HUNG
        self._meta["diagnosis"] = self._hang_diagnosis(report, tracker)
        kill_tree(self._pids())

    def _report_hang(self, report: dict[str, Any], tracker: Any) -> None:
        """The default watchdog: the run reads ``hung`` (status, summary) with where each rank is; it is not stopped."""
        diagnosis = self._hang_diagnosis(report, tracker)
        with self._lock:
            self._meta["diagnosis"] = diagnosis
            self._meta["hung"] = {"t": time.time(), "stalled_s": diagnosis.get("stalled_s")}
            try:
                self._rd.write_meta(self._meta)
            except OSError:
                pass

    def _hang_cleared(self) -> None:
        """A rank made progress again after a reported hang: the run is running again (the report is kept aside)."""
        with self._lock:
            self._meta.pop("hung", None)
            cleared = self._meta.pop("diagnosis", None)
            self._meta["hangs_cleared"] = [*self._meta.get("hangs_cleared", []), cleared]
            try:
                (self.dir / "diagnosis.json").unlink()
            except OSError:
                pass
            try:
                self._rd.write_meta(self._meta)
            except OSError:
                pass

    def _note_where(self) -> None:
        """Before a stop: each rank's phase and the cell line it was on (``run.json`` ``stopped_at``)."""
        tracker = getattr(self, "_tracker", None)
        if tracker is None or self.remote or self._meta.get("kind") == "pool":
            return
        try:
            started = float(self._meta.get("started", time.time()))
            lines = self._script_lines(self._stacks(tracker))
            with self._lock:  # the newest heartbeats (the watcher reads every second)
                tracker.ingest(self._reader.poll())
                where = tracker.where(time.time(), self.world_size, started)
            self._meta["stopped_at"] = {str(r): {"phase": w["phase"], "stalled_s": w["stalled_s"], "step": w["step"],
                                                 "where": lines.get(str(r))} for r, w in where.items()}  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a report must never keep a run from stopping
            self._meta["stopped_at_error"] = f"{type(exc).__name__}: {exc}"

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

    def _name_killed_rank(self) -> None:
        """A rank a signal ended (SIGKILL from the OOM killer...) is the cause: say so, with its peak memory."""
        from .exits import culprit, kernel_oom_line, killed_report, oom_kill_count, peak_rss, rank_exits

        ex = culprit(rank_exits(self._rd, self.world_size))
        if ex is None:
            return
        kernel = kernel_oom_line(ex.pid) if ex.signal == 9 else None
        report = killed_report(ex, peak=peak_rss(self._rd.telemetry, ex.rank), kernel_line=kernel,
                               oom_before=self._meta.get("oom_kills_at_start"), oom_after=oom_kill_count())  # fmt: skip
        self._meta["killed"] = report
        self._meta["reason"] = report["reason"]

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
        if not self.remote and self._stop_reason in (None, FAILED) and any(c for c in codes):
            self._name_killed_rank()
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
