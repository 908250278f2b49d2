"""What a cluster job installs: the kernel's own jupyter-dist as a wheel, and the kernel's versions pinned.

A cluster cannot ``pip install jupyter-dist`` by name: this project is not on a registry under that name (whatever
is there is someone else's), and a cell pickled here must mean the same thing there. So a job carries:

* **the package** - :func:`package_wheel` zips exactly the files of the ``jupyter_dist`` package this kernel
  imported (an editable install included: the files are read from the folder the imported package lives in) into a
  pure-Python wheel whose version carries their hash (``0.1.0+jd.<hash>``), cached under
  ``~/.cache/jupyter-dist/wheels``. The job's setup installs that file with ``pip install --no-index --no-deps
  --target .jd/site-<hash>``; the bootstrap puts that folder first on ``sys.path`` (``JD_SITE``).
* **the versions** - :func:`kernel_pins` pins what the run needs to the kernel's versions (torch, cloudpickle,
  pyyaml, psutil always; deepspeed for ZeRO; numpy, accelerate, transformers, safetensors when this kernel has them
  imported). torch comes from PyTorch's index for the remote accelerator (:func:`torch_variant`: CUDA 12.8 for
  Ampere/Hopper, 12.6 for Volta, ROCm for AMD, CPU for CPU processes). ``--requirements FILE`` installs the user's
  file instead of the pins, ``--image`` (SkyPilot ``image_id``) an image whose packages are kept (the wheel is still
  installed), ``--setup`` replaces the whole setup.
* **the check** - the pins travel in the launch contract (``JD_VERSIONS``); each rank compares them with its own
  before running the cell (:func:`version_mismatches`, called by the bootstrap) and prints one line per package that
  differs, so a reused cluster with an old torch is named before any training.

Pure stdlib (``importlib.metadata``, ``zipfile``); torch is never imported here.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shlex
import sys
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import JupyterDistError

__all__ = [
    "RemoteEnv",
    "Wheel",
    "kernel_pins",
    "kernel_version",
    "package_wheel",
    "parse_versions",
    "stage_files",
    "torch_variant",
    "version_mismatches",
    "versions_env",
]

DIST_NAME = "jupyter-dist"
ALWAYS = ("torch", "cloudpickle", "pyyaml", "psutil")
"""Pinned for every run: the worker's torch, the pickle format of shipped objects, and jupyter-dist's own deps."""
WHEN_IMPORTED = ("numpy", "deepspeed", "accelerate", "transformers", "safetensors", "datasets", "peft")
"""Pinned when the kernel has them imported (the cell or the shipped objects most likely use them)."""
_IMPORT_NAMES = {"pyyaml": "yaml"}
TORCH_INDEX = "https://download.pytorch.org/whl/{variant}"
"""PyTorch's wheel index for one build variant (``cu128``, ``cu126``, ``rocm6.4``, ``cpu``)."""
CUDA_FOR: dict[str, str] = {"v100-16gb": "cu126", "v100-32gb": "cu126"}
"""Accelerators whose CUDA build is not the default: Volta lost support in PyTorch's CUDA 12.8 builds."""
DEFAULT_CUDA = "cu128"
"""The CUDA build for NVIDIA accelerators not in :data:`CUDA_FOR` (Ampere, Ada, Hopper)."""
DEFAULT_ROCM = "rocm6.4"
"""The ROCm build for AMD accelerators."""
_EXCLUDE_DIRS = {"__pycache__"}
_EXCLUDE_SUFFIXES = (".pyc", ".pyo")


# ---- the package -------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Wheel:
    """A wheel of the jupyter-dist code this kernel runs."""

    path: Path
    """The ``.whl`` file (in the cache)."""
    version: str
    """Its version: the package's own, with the files' hash as local label (``0.1.0+jd.<hash>``)."""
    digest: str
    """The first 12 hex digits of the SHA-256 over the package's files (names and contents)."""
    source: Path
    """The folder the files came from (the imported package's)."""

    @property
    def name(self) -> str:
        """The wheel's file name."""
        return self.path.name

    @property
    def site(self) -> str:
        """Where the job installs it, relative to the job's working directory."""
        return f".jd/site-{self.digest}"


def _package_files(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDE_DIRS and not d.startswith("."))
        for fname in sorted(filenames):
            if fname.endswith(_EXCLUDE_SUFFIXES) or fname.startswith("."):
                continue
            out.append(Path(dirpath) / fname)
    return out


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def package_wheel(cache_dir: str | Path | None = None, *, package_dir: str | Path | None = None) -> Wheel:
    """A wheel of the imported ``jupyter_dist`` package, built once per content hash and cached.

    ``package_dir`` defaults to the folder of the imported package (for an editable install, the source tree).
    The wheel holds those files as they are (no build step runs), its metadata (the package's dependencies) and the
    ``jupyter-dist`` console script.
    """
    from .._version import __version__

    root = Path(package_dir) if package_dir is not None else Path(__file__).resolve().parents[1]  # jupyter_dist/
    files = _package_files(root)
    if not files:
        raise JupyterDistError(f"no jupyter_dist files under {root}: cannot build the wheel the job installs")
    h = hashlib.sha256()
    blobs: list[tuple[str, bytes]] = []
    for path in files:
        rel = "jupyter_dist/" + path.relative_to(root).as_posix()
        data = path.read_bytes()
        h.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
        blobs.append((rel, data))
    digest = h.hexdigest()[:12]
    version = f"{__version__.split('+', 1)[0]}+jd.{digest}"
    cache = Path(cache_dir) if cache_dir is not None else Path.home() / ".cache" / "jupyter-dist" / "wheels"
    target = cache / f"jupyter_dist-{version}-py3-none-any.whl"
    wheel = Wheel(path=target, version=version, digest=digest, source=root)
    if target.exists():
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    info = f"jupyter_dist-{version}.dist-info"
    requires = "".join(f"Requires-Dist: {r}\n" for r in ("pyyaml>=6", "psutil>=5.9", "cloudpickle>=2.2"))
    meta = [
        (f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: {version}\n{requires}"),
        (f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: jupyter-dist\nRoot-Is-Purelib: true\nTag: py3-none-any\n"),
        (f"{info}/entry_points.txt", "[console_scripts]\njupyter-dist = jupyter_dist.cli:main\n"),
        (f"{info}/top_level.txt", "jupyter_dist\n"),
    ]
    entries = blobs + [(n, t.encode()) for n, t in meta]
    record = "".join(f"{n},{_record_hash(d)},{len(d)}\n" for n, d in entries) + f"{info}/RECORD,,\n"
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in [*entries, (f"{info}/RECORD", record.encode())]:
            zi = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))  # reproducible bytes for equal content
            zi.external_attr = 0o644 << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(zi, data)
    os.replace(tmp, target)
    return wheel


# ---- the versions ------------------------------------------------------------------------------------------------
def kernel_version(name: str) -> str | None:
    """The installed version of distribution ``name`` in this kernel, or ``None``."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def kernel_pins(*, strategy: str = "none", extra: Iterable[str] = ()) -> dict[str, str]:
    """Distribution -> this kernel's version, for what the run needs (see the module docstring)."""
    names = list(ALWAYS)
    if strategy.startswith("zero"):
        names.append("deepspeed")
    for dist in WHEN_IMPORTED:
        if _IMPORT_NAMES.get(dist, dist) in sys.modules:
            names.append(dist)
    names += list(extra)
    out: dict[str, str] = {}
    for dist in dict.fromkeys(names):
        version = kernel_version(dist)
        if version is not None:
            out[dist] = version
    return out


def torch_variant(kernel_torch: str, accelerator: str | None, vendor: str | None) -> str:
    """The PyTorch build for the remote nodes (``cu128``, ``rocm6.4``, ``cpu``).

    ``cpu`` for CPU processes, else the kernel's own CUDA/ROCm build when it has one, else :data:`CUDA_FOR` /
    :data:`DEFAULT_CUDA` / :data:`DEFAULT_ROCM` for the accelerator.
    """
    if vendor in (None, "cpu"):
        return "cpu"
    local = kernel_torch.split("+", 1)[1] if "+" in kernel_torch else ""
    if vendor == "amd":
        return local if local.startswith("rocm") else DEFAULT_ROCM
    if local.startswith("cu"):
        return local
    return CUDA_FOR.get(accelerator or "", DEFAULT_CUDA)


def versions_env(pins: Mapping[str, str]) -> str:
    """``JD_VERSIONS``: ``name=version`` pairs, comma separated."""
    return ",".join(f"{k}={v}" for k, v in pins.items())


def parse_versions(text: str) -> dict[str, str]:
    """Inverse of :func:`versions_env`; a one-line error for a malformed value."""
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, version = item.partition("=")
        if not sep or not name or not version:
            raise JupyterDistError(f"JD_VERSIONS item {item!r}: write name=version, comma separated")
        out[name] = version
    return out


def _public(version: str) -> str:
    return version.split("+", 1)[0]


def version_mismatches(expected: Mapping[str, str], installed: Mapping[str, str | None] | None = None) -> list[str]:
    """One line per package whose version here differs from the kernel's (``installed`` defaults to this process's).

    Build labels (torch's ``+cu128`` vs ``+cpu``) do not count: a CPU kernel launching GPU nodes pins the CUDA build
    on purpose. jupyter-dist itself is compared in full: its label is the hash of the shipped code.
    """
    import platform

    lines = []
    for name, want in expected.items():
        if name == "python":  # pickled code needs the same minor version
            have_py = installed.get(name) if installed is not None else platform.python_version()
            if have_py is None or have_py.split(".")[:2] != want.split(".")[:2]:
                lines.append(f"jupyter-dist: version mismatch: python {have_py} here, {want} in the kernel")
            continue
        have = installed.get(name) if installed is not None else kernel_version(name)
        if have is None:
            lines.append(f"jupyter-dist: version mismatch: {name} is not installed here, the kernel has {want}")
        elif (have != want) if name == DIST_NAME else (_public(have) != _public(want)):
            lines.append(f"jupyter-dist: version mismatch: {name} {have} here, {want} in the kernel")
    return lines


# ---- what the job installs -----------------------------------------------------------------------------------------
_STORE_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True, kw_only=True, slots=True)
class RemoteEnv:
    """The remote set-up of one job: the wheel, the pins (or the user's requirements), the image."""

    wheel: Wheel | None
    """The jupyter-dist wheel the job installs (``None``: the nodes share this kernel's environment)."""
    pins: dict[str, str] = field(default_factory=dict)
    """Distribution -> version installed on the nodes (and compared by each rank at start)."""
    torch_variant: str = "cpu"
    """PyTorch build (``cu128``, ``rocm6.4``, ``cpu``) for the torch pin: its index is PyTorch's for it."""
    requirements: str | None = None
    """Name of the user's requirements file in the job's files (installed instead of the pins)."""
    image: str | None = None
    """Container / machine image (SkyPilot ``image_id``): its packages are kept, only the wheel is installed."""
    python: str = "python3"
    """The interpreter on the nodes."""
    site: str = ""
    """Where the wheel is installed, relative to the job's working directory (default ``.jd/site-<hash>``); may
    hold a shell variable (SLURM: one folder per node, ``...-node${SLURM_NODEID}``), then it is exported as
    ``JD_SITE`` by the set-up itself."""

    @property
    def torch_pin(self) -> str | None:
        """``torch==2.13.0+cu128`` (the build the nodes need), or ``None``."""
        version = self.pins.get("torch")
        if version is None:
            return None
        return f"torch=={_public(version)}+{self.torch_variant}"

    def install_lines(self, custom: str | None = None) -> list[str]:
        """The shell lines of the set-up, in order (also what the dry run shows).

        ``custom`` (``--setup``) replaces the pins; the wheel is always installed.
        """
        pip = f"{shlex.quote(self.python)} -m pip install -q --disable-pip-version-check"  # no index request of its own
        lines = []
        if self.wheel is not None:
            whl = shlex.quote(f".jd/{self.wheel.name}")
            site = self.site or self.wheel.site
            record = f"{site}/jupyter_dist-{self.wheel.version}.dist-info/RECORD"
            # Nodes may share this folder (a SLURM home): each installs into its own temporary folder and renames it
            # into place; rename is atomic, so the first one wins and the others drop theirs. The hash in the name
            # means an existing folder already holds this exact code.
            lines += [
                f"if [ ! -f \"{record}\" ]; then  # jupyter-dist: the kernel's own code, from the job's files",
                '  JD_TMP="$(mktemp -d "$PWD/.jd/tmp.XXXXXX")"',
                f'  {pip} --no-index --no-deps --target "$JD_TMP" {whl}  # never a registry',
                f'  mv -T "$JD_TMP" "{site}" 2>/dev/null || rm -rf "$JD_TMP"',
                "fi",
            ]
            if "$" in site:
                lines.append(f'export JD_SITE="$PWD/{site}"')
        if custom is not None:
            lines += [custom] if custom.strip() else []
        elif self.requirements is not None:
            lines.append(f"{pip} -r {shlex.quote(self.requirements)}  # your requirements file")
        elif self.image is None:
            if self.torch_pin is not None:
                index = TORCH_INDEX.format(variant=self.torch_variant)
                lines.append(f"{pip} {shlex.quote(self.torch_pin)} --index-url {index}")
            others = [f"{k}=={v}" for k, v in self.pins.items() if k != "torch"]
            if others:
                lines.append(f"{pip} " + " ".join(shlex.quote(o) for o in others))
        return lines

    def setup_script(self, custom: str | None = None) -> str:
        """The set-up commands (bash), run once per node in the job's working directory."""
        head = ["# Generated by jupyter-dist: install what the notebook's kernel runs.", "set -euo pipefail"]
        return "\n".join(head + self.install_lines(custom)) + "\n"

    def notes(self) -> list[str]:
        """What gets installed where, in words (the dry run's header)."""
        out = []
        if self.wheel is not None:
            out.append(f"installs jupyter-dist {self.wheel.version} from the shipped wheel {self.wheel.name} "
                       f"(built from {self.wheel.source})")  # fmt: skip
        if self.requirements is not None:
            out.append(f"installs your requirements file {self.requirements} (no version pins)")
        elif self.image is not None:
            out.append(f"uses the packages of image {self.image} (no version pins)")
        elif self.pins:
            pins = [self.torch_pin or ""] + [f"{k}=={v}" for k, v in self.pins.items() if k != "torch"]
            out.append("pins the kernel's versions: " + ", ".join(p for p in pins if p))
        if self.pins:
            out.append("each rank compares its versions with the kernel's at start: " + versions_env(self.pins))
        return out


def stage_files(renv: RemoteEnv, job_dir: Path, requirements: str | None) -> None:
    """Put the wheel (and the requirements file) under ``<job_dir>/.jd/``, where the set-up finds them."""
    import shutil

    dest = job_dir / ".jd"
    dest.mkdir(parents=True, exist_ok=True)
    if renv.wheel is not None:
        shutil.copyfile(renv.wheel.path, dest / renv.wheel.name)
    if requirements is not None and renv.requirements is not None:
        shutil.copyfile(Path(requirements).expanduser(), job_dir / renv.requirements)
