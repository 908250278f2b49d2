"""A Llama-style decoder-only transformer with its tensor-parallel layout: the project's reference model.

RMSNorm, rotary position embeddings, grouped-query attention through ``scaled_dot_product_attention``, a SwiGLU
MLP and an untied output head -- the architecture of Llama 2/3, Mistral and Qwen2 (Touvron et al. 2023), small
enough to train on CPU processes in tests and notebooks, and shaped like the models the planner plans for, so its
per-rank memory can be checked against the plan.

:meth:`Transformer.tp_plan` gives the Megatron-LM layout (Shoeybi et al. 2019) as PyTorch ``ParallelStyle`` objects
for ``torch.distributed.tensor.parallel.parallelize_module``: q/k/v and the MLP's gate and up projections split by
output features (column-wise), the attention output and the MLP's down projection by input features (row-wise), the
embedding by vocabulary rows and the head by vocabulary columns; with sequence parallelism (Korthikanti et al. 2022)
the norms and the residual stream between blocks are split along the sequence, gathered before attention and the
MLP and reduce-scattered after them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Transformer", "TransformerConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TransformerConfig:
    """Dimensions of a :class:`Transformer`."""

    vocab_size: int = 256
    """Tokens in the vocabulary (the embedding's rows and the head's outputs)."""
    dim: int = 64
    """Hidden size."""
    n_layers: int = 2
    """Transformer blocks."""
    n_heads: int = 4
    """Attention (query) heads."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); ``None``: as many as query heads."""
    ffn_dim: int | None = None
    """MLP width; ``None``: Llama's rule, 2/3 of 4 x dim rounded up to a multiple of 16."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding's frequencies."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TransformerConfig.{name} must be a positive integer, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"TransformerConfig: dim ({self.dim}) must be a multiple of n_heads ({self.n_heads})")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"TransformerConfig: the head size dim / n_heads ({self.dim // self.n_heads}) is odd")
        if self.kv_heads < 1 or self.n_heads % self.kv_heads:
            raise ValueError(f"TransformerConfig: n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")

    @property
    def kv_heads(self) -> int:
        """Key/value heads."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        """Size of one head."""
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """The MLP width used."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        return 16 * math.ceil(int(2 * 4 * self.dim / 3) / 16)


def rope(positions: int | torch.Tensor, head_dim: int, theta: float,
         device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Cosines and sines of the rotary angles, ``(seq, head_dim / 2)`` each, in fp32.

    ``positions`` is the sequence length (positions ``0 .. n-1``) or the 1-D tensor of the positions this rank holds
    (under context parallelism a rank holds non-contiguous chunks of the sequence).
    """
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if isinstance(positions, int):
        positions = torch.arange(positions, device=device)
    angles = torch.outer(positions.to(device=device, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of ``x`` (``batch, heads, seq, head_dim``) by the angles; computed in fp32."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        """Scale of ones."""
        nn.init.ones_(self.weight)


class CausalCore(nn.Module):
    """The attention core, ``softmax(q k^T / sqrt(d) + causal) v`` through ``scaled_dot_product_attention``.

    A module of its own (no parameters) so that context parallelism can hook exactly the call that needs the whole
    sequence: PyTorch's ``_ContextParallel`` style turns its q, k, v into sequence-sharded DTensors and the SDPA
    call into ring attention.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of ``(batch, heads, seq, head_dim)`` queries, keys and values."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings.

    Head counts are read from the projections' local widths (``-1`` in the views), so the same code runs whole or
    with the heads split across tensor-parallel ranks.
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.kv_heads  # whole-model counts (read by the planner)
        self.rope_theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.core = CausalCore()

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Attend to the current and earlier positions.

        Rotary angles come from ``positions`` (the positions of ``x``'s tokens in the whole sequence, 1-D) when
        given, else from ``0 .. seq-1``: under context parallelism a rank's tokens are not the sequence's first ones.
        """
        b, s, _ = x.shape
        cos, sin = rope(s if positions is None else positions, self.head_dim, self.rope_theta, x.device)
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves a group of query heads
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        y = self.core(q, k, v)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual connection."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the block (``positions``: see :meth:`Attention.forward`)."""
        x = x + self.attention(self.attention_norm(x), positions)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Token embedding, a stack of :class:`Block` in ``layers``, a final norm and the output head.

    ``Transformer(TransformerConfig(...))`` or ``Transformer(vocab_size=..., dim=..., ...)``. ``forward(tokens)``
    takes ``(batch, seq)`` token ids and returns ``(batch, seq, vocab)`` logits.
    """

    def __init__(self, cfg: TransformerConfig | None = None, **kwargs: Any) -> None:
        super().__init__()
        if cfg is not None and kwargs:
            raise TypeError("Transformer takes a TransformerConfig or keyword dimensions, not both")
        self.config = cfg = cfg if cfg is not None else TransformerConfig(**kwargs)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # a dict keyed by the layer's global index: a pipeline stage that keeps layers 2-3 still names them
        # "layers.2", so checkpoints and state dicts mean the same thing under any pipeline split
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the next token at every position.

        ``positions`` (1-D, one per token of ``tokens``' sequence) are the tokens' places in the whole sequence;
        ``None`` means ``0 .. seq-1``. Under context parallelism ``jd.wrap`` passes the positions of this rank's
        chunks (see :func:`jupyter_dist.worker.cp_shard`).

        A pipeline stage holds some of the parts (the first the embedding, the last the norm and head, the
        others only blocks): missing parts are ``None`` and the stage maps hidden states to hidden states.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h) if positions is None else layer(h, positions)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialise every parameter.

        N(0, 1) embeddings, N(0, 0.02) linears (GPT-2 / Llama practice), output projections of each residual branch
        scaled by ``1/sqrt(2 * n_layers)``, norms to ones.

        Works on sharded (DTensor) parameters too, e.g. after ``to_empty`` of a model built on the meta device.
        """
        if seed is not None:
            torch.manual_seed(seed)
        depth_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            for lin in (layer.attention.wq, layer.attention.wk, layer.attention.wv, layer.feed_forward.w1,
                        layer.feed_forward.w3):  # fmt: skip
                nn.init.normal_(lin.weight, std=0.02)
            for lin in (layer.attention.wo, layer.feed_forward.w2):
                nn.init.normal_(lin.weight, std=depth_std)
            layer.attention_norm.reset_parameters()
            layer.ffn_norm.reset_parameters()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            nn.init.normal_(self.output.weight, std=self.config.dim**-0.5)

    def cp_cores(self) -> list[nn.Module]:
        """The modules context parallelism hooks: each block's attention core (inputs q, k, v, sequence on dim 2)."""
        return [layer.attention.core for layer in self.layers.values()]

    def tp_dims(self) -> dict[str, int]:
        """The sizes a tensor-parallel degree must divide: heads, kv heads, MLP width, vocabulary."""
        c = self.config
        return {"attention heads": c.n_heads, "kv heads": c.kv_heads, "MLP width": c.hidden_dim,
                "vocabulary": c.vocab_size}  # fmt: skip

    def tp_plan(self, *, sequence_parallel: bool = False) -> dict[str, Any]:
        """The Megatron-LM layout as ``parallelize_module`` styles (module name pattern -> ``ParallelStyle``).

        Without sequence parallelism the residual stream is replicated on every tensor-parallel rank; with it, the
        stream between blocks and the norms are split along the sequence (dim 1), which is what saves activation
        memory (Korthikanti et al. 2022, section 4.2.2).
        """
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
        )

        seq = Shard(1) if sequence_parallel else Replicate()
        plan: dict[str, Any] = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "output": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
            "layers.*.attention.wq": ColwiseParallel(),
            "layers.*.attention.wk": ColwiseParallel(),
            "layers.*.attention.wv": ColwiseParallel(),
            "layers.*.attention.wo": RowwiseParallel(output_layouts=seq),
            "layers.*.feed_forward.w1": ColwiseParallel(),
            "layers.*.feed_forward.w3": ColwiseParallel(),
            "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:
            plan.update({
                "norm": SequenceParallel(use_local_output=True),
                "layers.*.attention_norm": SequenceParallel(use_local_output=True),
                "layers.*.ffn_norm": SequenceParallel(use_local_output=True),
                "layers.*.attention": PrepareModuleInput(  # (hidden states, positions): positions pass as they are
                    input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                ),
                "layers.*.feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
            })  # fmt: skip
        return plan
