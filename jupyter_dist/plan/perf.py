"""Step-time model: where the time of one optimizer step goes, part by part, on one GPU (the slowest rank).

The step is the sum of named parts (:attr:`StepTime.breakdown`, seconds, after overlap):

``matmul``
    The matrix multiplies' FLOPs (``6 N`` per token, N the matmul parameters a token passes through; Kaplan et al.
    2020, PaLM App. B) at the *achievable* rate of the GPU: ``peak x Accelerator.matmul_efficiency``, what
    well-tuned training reaches, from published utilisation and GEMM rates on that GPU (the sources are at
    ``Accelerator.matmul_efficiency``, :mod:`.hardware`). ``%dist_tune`` measures the real figure (a calibration).
``attention``
    The attention core, ``12 L H Q T`` FLOPs per token (PaLM App. B). With a fused kernel (FlashAttention-2, Dao
    2023, arXiv:2307.08691, Fig. 7/8) causal masking skips half of it, at 75 % of the matmul rate (FA2 reaches
    ~190 of A100's ~250 TFLOP/s GEMM rate forward + backward, head dim 128). Without it, all of it runs as
    matmuls, plus the ``seq x seq`` scores and probabilities written and read in fp32/16-bit (memory-bound).
``elementwise``
    Memory-bound work: norms, residual adds, rotary, the MLP activation (``14 h + 5 f`` elements written and read per
    token and layer forward for a gated MLP, ``10 h + 2 f`` otherwise), three passes for forward + backward, and the
    loss (logits in fp32, softmax, their gradient: 16 bytes per vocabulary entry and token), at 70 % of the
    datasheet memory bandwidth; eager RMSNorm as its chain of fp32 kernels (:data:`COMPOSITE_NORM_BYTES`). Without
    sequence parallelism the norm/residual part is repeated on every TP rank.
``fp8`` (``Precision.FP8``)
    The blocks' linear layers (attention q, k, v, o and the MLP) at the accelerator's FP8 peak
    (``Accelerator.fp8_flops``, at the same efficiency); the attention core, the output layer and MoE routers stay at
    the bf16 rate, as torchtitan's float8 converter leaves them. The casts are memory-bound and count in
    ``elementwise``: 3 bytes (read bf16, write float8; :data:`FP8_CAST_BYTES`) per element of every FP8 linear's
    input and output gradient per token, and of its weight per micro-batch (:func:`fp8_cast_elements`).
``optimizer``
    The optimizer step as memory traffic over the rank's share of the parameters, at
    :data:`OPTIMIZER_MEMORY_EFFICIENCY` of the memory bandwidth. torch's default ``foreach`` AdamW
    (``_multi_tensor_adamw``) runs eight passes, each its own kernel reading and writing whole fp32 tensors (decay
    ``mul_``, ``lerp_``, ``mul_``, ``addcmul_``, ``sqrt``, ``div_``, ``add_``, ``addcdiv_``): 84 bytes per parameter;
    the fused kernel (``fused=True``) reads parameter, gradient and both states once and writes three: 28 bytes
    (:data:`OPTIMIZER_BYTES`). On by default on GPUs, as the worker does (``TrainingShape.fused_optimizer``). Not
    counted for CPU processes, whose step time keeps the per-operator overhead model it was checked with.
``recompute``
    One more forward of what activation checkpointing dropped: the blocks (full) or the attention core
    (selective; Korthikanti et al. 2022, Sec. 5).
``compile`` (``TrainingShape.compile``, on by default on GPUs as the worker does)
    Regional ``torch.compile`` fuses each chain of pointwise and normalisation ops between two matmuls into one
    kernel, forward and backward (torchtitan's per-block compile): the blocks' elementwise traffic becomes
    :data:`COMPILED_ELEMENTWISE` of eager's, the FP8 casts fuse their amax read (:data:`FP8_CAST_BYTES` eager
    :data:`FP8_CAST_BYTES_EAGER`), and a block launches :data:`OPS_PER_LAYER_COMPILED` kernels instead of
    :data:`OPS_PER_LAYER`. The loss and the output layer stay eager (only the blocks are compiled).
``overhead``
    Host-side cost per operator (``OPS_PER_LAYER`` kernels per block per micro-batch plus the optimizer's) at
    ``Accelerator.op_overhead_s``: a GPU launches asynchronously, so only what the kernels do not cover is exposed;
    eager CPU dispatch adds up. It is what bounds a tiny model (the 2-process CPU demo).
``dp_comm`` / ``tp_comm`` / ``pp_bubble`` / ``pp_p2p`` / ``cp_comm`` / ``ep_comm`` / ``offload``
    Communication, exposed after overlap. Each collective costs ``Accelerator.collective_latency_s`` (the
    small-message floor: per bucket for DDP, per unit and pass for FSDP/ZeRO-3, per all-reduce for TP) plus its
    bytes. Collective times from the volumes
    nccl-tests uses (all-reduce moves
    ``2 (n-1)/n`` of the buffer per rank, all-gather and reduce-scatter ``(n-1)/n``) at the bus bandwidth of
    :meth:`Hardware.collective_bw`. Data parallel: DDP and ZeRO-1/2 move ``2 Psi`` per step, ZeRO-3/FSDP ``3 Psi``
    (ZeRO paper Sec. 7), hidden behind the backward pass (``Assumptions.overlap``) except the last bucket (DDP,
    25 MB); ZeRO-1's all-gather after the optimizer step is not hidden. ZeRO-3/FSDP run one all-gather per unit (a
    block, and the root) in forward, one more per unit and a reduce-scatter in backward, one after another on one
    stream, each paying :func:`ring_latency` (NCCL's ring: a step per rank, so the latency grows with the
    data-parallel size while each rank's share of the bytes shrinks): the forward's gathers hide behind the forward
    (prefetched one unit ahead) and the backward's behind the backward and its recomputation, except the first
    unit's gather and the last unit's reduce-scatter, which nothing covers. Tensor parallel: 4 all-reduces of
    ``s b h`` per layer and micro-batch (6 with full recomputation; Shoeybi et al. 2019), not overlapped, over
    NVLink inside a node and the network across nodes. Pipeline: the GPipe/1F1B bubble ``(p-1)/m`` of the compute,
    ``(p-1)/(v m)`` interleaved over ``v`` stages per rank (Narayanan et al. 2021), plus the stage-to-stage sends.
    Context parallel: the ring's K/V passes, hidden behind the attention. Expert parallel: the dispatch and combine
    all-to-alls (``k s b h`` per layer, twice in backward), not hidden. Offload: PCIe traffic and the CPU optimizer
    step.

MFU counts model FLOPs only (PaLM's definition); recomputation is executed but not counted. It is measured against
the time those FLOPs would take at the datasheet peak of the units that run them: the bf16 (or fp16/fp32) peak, and
under ``fp8`` the FP8 peak for the blocks' FP8 linears and the bf16 peak for the rest (so an fp8 plan's MFU is not
inflated by the faster unit, and equals the bf16 definition where nothing runs in FP8). torchtitan reports no MFU for
float8 runs for this reason (benchmarks/llama3_h100_202412_torchtitan.md); :func:`mfu_peak` gives the peak used.

FSDP2 under ``fp8`` all-gathers the FP8 linears' weights in float8, 1 byte per element (torchao's
``enable_fsdp_float8_all_gather``, tensorwise scaling, which the worker turns on; torchtitan docs/float8.md); the
other parameters are gathered in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .hardware import Hardware
from .memory import Assumptions, stage_params
from .model import ModelSpec
from .parallel import ParallelDims
from .strategies import StrategySpec
from .training import Checkpointing, Precision, TrainingShape

__all__ = [
    "BOUND_LABELS", "COMPUTE_PARTS", "FP8_CAST_BYTES", "OPTIMIZER_BYTES", "RING_HOP_S", "StepTime", "compute_parts",
    "estimate_time", "fp8_cast_elements", "fp8_params", "mfu_peak", "optimizer_seconds", "ring_latency",
    "training_flops_per_token",
]  # fmt: skip

BOUND_LABELS = {
    "matmul": "matrix multiplies",
    "attention": "attention",
    "elementwise": "memory-bound elementwise work",
    "recompute": "activation recomputation",
    "optimizer": "optimizer step",
    "overhead": "per-operator overhead (launches, eager dispatch)",
    "dp_comm": "data-parallel communication",
    "tp_comm": "tensor-parallel communication",
    "pp_bubble": "pipeline bubble",
    "pp_p2p": "pipeline sends",
    "cp_comm": "context-parallel communication",
    "ep_comm": "expert all-to-all",
    "offload": "CPU offload",
}

COMPUTE_PARTS = ("matmul", "attention", "elementwise", "recompute", "optimizer", "overhead")
"""The parts of :attr:`StepTime.breakdown` that are the GPU's own work (the rest is communication or waiting)."""

FLASH_RELATIVE = 0.75
"""FlashAttention-2's forward + backward rate relative to the GEMM rate (Dao 2023, Fig. 7: ~190 TFLOP/s on A100
at head dim 128, where large bf16 GEMMs reach ~250)."""
MEMORY_EFFICIENCY = 0.7
"""Fraction of the datasheet memory bandwidth elementwise kernels reach (STREAM-like copy/scale on HBM)."""
ELEMENTWISE_PASSES = 3.0
"""Forward + backward traffic of elementwise work as a multiple of the forward's (backward reads the forward's
inputs and the incoming gradient and writes the outgoing one)."""
OPS_PER_LAYER = 90
"""Kernels per transformer block per micro-batch, forward + backward, of an unfused eager implementation (about
30 in forward: 2 norms, 4-7 linears, rotary, attention, activation, residual adds; twice that in backward)."""
OPS_OPTIMIZER = 40
"""Kernels of a foreach AdamW step and the gradient-norm clip, per optimizer step."""
OPS_OPTIMIZER_FUSED = 10
"""The same with the fused optimizer (one kernel per parameter group and dtype, plus the clip)."""
OPS_PER_LAYER_COMPILED = 30
"""Kernels per block per micro-batch, forward + backward, once compiled: the matmuls and attention (about 10 forward,
twice that backward) with one fused kernel between each two instead of several."""
COMPILED_ELEMENTWISE = 0.75
"""The blocks' elementwise traffic compiled, as a share of eager's. Counted for a GPT-2-style block (``h`` wide,
``f = 4h``), elements moved per token outside the matmuls and attention: eager forward 12h + 2f (two LayerNorms, two
residual adds, GELU, the attention output's transpose) and backward 19h + 4f (two norm backwards, the residual
gradients summed at each fork, GELU backward, the bias-gradient reductions, the transpose), 55h in all; compiled,
each region between two matmuls reads its inputs and writes its outputs once: forward 11h + 2f (a residual add fused
with the next norm; the block's last add stays at the region boundary, as each block compiles alone) and backward
10h + 3f (norm backward with the residual gradient, GELU backward with its bias reduction), 41h: 0.75."""
COMPOSITE_NORM_BYTES = (76, 4)
"""Bytes per element an eager RMSNorm moves beyond a fused norm, ``a + b cb`` forward + backward. This package's,
Hugging Face's (Llama, Qwen, Gemma) and Meta's reference RMSNorm is ``x.float()``, ``pow(2)``, ``mean``, ``* rsqrt``,
``type_as``, ``* weight``: forward 28 + 4 cb, autograd's backward 48 + 6 cb, where one fused kernel (LayerNorm,
``aten._fused_rms_norm``) moves ~6 cb: 84 more bytes at cb = 2. Compiled, the chain fuses."""
FP8_CAST_BYTES_EAGER = 5
"""Bytes per element of an eager FP8 cast: the amax read (2) as its own kernel, then the scaled cast (read 2, write
1). Compiled, the read fuses into the cast (:data:`FP8_CAST_BYTES`)."""
OPTIMIZER_BYTES = {
    ("adamw", False): 84, ("adamw", True): 28, ("sgd", False): 32, ("sgd", True): 20,
    ("adamw-8bit", False): 16, ("adamw-8bit", True): 16,
}  # fmt: skip
"""Bytes the optimizer step moves per parameter with fp32 parameters, gradients and states, ``(kind, fused)``.
AdamW foreach: 8 passes (see the module docstring), 84; fused: read 4 x 4, write 3 x 4 = 28. SGD with momentum
foreach: ``mul_`` (8), ``add_`` of the gradient (12), ``add_`` into the parameter (12) = 32; fused: read 3, write 2 =
20. bitsandbytes 8-bit AdamW is one kernel either way: read parameter, gradient (4 + 4) and two 1-byte states, write
the parameter and the states: 16."""
OPTIMIZER_MEMORY_EFFICIENCY = 0.9
"""Fraction of the memory bandwidth the optimizer's passes reach: a few very long contiguous streams per kernel
(whole parameter tensors), where the blocks' elementwise kernels are short (:data:`MEMORY_EFFICIENCY`)."""
DDP_BUCKET_BYTES = 25 * 2**20
"""PyTorch DDP's default bucket (``bucket_cap_mb=25``): the last one is reduced after backward ends."""


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
    def compute_s(self) -> float:
        """Seconds of the GPU's own work (:data:`COMPUTE_PARTS`), communication and bubble left out."""
        return sum(v for k, v in self.breakdown.items() if k in COMPUTE_PARTS)

    def parts(self) -> list[tuple[str, float, float]]:
        """``(label, seconds, share of the step)`` per part, largest first: the breakdown in words."""
        total = self.step_time_s or 1.0
        rows = sorted(self.breakdown.items(), key=lambda kv: -kv[1])
        return [(BOUND_LABELS.get(k, k), v, v / total) for k, v in rows if v > 0]

    def describe(self, limit: int = 4) -> str:
        """The largest parts in one line, e.g. ``"matrix multiplies 61%, attention 14%, ..."``."""
        return ", ".join(f"{label} {100 * share:.0f}%" for label, _, share in self.parts()[:limit])

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


def training_flops_per_token(
    model: ModelSpec, seq_len: int, checkpointing: Checkpointing, every: int = 1
) -> tuple[float, float]:
    """(model FLOPs, executed FLOPs) per token of one training step (forward + backward [+ recomputation]).

    ``every``: K of ``layer:K`` checkpointing (one block in K is fully recomputed).
    """
    attn = 12 * model.layers * model.q_dim * seq_len
    model_flops = 6 * model.matmul_params + attn
    scale = model.params / model.params_from_dims if model.params_override else 1.0
    block_fwd = 2 * (model.matmul_params - model.vocab * model.hidden * scale)
    if checkpointing is Checkpointing.FULL:
        # one more forward of the blocks only: the output layer is not checkpointed, so it is not recomputed
        # (Narayanan et al. 2021, eq. 3: 96 B s l h^2 (1 + s/6h + V/16lh), whose logits term 6 B s V h is that of
        # the 72 B s l h^2 (1 + s/6h + V/12lh) without recomputation)
        extra = block_fwd + attn / 3
    elif checkpointing is Checkpointing.LAYER:  # one block in K recomputed whole
        extra = (block_fwd + attn / 3) / max(1, every)
    elif checkpointing is Checkpointing.OP:
        # torchtitan's op-level policy keeps the attention kernel's output and every second matmul's: half of the
        # blocks' matmuls run again, attention does not
        extra = block_fwd / 2
    elif checkpointing is Checkpointing.SELECTIVE:
        extra = attn / 3
    else:
        extra = 0.0
    return model_flops, model_flops + extra


RING_HOP_S = {"nvlink": 3.4e-6, "network": 9.6e-6}
"""Latency of one step of a ring all-gather / reduce-scatter (NCCL's Simple protocol), by the link the step crosses:
NVIDIA/nccl ``src/graph/tuning.cc`` (``hwLat``, ring / Simple: NVLink 3.4 us, network 9.6 us per step, on top of
``baseLat`` 8.4 us). A ring of ``n`` ranks on ``k`` nodes takes ``n - 1`` steps, ``k - 1`` of them across the
network (its ``nsteps`` / ``nInterSteps``), so the latency of a collective grows linearly with the ring."""


def ring_latency(hardware: Hardware, n: int, *, ranks_per_node: int) -> float:
    """Seconds one ring all-gather or reduce-scatter over ``n`` ranks costs before its bytes count (alpha).

    The small-message floor (:attr:`~.hardware.Accelerator.latency_s`: launch and handshake) plus :data:`RING_HOP_S`
    per step of the ring, ``ranks_per_node`` of its ranks on each node. CPU processes (gloo) keep the floor alone,
    which their figures were measured with.
    """
    acc = hardware.accelerator
    if n <= 1:
        return 0.0
    if acc.vendor == "cpu":
        return acc.latency_s
    nodes = 1 if hardware.nodes == 1 else -(-n // max(1, min(ranks_per_node, n)))
    hops = (n - nodes) * RING_HOP_S["nvlink"] + (nodes - 1) * RING_HOP_S["network"]
    return acc.latency_s + hops * acc.comm_scale


def _ring(n: int, factor: float) -> float:
    """Fraction of a buffer each rank sends in a ring collective of ``n`` ranks (``factor`` 2 for all-reduce)."""
    return factor * (n - 1) / n if n > 1 else 0.0


GEMM_HALF_WIDTH = 512
"""Model width (hidden size; TP keeps the inner dimension of half the GEMMs whole) that sets how much slower narrow
GEMMs run: ``efficiency(w) = e * w / (w + 512)``, normalised to ``e`` at ``w = 8192``. Narrow GEMMs fill fewer tiles
and waves and are closer to memory-bound; Narayanan et al. 2021, Table 1: 137 TFLOP/s per A100 at h=2304, 163 at
h=25600."""


def matmul_efficiency(large: float, width: int, *, speedup: float = 1.0) -> float:
    """The matmul rate (fraction of peak) at this per-rank width, from the large-GEMM ``large`` (see above).

    ``speedup``: the unit's peak over the bf16 one (2 for FP8): a GEMM on a faster unit needs that much more
    arithmetic intensity to stay compute-bound (the roofline's ridge point moves by the ratio of the peaks at the same
    memory bandwidth), so its half width scales by it.
    """
    half = GEMM_HALF_WIDTH * speedup
    return min(1.0, large * width / (width + half) * (1 + half / 8192))


FP8_CAST_BYTES = 3
"""Bytes one FP8 cast moves per element: reads the bf16 value (2), writes the float8 one (1). torchao's dynamic
scaling also reads the tensor for its amax; with ``torch.compile`` (which torchtitan requires for competitive FP8,
docs/float8.md) that read fuses into the cast."""


def fp8_cast_elements(model: ModelSpec) -> tuple[int, int]:
    """(elements cast per token, weight elements cast per micro-batch) of one block's FP8 linear layers.

    Per token: every linear's input (forward) and its output gradient (backward): attention q, k, v read ``h`` each
    and o reads ``q_dim``; their gradients are ``q_dim + 2 kv_dim + h``; the MLP (each of the ``top_k`` experts of a
    token) reads ``2 h + f`` and its gradients are ``2 f + h`` gated, ``h + f`` and ``f + h`` otherwise. Per
    micro-batch: every weight once (all the experts' for a mixture of experts). MoE routers stay in bf16.
    """
    h, f, q, kv = model.hidden, model.d_ffn, model.q_dim, model.kv_dim
    attention = (3 * h + q) + (q + 2 * kv + h)
    mlp = (2 * h + f) + (2 * f + h) if model.gated_mlp else (h + f) + (f + h)
    weights = model.attention_params + model.experts * model.expert_params
    return attention + model.top_k * mlp, weights


def fp8_params(model: ModelSpec) -> float:
    """Parameters of the linear layers ``fp8`` runs in FP8.

    Every block's attention and MLP (each of a token's ``top_k`` experts), not the routers, the embedding or the
    output layer.
    """
    scale = model.params / model.params_from_dims if model.params_override else 1.0
    return model.layers * (model.attention_params + model.top_k * model.expert_params) * scale


def mfu_peak(model: ModelSpec, training: TrainingShape, hardware: Hardware) -> float:
    """The peak FLOP/s MFU is measured against.

    The compute dtype's peak, and under ``fp8`` the FLOP-weighted harmonic mean of the FP8 peak (the blocks' linears)
    and the bf16 peak (attention, the output layer): the rate at which the model's FLOPs would run if every unit ran
    at its datasheet peak.
    """
    acc = hardware.accelerator
    peak = acc.peak_flops(training.precision.compute_dtype)
    if training.precision is not Precision.FP8:
        return peak
    model_fpt, _ = training_flops_per_token(model, training.seq_len, training.checkpointing,
                                            training.checkpoint_every)  # fmt: skip
    fast = 6 * fp8_params(model)
    return model_fpt / (fast / acc.peak_flops("fp8") + (model_fpt - fast) / peak)


def optimizer_seconds(training: TrainingShape, hardware: Hardware, params: float, *, fused: bool) -> float:
    """Seconds of one optimizer step over ``params`` parameters (the rank's share), as memory traffic.

    :data:`OPTIMIZER_BYTES` per parameter; ``bf16-true`` keeps 2-byte parameters, gradients and states: half the bytes.
    """
    per_param: float = OPTIMIZER_BYTES[(training.optimizer.value, fused)]
    if training.precision is Precision.BF16_TRUE:
        per_param /= 2
    acc = hardware.accelerator
    return per_param * params / (acc.memory_bw * OPTIMIZER_MEMORY_EFFICIENCY)


def compute_parts(
    model: ModelSpec, training: TrainingShape, hardware: Hardware, dims: ParallelDims, *, tokens_per_gpu: float,
) -> dict[str, float]:
    """Seconds of matmul, attention, elementwise and recompute work one GPU does for ``tokens_per_gpu`` tokens.

    ``tokens_per_gpu`` counts the tokens of the GPU's model-parallel group divided by its size (TP, PP, CP split the
    work of a token ``tp * pp * cp`` ways, as the FLOPs per GPU of the papers do).
    """
    acc = hardware.accelerator
    seq = training.seq_len
    peak = acc.peak_flops(training.precision.compute_dtype)
    rate = peak * matmul_efficiency(acc.matmul_efficiency, model.hidden)
    cb = 4 if training.precision is Precision.FP32 else 2
    ck = training.checkpointing
    attn_flops = 12 * model.layers * model.q_dim * seq  # PaLM's count per token: QK^T and AV, forward + backward
    dense_flops = 6 * model.matmul_params
    matmul = dense_flops * tokens_per_gpu / rate
    scale = model.params / model.params_from_dims if model.params_override else 1.0
    fp8_rate = 0.0
    cast = 0.0
    compiled, _ = training.speed_options(acc.vendor)
    fp8_count = fp8_params(model)
    if training.precision is Precision.FP8:  # the blocks' linears at the FP8 rate, the rest as above
        fp8_peak = acc.peak_flops("fp8")
        fp8_rate = fp8_peak * matmul_efficiency(acc.matmul_efficiency, model.hidden, speedup=fp8_peak / peak)
        matmul = (6 * fp8_count / fp8_rate + (dense_flops - 6 * fp8_count) / rate) * tokens_per_gpu
        cast_per_token, cast_weights = fp8_cast_elements(model)
        tokens_per_micro_batch = training.micro_batch * seq * dims.dp / dims.world_size  # of tokens_per_gpu
        elements = (cast_per_token + cast_weights * scale / (dims.tp * dims.pp) / tokens_per_micro_batch) * model.layers
        cast_bytes = FP8_CAST_BYTES if compiled else FP8_CAST_BYTES_EAGER
        cast = cast_bytes * elements * tokens_per_gpu / (acc.memory_bw * MEMORY_EFFICIENCY)
    if training.flash_attention:
        attention = (attn_flops / 2) * tokens_per_gpu / (rate * FLASH_RELATIVE)  # causal: half of the tiles run
    else:
        attention = attn_flops * tokens_per_gpu / rate
        # scores and probabilities, seq x seq per head: written, read by softmax, written, read by AV; backward twice
        per_token = model.heads * seq * (4 + 3 * cb) * ELEMENTWISE_PASSES
        scores = per_token * tokens_per_gpu / (acc.memory_bw * MEMORY_EFFICIENCY)
        attention += scores
    h, f = model.hidden, model.d_ffn * (model.top_k if model.is_moe else 1)
    h_part, f_part = (14 * h, 5 * f) if model.gated_mlp else (10 * h, 2 * f)
    whole = dims.tp if dims.tp > 1 and not dims.sp else 1  # norms and residuals whole on each TP rank without SP
    layer_fwd = cb * (h_part * whole + f_part)
    loss = 16 * model.vocab  # fp32 logits, log-softmax, their gradient
    traffic_fwd = model.layers * layer_fwd * (COMPILED_ELEMENTWISE if compiled else 1.0)
    # eager RMSNorm's unfused kernels (forward and backward in the constant, not x3): two per block, whole per TP rank
    normed = (2 * h * whole + (model.q_dim + model.kv_dim) * model.qk_norm) * model.layers + h  # q/k: Qwen3; final
    chains = (COMPOSITE_NORM_BYTES[0] + COMPOSITE_NORM_BYTES[1] * cb) * normed if model.norm == "rmsnorm" else 0.0
    moved = ELEMENTWISE_PASSES * traffic_fwd + loss + (0.0 if compiled else chains)
    elementwise = moved * tokens_per_gpu / (acc.memory_bw * MEMORY_EFFICIENCY)
    parts = {"matmul": matmul, "attention": attention, "elementwise": elementwise + cast}
    block_matmul = 2 * (model.matmul_params - model.vocab * model.hidden * scale) * tokens_per_gpu / rate
    if fp8_rate:  # a recomputed forward multiplies in FP8 too (its casts are not counted again)
        rest = model.matmul_params - model.vocab * model.hidden * scale - fp8_count  # MoE routers
        block_matmul = 2 * (fp8_count / fp8_rate + rest / rate) * tokens_per_gpu
    attn_fwd = attention * (2 / 7 if training.flash_attention else 1 / 3)  # FA2: backward ~2.5x forward
    again = traffic_fwd * tokens_per_gpu / (acc.memory_bw * MEMORY_EFFICIENCY)
    if ck is Checkpointing.FULL:  # one more forward of the blocks: a third of their matmul and elementwise work
        parts["recompute"] = block_matmul + attn_fwd + again
    elif ck is Checkpointing.LAYER:  # the same for one block in K
        parts["recompute"] = (block_matmul + attn_fwd + again) / max(1, training.checkpoint_every)
    elif ck is Checkpointing.OP:  # half of the blocks' matmuls and their elementwise work; attention is kept
        parts["recompute"] = block_matmul / 2 + again
    elif ck is Checkpointing.SELECTIVE:  # the attention core's forward again
        parts["recompute"] = attention * (2 / 7 if training.flash_attention else 1 / 3)
    return parts


def estimate_time(
    model: ModelSpec, training: TrainingShape, hardware: Hardware, strategy: StrategySpec, dims: ParallelDims,
    *, grad_accum: int, assumptions: Assumptions,
) -> StepTime:
    """Estimated step time of ``strategy`` with ``dims``, part by part (see the module docstring)."""
    world = dims.world_size
    gpn = hardware.gpus_per_node
    acc = hardware.accelerator
    m = grad_accum
    seq = training.seq_len
    tokens = training.micro_batch * m * dims.dp * seq
    model_fpt, _ = training_flops_per_token(model, seq, training.checkpointing, training.checkpoint_every)
    peak = mfu_peak(model, training, hardware)
    compiled, fused = training.speed_options(acc.vendor)
    fused = fused or strategy.family == "deepspeed"  # DeepSpeed steps with its own FusedAdam
    parts = compute_parts(model, training, hardware, dims, tokens_per_gpu=tokens / world)
    virtual = training.pp_stages_per_rank if dims.pp > 1 else 1
    dense, expert, _ = stage_params(model, dims, virtual, light_edges=training.pp_light_edges)
    # offloaded, the step runs on the host (``offload`` below); a CPU process's step keeps the per-operator model its
    # figures were checked with (the 2-process CPU runs: OPS_OPTIMIZER kernels in ``overhead``)
    if not strategy.offload_optimizer and acc.vendor != "cpu":
        local = dense / (dims.shard_size if strategy.shard_optimizer else 1)
        local += expert / (dims.expert_shard_size if strategy.shard_optimizer else 1)
        parts["optimizer"] = optimizer_seconds(training, hardware, local, fused=fused)
    compute = sum(v for k, v in parts.items() if k != "optimizer")  # forward + backward: what overlaps and bubbles
    compute_mb = compute / m
    backward_mb = compute_mb * 2 / 3
    cb = 4 if training.precision is Precision.FP32 else 2  # compute / activation bytes
    reduce_b = 2 if strategy.family == "deepspeed" or training.precision is Precision.BF16_TRUE else 4
    if training.precision is Precision.FP32:
        reduce_b = 4
    blocks = -(-model.layers // dims.pp)
    ops = ((OPS_PER_LAYER_COMPILED if compiled else OPS_PER_LAYER) * blocks * m
           + (OPS_OPTIMIZER_FUSED if fused else OPS_OPTIMIZER))  # fmt: skip
    launch = ops * acc.op_overhead_s
    # a GPU queues kernels ahead: launches cost time only where the kernels are shorter; eager CPU work adds up
    parts["overhead"] = launch if acc.vendor == "cpu" else max(0.0, launch - compute)

    breakdown: dict[str, float] = dict(parts)
    comm: dict[str, float] = {}

    # ---- data parallel (ZeRO / FSDP / DDP) ----------------------------------------------------------------------
    # FSDP2 under fp8 all-gathers the FP8 linears' weights in float8 (1 byte; tensorwise scaling), the rest in bf16
    gather_fp8 = training.precision is Precision.FP8 and strategy.family == "fsdp2"
    fp8_share = min(1.0, fp8_params(model) / model.params) if gather_fp8 else 0.0
    lat = acc.latency_s
    overlap = assumptions.overlap
    # CPU ranks run gloo on the cores that compute: FSDP/ZeRO-3's per-unit gathers and reduce-scatters, which the
    # backward waits on, are not hidden (DDP's bucketed all-reduce runs in gloo's own thread as before)
    sharded_overlap = 0.0 if acc.vendor == "cpu" else overlap
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
        params = local * (cb * (1 - fp8_share) + fp8_share)
        if not strategy.shard_grads:  # DDP, NO_SHARD, ZeRO-1: gradients reduced once per step, in the last backward
            # DDP / NO_SHARD all-reduce (RS + AG); ZeRO-1 only reduce-scatters the gradients, each rank updates its
            # partition and the parameters are all-gathered: Psi + Psi = the same 2 Psi as DDP (ZeRO paper Sec. 7.2.1)
            once = _ring(inner, 1 if strategy.shard_optimizer else 2) * grads
            buckets = max(1, -(-int(grads) // DDP_BUCKET_BYTES))
            t_once = once / bw + buckets * lat
            last_bucket = min(t_once, DDP_BUCKET_BYTES * _ring(inner, 2) / bw + lat)  # reduced after backward ends
            t_exposed = max(last_bucket, t_once - overlap * backward_mb)
            if strategy.shard_optimizer:  # ZeRO-1 all-gathers the updated params after the step (not hidden)
                gather = _ring(inner, 1) * params
                t_exposed += gather / bw + lat
                once += gather
            dp_bytes += once
            dp_exposed += t_exposed
        elif strategy.shard_params:  # ZeRO-3 / FSDP: per unit and pass, one collective after another on one stream
            units = blocks + 1  # the blocks and the root module
            alpha = ring_latency(hardware, inner, ranks_per_node=min(inner, per_node_dp))
            gather = _ring(inner, 1) * params / bw  # the whole stage's all-gathers of one pass
            scatter = _ring(inner, 1) * grads / bw
            forward_c = (compute_mb - parts.get("recompute", 0.0) / m) / 3
            backward_c = compute_mb - forward_c  # the backward's matmuls and the recomputed forward
            # forward: the gathers run one unit ahead of the compute (prefetch), the first has nothing to hide behind;
            # backward: the gathers again and the reduce-scatters, the last of which starts when the compute ends
            fwd = max(gather / units + alpha, gather + units * alpha - sharded_overlap * forward_c)
            bwd = max(scatter / units + alpha, gather + scatter + 2 * units * alpha - sharded_overlap * backward_c)
            dp_bytes += _ring(inner, 1) * (grads + 2 * params) * m
            dp_exposed += m * (fwd + bwd)
        else:  # ZeRO-2 / SHARD_GRAD_OP: reduce-scatter per micro-batch (DeepSpeed's and FSDP's own gathers)
            per_mb = _ring(inner, 1) * grads
            calls = 1.0  # collectives per unit (a block, or the root module) and micro-batch
            if strategy.keeps_gathered_params or strategy.family == "deepspeed":
                per_mb += _ring(inner, 1) * params / (1 if strategy.keeps_gathered_params else m)
                calls += 1 if strategy.keeps_gathered_params else 1 / m
            t_mb = per_mb / bw + calls * (blocks + 1) * lat
            dp_bytes += per_mb * m
            first_last = t_mb / max(1, blocks)  # the first unit's gather / the last one's reduce-scatter: no cover
            dp_exposed += m * max(first_last, t_mb - sharded_overlap * compute_mb)
        if outer > 1:  # hybrid: all-reduce of the shard's gradients across replicas, once per step
            cross = _ring(outer, 2) * grads / inner
            t_cross = cross / hardware.collective_bw(outer * inner, ranks_per_node=1) + lat
            dp_bytes += cross
            dp_exposed += max(0.0, t_cross - overlap * backward_mb)
    if dp_bytes:
        comm["data_parallel"] = dp_bytes
        breakdown["dp_comm"] = dp_exposed

    # ---- tensor parallel ----------------------------------------------------------------------------------------
    s_local = seq / dims.cp
    act = s_local * training.micro_batch * model.hidden * cb
    if dims.tp > 1:
        n_ar = 6 if training.checkpointing is Checkpointing.FULL else 4
        tp_bytes = blocks * n_ar * _ring(dims.tp, 2) * act * m
        comm["tensor_parallel"] = tp_bytes
        breakdown["tp_comm"] = (tp_bytes / hardware.collective_bw(dims.tp, ranks_per_node=min(dims.tp, gpn))
                                + blocks * n_ar * m * lat)

    # ---- pipeline -----------------------------------------------------------------------------------------------
    if dims.pp > 1:
        # GPipe and 1F1B idle (p-1)/m of the compute; interleaving v stages per rank shortens each fill and drain
        # step v-fold: (p-1)/(v m) (Narayanan et al. 2021, section 2.2)
        breakdown["pp_bubble"] = compute * (dims.pp - 1) / (m * virtual)
        p2p_bytes = 2 * act * m / dims.tp
        cross_node = hardware.nodes > 1 and dims.tp * dims.cp * dims.dp >= gpn
        link = (
            hardware.interconnect.node_bw * hardware.interconnect.efficiency / gpn
            if cross_node
            else acc.intra_node_bw * hardware.intra_node_efficiency
        )
        comm["pipeline"] = p2p_bytes
        breakdown["pp_p2p"] = p2p_bytes / link + 2 * m * virtual * lat

    # ---- context parallel (ring attention, overlapped with the attention compute) ----------------------------------
    if dims.cp > 1:
        kv = 2 * s_local * training.micro_batch * model.kv_dim * cb / dims.tp
        cp_bytes = 3 * (dims.cp - 1) * kv * blocks * m
        attn_share = (12 * model.layers * model.q_dim * seq) / model_fpt
        bw = hardware.collective_bw(dims.cp, ranks_per_node=min(dims.cp, max(1, gpn // dims.tp)))
        comm["context_parallel"] = cp_bytes
        breakdown["cp_comm"] = max(0.0, cp_bytes / bw + 3 * (dims.cp - 1) * blocks * m * lat - attn_share * compute)

    # ---- expert parallel all-to-all --------------------------------------------------------------------------------
    if dims.ep > 1 and model.is_moe:
        routed = s_local * training.micro_batch * model.top_k * model.hidden * cb
        ep_bytes = 4 * blocks * _ring(dims.ep, 1) * routed * m
        bw = hardware.collective_bw(dims.ep, ranks_per_node=min(dims.ep, max(1, gpn // dims.tp)))
        comm["expert_parallel"] = ep_bytes
        breakdown["ep_comm"] = ep_bytes / bw + 4 * blocks * m * lat

    # ---- CPU offload: gradients down, parameters up, the optimizer step on the host ---------------------------------
    if strategy.offload_optimizer:
        shard = dims.shard_size
        local = (dense + expert) / shard
        pcie = 2 * local * 2
        if strategy.offload_params:
            pcie += 2 * local * cb * m  # parameters fetched for forward and backward of every micro-batch
        comm["host_link"] = pcie
        breakdown["offload"] = pcie / acc.host_link_bw + local / assumptions.cpu_optimizer_params_per_s

    breakdown = {k: v for k, v in breakdown.items() if v > 0 or k == "matmul"}
    step = sum(breakdown.values())
    bound = max(breakdown, key=lambda k: breakdown[k])
    model_flops = model_fpt * tokens
    return StepTime(
        step_time_s=step, tokens_per_s=tokens / step, mfu=model_flops / (step * world * peak), bound_by=bound,
        breakdown=breakdown, model_flops=model_flops, comm_bytes=comm,
    )  # fmt: skip
