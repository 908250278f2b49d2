"""Where a pipeline cuts a model: contiguous layer ranges per stage, balanced by cost (stdlib only).

The first stage also runs the input embedding and the last the final norm and output head; on a large vocabulary
the head costs as much as several blocks (2 * h * V FLOPs per token against about 24 * h^2 for a block), so equal
numbers of layers per stage overload the last one. Narayanan et al. 2021 (Megatron-LM, section 3.1) and torchtitan's
pipeline splitting both give the edge stages fewer blocks; here the split minimises the most loaded stage exactly.
"""

from __future__ import annotations

from functools import cache

from ..errors import ParallelismError

__all__ = ["stage_bounds", "stage_costs"]


def stage_bounds(
    n_layers: int, n_stages: int, *, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` layer ranges, one per stage, that minimise the largest stage cost.

    A block costs 1; ``first_extra`` / ``last_extra`` are what the embedding / the norm and head cost in blocks.
    Every stage gets at least one block. Among splits with the same largest cost, the one whose stages are most
    even (smallest sum of squared costs) wins, so the answer does not depend on search order.
    """
    if not isinstance(n_stages, int) or n_stages < 1:
        raise ParallelismError(f"pipeline stages must be a positive integer, got {n_stages!r}")
    if n_stages > n_layers:
        raise ParallelismError(
            f"{n_stages} pipeline stages need at least {n_stages} layers, the model has {n_layers}; use pp <= "
            f"{n_layers} (with interleaving: pp x virtual stages <= {n_layers})"
        )
    for name, value in (("first_extra", first_extra), ("last_extra", last_extra)):
        if not value >= 0:
            raise ParallelismError(f"{name} must be >= 0, got {value!r}")

    def cost(stage: int, start: int, end: int) -> float:
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == n_stages - 1 else 0.0)
        return (end - start) + extra

    @cache
    def best(stage: int, start: int) -> tuple[float, float, tuple[int, ...]]:
        """(max cost, sum of squares, cut points) for stages ``stage..`` over layers ``start..``."""
        left = n_stages - stage
        if left == 1:
            c = cost(stage, start, n_layers)
            return c, c * c, ()
        out: tuple[float, float, tuple[int, ...]] | None = None
        for end in range(start + 1, n_layers - left + 2):
            c = cost(stage, start, end)
            rest_max, rest_sq, cuts = best(stage + 1, end)
            cand = (max(c, rest_max), c * c + rest_sq, (end, *cuts))
            if out is None or cand[:2] < out[:2]:
                out = cand
        assert out is not None
        return out

    cuts = (0, *best(0, 0)[2], n_layers)
    return [(cuts[i], cuts[i + 1]) for i in range(n_stages)]


def stage_costs(bounds: list[tuple[int, int]], *, first_extra: float = 0.0, last_extra: float = 0.0) -> list[float]:
    """The cost of each stage of ``bounds`` (blocks, plus the edge extras)."""
    n = len(bounds)
    return [
        (end - start) + (first_extra if i == 0 else 0.0) + (last_extra if i == n - 1 else 0.0)
        for i, (start, end) in enumerate(bounds)
    ]
