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


AUTO_CELL = """
import json, os
try:
    BIG
    big = "shipped"
except NameError:
    big = "not shipped"
out = {"scaled": scale(3), "cfg": CONFIG["lr"], "obj": Point(1, 2).total(), "big": big}
with open(os.path.join(os.environ["JD_RUN_DIR"], f"auto-{jd.rank}.json"), "w") as f:
    json.dump(out, f)
"""


def test_the_kernels_functions_classes_and_small_values_ship_and_a_big_one_gets_a_hint(
    ip: Any, runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No --ship: a function, a class and a small dict the cell uses are sent; a 16 MiB array is not, and the cell's
    first line says how (the rank sees a NameError, which the cell catches here)."""
    import numpy as np

    ip.run_cell("def scale(x):\n    return 10 * x\n\nclass Point:\n    def __init__(self, x, y):\n"
                "        self.x, self.y = x, y\n    def total(self):\n        return self.x + self.y\n")  # fmt: skip
    ip.user_ns["CONFIG"] = {"lr": 3e-4}
    ip.user_ns["BIG"] = np.zeros((2048, 1024))
    run = ip.run_cell_magic("dist_train", "--nproc 2 --strategy none --name auto_run --output none --no-dashboard",
                            AUTO_CELL)  # fmt: skip
    line = capsys.readouterr().out
    assert "shipped from the kernel: scale, CONFIG, Point" in line
    assert "BIG is defined in the kernel (16.0 MiB pickled); add --ship BIG to send it" in line
    assert run.wait(120) == "succeeded", run.logs()
    for rank in (0, 1):
        got = json.loads((run.dir / f"auto-{rank}.json").read_text())
        assert got == {"scaled": 30, "cfg": 3e-4, "obj": 3, "big": "not shipped"}
    run2 = ip.run_cell_magic("dist_train", "--nproc 2 --strategy none --name auto_run2 --output none --no-dashboard "
                             "--ship BIG", AUTO_CELL)  # fmt: skip
    assert run2.wait(120) == "succeeded", run2.logs()
    assert json.loads((run2.dir / "auto-0.json").read_text())["big"] == "shipped"


def test_free_names_are_what_the_cell_reads_and_never_binds() -> None:
    from jupyter_dist.launch.autoship import free_names

    code = ("import torch as T\nfrom x import y\ndef f(a, *b, c=1, **d):\n    return a + g + T.x + y\n"
            "class K(Base):\n    z = w\nfor i in range(n):\n    q = [j for j in items]\n"
            "print(jd.rank, lam(lambda u: u))")
    assert free_names(code) == ["g", "Base", "w", "n", "items", "lam"]
    assert free_names("def (") == []
