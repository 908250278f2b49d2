"""What of the user's project travels with a cluster job: a folder (``--workdir``), buckets (``--mount``), a script.

* ``--workdir DIR`` - the folder is copied into the job's working directory with the same ignore rules SkyPilot
  applies when it syncs a workdir (``.skyignore`` when the folder has one, else every ``.gitignore`` in it; ``.git``
  never), so ``import mymodule`` works on every node as in the notebook. Before anything is copied,
  :func:`check_workdir` totals what would go and refuses more than ``--workdir-limit`` (default 1 GB) with the
  biggest files named.
* ``--mount /data=s3://bucket/path`` - a bucket of a store SkyPilot supports, mounted on every node (the task's
  ``file_mounts``; ``MOUNT_CACHED`` for the checkpoint folder, whose writes must reach the bucket, ``MOUNT`` else).
  A local folder as source is copied instead.
* ``--script train.py [args]`` - an existing script runs in place of a cell: :func:`script_runner` is the job's
  ``script.py``, which runs it as ``__main__`` with its arguments, so the Run, logs and diagnosis are the same.

Stdlib only (``rsync`` for the copy, as SkyPilot uses it).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

from ..errors import JupyterDistError

__all__ = [
    "MOUNT_PREFIXES",
    "RESERVED",
    "check_workdir",
    "mount_config",
    "parse_mount",
    "parse_size",
    "script_runner",
    "sync_workdir",
    "workdir_files",
]

MOUNT_PREFIXES = ("s3://", "gs://", "r2://", "cos://", "oci://", "nebius://", "cw://")
"""Bucket URLs SkyPilot mounts (AWS S3, Google Cloud Storage, Cloudflare R2, IBM COS, OCI, Nebius, CoreWeave), plus
Azure blob containers (``https://ACCOUNT.blob.core.windows.net/CONTAINER``)."""
_AZURE_RE = re.compile(r"^https://[a-z0-9]+\.blob\.core\.windows\.net/[a-z0-9-]+(/.*)?$")
_DEST_RE = re.compile(r"^(/|~/)[A-Za-z0-9_./~-]*$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
RESERVED = ("script.py", "jd_bootstrap.py", "ds_config.json", "shipped.pkl", ".jd")
"""Names in the job's working directory that jupyter-dist writes: a ``--workdir`` must not hold them."""


def parse_size(text: str) -> int:
    """``"1GB"`` / ``"500M"`` / ``"2.5g"`` -> bytes (powers of 1024); a one-line error otherwise."""
    m = _SIZE_RE.match(text)
    if not m:
        raise JupyterDistError(f"--workdir-limit {text!r}: write a size such as 500MB, 2GB or 1.5G")
    scale = 1024 ** " kmgt".index((m.group(2) or " ").lower())
    return int(float(m.group(1)) * scale)


def parse_mount(spec: str) -> tuple[str, str]:
    """``"/data=s3://bucket/path"`` -> ``("/data", "s3://bucket/path")``, checked; a one-line error otherwise."""
    dest, sep, src = spec.partition("=")
    dest, src = dest.strip(), src.strip()
    valid = f"{', '.join(MOUNT_PREFIXES)}, https://ACCOUNT.blob.core.windows.net/CONTAINER or a local folder"
    if not sep or not dest or not src:
        raise JupyterDistError(f"--mount {spec!r}: write DEST=SOURCE, e.g. /data=s3://my-bucket/path")
    if not _DEST_RE.match(dest) or ".." in dest.split("/"):
        raise JupyterDistError(f"--mount {spec!r}: the destination must be an absolute path on the nodes (/data, ~/x)")
    if src.startswith(MOUNT_PREFIXES):
        bucket = src.split("://", 1)[1].split("/", 1)[0]
        if not re.match(r"^[a-z0-9][a-z0-9._-]{1,62}$", bucket):
            raise JupyterDistError(f"--mount {spec!r}: {bucket!r} is not a bucket name (lower case, digits, . _ -)")
        return dest, src
    if src.startswith("https://"):
        if not _AZURE_RE.match(src):
            raise JupyterDistError(f"--mount {spec!r}: an https source must be an Azure blob container; valid: {valid}")
        return dest, src
    if "://" in src:
        raise JupyterDistError(f"--mount {spec!r}: SkyPilot cannot mount {src.split('://')[0]}://; valid: {valid}")
    if not Path(src).expanduser().is_dir():
        raise JupyterDistError(f"--mount {spec!r}: {src} is not a folder here; valid: {valid}")
    return dest, str(Path(src).expanduser().resolve())


def mount_config(mounts: tuple[tuple[str, str], ...], checkpoint_dir: str | None) -> dict[str, object]:
    """The task's ``file_mounts``: buckets mounted (``MOUNT_CACHED`` under the checkpoint folder), folders copied."""
    out: dict[str, object] = {}
    ckpt = (checkpoint_dir or "").rstrip("/")
    for dest, src in mounts:
        if dest in out:
            raise JupyterDistError(f"--mount {dest}: given twice")
        if "://" not in src:
            out[dest] = src
            continue
        d = dest.rstrip("/")
        cached = bool(ckpt) and (ckpt == d or ckpt.startswith(d + "/"))
        out[dest] = {"source": src, "mode": "MOUNT_CACHED" if cached else "MOUNT"}
    return out


def _rsync_filters(src: Path) -> list[str]:
    """SkyPilot's rules: ``.skyignore`` when present, else the ``.gitignore`` files (merged per folder)."""
    filters = ["--exclude=.git/"]
    if (src / ".skyignore").exists():
        return [*filters, f"--exclude-from={src / '.skyignore'}"]
    return [*filters, "--filter=dir-merge,- .gitignore"]


def _rsync() -> str:
    found = shutil.which("rsync")
    if found is None:
        raise JupyterDistError("--workdir needs rsync here (Debian/Ubuntu: apt-get install rsync), as SkyPilot does")
    return found


def workdir_files(src: str | Path) -> list[tuple[str, int]]:
    """``(relative path, bytes)`` of every file ``--workdir`` would send, after the ignore rules."""
    root = Path(src).expanduser().resolve()
    if not root.is_dir():
        raise JupyterDistError(f"--workdir {src}: not a folder")
    res = subprocess.run(
        [_rsync(), "-a", "-n", "--out-format=%l %n", *_rsync_filters(root), f"{root}/", "/nonexistent-jd-dest/"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if res.returncode != 0:
        raise JupyterDistError(f"--workdir {src}: rsync could not list it: {res.stderr.strip().splitlines()[-1:]}")
    out = []
    for line in res.stdout.splitlines():
        size, _, name = line.partition(" ")
        if name and not name.endswith("/") and size.isdigit():
            out.append((name, int(size)))
    return out


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def check_workdir(src: str | Path, limit: int) -> tuple[int, int]:
    """(files, bytes) that ``--workdir`` sends; a one-line error naming the biggest files above ``limit`` bytes."""
    files = workdir_files(src)
    root = Path(src).expanduser().resolve()
    clash = [n for n in RESERVED if (root / n).exists()]
    if clash:
        raise JupyterDistError(f"--workdir {src}: holds {', '.join(clash)}, which jupyter-dist writes there; rename")
    total = sum(s for _, s in files)
    if total > limit:
        big = sorted(files, key=lambda f: -f[1])[:5]
        names = ", ".join(f"{n} ({_human(s)})" for n, s in big)
        raise JupyterDistError(
            f"--workdir {src}: {_human(total)} in {len(files)} files would be uploaded (limit {_human(limit)}); "
            f"biggest: {names}. Add them to .skyignore/.gitignore, put data in a bucket (--mount), or raise "
            "--workdir-limit"
        )
    return len(files), total


def sync_workdir(src: str | Path, dst: str | Path) -> None:
    """Copy ``src`` into ``dst`` with the ignore rules (``rsync -a``)."""
    root = Path(src).expanduser().resolve()
    Path(dst).mkdir(parents=True, exist_ok=True)
    res = subprocess.run([_rsync(), "-a", *_rsync_filters(root), f"{root}/", f"{dst}/"], capture_output=True,
                         text=True, timeout=3600, check=False)  # fmt: skip
    if res.returncode != 0:
        raise JupyterDistError(f"--workdir {src}: copy failed: {res.stderr.strip()[-300:]}")


def script_runner(path: str, args: tuple[str, ...] = ()) -> str:
    """The job's ``script.py`` for ``--script``: run ``path`` as ``__main__`` with ``args``.

    As ``python path args`` would: its folder first on ``sys.path``. First it arms
    :func:`jupyter_dist.integrations.autoattach`, as a cell's prelude does, so that an unmodified Hugging Face
    ``Trainer`` script logs to the run's panels (Lightning also finds the callback through its entry point); it
    imports nothing until the script imports the framework, and ``JD_AUTO_CALLBACKS=0`` turns it off.
    """
    return (
        "# --- added by jupyter-dist: runs an existing script as `python "
        + shlex.join([path, *args]).replace("\n", " ")
        + "` would; HF / Lightning Trainers log to the run (JD_AUTO_CALLBACKS) ---\n"
        "import os, runpy, sys  # noqa: E401\n"
        '__import__("jupyter_dist.integrations", fromlist=["_"]).autoattach()\n'
        f"_jd_path = os.path.abspath({path!r})\n"
        f"sys.argv = [_jd_path, *{list(args)!r}]\n"
        "sys.path.insert(0, os.path.dirname(_jd_path))\n"
        'runpy.run_path(_jd_path, run_name="__main__")\n'
    )
