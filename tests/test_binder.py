"""binder/ builds an environment in which the quickstart runs: the steps repo2docker takes (runtime.txt's Python,
``pip install -r binder/requirements.txt``, ``binder/postBuild`` from the repository root) in a fresh virtual
environment, then the quickstart executed there with ``jupyter-dist demo`` (nbclient on that environment's kernel,
a real 2-process run). Docker itself is the one part not exercised.

What is real and what is laid in: the venv, both pip steps (``requirements.txt``'s resolution against the
laid torch, then ``postBuild`` as written: its own pip, its constraint, its ``--no-cache-dir``), the notebook
extra's packages, the CLI, the kernel and the 2-process torchrun run. torch itself is not downloaded or unpacked
(the CPU wheel, ~200 MB): this environment's torch -- the CPU build ``constraints-cpu.txt`` pins -- is laid into
the venv first by test_extras_alone's ``TorchLayer`` (its package folders as symlinks, its ``.dist-info`` without
``RECORD``, its ``torchrun``). pip then sees ``torch==2.13.0`` installed: ``requirements.txt`` must be satisfied
by it (a pin that named another torch would make pip try to replace it, which it cannot: no ``RECORD``, the test
fails), and the test checks that the venv's python imports that very torch (issue 34)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_extras_alone import TorchLayer, torch_layer  # noqa: F401  (torch_layer: the fixture, used below)

ROOT = Path(__file__).resolve().parents[1]
BINDER = ROOT / "binder"


def test_binder_files_agree_with_the_project() -> None:
    runtime = (BINDER / "runtime.txt").read_text().strip()
    assert runtime == f"python-{sys.version_info.major}.{sys.version_info.minor}", runtime
    reqs = [ln.strip() for ln in (BINDER / "requirements.txt").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]  # fmt: skip
    constraint = [ln for ln in (ROOT / "constraints-cpu.txt").read_text().splitlines() if ln.startswith("torch==")]
    assert constraint and constraint[0] in reqs, "binder and constraints-cpu.txt must pin the same torch"
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in reqs
    post = (BINDER / "postBuild").read_text()
    assert os.access(BINDER / "postBuild", os.X_OK) and post.startswith("#!/usr/bin/env bash")
    assert '.[notebook]' in post and "PIP_CONSTRAINT=constraints-cpu.txt" in post


@pytest.mark.slow
def test_binder_environment_runs_the_quickstart(tmp_path: Path, torch_layer: TorchLayer) -> None:  # noqa: F811
    env_dir = tmp_path / "binder-env"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, timeout=120)
    torch_layer.lay(env_dir)  # this environment's CPU torch instead of a 200 MB download (see the docstring)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "PIP_CONSTRAINT"))}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env['PATH']}"
    env["VIRTUAL_ENV"] = str(env_dir)
    env["PIP_RETRIES"] = "0"  # download.pytorch.org may be out of reach here: pip falls back to the other indexes
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

    def sh(*cmd: str, timeout: int = 900) -> str:
        res = subprocess.run(list(cmd), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        return res.stdout

    sh("pip", "install", "-q", "-r", str(BINDER / "requirements.txt"))
    sh("bash", str(BINDER / "postBuild"))
    version, where = sh(str(env_dir / "bin" / "python"), "-c",
                        "import torch; print(torch.__version__); print(torch.__file__)").split()  # fmt: skip
    assert version.startswith("2.13.0"), version
    assert any(Path(where).resolve().is_relative_to(p) for p in torch_layer.packages), f"torch from {where}"
    out = sh(str(env_dir / "bin" / "jupyter-dist"), "demo", "--steps", "60", "--runs-dir", str(tmp_path / "runs"))
    assert "succeeded (2 ranks" in out, out
    (folder,) = list((tmp_path / "runs").iterdir())
    assert (folder / "quickstart.html").exists() and (folder / "quickstart.ipynb").exists()
