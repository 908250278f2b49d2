"""A nanoGPT-style model as a researcher writes it (no jupyter_dist in it): blocks in an ``nn.ModuleList``, a fused
``qkv`` projection, a GELU MLP ``fc``/``proj``, learned positions, untied head. Its forward is the plain loop the
pipeline cuts. Also two other shapes for the pipeline and planner tests: an MLP stack in an ``nn.Sequential`` and a
model with no block list. Imported by ``parallel_train.py`` (model ``gpt``) and the tests."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, n_head)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 128, block_size: int = 64, dim: int = 64, n_layer: int = 4,
                 n_head: int = 4) -> None:  # fmt: skip
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block_size, dim)
        self.blocks = nn.ModuleList([Block(dim, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.shape
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return self.lm_head(x)


class NestedGPT(GPT):
    """karpathy/nanoGPT's layout: ``transformer.{wte, wpe, drop, h, ln_f}`` and ``lm_head``."""

    def __init__(self, vocab: int = 128, block_size: int = 64, dim: int = 64, n_layer: int = 4,
                 n_head: int = 4) -> None:  # fmt: skip
        nn.Module.__init__(self)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, dim), wpe=nn.Embedding(block_size, dim), drop=nn.Dropout(0.0),
            h=nn.ModuleList([Block(dim, n_head) for _ in range(n_layer)]), ln_f=nn.LayerNorm(dim),
        ))  # fmt: skip
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)


def mlp_stack(width: int = 32, depth: int = 4) -> nn.Sequential:
    """An MLP stack: ``Linear, GELU`` pairs in one ``nn.Sequential`` (every child a place to cut)."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


class NoBlocks(nn.Module):
    """A model with no block list: two projections around an activation."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(128, dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, 128)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.emb(idx))))
