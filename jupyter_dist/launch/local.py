"""The local launcher: torchrun on this machine (gloo on CPU, NCCL on local GPUs).

Pure ``args()`` / ``env()``, then ``start()`` (side effects). One node runs ``torchrun --standalone`` (its own free
port, so runs never collide); ``nodes > 1`` starts one torchrun agent per simulated node with a c10d rendezvous on
127.0.0.1 (the same code path a real multi-node run takes). Workers are fresh processes started by torchrun, never
forks of the kernel, so whatever the kernel did (CUDA included) does not leak into them.
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

from ..errors import JupyterDistError
from .rundir import RunDir

__all__ = ["LocalLauncher", "LaunchError", "find_torchrun", "port_is_free"]


class LaunchError(JupyterDistError):
    """The job cannot be started (missing torchrun, port taken, ...)."""


def find_torchrun(python: str | None = None) -> str:
    """The ``torchrun`` next to the kernel's Python, else on PATH; a clear error when there is none."""
    exe = Path(python or sys.executable)
    candidate = exe.parent / "torchrun"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("torchrun")
    if found:
        return found
    raise LaunchError(
        f"torchrun not found next to {exe} or on PATH: install PyTorch in this environment (pip install torch)"
    )


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``host:port`` can be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(kw_only=True)
class LocalLauncher:
    """torchrun agents on this machine for one run directory."""

    run_dir: RunDir
    """Where script, logs and telemetry live."""
    nproc: int = 2
    """Processes per (simulated) node."""
    nodes: int = 1
    """torchrun agents; > 1 simulates a multi-node rendezvous on 127.0.0.1."""
    max_restarts: int = 0
    """torchrun ``--max-restarts``."""
    port: int | None = None
    """Rendezvous port for ``nodes > 1`` (default: a free one)."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Environment added to the workers (JD_* and user ``--env``)."""
    torchrun: str | None = None
    """Path of torchrun (default: :func:`find_torchrun`)."""
    state: str = "before"
    """``before`` -> ``running`` -> ``after``."""
    pids: list[int] = field(default_factory=list)
    """PIDs of the torchrun agents once started."""

    def __post_init__(self) -> None:
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
        """One argv per torchrun agent (pure: no port is checked, no process started)."""
        exe = self.torchrun or "torchrun"
        common = ["--nproc-per-node", str(self.nproc), "--max-restarts", str(self.max_restarts)]
        program = ["-m", "jupyter_dist.launch.bootstrap", str(self.run_dir.script)]
        if self.nodes == 1:
            return [[exe, "--standalone", *common, *program]]
        endpoint = f"127.0.0.1:{self.port or 0}"
        return [
            [exe, "--nnodes", str(self.nodes), "--node-rank", str(i), "--rdzv-backend", "c10d",
             "--rdzv-endpoint", endpoint, "--rdzv-id", self.run_dir.path.name, *common, *program]
            for i in range(self.nodes)
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        """Variables added to the environment of every agent."""
        env = {"JD_RUN_DIR": str(self.run_dir.path), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        env.update(self.extra_env)
        return env

    def start(self) -> list[subprocess.Popen[bytes]]:
        """Start the agents in their own session; stdout/stderr of torchrun go to ``logs/launcher.log``."""
        if self.state != "before":
            raise LaunchError(f"launcher already {self.state}")
        if self.torchrun is None:
            self.torchrun = find_torchrun()
        if self.nodes > 1:
            if self.port is None:
                self.port = _free_port()
            elif not port_is_free(self.port):
                raise LaunchError(
                    f"port {self.port} on 127.0.0.1 is already in use; pick another --port or leave it out to get "
                    "a free one"
                )
        env = {**os.environ, **self.env()}
        log = open(self.run_dir.logs / "launcher.log", "ab")  # noqa: SIM115 - owned by the child processes
        procs = []
        try:
            for argv in self.args():
                procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True,
                                              cwd=self.run_dir.path))  # fmt: skip
        except OSError as exc:
            for p in procs:
                p.kill()
            raise LaunchError(f"cannot start torchrun ({self.torchrun}): {exc.strerror}") from None
        finally:
            log.close()
        self.pids = [p.pid for p in procs]
        self.state = "running"
        return procs

    def to_dict(self) -> dict[str, Any]:
        """Enough to reattach after a kernel restart."""
        return {
            "kind": "local", "run_dir": str(self.run_dir.path), "nproc": self.nproc, "nodes": self.nodes,
            "max_restarts": self.max_restarts, "port": self.port, "torchrun": self.torchrun, "state": self.state,
            "pids": list(self.pids), "args": self.args(),
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LocalLauncher:
        """Inverse of :meth:`to_dict` (the environment is not restored: it is in the processes already)."""
        return cls(
            run_dir=RunDir(Path(data["run_dir"])), nproc=int(data["nproc"]), nodes=int(data["nodes"]),
            max_restarts=int(data["max_restarts"]), port=data.get("port"), torchrun=data.get("torchrun"),
            state=str(data.get("state", "after")), pids=list(data.get("pids", [])),
        )  # fmt: skip
