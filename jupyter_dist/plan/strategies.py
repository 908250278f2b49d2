"""The candidate strategies as data: what each one shards, offloads and how it communicates (stdlib only)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import PlanInputError
from .units import close_match_hint

__all__ = [
    "FAMILIES", "FSDP1_SHARDING", "MODEL_PARALLEL", "SIMPLEST", "StrategySpec", "STRATEGIES", "get_strategy", "runs_as",
    "strategy_names",
]  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class StrategySpec:
    """One way of distributing model states (ZeRO stage / FSDP sharding strategy / DDP)."""

    name: str
    """CLI name, e.g. ``"zero2"``."""
    label: str
    """Human name, e.g. ``"DeepSpeed ZeRO-2"``."""
    family: str
    """Implementation: ``"ddp"`` (torch DDP), ``"deepspeed"``, ``"fsdp"`` (FSDP1 wrapper) or ``"fsdp2"``."""
    shard_optimizer: bool = False
    """Optimizer states (and fp32 master weights) are partitioned across the data-parallel ranks."""
    shard_grads: bool = False
    """Gradients are reduce-scattered and partitioned."""
    shard_params: bool = False
    """Parameters are partitioned and all-gathered around each use."""
    hybrid: bool = False
    """Shard within a node only and replicate across nodes (FSDP HYBRID_SHARD / HSDP)."""
    keeps_gathered_params: bool = False
    """Gathered parameters stay alive from forward to backward (FSDP SHARD_GRAD_OP)."""
    offload_optimizer: bool = False
    """Optimizer states, master weights and gradient partitions live in CPU memory; the step runs on CPU."""
    offload_params: bool = False
    """Parameters live in CPU memory and are fetched for each use."""
    fsdp1_sharding: str = ""
    """FSDP1 wrapper only: the ``torch.distributed.fsdp.ShardingStrategy`` member (``"FULL_SHARD"``, ...)."""
    model_parallel: bool = False
    """Can be combined with tensor/pipeline/context/expert parallelism (torchtitan FSDP2, Megatron ZeRO-1)."""
    complexity: int = 0
    """Tie-breaker: among candidates within 3% of the best throughput the simplest wins."""
    summary: str = ""
    """One sentence on what it does."""

    @property
    def fsdp2_with_model_parallelism(self) -> bool:
        """With tp/pp/cp/ep it runs as FSDP2 keeping the gathered parameters (``zero1``; see :func:`runs_as`).

        A model-parallel strategy of another family: DeepSpeed's engine cannot take DTensors. Read it on the table's
        entry (``get_strategy(spec.name)``): the spec :func:`runs_as` answers has the family it runs as.
        """
        return self.model_parallel and self.family != "fsdp2"


STRATEGIES: dict[str, StrategySpec] = {
    s.name: s
    for s in (
        StrategySpec(name="ddp", label="PyTorch DDP", family="ddp", complexity=0,
                     summary="every GPU holds all model states; gradients are all-reduced"),
        StrategySpec(name="zero1", label="DeepSpeed ZeRO-1", family="deepspeed", shard_optimizer=True,
                     model_parallel=True, complexity=1,
                     summary="optimizer states partitioned across data-parallel ranks"),
        StrategySpec(name="zero2", label="DeepSpeed ZeRO-2", family="deepspeed", shard_optimizer=True,
                     shard_grads=True, complexity=2,
                     summary="optimizer states and gradients partitioned"),
        StrategySpec(name="zero3", label="DeepSpeed ZeRO-3", family="deepspeed", shard_optimizer=True,
                     shard_grads=True, shard_params=True, complexity=3,
                     summary="optimizer states, gradients and parameters partitioned; parameters gathered per layer"),
        StrategySpec(name="zero2-offload", label="DeepSpeed ZeRO-2 + optimizer offload", family="deepspeed",
                     shard_optimizer=True, shard_grads=True, offload_optimizer=True, complexity=5,
                     summary="ZeRO-2 with optimizer states and step on the CPU (ZeRO-Offload)"),
        StrategySpec(name="zero3-offload", label="DeepSpeed ZeRO-3 + optimizer offload", family="deepspeed",
                     shard_optimizer=True, shard_grads=True, shard_params=True, offload_optimizer=True,
                     complexity=6, summary="ZeRO-3 with optimizer states and step on the CPU"),
        StrategySpec(name="zero3-offload-params", label="DeepSpeed ZeRO-3 + optimizer and parameter offload",
                     family="deepspeed", shard_optimizer=True, shard_grads=True, shard_params=True,
                     offload_optimizer=True, offload_params=True, complexity=7,
                     summary="ZeRO-Infinity style: parameters and optimizer in CPU memory"),
        StrategySpec(name="fsdp-no-shard", label="FSDP NO_SHARD", family="fsdp", fsdp1_sharding="NO_SHARD",
                     complexity=1, summary="FSDP wrapper without sharding (equivalent to DDP)"),
        StrategySpec(name="fsdp-shard-grad-op", label="FSDP SHARD_GRAD_OP", family="fsdp",
                     fsdp1_sharding="SHARD_GRAD_OP", shard_optimizer=True, shard_grads=True,
                     keeps_gathered_params=True, complexity=2,
                     summary="gradients and optimizer sharded; parameters gathered once and kept until backward"),
        StrategySpec(name="fsdp-full-shard", label="FSDP FULL_SHARD", family="fsdp", fsdp1_sharding="FULL_SHARD",
                     shard_optimizer=True, shard_grads=True, shard_params=True, complexity=3,
                     summary="everything sharded; parameters gathered per unit in forward and again in backward"),
        StrategySpec(name="fsdp-hybrid-shard", label="FSDP HYBRID_SHARD", family="fsdp", fsdp1_sharding="HYBRID_SHARD",
                     shard_optimizer=True, shard_grads=True, shard_params=True, hybrid=True, complexity=3,
                     summary="FULL_SHARD inside each node, replicas across nodes"),
        StrategySpec(name="fsdp2", label="FSDP2 fully_shard", family="fsdp2", shard_optimizer=True,
                     shard_grads=True, shard_params=True, model_parallel=True, complexity=3,
                     summary="per-parameter (DTensor) sharding with fully_shard; composes with TP/PP/CP/EP"),
        StrategySpec(name="fsdp2-hybrid", label="FSDP2 HSDP (2-D mesh)", family="fsdp2", shard_optimizer=True,
                     shard_grads=True, shard_params=True, hybrid=True, model_parallel=True, complexity=3,
                     summary="fully_shard on a (replicate, shard) mesh: shard inside a node, replicate across"),
    )
}  # fmt: skip


FAMILIES: tuple[str, ...] = tuple(dict.fromkeys(s.family for s in STRATEGIES.values()))
"""The strategy families (implementations), in the table's order: ``ddp``, ``deepspeed``, ``fsdp``, ``fsdp2``."""

MODEL_PARALLEL: frozenset[str] = frozenset(s.name for s in STRATEGIES.values() if s.model_parallel)
"""Strategies that combine with tensor/pipeline/context/expert parallelism (FSDP2, HSDP, and ``zero1`` as FSDP2)."""

SIMPLEST: str = min(STRATEGIES.values(), key=lambda s: s.complexity).name
"""The strategy of least complexity (DDP): what a run without a plan uses on more than one process."""

FSDP1_SHARDING: dict[str, str] = {s.name: s.fsdp1_sharding for s in STRATEGIES.values() if s.family == "fsdp"}
"""FSDP1 strategy name -> member of ``torch.distributed.fsdp.ShardingStrategy`` (from :data:`STRATEGIES`)."""


def runs_as(spec: StrategySpec, *, model_parallel: bool, grad_accum: int | None = None) -> StrategySpec:
    """The layout a worker runs for ``spec`` (what the memory model must count).

    ``zero1`` with tensor/pipeline/context/expert parallelism runs as FSDP2 with ``reshard_after_forward=False``
    over the data-parallel dims (DeepSpeed's engine cannot take DTensors): optimizer states and gradients sharded,
    parameters sharded at rest and gathered once per step, kept from forward to backward -- SHARD_GRAD_OP's memory,
    at most ZeRO-1's, with the same all-gather + reduce-scatter volume as ZeRO-1's all-reduce.

    ``zero1`` on DeepSpeed holds its gradients as DeepSpeed implements stage 1, not as the ZeRO paper's P_os
    (whole gradients, all-reduced): stage 1 is the stage-2 optimizer (``DeepSpeedZeroOptimizer`` with
    ``partition_grads=False``, deepspeed/runtime/zero/stage_1_and_2.py) and, at a gradient-accumulation boundary,
    reduces each gradient through the stage-2 buckets and keeps only its own partition
    (``reduce_ipg_grads``: "zero stage 1 - partition only optimizer state" still ``copy_grads_in_partition``; the
    rest stays a view of the reused bucket). With the ``overlap_comm`` our DeepSpeed config sets, that happens in
    backward as each gradient is ready, so with one micro-batch per step (every backward is a boundary) the
    gradients are partitioned as ZeRO-2's: measured 2P/N in bf16 (tests/test_memory_measured.py). Between boundaries
    stage 1 does not communicate (``engine.allreduce_gradients``: "Communicate only at gradient accumulation
    boundaries"), so with ``grad_accum`` > 1 the gradients accumulate whole, the paper's figure.
    """
    if spec.fsdp2_with_model_parallelism and model_parallel:
        return replace(spec, family="fsdp2", shard_grads=True, keeps_gathered_params=True)
    if spec.name == "zero1" and spec.family == "deepspeed" and grad_accum == 1:
        return replace(spec, shard_grads=True)
    return spec


def strategy_names() -> list[str]:
    """CLI names of every strategy."""
    return list(STRATEGIES)


_ALIASES = {
    "zero-1": "zero1", "zero-2": "zero2", "zero-3": "zero3", "zero3-offload-optimizer": "zero3-offload",
    "zero2-offload-optimizer": "zero2-offload", "zero-infinity": "zero3-offload-params", "no-shard": "fsdp-no-shard",
    "shard-grad-op": "fsdp-shard-grad-op", "full-shard": "fsdp-full-shard", "fsdp": "fsdp-full-shard",
    "hybrid-shard": "fsdp-hybrid-shard", "hsdp": "fsdp2-hybrid", "fsdp1": "fsdp-full-shard",
}  # fmt: skip


def get_strategy(name: str | StrategySpec) -> StrategySpec:
    """Look a strategy up by CLI name or alias (``"zero-3"``, ``"full_shard"``, ``"hsdp"``)."""
    if isinstance(name, StrategySpec):
        return name
    key = name.strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key not in STRATEGIES:
        raise PlanInputError(
            f"unknown strategy {name!r}{close_match_hint(key, list(STRATEGIES))}; valid: {', '.join(STRATEGIES)}"
        )
    return STRATEGIES[key]
