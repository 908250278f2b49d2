"""Example training cells: the demo job's small transformer LM, also the strategy wizard's default Launch cell.

``DEMO_CELL.format(steps=N)`` is a complete ``%%dist_train`` cell (it uses ``jd`` from the worker API), so it runs
under any strategy ``jd.wrap`` applies (DDP, FSDP/FSDP2, DeepSpeed ZeRO) on CPU/gloo or GPUs.
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

DEMO_CELL = (
    "\nimport math\n"
    + MODEL_SOURCE
    + '''


STEPS, VOCAB, DIM, SEQ, BATCH = {steps}, 64, 64, 32, 16
torch.manual_seed(0)


def batch(step: int) -> torch.Tensor:
    """Synthetic data with structure to learn: each sequence counts up from a random start (mod VOCAB)."""
    g = torch.Generator().manual_seed(step * jd.world_size + jd.rank)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    return (start + torch.arange(SEQ + 1)) % VOCAB


model = TinyLM(vocab=VOCAB, dim=DIM)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = jd.wrap(model, opt)
for step in range(STEPS):
    tokens = batch(step)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    jd.backward(loss)
    jd.step(opt)
    jd.log(step, loss=loss, tokens=BATCH * SEQ)
if jd.is_main:
    print(f"final loss {{loss.item():.3f}} (random guessing: {{math.log(VOCAB):.3f}})")
'''
)
