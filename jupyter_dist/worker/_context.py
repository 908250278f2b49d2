"""Context parallelism inside a worker: the sequence split over the mesh's ``cp`` dimension, ring attention.

PyTorch's own context-parallel attention does the work (``torch.distributed.tensor.experimental``, read in torch
2.13's ``_context_parallel/``): the ``_ContextParallel`` style hooks each attention core so its q, k, v become
DTensors sharded on the sequence (dim 2); ``F.scaled_dot_product_attention`` on them reaches DTensor's dispatcher,
whose context-parallel handlers run ``_templated_ring_attention`` -- each rank attends its queries to every rank's
keys/values (on CUDA gathered once, all-gather rotation; on CPU passed round the ring, see below), merges the
partial results with their log-sum-exps, and in backward sends the key/value gradients home (all-to-all).
The sequence is laid out with the head-tail load balancer (``_HeadTailLoadBalancer``): cut into ``2 x cp`` chunks,
rank ``r`` holds chunks ``r`` and ``2cp-1-r``, so every rank does the same causal work.

On CPU, PyTorch 2.13 does not run it as shipped (``benchmarks/cp_cpu_probe.py`` prints the evidence): its handlers
cover only the CUDA kernels (``_scaled_dot_product_flash_attention``, ``_efficient_attention``,
``_cudnn_attention`` and their backwards), while SDPA on CPU calls ``_scaled_dot_product_flash_attention_for_cpu``,
which has no DTensor sharding strategy ("does not have a sharding strategy registered"), and the math fallback mixes
plain tensors into DTensor ops. The CPU kernel has the same contract as the CUDA flash kernel (returns the output and
the log-sum-exp; its backward takes them back), so this module registers the CPU pair into the same dispatcher table,
running through PyTorch's own ``_templated_ring_attention`` and ``_templated_ring_attention_backward`` -- same ring,
same merge, same load balancing; nothing of the algorithm is reimplemented here. Only the exchange differs: inside
these handlers the ring's rotater is :class:`BlockingRotater` (blocking ``dist.all_to_all_single`` to the next cp
rank) instead of PyTorch's async functional collectives, which corrupted the heap on gloo. On CUDA nothing is added.

Model states are sharded by FSDP2 over ``dp_shard x cp`` (torchtitan's ``dp_shard_cp``): cp ranks hold different
tokens of the same batch, so their gradients average like data-parallel ones, and the planner counts them the same
way (``ParallelDims.shard_size = dp x cp``).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ._env import WorkerEnv, WorkerError

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch.distributed.device_mesh import DeviceMesh


__all__ = [
    "SEQ_DIM", "check_context_parallel", "apply_context_parallel", "positions_hook", "fsdp_mesh", "head_tail_order",
    "shard", "unshard", "local_positions",
]  # fmt: skip

SEQ_DIM = 2
"""The sequence dimension of q, k, v at the attention core (``batch, heads, seq, head_dim``)."""


def head_tail_order(seq_len: int, cp: int) -> list[list[int]]:
    """The positions each cp rank holds under head-tail load balancing (PyTorch's ``_HeadTailLoadBalancer``).

    Rank ``r`` gets chunks ``r`` and ``2cp-1-r`` of ``2 x cp`` equal chunks; pure, for checks and docs.
    """
    if cp < 1 or seq_len % (2 * cp):
        raise WorkerError(
            f"context parallelism: the sequence length {seq_len} is not a multiple of 2 x cp ({2 * cp}); pad or cut "
            f"the sequence to a multiple of {2 * cp}"
        )
    c = seq_len // (2 * cp)
    return [list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c)) for r in range(cp)]


def check_context_parallel(env: WorkerEnv, model: torch.nn.Module, family: str) -> None:
    """One line for what context parallelism cannot run with: a strategy other than FSDP2, a model without cores."""
    if family != "fsdp2":
        raise WorkerError(
            f"jd.wrap: context parallelism (cp{env.cp}) needs JD_STRATEGY=fsdp2 or fsdp2-hybrid (model states are "
            f"sharded over dp x cp), not {env.strategy}; run the fsdp2+cp{env.cp} candidate"
        )
    if _is_hf(model):
        _check_hf(env, model)
        return
    if not callable(getattr(model, "cp_cores", None)):
        raise WorkerError(
            f"jd.wrap: context parallelism (cp{env.cp}) needs to know {type(model).__name__}'s attention cores: give "
            "it a cp_cores() method returning the modules whose forward(q, k, v) calls "
            "F.scaled_dot_product_attention(..., is_causal=True) and a forward(tokens, positions=None) "
            "(as jupyter_dist.models.Transformer has), or run a candidate without cp"
        )
    params = inspect.signature(model.forward).parameters
    if "positions" not in params:
        raise WorkerError(
            f"jd.wrap: context parallelism (cp{env.cp}) needs {type(model).__name__}.forward to take positions= (the "
            "places of this rank's tokens in the sequence, for the rotary angles); jupyter_dist.models.Transformer "
            "does"
        )


HF_CP_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
"""Hugging Face ``model_type``s whose attention goes through ``transformers``' attention interface with
``position_ids`` from the forward (so a registered attention function receives q, k, v after the rotary angles)."""

HF_ATTENTION = "jd_context_parallel"
"""The name under which the ring attention is registered in ``transformers.AttentionInterface``."""


def _is_hf(model: torch.nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__)


def _check_hf(env: WorkerEnv, model: torch.nn.Module) -> None:
    config = model.config  # type: ignore[attr-defined]
    kind = getattr(config, "model_type", None)
    if kind not in HF_CP_TYPES:
        raise WorkerError(
            f"jd.wrap: context parallelism (cp{env.cp}) runs Hugging Face decoders of type {', '.join(HF_CP_TYPES)} "
            f"(their attention through transformers' AttentionInterface); {type(model).__name__} is {kind!r}: run a "
            "candidate without cp, or jupyter_dist.models.Transformer"
        )
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise WorkerError(
            f"jd.wrap: context parallelism (cp{env.cp}) runs causal attention over the whole sequence; "
            f"{type(model).__name__} has sliding-window layers (layer_types), which the ring attention does not "
            "mask; build it without a sliding window or run a candidate without cp"
        )


def _hf_attention(cp_mesh: DeviceMesh) -> Any:
    """A ``transformers`` attention function that runs PyTorch's ring attention on the cp mesh.

    It receives the model's q, k, v (after the rotary angles, this rank's chunks of the sequence) and does what
    ``_ContextParallel`` does for the reference model's cores: sequence-sharded DTensors into
    ``F.scaled_dot_product_attention(is_causal=True)``, the local part of the output back. No attention mask is
    built for it (transformers builds none for an implementation without a mask function): the causal mask of the
    whole sequence is the ring's, with head-tail load balancing.
    """
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Shard

    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                  dropout: float = 0.0, scaling: float | None = None, sliding_window: int | None = None,
                  **_: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
        if attention_mask is not None:
            raise WorkerError("context parallelism: attention with an attention mask (padding) is not supported; "
                              "train on whole sequences (causal only)")  # fmt: skip
        if sliding_window is not None and query.shape[2] * cp_mesh.size() > sliding_window:
            raise WorkerError(
                f"context parallelism: a sliding window of {sliding_window} is shorter than the sequence "
                f"({query.shape[2] * cp_mesh.size()}); the ring attention masks causally only"
            )
        groups = query.shape[1] // key.shape[1]
        if groups > 1:  # grouped-query attention: each kv head serves a group of query heads
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        q, k, v = (DTensor.from_local(t.contiguous(), cp_mesh, (Shard(SEQ_DIM),), run_check=False)
                   for t in (query, key, value))  # fmt: skip
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, is_causal=True)
        return out.to_local().transpose(1, 2).contiguous(), None

    return attention


def _apply_hf(model: torch.nn.Module, cp_mesh: DeviceMesh) -> int:
    """Route a Hugging Face model's attention through the ring; returns the number of attention layers."""
    from transformers import AttentionInterface

    AttentionInterface.register(HF_ATTENTION, _hf_attention(cp_mesh))
    config = model.config  # type: ignore[attr-defined]
    seen = set()
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and id(c) not in seen:
            seen.add(id(c))
            c._attn_implementation = HF_ATTENTION
    config._attn_implementation = HF_ATTENTION
    return sum(1 for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "o_proj"))


def _cp_handlers() -> dict[Any, Any]:
    """DTensor custom-op handlers that route the CPU flash kernel pair through PyTorch's ring attention."""
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention,
        _templated_ring_attention_backward,
    )

    aten = torch.ops.aten

    def mesh_of(*tensors: Any) -> Any:
        mesh = None
        for t in tensors:
            if not isinstance(t, DTensor) or t.placements != (Shard(SEQ_DIM),) or t.device_mesh.ndim != 1:
                raise WorkerError(
                    "context parallelism: the attention core got tensors that are not sequence-sharded on the cp mesh "
                    f"({type(t).__name__}); call F.scaled_dot_product_attention only inside a cp_cores() module"
                )
            mesh = t.device_mesh
        return mesh

    def wrap(mesh: Any, *local: torch.Tensor) -> tuple[Any, ...]:
        return tuple(DTensor.from_local(t, mesh, (Shard(SEQ_DIM),), run_check=False) for t in local)

    def forward(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        q, k, v = args[:3]
        dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
        is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
        if kwargs.get("attn_mask") is not None:
            raise WorkerError("context parallelism: attention with an attn_mask is not supported; use is_causal=True")
        mesh = mesh_of(q, k, v)
        with _blocking_ring(cp_attention):
            out, lse = _templated_ring_attention(
                mesh.get_group(), SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu, q.to_local(),
                k.to_local(), v.to_local(), is_causal=is_causal, dropout_p=dropout_p, scale=kwargs.get("scale"),
            )  # fmt: skip
        return wrap(mesh, out, lse)

    def backward(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        grad_out, q, k, v, out, lse, dropout_p, is_causal = args[:8]
        mesh = mesh_of(grad_out, q, k, v, out, lse)
        with _blocking_ring(cp_attention):
            grads = _templated_ring_attention_backward(
                mesh.get_group(), SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                grad_out=grad_out.to_local(), grad_out_name="grad_out", query=q.to_local(), key=k.to_local(),
                value=v.to_local(), out=out.to_local(), logsumexp=lse.to_local(), is_causal=is_causal,
                dropout_p=dropout_p, scale=kwargs.get("scale"),
            )  # fmt: skip
        return wrap(mesh, *grads[:3])

    return {
        aten._scaled_dot_product_flash_attention_for_cpu.default: forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: backward,
    }


class BlockingRotater:
    """The ring's exchange on CPU: one blocking ``dist.all_to_all_single`` per step of the ring.

    Each call sends this rank's buffer to the next cp rank and receives the previous rank's, on the gloo group.

    PyTorch's rotaters exchange through the functional collectives (``permute_tensor``, ``all_gather_single``): async
    work finished on gloo's threads and waited later. On gloo that corrupted the heap: about one launch in 30-50 of
    30 context-parallel configurations aborted (``malloc(): unaligned tcache chunk detected``, on the main thread or
    a gloo worker; the corrupted free chunk held the bytes ``ALLTOALL``); with this blocking exchange 0 of 120 such
    launches did (docs/development.md, session 22). The math is the same exchange; on CPU there is no stream to
    overlap with anyway. Built as PyTorch's ``_create_rotater(pg, seq_dim, method)`` is called; every rotation method
    (all-gather or all-to-all) becomes this ring step, which the ring functions accept for either.
    """

    def __init__(self, pg: Any, seq_dim: int, method: Any = None) -> None:
        self._pg = pg
        self._buffer: Any = None

    def exchange_buffers(self, buffer: torch.Tensor) -> None:
        import torch
        import torch.distributed as dist

        buffer = buffer.contiguous()
        size, rank = dist.get_world_size(self._pg), dist.get_rank(self._pg)
        sends, receives = [0] * size, [0] * size
        sends[(rank + 1) % size] = buffer.numel()
        receives[(rank - 1) % size] = buffer.numel()
        out = torch.empty_like(buffer)
        dist.all_to_all_single(out, buffer, receives, sends, group=self._pg)
        self._buffer = out

    def next_buffer(self) -> torch.Tensor:
        if self._buffer is None:
            raise RuntimeError("BlockingRotater.next_buffer before exchange_buffers")
        return self._buffer


@contextlib.contextmanager
def _blocking_ring(cp_attention: Any) -> Iterator[None]:
    """PyTorch's ring functions, with :class:`BlockingRotater` for every exchange they make inside the block."""
    saved = cp_attention._create_rotater
    cp_attention._create_rotater = BlockingRotater
    try:
        yield
    finally:
        cp_attention._create_rotater = saved


def enable_dispatcher(device_type: str) -> None:
    """Turn on PyTorch's context-parallel SDPA dispatch (process-wide), plus the CPU kernels on CPU."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention

    cp_attention._enable_context_parallel_dispatcher()
    cp_attention._cp_options.enable_load_balance = True  # head-tail order: what shard() lays out
    if device_type == "cpu":
        handlers = DTensor._op_dispatcher._custom_op_handlers
        DTensor._op_dispatcher._custom_op_handlers = {**handlers, **_cp_handlers()}


def apply_context_parallel(model: torch.nn.Module, mesh: Any, device_type: str) -> int:
    """Hook every attention core with ``_ContextParallel`` on the cp mesh; the model's forward gets positions.

    Returns the number of cores hooked.
    """
    from torch.distributed.tensor.experimental._context_parallel._attention import _ContextParallel

    cp_mesh = mesh["cp"]
    if _is_hf(model):
        n = _apply_hf(model, cp_mesh)
        enable_dispatcher(device_type)
        model.register_forward_pre_hook(positions_hook(cp_mesh, hf=True), with_kwargs=True)
        return n
    cores = list(model.cp_cores())  # type: ignore[operator]
    if not cores:
        raise WorkerError(f"jd.wrap: {type(model).__name__}.cp_cores() returned no module; context parallelism has "
                          "nothing to shard")  # fmt: skip
    style = _ContextParallel(seq_dim=SEQ_DIM, attention_type=_ContextParallel.AttentionType.SDPA)
    for core in cores:
        style._apply(core, cp_mesh)
    enable_dispatcher(device_type)
    model.register_forward_pre_hook(positions_hook(cp_mesh), with_kwargs=True)
    return len(cores)


def positions_hook(cp_mesh: DeviceMesh, *, hf: bool = False) -> Any:
    """A forward pre-hook passing ``positions=`` (this rank's places in the whole sequence) to a model or stage.

    Registered on the model, and under pipeline parallelism on each stage (a stage's input is its hidden states,
    whose dim 1 is this rank's part of the sequence as the tokens' is). A Hugging Face model (``hf``) gets them as
    ``position_ids`` (``(1, local length)``), from its token ids or its ``inputs_embeds``.
    """
    cache: dict[tuple[int, str], torch.Tensor] = {}
    name = "position_ids" if hf else "positions"

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if name in kwargs:
            return None
        x = args[0] if len(args) == 1 else None
        if hf and not args:  # a later pipeline stage's hidden states come as inputs_embeds
            x = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        if x is None or x.dim() < 2:
            return None
        local = int(x.shape[1])
        key = (local, str(x.device))
        if key not in cache:
            cache[key] = local_positions(cp_mesh, local * cp_mesh.size(), x.device)
        positions = cache[key].unsqueeze(0) if hf else cache[key]
        return args, {**kwargs, name: positions}

    return hook


def fsdp_mesh(mesh: Any) -> DeviceMesh:
    """The mesh FSDP2 shards over under context parallelism.

    ``dp_shard x cp`` flattened (``dp_shard_cp``), with ``dp_replicate`` in front for HSDP.
    """
    names = mesh.mesh.mesh_dim_names or ()
    flat = mesh.mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    if "dp_replicate" in names:
        return mesh.mesh[("dp_replicate", "dp_shard_cp")]
    return flat


def _balancer(seq_len: int, cp: int, device: Any) -> Any:
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    head_tail_order(seq_len, cp)  # the one-line error for a length that does not split
    return _HeadTailLoadBalancer(seq_len, cp, device)


def shard(cp_mesh: DeviceMesh, tensors: tuple[torch.Tensor, ...], seq_dim: int) -> tuple[torch.Tensor, ...]:
    """Keep this rank's load-balanced chunks of each tensor along ``seq_dim`` (whole sequences in)."""
    from torch.distributed.tensor.experimental._context_parallel._attention import _context_parallel_shard

    seq_len = int(tensors[0].shape[seq_dim])
    for t in tensors:
        if t.dim() <= seq_dim or int(t.shape[seq_dim]) != seq_len:
            raise WorkerError(
                f"jd.cp_shard: every tensor needs the same sequence length on dim {seq_dim} ({seq_len}); got shape "
                f"{tuple(t.shape)}"
            )
    balancer = _balancer(seq_len, cp_mesh.size(), tensors[0].device)
    out = _context_parallel_shard(cp_mesh, list(tensors), [seq_dim] * len(tensors), load_balancer=balancer)
    return tuple(out)  # type: ignore[arg-type]


def unshard(cp_mesh: DeviceMesh, tensors: tuple[torch.Tensor, ...], seq_dim: int) -> tuple[torch.Tensor, ...]:
    """The inverse of :func:`shard`: every rank gets the whole sequences back, in order."""
    from torch.distributed.tensor.experimental._context_parallel._attention import context_parallel_unshard

    cp = cp_mesh.size()
    seq_len = int(tensors[0].shape[seq_dim]) * cp
    balancer = _balancer(seq_len, cp, tensors[0].device)
    if seq_dim < 1:
        raise WorkerError("jd.cp_unshard: the sequence dimension must follow a batch dimension (seq_dim >= 1)")
    return tuple(context_parallel_unshard(cp_mesh, list(tensors), [seq_dim] * len(tensors), load_balancer=balancer))


def local_positions(cp_mesh: DeviceMesh, seq_len: int, device: Any) -> torch.Tensor:
    """The positions (1-D, in the whole sequence of ``seq_len``) of the tokens this cp rank holds."""
    import torch

    whole = torch.arange(seq_len, device=device).unsqueeze(0)
    return shard(cp_mesh, (whole,), 1)[0].reshape(-1)
