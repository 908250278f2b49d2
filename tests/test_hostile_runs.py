"""Hostile training cells and a hostile peer on the pool's port (issue 16), on real torchrun processes.

A cell that prints 50 MB, forks children and exits, ignores SIGTERM, or calls ``os._exit(0)`` on one rank; a run
directory deleted while the ranks write to it; another process connecting to the pool's control port with garbage,
a huge length prefix, a slow (slowloris) hello, a replayed frame or a flood of connections. Each ends with a clear
status and no process left behind, and the pool stays usable.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import descendants_gone, run_processes, wait_until
from IPython.core.interactiveshell import InteractiveShell

import jupyter_dist.launch.run as run_mod
import jupyter_dist.launch.watch as watch_mod
import jupyter_dist.pool.kernel as pool_mod
from jupyter_dist.pool.channel import NONCE_SIZE, Channel, recv_exact
from jupyter_dist.pool.kernel import Pool

pytestmark = pytest.mark.slow


def _start(ip: InteractiveShell, line: str, cell: str) -> run_mod.Run:
    run = ip.run_cell_magic("dist_train", f"--strategy none --no-dashboard {line}", cell)
    assert isinstance(run, run_mod.Run)
    return run


def test_a_cell_that_prints_50_mb(ip: InteractiveShell, runs: Path) -> None:
    cell = (
        "import sys\n"
        "line = 'x' * 1023 + '\\n'\n"
        "for i in range(50 * 1024):\n"
        "    sys.stdout.write(line)\n"
        "print('the end of rank', jd.rank)\n"
    )
    run = _start(ip, "--nproc 2", cell)
    assert run.wait(240) == "succeeded", run.summary()
    for r in (0, 1):  # no data lost: every byte is in the rank's log
        assert run._rd.rank_log(r).stat().st_size >= 50 * 1024 * 1024
    t0 = time.monotonic()
    assert run.logs(1, tail=1) == "the end of rank 1"
    assert "succeeded" in run.summary()
    assert time.monotonic() - t0 < 2.0, "the tail of a 50 MB log is read from its end"
    assert descendants_gone(run)


def test_children_a_rank_forks_do_not_survive_the_run(ip: InteractiveShell, runs: Path) -> None:
    cell = (
        "import os, subprocess, sys, time\n"
        "# a detached grandchild in its own session, and a plain fork that outlives its parent\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        "if os.fork() == 0:\n"
        "    time.sleep(600)\n"
        "    os._exit(0)\n"
        "print('rank', jd.rank, 'leaves its children behind', flush=True)\n"
    )
    run = _start(ip, "--nproc 2", cell)
    assert run.wait(180) == "succeeded", run.summary()
    assert descendants_gone(run, within=5.0), [p.cmdline() for p in run_processes(run)]
    assert len(run._meta.get("strays_killed") or []) == 4  # two per rank
    assert "ended 4 process(es) the ranks left behind" in run.summary()


def test_a_rank_that_ignores_sigterm_is_still_stopped(ip: InteractiveShell, runs: Path) -> None:
    cell = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ignoring SIGTERM', flush=True)\n"
        "time.sleep(600)\n"
    )
    run = _start(ip, "--nproc 2", cell)
    wait_until(lambda: all("ignoring SIGTERM" in run.logs(r) for r in (0, 1)), 120, "both ranks started")
    t0 = time.monotonic()
    assert run.stop(grace=2.0) == "stopped"
    assert time.monotonic() - t0 < 30
    assert descendants_gone(run, within=10.0)


OS_EXIT_CELL = (
    "import os, time, torch, torch.distributed as dist\n"
    "jd.init()\n"
    "t = torch.ones(1)\n"
    "dist.all_reduce(t)\n"
    "if jd.rank == 1:\n"
    "    os._exit(0)\n"
    "WAIT\n"
    "print('never printed')\n"
)


def test_os_exit_on_one_rank_the_peer_notices(ip: InteractiveShell, runs: Path) -> None:
    """Rank 0's next all_reduce finds its peer gone (gloo): the run fails at once, and says which rank began it."""
    run = _start(ip, "--nproc 2", OS_EXIT_CELL.replace("WAIT", "dist.all_reduce(t)"))
    assert run.wait(180) == "failed", run.summary()
    summary = run.summary()
    assert "why: rank 1 ended with os._exit(0) at script.py:9 before the script finished" in summary
    assert "the other ranks lost their peer" in summary
    assert run.exit_codes == {0: 1, 1: 0} and run.failed_rank() == 0
    assert descendants_gone(run)


def test_os_exit_on_one_rank_while_the_other_waits_silently(
    ip: InteractiveShell, runs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 blocks without a word (here: a long sleep): the run is stopped after the grace, not left to hang."""
    monkeypatch.setattr(watch_mod, "EARLY_EXIT_GRACE", 3.0)
    run = _start(ip, "--nproc 2", OS_EXIT_CELL.replace("WAIT", "time.sleep(600)"))
    t0 = time.monotonic()
    assert run.wait(180) == "failed", run.summary()
    assert time.monotonic() - t0 < 120
    diag = run.diagnosis()
    assert diag is not None and diag.first_rank == 1 and diag.basis == "early_exit"
    report = diag.early_exit
    assert report is not None and report["kind"] == "early_exit" and report["rank"] == 1 and report["waiting"] == [0]
    assert report["where"] == "script.py:9"  # the cell's line 6, after the 3-line prelude
    assert "os._exit(0)" in diag.summary()
    assert "rank 1 ended with os._exit(0) at script.py:9" in run.summary()
    assert "printed nothing for 3 s" in run.summary()
    assert "never printed" not in run.logs(0)
    assert descendants_gone(run)


def test_a_run_directory_deleted_while_the_ranks_write(ip: InteractiveShell, runs: Path) -> None:
    cell = (
        "import time\n"
        "for step in range(40):\n"
        "    jd.log(step, loss=1.0 / (step + 1))\n"
        "    print('step', step, flush=True)\n"
        "    time.sleep(0.1)\n"
    )
    run = _start(ip, "--nproc 2", cell)
    wait_until(lambda: "step 3" in run.logs(0), 120, "rank 0 is training")
    shutil.rmtree(run.dir)
    status = run.wait(120)
    assert run.done and status in ("succeeded", "failed")
    assert "the run directory was deleted" in run.summary()
    assert run.records() == [] and run.logs(0, tail=3) == ""
    assert descendants_gone(run)


# ---- a hostile peer on the pool's control port --------------------------------------------------------------------
@pytest.fixture()
def one_rank_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pool]:
    monkeypatch.setattr(pool_mod, "HANDSHAKE_TIMEOUT", 2.0)
    monkeypatch.setattr(pool_mod, "MAX_PENDING_HANDSHAKES", 4)
    p = Pool(nproc=1, runs_dir=tmp_path, strategy="none").start()
    try:
        yield p
    finally:
        p.stop(grace=5.0)
        assert p.run is not None and descendants_gone(p.run, within=15.0)


def _peer(pool: Pool) -> socket.socket:
    host, port = pool.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=15)


def _closed(s: socket.socket) -> bool:
    s.settimeout(15)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_the_pool_survives_a_hostile_peer(one_rank_pool: Pool) -> None:
    pool = one_rank_pool
    me = psutil.Process()
    rss0 = me.memory_info().rss
    # 1. garbage
    with _peer(pool) as s:
        recv_exact(s, NONCE_SIZE)
        s.sendall(os.urandom(4096))
        assert _closed(s)
    # 2. a huge length prefix (2**63): refused before anything is allocated
    with _peer(pool) as s:
        recv_exact(s, NONCE_SIZE)
        s.sendall(struct.pack("!Q", 1 << 63) + b"x" * 64)
        assert _closed(s)
    # 3. slowloris: a valid-looking prefix, then one byte a second; cut at the handshake deadline, not kept forever
    with _peer(pool) as s:
        recv_exact(s, NONCE_SIZE)
        s.sendall(struct.pack("!Q", 200))
        t0 = time.monotonic()
        closed = False
        for _ in range(20):
            try:
                s.sendall(b"a")
            except OSError:
                closed = True
                break
            s.settimeout(1.0)
            try:
                if s.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed = True
                break
        assert closed and time.monotonic() - t0 < 10
    # 4. a replayed frame: a hello signed for one connection's nonce, replayed on another
    with _peer(pool) as a:
        nonce_a = bytes(recv_exact(a, NONCE_SIZE))
        sent: list[bytes] = []

        class _Tap:
            def sendall(self, data: bytes) -> None:
                sent.append(bytes(data))

        Channel(_Tap(), pool._key, nonce_a, kernel_side=False).send({"op": "hello", "rank": 0, "pid": 1})  # type: ignore[arg-type]
        a.sendall(b"".join(sent))
        assert _closed(a)  # signed right, but rank 0 is already connected
        with _peer(pool) as b:
            recv_exact(b, NONCE_SIZE)
            b.sendall(b"".join(sent))  # the same bytes on a connection with another nonce
            assert _closed(b)
    # 5. a flood: more connections than may wait for their hello; the extra ones are closed at once
    flood = [_peer(pool) for _ in range(12)]
    try:
        wait_until(lambda: any("connections waiting for their hello" in r["reason"] for r in pool.refused), 15,
                   "the flood refused")  # fmt: skip
    finally:
        for s in flood:
            s.close()
    wait_until(lambda: pool.refused_total >= 5 + 8, 20, "every hostile connection refused")
    reasons = " | ".join(r["reason"] for r in pool.refused)
    assert "frame of" in reasons  # garbage and the huge prefix
    assert "frame of 9223372036854775808 bytes refused" in reasons
    assert "no complete hello within 2 s" in reasons  # slowloris
    assert "rank 0 is already connected" in reasons and "bad signature" in reasons  # the replay
    log = (pool.dir / "logs" / "pool.log").read_text()
    assert log.count("refused a connection") >= 5
    # still usable, and no memory was spent on the attack
    assert pool.execute("print(6 * 7)").stdout(0) == "42\n" and pool.state == "ready"
    assert me.memory_info().rss - rss0 < 64 << 20
