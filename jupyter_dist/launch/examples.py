"""Example training cells: the quickstart's small transformer LM, and the demo job's cell (the wizard's default).

``DEMO_CELL.format(steps=N)`` is a complete ``%%dist_train`` cell (it uses ``jd`` from the worker API and the
reference :class:`jupyter_dist.models.Transformer`), so it runs under any strategy ``jd.wrap`` applies (DDP,
FSDP/FSDP2, DeepSpeed ZeRO, FSDP2 + tensor/sequence parallelism) on CPU/gloo or GPUs.
"""

from __future__ import annotations

__all__ = ["DEMO_CELL", "MODEL_SOURCE"]

MODEL_SOURCE = '''import torch
import torch.nn as nn


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """A small causal language model: embedding, transformer blocks, output head."""

    def __init__(self, vocab: int = 64, dim: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)'''
"""A small causal transformer LM (``Block``, ``TinyLM(vocab, dim, layers)``): the demo's model and the quickstart's."""

DEMO_CELL = '''
import math

import torch
import torch.nn as nn

from jupyter_dist.models import Transformer  # a Llama-style LM that knows its tensor-parallel layout

STEPS, VOCAB, DIM, SEQ, BATCH = {steps}, 64, 64, 32, 16
torch.manual_seed(0)


def batch(step: int) -> torch.Tensor:
    """Synthetic data with structure to learn: each sequence counts up from a random start (mod VOCAB).

    One batch per data-parallel rank (jd.dp_rank of jd.dp_size): the ranks of a tensor-parallel group share it.
    """
    g = torch.Generator().manual_seed(step * jd.dp_size + jd.dp_rank)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    return (start + torch.arange(SEQ + 1)) % VOCAB


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a micro-batch."""
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


model = Transformer(vocab_size=VOCAB, dim=DIM, n_layers=4, n_heads=4)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = jd.wrap(model, opt)  # the plan's strategy: DDP, FSDP2, ZeRO, or FSDP2 + tensor/pipeline parallelism
for step in range(STEPS):
    tokens = batch(step).to(jd.device)
    # forward, backward and the optimizer step, whatever the plan: a pipeline schedule over micro-batches under
    # pipeline parallelism, gradient accumulation over the plan's micro-batches otherwise
    loss = jd.train_step(tokens[:, :-1], tokens[:, 1:], loss_fn)
    jd.log(step, loss=loss, tokens=BATCH * SEQ)
if jd.is_main:
    print(f"final loss {{loss.item():.3f}} (random guessing: {{math.log(VOCAB):.3f}})")
'''
"""The wizard's default Launch cell and the terminal demo: a complete ``%%dist_train`` cell
(``DEMO_CELL.format(steps=N)``) that runs under every strategy ``jd.wrap`` applies, tensor parallelism included."""
