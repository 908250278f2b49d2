"""The example notebooks in notebooks/: saved without outputs, the quickstart equal to what `jupyter-dist demo`
generates, and every notebook executed on a real kernel with nbclient (each by exactly one test: the ones here, the
quickstart by test_demo.py, the pool and cluster notebooks by the tests of their back-ends)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
TESTS = Path(__file__).resolve().parent
EXECUTED_HERE = ("plan_large_models.ipynb", "communication_health.ipynb", "strategies_memory.ipynb",
                 "tensor_parallel.ipynb", "parallelism_3d.ipynb", "compare_and_profile.ipynb")  # fmt: skip
EXECUTED_ELSEWHERE = {"quickstart.ipynb": "test_demo.py", "pool_quickstart.ipynb": "test_pool.py",
                      "cluster_slurm.ipynb": "test_slurm.py", "cluster_skypilot.ipynb": "test_skypilot.py"}  # fmt: skip


def all_notebooks() -> list[Path]:
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def test_every_notebook_is_executed_by_a_test() -> None:
    for nb in all_notebooks():
        if nb.name in EXECUTED_HERE:
            continue
        owner = EXECUTED_ELSEWHERE.get(nb.name)
        assert owner, f"{nb.name} is executed by no test: add it to EXECUTED_HERE or EXECUTED_ELSEWHERE"
        assert (TESTS / owner).exists() and nb.name in (TESTS / owner).read_text(), f"{owner} does not run {nb.name}"


@pytest.mark.parametrize("path", all_notebooks(), ids=lambda p: p.name)
def test_notebooks_are_saved_without_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name}: clear outputs before saving"
    assert "widgets" not in nb.metadata, f"{path.name}: saved widget state"
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"


def test_the_quickstart_is_what_the_demo_runs() -> None:
    from jupyter_dist.demo import quickstart_notebook

    saved = nbformat.read(NOTEBOOKS / "quickstart.ipynb", as_version=4)
    fresh = quickstart_notebook()
    assert [(c.cell_type, c.source) for c in saved.cells] == [(c.cell_type, c.source) for c in fresh.cells], (
        "notebooks/quickstart.ipynb differs from jupyter_dist.demo.quickstart_notebook(); regenerate it with "
        "python -c \"import nbformat; from jupyter_dist.demo import quickstart_notebook; "
        "nbformat.write(quickstart_notebook(), 'notebooks/quickstart.ipynb')\""
    )


def execute(path: Path, workdir: Path, timeout: int = 600) -> object:
    """Run every cell on a fresh python3 kernel (this interpreter) with ``workdir`` as the working directory."""
    nb = nbformat.read(path, as_version=4)
    env_python = os.path.dirname(sys.executable)
    os.environ["PATH"] = env_python + os.pathsep + os.environ.get("PATH", "")
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=timeout, store_widget_state=True,
                                     resources={"metadata": {"path": str(workdir)}})  # fmt: skip
    client.execute()
    return nb


def outputs_text(nb: object) -> str:
    parts = []
    for cell in nb.cells:  # type: ignore[attr-defined]
        for out in cell.get("outputs", []):
            assert out.get("output_type") != "error", "".join(out.get("traceback", []))
            parts.append(out.get("text", "") or str(out.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


# ---- each notebook once, all in one folder, then all again in the reverse order ----------------------------------
# A researcher keeps the example notebooks side by side and re-runs them: each notebook's checks take the folder and
# the runs that were there before it, so they hold on the first pass and on the second.
@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for every notebook of this file (and the second pass), as a researcher's project folder."""
    return tmp_path_factory.mktemp("notebooks")


def runs_in(folder: Path) -> set[str]:
    return {p.name for p in (folder / "runs").iterdir()} if (folder / "runs").is_dir() else set()


def check_plan_large_models(nb: object, folder: Path, before: set[str]) -> None:
    text = outputs_text(nb)
    assert "DeepSpeed ZeRO-3 + optimizer offload" in text
    assert (folder / "configs-llama-3-70b" / "job.sbatch").exists()
    assert "#SBATCH --nodes=2" in text


def check_communication_health(nb: object, folder: Path, before: set[str]) -> None:
    text = outputs_text(nb)
    assert "straggler: rank 1" in text, text[-2000:]
    assert "HEALTHY" in text.upper()


def check_strategies_memory(nb: object, folder: Path, before: set[str]) -> None:
    text = outputs_text(nb)
    assert "within 2% of the plan" in text
    for s in ("ddp", "fsdp2", "zero1", "zero2"):
        assert f"{s}: succeeded" in text


def check_tensor_parallel(nb: object, folder: Path, before: set[str]) -> None:
    text = outputs_text(nb)
    assert "recommended: fsdp2+tp2+sp" in text
    assert "rehearsal of fsdp2+tp2+sp (planned for 32 processes) on 4: keeps tp2+sp; dp from 16 to 2" in text, text
    assert "every rank holds exactly the bytes the plan predicts" in text


def check_parallelism_3d(nb: object, folder: Path, before: set[str]) -> None:
    text = outputs_text(nb)
    # the 405B plan: an FSDP2 + tp8 + pipeline candidate recommended, the zero1 one shown beside it with its memory
    assert re.search(r"recommended: fsdp2\+tp8\+pp\d+\+sp\n", text), text[:2000]
    assert re.search(r"zero1\+tp8\+pp32\+sp: \d+\.\d GiB per GPU \(-?\d+% headroom\)", text), text[:2000]
    assert "fsdp2+tp2+pp2+sp: dp=2 x tp=2 x pp=2, 4 micro-batches, blocks per stage [4, 4]" in text
    assert "mesh pp=2 x dp_shard=2 x tp=2" in text
    assert "the worst stage holds exactly the planned bytes" in text


def check_compare_and_profile(nb: object, folder: Path, before: set[str]) -> None:
    text = outputs_text(nb)
    for s in ("ddp: succeeded, 30 steps", "fsdp2: succeeded, 30 steps"):
        assert s in text, text[-3000:]
    assert "none: stopped, 0 steps, best loss -, -, peak - per rank" in text, text[-3000:]
    assert "baseline" in text  # the tag, in the runs table
    assert "rank 1 is the slowest: rank 0 waits" in text, text[-3000:]
    html = "".join(o.get("data", {}).get("text/html", "") for c in nb.cells for o in c.get("outputs", []))  # type: ignore[attr-defined]
    assert html.count('class="jd-static-dashboard jd-compare"') == 2 and "jd-profile" in html
    new = sorted(r for r in runs_in(folder) - before if (folder / "runs" / r / "profile").is_dir())
    assert len(new) == 3 and all((folder / "runs" / r / "profile" / "rank-1.pt.trace.json").is_file() for r in new)


def check_quickstart(nb: object, folder: Path, before: set[str]) -> None:
    text = outputs_text(nb)
    assert "succeeded" in text and "PyTorch DDP" in text


def check_pool_quickstart(nb: object, folder: Path, before: set[str]) -> None:
    text = outputs_text(nb)
    assert "rank 1: x * scale = [30.0, 60.0, 90.0]" in text and "stopped" in text


CHECKS = {"plan_large_models.ipynb": check_plan_large_models, "communication_health.ipynb": check_communication_health,
          "strategies_memory.ipynb": check_strategies_memory, "tensor_parallel.ipynb": check_tensor_parallel,
          "parallelism_3d.ipynb": check_parallelism_3d, "compare_and_profile.ipynb": check_compare_and_profile,
          "quickstart.ipynb": check_quickstart, "pool_quickstart.ipynb": check_pool_quickstart}  # fmt: skip
"""Every notebook that runs on this machine without a cluster (the cluster ones run in test_slurm/test_skypilot)."""


# The second pass runs again every notebook that can see what the others left: those that write a fixed name into the
# folder (plan_large_models's configs-llama-3-70b/) or read the runs table (%dist_runs, the quickstart's and the
# pool's runs). These four (5 minutes a pass, most of it) start their runs with %%dist_train or %dist_check alone
# (%dist_check starts its ranks through the same start_run and reads only its own run's check.json) and read only
# their own runs: checked below, statically (no other magic) and on the first pass (they add new run folders and
# touch nothing else), so their second run cannot differ from their first.
OWN_RUN_ONLY = ("strategies_memory.ipynb", "parallelism_3d.ipynb", "tensor_parallel.ipynb",
                "communication_health.ipynb")  # fmt: skip


def folder_state(folder: Path) -> dict[str, int]:
    """Every file under ``folder`` with its modification time (ns)."""
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def test_the_notebooks_left_out_of_the_second_pass_use_no_magic_but_dist_train_and_dist_check() -> None:
    for name in OWN_RUN_ONLY:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
        used = set(re.findall(r"%{1,2}(\w+)|run_(?:line|cell)_magic\(\"(\w+)\"", code))
        magics = {a or b for a, b in used}
        allowed = {"dist_train", "dist_check", "load_ext"}
        assert magics <= allowed, f"{name} uses {sorted(magics)}: run it in the second pass too"
        assert "jd.runs" not in code and "open_run" not in code, f"{name} reads other runs: run it in the second pass"


def run_and_check(name: str, folder: Path) -> None:
    before = runs_in(folder)
    state = folder_state(folder)
    nb = execute(NOTEBOOKS / name, folder, timeout=900)
    CHECKS[name](nb, folder, before)
    if name in OWN_RUN_ONLY:  # it added run folders and changed nothing that was there
        new_runs = runs_in(folder) - before
        assert new_runs, f"{name} started no run"
        mine = {("runs", r) for r in new_runs}
        after = {k: v for k, v in folder_state(folder).items() if Path(k).parts[:2] not in mine}
        assert after == state, f"{name} changed {sorted(set(after.items()) ^ set(state.items()))[:5]} in the folder"


@pytest.mark.slow
def test_plan_large_models_notebook(folder: Path) -> None:
    run_and_check("plan_large_models.ipynb", folder)


@pytest.mark.slow
def test_communication_health_notebook_finds_the_straggler(folder: Path) -> None:
    run_and_check("communication_health.ipynb", folder)


@pytest.mark.slow
def test_strategies_memory_notebook_measures_what_the_plan_predicts(folder: Path) -> None:
    run_and_check("strategies_memory.ipynb", folder)


@pytest.mark.slow
def test_tensor_parallel_notebook_rehearses_the_70b_layout_and_matches_the_plan(folder: Path) -> None:
    run_and_check("tensor_parallel.ipynb", folder)


@pytest.mark.slow
def test_parallelism_3d_notebook_runs_fsdp2_tp2_pp2_on_8_processes_as_planned(folder: Path) -> None:
    run_and_check("parallelism_3d.ipynb", folder)


@pytest.mark.slow
def test_compare_and_profile_notebook_compares_two_strategies_and_finds_the_slow_rank(folder: Path) -> None:
    """In a folder whose runs/ already holds what other notebooks leave (a pool session and a check that logged no
    loss, tokens or memory), the notebook still runs: those rows show "-" (it crashed on them before)."""
    import time

    from jupyter_dist.launch.record import RunRecord, write_record

    for name, status in (("pool-20260101-000000", "stopped"), ("check-20260101-000001", "succeeded")):
        run = folder / "runs" / name
        (run / "telemetry").mkdir(parents=True, exist_ok=True)
        write_record(run, RunRecord.from_dict({"name": name, "status": status, "world_size": 2, "nproc": 2,
                                               "strategy": "none", "started": time.time() - 60}))  # fmt: skip
    run_and_check("compare_and_profile.ipynb", folder)


@pytest.mark.slow
def test_every_notebook_runs_again_in_the_reverse_order_in_the_same_folder(folder: Path) -> None:
    """After the tests above ran them in this folder (by name in this file), every local notebook that can see what
    others left (all but ``OWN_RUN_ONLY``) runs again, in the reverse order, beside everything the others left (runs,
    configs, checkpoints): none fails, each says the same."""
    if not (folder / "runs").is_dir():
        pytest.skip("runs alone: the first pass (the tests above) did not run in this folder")
    for name in sorted(set(CHECKS) - set(OWN_RUN_ONLY), reverse=True):
        try:
            run_and_check(name, folder)
        except Exception as exc:  # name the notebook that failed on its second run
            raise AssertionError(f"{name}, run again in a folder the other notebooks used: {exc}") from exc
