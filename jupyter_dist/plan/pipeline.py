"""Where a pipeline cuts a model: contiguous layer ranges per stage, balanced by cost (stdlib only).

The first stage also runs the input embedding and the last the final norm and output head; on a large vocabulary
the head costs as much as several blocks (2 * h * V FLOPs per token against about 24 * h^2 for a block), so equal
numbers of layers per stage overload the last one. Narayanan et al. 2021 (Megatron-LM, section 3.1) and torchtitan's
pipeline splitting both give the edge stages fewer blocks; here the split minimises the most loaded stage exactly.

Also the order in which each schedule runs a rank's forwards and backwards (:func:`schedule_actions`), as
``torch.distributed.pipelining`` runs them: the planner counts from it what a rank holds for backward at its peak.
"""

from __future__ import annotations

from ..errors import ParallelismError

__all__ = ["PP_SCHEDULES", "schedule_actions", "stage_bounds", "stage_costs", "stages_per_rank"]

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
"""Pipeline schedules (``JD_PP_SCHEDULE``): GPipe (all forwards, then all backwards), 1F1B and interleaved 1F1B."""


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


def stages_per_rank(schedule: str, virtual: int = 0) -> int:
    """Pipeline stages each rank holds: ``virtual`` if given, else 2 for interleaved 1F1B and 1 otherwise."""
    if schedule not in PP_SCHEDULES:
        raise ParallelismError(f"unknown pipeline schedule {schedule!r}; valid: {', '.join(PP_SCHEDULES)}")
    if virtual:
        return virtual
    return 2 if schedule == "interleaved-1f1b" else 1


def schedule_actions(
    schedule: str, *, pp: int, microbatches: int, rank: int, virtual: int = 1
) -> list[tuple[str, int]]:
    """The forwards (``"F"``) and backwards (``"B"``) pp rank ``rank`` runs in one step, in order, with their stage.

    Stage ``i`` of ``pp * virtual`` lives on rank ``i % pp``. The order is PyTorch 2.13's
    (``torch/distributed/pipelining/schedules.py``):

    - ``gpipe`` (``ScheduleGPipe``): every micro-batch's forward, then every backward;
    - ``1f1b`` (``Schedule1F1B``): stage ``s`` warms up with ``min(m, pp - s)`` forwards, then alternates one
      backward and one forward, then drains the backwards;
    - ``interleaved-1f1b`` (``ScheduleInterleaved1F1B``, Narayanan et al. 2021): micro-batches go in rounds of
      ``m / max(1, m // pp)``; rank ``r`` warms up with ``(virtual - 1) * per_round + 2 * (pp - 1 - r)`` forwards
      (at most ``m * virtual``), taking its stages in turn, one round each, then alternates one forward and one
      backward (the backwards from its last stage down) and drains the backwards.
    """
    m, v = microbatches, virtual
    if min(pp, m, v) < 1 or not 0 <= rank < pp:
        raise ParallelismError(f"pipeline of {pp} ranks, {m} micro-batches, {v} stages per rank: rank {rank} invalid")
    if schedule in ("gpipe", "1f1b"):
        if v != 1:
            raise ParallelismError(f"the {schedule} schedule runs one stage per rank, got {v}")
        if schedule == "gpipe":
            return [("F", rank)] * m + [("B", rank)] * m
        warmup = min(m, pp - rank)
        out = [("F", rank)] * warmup
        for _ in range(m - warmup):
            out += [("B", rank), ("F", rank)]
        return out + [("B", rank)] * warmup
    if schedule != "interleaved-1f1b":
        raise ParallelismError(f"unknown pipeline schedule {schedule!r}; valid: {', '.join(PP_SCHEDULES)}")
    rounds = max(1, m // pp)
    if m % rounds:
        raise ParallelismError(
            f"interleaved 1F1B over {pp} ranks needs a number of micro-batches that is a multiple of "
            f"{rounds} (m // pp), got {m}"
        )
    per_round = m // rounds
    total = m * v
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), total)

    def forward_stage(op: int) -> int:
        return ((op // per_round) % v) * pp + rank

    def backward_stage(op: int) -> int:
        return (v - 1 - ((op - warmup) // per_round) % v) * pp + rank

    out = [("F", forward_stage(op)) for op in range(warmup)]
    for op in range(warmup, total):
        out += [("F", forward_stage(op)), ("B", backward_stage(op))]
    return out + [("B", backward_stage(op)) for op in range(total, total + warmup)]
