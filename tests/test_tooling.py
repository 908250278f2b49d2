"""Strict tooling as tests, so CI runs it: ruff on the package, mypy --strict on the pure layers."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> list[str]:
    if shutil.which(name) is None and not (Path(sys.executable).parent / name).exists():
        pytest.skip(f"{name} is not installed (pip install -e '.[test]' installs it)")
    return [sys.executable, "-m", name]


def test_ruff_is_clean() -> None:
    res = subprocess.run([*_tool("ruff"), "check", "jupyter_dist", "tests", "benchmarks"], cwd=ROOT,
                         capture_output=True, text=True)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr


def test_mypy_strict_on_pure_layers() -> None:
    res = subprocess.run([*_tool("mypy")], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
