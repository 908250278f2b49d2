"""The local launcher: torchrun, ``deepspeed`` or ``accelerate launch`` on this machine (gloo on CPU, NCCL on GPUs).

Pure ``args()`` / ``env()``, then ``start()`` (side effects). One node runs ``torchrun --standalone`` (its own free
port, so runs never collide), or with a ``--port`` a c10d rendezvous on it (``--standalone`` would drop it);
``nodes > 1`` starts one torchrun agent per simulated node with a c10d rendezvous on 127.0.0.1 (the same code path a
real multi-node run takes). Workers are fresh processes started by the launcher, never forks of the kernel, so
whatever the kernel did (CUDA included) does not leak into them.

The other launchers run one node only, on a free port picked at ``start()``:

* ``deepspeed --num_gpus N --master_port P --no_local_rank --module jupyter_dist.launch.bootstrap SCRIPT``: the
  runner starts ``deepspeed.launcher.launch``, which starts the ranks with RANK/LOCAL_RANK/WORLD_SIZE set.
  ``--no_local_rank`` keeps ``--local_rank=K`` out of the script's ``sys.argv``; ``--hostfile /dev/null`` keeps a
  cluster's ``/job/hostfile`` from turning the run into a pdsh multi-node launch. On CPU it needs
  ``DS_ACCELERATOR=cpu`` (the session adds it when the machine has no GPU).
* ``accelerate launch --multi_gpu --num_processes N --num_machines 1 --main_process_port P -m
  jupyter_dist.launch.bootstrap SCRIPT``: ``--multi_gpu`` is accelerate's only local multi-process path (it runs
  torchrun's agent in-process, which also works on a CPU-only machine: the ranks use gloo). ``--cpu`` would start a
  single process unless MPI is used, so it is never passed; instead the session adds ``ACCELERATE_USE_CPU=true``
  on a machine without GPU, so that an ``Accelerator()`` in the cell is ``MULTI_CPU`` rather than one lone process.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import JupyterDistError
from ..base import Launcher
from ..rundir import RunDir

__all__ = [
    "CPU_OVERSUBSCRIPTION",
    "LAUNCHERS",
    "MAX_LOCAL_RANKS",
    "LocalLauncher",
    "LaunchError",
    "LAUNCHER_OWNED_ENV",
    "check_capacity",
    "check_launcher",
    "check_user_env",
    "find_launcher",
    "find_torchrun",
    "free_port",
    "local_cores",
    "port_is_free",
]

LAUNCHERS = ("torchrun", "deepspeed", "accelerate")
"""Launchers a local run can use."""

_INSTALL_HINT = {
    "torchrun": "install PyTorch in this environment (pip install torch)",
    "deepspeed": "install DeepSpeed in this environment (pip install deepspeed)",
    "accelerate": "install Accelerate in this environment (pip install accelerate)",
}


def _precision_var() -> str:
    """``JD_PRECISION``, named by the launch contract's one table (``WorkerEnv``'s ``ENV_VARS``)."""
    from ...worker._env import ENV_VARS

    return ENV_VARS["precision"]


class LaunchError(JupyterDistError):
    """The job cannot be started (missing torchrun, port taken, ...)."""


def find_launcher(name: str, python: str | None = None) -> str:
    """The launcher executable ``name`` next to the kernel's Python, else on PATH; a clear error when there is none."""
    exe = Path(python or sys.executable)
    candidate = exe.parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    raise LaunchError(f"{name} not found next to {exe} or on PATH: {_INSTALL_HINT.get(name, f'install {name}')}")


def find_torchrun(python: str | None = None) -> str:
    """The ``torchrun`` next to the kernel's Python, else on PATH; a clear error when there is none."""
    return find_launcher("torchrun", python)


def check_launcher(launcher: str, *, nodes: int = 1, max_restarts: int = 0) -> None:
    """One-line errors for a launcher this module cannot run with these options."""
    if launcher not in LAUNCHERS:
        raise LaunchError(f"launcher {launcher!r} is not available for local runs; valid: {', '.join(LAUNCHERS)}")
    if launcher != "torchrun" and nodes > 1:
        raise LaunchError(
            f"--launcher {launcher} runs one node here; simulate {nodes} nodes with --launcher torchrun "
            "(DeepSpeed strategies run under torchrun too)"
        )
    if launcher == "deepspeed" and max_restarts:
        raise LaunchError("--max-restarts needs --launcher torchrun or accelerate: DeepSpeed's launcher never restarts")


MAX_LOCAL_RANKS = 512
"""Most ranks one local run starts, ``--oversubscribe`` or not (``--nproc``'s own cap, over all simulated nodes)."""
CPU_OVERSUBSCRIPTION = 4
"""Local CPU ranks per core allowed without ``--oversubscribe`` (gloo ranks mostly wait; at least 8 ranks always)."""


def local_cores() -> int:
    """CPU cores this process may run on (its affinity, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_capacity(nproc: int, nodes: int, *, gpus: int, cores: int | None = None,
                   oversubscribe: bool = False) -> None:  # fmt: skip
    """Refuse, in one line, more local ranks than this machine holds.

    One rank per GPU when it has GPUs (the ranks use CUDA), else :data:`CPU_OVERSUBSCRIPTION` per core (at least 8).
    ``oversubscribe`` lifts that limit, never the hard cap of :data:`MAX_LOCAL_RANKS` ranks on one machine.
    """
    world = nproc * nodes
    what = f"--nproc {nproc}" if nodes == 1 else f"--nodes {nodes} x --nproc {nproc}"
    if world > MAX_LOCAL_RANKS:
        raise LaunchError(f"{what} starts {world:,} processes on this machine; a local run starts at most "
                          f"{MAX_LOCAL_RANKS}, even with --oversubscribe")  # fmt: skip
    if oversubscribe:
        return
    cores = local_cores() if cores is None else cores
    if gpus and world > gpus:
        raise LaunchError(f"{what} starts {world} processes on this machine, which has {gpus} GPU"
                          f"{'s' * (gpus != 1)} (one rank per GPU) and {cores} CPU cores; pass --oversubscribe to "
                          "start them anyway")  # fmt: skip
    limit = max(8, CPU_OVERSUBSCRIPTION * cores)
    if not gpus and world > limit:
        raise LaunchError(f"{what} starts {world} processes on this machine, which has {cores} CPU core"
                          f"{'s' * (cores != 1)} (at most {limit} ranks, {CPU_OVERSUBSCRIPTION} per core); pass "
                          "--oversubscribe to start them anyway")  # fmt: skip


LAUNCHER_OWNED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
                      "TORCHELASTIC_USE_AGENT_STORE", "JD_RUN_DIR")  # fmt: skip
"""Variables the launcher sets for each rank; ``--env`` may not give them (the launcher would override them)."""


def check_user_env(env: dict[str, str]) -> None:
    """One line naming every ``--env`` variable the launcher owns (it sets them per rank and would drop the user's)."""
    owned = [k for k in env if k in LAUNCHER_OWNED_ENV]
    if owned:
        raise LaunchError(f"--env {', '.join(owned)}: set by the launcher for each rank, not by --env (use --nproc, "
                          "--nodes and --port)")  # fmt: skip


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``host:port`` can be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port free on this host now (the kernel picks it; torchrun's rendezvous binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def project_paths() -> list[str]:
    """The user's folders on this process's ``sys.path`` (not the interpreter's, not installed packages).

    The ranks put them on theirs (``JD_PATH``), so a module the kernel imports from them imports there too.
    """
    roots = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    out = []
    for entry in sys.path:
        if not entry or not os.path.isdir(entry):
            continue
        real = os.path.realpath(entry)
        if any(real == r or real.startswith(r + os.sep) for r in roots) or "site-packages" in real.split(os.sep):
            continue
        if "dist-packages" in real.split(os.sep) or real in out:
            continue
        out.append(real)
    return out


@dataclass(kw_only=True)
class LocalLauncher(Launcher):
    """torchrun agents (or one ``deepspeed`` / ``accelerate launch``) on this machine for one run directory."""

    kind = "local"

    run_dir: RunDir
    """Where script, logs and telemetry live."""
    nproc: int = 2
    """Processes per (simulated) node."""
    nodes: int = 1
    """torchrun agents; > 1 simulates a multi-node rendezvous on 127.0.0.1 (torchrun only)."""
    launcher: str = "torchrun"
    """One of :data:`LAUNCHERS`."""
    max_restarts: int = 0
    """torchrun ``--max-restarts`` (also passed by accelerate; DeepSpeed's launcher has none)."""
    port: int | None = None
    """Rendezvous port (torchrun: one node with a port given runs a c10d rendezvous on it instead of
    ``--standalone``), master port for deepspeed / accelerate (default: a free one)."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Environment added to the workers (JD_* and user ``--env``)."""
    torchrun: str | None = None
    """Path of torchrun (default: :func:`find_torchrun`)."""
    executable: str | None = None
    """Path of ``deepspeed`` / ``accelerate`` for those launchers (default: :func:`find_launcher`)."""
    state: str = "before"
    """``before`` -> ``running`` -> ``after``."""
    pids: list[int] = field(default_factory=list)
    """PIDs of the launcher processes (torchrun agents, the deepspeed runner, accelerate) once started."""
    cwd: str | None = None
    """Working directory of the ranks (default: this process's when started, the notebook's folder, as torchrun
    keeps the shell's): relative paths and sibling modules resolve as in the kernel; jd's files go to the run dir."""

    def __post_init__(self) -> None:
        check_launcher(self.launcher, nodes=self.nodes, max_restarts=self.max_restarts)
        if self.nproc < 1:
            raise LaunchError(f"--nproc must be >= 1, got {self.nproc}")
        if self.nodes < 1:
            raise LaunchError(f"--nodes must be >= 1, got {self.nodes}")
        if self.max_restarts < 0:
            raise LaunchError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.port is not None and not 1024 <= self.port <= 65535:
            raise LaunchError(f"--port must be in 1024..65535, got {self.port}")

    @property
    def world_size(self) -> int:
        """Total worker processes."""
        return self.nproc * self.nodes

    def args(self) -> list[list[str]]:
        """One argv per launcher process (pure: no port is checked, no process started; port 0 until started)."""
        if self.launcher == "deepspeed":
            return [[self.executable or "deepspeed", "--hostfile", "/dev/null", "--num_gpus", str(self.nproc),
                     "--master_port", str(self.port or 0), "--no_local_rank", "--module",
                     "jupyter_dist.launch.bootstrap", str(self.run_dir.script)]]  # fmt: skip
        if self.launcher == "accelerate":
            precision = self.extra_env.get(_precision_var(), "")
            mixed = next((p for p in ("bf16", "fp16") if precision.startswith(p)), "no")
            dist = ["--multi_gpu"] if self.nproc > 1 else []
            return [[self.executable or "accelerate", "launch", *dist, "--num_processes", str(self.nproc),
                     "--num_machines", "1", "--main_process_port", str(self.port or 0), "--mixed_precision", mixed,
                     "--dynamo_backend", "no", "--max_restarts", str(self.max_restarts), "-m",
                     "jupyter_dist.launch.bootstrap", str(self.run_dir.script)]]  # fmt: skip
        exe = self.torchrun or "torchrun"
        common = ["--nproc-per-node", str(self.nproc), "--max-restarts", str(self.max_restarts)]
        program = ["-m", "jupyter_dist.launch.bootstrap", str(self.run_dir.script)]
        if self.nodes == 1 and self.port is None:
            return [[exe, "--standalone", *common, *program]]
        # a given --port on one node: the c10d rendezvous on it (--standalone would pick its own port and drop it)
        endpoint = f"127.0.0.1:{self.port or 0}"
        return [
            [exe, "--nnodes", str(self.nodes), "--node-rank", str(i), "--rdzv-backend", "c10d",
             "--rdzv-endpoint", endpoint, "--rdzv-id", self.run_dir.path.name, *common, *program]
            for i in range(self.nodes)
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        """Variables added to the environment of every agent."""
        env = {"JD_RUN_DIR": str(self.run_dir.path), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        project = project_paths()
        if project:
            env["JD_PATH"] = os.pathsep.join(project)
        env.update(self.extra_env)
        return env

    def start(self) -> list[subprocess.Popen[bytes]]:
        """Start the launcher(s) in their own session; their stdout/stderr go to ``logs/launcher.log``."""
        if self.state != "before":
            raise LaunchError(f"launcher already {self.state}")
        if self.launcher == "torchrun":
            if self.torchrun is None:
                self.torchrun = find_torchrun()
            exe = self.torchrun
        else:
            if self.executable is None:
                self.executable = find_launcher(self.launcher)
            exe = self.executable
        if self.nodes > 1 or self.launcher != "torchrun" or self.port is not None:
            if self.port is None:
                self.port = free_port()
            elif not port_is_free(self.port):
                raise LaunchError(
                    f"port {self.port} on 127.0.0.1 is already in use; pick another --port or leave it out to get "
                    "a free one"
                )
        if self.cwd is None:
            self.cwd = os.getcwd()
        if not os.path.isdir(self.cwd):
            raise LaunchError(f"the ranks' working directory {self.cwd} is not a folder; cd to the project first")
        env = {**os.environ, **self.env()}
        log = open(self.run_dir.logs / "launcher.log", "ab")  # noqa: SIM115 - owned by the child processes
        procs = []
        try:
            for argv in self.args():
                procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True,
                                              cwd=self.cwd))  # fmt: skip
        except OSError as exc:
            for p in procs:
                p.kill()
            raise LaunchError(f"cannot start {self.launcher} ({exe}): {exc.strerror}") from None
        finally:
            log.close()
        self.pids = [p.pid for p in procs]
        self.state = "running"
        return procs

    def to_dict(self) -> dict[str, Any]:
        """Enough to reattach after a kernel restart."""
        return {
            "kind": "local", "launcher": self.launcher, "run_dir": str(self.run_dir.path), "nproc": self.nproc,
            "nodes": self.nodes, "max_restarts": self.max_restarts, "port": self.port, "torchrun": self.torchrun,
            "executable": self.executable, "precision": self.extra_env.get(_precision_var()), "state": self.state,
            "pids": list(self.pids), "args": self.args(), "cwd": self.cwd,
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LocalLauncher:
        """Inverse of :meth:`to_dict` (the environment is not restored, but JD_PRECISION, which ``args()`` reads)."""
        precision = data.get("precision")
        return cls(
            run_dir=RunDir(Path(data["run_dir"])), nproc=int(data["nproc"]), nodes=int(data["nodes"]),
            launcher=str(data.get("launcher", "torchrun")), max_restarts=int(data["max_restarts"]),
            port=data.get("port"), torchrun=data.get("torchrun"), executable=data.get("executable"),
            state=str(data.get("state", "after")), pids=list(data.get("pids", [])),
            extra_env={_precision_var(): str(precision)} if precision else {}, cwd=data.get("cwd"),
        )  # fmt: skip
