"""A hardware calibration measured by ``%dist_tune``: the achieved matmul rate, per-operator cost, memory offset.

Stored per hardware in a user-level JSON file, ``~/.cache/jupyter-dist/calibration/<hardware-key>.json`` (the folder
is ``$JD_CALIBRATION_DIR`` when set), and used by later plans on the same hardware (``%dist_plan``, ``jupyter-dist
plan``), which say so in their reasons. The key is the accelerator's catalog name for GPUs (an H100 is an H100) and
``cpu-<host name>`` for CPU processes, whose speed is the machine's (stdlib only).
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import PlanInputError
from .hardware import Hardware

__all__ = ["Calibration", "calibration_dir", "hardware_key", "load_calibration", "published", "ENV_DIR"]

ENV_DIR = "JD_CALIBRATION_DIR"
"""Environment variable naming the calibration folder (tests point it at a temporary one)."""


def calibration_dir() -> Path:
    """Where calibrations are kept: ``$JD_CALIBRATION_DIR``, else ``~/.cache/jupyter-dist/calibration``."""
    given = os.environ.get(ENV_DIR)
    if given:
        return Path(given).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jupyter-dist" / "calibration"


def hardware_key(accelerator: str) -> str:
    """File key of a calibration: the accelerator's name, and for CPU processes the host as well."""
    name = accelerator.strip().lower()
    if name == "cpu":
        host = re.sub(r"[^a-z0-9._-]+", "-", platform.node().lower()) or "localhost"
        name = f"cpu-{host}"
    return re.sub(r"[^a-z0-9._-]+", "-", name)


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    """What measured runs on one hardware say about the speed and memory model."""

    hardware_key: str
    """See :func:`hardware_key`."""
    accelerator: str
    """Catalog name of the accelerator measured."""
    matmul_efficiency: float
    """Fraction of the dense peak the matmuls reached (fitted over the trials)."""
    op_overhead_s: float
    """Seconds of host-side cost per operator (fitted over the trials)."""
    memory_offset_bytes: int
    """Measured peak per rank minus the planned peak (the largest over the trials; negative: the plan was high)."""
    comm_scale: float = 1.0
    """Measured over modelled communication time (> 1: the links or the collective library are slower than the
    catalog's bus bandwidth; applied as a lower link efficiency)."""
    trials: int
    """Measured trials behind the fit."""
    step_error: float = 0.0
    """Mean relative error of the predicted step time over the trials *before* calibration."""
    measured_at: float = 0.0
    """Unix time of the measurement."""
    source: str = ""
    """Where the measurements are (the tune's or run's directory)."""

    def __post_init__(self) -> None:
        if not 0 < self.matmul_efficiency <= 1:
            raise PlanInputError(f"calibration matmul_efficiency must be in (0, 1], got {self.matmul_efficiency}")
        if self.op_overhead_s < 0 or self.trials < 1 or self.comm_scale <= 0:
            raise PlanInputError("calibration op_overhead_s must be >= 0, comm_scale > 0 and trials >= 1")

    def describe(self) -> str:
        """One line: what was measured, when, and from how many trials."""
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.measured_at)) if self.measured_at else "?"
        return (
            f"{self.trials} measured trial(s) on {when}: matmul efficiency {self.matmul_efficiency:.3g}, "
            f"{1e6 * self.op_overhead_s:.3g} us per operator, communication x{self.comm_scale:.3g} the model's, "
            f"memory {self.memory_offset_bytes / 2**20:+,.0f} MiB "
            f"per rank against the model ({self.path()})"
        )

    def apply(self, hardware: Hardware) -> Hardware:
        """``hardware`` with the measured rates (the plan then says it uses them)."""
        acc = replace(hardware.accelerator, matmul_efficiency=self.matmul_efficiency,
                      op_overhead_s=self.op_overhead_s, comm_scale=self.comm_scale,
                      calibration=self.describe())  # fmt: skip
        return replace(hardware, accelerator=acc)

    def path(self) -> Path:
        """The file this calibration is saved to."""
        return calibration_dir() / f"{self.hardware_key}.json"

    def save(self) -> Path:
        """Write it to :meth:`path` (atomically); returns the path."""
        path = self.path()
        path.parent.mkdir(parents=True, exist_ok=True)
        from .._atomic import write_atomic

        return write_atomic(path, json.dumps(self.to_dict(), indent=1))

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        """Inverse of :meth:`to_dict`."""
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**fields)


def load_calibration(accelerator: str) -> Calibration | None:
    """The saved calibration of this accelerator (on this host, for CPU), or ``None``.

    A damaged file is ignored (``None``), as a cache should be.
    """
    path = calibration_dir() / f"{hardware_key(accelerator)}.json"
    try:
        return Calibration.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError, PlanInputError):
        return None


def published(hardware: Hardware) -> Hardware:
    """``hardware`` with a file calibration taken off: the catalog's matmul rate, per-operator cost, communication.

    Figures given by hand (``--efficiency``) stay; an accelerator outside the catalog keeps its own.
    """
    from .hardware import ACCELERATORS

    acc = hardware.accelerator
    if not acc.calibration or acc.calibration.startswith("--"):
        return hardware
    base = ACCELERATORS.get(acc.name, acc)
    plain = replace(acc, matmul_efficiency=base.matmul_efficiency, op_overhead_s=base.op_overhead_s, comm_scale=1.0,
                    calibration="")  # fmt: skip
    return replace(hardware, accelerator=plain)
