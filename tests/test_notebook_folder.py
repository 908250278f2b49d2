"""The cell runs where the notebook lives: its folder is the ranks' working directory, its modules import.

A project folder as a researcher has it (``model.py``, ``data/train.csv``, a ``src/`` the kernel put on
``sys.path``); real 2-process torchrun runs started from that folder, as a kernel started in it would.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from jupyter_dist.launch.session import start_run

pytestmark = pytest.mark.slow

CELL = """
import csv, json, os
import model                      # model.py beside the notebook
import helpers                    # src/helpers.py, on the kernel's sys.path

with open("data/train.csv") as f:  # relative to the notebook's folder
    rows = list(csv.reader(f))
out = {"cwd": os.getcwd(), "rows": len(rows), "width": model.WIDTH, "twice": helpers.twice(21),
       "run_dir": os.environ["JD_RUN_DIR"]}
with open(os.path.join(os.environ["JD_RUN_DIR"], f"seen-{jd.rank}.json"), "w") as f:
    json.dump(out, f)
jd.log(0, loss=float(len(rows)))
"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "my-project"
    (root / "data").mkdir(parents=True)
    (root / "src").mkdir()
    (root / "model.py").write_text("WIDTH = 64\n")
    (root / "src" / "helpers.py").write_text("def twice(x):\n    return 2 * x\n")
    (root / "data" / "train.csv").write_text("a,b\n1,2\n3,4\n")
    monkeypatch.chdir(root)
    monkeypatch.syspath_prepend(str(root / "src"))
    for name in ("model", "helpers"):
        sys.modules.pop(name, None)
    return root


def test_a_cell_imports_sibling_modules_and_reads_relative_files(project: Path) -> None:
    run = start_run(CELL, nproc=2, strategy="ddp", runs_dir="runs", name="folder", output="none", timeout=120)
    assert run.wait(150) == "succeeded", run.logs()
    for rank in (0, 1):
        seen = json.loads((run.dir / f"seen-{rank}.json").read_text())
        assert seen == {"cwd": str(project.resolve()), "rows": 3, "width": 64, "twice": 42, "run_dir": str(run.dir)}
    assert run.dir.parent == (project / "runs").resolve()  # jd's own files still go to the run directory
    assert json.loads((run.dir / "run.json").read_text())["launcher"]["cwd"] == str(project.resolve())


def test_a_script_and_its_relative_arguments_behave_as_under_torchrun(project: Path) -> None:
    (project / "train.py").write_text(
        "import argparse, json, os\n"
        "import model\n"
        "p = argparse.ArgumentParser(); p.add_argument('--data'); a = p.parse_args()\n"
        "n = sum(1 for _ in open(a.data))\n"
        "rank = int(os.environ['RANK'])\n"
        "out = os.path.join(os.environ['JD_RUN_DIR'], f'r{rank}.json')\n"
        "json.dump({'lines': n, 'width': model.WIDTH}, open(out, 'w'))\n"
    )
    run = start_run("", nproc=2, strategy="none", runs_dir="runs", name="script", output="none", timeout=120,
                    script="train.py", script_args=("--data", "data/train.csv"))  # fmt: skip
    assert run.wait(150) == "succeeded", run.logs()
    for rank in (0, 1):
        assert json.loads((run.dir / f"r{rank}.json").read_text()) == {"lines": 3, "width": 64}


def test_the_project_paths_are_the_users_folders_only(project: Path) -> None:
    from jupyter_dist.launch.backends.local import project_paths

    paths = project_paths()
    assert str((project / "src").resolve()) in paths
    assert not any("site-packages" in p for p in paths)
    assert os.path.realpath(sys.prefix) not in paths


def test_the_same_cell_on_the_slurm_cluster_needs_no_flag(project: Path, ip: Any, runs: Path,
                                                          slurm_cluster: Any) -> None:  # fmt: skip
    """On SLURM (a shared filesystem, here this machine's) the ranks start in the notebook's folder too."""
    run = ip.run_cell_magic("dist_train", "--backend slurm --nodes 1 --nproc 2 --strategy ddp --partition debug "
                            "--time 00:05:00 --name slurm_folder --output none", CELL)  # fmt: skip
    assert run.wait(240) == "succeeded", run.summary() + run.logs()
    for rank in (0, 1):
        seen = json.loads((run.dir / f"seen-{rank}.json").read_text())
        assert (seen["cwd"], seen["rows"], seen["width"], seen["twice"]) == (str(project.resolve()), 3, 64, 42)
