"""The suite's xdist scheduler (tests/scheduling.py) driven with fake workers: whole files, the longest first, the
next file only to a worker that has nothing left to run; and scripts/durations.py's table and simulation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import scheduling

ROOT = Path(__file__).resolve().parents[1]


class FakeNode:
    """The part of xdist's WorkerController the scheduler calls: what it was sent, in order."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[list[int]] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent.append(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def _scheduler(monkeypatch: pytest.MonkeyPatch, seconds: dict[str, float], collection: list[str],
               workers: int = 2) -> Any:  # fmt: skip
    monkeypatch.setattr(scheduling, "file_seconds", lambda: seconds)
    config = SimpleNamespace(option=SimpleNamespace(loadscopereorder=True), getvalue=lambda name: None)
    monkeypatch.setattr("xdist.scheduler.loadscope.parse_tx_spec_config", lambda config: ["popen"] * workers)
    sched = scheduling.make_scheduler(config, None)
    nodes = [FakeNode(f"gw{i}") for i in range(workers)]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    return sched, nodes


def test_the_longest_files_go_first_and_the_cluster_files_together(monkeypatch: pytest.MonkeyPatch) -> None:
    # many quick tests in a.py (xdist's own order would send it first), three long ones in b.py
    collection = [*(f"tests/a.py::t{i}" for i in range(6)), *(f"tests/b.py::t{i}" for i in range(3)),
                  "tests/test_slurm.py::t0", "tests/test_wizard.py::t0", "tests/c.py::t0"]  # fmt: skip
    seconds = {"a.py": 10.0, "b.py": 2000.0, "test_slurm.py": 200.0, "test_wizard.py": 300.0, "c.py": 1.0}
    sched, (gw0, gw1) = _scheduler(monkeypatch, seconds, collection)
    assert [collection[i] for i in gw0.sent[0]] == [f"tests/b.py::t{i}" for i in range(3)]
    assert [collection[i] for i in gw1.sent[0]] == ["tests/test_slurm.py::t0", "tests/test_wizard.py::t0"]
    assert list(sched.workqueue) == ["tests/a.py", "tests/c.py"]  # not handed out before a worker needs them

    # gw0 finishes b.py's first test: two are left, it gets nothing yet
    sched.mark_test_complete(gw0, gw0.sent[0][0])
    assert len(gw0.sent) == 1
    # one left, which the worker holds until more arrives: now the next longest file, a.py
    sched.mark_test_complete(gw0, gw0.sent[0][1])
    assert [collection[i] for i in gw0.sent[1]] == [f"tests/a.py::t{i}" for i in range(6)]


def test_a_third_worker_runs_the_cluster_files_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    collection = [*(f"tests/b.py::t{i}" for i in range(2)), "tests/test_slurm.py::t0", "tests/test_wizard.py::t0",
                  *(f"tests/{f}.py::t0" for f in "acdef")]  # fmt: skip
    # the cluster files are not the longest: still one worker's only work
    seconds = {"b.py": 2000.0, "test_slurm.py": 20.0, "test_wizard.py": 30.0, "a.py": 500.0, "c.py": 400.0,
               "d.py": 300.0, "e.py": 200.0, "f.py": 100.0}  # fmt: skip
    sched, (gw0, gw1, gw2) = _scheduler(monkeypatch, seconds, collection, workers=3)
    assert [collection[i] for i in gw0.sent[0]] == ["tests/test_slurm.py::t0", "tests/test_wizard.py::t0"]
    assert [collection[i] for i in gw1.sent[0]] == ["tests/b.py::t0", "tests/b.py::t1"]
    assert [collection[i] for i in gw2.sent[0]] == ["tests/a.py::t0"]
    assert sched.cluster_node is gw0
    # the cluster worker finishes its first test and holds its last one (xdist's worker runs it only when more work
    # or the order to stop arrives): it is told to stop, and gets nothing more, though files are left
    assert not gw0.shutting_down
    sched.mark_test_complete(gw0, gw0.sent[0][0])
    assert len(gw0.sent) == 1 and gw0.shutting_down and "tests/d.py" in sched.workqueue
    # the others share the rest, the longest first
    sched.mark_test_complete(gw2, gw2.sent[0][0])
    assert [collection[i] for i in gw2.sent[1]] == ["tests/c.py::t0"]
    # a crashed cluster worker's files go back to the queue, and to the next worker that asks
    sched2, (hw0, hw1, hw2) = _scheduler(monkeypatch, seconds, collection, workers=3)
    assert sched2.remove_node(hw0) == "tests/test_slurm.py::t0"
    assert sched2.cluster_node is None and "cluster" in sched2.workqueue


def test_a_file_missing_from_the_table_counts_as_a_long_one(monkeypatch: pytest.MonkeyPatch) -> None:
    assert scheduling.estimate("tests/new.py", {}) == scheduling.NEW_FILE_S
    collection = ["tests/old.py::t0", "tests/new.py::t0"]
    _, (gw0, gw1) = _scheduler(monkeypatch, {"old.py": scheduling.NEW_FILE_S / 2}, collection)
    assert [collection[i] for i in gw0.sent[0]] == ["tests/new.py::t0"]


def test_durations_table_from_a_pytest_report_and_the_simulation(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import durations
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    log = ("== slowest durations ==\n12.50s call     tests/test_x.py::test_a[p-1]\n"
           "0.50s setup    tests/test_x.py::test_a[p-1]\n3.00s teardown tests/sub/test_y.py::T::test_b\n")  # fmt: skip
    assert durations.parse(log) == {"test_x.py": 13.0, "test_y.py": 3.0}
    # longest first on two workers: 10 | 6+4 -> 10 s; on one: 20 s
    assert durations.simulate({"p.py": 10.0, "q.py": 6.0, "r.py": 4.0}, 2) == 10.0
    assert durations.simulate({"p.py": 10.0, "q.py": 6.0, "r.py": 4.0}, 1) == 20.0
    # three workers: the SLURM files on their own one (6 s), the rest on two
    table = {"p.py": 10.0, "q.py": 6.0, "r.py": 3.0, **{name: 1.0 for name in scheduling.CLUSTER_FILES}}
    assert durations.simulate(table, 2) == 13.0 and durations.simulate(table, 3) == 10.0


def test_the_committed_table_is_read_and_names_test_files_that_exist() -> None:
    table = json.loads(scheduling.DURATIONS.read_text(encoding="utf-8"))
    assert table and scheduling.file_seconds() == {k: float(v) for k, v in table.items()}
    missing = sorted(name for name in table if not (ROOT / "tests" / name).is_file())
    assert not missing, f"tests/durations.json names deleted files: {missing}; rerun scripts/durations.py"


def test_durations_script_refuses_a_log_without_durations(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("1 passed\n")
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "durations.py"), str(log)], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert res.returncode == 1 and "no durations" in res.stderr
