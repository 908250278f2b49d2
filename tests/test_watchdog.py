"""Every failure is named, none is silent (issue 29), on real torchrun processes (CPU/gloo).

A rank killed by SIGKILL (what the kernel's out-of-memory killer sends) is named first, with the signal and its peak
RSS, not the peer that lost its connection; a deadlock before the first ``jd.log`` is found by the watchdog and
stopped under ``--hang-timeout``; with the default limits a deadlock after a few steps is reported ``hung`` long
before gloo's own timeout; a stopped run says where each rank was.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import descendants_gone, wait_until

from jupyter_dist.launch.run import Run
from jupyter_dist.launch.session import start_run

pytestmark = pytest.mark.slow
pytest.importorskip("torch")

SIGKILL_CELL = """
import os, signal, time
import torch, torch.distributed as dist
jd.init()
if jd.rank == 1:
    hog = bytearray(300 * 1024 * 1024)  # touched: resident
    for i in range(0, len(hog), 4096):
        hog[i] = 1
    time.sleep(3.0)  # a mem record (every heartbeat) sees the peak
    print("rank 1 dies now", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
t = torch.ones(4)
dist.all_reduce(t)  # rank 0 waits here for the rank that dies
"""


def _start(code: str, runs: Path, **kw: object) -> Run:
    run = start_run(code, nproc=2, strategy="none", runs_dir=runs, output="none", **kw)  # type: ignore[arg-type]
    assert isinstance(run, Run)
    return run


def test_a_rank_killed_by_sigkill_is_named_first_with_the_signal(runs: Path) -> None:
    run = _start(SIGKILL_CELL, runs, timeout=120, worker={"heartbeat_s": 0.5})
    assert run.wait(150) == "failed", run.summary()
    assert run.failed_rank() == 1, run.summary()
    assert run.exit_codes[1] == -9, run.exit_codes
    summary = run.summary()
    assert "rank 1 was killed by SIGKILL" in summary and "out-of-memory killer" in summary, summary
    assert "rank 1 failed first" in summary and "rank 0 failed first" not in summary, summary
    peak = run._meta["killed"]["peak_rss"]
    assert peak >= 300 * 1024 * 1024, run._meta["killed"]
    assert f"its peak RSS was {peak / 2**20:.0f} MiB" in summary, summary
    diag = run.diagnosis()
    assert diag is not None and diag.first_rank == 1 and diag.basis == "signal", diag.summary()
    assert diag.summary().startswith("Rank 1 failed first: killed by SIGKILL"), diag.summary()
    assert descendants_gone(run)


DEADLOCK_CELL = """
import torch, torch.distributed as dist
jd.init()
print("ready", flush=True)
t = torch.ones(4)
if jd.rank == 0:
    dist.all_reduce(t)  # waits for rank 1
else:
    dist.recv(t, src=0)  # waits for a send that never comes
for step in range(3):
    jd.log(step, loss=1.0)
"""


def test_a_deadlock_before_the_first_log_is_hung_and_stopped_under_hang_timeout(runs: Path) -> None:
    run = _start(DEADLOCK_CELL, runs, hang_timeout=15, timeout=300, worker={"heartbeat_s": 1.0})
    wait_until(lambda: all("ready" in run.logs(r) for r in (0, 1)), 120, "both ranks initialised")
    t0 = time.monotonic()
    assert run.wait(120) == "hung", run.summary()
    assert 14 < time.monotonic() - t0 < 35, time.monotonic() - t0
    diag = json.loads((run.dir / "diagnosis.json").read_text())
    assert diag["kind"] == "hang" and diag["phases"] == {"0": "setup", "1": "setup"}, diag
    assert diag["last_step"] is None and diag["limits"] == {"0": 15.0, "1": 15.0}, diag
    assert diag["where"]["0"].endswith("dist.all_reduce(t)  # waits for rank 1"), diag["where"]
    assert diag["where"]["1"].endswith("dist.recv(t, src=0)  # waits for a send that never comes"), diag["where"]
    summary = run.summary()
    assert "hung: no progress for" in summary, summary
    assert "rank 0 was in phase setup for" in summary and "(limit 15 s), at script.py:" in summary, summary
    assert "rank 1 was in phase setup for" in summary and "dist.recv(t, src=0)" in summary, summary
    assert run.diagnosis().summary().startswith("Hung: no progress for"), run.diagnosis().summary()
    assert descendants_gone(run)


AFTER_STEPS_CELL = """
import time, torch, torch.distributed as dist
jd.init()
t = torch.ones(4)
for step in range(4):
    dist.all_reduce(t)
    jd.log(step, loss=1.0)
    time.sleep(0.05)
print("step 3 done", flush=True)
if jd.rank == 0:
    dist.all_reduce(t)  # rank 1 never comes
else:
    time.sleep(900)  # longer than gloo's timeout
"""


def test_with_default_limits_a_deadlock_after_step_3_is_reported_hung_not_killed(
    runs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JD_WATCHDOG", "step_floor_s=5")  # the floor of a step phase (default 120 s)
    run = _start(AFTER_STEPS_CELL, runs, timeout=300, worker={"heartbeat_s": 0.5, "telemetry_interval_s": 0.2})
    wait_until(lambda: all("step 3 done" in run.logs(r) for r in (0, 1)), 120, "both ranks logged 4 steps")
    t0 = time.monotonic()
    wait_until(lambda: run.status == "hung", 40, "the run reported hung")
    assert 4 < time.monotonic() - t0 < 20, time.monotonic() - t0
    assert not run.done  # reported, not stopped: the default never kills
    d = run._meta["diagnosis"]
    assert d["limits"] == {0: 5.0, 1: 5.0} and 0 < d["median_step_s"] < 0.25, d
    assert d["last_step"] == 3 and d["phases"] == {0: "forward", 1: "forward"}, d
    summary = run.summary()
    assert "hung: no step for" in summary and "(reported, not stopped" in summary, summary
    assert "rank 0 was in phase forward for" in summary and "dist.all_reduce(t)  # rank 1 never comes" in summary
    assert "rank 1 was in phase forward for" in summary and "time.sleep(900)" in summary, summary
    assert run.stop(grace=2.0) == "stopped"
    summary = run.summary()
    assert "when stopped, rank 0 was in phase forward for" in summary, summary
    assert "dist.all_reduce(t)  # rank 1 never comes" in summary.split("when stopped, rank 0")[1], summary
    assert "when stopped, rank 1 was in phase forward" in summary and "time.sleep(900)" in summary, summary
    assert descendants_gone(run)


STOP_CELL = """
import time
jd.init()
print("looping", flush=True)
while True:
    time.sleep(0.05)  # the rank's loop
"""


def test_a_stopped_run_says_where_each_rank_was(runs: Path) -> None:
    run = _start(STOP_CELL, runs, timeout=300, worker={"heartbeat_s": 0.5})
    wait_until(lambda: all("looping" in run.logs(r) for r in (0, 1)), 120, "both ranks looping")
    time.sleep(1.0)  # a heartbeat after the print
    assert run.stop(grace=2.0) == "stopped"
    summary = run.summary()
    for r in (0, 1):
        assert f"when stopped, rank {r} was in phase setup for" in summary, summary
    assert summary.count("time.sleep(0.05)  # the rank's loop") == 2, summary
    stopped_at = json.loads((run.dir / "run.json").read_text())["stopped_at"]
    assert stopped_at["1"]["phase"] == "setup" and stopped_at["1"]["where"].startswith("script.py:"), stopped_at
    assert descendants_gone(run)
