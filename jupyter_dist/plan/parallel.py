"""Parallel degrees as a value object, in the manner of torchtitan's ``ParallelDims`` (stdlib only)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ParallelismError

__all__ = ["DEGREES", "DegreesDoNotDivide", "ParallelDims", "check_degree", "degrees_label"]

DEGREES = ("dp", "tp", "pp", "cp", "ep", "dp_replicate")
"""The integer degrees of :class:`ParallelDims` (``sp`` is the one flag)."""


class DegreesDoNotDivide(ParallelismError):
    """The model-parallel degrees' product does not divide the world: :attr:`model` and :attr:`world` say by how much.

    Raised by :meth:`ParallelDims.split`, the one "the degrees divide the world" check; the planner, a launch
    (:meth:`~jupyter_dist.plan.candidates.CandidateName.dims_for`) and the worker (``WorkerEnv``, ``build_mesh``) each
    word it for their reader.
    """

    def __init__(self, message: str, *, model: int, world: int) -> None:
        super().__init__(message)
        self.model = model
        """The product of the degrees (``tp x pp x cp``, times ``dp_replicate`` where given)."""
        self.world = world
        """The processes it had to divide."""


def degrees_label(*, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, sp: bool = False) -> str:
    """The model-parallel degrees as a candidate name spells them (``"tp4+pp2"``, ``"tp2+sp"``; empty: none)."""
    parts = [f"{n}{v}" for n, v in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)) if v > 1]
    return "+".join(parts + (["sp"] if sp else []))


def check_degree(name: str, value: object) -> int:
    """``value`` when it is a positive integer (not a bool), else ``ParallelismError`` naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ParallelismError(f"{name} must be a positive integer, got {value!r}")
    return value


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
    dp_replicate: int = 1
    """HSDP replicas among the ``dp`` ranks (a launch's ``JD_DP_REPLICATE``; 1: no replicate dimension). The planner
    leaves it at 1 (it counts replicas with :meth:`hybrid_replicas`); a launch and a run record carry it."""

    def __post_init__(self) -> None:
        for name in DEGREES:
            check_degree(name, getattr(self, name))
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
            dp = cls.split(world_size, tp=tp, pp=pp, cp=cp, where=where)
        elif dp * model != world_size:
            raise ParallelismError(
                f"dp ({dp}) x tp ({tp}) x pp ({pp}) x cp ({cp}) = {dp * model} != world size {world_size}{where}; "
                "set dp=-1 to infer it"
            )
        return cls(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, sp=sp)

    @staticmethod
    def split(world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, dp_replicate: int = 1,
              where: str = "") -> int:  # fmt: skip
        """The data-parallel ranks ``world_size`` leaves: the one "the degrees divide the world" check.

        ``tp x pp x cp`` (times ``dp_replicate``, where a launch fixed HSDP's replicas) must divide ``world_size``;
        else :class:`DegreesDoNotDivide`, worded for the planner (``where``: the hardware, e.g. ``" (1 node x 8
        GPUs)"``) and carrying the numbers for the launch's and the worker's own wording.
        """
        model = tp * pp * cp * dp_replicate
        if world_size % model:
            rep = f" x dp_replicate ({dp_replicate})" if dp_replicate != 1 else ""
            raise DegreesDoNotDivide(
                f"tp ({tp}) x pp ({pp}) x cp ({cp}){rep} = {model} does not divide world size {world_size}{where}; "
                f"choose degrees whose product divides {world_size}",
                model=model, world=world_size,
            )  # fmt: skip
        return world_size // (tp * pp * cp)

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
        return degrees_label(tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, sp=self.sp)

    def to_dict(self, *, replicas: bool = False) -> dict[str, int | bool]:
        """Return ``{"dp", "tp", "pp", "cp", "ep", "sp"}``, and ``"dp_replicate"`` when not 1 or ``replicas``.

        A plan's candidates write the six keys (the planner leaves ``dp_replicate`` at 1); a run record writes all
        seven (``replicas=True``), the layout ``run.json`` has always had.
        """
        out: dict[str, int | bool] = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep,
                                      "sp": self.sp}  # fmt: skip
        if replicas or self.dp_replicate != 1:
            out["dp_replicate"] = self.dp_replicate
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParallelDims:
        """Inverse of :meth:`to_dict`; unknown keys ignored, missing (or ``null``) ones default.

        Numbers are read as written (``"2"`` is 2); anything else that is not a positive integer is a
        ``ParallelismError`` naming the degree.
        """
        out: dict[str, Any] = {}
        for k in (*DEGREES, "sp"):
            v = data.get(k)
            if v is None:
                continue
            if k == "sp":
                out[k] = bool(v)
            else:
                try:
                    out[k] = v if isinstance(v, bool) else int(v)
                except (TypeError, ValueError):
                    out[k] = v  # refused by check_degree, by name
        return cls(**out)
