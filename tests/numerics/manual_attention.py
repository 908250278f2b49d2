"""Hand-written attention as researchers write it without ``scaled_dot_product_attention``'s causal flag (no
jupyter_dist in it), for the derived tensor-parallel layout's DTensor path: whole-width code (``split(n_embd)``,
``view(B, T, n_head, ...)``) meeting plain tensors -- karpathy/nanoGPT's causal-mask buffer, a mask built in the
forward without a device, rotary tables -- and one operation DTensor has no sharding rule for (a sliding window
through ``F.unfold``). Imported by ``tests/test_tp_layout.py`` and its notebook cell."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

ATTENTIONS = ("mask", "inline", "rope")
"""The forms that run under tensor parallelism; ``"unfold"`` is refused in one line at its first forward."""


class Attention(nn.Module):
    def __init__(self, kind: str, dim: int = 32, n_head: int = 4, block_size: int = 16) -> None:
        super().__init__()
        self.kind, self.n_head, self.n_embd = kind, n_head, dim
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))
        hd = dim // n_head
        freqs = torch.outer(torch.arange(block_size).float(), 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)))
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(2)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        c, s = self.cos[:t], self.sin[:t]
        return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # noqa: N806 - nanoGPT's names
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for z in (q, k, v))
        scale = 1.0 / math.sqrt(k.size(-1))
        if self.kind == "mask":  # karpathy/nanoGPT's path without flash attention
            att = (q @ k.transpose(-2, -1)) * scale
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        elif self.kind == "inline":  # the mask made in the forward, with no device given
            att = (q @ k.transpose(-2, -1)) * scale + torch.full((T, T), float("-inf")).triu(1)
            y = att.softmax(-1) @ v
        elif self.kind == "rope":
            q, k = self.rotate(q), self.rotate(k)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.kind == "unfold":  # keys of a 2-token window gathered by unfold (im2col: no DTensor rule)
            win = F.unfold(k.reshape(B * self.n_head, 1, T, -1), (2, 1), padding=(1, 0))
            y = v + win.mean() * scale
        else:
            raise ValueError(f"attention {self.kind!r} is not one of {ATTENTIONS + ('unfold',)}")
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, kind: str, dim: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(dim), Attention(kind, dim)
        self.ln_2, self.mlp = nn.LayerNorm(dim), MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, attention: str = "mask", vocab: int = 64, dim: int = 32, n_layer: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.h = nn.ModuleList(Block(attention, dim) for _ in range(n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))
