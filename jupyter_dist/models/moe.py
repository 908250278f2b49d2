"""A mixture-of-experts variant of the reference transformer: the project's reference model for expert parallelism.

Each block's MLP is replaced by a top-k mixture of SwiGLU experts (Shazeer et al. 2017; Fedus et al. 2021's Switch
Transformer for k = 1; Jiang et al. 2024's Mixtral for k = 2): a bias-free router maps each token to ``n_experts``
logits, a softmax turns them into probabilities, the token goes to its ``top_k`` most probable experts and their
outputs are summed with the chosen probabilities renormalised to 1 (Mixtral). Routing is a deterministic function of
the token's hidden state (no noise, no capacity limit, no dropped tokens), so a token is routed the same way whole or
under any parallel layout.

The experts' weights are grouped 3-D parameters ``(n_experts, ...)``, as in torchtitan and transformers 5: expert
parallelism splits them along dim 0 (``jupyter_dist.worker`` does it with ``JD_EP``), and the computation takes the
tokens sorted by expert with a count per expert, which is exactly what an all-to-all dispatch delivers.

The load-balancing loss is the Switch/Mixtral auxiliary loss ``E * sum_e f_e * P_e`` (``f_e`` the fraction of the
routing slots that chose expert ``e``, ``P_e`` its mean router probability), computed over each sequence and
averaged over the sequences and the layers (``balance="sequence"``, DeepSeek-V3's sequence-wise variant): its value
and gradient do not depend on how the batch is split across data-parallel ranks. ``balance="batch"`` computes it over
all the tokens of the forward (Switch/Mixtral's micro-batch loss), which changes with the split. Add
``coef * model.aux_loss()`` to the training loss after each forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .transformer import Attention, RMSNorm, Transformer, TransformerConfig

__all__ = ["GroupedExperts", "MoE", "MoETransformer", "MoETransformerConfig"]

BALANCE = ("sequence", "batch")
"""Where the load-balancing loss takes its statistics: over each sequence, or over the whole forward batch."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MoETransformerConfig(TransformerConfig):
    """Dimensions of a :class:`MoETransformer` (``ffn_dim`` is one expert's width)."""

    n_experts: int = 8
    """Routed experts per block."""
    top_k: int = 2
    """Experts each token goes to."""
    balance: str = "sequence"
    """Statistics of the load-balancing loss: ``"sequence"`` (per sequence, averaged) or ``"batch"``."""

    def __post_init__(self) -> None:
        TransformerConfig.__post_init__(self)
        if not isinstance(self.n_experts, int) or self.n_experts < 1:
            raise ValueError(f"MoETransformerConfig.n_experts must be a positive integer, got {self.n_experts!r}")
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.n_experts:
            raise ValueError(
                f"MoETransformerConfig.top_k must be an integer in 1..n_experts ({self.n_experts}), got {self.top_k!r}"
            )
        if self.balance not in BALANCE:
            raise ValueError(f"MoETransformerConfig.balance must be one of {', '.join(BALANCE)}, got {self.balance!r}")


def _local(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (a DTensor's local shard: the experts it owns under expert parallelism)."""
    to_local = getattr(p, "to_local", None)
    return to_local() if callable(to_local) else p


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU MLPs as three 3-D parameters, expert index first.

    ``forward(x, counts)`` takes tokens sorted by expert (``x``: ``(tokens, dim)``) and how many go to each expert
    this module holds, and returns each token's output in the same order. Under expert parallelism the parameters
    are DTensors split along dim 0 and this module sees only its local experts and the tokens sent to them.
    """

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = n_experts  # whole-model count (read by the planner and by expert parallelism)
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each expert's MLP on its contiguous run of tokens."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        if counts.numel() != w1.shape[0]:
            raise ValueError(f"GroupedExperts: {counts.numel()} token counts for {w1.shape[0]} experts")
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            xe = x[start : start + n]
            outs.append((F.silu(xe @ w1[e]) * (xe @ w3[e])) @ w2[e])
            start += n
        return torch.cat(outs) if outs else x[:0]

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        """N(0, std) input projections, N(0, out_std) output projection."""
        nn.init.normal_(self.w1, std=std)
        nn.init.normal_(self.w3, std=std)
        nn.init.normal_(self.w2, std=out_std)


class MoE(nn.Module):
    """Top-k router and grouped experts; keeps the last forward's load-balancing loss in :attr:`aux`."""

    def __init__(self, cfg: MoETransformerConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.balance = cfg.n_experts, cfg.top_k, cfg.balance
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.hidden_dim)
        self.aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route each token to its top-k experts and sum their outputs with the renormalised router weights."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)  # routing slots sorted by expert, in token order within one
        counts = torch.bincount(flat, minlength=self.num_experts)
        out_sorted = self.experts(tokens[order // self.top_k], counts)
        out = out_sorted[torch.argsort(order)].view(-1, self.top_k, shape[-1])  # back to (token, slot) order
        y = (out * weights.unsqueeze(-1).to(out.dtype)).sum(1)
        self.aux = self._balance_loss(probs, chosen, shape[:-1])
        return y.view(shape)

    def _balance_loss(self, probs: torch.Tensor, chosen: torch.Tensor, lead: torch.Size) -> torch.Tensor:
        """Switch/Mixtral's ``E * sum_e f_e P_e`` per sequence (or over the batch), averaged."""
        groups = lead[0] if self.balance == "sequence" and len(lead) > 1 else 1
        probs = probs.view(groups, -1, self.num_experts)
        slots = F.one_hot(chosen, self.num_experts).float().view(groups, -1, self.top_k, self.num_experts)
        f = slots.sum(2).mean(1)  # routing slots per token that chose each expert (sums to top_k)
        return (self.num_experts * (f * probs.mean(1)).sum(-1)).mean()


class MoEBlock(nn.Module):
    """Pre-norm block: attention then the mixture of experts, each with a residual connection."""

    def __init__(self, cfg: MoETransformerConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the block (``positions``: see :meth:`Attention.forward`)."""
        x = x + self.attention(self.attention_norm(x), positions)
        return x + self.moe(self.ffn_norm(x))


class MoETransformer(Transformer):
    """The reference :class:`~jupyter_dist.models.Transformer` with a top-k mixture of experts in every block.

    ``MoETransformer(MoETransformerConfig(...))`` or ``MoETransformer(n_experts=8, top_k=2, dim=..., ...)``;
    ``forward(tokens)`` returns logits, :meth:`aux_loss` the load-balancing loss of that forward.
    """

    def __init__(self, cfg: MoETransformerConfig | None = None, **kwargs: Any) -> None:
        if cfg is not None and kwargs:
            raise TypeError("MoETransformer takes a MoETransformerConfig or keyword dimensions, not both")
        cfg = cfg if cfg is not None else MoETransformerConfig(**kwargs)
        nn.Module.__init__(self)
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): MoEBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    def aux_loss(self) -> torch.Tensor:
        """The load-balancing loss of the last forward, averaged over the blocks (add ``coef *`` it to the loss)."""
        losses = [m.aux for m in self.modules() if isinstance(m, MoE) and m.aux is not None]
        if not losses:
            raise RuntimeError("MoETransformer.aux_loss(): run a forward first")
        return torch.stack(losses).mean()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """As :meth:`Transformer.init_weights`, with N(0, 0.02) routers and experts (their output depth-scaled)."""
        if seed is not None:
            torch.manual_seed(seed)
        depth_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            for lin in (layer.attention.wq, layer.attention.wk, layer.attention.wv, layer.moe.router):
                nn.init.normal_(lin.weight, std=0.02)
            nn.init.normal_(layer.attention.wo.weight, std=depth_std)
            layer.moe.experts.init_weights(0.02, depth_std)
            layer.attention_norm.reset_parameters()
            layer.ffn_norm.reset_parameters()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            nn.init.normal_(self.output.weight, std=self.config.dim**-0.5)

    def tp_dims(self) -> dict[str, int]:
        """The sizes a tensor-parallel degree must divide: heads, kv heads, vocabulary (experts stay whole)."""
        c = self.config
        return {"attention heads": c.n_heads, "kv heads": c.kv_heads, "vocabulary": c.vocab_size}

    def ep_dims(self) -> dict[str, int]:
        """The sizes an expert-parallel degree must divide."""
        return {"experts": self.config.n_experts}

    def tp_plan(self, *, sequence_parallel: bool = False) -> dict[str, Any]:
        """The reference transformer's layout for attention, embedding and head; routers and experts replicated.

        Experts are split by expert parallelism, not tensor parallelism; with sequence parallelism the mixture
        gathers the sequence before routing and keeps its own part of the sequence after.
        """
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import PrepareModuleInputOutput

        dense = super().tp_plan(sequence_parallel=sequence_parallel)
        plan = {k: v for k, v in dense.items() if "feed_forward" not in k}
        if sequence_parallel:
            plan["layers.*.moe"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True,
            )  # fmt: skip
        return plan
