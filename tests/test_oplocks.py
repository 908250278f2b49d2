"""Stale C++-extension build locks (a killed DeepSpeed op load) are removed before DeepSpeed loads its ops.

Fast tests on a temporary extensions folder, and one real ZeRO-2 run through ``%%dist_train`` that starts with a
stale lock on ``deepspeed_shm_comm`` (which ``deepspeed.initialize`` loads on CPU): before the fix it waited forever.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from jupyter_dist.worker._oplocks import STALE_AFTER, clear_stale_locks, extensions_root, stale_lock_guard


def _lock(root: Path, op: str, age: float) -> Path:
    (root / op).mkdir(parents=True, exist_ok=True)
    lock = root / op / "lock"
    lock.write_text("")
    t = time.time() - age
    os.utime(lock, (t, t))
    return lock


def test_an_old_lock_nobody_builds_under_is_removed_and_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    stale = _lock(tmp_path, "deepspeed_shm_comm", STALE_AFTER + 60)
    young = _lock(tmp_path, "cpu_adam", 5)
    with caplog.at_level("WARNING", logger="jupyter_dist.worker"):
        assert clear_stale_locks(tmp_path) == [stale]
    assert not stale.exists() and young.exists()
    assert "removed a stale build lock" in caplog.text and "deepspeed_shm_comm" in caplog.text


def test_an_old_lock_is_kept_while_a_process_builds_in_its_folder(tmp_path: Path) -> None:
    lock = _lock(tmp_path, "cpu_adam", STALE_AFTER + 60)
    (tmp_path / "cpu_adam" / "build").mkdir()
    where = tmp_path / "cpu_adam" / "build"
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], cwd=where)
    try:
        time.sleep(0.3)
        assert clear_stale_locks(tmp_path) == [] and lock.exists()
    finally:
        builder.kill()
        builder.wait()
    assert clear_stale_locks(tmp_path) == [lock] and not lock.exists()


def test_the_guard_clears_a_lock_whose_builder_dies_while_the_load_waits(tmp_path: Path) -> None:
    """The lock looked busy when the load began (a builder in its folder), then the builder was killed: one look
    before ``deepspeed.initialize`` kept it, and the load waited forever (CI, a killed test run's lock); the guard
    looks again while the block runs and removes it."""
    lock = _lock(tmp_path, "deepspeed_shm_comm", STALE_AFTER + 60)
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=lock.parent)
    try:
        time.sleep(0.3)
        with stale_lock_guard(interval=0.2, root=tmp_path):
            assert lock.exists()  # kept: a process builds there
            builder.kill()
            builder.wait()
            deadline = time.time() + 10
            while lock.exists() and time.time() < deadline:  # what torch's FileBaton.wait does
                time.sleep(0.1)
            assert not lock.exists(), "the guard did not clear the abandoned lock"
    finally:
        builder.kill()
        builder.wait()


def test_no_folder_no_locks_nothing_happens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert clear_stale_locks(tmp_path / "missing") == []
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extensions_root() == tmp_path and clear_stale_locks() == []


@pytest.fixture()
def stale_shm_lock(tmp_path: Path) -> Path:
    """A stale lock in an extensions folder of this test's own, so that no other DeepSpeed run on the machine (a
    concurrent soak, another user's job) removes it first and says so in its own log (seen once: a soak beside a
    fresh-clone CI shared the user's folder). The op already built in the shared folder is copied in, when there,
    so the run loads it instead of building it again."""
    shared = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    root = tmp_path / "torch_extensions"
    if (shared / "deepspeed_shm_comm").is_dir():
        shutil.copytree(shared / "deepspeed_shm_comm", root / "deepspeed_shm_comm",
                        ignore=shutil.ignore_patterns("lock"))  # fmt: skip
    return _lock(root, "deepspeed_shm_comm", STALE_AFTER + 600)


@pytest.mark.slow
@pytest.mark.deepspeed
def test_a_deepspeed_run_starts_past_a_lock_a_killed_run_left(stale_shm_lock: Path, ip: Any, runs: Path) -> None:
    pytest.importorskip("deepspeed")
    cell = (
        "import torch\nmodel = torch.nn.Linear(8, 1)\n"
        "model, opt = jd.wrap(model, torch.optim.AdamW(model.parameters()))\n"
        "for step in range(3):\n    loss = model(torch.randn(4, 8)).pow(2).mean()\n    jd.backward(loss)\n"
        "    jd.step(opt)\n    jd.log(step, loss=loss)\n"
    )
    env = f"--env DS_ACCELERATOR=cpu --env TORCH_EXTENSIONS_DIR={stale_shm_lock.parent.parent}"
    run = ip.run_cell_magic("dist_train", f"--nproc 2 --strategy zero2 {env} --timeout 400", cell)
    assert run.wait(460) == "succeeded", run.summary()
    assert not stale_shm_lock.exists()
    assert "removed a stale build lock" in run.logs(0) + run.logs(1)


def test_every_process_of_the_suite_finds_the_ninja_beside_its_interpreter() -> None:
    """tests/conftest.py puts the interpreter's bin folder first on PATH: a rank, a generated script and the
    ``deepspeed_ops`` build all run the same ``ninja`` (two ninjas rebuild each other's ops at every switch)."""
    beside = Path(sys.executable).parent / "ninja"
    if not beside.exists():
        pytest.skip("no ninja beside this interpreter (DeepSpeed not installed here)")
    res = subprocess.run(["sh", "-c", "command -v ninja"], capture_output=True, text=True, timeout=30)
    assert res.stdout.strip() == str(beside), (res.stdout, os.environ["PATH"][:300])
