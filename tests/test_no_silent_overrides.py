"""Flags are honoured or refused, never dropped (issue 29): ``--port`` on one node, ``--env`` the launcher owns."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

pytest.importorskip("IPython")
from IPython.core.error import UsageError  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402

from jupyter_dist.launch.backends.local import LaunchError, LocalLauncher, check_user_env  # noqa: E402
from jupyter_dist.launch.rundir import RunDir  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_a_port_on_one_node_is_the_rendezvous_port(tmp_path: Path) -> None:
    argv = LocalLauncher(run_dir=RunDir(tmp_path), nproc=2, port=29555, torchrun="/x/torchrun").args()[0]
    assert "--standalone" not in argv  # torchrun --standalone picks its own port and ignores an endpoint
    i = argv.index("--rdzv-endpoint")
    assert argv[i + 1] == "127.0.0.1:29555" and argv[argv.index("--rdzv-backend") + 1] == "c10d"
    assert argv[argv.index("--nnodes") + 1] == "1"
    # without a port, one node stays --standalone (a free port of its own, runs never collide)
    assert LocalLauncher(run_dir=RunDir(tmp_path), nproc=2, torchrun="/x/torchrun").args()[0][1] == "--standalone"


def test_a_taken_port_on_one_node_is_one_line(ip: InteractiveShell, runs: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(UsageError) as e:
            ip.run_cell_magic("dist_train", f"--nproc 2 --strategy none --port {port}", "pass")
    assert str(e.value) == (f"port {port} on 127.0.0.1 is already in use; pick another --port or leave it out to "
                            "get a free one")  # fmt: skip


def test_env_the_launcher_owns_is_refused_in_one_line(ip: InteractiveShell, runs: Path) -> None:
    with pytest.raises(UsageError) as e:
        ip.run_cell_magic("dist_train", "--nproc 2 --env RANK=3 --env WORLD_SIZE=7 --env MASTER_PORT=x --env A=1",
                          "pass")  # fmt: skip
    assert str(e.value) == ("--env RANK, WORLD_SIZE, MASTER_PORT: set by the launcher for each rank, not by --env "
                            "(use --nproc, --nodes and --port)")  # fmt: skip
    assert not list(runs.iterdir())  # refused before anything is written
    for key in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "GROUP_RANK", "JD_RUN_DIR"):
        with pytest.raises(LaunchError, match=f"^--env {key}: set by the launcher"):
            check_user_env({key: "1"})
    check_user_env({"OMP_NUM_THREADS": "2", "JD_CHECKPOINT_DIR": "/x", "NCCL_DEBUG": "INFO"})


@pytest.mark.slow
def test_a_port_on_one_node_is_used_and_recorded(ip: InteractiveShell, runs: Path) -> None:
    """A real 2-rank run with ``--port P``: the rendezvous listens on P while the ranks run, run.json says P."""
    port = _free_port()
    code = (
        "import socket, jupyter_dist.worker as jd\n"
        "jd.init()\n"
        f"socket.create_connection(('127.0.0.1', {port}), timeout=5).close()\n"
        "print('reached the rendezvous port', flush=True)\n"
    )
    run = ip.run_cell_magic("dist_train", f"--nproc 2 --strategy none --port {port} --timeout 240 --no-dashboard",
                            code)  # fmt: skip
    assert run.wait(260) == "succeeded", run.summary() + run.launcher_log()
    assert "reached the rendezvous port" in run.logs(0)
    record = json.loads((run.dir / "run.json").read_text())
    assert record["launcher"]["port"] == port
