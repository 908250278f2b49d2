"""Writes a user reads later are atomic, and a full disk is one line (issue 29).

The full disk is real where the test may mount one (a 256 KiB tmpfs, filled to the last byte; root in a sandbox that
allows ``mount``); elsewhere ``os.write`` inside :mod:`jupyter_dist._atomic` fails with ENOSPC instead (the narrowest
boundary: every atomic write goes through it), and the test says which it used.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from jupyter_dist import _atomic
from jupyter_dist._atomic import describe_write_error, write_atomic
from jupyter_dist.cli import main


def _mount_full_tmpfs(where: Path) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True)
    if done.returncode:
        return False
    try:  # fill it: every later write of data fails with ENOSPC (folders and empty files still work, as on a disk)
        with open(where / ".filler", "wb") as fh:
            while True:
                fh.write(b"\0" * 4096)
                fh.flush()
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    return True


@pytest.fixture()
def full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder on a full disk: a real filled tmpfs, or ENOSPC from the atomic writer's ``os.write``."""
    where = tmp_path / "full"
    real = _mount_full_tmpfs(where)
    if not real:
        def no_space(fd: int, data: bytes) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        fake_os = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
        fake_os.write = no_space
        monkeypatch.setattr(_atomic, "os", fake_os)
    print(f"full disk: {'a filled tmpfs' if real else 'os.write raising ENOSPC (no mount here)'}")
    try:
        yield where
    finally:
        if real:
            subprocess.run(["umount", "-l", str(where)], check=False)


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.name != ".filler")


def test_a_failed_write_leaves_the_old_file_and_no_temporary(full_disk: Path) -> None:
    target = full_disk / "plan.json"
    target.write_bytes(b"")  # an empty file can be made on a full disk, like the old complete one
    with pytest.raises(OSError) as e:
        write_atomic(target, json.dumps({"x": "y" * 300_000}))
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(target)
    assert _leftovers(full_disk) == ["plan.json"] and target.read_bytes() == b""
    assert describe_write_error(e.value, hint="free space") == f"no space left on device writing {target}: free space"


def test_write_atomic_replaces_whole_and_keeps_modes(tmp_path: Path) -> None:
    path = write_atomic(tmp_path / "a.sh", "echo hi\n", mode=0o755)
    assert path.read_text() == "echo hi\n" and path.stat().st_mode & 0o777 == 0o755
    plain = write_atomic(tmp_path / "b.json", b"{}")
    umask = os.umask(0)
    os.umask(umask)
    assert plain.stat().st_mode & 0o777 == 0o666 & ~umask
    write_atomic(plain, "[1]")
    assert plain.read_text() == "[1]" and sorted(p.name for p in tmp_path.iterdir()) == ["a.sh", "b.json"]


def test_config_out_on_a_full_disk_is_one_line_and_leaves_no_plan(
    full_disk: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = full_disk / "cfg"
    assert main(["config", "--model", "gpt2", "--gpus-per-node", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"jupyter-dist config: error: no space left on device writing {out / 'plan.json'}: free space or "
                   "choose another --out"]  # fmt: skip
    assert not (out / "plan.json").exists() and _leftovers(out) == []  # nothing half-written for a later reader


def test_calibration_summary_annotations_and_bundle_write_atomically(
    full_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jupyter_dist.launch.rundir import RunDir
    from jupyter_dist.plan import Hardware, plan
    from jupyter_dist.plan.calibration import Calibration
    from jupyter_dist.render.bundle import render_bundle
    from jupyter_dist.telemetry.summary import write_summary

    monkeypatch.setenv("JD_CALIBRATION_DIR", str(full_disk / "cal"))
    cal = Calibration(hardware_key="h100-80gb", accelerator="h100-80gb", matmul_efficiency=0.5, op_overhead_s=0.0,
                      memory_offset_bytes=0, trials=1)
    with pytest.raises(OSError, match="No space left on device"):
        cal.save()
    with pytest.raises(OSError, match="No space left on device"):
        write_summary(full_disk, {"x": "y" * 300_000})
    with pytest.raises(OSError, match="No space left on device"):
        RunDir(full_disk).write_annotations({"tags": ["x" * 300_000], "notes": []})
    bundle = render_bundle(plan("gpt2", Hardware.from_names("h100-80gb", gpus_per_node=2)))
    with pytest.raises(OSError, match="No space left on device"):
        bundle.write_to(full_disk / "bundle")
    assert _leftovers(full_disk) == ["bundle", "cal"]  # folders, no file


def test_dist_train_on_a_full_disk_is_one_line_and_leaves_no_run_folder(full_disk: Path, ip: object) -> None:
    from IPython.core.error import UsageError

    runs = full_disk / "runs"
    with pytest.raises(UsageError) as e:
        ip.run_cell_magic("dist_train", f"--nproc 2 --strategy none --runs-dir {runs}",  # type: ignore[attr-defined]
                          "print('x' * 10)\n" + "#" * 400_000)  # fmt: skip
    want = (rf"no space left on device writing {re.escape(str(runs))}/run-\d{{8}}-\d{{6}}(-\d+)?/script\.py: "
            r"free space or choose --runs-dir elsewhere")
    assert re.fullmatch(want, str(e.value)), str(e.value)
    assert _leftovers(runs) == []


@pytest.mark.parametrize("kind", ["folder", "fifo", "missing"])
def test_launch_says_what_a_path_that_is_no_script_is(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "train.py"
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    what = {"folder": "is a folder, not a script file", "fifo": "is a FIFO (named pipe), not a script file",
            "missing": "no such file"}[kind]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "jupyter_dist.cli", "launch", "--nproc", "1", str(path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"jupyter-dist launch: error: --script {path}: {what}"]
