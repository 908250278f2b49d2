"""Communication health during a run: straggler scores, hang detection with the rank that is behind, and failures
explained -- pure judgements, then real 2-rank gloo scenarios, each bounded to seconds."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import descendants_gone

from jupyter_dist.telemetry.health import MIN_STRAGGLER_LAG_S, HealthTracker, hang_report, straggler_scores


# --------------------------------------------------------------------------- pure
def test_the_rank_that_waits_least_is_the_straggler() -> None:
    # 10 s windows: ranks 0, 2, 3 wait ~6 s in collectives, rank 1 only 1 s -> it computes 9 s against 4 s
    got = straggler_scores({0: (6.0, 10.0), 1: (1.0, 10.0), 2: (6.2, 10.0), 3: (5.9, 10.0)})
    assert got["straggler"] == 1 and got["slowdown"] == pytest.approx(9.0 / 3.8 - 1)
    assert got["scores"][2] == 1.0 and got["scores"][1] == pytest.approx(3.8 / 9.0)
    even = straggler_scores({0: (2.0, 10.0), 1: (2.5, 10.0)})
    assert even["straggler"] is None and min(even["scores"].values()) > 0.9
    assert straggler_scores({0: (1.0, 10.0)})["straggler"] is None


def test_hang_names_the_rank_behind_or_suspects_the_fabric() -> None:
    hb = {r: {"t": 99.0, "phase": p} for r, p in ((0, "backward"), (1, "forward"), (2, "backward"))}
    steps = {0: 50.0, 1: 50.0, 2: 50.0}
    rep = hang_report(now=100.0, last_step_t=steps, last_hb=hb, issued={0: 41, 1: 40, 2: 41}, timeout=30.0)
    assert rep is not None and rep["culprit"] == 1 and rep["stalled_s"] == 50.0
    assert "issued 40 collectives, the others 41" in rep["reason"] and "(phase forward)" in rep["reason"]
    fabric = hang_report(now=100.0, last_step_t=steps, last_hb=hb, issued={0: 41, 1: 41, 2: 41}, timeout=30.0)
    assert fabric is not None and fabric["culprit"] is None and "fabric" in fabric["reason"]
    assert hang_report(now=70.0, last_step_t=steps, last_hb=hb, issued={}, timeout=30.0) is None
    assert hang_report(now=100.0, last_step_t={}, last_hb=hb, issued={}, timeout=30.0) is None


def test_tracker_takes_records_in_any_order_and_an_exit_is_not_a_hang() -> None:
    tr = HealthTracker()
    tr.ingest([{"kind": "comm", "rank": 1, "t": 5.0, "seconds": 0.1, "window_s": 1.0, "issued": 7},
               {"kind": "comm", "rank": 1, "t": 4.0, "seconds": 0.1, "window_s": 1.0, "issued": 6},
               {"kind": "step", "rank": 0, "t": 3.0, "step": 1}, {"kind": "start", "rank": 0, "t": 1.0, "pid": 42},
               {"kind": "hb", "rank": 0, "t": 9.0, "phase": "forward"}, {"kind": "bogus"}])  # fmt: skip
    assert tr.issued == {1: 7} and tr.pids == {0: 42} and tr.last_step_t == {0: 3.0}
    assert tr.hang(100.0, 10.0) is not None
    tr.ingest([{"kind": "exit", "rank": 0, "t": 99.0, "status": "error"}])
    assert tr.hang(100.0, 10.0) is None


@pytest.mark.parametrize(("lag", "named"), [(0.0007, None), (0.04, 0)])
def test_a_busy_time_straggler_needs_the_arrival_order_to_agree(lag: float, named: Any) -> None:
    """Rank 0 looks 1.7x busier over its windows; it is named only when it also reaches collectives later."""
    tr = HealthTracker()
    recs = []
    for k in range(5):  # rank 0 waits 0.3 s of each 1 s window, rank 1 0.6 s: busy 0.7 vs 0.4
        recs.append({"kind": "comm", "rank": 0, "t": 10.0 + k, "seconds": 0.3, "window_s": 1.0, "issued": 10 * k,
                     "recent": [[10 * k + j, 10.0 + k + 0.01 * j + lag] for j in range(10)]})
        recs.append({"kind": "comm", "rank": 1, "t": 10.0 + k, "seconds": 0.6, "window_s": 1.0, "issued": 10 * k,
                     "recent": [[10 * k + j, 10.0 + k + 0.01 * j] for j in range(10)]})
    tr.ingest(recs)
    st = tr.straggler()
    assert st["scores"][0] < 0.75 and st["arrival_lag_s"][0] == pytest.approx(lag, abs=1e-5)
    assert st["straggler"] == named
    assert st.get("unconfirmed") == (0 if named is None else None)


# --------------------------------------------------------------------------- real runs
STRAGGLER = """
import time
import torch
model = torch.nn.Linear(32, 32)
model, opt = jd.wrap(model, torch.optim.SGD(model.parameters(), lr=0.01))
for step in range(80):
    loss = model(torch.randn(16, 32)).pow(2).mean()
    if jd.rank == 1:
        time.sleep(0.06)  # the straggler: 60 ms more work per step
    jd.backward(loss)
    jd.step(opt)
    jd.log(step, loss=loss)
"""


@pytest.mark.slow
@pytest.mark.parametrize("slow_rank", [1, None], ids=["rank1-sleeps", "healthy"])
def test_an_injected_sleep_is_named_as_the_straggler_with_its_slowdown(ip: Any, runs: Path, slow_rank: Any) -> None:
    from jupyter_dist.ui.dashboard import Dashboard

    code = STRAGGLER.replace("jd.rank == 1", f"jd.rank == {slow_rank}")
    run = ip.run_cell_magic("dist_train", "--nproc 2 --strategy ddp --heartbeat 0.5 --no-dashboard --timeout 120",
                            code)  # fmt: skip
    assert run.wait(150) == "succeeded", run.summary()
    dash = Dashboard(run, widget=False)
    st = dash.model.status()["straggler"]
    if slow_rank is None:  # same work on both ranks: nobody is named, and both reach each collective together
        assert st["straggler"] is None and max(st["arrival_lag_s"].values()) < MIN_STRAGGLER_LAG_S, st
        # busy time alone is scheduling noise on a loaded machine (a fresh-clone run saw 1.0 against 0.57 here): a
        # gap is reported as unconfirmed, never as a straggler
        low = min(st["scores"], key=st["scores"].get)
        assert st.get("unconfirmed") == (low if st["scores"][low] < 0.75 else None), st
        assert "straggler" not in dash.model.status_html()
        return
    assert st["straggler"] == 1, st
    assert st["slowdown"] > 0.5, st  # rank 1 computes at least 1.5x as long as rank 0
    lags = st["arrival_lag_s"]  # arrival order: rank 1 issues each gradient all-reduce ~60 ms after rank 0
    assert lags[1] > 0.03 and lags[0] < 0.01, lags
    assert "straggler: rank 1" in dash.model.status_html() and "ms late at collectives" in dash.model.status_html()


HANG = """
import time
import torch
import torch.distributed as dist
jd.init()
for step in range(2000):
    if jd.rank == 1 and step == 30:
        time.sleep(600)  # stuck before the collective the other rank enters
    t = torch.ones(4)
    dist.all_reduce(t)
    jd.log(step, loss=1.0 / (step + 1))
    time.sleep(0.01)
"""


@pytest.mark.slow
def test_a_rank_stuck_before_a_collective_is_named_and_the_run_stopped(ip: Any, runs: Path) -> None:
    t0 = time.monotonic()
    run = ip.run_cell_magic("dist_train", "--nproc 2 --strategy none --heartbeat 0.3 --telemetry-interval 0.2 "
                            "--hang-timeout 4 --no-dashboard --timeout 120", HANG)  # fmt: skip
    assert run.wait(150) == "hung", run.summary()
    assert time.monotonic() - t0 < 60
    diag = json.loads((run.dir / "diagnosis.json").read_text())
    assert diag["kind"] == "hang" and diag["culprit"] == 1, diag
    assert diag["issued"]["0"] > diag["issued"]["1"] and diag["phases"]["1"] == "forward"
    # every rank's stacks, and the cell line each main thread was on
    assert "Current thread" in diag["stacks"]["1"] and "Current thread" in diag["stacks"]["0"]
    assert diag["where"]["1"].endswith("time.sleep(600)  # stuck before the collective the other rank enters")
    assert diag["where"]["0"].endswith("dist.all_reduce(t)") and "_comm.py" in diag["stacks"]["0"]
    assert "rank 1 was in phase forward for" in run.summary() and "(limit 4 s), at script.py:" in run.summary()
    assert "hung: no step for" in run.summary() and run.diagnosis().hang["culprit"] == 1
    assert run.diagnosis().first_rank == 1 and run.diagnosis().summary().startswith("Hung: no step for")
    assert descendants_gone(run)


@pytest.mark.slow
def test_the_rank_that_dies_is_named_first(ip: Any, runs: Path) -> None:
    code = ("import time, torch, torch.distributed as dist\njd.init()\n"
            "if jd.rank == 1:\n    time.sleep(0.5)\n    raise MemoryError('batch too large for host memory')\n"
            "t = torch.ones(4)\ndist.all_reduce(t)\n")  # fmt: skip
    run = ip.run_cell_magic("dist_train", "--nproc 2 --strategy none --no-dashboard --timeout 60", code)
    assert run.wait(90) == "failed"
    diag = run.diagnosis()
    assert diag.first_rank == 1, diag.summary()
    assert diag.summary().startswith("Rank 1 failed first: MemoryError") and "peer closed" in diag.summary()
    assert "diagnosis: Rank 1 failed first" in run.summary()


@pytest.mark.slow
def test_mismatched_collectives_are_reported_as_desync(ip: Any, runs: Path) -> None:
    code = ("import torch, torch.distributed as dist\njd.init()\nt = torch.ones(4)\n"
            "if jd.rank == 0:\n    dist.all_reduce(t)\nelse:\n    dist.broadcast(t, 0)\n")  # fmt: skip
    run = ip.run_cell_magic("dist_train", "--nproc 2 --strategy none --no-dashboard --timeout 60 "
                            "--env TORCH_DISTRIBUTED_DEBUG=DETAIL", code)  # fmt: skip
    assert run.wait(90) == "failed", run.summary()
    kinds = {f.kind for f in run.diagnosis().findings}
    assert kinds & {"collective_mismatch", "desync"}, (kinds, run.logs(0)[-2000:])


def test_watchdog_limits_scale_with_the_step_and_parse_from_the_environment() -> None:
    from jupyter_dist.telemetry.health import WatchdogLimits

    d = WatchdogLimits()
    assert d.limit("forward", None) == 120.0 and d.limit("backward", 10.0) == 200.0  # 20 x median past the floor
    assert (d.limit("setup", 1.0), d.limit("resume", 1.0), d.limit("checkpoint", 1.0)) == (300.0, 300.0, 600.0)
    assert d.limit("launching", None) == 600.0 and d.limit("eval", None) == 600.0
    e = WatchdogLimits.from_env({"JD_WATCHDOG": "step_floor_s=5, setup_s=30"}, explicit=15.0)
    assert e.step_floor_s == 5.0 and e.setup_s == 30.0
    assert e.limit("forward", 100.0) == 15.0 and e.limit("setup", None) == 15.0 and e.limit("launching", None) == 60.0
    assert WatchdogLimits.from_env({"JD_WATCHDOG": "step_floor_s=5"}).limit("forward", 0.05) == 5.0
    with pytest.raises(ValueError, match="'floor=5' is not name=seconds; valid names: launch_s, setup_s"):
        WatchdogLimits.from_env({"JD_WATCHDOG": "floor=5"})
    with pytest.raises(ValueError, match="watchdog setup_s=-1.0 must be a finite number of seconds > 0"):
        WatchdogLimits.from_env({"JD_WATCHDOG": "setup_s=-1"})


def test_the_watchdog_needs_every_rank_stuck_past_its_phase_limit() -> None:
    from jupyter_dist.telemetry.health import HealthTracker, WatchdogLimits

    limits = WatchdogLimits(step_floor_s=5.0)
    tr = HealthTracker()
    assert tr.stall(1000.0, limits, world_size=2, started=0.0) is None  # nobody reported: not judged by default
    assert tr.stall(1000.0, WatchdogLimits(explicit=15.0), world_size=2, started=0.0)["phases"] == {
        0: "launching", 1: "launching"}  # fmt: skip
    for step in range(4):  # 0.1 s per step
        tr.ingest([{"kind": "step", "rank": r, "t": 100.0 + 0.1 * step, "step": step} for r in (0, 1)])
    assert tr.median_step_s() == pytest.approx(0.1)
    tr.ingest([{"kind": "hb", "rank": 0, "t": 104.0, "phase": "forward", "phase_s": 3.8, "step": 3},
               {"kind": "hb", "rank": 1, "t": 104.0, "phase": "backward", "phase_s": 0.5, "step": 3}])  # fmt: skip
    assert tr.stall(105.4, limits, world_size=2, started=90.0) is None  # rank 1 moved 1.9 s ago
    rep = tr.stall(109.0, limits, world_size=2, started=90.0)
    assert rep is not None and rep["phases"] == {0: "forward", 1: "backward"} and rep["last_step"] == 3, rep
    assert rep["limits"] == {0: 5.0, 1: 5.0} and rep["stalled"] == {0: 8.7, 1: 5.5} and rep["stalled_s"] == 5.5
    tr.ingest([{"kind": "exit", "rank": 1, "t": 109.5, "status": "error"}])
    assert tr.stall(200.0, limits, world_size=2, started=90.0) is None  # a rank that exited is not a hang
