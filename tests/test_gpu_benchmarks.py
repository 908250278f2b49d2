"""The GPU benchmark scripts (run by hand on a lent GPU, docs/gpu.md) answer a bad argument in one line, before any
work starts, here on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("torch")


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("memory_calibration.py", ["--strategies", "plain,zero9"], "unknown strategy zero9; valid: plain, ddp, fsdp2"),
        ("gpu_paths.py", ["--strategies", "ddp,nope"], "unknown strategy nope; valid: ddp, zero1"),
        ("cp_cpu_probe.py", ["--device", "tpu"], "invalid choice: 'tpu'"),
        ("launched_memory.py", ["--strategies", "zero2"], "unknown strategy zero2; valid: ddp, fsdp2"),
        ("launched_memory.py", ["--modes", "none,sometimes"], "unknown --modes 'sometimes'; valid: none, selective"),
        ("memory_calibration.py", ["--hf-config", "/nonexistent.json"], "is not a file; give a Hugging Face config"),
    ],
)
def test_a_bad_argument_is_one_line_exit_2(script: str, args: list[str], message: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True,
                         env=env, timeout=120)  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert message in last and last.startswith(f"{script}: error:"), res.stderr
