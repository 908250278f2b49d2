"""Strict tooling as tests, so CI runs it: ruff on the package, mypy --strict on the pure layers."""

from __future__ import annotations

import os
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


def test_the_suites_processes_run_torch_on_one_thread_each() -> None:
    """The worker and what it starts inherit ``OMP_NUM_THREADS=1`` (``conftest.SUITE_THREADS``); torch uses it."""
    torch = pytest.importorskip("torch")
    from conftest import SUITE_THREADS

    if SUITE_THREADS != "1":
        pytest.skip(f"OMP_NUM_THREADS={SUITE_THREADS} was set before the suite started")
    assert os.environ["OMP_NUM_THREADS"] == "1" and torch.get_num_threads() == 1
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], capture_output=True,
                           text=True, check=True)  # fmt: skip
    assert child.stdout.strip() == "1"


def test_the_suites_op_builds_compile_without_debug_info_under_the_same_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tests/conftest.py's op builds put a ``c++`` first on PATH that drops ``-g`` (a third of DeepSpeed's compile
    time): the same command line makes an object without debug sections, and torch accepts that compiler."""
    import os

    from conftest import compiler_without_debug_info
    from torch.utils.cpp_extension import check_compiler_ok_for_platform

    folder = compiler_without_debug_info()
    if folder is None or shutil.which("readelf") is None:
        pytest.skip("no c++ or readelf on this machine")
    src = tmp_path / "twice.cpp"
    src.write_text("int twice(int x) { return 2 * x; }\n")
    sections = {}
    for name, path in (("plain", os.environ["PATH"]), ("suite", f"{folder}{os.pathsep}{os.environ['PATH']}")):
        env = dict(os.environ, PATH=path)
        obj = tmp_path / f"{name}.o"
        subprocess.run(["c++", "-O3", "-g", "-Wno-reorder", "-c", str(src), "-o", str(obj)], env=env, check=True,
                       timeout=120)  # fmt: skip
        sections[name] = subprocess.run(["readelf", "-S", str(obj)], capture_output=True, text=True, check=True).stdout
    assert ".debug_info" in sections["plain"] and ".debug_info" not in sections["suite"]
    assert ".text" in sections["suite"]
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    assert shutil.which("c++") == str(folder / "c++") and check_compiler_ok_for_platform("c++")
