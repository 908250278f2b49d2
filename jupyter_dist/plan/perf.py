"""Step-time model: compute from training FLOPs, communication from volumes over the hardware's bandwidths.

Sources:

* Training FLOPs per token ``6 N + 12 L (H Q) T`` (Chowdhery et al. 2022, PaLM, appendix B; Kaplan et al. 2020
  for the 6N rule), where N counts the matrix-multiply parameters a token passes through; recomputation adds one
  forward of the blocks (``2 (N - V H) + 4 L H Q T``; the output layer is not recomputed, as in Narayanan et al.
  2021, eq. 3) for full checkpointing, the attention core forward ``4 L H Q T`` for selective (Korthikanti et al.
  2022, Sec. 5). MFU counts model FLOPs only (PaLM's definition).
* Collective times from the volumes nccl-tests uses: all-reduce moves ``2 (n-1)/n`` of the buffer per rank,
  all-gather and reduce-scatter ``(n-1)/n``, at the bus bandwidth of :meth:`Hardware.collective_bw`.
* Volumes per strategy: DDP and ZeRO-1/2 move ``2 Psi`` per step (all-reduce, or reduce-scatter of gradients plus
  all-gather of parameters), ZeRO-3/FSDP ``3 Psi`` (two all-gathers and a reduce-scatter; ZeRO paper Sec. 7); TP
  4 all-reduces of ``s b h`` per layer and micro-batch (Megatron-LM, Shoeybi et al. 2019; 6 with full
  recomputation); the 1F1B pipeline bubble ``(p-1)/m`` of the ideal time (Narayanan et al. 2021); MoE
  all-to-alls dispatch and combine ``k s b h`` per layer, twice in backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .hardware import Hardware
from .memory import Assumptions, _stage_params
from .model import ModelSpec
from .parallel import ParallelDims
from .strategies import StrategySpec
from .training import Checkpointing, Precision, TrainingShape

__all__ = ["StepTime", "estimate_time", "training_flops_per_token"]

BOUND_LABELS = {
    "compute": "compute",
    "dp_comm": "data-parallel communication",
    "tp_comm": "tensor-parallel communication",
    "pp_bubble": "pipeline bubble",
    "pp_p2p": "pipeline sends",
    "cp_comm": "context-parallel communication",
    "ep_comm": "expert all-to-all",
    "offload": "CPU offload",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTime:
    """Estimated time of one optimizer step and what bounds it."""

    step_time_s: float
    """Seconds per optimizer step."""
    tokens_per_s: float
    """Tokens per second, whole job."""
    mfu: float
    """Model FLOPs utilisation (model FLOPs / (time x GPUs x peak))."""
    bound_by: str
    """Largest component of the step: one of ``BOUND_LABELS``' keys."""
    breakdown: dict[str, float] = field(default_factory=dict)
    """Seconds per component (exposed, after overlap)."""
    model_flops: float = 0.0
    """Model FLOPs per step, whole job."""
    comm_bytes: dict[str, float] = field(default_factory=dict)
    """Bytes each GPU moves per step, by kind."""

    @property
    def bound_label(self) -> str:
        """Human name of :attr:`bound_by`."""
        return BOUND_LABELS.get(self.bound_by, self.bound_by)

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return {
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
            "bound_by": self.bound_by, "breakdown": dict(self.breakdown), "model_flops": self.model_flops,
            "comm_bytes": dict(self.comm_bytes),
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepTime:
        """Inverse of :meth:`to_dict`."""
        return cls(
            step_time_s=float(data["step_time_s"]), tokens_per_s=float(data["tokens_per_s"]),
            mfu=float(data["mfu"]), bound_by=str(data["bound_by"]), breakdown=dict(data.get("breakdown", {})),
            model_flops=float(data.get("model_flops", 0.0)), comm_bytes=dict(data.get("comm_bytes", {})),
        )  # fmt: skip


def training_flops_per_token(model: ModelSpec, seq_len: int, checkpointing: Checkpointing) -> tuple[float, float]:
    """(model FLOPs, executed FLOPs) per token of one training step (forward + backward [+ recomputation])."""
    attn = 12 * model.layers * model.q_dim * seq_len
    model_flops = 6 * model.matmul_params + attn
    if checkpointing is Checkpointing.FULL:
        # one more forward of the blocks only: the output layer is not checkpointed, so it is not recomputed
        # (Narayanan et al. 2021, eq. 3: 96 B s l h^2 (1 + s/6h + V/16lh), whose logits term 6 B s V h is that of
        # the 72 B s l h^2 (1 + s/6h + V/12lh) without recomputation)
        scale = model.params / model.params_from_dims if model.params_override else 1.0
        extra = 2 * (model.matmul_params - model.vocab * model.hidden * scale) + attn / 3
    elif checkpointing is Checkpointing.SELECTIVE:
        extra = attn / 3
    else:
        extra = 0.0
    return model_flops, model_flops + extra


def _ring(n: int, factor: float) -> float:
    """Fraction of a buffer each rank sends in a ring collective of ``n`` ranks (``factor`` 2 for all-reduce)."""
    return factor * (n - 1) / n if n > 1 else 0.0


def estimate_time(
    model: ModelSpec, training: TrainingShape, hardware: Hardware, strategy: StrategySpec, dims: ParallelDims,
    *, grad_accum: int, assumptions: Assumptions,
) -> StepTime:
    """Estimated step time of ``strategy`` with ``dims``."""
    world = dims.world_size
    gpn = hardware.gpus_per_node
    acc = hardware.accelerator
    m = grad_accum
    seq = training.seq_len
    tokens = training.micro_batch * m * dims.dp * seq
    model_fpt, hw_fpt = training_flops_per_token(model, seq, training.checkpointing)
    peak = acc.peak_flops(training.precision.compute_dtype)
    compute = hw_fpt * tokens / (world * peak * assumptions.compute_efficiency)
    compute_mb = compute / m
    backward_mb = compute_mb * 2 / 3
    cb = 4 if training.precision is Precision.FP32 else 2  # compute / activation bytes
    reduce_b = 2 if strategy.family == "deepspeed" or training.precision is Precision.BF16_TRUE else 4
    if training.precision is Precision.FP32:
        reduce_b = 4

    breakdown: dict[str, float] = {"compute": compute}
    comm: dict[str, float] = {}

    # ---- data parallel (ZeRO / FSDP / DDP) ----------------------------------------------------------------------
    dense, expert, _ = _stage_params(model, dims)
    dp_exposed = 0.0
    dp_bytes = 0.0
    per_node_dp = max(1, gpn // dims.tp)
    for local, group in ((dense, dims.shard_size), (expert, dims.expert_shard_size)):
        if local == 0 or group == 1:
            continue
        inner = group
        outer = 1
        if strategy.hybrid:
            inner = min(group, per_node_dp)
            outer = group // inner
        bw = hardware.collective_bw(inner, ranks_per_node=min(inner, per_node_dp))
        grads = local * reduce_b
        params = local * cb
        if not strategy.shard_grads:  # DDP, NO_SHARD, ZeRO-1: gradients reduced once per step, in the last backward
            # DDP / NO_SHARD all-reduce (RS + AG); ZeRO-1 only reduce-scatters the gradients, each rank updates its
            # partition and the parameters are all-gathered: Psi + Psi = the same 2 Psi as DDP (ZeRO paper Sec. 7.2.1)
            once = _ring(inner, 1 if strategy.shard_optimizer else 2) * grads
            t_once = once / bw
            t_exposed = max(0.0, t_once - assumptions.overlap * backward_mb)
            if strategy.shard_optimizer:  # ZeRO-1 all-gathers the updated params after the step (not hidden)
                gather = _ring(inner, 1) * params
                t_exposed += gather / bw
                once += gather
            dp_bytes += once
            dp_exposed += t_exposed
        else:
            per_mb = _ring(inner, 1) * grads
            if strategy.shard_params:
                per_mb += 2 * _ring(inner, 1) * params  # all-gather in forward and again in backward
            elif strategy.keeps_gathered_params or strategy.family == "deepspeed":
                per_mb += _ring(inner, 1) * params / (1 if strategy.keeps_gathered_params else m)
            t_mb = per_mb / bw
            dp_bytes += per_mb * m
            dp_exposed += m * max(0.0, t_mb - assumptions.overlap * compute_mb)
        if outer > 1:  # hybrid: all-reduce of the shard's gradients across replicas, once per step
            cross = _ring(outer, 2) * grads / inner
            t_cross = cross / hardware.collective_bw(outer * inner, ranks_per_node=1)
            dp_bytes += cross
            dp_exposed += max(0.0, t_cross - assumptions.overlap * backward_mb)
    if dp_bytes:
        comm["data_parallel"] = dp_bytes
        breakdown["dp_comm"] = dp_exposed

    # ---- tensor parallel ----------------------------------------------------------------------------------------
    blocks = -(-model.layers // dims.pp)
    s_local = seq / dims.cp
    act = s_local * training.micro_batch * model.hidden * cb
    if dims.tp > 1:
        n_ar = 6 if training.checkpointing is Checkpointing.FULL else 4
        tp_bytes = blocks * n_ar * _ring(dims.tp, 2) * act * m
        comm["tensor_parallel"] = tp_bytes
        breakdown["tp_comm"] = tp_bytes / hardware.collective_bw(dims.tp, ranks_per_node=min(dims.tp, gpn))

    # ---- pipeline -----------------------------------------------------------------------------------------------
    if dims.pp > 1:
        breakdown["pp_bubble"] = compute * (dims.pp - 1) / m
        p2p_bytes = 2 * act * m / dims.tp
        cross_node = hardware.nodes > 1 and dims.tp * dims.cp * dims.dp >= gpn
        link = (
            hardware.interconnect.node_bw * hardware.interconnect.efficiency / gpn
            if cross_node
            else acc.intra_node_bw * hardware.intra_node_efficiency
        )
        comm["pipeline"] = p2p_bytes
        breakdown["pp_p2p"] = p2p_bytes / link

    # ---- context parallel (ring attention, overlapped with the attention compute) ----------------------------------
    if dims.cp > 1:
        kv = 2 * s_local * training.micro_batch * model.kv_dim * cb / dims.tp
        cp_bytes = 3 * (dims.cp - 1) * kv * blocks * m
        attn_share = (12 * model.layers * model.q_dim * seq) / model_fpt
        bw = hardware.collective_bw(dims.cp, ranks_per_node=min(dims.cp, max(1, gpn // dims.tp)))
        comm["context_parallel"] = cp_bytes
        breakdown["cp_comm"] = max(0.0, cp_bytes / bw - attn_share * compute)

    # ---- expert parallel all-to-all --------------------------------------------------------------------------------
    if dims.ep > 1 and model.is_moe:
        routed = s_local * training.micro_batch * model.top_k * model.hidden * cb
        ep_bytes = 4 * blocks * _ring(dims.ep, 1) * routed * m
        bw = hardware.collective_bw(dims.ep, ranks_per_node=min(dims.ep, max(1, gpn // dims.tp)))
        comm["expert_parallel"] = ep_bytes
        breakdown["ep_comm"] = ep_bytes / bw

    # ---- CPU offload: gradients down, parameters up, the optimizer step on the host ---------------------------------
    if strategy.offload_optimizer:
        shard = dims.shard_size
        local = (dense + expert) / shard
        pcie = 2 * local * 2
        if strategy.offload_params:
            pcie += 2 * local * cb * m  # parameters fetched for forward and backward of every micro-batch
        comm["host_link"] = pcie
        breakdown["offload"] = pcie / acc.host_link_bw + local / assumptions.cpu_optimizer_params_per_s

    step = sum(breakdown.values())
    bound = max(breakdown, key=lambda k: breakdown[k])
    model_flops = model_fpt * tokens
    return StepTime(
        step_time_s=step, tokens_per_s=tokens / step, mfu=model_flops / (step * world * peak), bound_by=bound,
        breakdown=breakdown, model_flops=model_flops, comm_bytes=comm,
    )  # fmt: skip
