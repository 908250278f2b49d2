"""Where a pipeline cuts a model: contiguous layer ranges per stage, balanced by cost (stdlib only).

The first stage also runs the input embedding and the last the final norm and output head; on a large vocabulary
the head costs as much as several blocks (2 * h * V FLOPs per token against about 24 * h^2 for a block), so equal
numbers of layers per stage overload the last one. Narayanan et al. 2021 (Megatron-LM, section 3.1) and torchtitan's
pipeline splitting both give the edge stages fewer blocks; here the split minimises the most loaded stage exactly.

Also the order in which each schedule runs a rank's forwards and backwards (:func:`schedule_actions`), as
``torch.distributed.pipelining`` runs them: the planner counts from it what a rank holds for backward at its peak.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ParallelismError

__all__ = ["MAX_PIPELINE_STAGES", "PP_SCHEDULES", "Run", "expand_runs", "light_edge_bounds", "schedule_actions",
           "schedule_runs", "stage_bounds", "stage_costs", "stages_per_rank"]  # fmt: skip

MAX_PIPELINE_STAGES = 4096
"""Most pipeline stages (pp x stages per rank) the planner models (real pipelines use tens)."""

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
    # O(log^2 L) whatever the size (an O(L^2) table of limits took a minute at a million layers): every middle stage
    # has the same extra (0), so a stage is one of three kinds (first, middle, last) and each count is a product.
    mids = n_stages - 2
    kinds = [(first_extra, 1), (0.0, mids), (last_extra, 1)]  # (extra, how many stages), in stage order

    def capacities(limit: float) -> tuple[int, int, int] | None:
        # the most blocks each stage can take under the limit
        caps = (int(limit - first_extra + 1e-9), int(limit - 0.0 + 1e-9), int(limit - last_extra + 1e-9))
        if min(c for c, (_, k) in zip(caps, kinds, strict=True) if k) < 1:
            return None
        return caps if sum(c * k for c, (_, k) in zip(caps, kinds, strict=True)) >= n_layers else None

    def first_true(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
        """The smallest integer in ``[lo, hi]`` where the monotone ``ok`` holds (None if it never does)."""
        if lo > hi or not ok(hi):
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
        return lo

    # the smallest feasible largest cost is a block count plus an edge's extra (or a plain block count); feasibility
    # grows with the limit, so a binary search per kind of limit finds it
    found = []
    for e in (0.0, first_extra, last_extra):

        def feasible(k: int, e: float = e) -> bool:
            return capacities(k + e) is not None

        if (k := first_true(1, n_layers, feasible)) is not None:
            found.append(k + e)
    caps = capacities(min(found)) or (n_layers, n_layers, n_layers)  # (never None: the least feasible limit)
    # then take blocks away from the costliest stages (ties: the later one) until the layers are exactly covered;
    # for a separable convex objective this greedy gives the most even split (smallest sum of squared costs). Taking
    # one block at a time takes the `excess` costliest removals of all (a stage at c blocks offers removals costing
    # j + extra, j = c..2), so find the cost of the last one taken and count.
    excess = sum(c * k for c, (_, k) in zip(caps, kinds, strict=True)) - n_layers

    def at_least(c: int, e: float, t: float, strict: bool = False) -> int:
        """How many of one stage's removals (costs j + e, j = 2..c) cost at least (more than, if strict) ``t``."""
        j = first_true(2, c, lambda j: j + e > t if strict else j + e >= t)
        return 0 if j is None else c - j + 1

    def removals(t: float, strict: bool = False) -> int:
        return sum(k * at_least(c, e, t, strict) for c, (e, k) in zip(caps, kinds, strict=True))

    taken = [0, 0, 0]  # removals per stage of each kind
    ties = [0, 0, 0]
    if excess:
        tops = []
        for c, (e, k) in zip(caps, kinds, strict=True):
            if k and c >= 2:
                # removals(j + e) falls as j grows: the largest j where it still reaches `excess`

                def past(j: int, e: float = e) -> bool:
                    return removals(j + e) < excess

                j = first_true(2, c, past)
                j = c if j is None else j - 1
                if j >= 2:
                    tops.append(j + e)
        cut = max(tops)
        taken = [at_least(c, e, cut, strict=True) for c, (e, _) in zip(caps, kinds, strict=True)]
        left = excess - sum(t * k for t, (_, k) in zip(taken, kinds, strict=True))
        for i in (2, 1, 0):  # the removals that cost exactly `cut`, later stages first
            c, (e, k) = caps[i], kinds[i]
            if k and left and at_least(c, e, cut) > taken[i]:
                ties[i] = min(left, k)
                left -= ties[i]
    first = caps[0] - taken[0] - ties[0]
    middle = [caps[1] - taken[1]] * (mids - ties[1]) + [caps[1] - taken[1] - 1] * ties[1]
    last = caps[2] - taken[2] - ties[2]
    bounds, start = [], 0
    for c in [first, *middle, last]:
        bounds.append((start, start + c))
        start += c
    return bounds


def light_edge_bounds(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Llama 3's split: the embedding and the output layer take a block's place each (edge stages one block fewer).

    Dubey et al. 2024, "The Llama 3 Herd of Models", arXiv:2407.21783, Sec. 3.3.2: with one block per virtual stage
    the first stage's first chunk is the embedding alone and the last stage's last chunk the output projection and
    loss alone, which balances the pipeline's compute and memory.

    ``n_layers + 2`` slots (embedding, the blocks, the output) in ``n_stages`` contiguous ranges as even as
    :func:`stage_bounds` makes them; a stage's ``[start, end)`` are the blocks of its range, so an edge stage may
    hold none (it needs ``n_stages <= n_layers + 2``).
    """
    if not isinstance(n_stages, int) or isinstance(n_stages, bool) or n_stages < 1:
        raise ParallelismError(f"pipeline stages must be a positive integer, got {n_stages!r}")
    if n_stages > n_layers + 2:
        raise ParallelismError(
            f"{n_stages} pipeline stages with light edge stages need at most {n_layers + 2} (the {n_layers} layers, "
            f"the embedding and the output); use pp x virtual stages <= {n_layers + 2}"
        )
    if n_stages == 1:
        return [(0, n_layers)]
    return [(max(0, a - 1), min(n_layers, b - 1)) for a, b in stage_bounds(n_layers + 2, n_stages)]


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


Run = tuple[tuple[Any, ...], int]
"""``(pattern, repeat)``: ``pattern``, a tuple of actions (``("F", stage)``) or of nested runs, run ``repeat`` times."""


def schedule_runs(schedule: str, *, pp: int, microbatches: int, rank: int, virtual: int = 1) -> list[Run]:
    """:func:`schedule_actions` run-length encoded, in ``O(virtual)`` runs whatever the number of micro-batches.

    A run repeats one pattern: a forward, a backward, a (backward, forward) pair of 1F1B's steady state, or an
    interleaved steady-state period (``virtual`` rounds of ``m / max(1, m // pp)`` pairs, itself made of runs), so a
    planner can follow a schedule of billions of actions in a few steps (:func:`expand_runs` gives the actions back).
    """
    m, v = microbatches, virtual
    schedule_actions(schedule, pp=pp, microbatches=min(m, pp), rank=rank, virtual=v)  # validates the shape
    if schedule == "gpipe":
        return [((("F", rank),), m), ((("B", rank),), m)]
    if schedule == "1f1b":
        warmup = min(m, pp - rank)
        return [((("F", rank),), warmup), ((("B", rank), ("F", rank)), m - warmup), ((("B", rank),), warmup)]
    rounds = max(1, m // pp)
    if m % rounds:
        schedule_actions(schedule, pp=pp, microbatches=m, rank=rank, virtual=v)  # raises the one-line error
    per_round = m // rounds
    total = m * v
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), total)

    def fwd(op: int) -> int:
        return ((op // per_round) % v) * pp + rank

    def bwd(op: int) -> int:
        return (v - 1 - ((op - warmup) // per_round) % v) * pp + rank

    def segments(lo: int, hi: int, step: Callable[[int], tuple[tuple[str, int], ...]], *marks: int) -> list[Run]:
        """Ops ``lo..hi-1`` cut where a stage can change (multiples of per_round past each mark)."""
        out: list[Run] = []
        op = lo
        while op < hi:
            nxt = min([hi] + [mark + ((op - mark) // per_round + 1) * per_round for mark in marks])
            out.append((step(op), nxt - op))
            op = nxt
        return out

    def pair(op: int) -> tuple[tuple[str, int], ...]:
        return (("F", fwd(op)), ("B", bwd(op)))

    runs = segments(0, warmup, lambda op: (("F", fwd(op)),), 0)
    period = v * per_round  # both stages repeat after it
    whole = (total - warmup) // period
    if whole > 1:
        runs.append((tuple(segments(warmup, warmup + period, pair, 0, warmup)), whole))
        runs += segments(warmup + whole * period, total, pair, 0, warmup)
    else:
        runs += segments(warmup, total, pair, 0, warmup)
    return runs + segments(total, total + warmup, lambda op: (("B", bwd(op)),), warmup)


def expand_runs(runs: list[Run] | tuple[Any, ...]) -> list[tuple[str, int]]:
    """The actions a list of :data:`Run` stands for, in order (for tests and small schedules)."""
    out: list[tuple[str, int]] = []
    for pattern, repeat in runs:
        one = list(pattern) if isinstance(pattern[0][0], str) else expand_runs(pattern)
        out += one * repeat
    return out
