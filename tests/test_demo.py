"""`jupyter-dist demo`: the README's main job, a real 2-process training run on CPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_demo_trains_on_two_processes(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "jupyter-dist"
    res = subprocess.run([str(exe), "demo", "--steps", "150", "--runs-dir", str(tmp_path)], capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", res.stdout)]
    assert len(losses) >= 3 and losses[-1] < 0.5 * losses[0], res.stdout
    assert "succeeded (2 ranks, strategy ddp)" in res.stdout
    (run_dir,) = list(tmp_path.iterdir())
    assert (run_dir / "telemetry" / "rank-0.jsonl").exists() and (run_dir / "telemetry" / "rank-1.jsonl").exists()


def test_demo_rejects_bad_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    from jupyter_dist.cli import main

    assert main(["demo", "--nproc", "0"]) == 2
    assert "--nproc and --steps must be >= 1" in capsys.readouterr().err
