"""Runs an earlier kernel left running are visible (issue 29): ``%load_ext jupyter_dist`` and ``%dist_runs`` list them
with the commands to attach or stop them."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from jupyter_dist.launch.runs import Orphan, orphans, orphans_notice

REPO = Path(__file__).resolve().parents[1]


def _fake_run(runs: Path, name: str, *, status: str = "running", kernel: dict[str, object] | None = None) -> Path:
    path = runs / name
    (path / "logs").mkdir(parents=True)
    record = {"name": name, "status": status, "backend": "local", "world_size": 2, "nproc": 2, "nodes": 1,
              "pids": [os.getpid()], "started": psutil.Process().create_time() + 1, "created": time.time() - 126,
              "launcher": {"kind": "local"}, **({"kernel": kernel} if kernel is not None else {})}  # fmt: skip
    (path / "run.json").write_text(json.dumps(record))
    return path


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_which_runs_are_orphans(tmp_path: Path) -> None:
    """Alive processes + a running record + another kernel + this host: listed; anything else: not."""
    runs = tmp_path / "runs"
    host = socket.gethostname()
    gone = _fake_run(runs, "a-gone", kernel={"pid": _dead_pid(), "host": host})
    _fake_run(runs, "b-mine", kernel={"pid": os.getpid(), "host": host})  # this kernel's own run
    _fake_run(runs, "c-elsewhere", kernel={"pid": 1, "host": host + "-other"})  # a shared folder, another machine
    _fake_run(runs, "d-done", status="succeeded", kernel={"pid": _dead_pid(), "host": host})
    old = _fake_run(runs, "e-old")  # recorded before kernels were
    found = orphans(runs)
    assert [Path(o.path).name for o in found] == ["e-old", "a-gone"]
    assert not any(o.kernel_alive for o in found)
    text = orphans_notice(found, now=found[0].started + 125)  # type: ignore[operator]
    assert text.splitlines() == [
        "jupyter-dist: 2 runs started by earlier kernels are still running on this machine:",
        f"  {old.resolve()} (2 ranks, running 2 min 5 s; its kernel is gone): watch it with %dist_attach "
        f"{old.resolve()}, then stop it with %dist_stop",
        f"  {gone.resolve()} (2 ranks, running 2 min 5 s; its kernel is gone): watch it with %dist_attach "
        f"{gone.resolve()}, then stop it with %dist_stop",
    ]
    alive = Orphan(path="/r", world_size=4, started=None, kernel_pid=42, kernel_alive=True)
    assert orphans_notice([alive]).splitlines()[1] == ("  /r (4 ranks; its kernel (pid 42) still runs): watch it with "
                                                       "%dist_attach /r, then stop it with %dist_stop")  # fmt: skip
    assert orphans_notice([]) == "" and orphans(tmp_path / "nope") == []


KERNEL = textwrap.dedent("""
    import os, signal, sys, time
    from jupyter_dist.launch.session import start_run
    code = "import time\\nfor step in range(100000):\\n    jd.log(step, loss=1.0)\\n    time.sleep(0.05)\\n"
    run = start_run(code, nproc=2, runs_dir=sys.argv[1], name="orphan", output="none")
    deadline = time.time() + 120
    while not run.records("step") and time.time() < deadline and not run.done:
        time.sleep(0.2)
    print(run.dir, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the kernel dies: nobody watches the ranks any more
""")


def _processes_of(run_dir: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid", "environ"]):
        try:
            if (proc.info["environ"] or {}).get("JD_RUN_DIR") == str(run_dir) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _load_ext_in_a_new_kernel(cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "IPython", "--no-banner", "--quick", "-c", "%load_ext jupyter_dist"],
                          capture_output=True, text=True, timeout=120, cwd=cwd)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
def test_a_run_left_by_a_killed_kernel_is_listed_then_attached_and_stopped(
    tmp_path: Path, ip: object, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    (tmp_path / "kernel.py").write_text(KERNEL)
    out = subprocess.run([sys.executable, str(tmp_path / "kernel.py"), str(runs)], capture_output=True, text=True,
                         timeout=180, cwd=REPO)  # fmt: skip
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    run_dir = Path(out.stdout.strip().splitlines()[-1])
    try:
        assert len(_processes_of(run_dir)) >= 3  # the torchrun agent and its 2 ranks outlive the kernel
        # a new kernel: %load_ext says so (the default runs folder is ./runs)
        said = _load_ext_in_a_new_kernel(tmp_path).strip().splitlines()
        assert said[0] == "jupyter-dist: 1 run started by an earlier kernel is still running on this machine:"
        assert re.fullmatch(rf"  {re.escape(str(run_dir))} \(2 ranks, running [^;]+; its kernel is gone\): watch it "
                            rf"with %dist_attach {re.escape(str(run_dir))}, then stop it with %dist_stop",
                            said[1]), said  # fmt: skip
        # %dist_runs says it too, above the table
        capsys.readouterr()
        table = ip.run_line_magic("dist_runs", f"{runs} --table")  # type: ignore[attr-defined]
        assert table.row(run_dir.name).status == "running"
        assert capsys.readouterr().out.splitlines()[0].startswith("jupyter-dist: 1 run started by an earlier kernel")
        # the commands it gives work: attach, then stop
        run = ip.run_line_magic("dist_attach", str(run_dir))  # type: ignore[attr-defined]
        ip.run_line_magic("dist_stop", "")  # type: ignore[attr-defined]
        deadline = time.time() + 30
        while _processes_of(run_dir) and time.time() < deadline:
            time.sleep(0.2)
        assert not _processes_of(run_dir) and run.done
        assert orphans(runs) == [] and _load_ext_in_a_new_kernel(tmp_path).strip() == ""
    finally:
        for proc in _processes_of(run_dir):
            proc.kill()
