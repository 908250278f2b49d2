"""Templates: the demo model and data, the flags, the process-group set-up, activation checkpointing.

The demo model and data are the parts a user replaces.

A line that holds only ``<<name>>`` is replaced by a block (indented like the marker, dropped when empty);
``<<name>>`` inside a line by a value (:func:`.text.fill`). Generated lines are at most 120 characters.
"""

from __future__ import annotations

__all__ = [
    "MODEL", "MODEL_REST", "ARGS", "ARGS_TORCH", "ARGS_DEEPSPEED", "SETUP", "CHECKPOINT_ACTIVATIONS", "OP_SAC",
]  # fmt: skip

MODEL = '''
# ==============================================================================================================
# REPLACE: the model. A small decoder-only transformer for the demo. Put your model in build_model(), point
# BLOCK_CLASS at its repeated layer (the unit that is sharded and recomputed) and ATTENTION_CLASS at its attention.
# ==============================================================================================================
class Attention(nn.Module):
    """Causal multi-head self-attention (PyTorch's fused scaled_dot_product_attention).

    The head count is read from the projections' width (``-1`` below), so the same code runs whole or with the
    heads split across tensor-parallel ranks.
    """

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"--model-dim {dim} must be a multiple of --heads {heads}")
        self.head_dim = dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.out_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend to the current and the earlier positions."""
        batch, seq = x.shape[0], x.shape[1]
        q, k, v = (
            proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).flatten(2))


class Block(nn.Module):
    """One pre-norm transformer layer: attention, then an MLP, each with a residual connection."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = <<mlp>>

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer."""
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class DemoTransformer(nn.Module):
    """Token and position embeddings, a stack of blocks, a final norm and the output head.

    The blocks sit in a dict keyed by their index and ``forward`` skips parts that are ``None``: a pipeline stage
    keeps only some parts under their whole-model names (``blocks.5`` stays ``blocks.5``), so checkpoints mean the
    same under any pipeline split, or none.
    """

    def __init__(self, *, vocab_size: int, dim: int, layers: int, heads: int, max_seq_len: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.pos_emb = nn.Embedding(max_seq_len, dim)
        self.blocks = nn.ModuleDict({str(i): Block(dim, heads) for i in range(layers)})
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, x: torch.Tensor<<forward_params>>) -> torch.Tensor:
        """Logits of the next token at every position (a pipeline stage without some parts: hidden states)."""
        if self.tok_emb is not None:  # token ids in
            <<positions>>
            x = self.tok_emb(x) + self.pos_emb(positions)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:  # logits out
            x = self.head(self.norm(x))
        return x


BLOCK_CLASS = Block  # the repeated layer: FSDP's unit of sharding, full activation checkpointing's unit
ATTENTION_CLASS = Attention  # what selective activation checkpointing recomputes
'''

MODEL_REST = '''


def build_model(args: argparse.Namespace) -> nn.Module:
    """REPLACE with your model. Every rank calls this after seeding the same way, so the weights agree."""
    return DemoTransformer(
        vocab_size=args.vocab_size, dim=args.model_dim, layers=args.layers, heads=args.heads, max_seq_len=args.seq_len
    )


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """REPLACE with your loss: mean next-token cross-entropy, computed in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def compute_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss of one micro-batch."""
    return loss_fn(model(inputs), targets)


# ==============================================================================================================
# REPLACE: the data. Synthetic token sequences; build_dataset() may return any map-style dataset of
# (input tokens, target tokens) pairs of length --seq-len.
# ==============================================================================================================
class SyntheticTokens(Dataset):
    """Sequences in which each token is the previous one plus a fixed stride (modulo the vocabulary).

    A model learns the rule within a few steps, so a falling loss shows that training works end to end.
    """

    def __init__(self, *, vocab_size: int, seq_len: int, size: int, stride: int = 3) -> None:
        self.vocab_size, self.seq_len, self.size, self.stride = vocab_size, seq_len, size, stride

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = (index * 7919) % self.vocab_size
        tokens = (start + self.stride * torch.arange(self.seq_len + 1)) % self.vocab_size
        return tokens[:-1], tokens[1:]


def build_dataset(args: argparse.Namespace) -> Dataset:
    """REPLACE with your dataset."""
    return SyntheticTokens(vocab_size=args.vocab_size, seq_len=args.seq_len, size=args.samples)
'''

ARGS = '''
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; their defaults are the plan's numbers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS, help="optimizer steps in all; a resumed run continues")
    <<strategy_args>>
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=LR, help="learning rate")
    parser.add_argument("--weight-decay", type=float, default=WEIGHT_DECAY, help="decoupled weight decay")
    parser.add_argument("--checkpoint-dir", default=CHECKPOINT_DIR, help="where checkpoints are saved and resumed")
    parser.add_argument("--save-every", type=int, default=500, help="save every N steps (and after the last)")
    parser.add_argument("--log-every", type=int, default=10, help="print the loss every N steps")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the shuffle")
    parser.add_argument("--num-workers", type=int, default=2, help="data-loading processes per rank")
    # the demo model and data: REPLACE these flags with your own
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--model-dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--samples", type=int, default=100_000, help="size of the synthetic dataset")
    return parser.parse_args(argv)
'''

ARGS_TORCH = """
parser.add_argument("--micro-batch", type=int, default=MICRO_BATCH, help="sequences per GPU per micro-step")
parser.add_argument("--grad-accum", type=int, default=GRAD_ACCUM, help="micro-steps per optimizer step")
parser.add_argument("--grad-clip", type=float, default=GRAD_CLIP, help="max gradient norm (0: no clipping)")
"""

ARGS_DEEPSPEED = """
parser.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON: batch sizes, precision, ZeRO")
parser.add_argument("--deepspeed", action="store_true", help="accepted: the deepspeed launcher convention")
parser.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="ignored: LOCAL_RANK is read")
"""

SETUP = '''
def setup_distributed() -> torch.device:
    """Join the process group <<who>> describes (NCCL on GPUs, gloo on CPU); return this rank's device."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        <<init_nccl>>
    else:
        device = torch.device("cpu")
        <<init_gloo>>
    return device
'''

CHECKPOINT_ACTIVATIONS = '''
def checkpoint_activations(model: nn.Module, module_class: type[nn.Module], every: int = 1, **kwargs: Any) -> None:
    """Recompute every ``every``-th ``module_class`` in backward instead of keeping its activations.

    State-dict keys stay unchanged; ``kwargs`` go to ``torch.utils.checkpoint.checkpoint`` (``context_fn``: op-level
    selective checkpointing).
    """
    modules = [m for m in model.modules() if isinstance(m, module_class)]
    for i, module in enumerate(modules):
        if (i + 1) % every == 0:
            module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False, **kwargs)
'''

OP_SAC = '''
_OP_SAC_SAVE = {
    getattr(torch.ops.aten, name).default
    for name in ("mm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(torch.ops.aten, name)
}


def op_sac_context() -> Any:
    """Op-level selective checkpointing as torchtitan does it: keep attention and every other matmul output."""
    meta: dict[str, int] = defaultdict(int)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        key = "recompute" if ctx.is_recompute else "forward"
        if op == torch.ops.aten.mm.default:
            meta[key] += 1
        keep = op in _OP_SAC_SAVE and not (op == torch.ops.aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
'''
