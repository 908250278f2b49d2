"""Where a pipeline cuts a model: contiguous layer ranges per stage, balanced by cost (stdlib only).

The first stage also runs the input embedding and the last the final norm and output head; on a large vocabulary
the head costs as much as several blocks (2 * h * V FLOPs per token against about 24 * h^2 for a block), so equal
numbers of layers per stage overload the last one. Narayanan et al. 2021 (Megatron-LM, section 3.1) and torchtitan's
pipeline splitting both give the edge stages fewer blocks; here the split minimises the most loaded stage exactly.
"""

from __future__ import annotations

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

    if n_stages == 1:
        return [(0, n_layers)]
    extra = [first_extra] + [0.0] * (n_stages - 2) + [last_extra]

    def capacities(limit: float) -> list[int] | None:
        caps = [int(limit - e + 1e-9) for e in extra]  # the most blocks each stage can take under the limit
        return caps if min(caps) >= 1 and sum(caps) >= n_layers else None

    # the smallest feasible largest cost is a block count plus an edge's extra (or a plain block count)
    limits = sorted({k + e for k in range(1, n_layers + 1) for e in (0.0, first_extra, last_extra)})
    caps = next(c for c in (capacities(m) for m in limits) if c is not None)
    # then take blocks away from the costliest stages (ties: the later one) until the layers are exactly covered;
    # for a separable convex objective this greedy gives the most even split (smallest sum of squared costs)
    for _ in range(sum(caps) - n_layers):
        i = max((k for k in range(n_stages) if caps[k] > 1), key=lambda k: (caps[k] + extra[k], k))
        caps[i] -= 1
    bounds, start = [], 0
    for c in caps:
        bounds.append((start, start + c))
        start += c
    return bounds


def stage_costs(bounds: list[tuple[int, int]], *, first_extra: float = 0.0, last_extra: float = 0.0) -> list[float]:
    """The cost of each stage of ``bounds`` (blocks, plus the edge extras)."""
    n = len(bounds)
    return [
        (end - start) + (first_extra if i == 0 else 0.0) + (last_extra if i == n - 1 else 0.0)
        for i, (start, end) in enumerate(bounds)
    ]
