"""Units and number parsing shared by the planner, the renderers and the CLI (stdlib only)."""

from __future__ import annotations

import math
import re

from ..errors import PlanInputError

__all__ = ["GiB", "MiB", "GB", "fmt_gib", "fmt_count", "parse_count", "parse_bytes", "close_match_hint"]

KiB = 1024
MiB = 1024**2
GiB = 1024**3
GB = 10**9

_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*$", re.IGNORECASE)
_BYTES_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": 1024**4,
}  # fmt: skip
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?i?b)?\s*$", re.IGNORECASE)


def fmt_gib(n_bytes: float, digits: int = 1) -> str:
    """Format bytes as GiB (binary gigabytes), the unit of human-readable output."""
    return f"{n_bytes / GiB:,.{digits}f} GiB"


def fmt_count(n: float) -> str:
    """Format a parameter or token count as 124.4M / 6.74B / 1.2T."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suffix}" if n / div < 100 else f"{n / div:,.0f}{suffix}"
    return f"{n:g}"


def parse_count(value: str | int | float, *, what: str = "count") -> int:
    """Parse ``7.5e9``, ``7B``, ``124M`` or ``6738415616`` into a positive integer."""
    if isinstance(value, bool):
        raise PlanInputError(f"{what} must be a number like 7e9, 7B or 124M, not {value!r}")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        m = _COUNT_RE.match(value)
        if not m:
            raise PlanInputError(f"{what} {value!r} is not a number: use e.g. 7e9, 7B, 124M or 6738415616")
        number = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if not math.isfinite(number) or number < 1:
        raise PlanInputError(f"{what} must be at least 1, got {value!r}")
    return int(round(number))


def parse_bytes(value: str | int | float, *, what: str = "size") -> int:
    """Parse ``80GiB``, ``80GB``, ``512MiB`` or a plain byte count into bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), "b"
    else:
        m = _BYTES_RE.match(str(value))
        if not m:
            raise PlanInputError(f"{what} {value!r} is not a size: use e.g. 80GiB, 80GB or 512MiB")
        number, unit = float(m.group(1)), (m.group(2) or "b").lower()
    if not math.isfinite(number) or number <= 0:
        raise PlanInputError(f"{what} must be positive, got {value!r}")
    return int(number * _BYTES_UNITS[unit])


def close_match_hint(name: str, choices: list[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or an empty string."""
    import difflib

    best = difflib.get_close_matches(name.lower(), choices, n=1, cutoff=0.6)
    return f" (did you mean {best[0]!r}?)" if best else ""
