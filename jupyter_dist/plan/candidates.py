"""Candidate names as data: ``fsdp2+tp2+sp`` parsed into a strategy and model-parallel degrees (stdlib only).

The planner names a candidate by its strategy plus the degrees of :meth:`ParallelDims.label` (``fsdp2``,
``fsdp2+tp2+sp``, ``zero1+tp4+pp2``, ``fsdp2+ep4``). Everything that takes a strategy from a user (``%%dist_train
--strategy``/``--plan``, the wizard's Launch, ``start_run``, pools) reads it with :func:`parse_candidate`, checks it
against :data:`RUNNABLE` and turns it into a mesh for the processes it gets with :func:`resolve_launch`, so no
dimension is ever dropped on the way to the workers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..errors import ParallelismError, PlanInputError
from .parallel import DegreesDoNotDivide, ParallelDims, check_degree, degrees_label
from .strategies import MODEL_PARALLEL, SIMPLEST, STRATEGIES, StrategySpec, get_strategy
from .units import close_match_hint

__all__ = [
    "CandidateName", "LaunchChoice", "MODEL_PARALLEL_DIMS", "RUNNABLE", "composable_strategies", "parse_candidate",
    "replicates", "resolve_launch", "runnable_problem",
]  # fmt: skip

MODEL_PARALLEL_DIMS = ("tp", "pp", "cp", "ep")
"""The model-parallel degrees a candidate name can carry, in the order the planner prints them (then ``sp``)."""

RUNNABLE: dict[str, tuple[frozenset[str], str]] = {
    "tp": (MODEL_PARALLEL | {"none"},
           "tensor parallelism with {base} ({deg}) cannot run (torch's DDP cannot take DTensors); run the "
           "fsdp2+{deg} or zero1+{deg} candidate or pass --tp 1"),
    "pp": (MODEL_PARALLEL | {"none"},
           "pipeline parallelism with {base} ({deg}) cannot run; run the fsdp2+{deg} or zero1+{deg} candidate or "
           "pass --pp 1"),
    "cp": (MODEL_PARALLEL,
           "context parallelism with {base} ({deg}) cannot run; run the fsdp2+{deg} candidate (model states are "
           "sharded over dp x cp) or pass --cp 1"),
    "ep": (MODEL_PARALLEL,
           "expert parallelism with {base} ({deg}) cannot run; run the fsdp2+{deg} candidate or pass --ep 1"),
}  # fmt: skip
"""What the workers can run today: model-parallel dim -> (base strategies it runs with, the refusal).

The strategies are the table's model-parallel ones (:data:`~.strategies.MODEL_PARALLEL`; ``"none"`` is a plain
single-mesh run): flip a strategy's ``model_parallel`` when the worker learns to compose it. Data-parallel
names alone always run; ``sp`` runs wherever its ``tp`` does. ``zero1`` with model parallelism runs as FSDP2 with
``reshard_after_forward=False`` (optimizer states and gradients sharded, parameters kept from forward to backward;
the planner's memory for it is that layout's)."""


def composable_strategies() -> list[str]:
    """Base strategies a model-parallel degree may be attached to (``none`` and DDP, FSDP2, HSDP, ZeRO-1)."""
    return ["none"] + [s.name for s in STRATEGIES.values() if s.model_parallel or s.family in ("ddp", "fsdp2")]


_DEGREE = re.compile(r"^(tp|pp|cp|ep)(\d+)$")


def _valid_forms(extra: tuple[str, ...] = ()) -> str:
    return (
        f"valid: {', '.join([*extra, 'none', *STRATEGIES])}, or a candidate name "
        f"{'|'.join(composable_strategies())} followed by +tpN, +ppN, +cpN, +epN and +sp (e.g. fsdp2+tp2+sp, "
        "zero1+tp4+pp2, fsdp2+ep4)"
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class CandidateName:
    """A strategy plus model-parallel degrees, as a candidate name spells it; data parallelism fills the rest."""

    strategy: str = "none"
    """Base strategy: ``"none"`` or a canonical name of :data:`~jupyter_dist.plan.strategies.STRATEGIES`."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline stages."""
    cp: int = 1
    """Context-parallel degree."""
    ep: int = 1
    """Expert-parallel degree."""
    sp: bool = False
    """Sequence parallelism (needs ``tp >= 2``)."""

    def __post_init__(self) -> None:
        if self.strategy != "none" and self.strategy not in STRATEGIES:
            raise PlanInputError(f"unknown strategy {self.strategy!r}; {_valid_forms()}")
        for dim in MODEL_PARALLEL_DIMS:
            check_degree(dim, getattr(self, dim))
        if self.sp and self.tp < 2:
            raise ParallelismError("sequence parallelism (sp) splits tensor-parallel regions: it needs tp >= 2")
        if self.model_parallel and self.strategy not in composable_strategies():
            raise ParallelismError(
                f"{self.strategy} does not combine with tp/pp/cp/ep; use one of "
                f"{', '.join(composable_strategies())} with the degrees, or drop them"
            )

    @property
    def spec(self) -> StrategySpec | None:
        """The base strategy's spec (``None`` for ``"none"``)."""
        return None if self.strategy == "none" else STRATEGIES[self.strategy]

    @property
    def model_parallel(self) -> bool:
        """Any of tp, pp, cp, ep above 1."""
        return max(self.tp, self.pp, self.cp, self.ep) > 1

    @property
    def model_size(self) -> int:
        """Processes one data-parallel replica spans: ``tp * pp * cp``."""
        return self.tp * self.pp * self.cp

    def degrees(self) -> str:
        """The model-parallel part, e.g. ``"tp2+sp"`` (empty for pure data parallel): :meth:`ParallelDims.label`'s."""
        return degrees_label(tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, sp=self.sp)

    @property
    def name(self) -> str:
        """Canonical name, as the planner prints it (``"fsdp2+tp2+sp"``)."""
        extra = self.degrees()
        return f"{self.strategy}+{extra}" if extra else self.strategy

    def with_degrees(self, **overrides: int | bool | None) -> CandidateName:
        """The same name with the degrees given (``None``: keep); ``tp=1`` also drops ``sp`` unless ``sp`` is given."""
        given = {k: v for k, v in overrides.items() if v is not None}
        if given.get("tp") == 1 and "sp" not in given:
            given["sp"] = False
        return replace(self, **given)  # type: ignore[arg-type]

    def dims_for(self, world: int) -> ParallelDims:
        """The degrees on ``world`` processes (dp fills the rest); an error names both numbers when they don't fit.

        The check is :meth:`ParallelDims.split`'s, worded for a launch (the candidate's name, the processes given).
        """
        try:
            return ParallelDims.from_world(world, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, sp=self.sp)
        except DegreesDoNotDivide as exc:
            raise ParallelismError(
                f"{self.name} needs a multiple of tp x pp x cp = {exc.model} processes; {world} given"
            ) from None


def parse_candidate(name: str, *, also: tuple[str, ...] = ()) -> CandidateName:
    """Parse a candidate name (``"fsdp2+tp2+sp"``, ``"zero1+tp4+pp2"``, ``"ddp"``, ``"none"``, aliases allowed).

    Strict: each degree at most once, ``sp`` only with ``tp``, degrees only on a strategy that composes; the error is
    one line listing the valid forms (``also``: words the caller accepts besides, e.g. ``("auto",)``).
    """
    if not isinstance(name, str) or not name.strip():
        raise PlanInputError(f"empty strategy name; {_valid_forms(also)}")
    base, *rest = [p.strip() for p in name.strip().lower().split("+")]
    if base == "none":
        strategy = "none"
    else:
        try:
            strategy = get_strategy(base).name
        except PlanInputError:
            where = f" in {name!r}" if rest else close_match_hint(base, [*also, "none", *STRATEGIES])
            raise PlanInputError(f"unknown strategy {base!r}{where}; {_valid_forms(also)}") from None
    seen: dict[str, int | bool] = {}
    for part in rest:
        m = _DEGREE.match(part)
        key = "sp" if part == "sp" else m.group(1) if m else None
        if key is None:
            raise PlanInputError(f"{part!r} in {name!r} is not a degree; {_valid_forms(also)}")
        if key in seen:
            raise PlanInputError(f"{key} appears twice in {name!r}; {_valid_forms(also)}")
        seen[key] = True if key == "sp" else int(m.group(2))  # type: ignore[union-attr]
    return CandidateName(strategy=strategy, **seen)  # type: ignore[arg-type]


def runnable_problem(cand: CandidateName) -> str | None:
    """Why the workers cannot run ``cand`` yet (one line, from :data:`RUNNABLE`), or ``None`` when they can."""
    for dim in MODEL_PARALLEL_DIMS:
        degree = getattr(cand, dim)
        if degree > 1:
            bases, why = RUNNABLE[dim]
            if cand.strategy not in bases:
                return why.format(base=cand.strategy, deg=f"{dim}{degree}")
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchChoice:
    """What a launch runs: the candidate, its mesh on the processes given, and what changed from the plan."""

    candidate: CandidateName
    """The strategy and model-parallel degrees the workers apply."""
    dims: ParallelDims
    """The degrees on this launch's processes."""
    dp_replicate: int = 1
    """HSDP replicas (``JD_DP_REPLICATE``) when a hybrid strategy runs with tensor parallelism; else 1."""
    note: str | None = None
    """One line when a plan runs on fewer (or more) processes than it was made for: what is kept, what changes."""

    @property
    def strategy(self) -> str:
        """The base strategy (``JD_STRATEGY``)."""
        return self.candidate.strategy

    def mesh(self) -> str:
        """``"mesh: dp_shard=2 x tp=2 (4 processes), sequence parallel on"``.

        A strategy that shards nothing (DDP, FSDP ``NO_SHARD``, ``none``) replicates: its data-parallel ranks are
        ``dp_replicate`` (``"mesh: dp_replicate=2 (2 processes)"``).
        """
        d = self.dims
        if replicates(self.strategy) and self.dp_replicate == 1:
            axes = [("pp", d.pp), ("dp_replicate", d.dp), ("cp", d.cp), ("tp", d.tp)]
            shown = [f"{n}={v}" for n, v in axes if v > 1 or n == "dp_replicate"]
        else:
            axes = [("pp", d.pp), ("dp_replicate", self.dp_replicate), ("dp_shard", d.dp // self.dp_replicate),
                    ("cp", d.cp), ("tp", d.tp)]  # fmt: skip
            shown = [f"{n}={v}" for n, v in axes if v > 1 or n == "dp_shard"]
        extra = [f"ep={d.ep} (borrowed from dp x cp)"] if d.ep > 1 else []
        sp = ", sequence parallel on" if d.sp else ""
        return f"mesh: {' x '.join(shown + extra)} ({d.world_size} processes){sp}"

    @property
    def degrees(self) -> ParallelDims:
        """:attr:`dims` with this launch's HSDP replicas (``dp_replicate``): what a run record keeps."""
        return replace(self.dims, dp_replicate=self.dp_replicate)

    def worker_fields(self) -> dict[str, Any]:
        """The :class:`~jupyter_dist.worker._env.WorkerEnv` fields this choice sets."""
        d = self.dims
        return {"strategy": self.strategy, "tp": d.tp, "pp": d.pp, "cp": d.cp, "ep": d.ep, "sp": d.sp,
                "dp_replicate": self.dp_replicate}  # fmt: skip


def replicates(strategy: str) -> bool:
    """Whether ``strategy`` keeps every model state whole on each data-parallel rank (DDP, FSDP NO_SHARD, none)."""
    if strategy in ("", "none", "auto"):
        return strategy == "none"
    spec = STRATEGIES.get(strategy)
    return spec is not None and not (spec.shard_optimizer or spec.shard_grads or spec.shard_params)


def resolve_launch(
    strategy: str, plan: Any, world: int, *, nproc_per_node: int | None = None,
    degrees: Mapping[str, int | bool | None] | None = None,
) -> LaunchChoice:  # fmt: skip
    """What ``world`` processes run for ``--strategy`` (auto, a name, a candidate name), ``--plan`` and the degrees.

    ``degrees`` are ``--tp/--pp/--cp/--ep/--sp`` (``None``: not given).
    Refuses what the workers cannot run yet and degrees that do not fit ``world``.

    ``auto`` takes the plan's recommended candidate (else DDP for more than one process); a name the plan has keeps
    its degrees; explicit degrees override the name's (``--pp 1`` drops pipeline stages, on purpose).
    """
    if not isinstance(world, int) or world < 1:
        raise PlanInputError(f"the number of processes must be >= 1, got {world!r}")
    degrees = dict(degrees or {})
    for dim, value in degrees.items():
        if dim not in (*MODEL_PARALLEL_DIMS, "sp"):
            raise PlanInputError(f"unknown degree {dim!r}; valid: {', '.join(MODEL_PARALLEL_DIMS)}, sp")
        if dim != "sp" and value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ParallelismError(f"--{dim} must be a positive integer, got {value!r}")
    best = getattr(plan, "best", None) if plan is not None else None
    planned_world = getattr(plan, "world_size", None) if plan is not None else None
    if strategy == "auto":
        if best is not None:
            cand = parse_candidate(best.name)
        else:
            cand = CandidateName(strategy=SIMPLEST if world > 1 else "none")
    else:
        cand = parse_candidate(strategy, also=("auto",))
    if degrees.get("sp") and degrees.get("tp") is None and cand.tp < 2:
        raise ParallelismError("--sp needs tensor parallelism: pass --tp N (N >= 2) or a +tpN candidate")
    cand = cand.with_degrees(**degrees)
    problem = runnable_problem(cand)
    if problem:
        raise ParallelismError(problem)
    training = getattr(plan, "training", None) if plan is not None else None
    if cand.pp > 1 and getattr(training, "pp_light_edges", False):
        raise ParallelismError(
            "the plan splits the pipeline as Llama 3 does (pp-light-edges: the first and last stage one layer "
            "fewer), which the workers do not run; plan without pp-light-edges to launch it, or launch with --pp 1"
        )
    dims = cand.dims_for(world)
    note = None
    if plan is not None and isinstance(planned_world, int) and planned_world != world:
        kept = cand.degrees() or "no model-parallel degrees (data parallel only)"
        planned_dp = planned_world // cand.model_size if planned_world % cand.model_size == 0 else None
        dp_from = f"dp from {planned_dp} to {dims.dp}" if planned_dp else f"dp is {dims.dp}"
        note = (f"rehearsal of {cand.name} (planned for {planned_world} processes) on {world}: keeps {kept}; "
                f"{dp_from}")  # fmt: skip
    dp_replicate = 1
    spec = cand.spec
    if spec is not None and spec.hybrid and spec.family == "fsdp2":  # the mesh's replicas are then the plan's
        dp_replicate = dims.hybrid_replicas(nproc_per_node or world)
    return LaunchChoice(candidate=cand, dims=dims, dp_replicate=dp_replicate, note=note)
