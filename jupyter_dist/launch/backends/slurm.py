"""The SLURM back-end: submit the compiler's sbatch script, track the job, follow its output, ``scancel`` it.

``%%dist_train --backend slurm --nodes 2 [--partition P] [--account A] [--time T]``. The run directory must be on a
filesystem the nodes share (home or scratch on a cluster; here both "nodes" are this host): the cell becomes
``script.py`` there, the batch script ``job.sbatch`` (rendered by :func:`jupyter_dist.render.slurm.render_sbatch`,
so what runs is what ``%dist_plan``/``jupyter-dist config`` shows), and each rank writes its log, exit code and
telemetry into it exactly as a local run does. The job's own output file (``<name>-<jobid>.out``: srun and torchrun
messages) is followed into ``logs/launcher.log`` and through the telemetry reader (sentinel lines).

Tracking uses ``scontrol show job`` (always there), then ``sacct`` when accounting is enabled (a job the controller
already forgot), then the ranks' exit files. ``stop()`` is ``scancel``: SLURM signals every step, then kills.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..._atomic import write_atomic
from ...errors import JupyterDistError
from ..base import Follower, JobState, RemoteLauncher
from ..rundir import RunDir

__all__ = ["SlurmLauncher", "SlurmError", "SlurmStart", "slurm_state", "find_slurm_tool", "BOOTSTRAP_STUB"]

SLURM_INSTALL_HINT = (
    "install the SLURM client tools (Debian/Ubuntu: apt-get install slurm-client) or run the notebook on a login "
    "node of the cluster"
)

BOOTSTRAP_STUB = """\
# Written by jupyter-dist: runs the cell (script.py) under the jupyter-dist bootstrap on every rank
# (rank logs, shipped notebook objects, exit codes).
import os
import sys

if os.environ.get("JD_SITE"):  # the jupyter-dist wheel this job installed (the kernel's own code) comes first
    sys.path.insert(0, os.path.abspath(os.environ["JD_SITE"]))

from jupyter_dist.launch.bootstrap import main  # noqa: E402

sys.exit(main())
"""

_STATES = {
    "PENDING": "pending", "CONFIGURING": "pending", "REQUEUED": "pending", "REQUEUE_HOLD": "pending",
    "REQUEUE_FED": "pending", "RESV_DEL_HOLD": "pending", "SUSPENDED": "pending",
    "RUNNING": "running", "COMPLETING": "running", "STAGE_OUT": "running", "SIGNALING": "running",
    "RESIZING": "running",
    "COMPLETED": "succeeded",
    "CANCELLED": "stopped", "REVOKED": "stopped",
    "TIMEOUT": "timed out", "DEADLINE": "timed out",
    "FAILED": "failed", "NODE_FAIL": "failed", "OUT_OF_MEMORY": "failed", "BOOT_FAIL": "failed",
    "PREEMPTED": "failed", "SPECIAL_EXIT": "failed",
}  # fmt: skip
_JOB_ID = re.compile(r"^(\d+)(?:;\S+)?$")


class SlurmError(JupyterDistError):
    """sbatch, squeue, scontrol or scancel is missing or refused the request."""


def slurm_state(raw: str) -> JobState:
    """Our state for a SLURM job state (``CANCELLED by 0`` -> stopped; unknown words -> unknown)."""
    word = raw.strip().split()[0].rstrip("+").upper() if raw.strip() else ""
    return _STATES.get(word, "unknown")


def find_slurm_tool(name: str) -> str:
    """Path of a SLURM client tool, or a one-line error saying how to get it."""
    found = shutil.which(name)
    if found is None:
        raise SlurmError(f"{name} not found on PATH: {SLURM_INSTALL_HINT}")
    return found


def _run(argv: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None,
         timeout: float = 30.0) -> subprocess.CompletedProcess[str]:  # fmt: skip
    try:
        return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout, check=False,
                              stdin=subprocess.DEVNULL)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{Path(argv[0]).name} did not answer within {timeout:.0f} s (is slurmctld up?)") from None
    except OSError as exc:
        raise SlurmError(f"cannot run {argv[0]}: {exc.strerror}") from None


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


@dataclass(kw_only=True)
class SlurmLauncher(RemoteLauncher):
    """One ``sbatch`` job for one run directory (a shared filesystem is assumed)."""

    kind = "slurm"

    run_dir: RunDir
    """Where script, batch script, logs and telemetry live (visible to every node)."""
    script: str = ""
    """The batch script (``render_sbatch``); written to ``job.sbatch`` at start."""
    job_name: str = "jupyter-dist"
    """``--job-name`` (names the output file ``<job_name>-<jobid>.out``)."""
    nodes: int = 1
    """Nodes the script asks for."""
    nproc: int = 1
    """Processes per node."""
    partition: str | None = None
    """``--partition`` (checked against ``sinfo`` before submitting)."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Environment of the submission (``--export=ALL`` hands it to the job): PATH of this kernel's Python, JD_*."""
    job_id: str | None = None
    """SLURM job id once submitted."""
    state: str = "before"
    """``before`` -> ``running`` -> ``after``."""
    output: str | None = None
    """The job's output file (``StdOut`` of ``scontrol show job``)."""
    poll_interval: float = 1.0
    """Seconds between state polls."""
    reason: str | None = None
    """Why a pending job waits (``Reason`` of ``scontrol show job``: Resources, Priority, ...)."""
    raw_state: str | None = None
    """The scheduler's own word for the job's state (``OUT_OF_MEMORY``: the watcher names the cause)."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise SlurmError(f"--nodes must be >= 1, got {self.nodes}")

    # ---- pure -------------------------------------------------------------------------------------------------
    @property
    def sbatch_path(self) -> Path:
        """``job.sbatch`` in the run directory."""
        return self.run_dir.path / "job.sbatch"

    def args(self) -> list[list[str]]:
        """``sbatch --parsable job.sbatch`` (partition, account and time limit are in the script's header)."""
        return [["sbatch", "--parsable", str(self.sbatch_path)]]

    def env(self) -> dict[str, str]:
        """Added to the submitting environment (the job inherits it with ``--export=ALL``)."""
        return dict(self.extra_env)

    def task(self) -> str:
        """The batch script."""
        return self.script

    # ---- side effects -----------------------------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        env = {**os.environ, **self.env()}
        bindir = str(Path(sys.executable).parent)  # torchrun and jupyter_dist of this kernel's environment
        if bindir not in env.get("PATH", "").split(os.pathsep):
            env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
        return env

    def check_partition(self) -> None:
        """One-line errors when ``partition`` is not one ``sinfo`` lists, or has fewer nodes than the job asks for.

        (SLURM would accept such a job and leave it pending forever unless the cluster enforces partition limits.)
        """
        res = _run([find_slurm_tool("sinfo"), "-h", "-o", "%P %D"], env=self._env())
        if res.returncode != 0:
            raise SlurmError(f"sinfo failed: {_last_line(res.stderr)}")
        nodes: dict[str, int] = {}
        default = None
        for ln in res.stdout.splitlines():
            words = ln.split()
            if len(words) != 2 or not words[1].isdigit():
                continue
            name = words[0].rstrip("*")
            if words[0].endswith("*"):
                default = name
            nodes[name] = nodes.get(name, 0) + int(words[1])
        if self.partition is not None and self.partition not in nodes:
            raise SlurmError(
                f"SLURM partition {self.partition!r} does not exist on this cluster; partitions: "
                f"{', '.join(sorted(nodes)) or '(none)'} (sinfo)"
            )
        part = self.partition or default
        if part is not None and part in nodes and self.nodes > nodes[part]:
            raise SlurmError(
                f"--nodes {self.nodes}: SLURM partition {part!r} has {nodes[part]} node(s), the job could never start; "
                f"ask for at most {nodes[part]} or pick a bigger partition (sinfo)"
            )

    def start(self) -> str:
        """Write ``job.sbatch`` and submit it; returns the job id."""
        if self.state != "before":
            raise SlurmError(f"launcher already {self.state}")
        sbatch = find_slurm_tool("sbatch")
        self.check_partition()
        write_atomic(self.sbatch_path, self.script)
        write_atomic(self.run_dir.path / "jd_bootstrap.py", BOOTSTRAP_STUB)
        res = _run([sbatch, "--parsable", str(self.sbatch_path)], env=self._env(), cwd=self.run_dir.path, timeout=60)
        if res.returncode != 0:
            msg = _last_line(res.stderr or res.stdout)
            if "partition" in msg.lower():
                msg += f" (partition {self.partition!r}; list them with sinfo)"
            raise SlurmError(f"sbatch refused the job: {msg}")
        m = _JOB_ID.match(res.stdout.strip())
        if not m:
            raise SlurmError(f"sbatch answered {res.stdout.strip()!r}, not a job id")
        self.job_id = m.group(1)
        self.output = str(self.run_dir.path / f"{self.job_name}-{self.job_id}.out")
        self.state = "running"
        return self.job_id

    def job_info(self) -> dict[str, str]:
        """``scontrol show job -o <id>`` as a dict (empty when the controller no longer knows the job)."""
        if self.job_id is None:
            return {}
        res = _run([find_slurm_tool("scontrol"), "show", "job", "-o", self.job_id], env=self._env())
        if res.returncode != 0:
            return {}
        info = {}
        for word in res.stdout.split():
            key, sep, value = word.partition("=")
            if sep:
                info[key] = value
        return info

    def poll(self) -> JobState:
        """pending, running, succeeded, failed, stopped, timed out, or unknown."""
        if self.job_id is None:
            return "pending" if self.state == "before" else "unknown"
        info = self.job_info()
        if info.get("JobState"):
            self.raw_state = info["JobState"]
            if info.get("StdOut"):
                self.output = info["StdOut"]
            state = slurm_state(info["JobState"])
            self.reason = info.get("Reason") if state == "pending" and info.get("Reason") != "None" else None
        else:
            state = self._sacct_state()
        if state in ("succeeded", "failed", "stopped", "timed out"):
            self.state = "after"
        return state

    def _sacct_state(self) -> JobState:
        sacct = shutil.which("sacct")
        if sacct is None or self.job_id is None:
            return "unknown"
        try:
            res = _run([sacct, "-n", "-X", "-P", "-j", self.job_id, "-o", "State"], env=self._env(), timeout=15)
        except SlurmError:
            return "unknown"
        if res.returncode != 0 or not res.stdout.strip():  # accounting disabled: "Slurm accounting storage is ..."
            return "unknown"
        self.raw_state = res.stdout.splitlines()[0].strip()
        return slurm_state(self.raw_state)

    def cancel(self) -> None:
        """``scancel <id>`` (SIGTERM to every step, SIGKILL after the cluster's KillWait)."""
        if self.job_id is None:
            return
        res = _run([find_slurm_tool("scancel"), self.job_id], env=self._env())
        if res.returncode != 0 and "already completed" not in res.stderr and "Invalid job id" not in res.stderr:
            raise SlurmError(f"scancel {self.job_id} failed: {_last_line(res.stderr)}")

    def follow(self, on_lines: Callable[[list[str]], None]) -> Follower:
        """Tail the job's output file (it appears when the job starts); a last read after :meth:`Follower.finish`."""

        def tail(stop: threading.Event) -> None:
            offset, partial = 0, b""
            while True:
                final = stop.is_set()
                path = Path(self.output) if self.output else None
                if path is not None and path.exists():
                    with open(path, "rb") as fh:
                        fh.seek(offset)
                        data = fh.read()
                    offset += len(data)
                    data = partial + data
                    cut = data.rfind(b"\n")
                    if final and data and cut != len(data) - 1:
                        cut = len(data)  # the last line without a newline: take it on the final read
                    partial = data[cut + 1 :] if cut >= 0 else data
                    if cut >= 0:
                        on_lines(data[:cut].decode("utf-8", "replace").split("\n"))
                if final:
                    return
                stop.wait(0.5)

        return Follower(tail, f"jd-slurm-{self.job_id}")

    def describe(self) -> str:
        """``SLURM job 12 (2 nodes, partition debug)``."""
        part = f", partition {self.partition}" if self.partition else ""
        waiting = f"; pending: {self.reason}" if self.reason else ""
        return f"SLURM job {self.job_id} ({self.nodes} node(s){part}){waiting}"

    # ---- reattach -----------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Saved in ``run.json`` (the script itself is ``job.sbatch``)."""
        return {"kind": self.kind, "run_dir": str(self.run_dir.path), "job_name": self.job_name, "nodes": self.nodes,
                "nproc": self.nproc, "partition": self.partition, "job_id": self.job_id, "state": self.state,
                "output": self.output, "args": self.args(), "env_names": sorted(self.extra_env)}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SlurmLauncher:
        """Inverse of :meth:`to_dict`."""
        rd = RunDir(Path(data["run_dir"]))
        script = rd.path / "job.sbatch"
        return cls(
            run_dir=rd, script=script.read_text() if script.exists() else "", job_name=str(data["job_name"]),
            nodes=int(data["nodes"]), nproc=int(data.get("nproc", 1)), partition=data.get("partition"),
            job_id=data.get("job_id"), state=str(data.get("state", "running")), output=data.get("output"),
        )  # fmt: skip


def wait_for_state(launcher: SlurmLauncher, states: tuple[str, ...], timeout: float) -> JobState:
    """Poll until the job is in one of ``states`` (or ``timeout`` s); returns the last state."""
    deadline = time.monotonic() + timeout
    state = launcher.poll()
    while state not in states and time.monotonic() < deadline:
        time.sleep(0.5)
        state = launcher.poll()
    return state


# ---- starting a run from a cell (the hooks start_cluster_run calls; the registry names SlurmStart) -------------
class SlurmStart:
    """SLURM's part of ``start_cluster_run`` (:class:`~.cluster.ClusterHooks`): a shared filesystem, ``sbatch``."""

    def check(self, cluster: Any) -> None:
        """SkyPilot's options are refused; ``--setup``/``--requirements`` need ``--ship-env``."""
        if (cluster.gpus or cluster.cluster or cluster.infra or cluster.spot or cluster.managed
                or cluster.idle_minutes is not None or cluster.down or cluster.image or cluster.mounts
                or cluster.checkpoint_dir is not None):  # fmt: skip
            raise JupyterDistError(
                "--gpus/--cluster/--infra/--spot/--idle-minutes/--down/--managed/--image/--mount/--checkpoint-dir are "
                "SkyPilot options; with "
                "--backend slurm use --partition/--account/--time (and --nproc for processes per node)"
            )
        if not cluster.ship_env and (cluster.setup is not None or cluster.requirements):
            raise JupyterDistError("--setup/--requirements on SLURM install on the nodes: add --ship-env (the nodes "
                                   "do not share this kernel's environment)")  # fmt: skip

    def ships_env(self, cluster: Any) -> bool:
        """Only with ``--ship-env``: the nodes otherwise share this kernel's environment."""
        return bool(cluster.ship_env)

    def wheel_site(self, site: str) -> str:
        """One folder per node: they share the run directory."""
        return f"{site}-node${{SLURM_NODEID}}"

    def contract(self, contract: Any) -> Any:
        """Unchanged: the ranks write the run directory itself (a shared filesystem)."""
        return contract

    def extras(self, cluster: Any, renv: Any) -> dict[str, str]:
        """The ranks start in the notebook's folder (or ``--workdir``, importable from where it is), as local ranks."""
        from .local import project_paths

        out: dict[str, str] = {}
        if cluster.workdir is not None:  # a shared filesystem: import from the folder itself
            path = str(Path(cluster.workdir).expanduser().resolve())
            out["PYTHONPATH"] = os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH", "")]))
        out["JD_CWD"] = str(Path(cluster.workdir).expanduser().resolve()) if cluster.workdir else os.getcwd()
        if project_paths():
            out["JD_PATH"] = os.pathsep.join(project_paths())
        return out

    def script_path(self, script_file: str, cluster: Any) -> tuple[str, Path | None]:
        """The script where it is (the nodes see this filesystem)."""
        return str(Path(script_file).expanduser().resolve()), None

    def start(self, job: Any) -> Any:
        """Write the run directory and ``job.sbatch`` (``render_sbatch``), submit it; a Run (or a DryRun)."""
        from dataclasses import replace

        from ...render.common import RenderOptions
        from ...render.slurm import render_sbatch
        from ..prepare import DryRun, write_shipped
        from ..record import launch_record
        from ..run import Run
        from ..rundir import new_run_dir, scrub_env
        from .local import free_port

        cluster, renv, contract, dry_run = job.cluster, job.renv, job.contract, job.dry_run
        rd = RunDir(Path(job.runs_dir).expanduser().resolve() / f"{job.name}-DRYRUN") if dry_run else new_run_dir(
            job.runs_dir, job.name)  # fmt: skip
        if contract.ds_config and not dry_run:
            contract = replace(contract, ds_config=str(rd.path / "ds_config.json"))
        run_env = {**replace(contract, run_dir=str(rd.path)).to_environ(), **job.extras}
        opts = RenderOptions(
            candidate=job.candidate, name=job.job, script=str(rd.path / "jd_bootstrap.py"),
            script_args=(str(rd.script),), rdzv="static", master_port=job.port or (29500 if dry_run else free_port()),
            max_restarts=job.max_restarts, checkpoint_dir=str(rd.checkpoints), partition=cluster.partition,
            account=cluster.account, time_limit=cluster.time_limit or "24:00:00", env=tuple(run_env.items()),
            secrets=cluster.secrets, nccl_debug="WARN",
            node_setup=renv.setup_script(cluster.setup) if renv is not None else "",
        )  # fmt: skip
        sbatch = render_sbatch(job.plan, opts, layout=job.layout)
        lau = SlurmLauncher(run_dir=rd, script=sbatch, job_name=job.job, nodes=job.nodes, nproc=job.nproc,
                            partition=cluster.partition)  # fmt: skip
        if dry_run:
            notes = renv.notes() if renv is not None else ["the nodes share this kernel's environment (no --ship-env)"]
            return DryRun(script=job.script, argv=lau.args(), env=run_env, files={"job.sbatch": sbatch, **job.files},
                          notes=notes)  # fmt: skip
        write_atomic(rd.script, job.script)
        if renv is not None:
            from ..remote_env import stage_files

            stage_files(renv, rd.path, cluster.requirements)
        for fname, text in job.files.items():
            write_atomic(rd.path / fname, text)
        if job.ship:
            write_shipped(rd, job.ship)
        record = launch_record(name=job.name, backend=SlurmLauncher.kind, strategy=job.strat, choice=job.choice,
                               nproc=job.nproc, nodes=job.nodes, timeout=job.timeout, env=scrub_env(run_env),
                               plan=job.user_plan, ship=job.ship, secrets=cluster.secrets)  # fmt: skip
        rd.write_meta(record)
        try:
            lau.start()
        except JupyterDistError:
            rd.write_meta(replace(record, status="failed", error="submission failed"))
            raise
        record = replace(record, started=time.time(), launcher=lau.to_dict(), extra={"job_id": lau.job_id})
        meta = rd.write_meta(record).to_dict()
        return Run(rd, meta, launcher=lau, timeout=job.timeout, plan=job.user_plan)
