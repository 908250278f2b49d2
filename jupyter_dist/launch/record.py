"""The run record: what ``run.json`` holds, as one typed value, written by one function, atomically.

:class:`RunRecord` is what a run directory says about its run: the plan and the candidate that ran, its degrees, the
back-end, the versions, the hyperparameters, the status and the exit codes. Every writer of ``run.json`` (the local
session, the SLURM and SkyPilot back-ends, the pool) builds one, and every write goes through :func:`write_record`
(a temporary file in the same folder, flushed, then ``os.replace``: a reader never sees half of it, and two writers
in one process never share a temporary file). Every reader goes through :func:`read_record`, whose
:meth:`RunRecord.from_dict` reads each layout ``run.json`` has had (before the ``record`` version key, without
``backend``, ``candidate`` or ``degrees``): a missing field gets its default or is derived from what is there.

``to_dict`` keeps the flat layout (``meta["status"]``, ``meta["launcher"]``, ...) and every key the record does not
name (``diagnosis``, ``timeout_report``, ``job_id``, ...), so the :class:`~.run.Run` handle's in-memory dict and the
file stay the same thing.

Hyperparameters: the kernel records the scalars shipped to the cell (``--ship``) when it starts the run; rank 0's
``jd.config(...)`` (and the Hugging Face / Lightning callbacks) write ``hparams.json`` in the run directory
(:func:`write_hparams`); :func:`read_record` merges that file into the record, and the run's final write keeps the
merge in ``run.json``. :func:`check_hparams` is the one validation both sides use (scalars and one-line strings).

:func:`settle_stale` is what attaching does to a record that says ``pending``/``running``: a local run whose
processes are all gone is settled from what the ranks left (exit files), never reported as running.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .._atomic import write_atomic
from ..errors import JupyterDistError
from ..plan.parallel import ParallelDims
from .base import DEFAULT_BACKEND, runs_here

__all__ = [
    "HPARAMS_FILE",
    "RECORD_FILE",
    "RECORD_VERSION",
    "Degrees",
    "HparamError",
    "RunRecord",
    "check_hparams",
    "kernel_versions",
    "launch_record",
    "local_pids_alive",
    "read_hparams",
    "read_record",
    "scalar_items",
    "settle_stale",
    "shipped_hparams",
    "write_hparams",
    "write_record",
]

RECORD_FILE = "run.json"
"""The record's file in a run directory."""
HPARAMS_FILE = "hparams.json"
"""Rank 0's hyperparameters (``jd.config``, the framework callbacks), merged into the record when it is read."""
RECORD_VERSION = 2
"""``run.json``'s layout version (``record``); files without it are version 1 and read the same way."""
MAX_RECORD_BYTES = 64 << 20
"""Largest ``run.json`` read (a real one is a few KiB; a bigger one is garbage and is refused, not loaded)."""
MAX_HPARAM_KEY = 250
"""Longest hyperparameter name (MLflow's limit for a param key)."""
MAX_HPARAM_TEXT = 500
"""Longest string value of a hyperparameter (MLflow's historic limit for a param value)."""
ACTIVE = ("pending", "running")
"""Statuses of a run that has not ended."""

Scalar = bool | int | float | str


class HparamError(JupyterDistError, ValueError):
    """A hyperparameter that is not a scalar or a one-line string; the message names the key."""


def _scalar(key: str, value: Any, *, where: str) -> Scalar:
    if hasattr(value, "item") and not isinstance(value, (bool, int, float, str)):  # numpy / 0-d torch scalars
        try:
            value = value.item()
        except Exception:  # noqa: BLE001 - a tensor of many values: refused below
            pass
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise HparamError(f"{where}: {key} = {value} is not finite; give a finite number")
        return float(value)
    if isinstance(value, str):
        if "\n" in value or "\r" in value or len(value) > MAX_HPARAM_TEXT:
            raise HparamError(f"{where}: {key} must be a one-line string of at most {MAX_HPARAM_TEXT} characters")
        return value
    raise HparamError(f"{where}: {key} must be a number, bool or string, got {type(value).__name__}")


def check_hparams(values: Mapping[str, Any], *, where: str = "jd.config") -> dict[str, Scalar]:
    """``values`` checked: names of 1-250 characters on one line, values numbers, bools or one-line strings.

    Numpy and 0-d torch scalars become Python numbers. Raises :class:`HparamError` naming the first bad key.
    """
    out: dict[str, Scalar] = {}
    for key, value in values.items():
        if not isinstance(key, str) or not key.strip() or len(key) > MAX_HPARAM_KEY or "\n" in key or "\r" in key:
            raise HparamError(f"{where}: name {key!r} is not valid; give 1-{MAX_HPARAM_KEY} characters on one line")
        out[key] = _scalar(key, value, where=where)
    return out


def shipped_hparams(objects: Mapping[str, Any]) -> dict[str, Scalar]:
    """The scalars among objects shipped to a cell (``--ship lr,model``: ``lr`` if it is a number, bool or string)."""
    out: dict[str, Scalar] = {}
    for key, value in objects.items():
        if isinstance(value, (bool, int, float, str)):
            try:
                out.update(check_hparams({key: value}, where="--ship"))
            except HparamError:  # a long or multi-line string, a NaN: shipped, but not a hyperparameter
                continue
    return out


def scalar_items(values: Mapping[str, Any], *, prefix: str = "", depth: int = 1) -> dict[str, Scalar]:
    """The hyperparameters in a framework's mapping (a Trainer's arguments, Lightning's ``hparams``).

    Numbers, bools and one-line strings are kept, ``None`` and everything else (lists, modules, callables) left out;
    nested mappings are flattened ``depth`` levels deep as ``outer.inner``; names starting with ``_`` and values that
    look like credentials (``<HUB_TOKEN>``, keys named ``*token*``) are left out.
    """
    out: dict[str, Scalar] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if not isinstance(key, str) or key.startswith("_") or "token" in key.lower():
            continue
        if isinstance(value, Mapping):
            if depth > 0:
                out.update(scalar_items(value, prefix=f"{name}.", depth=depth - 1))
            continue
        if hasattr(value, "value") and isinstance(getattr(value, "value", None), (str, int)):  # an Enum member
            value = value.value
        if value is None or not isinstance(value, (bool, int, float, str)):
            continue
        try:
            out.update(check_hparams({name: value}, where="hparams"))
        except HparamError:
            continue
    return out


def kernel_versions() -> dict[str, str]:
    """Python, jupyter-dist and (when installed) torch of this process, without importing torch."""
    import platform
    from importlib import metadata

    from .._version import __version__

    out = {"python": platform.python_version(), "jupyter-dist": __version__}
    for dist in ("torch",):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


Degrees = ParallelDims
"""The run's degrees are a :class:`~jupyter_dist.plan.parallel.ParallelDims` (with ``dp_replicate``); this name is
kept so that older imports of ``launch.record.Degrees`` still work."""


def _degrees_of(data: Mapping[str, Any], world: int | None) -> ParallelDims | None:
    """The degrees of an older record: from its candidate name, else from its ``JD_*`` environment."""
    env = data.get("env") if isinstance(data.get("env"), Mapping) else {}
    try:
        if env.get("JD_TP") or env.get("JD_PP") or env.get("JD_CP"):
            tp, pp, cp = (int(env.get(f"JD_{k}") or 1) for k in ("TP", "PP", "CP"))
            ep, rep = int(env.get("JD_EP") or 1), int(env.get("JD_DP_REPLICATE") or 1)
            sp = str(env.get("JD_SP") or "0") not in ("0", "", "false")
        elif isinstance(data.get("candidate"), str) and data["candidate"]:
            from ..plan.candidates import parse_candidate

            c = parse_candidate(data["candidate"])
            tp, pp, cp, ep, sp, rep = c.tp, c.pp, c.cp, c.ep, c.sp, 1
        else:
            return None
        if not world or world % (tp * pp * cp):
            return None
        return ParallelDims(dp=world // (tp * pp * cp), tp=tp, pp=pp, cp=cp, ep=ep, sp=sp, dp_replicate=rep)
    except (ValueError, TypeError, JupyterDistError):
        return None


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    try:
        return int(value) if value is not None and not isinstance(value, bool) else None
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class RunRecord:
    """One run as its directory records it (``run.json``); see the module docstring."""

    name: str
    """The name the run was started with (its directory adds a time stamp)."""
    kind: str = "run"
    """``run`` (``%%dist_train``, ``start_run``, ``jupyter-dist launch``) or ``pool`` (``%dist_start``)."""
    status: str = "pending"
    """pending, running, succeeded, failed, stopped, timed out or hung."""
    backend: str = DEFAULT_BACKEND
    """A key of the back-end registry (``launch/base.py``: ``BACKEND_SPECS``)."""
    strategy: str | None = None
    """The base strategy the ranks apply (``JD_STRATEGY``)."""
    candidate: str | None = None
    """The candidate that ran, with its degrees (``fsdp2+tp2+sp``): what ``plan_check`` compares with."""
    degrees: ParallelDims | None = None
    """The candidate's degrees on the processes it ran on."""
    world_size: int | None = None
    """Ranks (``None``: a job attached by id whose size is not known yet)."""
    nproc: int | None = None
    """Processes per node."""
    nodes: int | None = None
    """Nodes."""
    notes: tuple[str, ...] = ()
    """What runs, in words: the mesh line first, then a rehearsal note."""
    plan: dict[str, Any] | None = None
    """The plan given (``Plan.to_dict()``), else ``None``."""
    hparams: dict[str, Scalar] = field(default_factory=dict)
    """Hyperparameters: shipped scalars, ``jd.config``, a Trainer's arguments, Lightning's ``hparams``."""
    versions: dict[str, str] = field(default_factory=dict)
    """Versions of the kernel that started it (python, jupyter-dist, torch)."""
    env: dict[str, str] = field(default_factory=dict)
    """The ranks' added environment, secret-looking values redacted."""
    shipped: tuple[str, ...] = ()
    """Names of the objects shipped to the cell."""
    secrets: tuple[str, ...] = ()
    """Names (never values) of the kernel variables passed to a cluster job."""
    timeout: float | None = None
    """``--timeout`` seconds."""
    hang_timeout: float | None = None
    """``--hang-timeout`` seconds (local runs)."""
    created: float | None = None
    """Unix time the record was first written."""
    started: float | None = None
    """Unix time the processes (or the job) started."""
    ended: float | None = None
    """Unix time the run was settled."""
    pids: tuple[int, ...] = ()
    """The launcher processes of a local run (torchrun agents)."""
    launcher: dict[str, Any] = field(default_factory=dict)
    """The launcher's ``to_dict()`` (its ``kind`` picks the back-end that reattaches)."""
    exit_codes: dict[int, int | None] = field(default_factory=dict)
    """Exit code per rank once it ended (``None``: a rank that left none)."""
    reason: str | None = None
    """Why it ended as it did, when the status alone does not say."""
    error: str | None = None
    """What went wrong launching or watching it."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Every other key of ``run.json`` (``diagnosis``, ``timeout_report``, ``job_id``, ``control``, ...), kept."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"RunRecord.name must be a string, got {self.name!r}")
        if self.kind not in ("run", "pool"):
            raise ValueError(f"RunRecord.kind must be 'run' or 'pool', got {self.kind!r}")
        if self.world_size is not None and self.world_size < 1:
            raise ValueError(f"RunRecord.world_size must be >= 1, got {self.world_size}")
        object.__setattr__(self, "hparams", check_hparams(self.hparams, where="RunRecord.hparams"))

    @property
    def active(self) -> bool:
        """Whether the record says the run has not ended (pending or running)."""
        return self.status in ACTIVE

    def to_dict(self) -> dict[str, Any]:
        """The flat JSON layout of ``run.json`` (every :attr:`extra` key kept at the top level)."""
        out: dict[str, Any] = dict(self.extra)
        for f in fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if f.name == "degrees":
                value = value.to_dict(replicas=True) if value is not None else None
            elif f.name == "exit_codes":
                if not value:
                    continue
                value = {str(k): v for k, v in value.items()}
            elif f.name in ("notes", "shipped", "secrets", "pids"):
                value = list(value)
            elif f.name == "hparams":
                value = dict(value)
            out[f.name] = value
        out["record"] = RECORD_VERSION
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunRecord:
        """Any ``run.json`` this project has written (every layout), into a record; unknown keys go to ``extra``."""
        known = {f.name for f in fields(cls)}
        launcher = data.get("launcher") if isinstance(data.get("launcher"), Mapping) else {}
        world = _int(data.get("world_size"))
        raw_deg = data.get("degrees")
        degrees = ParallelDims.from_dict(raw_deg) if isinstance(raw_deg, Mapping) else _degrees_of(data, world)
        codes: dict[int, int | None] = {}
        for k, v in (data.get("exit_codes") or {}).items() if isinstance(data.get("exit_codes"), Mapping) else ():
            if str(k).isdigit():
                codes[int(k)] = _int(v)
        hp = data.get("hparams") if isinstance(data.get("hparams"), Mapping) else {}
        hparams: dict[str, Scalar] = {}
        for k, v in hp.items():  # a damaged value is dropped, not a record that cannot be read
            try:
                hparams.update(check_hparams({k: v}, where="run.json"))
            except HparamError:
                continue

        def strs(key: str) -> tuple[str, ...]:
            value = data.get(key)
            return tuple(str(x) for x in value) if isinstance(value, (list, tuple)) else ()

        kind = data.get("kind") if data.get("kind") in ("run", "pool") else "run"
        backend = data.get("backend") or launcher.get("kind") or DEFAULT_BACKEND
        return cls(
            name=str(data.get("name") or ""), kind=str(kind), status=str(data.get("status") or "pending"),
            backend=str(backend), strategy=str(data["strategy"]) if data.get("strategy") else None,
            candidate=str(data["candidate"]) if data.get("candidate") else None, degrees=degrees,
            world_size=world if world and world > 0 else None, nproc=_int(data.get("nproc")),
            nodes=_int(data.get("nodes")), notes=strs("notes"),
            plan=dict(data["plan"]) if isinstance(data.get("plan"), Mapping) else None, hparams=hparams,
            versions={str(k): str(v) for k, v in (data.get("versions") or {}).items()}
            if isinstance(data.get("versions"), Mapping) else {},
            env={str(k): str(v) for k, v in data["env"].items()} if isinstance(data.get("env"), Mapping) else {},
            shipped=strs("shipped"), secrets=strs("secrets"), timeout=_num(data.get("timeout")),
            hang_timeout=_num(data.get("hang_timeout")), created=_num(data.get("created")),
            started=_num(data.get("started")), ended=_num(data.get("ended")),
            pids=tuple(p for p in (_int(x) for x in data.get("pids") or ()) if p is not None)
            if isinstance(data.get("pids"), (list, tuple)) else (),
            launcher=dict(launcher), exit_codes=codes,
            reason=str(data["reason"]) if data.get("reason") else None,
            error=str(data["error"]) if data.get("error") else None,
            extra={k: v for k, v in data.items() if k not in known and k != "record"},
        )  # fmt: skip

    def with_hparams(self, values: Mapping[str, Any]) -> RunRecord:
        """A copy with ``values`` merged over the record's hyperparameters."""
        return replace(self, hparams={**self.hparams, **check_hparams(values, where="hparams")})


def launch_record(*, name: str, backend: str, strategy: str, choice: Any, nproc: int, nodes: int,
                  timeout: float | None, env: dict[str, str], plan: Any, ship: Mapping[str, Any] | None,
                  secrets: tuple[str, ...] = (), hang_timeout: float | None = None,
                  extra: dict[str, Any] | None = None) -> RunRecord:  # fmt: skip
    """The record a run starts with: the candidate and degrees ``choice`` resolved (what runs, not the plan's best).

    ``choice`` is the :class:`~jupyter_dist.plan.candidates.LaunchChoice` of :func:`~.prepare.launch_contract`;
    ``ship`` the objects shipped to the cell (its scalars become hyperparameters).
    """
    notes = (choice.mesh(), *([choice.note] if choice.note else [])) if choice is not None else ()
    return RunRecord(
        name=name, backend=backend, strategy=strategy, candidate=choice.candidate.name if choice is not None else None,
        degrees=choice.degrees if choice is not None else None, notes=notes, world_size=nproc * nodes,
        nproc=nproc, nodes=nodes, timeout=timeout, hang_timeout=hang_timeout, env=dict(env), created=time.time(),
        plan=plan.to_dict() if plan is not None else None, shipped=tuple(sorted(ship or {})),
        hparams=shipped_hparams(ship or {}), secrets=tuple(secrets), versions=kernel_versions(),
        extra=dict(extra or {}),
    )  # fmt: skip


# ---- files --------------------------------------------------------------------------------------------------------
def _atomic_write(path: Path, text: str) -> None:
    """``text`` into ``path`` through a unique temporary file in the same folder, then ``os.replace``."""
    write_atomic(path, text)


def write_record(folder: str | os.PathLike[str], record: RunRecord | Mapping[str, Any]) -> RunRecord:
    """The one writer of ``run.json``: ``record`` (or a dict in its layout) with rank 0's hyperparameters merged.

    Atomic (a unique temporary file in the same folder, fsync, ``os.replace``). Returns what was written. Raises
    ``OSError`` when the folder is gone or not writable.
    """
    folder = Path(folder)
    rec = record if isinstance(record, RunRecord) else RunRecord.from_dict(record)
    ranks = read_hparams(folder)
    if ranks:
        rec = replace(rec, hparams={**rec.hparams, **ranks})
    _atomic_write(folder / RECORD_FILE, json.dumps(rec.to_dict(), indent=2, default=str))
    return rec


def read_record(folder: str | os.PathLike[str]) -> RunRecord:
    """The record of the run in ``folder``, rank 0's ``hparams.json`` merged in.

    A missing, unreadable or damaged ``run.json`` is a :class:`~jupyter_dist.errors.JupyterDistError` saying so.
    """
    path = Path(folder) / RECORD_FILE
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_RECORD_BYTES + 1)
    except OSError as exc:
        raise JupyterDistError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_RECORD_BYTES:
        raise JupyterDistError(f"{path} is larger than {MAX_RECORD_BYTES >> 20} MiB: not a run.json")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise JupyterDistError(f"{path} is damaged (not a JSON object); the run cannot be read") from None
    if not isinstance(data, dict):
        raise JupyterDistError(f"{path} is damaged (not a JSON object); the run cannot be read")
    try:
        rec = RunRecord.from_dict(data)
    except (ValueError, TypeError) as exc:
        raise JupyterDistError(f"{path} is damaged ({exc}); the run cannot be read") from None
    ranks = read_hparams(folder)
    return replace(rec, hparams={**rec.hparams, **ranks}) if ranks else rec


def read_hparams(folder: str | os.PathLike[str]) -> dict[str, Scalar]:
    """``hparams.json`` of a run directory (rank 0's ``jd.config``); ``{}`` when there is none or it is damaged."""
    try:
        data = json.loads((Path(folder) / HPARAMS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    out: dict[str, Scalar] = {}
    for k, v in data.items():
        try:
            out.update(check_hparams({k: v}, where=HPARAMS_FILE))
        except HparamError:
            continue
    return out


def write_hparams(folder: str | os.PathLike[str], values: Mapping[str, Any], *, where: str = "jd.config") -> dict[
    str, Scalar
]:  # fmt: skip
    """Merge ``values`` (checked) into ``hparams.json`` of ``folder``, atomically; returns every value it holds."""
    checked = check_hparams(values, where=where)
    merged = {**read_hparams(folder), **checked}
    _atomic_write(Path(folder) / HPARAMS_FILE, json.dumps(merged, indent=1, sort_keys=True))
    return merged


# ---- attaching ----------------------------------------------------------------------------------------------------
def local_pids_alive(pids: tuple[int, ...] | list[int], started: float | None) -> bool:
    """Whether any of a local run's launcher processes still lives (a recycled pid started later does not count)."""
    import psutil

    for pid in pids:
        try:
            proc = psutil.Process(int(pid))
            same = started is None or proc.create_time() <= float(started) + 5
            if proc.status() != psutil.STATUS_ZOMBIE and same:
                return True
        except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
            continue
    return False


def _rank_exit_codes(folder: Path, world: int) -> dict[int, int | None]:
    out: dict[int, int | None] = {}
    for r in range(world):
        try:
            out[r] = int(json.loads((folder / "logs" / f"rank-{r}.exit.json").read_text())["code"])
        except (OSError, ValueError, KeyError, TypeError):
            out[r] = None
    return out


def settle_stale(folder: str | os.PathLike[str], record: RunRecord, *, now: float | None = None) -> RunRecord:
    """The record corrected when it says pending/running but none of its local processes lives any more.

    A cluster run (its scheduler answers for it) and a run that is still alive come back unchanged. A local run
    whose processes are all gone is settled from what the ranks left: ``succeeded`` when every rank wrote exit
    code 0, else ``failed``, with the exit codes and a reason saying it ended while no kernel watched it. The
    caller writes it (:func:`write_record`) when it may.
    """
    if not record.active or not runs_here(record.backend):
        return record
    if not record.pids:  # nothing to check: a run being started, or one only a pending record says was ever tried
        stuck = record.status == "pending" and record.created and (now or time.time()) - record.created > 60
        if not stuck:
            return record
    elif local_pids_alive(record.pids, record.started):
        return record
    folder = Path(folder)
    world = record.world_size or 0
    codes = _rank_exit_codes(folder, world) if world else {}
    ok = bool(codes) and all(c == 0 for c in codes.values())
    bad = sorted(r for r, c in codes.items() if c not in (0, None))
    silent = sorted(r for r, c in codes.items() if c is None)
    parts = ["its processes ended while no kernel watched it (found when the run was attached)"]
    if bad:
        parts.append(f"rank(s) {', '.join(map(str, bad))} exited non-zero")
    if silent:
        parts.append(f"rank(s) {', '.join(map(str, silent))} left no exit record (killed?)")
    if record.status == "pending" and not record.pids:
        parts = ["it never started (no launcher process was recorded)"]
    return replace(record, status="succeeded" if ok else "failed", exit_codes=codes, ended=now or time.time(),
                   reason=record.reason or "; ".join(parts))  # fmt: skip
