"""How ``-n N`` (scripts/test.sh) shares the suite between xdist workers: a worker takes a whole file, the longest
first, and takes its next file only when it has nothing left to run.

- A whole file, so a module fixture (a real run that several tests read) starts once; the files that share the
  session's SLURM cluster (:data:`CLUSTER_FILES`) go to one worker together. (xdist's ``--dist loadgroup`` does not
  group under pytest 9, whose node ids ignore the suffix it appends.)
- The longest first (``tests/durations.json``, seconds per file, written by ``scripts/durations.py`` from a
  ``--durations=0`` run): xdist's own order is by the number of tests in a file, which sends a 500-test planner file
  first and a 10-test notebook file of 15 minutes last, where one worker then runs it alone.
- No file is handed to a worker while it still has two tests to run (xdist's rule): a worker running a file's long
  last tests would hold the next file while the other worker idles.
- With more than two workers (``JD_TEST_WORKERS=3``; ``scripts/test.sh`` starts two, measured faster on two cores),
  the cluster files are one worker's only work and the others share every other file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CLUSTER_FILES = frozenset({"test_notebook_folder.py", "test_run_record.py", "test_ship_cluster.py", "test_skypilot.py",
                           "test_slurm.py", "test_wizard.py"})
"""Files whose tests use the session's one SLURM cluster (its daemons, ports and state): one xdist worker runs them."""

DURATIONS = Path(__file__).with_name("durations.json")
NEW_FILE_S = 120.0
"""A file not in the table yet is taken as this long: new files are most often new real-process tests."""


def file_seconds() -> dict[str, float]:
    """Seconds per test file from the last full run (``{}`` when the table is missing or unreadable)."""
    try:
        table = json.loads(DURATIONS.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in table.items()} if isinstance(table, dict) else {}


def scope_of(nodeid: str) -> str:
    """The unit one worker runs whole: the test's file, or ``"cluster"`` for the files sharing the SLURM cluster."""
    name = Path(nodeid.split("::", 1)[0]).name
    return "cluster" if name in CLUSTER_FILES else nodeid.split("::", 1)[0]


def estimate(scope: str, seconds: dict[str, float]) -> float:
    """Expected seconds of a unit: its files' total in the table (a new file: :data:`NEW_FILE_S`)."""
    files = CLUSTER_FILES if scope == "cluster" else {Path(scope).name}
    return sum(seconds.get(f, NEW_FILE_S) for f in files)


def make_scheduler(config: Any, log: Any) -> Any:
    """The xdist scheduler described in the module docstring."""
    from xdist.scheduler import LoadScopeScheduling

    seconds = file_seconds()

    class FileScheduling(LoadScopeScheduling):  # type: ignore[misc]
        cluster_node: Any = None
        """With more than two workers: the one that runs the cluster files and nothing else."""

        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

        def _open_units(self) -> list[str]:
            """The queued units any worker may take (the cluster unit is its own worker's once that is chosen)."""
            return [s for s in self.workqueue if s != "cluster" or self.cluster_node is None]

        def _assign_work_unit(self, node: Any) -> None:
            if len(self.nodes) > 2 and self.cluster_node is None and "cluster" in self.workqueue:
                self.cluster_node = node
                pick = "cluster"
            else:
                others = self._open_units()
                if not others:
                    return
                pick = max(others, key=lambda s: estimate(s, seconds))
            self.workqueue.move_to_end(pick, last=False)  # the base class hands out the first unit
            super()._assign_work_unit(node)

        def remove_node(self, node: Any) -> Any:
            if node is self.cluster_node:  # crashed or done: a crashed one's tests go to whichever worker asks
                self.cluster_node = None
            return super().remove_node(node)

        def _reschedule(self, node: Any) -> None:
            if node.shutting_down:
                return
            if node is self.cluster_node:  # its one unit: told to stop once it holds its last test (a worker runs
                if self._pending_of(self.assigned_work[node]) <= 1:  # that one only when more comes or it must stop)
                    node.shutdown()
                return
            if not self._open_units():
                node.shutdown()
                return
            if self._pending_of(self.assigned_work[node]) > 1:  # one left: the worker holds it until the next arrives
                return
            self._assign_work_unit(node)

    return FileScheduling(config, log)
