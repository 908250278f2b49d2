"""`jupyter-dist demo`: the README's main job, a real 2-process training run on CPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_demo_executes_the_quickstart_notebook(tmp_path: Path) -> None:
    """The README's main job: the quickstart notebook (notebooks/quickstart.ipynb) executed on a real kernel, a real
    2-process run, progress in the terminal, and an executed notebook, an offline HTML report and the panels left."""
    import nbformat

    exe = Path(sys.executable).parent / "jupyter-dist"
    res = subprocess.run([str(exe), "demo", "--steps", "120", "--runs-dir", str(tmp_path)], capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", res.stdout)]
    assert len(losses) >= 2 and losses[-1] < 0.5 * losses[0], res.stdout
    assert "succeeded (2 ranks, strategy ddp)" in res.stdout
    # how the plan did: predicted against measured step time, tokens/s and peak memory of each of the 2 ranks
    plan_vs_measured = re.compile(
        r"plan vs measured \(ddp, predicted / measured\): step (\S+) s / (\S+) s \(\S+x the plan\); "
        r"tokens/s ([\d,]+) / ([\d,]+); peak per rank ([\d,]+) MiB / ([\d,]+), ([\d,]+) MiB \(process max RSS\)"
    )
    found = plan_vs_measured.search(res.stdout)
    assert found, res.stdout[-3000:]
    figures = [float(x.replace(",", "")) for x in found.groups()]
    assert all(f > 0 for f in figures), found.group(0)
    assert "run.save_calibration()" in res.stdout
    (folder,) = list(tmp_path.iterdir())
    nb = nbformat.read(folder / "quickstart.ipynb", as_version=4)
    outs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outs if o.output_type == "error"]
    text = "\n".join(o.get("text", "") for o in outs)
    assert "succeeded" in text and "PyTorch DDP" in text
    assert plan_vs_measured.search(text), text[-3000:]  # the notebook's summary cell says it too
    views = [o for o in outs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert views and "widgets" in nb.metadata  # the wizard and the live panels, with their saved state
    report = (folder / "quickstart.html").read_text()
    assert "<svg" in report and "Recommended" in report and "widget-view+json" not in report
    assert "jd-static-dashboard" in report  # the run's panels, drawn as SVG when the run ended
    assert (folder / "dashboard.html").read_text().count("<svg") >= 4
    (run_dir,) = list((folder / "runs").iterdir())
    assert (run_dir / "telemetry" / "rank-0.jsonl").exists() and (run_dir / "telemetry" / "rank-1.jsonl").exists()
    assert "final loss" in (run_dir / "logs" / "rank-0.log").read_text()


@pytest.mark.slow
def test_demo_in_the_terminal_trains_on_two_processes(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "jupyter-dist"
    res = subprocess.run([str(exe), "demo", "--terminal", "--steps", "150", "--runs-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", res.stdout)]
    assert len(losses) >= 3 and losses[-1] < 0.5 * losses[0], res.stdout
    assert "succeeded (2 ranks, strategy ddp)" in res.stdout
    (run_dir,) = list(tmp_path.iterdir())
    assert (run_dir / "telemetry" / "rank-0.jsonl").exists() and (run_dir / "telemetry" / "rank-1.jsonl").exists()


def test_demo_rejects_bad_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    from jupyter_dist.cli import main

    with pytest.raises(SystemExit) as info:
        main(["demo", "--nproc", "0"])
    assert info.value.code == 2
    assert "argument --nproc: want an integer in 1..512, got '0'" in capsys.readouterr().err
    assert main(["demo", "--strategy", "zero9"]) == 2
    assert "--strategy 'zero9' is not one of auto, none, ddp" in capsys.readouterr().err
