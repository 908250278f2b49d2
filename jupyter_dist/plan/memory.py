"""Per-GPU memory model: model states, activations and overhead, with the published formulas (stdlib only).

Sources, cited where each is used:

* Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", Sec. 3.1 and
  Table 1: mixed-precision Adam keeps 2 (fp16 params) + 2 (fp16 grads) + K (fp32 master, momentum, variance;
  K = 12) bytes per parameter; ZeRO-1 divides the K part by N_d, ZeRO-2 also the gradients, ZeRO-3 everything.
* Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4, Table 2:
  activations per layer ``s*b*h*(34 + 5*a*s/h)`` bytes, ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` with tensor
  parallelism, ``s*b*h/t*(34 + 5*a*s/h)`` with sequence parallelism, ``34*s*b*h/t`` with selective
  recomputation, ``2*s*b*h`` with full recomputation; the first pipeline stage holds ``p`` micro-batches in
  flight (1F1B); the output layer stores ``4*s*b*v/t`` bytes of fp32 logits.
* Measurement (tests/test_memory_measured.py, docs/how-numbers-are-made.md): Llama-family blocks' activations op
  by op as ``torch.autograd.graph.saved_tensors_hooks`` sees them, the loss peak and optimizer-step temporaries with
  PyTorch's ``MemTracker``, strategy state bytes from the live objects of 2-process runs.
* DeepSpeed 0.19 ``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs``
  (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py): the CPU memory that offload needs, and a cross-check.

One piece: every row of the per-GPU breakdown is computed from the same model, shape, parallel degrees and
layout, and the measured test table checks them together; the GPT-style (Korthikanti) and measured Llama-family
accountings sit side by side so that a model's row can be traced to one function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .hardware import Hardware
from .model import ModelSpec
from .parallel import ParallelDims
from .strategies import STRATEGIES, StrategySpec, runs_as
from .training import Checkpointing, OptimizerKind, Precision, TrainingShape
from .units import GiB, MiB

__all__ = [
    "Assumptions",
    "stage_params",
    "MemoryBreakdown",
    "state_bytes_per_param",
    "zero_paper_model_states",
    "deepspeed_zero_model_states",
    "activation_bytes_per_layer",
    "korthikanti_per_layer",
    "estimate_memory",
    "deepspeed_zero2_estimate",
    "deepspeed_zero3_estimate",
    "ActivationLayout",
    "HF_LAYOUT",
    "REFERENCE_LAYOUT",
    "measured_layout_applies",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Assumptions:
    """Calibration knobs of the memory and time model; every one is shown in the plan."""

    compute_efficiency: float = 0.5
    """Fraction of peak dense FLOP/s the matrix multiplies reach (large-model training reaches 0.4-0.55 MFU)."""
    overlap: float = 0.8
    """Fraction of the backward pass that data-parallel communication can hide behind."""
    cuda_context_bytes: int = 1 * GiB
    """CUDA/ROCm context plus NCCL buffers per process (not seen by ``torch.cuda.memory_allocated``)."""
    fragmentation: float = 0.05
    """Caching-allocator fragmentation as a fraction of the other memory."""
    min_headroom: float = 0.10
    """Free fraction of device memory a recommended candidate must leave (for spikes, evaluation, etc.)."""
    cpu_optimizer_params_per_s: float = 1.0e9
    """Parameters per second one GPU's share of the host cores updates with DeepSpeed's CPU Adam."""

    def __post_init__(self) -> None:
        from ..errors import PlanInputError

        for f in ("compute_efficiency", "overlap", "min_headroom", "fragmentation"):
            v = getattr(self, f)
            if not 0 <= v <= 1 or (f == "compute_efficiency" and v == 0):
                raise PlanInputError(f"assumption {f} must be in (0, 1], got {v}")
        if self.cuda_context_bytes < 0 or self.cpu_optimizer_params_per_s <= 0:
            raise PlanInputError("cuda_context_bytes must be >= 0 and cpu_optimizer_params_per_s > 0")

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBreakdown:
    """Peak memory of one GPU (the worst rank), in bytes, split the way the ZeRO paper does."""

    params: int
    """Parameters resident on the GPU (working copy, or the shard)."""
    grads: int
    """Gradients resident on the GPU."""
    optimizer: int
    """Optimizer states, including fp32 master weights in mixed precision."""
    activations: int
    """Activations saved for backward at the peak (worst pipeline stage)."""
    overhead: int
    """CUDA context, communication buffers, gathered parameters, autocast copies, fragmentation."""
    capacity: int
    """Device memory."""
    detail: dict[str, int] = field(default_factory=dict)
    """The parts of ``overhead`` (and other sub-figures) by name, bytes."""
    cpu_bytes_per_node: int = 0
    """Host memory per node that offload needs (DeepSpeed's estimator, 1.5x buffer factor)."""
    grads_reuse: int = 0
    """Gradient bytes that only ever occupy memory backward has freed, so they are never at the peak together with
    everything else (FSDP2 frees its gradients between steps); :attr:`total` subtracts them."""

    @property
    def model_states(self) -> int:
        """Parameters + gradients + optimizer states (the ZeRO paper's "model states")."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        """Peak per-GPU bytes: the parts, less the gradients that reuse memory backward freed."""
        return self.model_states + self.activations + self.overhead - self.grads_reuse

    @property
    def fits(self) -> bool:
        """Whether the peak is within device memory."""
        return self.total <= self.capacity

    @property
    def headroom(self) -> float:
        """Free fraction of device memory at the peak (negative when it does not fit)."""
        return 1 - self.total / self.capacity

    def rows(self) -> list[tuple[str, int]]:
        """The per-GPU peak as named rows (bytes) that add up to :attr:`total`, for the plan and the wizard.

        The activations row is split into the blocks, the final norm and head input, the loss at its peak and one
        block rebuilt by recomputation; the overhead into its named parts.
        """
        d = self.detail
        parts = [("parameters", self.params), ("gradients", self.grads), ("optimizer states", self.optimizer)]
        loss, rec = d.get("loss_peak", 0), d.get("activations_recompute_peak", 0)
        work = d.get("activations_backward_working", 0)
        loss_row = ("loss (logits, fp32 softmax, grads)", loss)
        rec_row = ("recomputation (one block rebuilt)", rec)
        if work:  # the larger of the loss at the start of backward and one block's backward
            tail = [loss_row] if loss >= rec + work else [rec_row, ("one block's backward (gradients in flight)", work)]
        else:
            tail = [loss_row, rec_row]
        tail = [("final norm + head input", d.get("activations_head", 0)), *tail]
        tail = [(label, value) for label, value in tail if value]
        parts.append(("activations (blocks)", self.activations - sum(value for _, value in tail)))
        parts += tail
        labels = {
            "gathered_params": "FSDP/ZeRO-3 gathered units + reduce-scatter", "comm_buckets": "communication buckets",
            "autocast_weight_copies": "autocast weight copies", "optimizer_step_excess": "optimizer step temporaries",
            "cuda_context": "CUDA context + NCCL", "allocator_reserve": "caching-allocator reserve",
            "rehearsal_correction": "rehearsed peak - modelled (calibration)",
        }  # fmt: skip
        parts += [(label, d[k]) for k, label in labels.items() if d.get(k)]
        known = sum(d.get(k, 0) for k in labels)
        if self.overhead != known:
            parts.append(("other overhead", self.overhead - known))
        if self.grads_reuse:  # FSDP2 frees its gradients between steps: they never meet all the activations
            parts.append(("gradients in memory backward freed (FSDP2)", -self.grads_reuse))
        return parts

    def to_dict(self) -> dict[str, Any]:
        """Bytes as integers: ``params, grads, optimizer, activations, overhead, total`` and more."""
        return {
            "params": self.params, "grads": self.grads, "optimizer": self.optimizer,
            "activations": self.activations, "overhead": self.overhead, "total": self.total,
            "model_states": self.model_states, "capacity": self.capacity, "headroom": round(self.headroom, 4),
            "cpu_bytes_per_node": self.cpu_bytes_per_node, "grads_reuse": self.grads_reuse,
            "detail": dict(self.detail),
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryBreakdown:
        """Inverse of :meth:`to_dict`."""
        return cls(
            params=int(data["params"]), grads=int(data["grads"]), optimizer=int(data["optimizer"]),
            activations=int(data["activations"]), overhead=int(data["overhead"]), capacity=int(data["capacity"]),
            detail={k: int(v) for k, v in data.get("detail", {}).items()},
            cpu_bytes_per_node=int(data.get("cpu_bytes_per_node", 0)), grads_reuse=int(data.get("grads_reuse", 0)),
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Model states
# ---------------------------------------------------------------------------------------------------------------
_OPT_STATE_BYTES = {OptimizerKind.ADAMW: 8, OptimizerKind.ADAMW_8BIT: 2, OptimizerKind.SGD: 4}


def state_bytes_per_param(precision: Precision, optimizer: OptimizerKind, family: str) -> tuple[int, int, int]:
    """Bytes per parameter of (params, grads, optimizer) before sharding.

    Mixed precision, DeepSpeed's layout (ZeRO paper Sec. 3.1): fp16/bf16 params 2, grads 2, and ``K`` = fp32 master
    copy 4 + states (Adam 8, 8-bit Adam 2 (Dettmers et al. 2022), SGD momentum 4); K = 12 for Adam.
    Mixed precision, PyTorch's layout (DDP with autocast, FSDP with ``MixedPrecision``): the fp32 weights *are*
    the parameters (4) and gradients are fp32 (4), so the optimizer holds only its states; the totals are equal.
    Pure bf16 keeps everything in 2 bytes (Adam states in bf16: 4); fp32 keeps 4 + 4 + states.

    ``fp8`` is bf16-mixed here and in every other row of the breakdown (activations in bf16 included): torchtitan's
    float8 recipe keeps fp32 parameters with FSDP2's bf16 mixed precision (torchtitan docs/float8.md), and torchao's
    ``Float8Linear`` keeps its weight in high precision, casting it to float8 inside forward (torchao/float8/README.md,
    ``float8_linear.py``): the float8 weight copy is transient, and with tensorwise scaling one fp32 scale per
    tensor. What the FP8 linears save for backward in float8 (their inputs, 1 byte instead of 2) is not subtracted:
    the plan overstates fp8's activations by at most that, on the safe side.
    """
    states = _OPT_STATE_BYTES[optimizer]
    if precision.is_mixed:
        if family == "deepspeed":
            return 2, 2, 4 + states
        return 4, 4, states
    if precision is Precision.BF16_TRUE:
        return 2, 2, states // 2
    return 4, 4, states


def zero_paper_model_states(params: int, stage: int, dp: int, k: int = 12) -> int:
    """Model-state bytes per device from the ZeRO paper, Sec. 3.1 / Table 1 (fp16 params and grads, K bytes)."""
    if stage == 0:
        return (2 + 2 + k) * params
    if stage == 1:
        return 4 * params + k * params // dp
    if stage == 2:
        return 2 * params + (2 + k) * params // dp
    if stage == 3:
        return (2 + 2 + k) * params // dp
    raise ValueError(f"ZeRO stage must be 0..3, got {stage}")


def deepspeed_zero_model_states(params: int, stage: int, dp: int, *, grad_accum: int, k: int = 12) -> int:
    """Model-state bytes per device as DeepSpeed implements ZeRO (fp16/bf16 params and grads, K bytes).

    The paper's figures (:func:`zero_paper_model_states`) except stage 1 with one micro-batch per step: DeepSpeed's
    stage 1 keeps only its gradient partition at every accumulation boundary (see
    :func:`~.strategies.runs_as`), so it holds what stage 2 holds; with ``grad_accum`` > 1 the gradients accumulate
    whole between boundaries, the paper's P_os.
    """
    if stage == 1 and grad_accum == 1:
        return zero_paper_model_states(params, 2, dp, k)
    return zero_paper_model_states(params, stage, dp, k)


def pipeline_blocks(model: ModelSpec, pp: int, *, light_edges: bool = False) -> list[int]:
    """Blocks per pipeline stage, split as the workers split them.

    :func:`~.pipeline.stage_bounds`, with the head and final norm costing ``(vocab * hidden + norm) / block``
    blocks on the last stage; ``light_edges``: Llama 3's layout (:func:`~.pipeline.light_edge_bounds`), which only
    the planner models.
    """
    if pp <= 1:
        return [model.layers]
    from .pipeline import light_edge_bounds, stage_bounds

    if light_edges:
        return [end - start for start, end in light_edge_bounds(model.layers, pp)]

    head = (model.vocab * model.hidden + model.norm_params) / max(1, model.layer_params)
    return [end - start for start, end in stage_bounds(model.layers, pp, last_extra=head)]


def stage_params(
    model: ModelSpec, dims: ParallelDims, virtual: int = 1, *, light_edges: bool = False
) -> tuple[float, float, float]:
    """(dense, expert, block) parameters one rank holds before ZeRO/FSDP sharding, for the worst pipeline rank.

    Blocks are split ``pp x virtual`` ways as :func:`pipeline_blocks` says (stage ``i`` on rank ``i % pp``: a rank of
    the interleaved schedule holds ``virtual`` stages) (the first stage also holds the input embedding,
    the last the output projection and final norm; the stage with the most parameters is the worst); TP splits
    block and embedding matrices ``tp`` ways (Megatron-LM); EP splits experts ``ep`` ways. What TP does not split
    stays whole on every tensor-parallel rank: the norms' weights and biases (sequence parallelism splits their
    activations, not their weights), the biases of the row-parallel projections
    (attention output, MLP down projection) and a learned position table (Shoeybi et al. 2019; the same in
    PyTorch's ``ColwiseParallel``/``RowwiseParallel``, measured to the byte in tests/test_tensor_parallel.py), and a
    MoE router, which every tensor-parallel rank needs whole to route its tokens (Megatron-LM's ``TopKRouter`` weight
    and torchtitan's router gate are replicated over TP; measured in tests/test_expert_parallel.py).
    ``block`` is one block's share, the unit that ZeRO-3/FSDP gather at a time.
    """
    scale = model.params / model.params_from_dims if model.params_override else 1.0
    expert_per_block = model.experts * model.expert_params if model.is_moe else 0
    dense_per_block = model.layer_params - expert_per_block
    whole_per_block = (2 * model.norm_params + model.router_params
                       + model.hidden * (model.out_bias + (model.mlp_bias and not model.is_moe)))  # fmt: skip
    positions = model.max_positions * model.hidden
    n_stages = dims.pp * virtual
    first = model.embedding_params + (model.lm_head_params + model.norm_params if n_stages == 1 else 0)
    first_whole = positions + (model.norm_params if n_stages == 1 else 0)
    last = model.lm_head_params + model.norm_params + (model.embedding_params if model.tied_embeddings else 0)
    last_whole = model.norm_params + (positions if model.tied_embeddings else 0)
    counts = pipeline_blocks(model, n_stages, light_edges=light_edges)

    def stage(i: int) -> tuple[float, float]:
        blocks = counts[i]
        edge = (first if i == 0 else 0) + (last if i == n_stages - 1 and n_stages > 1 else 0)
        edge_whole = (first_whole if i == 0 else 0) + (last_whole if i == n_stages - 1 and n_stages > 1 else 0)
        split = blocks * (dense_per_block - whole_per_block) + edge - edge_whole
        return split / dims.tp + blocks * whole_per_block + edge_whole, blocks * expert_per_block / dims.ep

    def rank(r: int) -> tuple[float, float]:
        parts = [stage(i) for i in range(r, n_stages, dims.pp)]
        return sum(d for d, _ in parts), sum(e for _, e in parts)

    dense, expert = max((rank(r) for r in range(dims.pp)), key=lambda de: de[0] + de[1])
    block = ((dense_per_block - whole_per_block) / dims.tp + whole_per_block + expert_per_block / dims.ep) * scale
    return dense * scale, expert * scale, block


# ---------------------------------------------------------------------------------------------------------------
# Activations (Korthikanti et al. 2022, generalised to GQA, gated MLPs, MoE, FlashAttention, CP)
# ---------------------------------------------------------------------------------------------------------------
def korthikanti_per_layer(
    s: int, b: int, h: int, a: int, *, t: int = 1, sp: bool = False, recompute: str = "none"
) -> float:
    """Activation bytes of one GPT layer exactly as in Korthikanti et al. 2022, Table 2 (fp16, with dropout).

    Full recomputation is Table 2's ``2sbh`` (each layer's input). With sequence parallelism that input is
    already split along the sequence (Megatron-LM checkpoints the ``[s/t, b, h]`` shard), so we use ``2sbh/t``;
    Table 2 has no SP row for full recomputation, and Sec. 5 sets ``2sbhL/t`` aside for the extra all-gather it
    costs when the input is replicated across the tensor-parallel ranks.
    """
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    attn_core = 0.0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return s * b * h / t * (34 + attn_core)
    return s * b * h * (10 + 24 / t + attn_core / t)


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationLayout:
    """How an implementation of a Llama-style block lays out what it saves (the parts that differ between them).

    Measured with ``torch.autograd.graph.saved_tensors_hooks`` in tests/test_memory_measured.py: Hugging Face's
    Llama/Mistral/Qwen2/Mixtral layers (:data:`HF_LAYOUT`, the planner's default) and the reference
    ``jupyter_dist.models.Transformer`` (:data:`REFERENCE_LAYOUT`).
    """

    kv_repeated: bool = False
    """K and V are expanded to the query heads before SDPA (``repeat_interleave``) instead of ``enable_gqa``."""
    rope_tables_per_block: bool = False
    """Each block builds its own fp32 ``cos``/``sin`` tables, ``(s, head_dim / 2)`` each (HF builds them once)."""
    attention_output_copied: bool = False
    """The output projection's input is a copy of the SDPA output (``transpose(1, 2).reshape`` of a contiguous
    ``(b, heads, s, d)`` output) rather than a view of it."""


HF_LAYOUT = ActivationLayout()
"""Hugging Face transformers 5 with ``attn_implementation="sdpa"``."""
REFERENCE_LAYOUT = ActivationLayout(kv_repeated=True, rope_tables_per_block=True, attention_output_copied=True)
"""The reference ``jupyter_dist.models.Transformer``."""


def _matmuls(model: ModelSpec, t: int) -> list[tuple[float, bool]]:
    """(output width on one tensor-parallel rank, has a bias) of a dense block's linears, in forward order."""
    out = [(model.q_dim / t, model.qkv_bias), (model.kv_dim / t, model.qkv_bias), (model.kv_dim / t, model.qkv_bias),
           (model.hidden, model.out_bias)]  # fmt: skip
    f = model.d_ffn / t
    if model.gated_mlp:
        out += [(f, model.mlp_bias), (f, model.mlp_bias), (model.hidden, model.mlp_bias)]
    else:
        out += [(f, model.mlp_bias), (model.hidden, model.mlp_bias)]
    return out


def measured_layout_applies(model: ModelSpec) -> bool:
    """Whether :func:`activation_bytes_per_layer` uses the measured Llama-family layout (RMSNorm, no dropout).

    GPT-style blocks (LayerNorm, dropout) keep Korthikanti et al.'s accounting term by term.
    """
    return model.norm == "rmsnorm" and not model.dropout


def _llama_layer(model: ModelSpec, training: TrainingShape, dims: ParallelDims, recompute: Checkpointing,
                 layout: ActivationLayout) -> float:  # fmt: skip
    """Bytes one Llama-family block keeps for backward, op by op as PyTorch saves them (measured to the byte).

    ``e`` is the compute dtype's size (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` and ``bf16-true`` run the
    block in bf16; ``fp32`` in fp32). Each RMSNorm saves its fp32 input (``x.float()``: the input itself in fp32,
    a copy otherwise) ``4sbh``, ``rsqrt`` ``4sb`` and the normalised tensor before and after the weight, ``2e sbh``.
    Attention saves Q ``e sb q``, K and V ``e sb kv`` each (``e sb q`` when repeated), the SDPA output ``e sb q``
    (and its copy when the layout copies it) and the fp32 log-sum-exp ``4sba``; per-head Q/K norms (Qwen3) add
    their fp32 inputs ``4sb(q+kv)``, ``rsqrt`` per head and the normalised Q and K before the weight ``e sb(q+kv)``
    (the weighted output goes to the rotary embedding, which keeps only its tables); a SwiGLU MLP saves gate, up,
    act(gate) and their product, ``4e sbF``; a GeLU one its two inputs ``2e sbF``. A top-k MoE (Hugging Face's
    Mixtral experts) saves per routed slot the expert's index ``16``, its gathered input, output and weighted output
    ``3e h``, the fused gate-up output ``2e F``, act and product ``2e F``, the fp32 weight ``4``; and per token the
    fp32 router softmax ``4E``, top-k indices and values ``12k`` and their sum ``4``.
    ``selective`` drops the log-sum-exp and the SDPA output where only the kernel keeps it; ``op`` keeps the block
    input, the SDPA outputs and every other ``mm`` output (bias-free linears; ``addmm`` is recomputed), as
    torchtitan's policy does; ``full`` keeps the block input; ``layer:K`` averages K-1 blocks without and one with
    full checkpointing.
    """
    s = training.seq_len / dims.cp
    b = training.micro_batch
    h, t, a = model.hidden, dims.tp, model.heads / dims.tp
    e = training.precision.bytes_per_activation
    sb = s * b
    sp = t if dims.sp else 1
    if recompute is Checkpointing.FULL:
        return e * sb * h / sp
    if recompute is Checkpointing.LAYER:
        k = training.checkpoint_every
        none = _llama_layer(model, training, dims, Checkpointing.NONE, layout)
        full = _llama_layer(model, training, dims, Checkpointing.FULL, layout)
        return ((k - 1) * none + full) / k
    q, kv = model.q_dim / t, model.kv_dim / t
    lse = 4 * sb * a if training.flash_attention else 2 * e * a * s * s * b  # fp32 log-sum-exp, or the scores
    attn_out = e * sb * q
    if recompute is Checkpointing.OP:
        kept, count = e * sb * h / sp + attn_out + lse, 0
        for width, bias in _matmuls(model, t):
            if not bias:
                count += 1
                kept += e * sb * width if count % 2 == 1 else 0
        return kept
    norms = 2 * (4 * sb * h + 4 * sb + 2 * e * sb * h) / sp
    if model.qk_norm:  # per head on Q and K: fp32 input, rsqrt per head, the normalised tensor before the weight
        heads = a + model.n_kv_heads / t
        norms += (4 + e) * sb * (q + kv) + 4 * sb * heads
    kv_saved = q if layout.kv_repeated else kv
    attention = e * sb * q + 2 * e * sb * kv_saved + attn_out * (2 if layout.attention_output_copied else 1) + lse
    rope = 4 * s * model.d_head if layout.rope_tables_per_block else 0.0
    if recompute is Checkpointing.SELECTIVE:
        attention -= lse + (attn_out if layout.attention_output_copied else 0)
    f = model.d_ffn / t
    if model.is_moe:
        slots = sb * model.top_k
        mlp = slots * (20 + 3 * e * h + 4 * e * f) + sb * (4 * model.experts + 12 * model.top_k + 4)
    else:
        mlp = (4 if model.gated_mlp else 2) * e * sb * f
    return norms + attention + rope + mlp


def _measured_block(model: ModelSpec, training: TrainingShape, dims: ParallelDims,
                    recompute: Checkpointing) -> float | None:  # fmt: skip
    """A measured module's block (``model.activations_of``: autograd's saved bytes, fitted and scaled), or ``None``.

    Used without tensor parallelism (how a module's own block splits is not measured) for ``none``, ``full`` (the
    block input ``e·sbh``, what checkpointing keeps whatever the block) and ``layer:K`` (their average);
    ``selective`` and ``op`` keep the layout's accounting. Context parallelism divides the sequence.
    """
    if model.activations_of is None or dims.tp > 1:
        return None
    if recompute not in (Checkpointing.NONE, Checkpointing.FULL, Checkpointing.LAYER):
        return None
    e = training.precision.bytes_per_activation
    s = training.seq_len // dims.cp
    b = training.micro_batch
    if recompute is Checkpointing.FULL:
        return float(e * s * b * model.hidden)
    none = model.activations_of(b, s, e)
    if none is None:
        return None
    if recompute is Checkpointing.LAYER:
        k = training.checkpoint_every
        return ((k - 1) * float(none) + e * s * b * model.hidden) / k
    return float(none)


def activation_bytes_per_layer(
    model: ModelSpec, training: TrainingShape, dims: ParallelDims, *, recompute: Checkpointing | None = None,
    layout: ActivationLayout = HF_LAYOUT,
) -> float:  # fmt: skip
    """Bytes one transformer block saves for backward, per micro-batch, on one rank.

    Llama-family blocks (RMSNorm, no dropout: :func:`measured_layout_applies`) are counted op by op as PyTorch
    saves them (:func:`_llama_layer`, equal to the measurement of real blocks in tests/test_memory_measured.py).
    Other blocks follow Korthikanti et al.'s accounting term by term (fp16 activations, 1-byte dropout masks) so
    that a GPT layer (MHA, 4h GeLU MLP, dropout, no FlashAttention) gives exactly their Table 2; the terms are
    generalised: Q is ``2sb*q_dim`` and K, V ``2sb*kv_dim`` each (grouped-query attention); a GeLU MLP of width F
    stores ``4sbF`` (activation input and second-linear input), a gated (SwiGLU) one ``8sbF`` (gate, up, act(gate)
    and their product); MoE multiplies the MLP term by top-k and adds fp32 router logits ``4sbE``; FlashAttention
    replaces the ``a*s^2*b`` score terms by its fp32 log-sum-exp ``4sba``; context parallelism divides ``s``.
    ``op`` and ``layer:K`` on such blocks: ``op`` as full recomputation plus the matmul outputs torchtitan keeps
    (every other one, counted as for the measured layout), ``layer:K`` the average of K-1 plain and one full block.
    """
    recompute = training.checkpointing if recompute is None else recompute
    measured = _measured_block(model, training, dims, recompute)
    if measured is not None:
        return measured
    if measured_layout_applies(model):
        return _llama_layer(model, training, dims, recompute, layout)
    s = training.seq_len / dims.cp
    b = training.micro_batch
    h = model.hidden
    t = dims.tp
    scale = 2.0 if training.precision is Precision.FP32 else 1.0  # the paper assumes 2-byte activations
    if recompute is Checkpointing.FULL:
        return 2 * s * b * h * scale / (t if dims.sp else 1)
    if recompute is Checkpointing.LAYER:
        k = training.checkpoint_every
        none = activation_bytes_per_layer(model, training, dims, recompute=Checkpointing.NONE)
        full = activation_bytes_per_layer(model, training, dims, recompute=Checkpointing.FULL)
        return ((k - 1) * none + full) / k
    if recompute is Checkpointing.OP:
        kept, count = 2 * s * b * h * scale / (t if dims.sp else 1), 0
        for width, bias in _matmuls(model, t):
            if not bias:
                count += 1
                kept += 2 * scale * s * b * width if count % 2 == 1 else 0
        return kept + 2 * scale * s * b * model.q_dim / t + 4 * s * b * model.heads / t
    masks = 2 * s * b * h if model.dropout else 0.0  # attention-output and MLP-output dropout masks
    replicated = 4 * s * b * h + 2 * s * b * h + 2 * s * b * h  # two norm inputs, QKV input, MLP input
    ffn = model.d_ffn
    mlp = (8 if model.gated_mlp else 4) * s * b * ffn * model.top_k
    if model.is_moe:
        mlp += 4 * s * b * model.experts
    parallel = 2 * s * b * model.q_dim + 4 * s * b * model.kv_dim + 2 * s * b * model.q_dim + mlp
    a = model.heads
    if recompute is Checkpointing.SELECTIVE:
        core = 0.0
    elif training.flash_attention:
        core = 4 * s * b * a  # fp32 log-sum-exp per query and head
    elif model.dropout:
        core = (2 * scale + 1 + 2 * scale) * a * s * s * b  # softmax output, dropout mask, dropout output
    else:
        core = 2 * scale * a * s * s * b  # softmax output
    replicated_total = (replicated * scale + masks) / (t if dims.sp else 1)
    return replicated_total + (parallel * scale + core) / t


def _rank_peak(
    training: TrainingShape, pp: int, grad_accum: int, rank: int, held: list[float], during_backward: list[float]
) -> tuple[float, int]:
    """(bytes, forwards held) at pipeline rank ``rank``'s activation peak under the plan's schedule.

    ``held[i]``: what stage ``i`` keeps per micro-batch from its forward until its backward;
    ``during_backward[i]``: what that micro-batch occupies while its backward runs (the stage's transient buffers
    added). The rank's forwards and backwards run in the order of :func:`~.pipeline.schedule_actions`: a forward
    adds its stage's ``held``, a backward peaks at ``during_backward`` and then frees it. So 1F1B holds
    ``min(m, pp - s)`` micro-batches on stage ``s``, GPipe all ``m`` on every stage, and interleaved 1F1B its
    warm-up forwards plus one (spread over the rank's stages).
    """
    from .pipeline import Run, schedule_runs

    virtual = len(held) // pp
    now, count, peak, peak_count = 0.0, 0, 0.0, 0

    def act(kind: str, stage: int) -> None:
        nonlocal now, count, peak, peak_count
        if kind == "F":
            now, count = now + held[stage], count + 1
            if now > peak:
                peak, peak_count = now, count
            return
        if now - held[stage] + during_backward[stage] > peak:
            peak, peak_count = now - held[stage] + during_backward[stage], count
        now, count = now - held[stage], count - 1

    def drift(pattern: tuple[Any, ...]) -> tuple[float, int]:
        if isinstance(pattern[0][0], str):
            return (sum(held[s] if k == "F" else -held[s] for k, s in pattern),
                    sum(1 if k == "F" else -1 for k, _ in pattern))  # fmt: skip
        parts = [drift(p) for p, _ in pattern]
        return sum(d * r for (d, _), (_, r) in zip(parts, pattern, strict=True)), sum(
            c * r for (_, c), (_, r) in zip(parts, pattern, strict=True))

    def follow(runs: list[Run] | tuple[Any, ...]) -> None:
        # a repeated pattern's values grow by the same amount each time, so the peak is in its first or last
        # repetition: a run of billions of micro-batches costs two repetitions (short runs are followed one by one)
        nonlocal now, count
        for pattern, repeat in runs:
            for i in range(repeat) if repeat <= 64 else (0, repeat - 1):
                if repeat > 64 and i == repeat - 1:
                    d_now, d_count = drift(pattern)
                    now, count = now + (repeat - 2) * d_now, count + (repeat - 2) * d_count
                if isinstance(pattern[0][0], str):
                    for kind, stage in pattern:
                        act(kind, stage)
                else:
                    follow(pattern)

    follow(schedule_runs(training.pp_schedule, pp=pp, microbatches=grad_accum, rank=rank, virtual=virtual))
    return peak, peak_count


def _activation_bytes(
    model: ModelSpec, training: TrainingShape, dims: ParallelDims, grad_accum: int, layout: ActivationLayout
) -> dict[str, int]:
    """Peak activation bytes of the worst pipeline rank, and its parts."""
    s = training.seq_len / dims.cp
    b = training.micro_batch
    h, v, t = model.hidden, model.vocab, dims.tp
    virtual = training.pp_stages_per_rank if dims.pp > 1 else 1
    counts = pipeline_blocks(model, dims.pp * virtual, light_edges=training.pp_light_edges)
    per_layer = activation_bytes_per_layer(model, training, dims, layout=layout)
    # Korthikanti Sec. 4.3: input-embedding dropout mask (sbhp/t: "also parallelized along the sequence
    # dimension" with SP, replicated without it), final norm + output projection input, fp32 logits
    embed = s * b * h / (t if dims.sp else 1) if model.dropout else 0.0
    sp = t if dims.sp else 1
    saved_loss = 0.0
    if measured_layout_applies(model):
        e = training.precision.bytes_per_activation
        # the final RMSNorm as in a block (fp32 input 4sbh, rsqrt 4sb, normalised before/after the weight 2e*sbh);
        # the loss at its peak (the start of its backward), measured with MemTracker in
        # tests/test_memory_measured.py: the logits (e*sbv, held by the caller), their fp32 log-softmax (4sbv,
        # saved by cross-entropy; the fp32 upcast itself is freed after forward), the log-softmax's incoming
        # gradient and the logits' fp32 gradient (4sbv each): (e + 12) s b v
        head = (4 * s * b * h + 4 * s * b + 2 * e * s * b * h) / sp
        loss = (e + 12) * s * b * v / t
        saved_loss = (e + 4) * s * b * v / t  # what a micro-batch's loss keeps until its backward: logits, log-softmax
    else:
        # Korthikanti Sec. 4.3: final norm + output projection input, fp32 logits
        head = 4 * s * b * h / sp
        loss = 4 * s * b * v / t
    # recomputation rebuilds one block's activations at a time in backward (Korthikanti Sec. 5): full, every K-th
    # block, and op-level (what the policy did not keep)
    recompute_peak = 0.0
    if training.checkpointing in (Checkpointing.FULL, Checkpointing.LAYER, Checkpointing.OP):
        recompute_peak = activation_bytes_per_layer(model, training, dims, recompute=Checkpointing.NONE, layout=layout)
    working = 0.0
    if measured_layout_applies(model):
        # a block's backward works on the gradients of its MLP (two e*sbF tensors in flight) and of its output
        # (e*sbh); that happens after the loss's buffers are freed, so the step's activation peak is the larger of
        # the loss at the start of backward and one block's backward (rebuilt under recomputation). MemTracker on
        # real blocks, to within one e*sbh tensor (tests/test_memory_measured.py).
        e = training.precision.bytes_per_activation
        working = 2 * e * s * b * model.d_ffn * model.top_k / t + e * s * b * h / sp
        backward = recompute_peak + working
        output, after = head + max(loss, backward), 0.0
        edge_saved, edge_backward, inner_backward = head + saved_loss, output, backward
    else:
        output, after = head + loss, recompute_peak
        edge_saved, edge_backward, inner_backward = head + loss, head + loss, 0.0
    in_flight, blocks_in_flight = 1, counts[0]
    if dims.pp == 1:
        total = counts[0] * per_layer + embed + output
    else:
        # what each stage keeps per micro-batch until its backward, and what it occupies during that backward
        n = len(counts)
        held = [c * per_layer + (embed if i == 0 else 0.0) + (edge_saved if i == n - 1 else 0.0)
                for i, c in enumerate(counts)]  # fmt: skip
        during = [c * per_layer + (embed if i == 0 else 0.0) + (edge_backward if i == n - 1 else inner_backward)
                  for i, c in enumerate(counts)]  # fmt: skip
        total = max(_rank_peak(training, dims.pp, grad_accum, r, held, during)[0] for r in range(dims.pp))
        # the first rank's forwards held at once, and their blocks (what the pipeline tests measure with hooks)
        blocks = [float(c) for c in counts]
        first_blocks, in_flight = _rank_peak(training, dims.pp, grad_accum, 0, blocks, blocks)
        blocks_in_flight = int(first_blocks)
    return {
        "activations_per_layer": int(per_layer), "activations_in_flight": in_flight,
        "activations_blocks_in_flight": blocks_in_flight,
        "activations_head": int(head), "loss_peak": int(loss), "activations_logits": int(loss),
        "activations_recompute_peak": int(recompute_peak), "activations_backward_working": int(working),
        "activations": int(total + after),
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed's own estimators, re-implemented from deepspeed 0.19 (see module docstring) and checked against it.
# ---------------------------------------------------------------------------------------------------------------
def deepspeed_zero2_estimate(
    total_params: int,
    *,
    gpus_per_node: int = 1,
    nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """(CPU bytes per node, GPU bytes) of ZeRO-2 model states, as ``estimate_zero2_model_states_mem_needs``."""
    total_gpus = nodes * gpus_per_node
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu = 2 * total_params + int(18 * total_params / total_gpus)
        cpu = total_params * 4 * gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


def deepspeed_zero3_estimate(
    total_params: int,
    largest_layer_params: int,
    *,
    gpus_per_node: int = 1,
    nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int]:
    """(CPU bytes per node, GPU bytes, largest layer bytes), as ``estimate_zero3_model_states_mem_needs``."""
    total_gpus = nodes * gpus_per_node
    gpus_factor = 1 / nodes
    largest = 4 * largest_layer_params
    # the products are written in DeepSpeed's order so that the float results (and their int()) are identical
    if cpu_offload:
        if cpu_offload_params:
            gpu = largest
            if zero_init:
                cpu = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu = total_params * max(4 * gpus_per_node, 18 * gpus_factor) * additional_buffer_factor
        else:
            gpu = largest + int(2 * total_params / total_gpus)
            if zero_init:
                cpu = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu = total_params * max(4 * gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
    else:
        gpu = largest + int(18 * total_params / total_gpus)
        if zero_init:
            cpu = largest_layer_params * 4 * gpus_per_node * additional_buffer_factor
        else:
            cpu = total_params * 4 * gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu), largest


# ---------------------------------------------------------------------------------------------------------------
# The whole breakdown
# ---------------------------------------------------------------------------------------------------------------
def over_bucket_params(model: ModelSpec, bucket: int) -> int:
    """Parameters in tensors of more than ``bucket`` elements (one full-model replica, before any parallelism).

    DeepSpeed's ZeRO-1/2 reduce such a gradient on its own instead of copying it into the reduce bucket
    (``extra_large_param_to_reduce``, stage_1_and_2.py). Counted per tensor: the token embedding, an untied output
    projection, the q/k/v/o projections and the MLP matrices (per expert).
    """
    h, f, kv = model.hidden, model.d_ffn, model.kv_dim
    per_layer = [h * h, h * kv, h * kv, h * h] + [h * f] * (3 if model.gated_mlp else 2) * model.experts
    total = model.layers * sum(n for n in per_layer if n > bucket)
    total += sum(n for n in (model.vocab * h, model.lm_head_params) if n > bucket)
    scale = model.params / model.params_from_dims if model.params_override else 1.0
    return int(total * scale)


def comm_settings(model: ModelSpec, strategy: StrategySpec) -> dict[str, int]:
    """Bucket sizes the plan decides and the compiler writes (elements), so memory and configs agree.

    DeepSpeed's defaults (5e8-element buckets) cost 1 GB each; we use the sizes the Hugging Face integration
    derives from the model ("auto"): reduce bucket h^2, ZeRO-3 prefetch 0.9 h^2, persistence threshold 10 h.
    """
    h2 = model.hidden * model.hidden
    if strategy.family == "deepspeed":
        out = {"reduce_bucket_size": h2, "allgather_bucket_size": h2}
        if strategy.shard_params:
            out.update(stage3_prefetch_bucket_size=int(0.9 * h2), stage3_param_persistence_threshold=10 * model.hidden,
                       stage3_max_live_parameters=int(1e9), stage3_max_reuse_distance=int(1e9))  # fmt: skip
        return out
    if strategy.family == "ddp":
        return {"bucket_cap_mb": 25}
    return {}


def estimate_memory(
    model: ModelSpec,
    training: TrainingShape,
    hardware: Hardware,
    strategy: StrategySpec,
    dims: ParallelDims,
    *,
    grad_accum: int,
    assumptions: Assumptions,
    layout: ActivationLayout = HF_LAYOUT,
) -> MemoryBreakdown:
    """Peak per-GPU memory of ``strategy`` with ``dims`` (the worst rank); ``layout``: see :class:`ActivationLayout`."""
    # zero1+tp/pp/cp/ep: FSDP2's layout; zero1 with one micro-batch per step: DeepSpeed's partitioned gradients
    strategy = runs_as(strategy, model_parallel=not dims.is_data_parallel_only, grad_accum=grad_accum)
    pb, gb, ob = state_bytes_per_param(training.precision, training.optimizer, strategy.family)
    if strategy.family == "deepspeed" and training.precision is Precision.FP32 and strategy.shard_optimizer:
        # ZeRO-1/2/3 clone their optimizer partition into fp32 master weights even when the model is already fp32
        # (deepspeed/runtime/zero/stage_1_and_2.py ``single_partition_of_fp32_groups``; stage3.py
        # ``fp32_partitioned_groups_flat`` = ``fp16_partitioned_groups_flat[i].clone().float()``, a separate storage
        # from the parameters' ``ds_tensor``). Measured from the live objects of 2-process runs in
        # tests/test_memory_measured.py::test_strategy_state_bytes_equal_measured.
        ob += 4
    virtual = training.pp_stages_per_rank if dims.pp > 1 else 1
    dense, expert, block = stage_params(model, dims, virtual, light_edges=training.pp_light_edges)

    shard = dims.shard_size
    eshard = dims.expert_shard_size
    if strategy.hybrid:  # shard inside a node, replicate across nodes (as the mesh lays the replicas out)
        shard = dims.shard_size // dims.hybrid_replicas(hardware.gpus_per_node)
        eshard = max(1, shard // dims.ep)

    def sharded(bytes_per_param: int, on: bool) -> int:
        if not on:
            return int(bytes_per_param * (dense + expert))
        return int(bytes_per_param * (dense / shard + expert / eshard))

    # FSDP SHARD_GRAD_OP shards parameters at rest too (PyTorch docs: "everything is sharded outside computation");
    # only its compute-dtype unsharded copy lives from forward to the end of backward, counted in
    # ``gathered_params`` below. Counting the fp32 parameters unsharded as well would double them.
    params = sharded(pb, strategy.shard_params or strategy.keeps_gathered_params)
    grads = sharded(gb, strategy.shard_grads)
    optimizer = sharded(ob, strategy.shard_optimizer)
    detail: dict[str, int] = {}
    compute_bytes = 4 if training.precision is Precision.FP32 else 2
    local = dense + expert

    cpu = 0
    if strategy.offload_optimizer or strategy.offload_params:
        # what leaves the GPU goes to host memory; size the host side with DeepSpeed's own estimator
        detail["offloaded_to_cpu"] = optimizer + grads + (params if strategy.offload_params else 0)
        if strategy.shard_params:
            cpu = deepspeed_zero3_estimate(
                model.params, model.largest_module_params, gpus_per_node=hardware.gpus_per_node,
                nodes=hardware.nodes, cpu_offload=True, cpu_offload_params=strategy.offload_params,
            )[0]  # fmt: skip
        else:
            cpu = deepspeed_zero2_estimate(
                model.params, gpus_per_node=hardware.gpus_per_node, nodes=hardware.nodes, cpu_offload=True
            )[0]
        optimizer = 0
        grads = 0
        if strategy.offload_params:
            params = 0

    # ---- overhead -------------------------------------------------------------------------------------------
    detail["cuda_context"] = assumptions.cuda_context_bytes
    settings = comm_settings(model, strategy)
    if strategy.family == "ddp":
        detail["comm_buckets"] = 2 * settings["bucket_cap_mb"] * MiB
        if training.precision.is_mixed:
            # autocast's low-precision weight copies are saved for backward (one per weight)
            detail["autocast_weight_copies"] = int(2 * local)
    elif strategy.family == "deepspeed":
        detail["comm_buckets"] = 2 * (settings["reduce_bucket_size"] + settings["allgather_bucket_size"])
        natively = STRATEGIES.get(strategy.name, strategy).shard_grads  # the table's entry, before runs_as
        if strategy.shard_grads and not natively and not strategy.offload_optimizer:
            # DeepSpeed's ZeRO-1 partitions its gradients in backward (runs_as), but a gradient larger than the reduce
            # bucket is reduced in place and, when it lies in another rank's partition, kept until backward ends
            # (stage 2 frees it: ``clear_grad_attribute``; stage 1 only at the epilogue's ``_clear_param_grad_only``).
            # Measured: ZeRO-1's backward peak minus ZeRO-2's (tests/test_memory_measured.py).
            big = over_bucket_params(model, settings["reduce_bucket_size"])
            detail["zero1_unbucketed_grads"] = int(gb * big * (1 - 1 / shard))
    elif strategy.family == "fsdp" and not strategy.shard_params and not strategy.keeps_gathered_params:
        detail["comm_buckets"] = int(gb * local / max(model.layers, 1))  # one flat-parameter's gradient
    largest_unit = max(
        block,
        model.vocab * model.hidden / dims.tp * (model.params / model.params_from_dims if model.params_override else 1),
    )
    if strategy.shard_params:
        # the unit being used plus the one prefetched, in the compute dtype, and one unit's unsharded gradient
        # in the reduce dtype before reduce-scatter (fp32 for PyTorch mixed precision)
        reduce_bytes = gb if strategy.family != "deepspeed" else compute_bytes
        detail["gathered_params"] = int(2 * largest_unit * compute_bytes + largest_unit * reduce_bytes)
    elif strategy.keeps_gathered_params:
        # SHARD_GRAD_OP keeps every gathered unit from forward until its backward
        detail["gathered_params"] = int(local * compute_bytes + largest_unit * gb)
    if strategy.offload_params:
        detail["gathered_params"] = detail.get("gathered_params", 0) + int(largest_unit * compute_bytes)

    acts = _activation_bytes(model, training, dims, grad_accum, layout)
    activations = acts.pop("activations")
    detail.update(acts)
    temp = 0
    if strategy.offload_optimizer:
        pass
    elif strategy.family == "deepspeed":
        if strategy.shard_optimizer and optimizer:
            # DeepSpeed's estimators count 18 bytes per parameter over dp where the planner counts 14 (2 grads +
            # 12 optimizer): the other 4 are the fp32 gradient partition ZeRO's step() builds
            # (stage_1_and_2.py ``single_grad_partition = flat_grad_partition.to(fp32)``, set as the master
            # partition's .grad; stage3.py likewise) and frees after the update. Both are right at their moment:
            # 14 through forward and backward, 18 during the step, when the activations are freed. The true peak
            # is the larger of the two, so the step's 4 bytes count only where they exceed the activations.
            # Measured in 2-process runs (tests/test_memory_measured.py): the step allocates at least this.
            temp = int(4 * optimizer / ob)
    elif training.optimizer is not OptimizerKind.SGD:
        # torch.optim.AdamW's default multi-tensor (foreach) step builds sqrt(exp_avg_sq) for all of a rank's
        # parameters at once, in the states' dtype: 4 bytes per local parameter, 2 with bf16 states (MemTracker,
        # tests/test_memory_measured.py; on an H200, benchmarks/memory_calibration.py: 1.97 GiB for 1.06B bf16
        # parameters; fused=True builds none). The step runs after backward has freed the activations: only the
        # excess adds.
        temp = int((2 if training.precision is Precision.BF16_TRUE else 4) * params / pb)
    if temp:
        detail["optimizer_step_temporaries"] = temp
        detail["optimizer_step_excess"] = max(0, temp - activations)
    reuse = 0
    if grads and strategy.family == "fsdp2" and grad_accum == 1 and dims.pp == 1:
        # FSDP2 gives each parameter a new sharded gradient in backward (its reduce-scatter's output) and
        # ``zero_grad(set_to_none=True)`` (what jd.step, jd.train_step and the generated loops call) frees it, so
        # with one micro-batch per step and no pipeline no gradient lives through forward: the gradients fill memory
        # backward frees. The peak is the largest of the forward's (activations), the end of backward (gradients +
        # one block's backward) and the optimizer step (gradients + its temporaries), each with the gathered units.
        # On an H200, world of one (benchmarks/memory_calibration.py, docs/gpu.md): the reference model and Hugging
        # Face Llama 1.1B within 0.6 % (Llama `full` 2.8 % high) in every checkpointing mode; DDP keeps its gradients
        # (bucket views) and is planned as before. tests/test_memory_measured.py checks on 2 CPU ranks that FSDP2
        # leaves no gradient from one step's backward to the next forward.
        # (the gathered units are in every term, so they cancel out of the saving)
        inner = detail.get("activations_recompute_peak", 0) + detail.get("activations_backward_working", 0)
        held = grads + activations + detail.get("optimizer_step_excess", 0)
        reuse = max(0, held - max(activations, grads + inner, grads + temp))
    overhead_parts = (
        "cuda_context",
        "comm_buckets",
        "zero1_unbucketed_grads",
        "autocast_weight_copies",
        "gathered_params",
        "optimizer_step_excess",
    )
    before_reserve = params + grads + optimizer + activations + sum(detail.get(k, 0) for k in overhead_parts) - reuse
    # the caching allocator's reserve: memory reserved in blocks that the live tensors do not fill
    detail["allocator_reserve"] = int(assumptions.fragmentation * (before_reserve - assumptions.cuda_context_bytes))
    overhead = sum(detail.get(k, 0) for k in (*overhead_parts, "allocator_reserve"))
    return MemoryBreakdown(
        params=params, grads=grads, optimizer=optimizer, activations=activations, overhead=overhead,
        capacity=hardware.accelerator.memory_bytes, detail=detail, cpu_bytes_per_node=cpu, grads_reuse=reuse,
    )  # fmt: skip
