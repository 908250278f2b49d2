"""The SkyPilot back-end: launch the compiler's SkyPilot task through the SDK and stream the job back.

``%%dist_train --backend skypilot --nodes N [--gpus H100:8] [--cluster NAME] [--infra aws] [--spot]
[--idle-minutes N] [--down] [--managed] [--secret HF_TOKEN]``.

* The cell becomes ``script.py`` in ``<run dir>/workdir`` (with the bootstrap stub, the DeepSpeed config and the
  shipped objects): SkyPilot syncs that folder to every node. The task is
  :func:`jupyter_dist.render.skypilot.render_skypilot_task` with that workdir, saved as ``task.yaml``.
* SDK calls return request ids; :meth:`SkyPilotLauncher.start` only submits, and a background thread waits on the
  request (``sky.stream_and_get``, its progress going to ``logs/launch.log``), so the kernel is never blocked.
* The job's output is followed with ``sky.tail_logs(cluster, job, follow=True, preload_content=False)`` (managed:
  ``sky.jobs.tail_logs``). Ranks print their telemetry records after the sentinel (``JD_TELEMETRY_STDOUT=1``) and
  prefix their lines with ``[rank K]`` (``JD_LOG_STREAM=1``); the :class:`~.stream.LogRouter` strips SkyPilot's
  ``(head, rank=0, pid=...)`` prefixes and colours, de-duplicates records and writes the run directory, so the same
  panels show the remote run.
* ``Run.stop()`` cancels the job (``sky.cancel`` / ``sky.jobs.cancel``); the cluster's autostop and teardown follow
  ``--idle-minutes`` / ``--down`` (passed to ``sky.launch``); :func:`down` tears a cluster down.
* Secrets are passed by name: their values are read from this kernel's environment at launch and handed to
  ``Task.from_yaml_config(..., secrets_overrides=...)``; ``task.yaml`` and ``run.json`` only hold the names.
* ``--managed`` uses managed jobs (``sky.jobs.launch``) with ``job_recovery`` (FAILOVER, restarts on errors); the
  task's ``JD_CHECKPOINT_DIR`` is keyed on ``SKYPILOT_TASK_ID``, which survives recoveries, so ``jd.resume()`` in
  the recovered job finds the checkpoints (point ``--checkpoint-dir`` at a bucket mount to survive losing a node).

SkyPilot is an optional extra, imported on first use: ``pip install "jupyter-dist[sky]"``.
"""

from __future__ import annotations

import copy
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._atomic import write_atomic
from ...errors import JupyterDistError
from ..base import Follower, JobState, RemoteLauncher
from ..rundir import RunDir, new_run_dir, scrub_env
from .slurm import BOOTSTRAP_STUB

if TYPE_CHECKING:
    from ...render.common import Layout

__all__ = [
    "SkyPilotLauncher", "SkyPilotError", "SkyPilotStart", "attach_job", "attach_ref", "down", "import_sky", "job_state",
    "start_skypilot",
]  # fmt: skip

INSTALL_HINT = 'SkyPilot is not installed: pip install "jupyter-dist[sky]" (then `sky check` to enable a cloud)'

_CLUSTER_STATES = {
    "INIT": "pending", "PENDING": "pending", "SETTING_UP": "pending", "RUNNING": "running",
    "SUCCEEDED": "succeeded", "FAILED": "failed", "FAILED_SETUP": "failed", "FAILED_DRIVER": "failed",
    "CANCELLED": "stopped",
}  # fmt: skip
_MANAGED_STATES = {
    "PENDING": "pending", "SUBMITTED": "pending", "STARTING": "pending", "RUNNING": "running",
    "RECOVERING": "running", "WINDING_DOWN": "running", "CANCELLING": "running", "SUCCEEDED": "succeeded",
    "CANCELLED": "stopped",
    "FAILED": "failed", "FAILED_SETUP": "failed", "FAILED_PRECHECKS": "failed", "FAILED_NO_RESOURCE": "failed",
    "FAILED_CONTROLLER": "failed",
}  # fmt: skip


class SkyPilotError(JupyterDistError):
    """SkyPilot is missing, or refused or failed a request."""


def import_sky() -> Any:
    """``import sky`` with an install hint."""
    try:
        import sky
    except ImportError:
        raise SkyPilotError(INSTALL_HINT) from None
    return sky


def _status_name(status: Any) -> str:
    value = getattr(status, "value", status)
    return str(value).rsplit(".", 1)[-1].upper() if value is not None else ""


def job_state(status: Any, *, managed: bool = False) -> JobState:
    """Our state for a SkyPilot ``JobStatus`` / ``ManagedJobStatus`` (or its name)."""
    table = _MANAGED_STATES if managed else _CLUSTER_STATES
    return table.get(_status_name(status), "unknown")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}".strip()


@dataclass(kw_only=True)
class SkyPilotLauncher(RemoteLauncher):
    """One SkyPilot job (on a cluster, or managed) for one run directory."""

    kind = "skypilot"
    poll_interval = 3.0  # seconds between state polls (each one is an API request)
    poll_max_interval = 30.0  # the longest wait between two polls of a job whose state does not change
    unknown_grace = 300.0  # an API server that does not answer (restarting: ~13 s) is waited for this long

    run_dir: RunDir
    """The local run directory (``workdir/`` inside it is what SkyPilot syncs)."""
    task_config: dict[str, Any] = field(default_factory=dict)
    """The task in SkyPilot's schema (``render_skypilot_task`` with this run's workdir)."""
    cluster: str = "jupyter-dist"
    """Cluster name (``sky launch -c``); for managed jobs, the job name."""
    managed: bool = False
    """A managed job (``sky.jobs.launch``) instead of a job on a named cluster."""
    idle_minutes: int | None = None
    """Autostop after this many idle minutes."""
    down_after: bool = False
    """Tear the cluster down when idle / when the job ends (``sky launch --down``)."""
    secrets: tuple[str, ...] = ()
    """Names of environment variables whose values are passed at launch (never saved)."""
    nodes: int = 1
    """Nodes."""
    job_id: str | None = None
    """SkyPilot job id (a string of the integer) once the launch request returned it."""
    request_id: str | None = None
    """The launch request's id on the API server."""
    launch_error: str | None = None
    """Why the launch request failed (one line)."""
    state: str = "before"
    """``before`` -> ``running`` -> ``after``."""
    recoveries: int = 0
    """Managed jobs: how often SkyPilot recovered the job (RECOVERING seen)."""
    _launched: threading.Event = field(default_factory=threading.Event, repr=False)
    _cancel_requested: threading.Event = field(default_factory=threading.Event, repr=False)
    _last_status: str = field(default="", repr=False)

    # ---- pure -------------------------------------------------------------------------------------------------
    @property
    def task_yaml(self) -> Path:
        """``task.yaml`` in the run directory."""
        return self.run_dir.path / "task.yaml"

    @property
    def workdir(self) -> Path:
        """The folder SkyPilot syncs to the nodes."""
        return self.run_dir.path / "workdir"

    def args(self) -> list[list[str]]:
        """The equivalent ``sky`` command line (what :meth:`start` does through the SDK)."""
        secrets = [w for s in self.secrets for w in ("--secret", s)]
        if self.managed:
            return [["sky", "jobs", "launch", "-n", self.cluster, str(self.task_yaml), *secrets, "-y"]]
        argv = ["sky", "launch", "-c", self.cluster, str(self.task_yaml), *secrets]
        if self.idle_minutes is not None:
            argv += ["-i", str(self.idle_minutes)]
        if self.down_after:
            argv.append("--down")
        return [[*argv, "-y"]]

    def env(self) -> dict[str, str]:
        """The task's ``envs`` (set on every node)."""
        return {str(k): str(v) for k, v in (self.task_config.get("envs") or {}).items()}

    def task(self) -> dict[str, Any]:
        """The task dict."""
        return self.task_config

    def describe(self) -> str:
        """``SkyPilot job 3 on cluster jd-run (2 nodes)``."""
        if self.managed:
            rec = f", recovered {self.recoveries}x" if self.recoveries else ""
            return f"SkyPilot managed job {self.job_id} ({self.cluster}, {self.nodes} node(s){rec})"
        where = f"SkyPilot job {self.job_id} on cluster {self.cluster} ({self.nodes} node(s))"
        return where + (f"; launch failed: {self.launch_error}" if self.launch_error else "")

    # ---- side effects -----------------------------------------------------------------------------------------
    def sky_task(self) -> Any:
        """``sky.Task.from_yaml_config`` of the task, with the secrets' values from this environment."""
        sky = import_sky()
        missing = [s for s in self.secrets if not os.environ.get(s)]
        if missing:
            raise SkyPilotError(
                f"--secret {', '.join(missing)}: not set in this kernel's environment "
                f"(set it first, e.g. os.environ[{missing[0]!r}] = ..., or drop --secret)"
            )
        overrides = [(s, os.environ[s]) for s in self.secrets]
        try:
            # from_yaml_config consumes the dict it is given: hand it a copy
            return sky.Task.from_yaml_config(copy.deepcopy(self.task_config), secrets_overrides=overrides or None)
        except Exception as exc:  # SkyPilot's own validation: say what it said
            raise SkyPilotError(f"SkyPilot rejected the task: {_one_line(exc)}") from None

    def start(self) -> None:
        """Validate the task here, then submit it and wait for the job id on a thread; returns at once.

        Even the submission runs on the thread: the first SDK call of a session starts a local API server (~13 s).
        A refusal or a failed launch is reported through :meth:`poll` (the run fails with the reason).
        """
        if self.state != "before":
            raise SkyPilotError(f"launcher already {self.state}")
        task = self.sky_task()  # SkyPilot's own validation, with a one-line error, before anything is submitted
        self.state = "running"
        threading.Thread(target=self._launch, args=(task,), name=f"jd-sky-launch-{self.cluster}",
                         daemon=True).start()  # fmt: skip

    def _launch(self, task: Any) -> None:
        sky = import_sky()
        try:
            if self.managed:
                rid = sky.jobs.launch(task, name=self.cluster)
            else:
                rid = sky.launch(task, cluster_name=self.cluster, idle_minutes_to_autostop=self.idle_minutes,
                                 down=self.down_after)  # fmt: skip
            self.request_id = str(rid)
            if self._cancel_requested.is_set():  # stop() came before the request id
                sky.get(sky.api_cancel(rid))
            with open(self.run_dir.logs / "launch.log", "a", encoding="utf-8") as log:
                result = sky.stream_and_get(rid, output_stream=log)
            job_id = result[0] if isinstance(result, (tuple, list)) else result
            if isinstance(job_id, list):  # managed jobs: a list of ids
                job_id = job_id[0] if job_id else None
            if job_id is None:
                self.launch_error = "SkyPilot returned no job id"
            else:
                self.job_id = str(job_id)
        except BaseException as exc:  # noqa: BLE001 - reported through poll() as a failed run
            self.launch_error = _one_line(exc)
        finally:
            self._launched.set()

    def wait_launched(self, timeout: float | None = None) -> bool:
        """Wait until the launch request returned (a job id or an error)."""
        return self._launched.wait(timeout)

    def poll(self) -> JobState:
        """The job's state: pending (launching, queued), running, succeeded, failed, stopped, or unknown."""
        if self.launch_error:
            self.state = "after"
            return "stopped" if "cancel" in self.launch_error.lower() else "failed"
        if self.job_id is None:
            if not self._launched.is_set() and self.state == "running":
                return "pending"
            return "unknown"
        sky = import_sky()
        jid = int(self.job_id)
        try:
            if self.managed:
                records = sky.get(sky.jobs.queue(refresh=False, job_ids=[jid]))
                if isinstance(records, tuple):
                    records = records[0]
                mine = [r for r in records if int(_field(r, "job_id", -1)) == jid]
                status = _field(mine[0], "status", None) if mine else None
                if mine and _field(mine[0], "recovery_count", None) is not None:
                    self.recoveries = max(self.recoveries, int(_field(mine[0], "recovery_count", 0)))
            else:
                status = sky.get(sky.job_status(self.cluster, [jid])).get(jid)
        except Exception as exc:
            raise SkyPilotError(f"SkyPilot status of job {jid}: {_one_line(exc)}") from None
        name = _status_name(status)
        if self.managed and name == "RECOVERING" and self._last_status != "RECOVERING":
            self.recoveries += 1  # seen here first; the record's recovery_count (when given) catches up
        self._last_status = name
        state = job_state(status, managed=self.managed)
        if state in ("succeeded", "failed", "stopped"):
            self.state = "after"
        return state

    def next_poll_in(self, unchanged: int) -> float:
        """3 s, then 1.5 times longer after each poll that answered the same, up to 30 s.

        A state poll is an API request that the server answers by running SkyPilot's job table on the cluster's head
        node (over SSH: 4-6 s and ~3 CPU-seconds, most of it importing sky, on the local test cluster); a job runs
        for minutes or days in one state. The end is seen at once all the same: the log stream ends with the job and
        the watcher polls then.
        """
        return min(self.poll_interval * 1.5**unchanged, self.poll_max_interval)

    def cancel(self) -> None:
        """Cancel the job (or the launch request, when no job exists yet)."""
        sky = import_sky()
        try:
            if self.job_id is None:
                if not self._launched.is_set():
                    self._cancel_requested.set()
                    if self.request_id is not None:
                        sky.get(sky.api_cancel(self.request_id))
                    self._launched.wait(30)  # the launch thread sees the request end
                    if self.job_id is None:
                        self.launch_error = self.launch_error or "launch cancelled"
                if self.job_id is None:
                    return
            if self.managed:
                sky.get(sky.jobs.cancel(job_ids=[int(self.job_id)]))
            else:
                sky.get(sky.cancel(self.cluster, job_ids=[int(self.job_id)]))
        except Exception as exc:
            raise SkyPilotError(f"SkyPilot could not cancel job {self.job_id}: {_one_line(exc)}") from None

    def follow(self, on_lines: Callable[[list[str]], None]) -> Follower:
        """Once the job id is known, follow its logs with SkyPilot's log tailing (ends with the job)."""

        def tail(stop: threading.Event) -> None:
            while not self._launched.wait(0.5):
                if stop.is_set() and self.job_id is None:
                    return
            if self.job_id is None:
                return
            sky = import_sky()
            if self.managed:
                lines = sky.jobs.tail_logs(job_id=int(self.job_id), follow=True, preload_content=False)
            else:
                lines = sky.tail_logs(self.cluster, int(self.job_id), follow=True, preload_content=False)
            batch: list[str] = []
            cut = ""  # the end of the last chunk when it stopped inside a line: the next chunk completes it
            last = time.monotonic()
            for chunk in lines:  # None: no new output yet (a keep-alive), a chance to hand over what came
                if chunk is not None:
                    whole = (cut + str(chunk)).splitlines(keepends=True)
                    cut = whole.pop() if whole and not whole[-1].endswith(("\n", "\r")) else ""
                    batch += [ln.rstrip("\r\n") for ln in whole]
                if batch and (time.monotonic() - last > 0.2 or len(batch) > 200 or chunk is None):
                    on_lines(batch)
                    batch, last = [], time.monotonic()
            if cut:  # the stream ended inside a line: what there is of it
                batch.append(cut)
            if batch:
                on_lines(batch)

        return Follower(tail, f"jd-sky-tail-{self.cluster}")

    # ---- reattach -----------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Saved in ``run.json`` (the task itself is ``task.yaml``; secrets by name only)."""
        return {"kind": self.kind, "run_dir": str(self.run_dir.path), "cluster": self.cluster, "managed": self.managed,
                "idle_minutes": self.idle_minutes, "down": self.down_after, "secrets": list(self.secrets),
                "nodes": self.nodes, "job_id": self.job_id, "request_id": self.request_id,
                "launch_error": self.launch_error, "state": self.state, "recoveries": self.recoveries,
                "args": self.args()}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SkyPilotLauncher:
        """Inverse of :meth:`to_dict`; a launcher whose launch already returned (or failed)."""
        import yaml  # type: ignore[import-untyped, unused-ignore]

        rd = RunDir(Path(data["run_dir"]))
        cfg: dict[str, Any] = {}
        if (rd.path / "task.yaml").exists():
            cfg = yaml.safe_load((rd.path / "task.yaml").read_text()) or {}
        lau = cls(
            run_dir=rd, task_config=cfg, cluster=str(data["cluster"]), managed=bool(data.get("managed")),
            idle_minutes=data.get("idle_minutes"), down_after=bool(data.get("down")),
            secrets=tuple(data.get("secrets") or ()), nodes=int(data.get("nodes", 1)), job_id=data.get("job_id"),
            request_id=data.get("request_id"), launch_error=data.get("launch_error"),
            state=str(data.get("state", "running")), recoveries=int(data.get("recoveries", 0)),
        )  # fmt: skip
        lau._launched.set()
        return lau


def _field(record: Any, name: str, default: Any) -> Any:
    if isinstance(record, dict):
        return record.get(name, default)
    return getattr(record, name, default)


def down(cluster: str, timeout: float = 300.0) -> float:
    """Tear ``cluster`` down (``sky.down``) and wait for it; returns the seconds it took."""
    sky = import_sky()
    t0 = time.monotonic()
    rid = sky.down(cluster)
    done = threading.Event()
    error: list[BaseException] = []

    def wait() -> None:
        try:
            sky.get(rid)
        except BaseException as exc:  # noqa: BLE001
            error.append(exc)
        finally:
            done.set()

    threading.Thread(target=wait, daemon=True).start()
    if not done.wait(timeout):
        raise SkyPilotError(f"sky.down({cluster!r}) did not finish within {timeout:.0f} s (request {rid})")
    if error:
        raise SkyPilotError(f"sky.down({cluster!r}) failed: {_one_line(error[0])}")
    return time.monotonic() - t0


# ---- starting a run from a cell (the hooks start_cluster_run calls; the registry names SkyPilotStart) ----------
class SkyPilotStart:
    """SkyPilot's part of ``start_cluster_run`` (:class:`~.cluster.ClusterHooks`): a workdir synced to the nodes."""

    def check(self, cluster: Any) -> None:
        """SLURM's options are refused (SkyPilot on a SLURM cluster takes ``--infra slurm``)."""
        if cluster.partition or cluster.account or cluster.time_limit:
            raise JupyterDistError(
                "--partition/--account/--time are SLURM options; SkyPilot on a SLURM cluster takes --infra slurm"
            )
        if cluster.ship_env:
            raise JupyterDistError("--ship-env is a SLURM option: SkyPilot jobs always install the shipped environment")

    def ships_env(self, cluster: Any) -> bool:
        """Always: the nodes are new machines."""
        return True

    def wheel_site(self, site: str) -> str:
        """In the job's own workdir on each node."""
        return site

    def contract(self, contract: Any) -> Any:
        """The job runs in its workdir and its records travel on the log stream."""
        from dataclasses import replace

        return replace(contract, run_dir=".", telemetry_stdout=True)

    def extras(self, cluster: Any, renv: Any) -> dict[str, str]:
        """``JD_SITE``: the shipped wheel, relative to the job's workdir (``jd_bootstrap.py`` puts it first)."""
        return {"JD_SITE": renv.site} if renv is not None else {}

    def script_path(self, script_file: str, cluster: Any) -> tuple[str, Path | None]:
        """The nodes see the workdir: a path inside it, else the file copied in."""
        from ..project import RESERVED

        src = Path(script_file).expanduser().resolve()
        root = Path(cluster.workdir).expanduser().resolve() if cluster.workdir else None
        if root is not None and src.is_relative_to(root):
            return src.relative_to(root).as_posix(), None
        if src.name in RESERVED:
            raise JupyterDistError(f"--script {script_file}: rename it ({src.name} is the name of the job's own file)")
        return src.name, src

    def start(self, job: Any) -> Any:
        """:func:`start_skypilot` with the job ``start_cluster_run`` resolved."""
        return start_skypilot(
            script=job.script, files=job.files, plan=job.plan, user_plan=job.user_plan, candidate=job.candidate,
            cluster=job.cluster, nproc=job.nproc, nodes=job.nodes, job=job.job, name=job.name, strat=job.strat,
            jd_env=job.jd_env, ship=job.ship, timeout=job.timeout, runs_dir=job.runs_dir, port=job.port,
            dry_run=job.dry_run, max_restarts=job.max_restarts, layout=job.layout, renv=job.renv,
            script_copy=job.script_copy, choice=job.choice,
        )  # fmt: skip


def start_skypilot(*, script: str, files: dict[str, str], plan: Any, user_plan: Any, candidate: str | None,
                   cluster: Any, nproc: int, nodes: int, job: str, name: str, strat: str, jd_env: dict[str, str],
                   ship: dict[str, Any] | None, timeout: float | None, runs_dir: str | Path, port: int | None,
                   dry_run: bool, max_restarts: int, layout: Layout | None = None, renv: Any = None,
                   script_copy: Path | None = None, choice: Any = None) -> Any:  # fmt: skip
    """Write the workdir and ``task.yaml``, launch through the SDK, return a Run (``start_cluster_run`` calls it)."""
    from ...render.common import RenderOptions
    from ...render.skypilot import dump_yaml, render_skypilot_task
    from ..prepare import DryRun, write_shipped
    from ..run import Run

    rd = RunDir(Path(runs_dir).expanduser().resolve() / f"{name}-DRYRUN") if dry_run else new_run_dir(runs_dir, name)
    run_env = {"JD_LOG_STREAM": "1", **jd_env}  # jd_env: WorkerEnv.to_environ() (JD_RUN_DIR=., telemetry on stdout)
    setup = renv.setup_script(cluster.setup) if renv is not None else (cluster.setup or "")
    opts = RenderOptions(
        candidate=candidate, name=job, script="jd_bootstrap.py", script_args=("script.py",), rdzv="static",
        master_port=port or 29500, max_restarts=max_restarts if not cluster.managed else 0,
        checkpoint_dir=cluster.checkpoint_dir or "checkpoints", cloud=cluster.infra, use_spot=cluster.spot,
        setup=setup, env=tuple(run_env.items()), secrets=cluster.secrets,
    )  # fmt: skip
    task = render_skypilot_task(plan, opts, layout=layout)
    task["workdir"] = str(rd.path / "workdir")
    if cluster.image is not None:
        task["resources"]["image_id"] = cluster.image
    if cluster.mounts:
        from ..project import mount_config, parse_mount

        task["file_mounts"] = mount_config(tuple(parse_mount(m) for m in cluster.mounts), cluster.checkpoint_dir)
    if cluster.managed:
        task["resources"]["job_recovery"] = {"strategy": "FAILOVER",
                                             "max_restarts_on_errors": cluster.max_restarts_on_errors}  # fmt: skip
    name_on_cluster = cluster.cluster or (job if job.startswith("jd-") else f"jd-{job}")[:63]
    lau = SkyPilotLauncher(run_dir=rd, task_config=task, cluster=name_on_cluster, managed=cluster.managed,
                           idle_minutes=cluster.idle_minutes, down_after=cluster.down, secrets=cluster.secrets,
                           nodes=nodes)  # fmt: skip
    if dry_run:
        notes = _notes(renv, cluster) + [_price_note(plan, opts, cluster, nodes, layout)]
        return DryRun(script=script, argv=lau.args(), env=run_env, files={"task.yaml": dump_yaml(task), **files},
                      notes=notes)  # fmt: skip
    workdir = rd.path / "workdir"
    if cluster.workdir is not None:  # the user's project first; the job's own files next to it
        from ..project import sync_workdir

        sync_workdir(cluster.workdir, workdir)
    workdir.mkdir(exist_ok=True)
    if renv is not None:
        from ..remote_env import stage_files

        stage_files(renv, workdir, cluster.requirements)
    if script_copy is not None:
        import shutil

        shutil.copyfile(script_copy, workdir / script_copy.name)
    write_atomic(workdir / "script.py", script)
    write_atomic(workdir / "jd_bootstrap.py", BOOTSTRAP_STUB)
    for fname, text in files.items():
        write_atomic(workdir / fname, text)
    write_atomic(rd.script, script)
    if ship:
        write_shipped(rd, ship)
        os.replace(rd.path / "shipped.pkl", workdir / "shipped.pkl")
    write_atomic(lau.task_yaml, dump_yaml(task))
    from dataclasses import replace

    from ..record import launch_record

    record = launch_record(name=name, backend="skypilot", strategy=strat, choice=choice, nproc=nproc, nodes=nodes,
                           timeout=timeout, env=scrub_env(run_env), plan=user_plan, ship=ship,
                           secrets=cluster.secrets, extra={"cluster": name_on_cluster})  # fmt: skip
    rd.write_meta(record)
    try:
        lau.start()
    except JupyterDistError:
        rd.write_meta(replace(record, status="failed", error="launch failed"))
        raise
    meta = rd.write_meta(replace(record, started=time.time(), launcher=lau.to_dict())).to_dict()
    return Run(rd, meta, launcher=lau, timeout=timeout, plan=user_plan)


def _notes(renv: Any, cluster: Any) -> list[str]:
    """What the dry run says about the remote side: what is installed where, the project folder, the mounts."""
    notes = list(renv.notes()) if renv is not None else []
    if cluster.workdir is not None:
        from ..project import check_workdir, parse_size

        count, size = check_workdir(cluster.workdir, parse_size(cluster.workdir_limit))
        notes.append(f"copies --workdir {cluster.workdir} ({count} files, {size / 2**20:.1f} MB after .skyignore/"
                     ".gitignore) into the job's folder, importable on every node")  # fmt: skip
    if cluster.managed and cluster.checkpoint_dir and not cluster.mounts:
        notes.append(f"--checkpoint-dir {cluster.checkpoint_dir} is on the node's disk: mount a bucket there "
                     "(--mount) so a recovered job finds the checkpoints")  # fmt: skip
    return notes


def _price_note(plan: Any, opts: Any, cluster: Any, nodes: int, layout: Any = None) -> str:
    """The nodes' hourly price from SkyPilot's catalog, and the run's estimate (plan's step time x ``--steps``)."""
    from ...render.common import layout_of
    from ..cost import price_for, price_line

    lay = layout or layout_of(plan, opts)
    price = price_for(plan.hardware.accelerator, lay.gpus_per_node, nodes, infra=cluster.infra, spot=cluster.spot)
    return price_line(price, step_time_s=lay.candidate.time.step_time_s, steps=cluster.steps)


_REF = re.compile(r"^([a-z][a-z0-9-]*)/(\d+)$")


def attach_ref(ref: str, *, runs_dir: str | Path = "runs") -> Any:
    """:func:`attach_job` for a ``CLUSTER/JOB`` reference; ``None`` for anything else (``%dist_attach`` asks)."""
    return attach_job(ref, runs_dir=runs_dir) if _REF.match(ref.strip()) else None


def attach_job(ref: str, *, runs_dir: str | Path = "runs") -> Any:
    """``CLUSTER/JOB``: the run directory of that job under ``runs_dir`` (reopened), else a new one following it."""
    from ..run import Run, open_run

    m = _REF.match(ref.strip())
    if not m:
        raise SkyPilotError(f"{ref!r} is not CLUSTER/JOB (e.g. jd-run/3) nor a run directory")
    cluster, job_id = m.group(1), m.group(2)
    root = Path(runs_dir).expanduser().resolve()
    for meta_path in sorted(root.glob("*/run.json"), reverse=True):
        try:
            saved = RunDir(meta_path.parent).read_record().launcher
        except JupyterDistError:
            continue
        if saved.get("kind") == "skypilot" and saved.get("cluster") == cluster and str(saved.get("job_id")) == job_id:
            return open_run(meta_path.parent)
    import_sky()
    rd = new_run_dir(root, f"attach-{cluster}-{job_id}")
    lau = SkyPilotLauncher(run_dir=rd, cluster=cluster, job_id=job_id, state="running")
    lau._launched.set()
    from ..record import RunRecord, kernel_versions

    record = RunRecord(name=rd.path.name, backend="skypilot", created=time.time(), started=time.time(),
                       launcher=lau.to_dict(), versions=kernel_versions(), extra={"cluster": cluster})  # fmt: skip
    meta = rd.write_meta(record).to_dict()
    return Run(rd, meta, launcher=lau)
