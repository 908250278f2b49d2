"""What the interactive pool returns and raises: one rank's report, a cell's result, the pool's errors; ``--ranks``.

Part of :mod:`jupyter_dist.pool` (the :class:`~jupyter_dist.pool.kernel.Pool` that produces them is in :mod:`.kernel`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import JupyterDistError

__all__ = ["CellError", "CellResult", "PoolBroken", "PoolError", "PoolInterrupted", "RankReport", "parse_ranks"]

class PoolError(JupyterDistError):
    """The pool cannot do what was asked (not started, stopped, bad rank, object that cannot be pickled...)."""


class PoolBroken(PoolError):
    """A rank died or stopped answering: the pool must be stopped and started again. The message says which/why."""


@dataclass
class RankReport:
    """What one rank did with one cell."""

    rank: int
    """The rank."""
    stdout: str = ""
    """What the cell printed to ``sys.stdout`` on this rank."""
    stderr: str = ""
    """What it printed to ``sys.stderr``."""
    value: str | None = None
    """``repr`` of the cell's last expression, when it was one and not ``None``."""
    error: dict[str, str] | None = None
    """``ename``, ``evalue`` and ``traceback`` (text, from the cell's frames down) when the cell raised."""
    interrupted: bool = False
    """The cell ended with ``KeyboardInterrupt`` (kernel interrupt or ``--timeout``)."""
    elapsed: float | None = None
    """Seconds the rank spent in the cell."""
    where: str | None = None
    """For a timed-out cell: the cell line (and innermost frame) the rank was on, from its faulthandler stack."""
    lost: str | None = None
    """Why the rank stopped answering (it died), when it did."""

    @property
    def ok(self) -> bool:
        """The cell ran to its end on this rank."""
        return self.error is None and self.lost is None


@dataclass
class CellResult:
    """Outputs, values and errors of one cell, per rank."""

    ranks: dict[int, RankReport]
    """One report per rank the cell ran on."""
    elapsed: float = 0.0
    """Wall seconds, as the kernel measured them."""
    interrupted: bool = False
    """The kernel was interrupted while the cell ran (the ranks were interrupted too)."""
    timed_out: bool = False
    """The cell ran past ``timeout`` and was interrupted."""
    timeout: float | None = None
    """The cell's ``timeout``."""

    @property
    def failed(self) -> list[int]:
        """Ranks whose cell raised (interrupts included) or that died."""
        return [r for r, rep in sorted(self.ranks.items()) if not rep.ok]

    def stdout(self, rank: int = 0) -> str:
        """What ``rank`` printed."""
        return self.ranks[rank].stdout

    def text(self) -> str:
        """Everything, grouped by rank: output, last value, error."""
        out = []
        for r, rep in sorted(self.ranks.items()):
            body = rep.stdout + rep.stderr
            if rep.value is not None:
                body += f"Out[rank {r}]: {rep.value}\n"
            if rep.where:
                body += f"was at {rep.where}\n"
            if rep.error is not None:
                body += rep.error.get("traceback") or f"{rep.error['ename']}: {rep.error['evalue']}\n"
            if rep.lost:
                body += f"rank lost: {rep.lost}\n"
            if body:
                out.append(f"[rank {r}]\n{body.rstrip()}")
        return "\n".join(out)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": self.text()}


class CellError(JupyterDistError):
    """A cell raised on some ranks (or ran past its timeout); ``result`` holds every rank's report.

    IPython shows it through :meth:`_render_traceback_`: each failing rank with its own traceback.
    """

    def __init__(self, result: CellResult) -> None:
        self.result = result
        bad = result.failed
        if result.timed_out:
            msg = f"the cell ran past --timeout {result.timeout:g} s and was interrupted: " + "; ".join(
                f"rank {r} was at {result.ranks[r].where or 'an unknown line'}" for r in bad
            )
        else:
            first = result.ranks[bad[0]].error or {}
            msg = f"the cell failed on rank(s) {', '.join(map(str, bad))}: " + (
                f"rank {bad[0]}: {first.get('ename')}: {first.get('evalue')}" if first else ""
            )
        super().__init__(msg)

    def _render_traceback_(self) -> list[str]:
        lines = [str(self)]
        for r in self.result.failed:
            rep = self.result.ranks[r]
            lines.append(f"---- rank {r} " + "-" * 60)
            if rep.where:
                lines.append(f"was at {rep.where}")
            if rep.error is not None:
                tb = rep.error.get("traceback") or f"{rep.error.get('ename')}: {rep.error.get('evalue')}"
                lines += tb.rstrip("\n").splitlines()
            if rep.lost:
                lines.append(f"rank lost: {rep.lost}")
        return lines


class PoolInterrupted(KeyboardInterrupt):
    """The kernel was interrupted during a pool cell; every rank was interrupted and the pool still answers."""

    def __init__(self, result: CellResult) -> None:
        self.result = result
        where = ", ".join(f"rank {r} at {rep.where}" for r, rep in sorted(result.ranks.items()) if rep.where)
        super().__init__("interrupted on every rank; the pool keeps its state" + (f" ({where})" if where else ""))

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self}"]


def parse_ranks(spec: str | None, world_size: int) -> list[int]:
    """``"0,2"`` / ``"0-3"`` / ``"all"`` / ``None`` -> sorted ranks, validated against ``world_size``."""
    if spec is None or str(spec).strip() in ("", "all"):
        return list(range(world_size))
    ranks: set[int] = set()
    for part in str(spec).split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            if sep:
                ranks.update(range(int(lo), int(hi) + 1))
            else:
                ranks.add(int(part))
        except ValueError:
            raise PoolError(f"--ranks {spec}: want rank numbers like 0,1 or 0-3 or all") from None
    bad = sorted(r for r in ranks if not 0 <= r < world_size)
    if bad or not ranks:
        raise PoolError(f"--ranks {spec}: the pool has ranks 0..{world_size - 1}")
    return sorted(ranks)
