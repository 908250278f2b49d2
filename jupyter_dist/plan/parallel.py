"""Parallel degrees as a value object, in the manner of torchtitan's ``ParallelDims`` (stdlib only)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ParallelismError

__all__ = ["ParallelDims"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelDims:
    """How the world is split: ``world = dp * tp * pp * cp``; ``ep`` borrows ranks from ``dp * cp``.

    Model states are sharded (by ZeRO/FSDP) over the ``dp * cp`` ranks that hold the same parameters, as
    torchtitan does; experts are split ``ep`` ways and their states sharded over the remaining ``dp * cp / ep``.
    """

    dp: int = 1
    """Data-parallel replicas (each sees different samples)."""
    tp: int = 1
    """Tensor-parallel degree (Megatron-LM column/row splits)."""
    pp: int = 1
    """Pipeline stages."""
    cp: int = 1
    """Context-parallel degree (the sequence split across ranks, ring attention)."""
    ep: int = 1
    """Expert-parallel degree (MoE experts split across ranks)."""
    sp: bool = False
    """Sequence parallelism with TP (Korthikanti et al. 2022): norms and dropout split along the sequence."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ParallelismError(f"{name} must be a positive integer, got {value!r}")
        if (self.dp * self.cp) % self.ep:
            raise ParallelismError(
                f"ep ({self.ep}) must divide dp x cp ({self.dp} x {self.cp} = {self.dp * self.cp}): "
                "expert parallelism borrows data-parallel ranks"
            )
        if self.sp and self.tp == 1:
            object.__setattr__(self, "sp", False)

    @classmethod
    def from_world(
        cls, world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, dp: int = -1,
        sp: bool = False, gpus_per_node: int | None = None,
    ) -> ParallelDims:
        """Fill ``dp = -1`` with what is left of ``world_size``; explain any degree that does not divide."""
        for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
            if not isinstance(value, int) or value < 1:
                raise ParallelismError(f"{name} must be a positive integer, got {value!r}")
        model = tp * pp * cp
        nodes = world_size // gpus_per_node if gpus_per_node else 0
        where = f" ({nodes} node{'s' if nodes > 1 else ''} x {gpus_per_node} GPUs)" if gpus_per_node else ""
        if dp == -1:
            if world_size % model:
                raise ParallelismError(
                    f"tp ({tp}) x pp ({pp}) x cp ({cp}) = {model} does not divide world size {world_size}{where}; "
                    f"choose degrees whose product divides {world_size}"
                )
            dp = world_size // model
        elif dp * model != world_size:
            raise ParallelismError(
                f"dp ({dp}) x tp ({tp}) x pp ({pp}) x cp ({cp}) = {dp * model} != world size {world_size}{where}; "
                "set dp=-1 to infer it"
            )
        return cls(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, sp=sp)

    @property
    def world_size(self) -> int:
        """Ranks these degrees use."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def shard_size(self) -> int:
        """Ranks over which ZeRO/FSDP shard dense model states (``dp * cp``)."""
        return self.dp * self.cp

    @property
    def expert_shard_size(self) -> int:
        """Ranks over which ZeRO/FSDP shard one expert's states (``dp * cp / ep``)."""
        return self.dp * self.cp // self.ep

    def hybrid_replicas(self, gpus_per_node: int) -> int:
        """HSDP's replica count (``JD_DP_REPLICATE``) when it shards inside a node and replicates across nodes.

        On the device mesh ``(pp, dp_replicate, dp_shard, cp, tp)`` (row-major, tp innermost) one pipeline stage's
        ranks are consecutive, so a node holds ``min(gpus_per_node, world / pp)`` of them; a shard group is
        ``dp_shard`` whole ``cp x tp`` blocks, so ``dp_shard`` is the largest divisor of ``dp`` whose blocks fit in
        that (1 when one ``cp x tp`` block already spans nodes) and the rest of ``dp`` replicates. The planner's
        memory, the launch and the worker's mesh all use this one count.
        """
        in_node = min(max(1, gpus_per_node), self.world_size // self.pp)
        return self.dp // math.gcd(self.dp, max(1, in_node // (self.cp * self.tp)))

    @property
    def is_data_parallel_only(self) -> bool:
        """No model parallelism of any kind."""
        return self.tp == self.pp == self.cp == self.ep == 1

    def label(self) -> str:
        """Short label of the model-parallel part, e.g. ``"tp4+pp2"`` (empty for pure data parallel)."""
        parts = [f"{n}{v}" for n, v in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("ep", self.ep)) if v > 1]
        if self.sp:
            parts.append("sp")
        return "+".join(parts)

    def to_dict(self) -> dict[str, int | bool]:
        """Return ``{"dp", "tp", "pp", "cp", "ep", "sp"}``."""
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep, "sp": self.sp}

    @classmethod
    def from_dict(cls, data: dict[str, int | bool]) -> ParallelDims:
        """Inverse of :meth:`to_dict`."""
        return cls(**{k: data[k] for k in ("dp", "tp", "pp", "cp", "ep", "sp") if k in data})  # type: ignore[arg-type]
