"""The plan as a complete, runnable PyTorch training script (DDP, FSDP, FSDP2 with tensor/pipeline parallelism, ZeRO).

:func:`render_train_script` writes one readable file for the plan's chosen candidate: process-group set-up from
torchrun's environment, the strategy with the plan's numbers (micro-batch, accumulation, bucket and shard-group
sizes), precision, activation checkpointing, gradient accumulation without redundant communication, clipping, the
optimizer, and checkpoint save/resume. Its model and dataset are a small demo transformer and synthetic tokens in a
``build_model()`` / ``build_dataset()`` pair, marked as the parts a user replaces. The generated code passes ruff and
runs as is (on CPU with gloo for a quick check, e.g. ``--steps 5 --model-dim 32 --seq-len 32``).

Tensor parallelism (``fsdp2+tpN``, ``fsdp2+tpN+sp``, ``fsdp2-hybrid+tpN(+sp)``) is written as the worker applies it
(:mod:`jupyter_dist.worker._parallel`), in plain PyTorch so the script stays self-contained: one ``init_device_mesh``
of ``(dp_shard, tp)`` or ``(dp_replicate, dp_shard, tp)``, tp innermost; the demo model's Megatron layout as a
``tp_plan(sequence_parallel)`` of ``parallelize_module`` styles next to ``BLOCK_CLASS`` (the part a user adapts to
their model); activation checkpointing; ``fully_shard`` over the data-parallel sub-mesh; data loaded by data-parallel
rank (tp ranks see the same batch); gradients clipped per mesh; DCP checkpoints.

Pipeline parallelism (``fsdp2+ppN``, ``fsdp2+tpN+ppM(+sp)``, and their ``fsdp2-hybrid`` forms) follows the worker too
(:mod:`jupyter_dist.worker._pipeline`): the mesh ``(pp, [dp_replicate,] dp_shard[, tp])``, pp outermost; the demo
model keeps its blocks in a ``ModuleDict`` keyed by index and skips parts set to ``None``, so ``split_model()`` gives
each rank its stages under the whole model's parameter names (contiguous blocks balanced by cost, cut by an inlined
copy of :func:`~jupyter_dist.plan.pipeline.stage_bounds`; ``keep_stage_part()`` is the part a user adapts); TP,
activation checkpointing and FSDP2 per stage; a ``PipelineStage`` per stage on the ``pp`` group and a GPipe, 1F1B
(default) or interleaved-1F1B schedule (``--schedule``, ``--stages-per-rank``) over the plan's micro-batches (its
gradient accumulation); data read by data-parallel rank on the first stage (inputs) and the last (targets), the
loss on the last; the gradient norm summed over the stages; one optimizer per stage; DCP checkpoints with
``StateDictOptions(flatten_optimizer_state_dict=True)`` (one key per parameter, so a checkpoint resumes under another
pipeline split). Context and expert parallelism, ZeRO or FSDP1 with tp/pp, and fp16 pipelines are refused with a line
naming what can be generated.

The script is assembled from the templates below: a line that holds only ``<<name>>`` is replaced by a block
(indented like the marker, dropped when empty); ``<<name>>`` inside a line by a value. Pure and stdlib only: this
module renders text and never imports torch.

Planned split: the templates (``_MODEL`` to ``_MAIN_DEEPSPEED``, about half the file) move to template files that
are linted as Python themselves, apart from the assembler (``_Script``, :func:`render_train_script`), so that a
change to the generated code reads as a change to code (issue 17; docs/architecture.md, "Planned").
"""

from __future__ import annotations

from ..plan.parallel import ParallelDims
from ..plan.plan import Plan
from ..plan.strategies import FSDP1_SHARDING
from ..plan.training import TORCH_DTYPES, Checkpointing, OptimizerKind, Precision, precision_names
from .commands import deepspeed_command, torchrun_command
from .common import Layout, RenderError, RenderOptions, layout_of

__all__ = ["render_train_script", "FAMILIES", "DEFAULT_STEPS", "FSDP1_SHARDING"]

FAMILIES = ("ddp", "fsdp", "fsdp2", "deepspeed")
"""Strategy families the code generator covers (data parallelism, with or without sharding; fsdp2 also with tp/pp)."""

DEFAULT_STEPS = 1000
"""Optimizer steps written as the ``--steps`` default (the plan has no run length)."""


_DTYPES = {k: f"torch.{v}" for k, v in TORCH_DTYPES.items()}
_STDLIB = frozenset({"argparse", "collections", "contextlib", "fnmatch", "functools", "itertools", "json", "os", "re",
                     "time", "pathlib", "typing"})  # fmt: skip
_FSDP1_AC = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"

# ===============================================================================================================
# Templates (generated code; lines up to 120 characters)
# ===============================================================================================================
_MODEL = '''
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
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the next token at every position (a pipeline stage without some parts: hidden states)."""
        if self.tok_emb is not None:  # token ids in
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.tok_emb(x) + self.pos_emb(positions)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:  # logits out
            x = self.head(self.norm(x))
        return x


BLOCK_CLASS = Block  # the repeated layer: FSDP's unit of sharding, full activation checkpointing's unit
ATTENTION_CLASS = Attention  # what selective activation checkpointing recomputes
'''

_MODEL_REST = '''


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

_ARGS = '''
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

_ARGS_TORCH = """
parser.add_argument("--micro-batch", type=int, default=MICRO_BATCH, help="sequences per GPU per micro-step")
parser.add_argument("--grad-accum", type=int, default=GRAD_ACCUM, help="micro-steps per optimizer step")
parser.add_argument("--grad-clip", type=float, default=GRAD_CLIP, help="max gradient norm (0: no clipping)")
"""

_ARGS_DEEPSPEED = """
parser.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON: batch sizes, precision, ZeRO")
parser.add_argument("--deepspeed", action="store_true", help="accepted: the deepspeed launcher convention")
parser.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="ignored: LOCAL_RANK is read")
"""

_SETUP = '''
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

_CHECKPOINT_ACTIVATIONS = '''
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

_OP_SAC = '''
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

_PARALLELIZE_DDP = '''
def parallelize(model: nn.Module, device: torch.device) -> nn.Module:
    """DDP: a full replica on every rank; gradients are all-reduced in buckets while backward runs."""
    model = model.to(device<<to_dtype>>)
    <<activation_checkpointing>>
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=BUCKET_CAP_MB,
        gradient_as_bucket_view=True,  # gradients are views into the buckets: no extra copy
    )
'''

_PARALLELIZE_FSDP = '''
def parallelize(model: nn.Module, device: torch.device) -> nn.Module:
    """FSDP (<<sharding>>): one FSDP unit per block plus the root (embeddings, head)."""
    <<precision>>
    <<mesh>>
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={BLOCK_CLASS}),
        sharding_strategy=ShardingStrategy.<<sharding>>,
        mixed_precision=<<mixed_precision>>,
        device_id=device,  # also on CPU: without it FSDP refuses to run where there is no accelerator
        use_orig_params=True,  # optimizer and checkpoints see the original parameters, not flat ones
        <<device_mesh>>
    )
    <<activation_checkpointing>>
    return model
'''

_PARALLELIZE_FSDP2 = '''
def parallelize(model: nn.Module, device: torch.device) -> nn.Module:
    """FSDP2: shard each block's parameters (as DTensors), then the rest of the model at the root."""
    <<mesh>>
    <<precision>>
    <<activation_checkpointing>>
    for module in model.modules():
        if isinstance(module, BLOCK_CLASS):
            fully_shard(module, mesh=mesh<<policy>>)
    fully_shard(model, mesh=mesh<<policy>>)  # also moves the shards to the mesh's device
    return model
'''

_HYBRID_MESH = """
world_size = dist.get_world_size()
if world_size % SHARD_GROUP_SIZE:
    raise SystemExit(f"world size {world_size} is not a multiple of the shard group size {SHARD_GROUP_SIZE}")
# <<what>>
mesh = init_device_mesh(
    device.type, (world_size // SHARD_GROUP_SIZE, SHARD_GROUP_SIZE), mesh_dim_names=<<names>>
)
"""

_TP_PLAN = '''
def tp_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """REPLACE with your model's layout: module name (``*`` for any one name) -> how tensor parallelism splits it.

    Megatron-LM's layout (Shoeybi et al. 2019): the attention's q/k/v projections and the MLP's first linear are split
    by output features (column-wise: each tp rank computes some of the heads, some of the MLP width), the attention's
    output projection and the MLP's second linear by input features (row-wise: partial sums, added up across the tp
    ranks), the token embedding by vocabulary rows and the head by vocabulary columns. The tp degree must divide the
    heads, the MLP width and the vocabulary. With sequence parallelism (Korthikanti et al. 2022) the residual stream
    between the blocks and the norms are split along the sequence (dim 1) instead of replicated: gathered before the
    attention and the MLP, reduce-scattered after them.
    """
    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout between the blocks
    plan: dict[str, ParallelStyle] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "blocks.*.attn.q_proj": ColwiseParallel(),
        "blocks.*.attn.k_proj": ColwiseParallel(),
        "blocks.*.attn.v_proj": ColwiseParallel(),
        "blocks.*.attn.out_proj": RowwiseParallel(output_layouts=stream),
        "blocks.*.mlp.0": ColwiseParallel(),  # the MLP's first linear (its bias is split with it)
        "blocks.*.mlp.2": RowwiseParallel(output_layouts=stream),  # its second (the bias stays whole)
        "head": ColwiseParallel(input_layouts=stream, output_layouts=Replicate()),  # whole logits on every tp rank
    }
    if sequence_parallel:
        gather = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}
        plan.update({
            # the position table stays whole: the stream is split once it is added, at the first block's input
            "blocks.0": PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
            ),
            "blocks.*.attn_norm": SequenceParallel(use_local_output=True),
            "blocks.*.mlp_norm": SequenceParallel(use_local_output=True),
            "norm": SequenceParallel(use_local_output=True),
            "blocks.*.attn": PrepareModuleInput(**gather),  # all-gather the sequence (reduce-scatter in backward)
            "blocks.*.mlp": PrepareModuleInput(**gather),
        })
    return plan
'''

_BUILD_MESH = '''
def build_mesh(device: torch.device) -> DeviceMesh:
    """The device mesh <<shape>><<innermost>>.

    <<what>>
    """
    world_size, unit = dist.get_world_size(), <<unit>>
    if world_size % unit:
        raise SystemExit(f"{world_size} processes: not a multiple of <<unit_what>> = {unit}")
    sizes = (<<sizes>>)
    return init_device_mesh(device.type, sizes, mesh_dim_names=(<<names>>))
'''

_PARALLELIZE_FSDP2_TP = '''
def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """<<doc>>"""
    <<precision_model>>
    <<tensor_parallel>>
    <<activation_checkpointing>>
    <<precision>>
    dp_mesh = mesh[<<dp_dims>>]  # <<dp_what>>
    for module in model.modules():
        if isinstance(module, BLOCK_CLASS):
            fully_shard(module, mesh=dp_mesh<<policy>>)
    fully_shard(model, mesh=dp_mesh<<policy>>)  # also moves the shards to the mesh's device
    return model
'''

_CLIP_MESHES = '''
def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip to ``max_norm``; return the norm of all gradients over every rank's shards.

    With tensor parallelism the gradients are DTensors on two meshes ((dp, tp) for the split layers, dp for the ones
    kept whole), which torch.nn.utils.clip_grad_norm_ cannot mix: each mesh's gradients are reduced and scaled apart.
    """
    groups: dict[object, list[nn.Parameter]] = {}  # the parameters by the mesh their gradients live on
    for param in model.parameters():
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            groups.setdefault(mesh, []).append(param)
    squares = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = torch.stack(squares).sum().sqrt()
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
'''

_ARGS_PIPELINE = """
parser.add_argument("--schedule", choices=SCHEDULES, default=SCHEDULE, help="pipeline schedule")
parser.add_argument(
    "--stages-per-rank", type=int, default=0, help="pipeline stages per rank (0: 2 for interleaved-1f1b, else 1)"
)
"""

_HELD = '''
def held(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """The entries of ``plan`` whose modules this pipeline stage holds (the others live on other ranks)."""
    names = [name for name, _ in model.named_modules()]
    return {key: style for key, style in plan.items() if any(fnmatch.fnmatchcase(name, key) for name in names)}
'''

_PIPELINE = '''
def check_pipeline(args: argparse.Namespace) -> None:
    """Check --schedule, --stages-per-rank and --grad-accum (the schedule's micro-batches) together."""
    interleaved = args.schedule == "interleaved-1f1b"
    if args.stages_per_rank == 0:
        args.stages_per_rank = 2 if interleaved else 1
    if interleaved and args.stages_per_rank < 2:
        raise SystemExit(f"--schedule interleaved-1f1b needs --stages-per-rank >= 2, got {args.stages_per_rank}")
    if not interleaved and args.stages_per_rank != 1:
        raise SystemExit(
            f"--schedule {args.schedule} runs one stage per rank; --stages-per-rank {args.stages_per_rank} needs "
            "--schedule interleaved-1f1b"
        )
    if args.schedule == "1f1b" and args.grad_accum < PP:
        raise SystemExit(
            f"1F1B needs at least as many micro-batches (--grad-accum {args.grad_accum}) as pipeline stages ({PP}); "
            "raise --grad-accum or use --schedule gpipe"
        )
    if args.layers < PP * args.stages_per_rank:
        raise SystemExit(
            f"{PP * args.stages_per_rank} pipeline stages need at least as many blocks; --layers is {args.layers}"
        )


def stage_bounds(n_layers: int, n_stages: int, last_extra: float) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` block ranges, one per stage, that minimise the most loaded stage.

    A block costs 1; the last stage also runs the norm and the head, worth ``last_extra`` blocks (the embeddings
    are lookups and cost next to nothing), so it gets fewer blocks when the vocabulary is large. Among splits with
    the same largest cost, the most even one (smallest sum of squared costs) wins.
    """
    if n_stages == 1:
        return [(0, n_layers)]
    extra = [0.0] * (n_stages - 1) + [last_extra]

    def capacities(limit: float) -> list[int] | None:
        caps = [int(limit - e + 1e-9) for e in extra]  # the most blocks each stage can take under the limit
        return caps if min(caps) >= 1 and sum(caps) >= n_layers else None

    limits = sorted({k + e for k in range(1, n_layers + 1) for e in (0.0, last_extra)})
    caps = next(c for c in (capacities(m) for m in limits) if c is not None)
    for _ in range(sum(caps) - n_layers):  # take blocks from the costliest stages (ties: the later one)
        i = max((k for k in range(n_stages) if caps[k] > 1), key=lambda k: (caps[k] + extra[k], k))
        caps[i] -= 1
    starts = [sum(caps[:k]) for k in range(n_stages)]
    return [(start, start + c) for start, c in zip(starts, caps, strict=True)]


def keep_stage_part(model: nn.Module, start: int, end: int, *, first: bool, last: bool) -> None:
    """REPLACE for your model: keep only what one pipeline stage runs.

    Blocks ``start..end-1`` under their whole-model keys, the embeddings on the first stage, the norm and the head on
    the last; the other parts become None, which forward skips.
    """
    for key in list(model.blocks):
        if not start <= int(key) < end:
            del model.blocks[key]
    if not first:
        model.tok_emb = model.pos_emb = None
    if not last:
        model.norm = model.head = None


def split_model(model: nn.Module, mesh: DeviceMesh, args: argparse.Namespace) -> list[tuple[int, nn.Module]]:
    """The pipeline stages this rank holds, as (stage index, module), cut at block boundaries balanced by cost.

    ``PP x --stages-per-rank`` stages; stage ``i`` goes to pp rank ``i % PP`` (the looped placement interleaved 1F1B
    expects). Every rank built the whole model from the same seed, so each stage starts from the weights a run
    without a pipeline has; a stage is a skeleton built on the meta device (no memory) that keeps its parts and takes
    their tensors from the whole model. (A model too large for one host's memory: build it on the meta device too,
    then initialise or load each stage's parts.)
    """
    n_stages = PP * args.stages_per_rank
    per_block = sum(p.numel() for p in model.blocks["0"].parameters())
    head = sum(p.numel() for part in (model.norm, model.head) for p in part.parameters())
    bounds = stage_bounds(len(model.blocks), n_stages, last_extra=head / per_block)
    whole = model.state_dict()
    stages = []
    for index in range(mesh["pp"].get_local_rank(), n_stages, PP):
        with torch.device("meta"):
            stage = build_model(args)
        keep_stage_part(stage, *bounds[index], first=index == 0, last=index == n_stages - 1)
        stage.load_state_dict(whole, strict=False, assign=True)  # the kept parts' tensors, not copies
        stages.append((index, stage))
    if dist.get_rank() == 0:
        cuts = ", ".join(f"{i}: {start}..{end - 1}" for i, (start, end) in enumerate(bounds))
        print(f"pipeline stages (blocks): {cuts}", flush=True)
    return stages


def build_schedule(
    stages: list[tuple[int, nn.Module]], mesh: DeviceMesh, args: argparse.Namespace, device: torch.device
) -> ScheduleGPipe | Schedule1F1B | ScheduleInterleaved1F1B:
    """The schedule that runs forward and backward of this rank's stages over ``--grad-accum`` micro-batches.

    GPipe runs every micro-batch's forward, then every backward (all of them in flight); 1F1B alternates one forward
    and one backward once the pipeline is full (at most PP in flight on the first stage; the bubble is
    (PP - 1) / micro-batches of the step); interleaved 1F1B gives each rank several smaller stages, which shrinks
    the bubble by that factor for more point-to-point traffic. Gradients are scaled by 1 / micro-batches (the loss
    of a step is the mean of its micro-batches', as without a pipeline).
    """
    n_stages = PP * args.stages_per_rank
    group = mesh["pp"].get_group()
    pipeline = [PipelineStage(stage, index, n_stages, device, group=group) for index, stage in stages]
    if args.schedule == "interleaved-1f1b":
        return ScheduleInterleaved1F1B(pipeline, args.grad_accum, loss_fn=loss_fn)
    schedule = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    return schedule(pipeline[0], args.grad_accum, loss_fn=loss_fn)
'''

_CLIP_PIPELINE = '''
def clip_grad_norm(stages: list[nn.Module], max_norm: float, pp_group: dist.ProcessGroup) -> torch.Tensor:
    """Clip to ``max_norm``; return the norm of all gradients over every rank's shards and every pipeline stage.

    The gradients are DTensors, on one mesh per kind of layout (with tensor parallelism: (dp, tp) for the split
    layers, dp for the ones kept whole), which torch.nn.utils.clip_grad_norm_ cannot mix: each mesh's squared norm is
    reduced apart, then the stages' squares are summed over ``pp``.
    """
    groups: dict[object, list[nn.Parameter]] = {}  # the parameters by the mesh their gradients live on
    for stage in stages:
        for param in stage.parameters():
            if param.grad is not None:
                mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
                groups.setdefault(mesh, []).append(param)
    squares = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = torch.stack(squares).sum()
    dist.all_reduce(total, group=pp_group)  # add the other stages' squares
    total = total.sqrt()
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
'''

_OPTIMIZERS = {
    OptimizerKind.ADAMW: '''
def build_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW with decoupled weight decay; the learning rate stays constant."""
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
''',
    OptimizerKind.SGD: '''
def build_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """SGD with momentum 0.9; the learning rate stays constant."""
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
''',
    OptimizerKind.ADAMW_8BIT: '''
def build_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """bitsandbytes 8-bit AdamW (one byte per optimizer state); the learning rate stays constant."""
    try:
        import bitsandbytes as bnb
    except ImportError as err:
        raise SystemExit("the plan uses 8-bit AdamW, which needs bitsandbytes: pip install bitsandbytes") from err
    return bnb.optim.AdamW8bit(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
''',
}

_MICRO_BATCHES = '''
def micro_batches(loader: DataLoader, sampler: DistributedSampler, start: int) -> Iterator[list[torch.Tensor]]:
    """Endless micro-batches, reshuffled each epoch (``set_epoch``), skipping the ``start`` already trained on."""
    epoch, skip = divmod(start, len(loader))
    while True:
        sampler.set_epoch(epoch)
        for index, batch in enumerate(loader):
            if index >= skip:
                yield batch
        epoch, skip = epoch + 1, 0
'''

_CHECKPOINT_DCP = r'''
def latest_checkpoint(root: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint under ``root`` as (step, folder); DCP writes ``.metadata`` last."""
    found = [
        (int(match.group(1)), path)
        for path in root.glob("step-*")
        if (match := re.fullmatch(r"step-(\d+)", path.name)) and (path / ".metadata").exists()
    ]
    return max(found) if found else None


def save_checkpoint(
    model: nn.Module, optimizer: torch.optim.Optimizer<<scaler_param>>, step: int, root: Path
) -> None:
    """Save with torch.distributed.checkpoint: each rank writes its own shards to ``root/step-<N>``."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": step}
    <<scaler_state>>
    dcp.save(state, checkpoint_id=root / f"step-{step}")


def load_checkpoint(
    model: nn.Module, optimizer: torch.optim.Optimizer<<scaler_param>>, root: Path
) -> int:
    """Resume from the newest checkpoint under ``root``; return its step (0 when there is none)."""
    latest = latest_checkpoint(root)
    if latest is None:
        return 0
    step, path = latest
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": step}
    <<scaler_state>>
    dcp.load(state, checkpoint_id=path)  # in place: each rank reads the pieces of its own shards
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    <<scaler_load>>
    if dist.get_rank() == 0:
        print(f"resumed from {path} at step {state['step']}", flush=True)
    return int(state["step"])
'''

_CHECKPOINT_PIPELINE = r'''
def latest_checkpoint(root: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint under ``root`` as (step, folder); DCP writes ``.metadata`` last."""
    found = [
        (int(match.group(1)), path)
        for path in root.glob("step-*")
        if (match := re.fullmatch(r"step-(\d+)", path.name)) and (path / ".metadata").exists()
    ]
    return max(found) if found else None


# one key per parameter (state.<name>.exp_avg, param_groups.<name>.lr): the stages' optimizer states merge into one
# dict without clashing, and a stage that resumes reads its own parameters' groups (the nested form keeps one list
# of param groups, which differs from stage to stage)
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def pipeline_state(
    stages: list[nn.Module], optimizers: list[torch.optim.Optimizer], step: int
) -> tuple[dict[str, Any], list[tuple[dict[str, Any], dict[str, Any]]]]:
    """The checkpoint's state (this rank's stages merged, whole-model names) and each stage's own state dicts."""
    parts = [
        get_state_dict(model, optimizer, options=FLAT) for model, optimizer in zip(stages, optimizers, strict=True)
    ]
    state = {"model": {}, "optim": {}, "step": step}
    for model_state, optim_state in parts:
        state["model"].update(model_state)
        state["optim"].update(optim_state)
    return state, parts


def save_checkpoint(stages: list[nn.Module], optimizers: list[torch.optim.Optimizer], step: int, root: Path) -> None:
    """Save with torch.distributed.checkpoint: each rank writes its stages' shards to ``root/step-<N>``."""
    state, _ = pipeline_state(stages, optimizers, step)
    dcp.save(state, checkpoint_id=root / f"step-{step}")


def load_checkpoint(stages: list[nn.Module], optimizers: list[torch.optim.Optimizer], root: Path) -> int:
    """Resume from the newest checkpoint under ``root`` (saved under any pipeline split); return its step."""
    latest = latest_checkpoint(root)
    if latest is None:
        return 0
    step, path = latest
    state, parts = pipeline_state(stages, optimizers, step)
    dcp.load(state, checkpoint_id=path)  # in place: each rank reads the pieces of its own stages' shards
    for stage, optimizer, (model_state, optim_state) in zip(stages, optimizers, parts, strict=True):
        set_state_dict(
            stage, optimizer, model_state_dict={k: state["model"][k] for k in model_state},
            optim_state_dict={k: state["optim"][k] for k in optim_state}, options=FLAT,
        )
    if dist.get_rank() == 0:
        print(f"resumed from {path} at step {state['step']}", flush=True)
    return int(state["step"])
'''

_CHECKPOINT_DEEPSPEED = '''
# DeepSpeed's own checkpoint format: torch.distributed.checkpoint's get_state_dict() does not know ZeRO's partitions.
def save_checkpoint(engine: deepspeed.DeepSpeedEngine, step: int, root: Path) -> None:
    """Save the engine (each rank writes its ZeRO partitions) to ``root/step-<N>``; ``root/latest`` names it."""
    engine.save_checkpoint(str(root), tag=f"step-{step}", client_state={"step": step})


def load_checkpoint(engine: deepspeed.DeepSpeedEngine, root: Path) -> int:
    """Resume from the checkpoint ``root/latest`` names; return its step (0 when there is none)."""
    if not (root / "latest").exists():
        return 0
    path, client_state = engine.load_checkpoint(str(root))
    if path is None:
        raise SystemExit(f"could not load the checkpoint that {root / 'latest'} names")
    if dist.get_rank() == 0:
        print(f"resumed from {path} at step {client_state['step']}", flush=True)
    return int(client_state["step"])
'''

_MAIN_TORCH = '''
def main(argv: list[str] | None = None) -> None:
    """Train for ``--steps`` optimizer steps; resume from the newest checkpoint in ``--checkpoint-dir``."""
    args = parse_args(argv)
    device = setup_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    <<build>>
    optimizer = build_optimizer(model, args)
    <<scaler>>
    checkpoint_dir = Path(args.checkpoint_dir)
    start_step = load_checkpoint(model, optimizer<<scaler_arg>>, checkpoint_dir)

    dataset = build_dataset(args)
    <<dp_ranks>>
    sampler = DistributedSampler(dataset, num_replicas=<<dp_size>>, rank=<<dp_rank>>, seed=args.seed, drop_last=True)
    loader = DataLoader(
        dataset, batch_size=args.micro_batch, sampler=sampler, num_workers=args.num_workers, drop_last=True,
        pin_memory=device.type == "cuda",
    )
    batches = micro_batches(loader, sampler, start=start_step * args.grad_accum)
    if rank == 0:
        print(f"{STRATEGY} on {world_size} ranks ({device.type}), {PRECISION}, steps {start_step + 1}..{args.steps}",
              flush=True)
        <<describe_mesh>>

    model.train()
    for step in range(start_step + 1, args.steps + 1):
        started = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for micro_step in range(args.grad_accum):
            inputs, targets = (t.to(device, non_blocking=True) for t in next(batches))
            last = micro_step == args.grad_accum - 1
            <<micro_step>>
            loss_sum += loss.detach()
        <<clip>>
        <<optimizer_step>>
        optimizer.zero_grad(set_to_none=True)

        if step % args.log_every == 0 or step == args.steps:
            dist.all_reduce(loss_sum)  # the sum of the ranks' mean losses
            if rank == 0:
                tokens = args.micro_batch * args.grad_accum * args.seq_len * <<dp_size>>
                print(
                    f"step {step}/{args.steps} loss {loss_sum.item() / world_size:.6f} "
                    f"grad-norm {grad_norm.item():.3f} tokens/s {tokens / (time.perf_counter() - started):,.0f}",
                    flush=True,
                )
        if step % args.save_every == 0 or step == args.steps:
            save_checkpoint(model, optimizer<<scaler_arg>>, step, checkpoint_dir)
    <<teardown>>
    dist.destroy_process_group()
'''

_MAIN_PIPELINE = '''
def main(argv: list[str] | None = None) -> None:
    """Train for ``--steps`` optimizer steps; resume from the newest checkpoint in ``--checkpoint-dir``."""
    args = parse_args(argv)
    check_pipeline(args)
    device = setup_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    mesh = build_mesh(device)
    stages = [(index, parallelize(stage, mesh)) for index, stage in split_model(build_model(args), mesh, args)]
    models = [stage for _, stage in stages]
    optimizers = [build_optimizer(model, args) for model in models]  # one per stage, as its checkpoint is
    schedule = build_schedule(stages, mesh, args, device)
    first, last = stages[0][0] == 0, stages[-1][0] == PP * args.stages_per_rank - 1
    checkpoint_dir = Path(args.checkpoint_dir)
    start_step = load_checkpoint(models, optimizers, checkpoint_dir)

    # data parallelism by replica, not by rank: the mesh is (pp, dp, tp) with tp innermost, so the TP ranks of a
    # replica are neighbours and its stages are world_size // PP ranks apart; they all take replica dp_rank's batch,
    # of which the first stage reads the inputs and the last the targets (the other stages read nothing)
    dp_size = world_size // (PP * TP)
    dp_rank = (rank // TP) % dp_size
    batches = None
    if first or last:
        dataset = build_dataset(args)
        sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, seed=args.seed, drop_last=True)
        loader = DataLoader(  # one batch per optimizer step: the schedule splits it into --grad-accum micro-batches
            dataset, batch_size=args.micro_batch * args.grad_accum, sampler=sampler, num_workers=args.num_workers,
            drop_last=True, pin_memory=device.type == "cuda",
        )
        batches = micro_batches(loader, sampler, start=start_step)
    if rank == 0:
        print(f"{STRATEGY} on {world_size} ranks ({device.type}), {PRECISION}, steps {start_step + 1}..{args.steps}",
              flush=True)
        print("mesh", " x ".join(f"{n}={s}" for n, s in zip(mesh.mesh_dim_names, mesh.shape, strict=True)),
              f"schedule {args.schedule}, {args.grad_accum} micro-batches", flush=True)

    for model in models:
        model.train()
    for step in range(start_step + 1, args.steps + 1):
        started = time.perf_counter()
        inputs = targets = None
        if batches is not None:
            inputs, targets = (t.to(device, non_blocking=True) for t in next(batches))
        losses: list[torch.Tensor] = []  # filled on the last stage: one loss per micro-batch
        # forward and backward of every micro-batch in the schedule's order; FSDP2 reduce-scatters the gradients
        # after each stage's last backward
        schedule.step(*([inputs] if first else []), target=targets if last else None, losses=losses)
        loss = torch.stack(losses).mean() if losses else torch.zeros((), device=device)
        <<clip>>
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        if step % args.log_every == 0 or step == args.steps:
            dist.all_reduce(loss)  # the sum of the last stage's ranks' mean losses (the other ranks add zeros)
            if rank == 0:
                tokens = args.micro_batch * args.grad_accum * args.seq_len * dp_size
                print(
                    f"step {step}/{args.steps} loss {loss.item() / (dp_size * TP):.6f} "
                    f"grad-norm {grad_norm.item():.3f} tokens/s {tokens / (time.perf_counter() - started):,.0f}",
                    flush=True,
                )
        if step % args.save_every == 0 or step == args.steps:
            save_checkpoint(models, optimizers, step, checkpoint_dir)
    dist.destroy_process_group()
'''

_MAIN_DEEPSPEED = '''
def main(argv: list[str] | None = None) -> None:
    """Train for ``--steps`` optimizer steps; resume from the newest checkpoint in ``--checkpoint-dir``."""
    args = parse_args(argv)
    device = setup_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = build_model(args)
    <<activation_checkpointing>>
    config = json.loads(Path(args.deepspeed_config).read_text())
    optimizer = None if "optimizer" in config else build_optimizer(model, args)  # the config's optimizer wins
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, model_parameters=model.parameters(), config=args.deepspeed_config
    )
    micro_batch, grad_accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    if rank == 0 and (micro_batch, grad_accum) != (MICRO_BATCH, GRAD_ACCUM):
        print(
            f"note: {args.deepspeed_config} sets micro-batch {micro_batch} x accumulation {grad_accum}; "
            f"the plan has {MICRO_BATCH} x {GRAD_ACCUM}",
            flush=True,
        )
    checkpoint_dir = Path(args.checkpoint_dir)
    start_step = load_checkpoint(engine, checkpoint_dir)

    dataset = build_dataset(args)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=args.seed, drop_last=True)
    loader = DataLoader(
        dataset, batch_size=micro_batch, sampler=sampler, num_workers=args.num_workers, drop_last=True,
        pin_memory=device.type == "cuda",
    )
    batches = micro_batches(loader, sampler, start=start_step * grad_accum)
    if rank == 0:
        print(f"{STRATEGY} on {world_size} ranks ({device.type}), steps {start_step + 1}..{args.steps}", flush=True)

    engine.train()
    for step in range(start_step + 1, args.steps + 1):
        started = time.perf_counter()
        loss_sum = torch.zeros((), device=engine.device)
        for _ in range(grad_accum):
            inputs, targets = (t.to(engine.device, non_blocking=True) for t in next(batches))
            loss = compute_loss(engine, inputs, targets)
            engine.backward(loss)  # scales by 1 / accumulation; reduces gradients at the boundary
            engine.step()  # steps the optimizer (and clips) only at the accumulation boundary
            loss_sum += loss.detach().float() / grad_accum

        if step % args.log_every == 0 or step == args.steps:
            dist.all_reduce(loss_sum)  # the sum of the ranks' mean losses
            if rank == 0:
                tokens = micro_batch * grad_accum * args.seq_len * world_size
                grad_norm = engine.get_global_grad_norm()
                norm = "n/a" if grad_norm is None else f"{float(grad_norm):.3f}"
                print(
                    f"step {step}/{args.steps} loss {loss_sum.item() / world_size:.6f} "
                    f"grad-norm {norm} tokens/s {tokens / (time.perf_counter() - started):,.0f}",
                    flush=True,
                )
        if step % args.save_every == 0 or step == args.steps:
            save_checkpoint(engine, step, checkpoint_dir)
    dist.destroy_process_group()
'''


# ===============================================================================================================
# Assembly
# ===============================================================================================================
def _fill(template: str, **values: str) -> str:
    """Fill ``<<name>>`` markers: a marker alone on its line takes an indented block, elsewhere a value."""
    out: list[str] = []
    for line in template.strip("\n").split("\n"):
        stripped = line.strip()
        key = stripped[2:-2]
        if stripped.startswith("<<") and stripped.endswith(">>") and key in values:
            indent = line[: len(line) - len(stripped)]
            out.extend(indent + x if x else "" for x in values[key].strip("\n").split("\n") if values[key])
            continue
        for name, value in values.items():
            line = line.replace(f"<<{name}>>", value)
        out.append(line)
    text = "\n".join(out)
    if "<<" in text:
        raise RuntimeError(f"unfilled template marker near {text[text.index('<<') :][:40]!r}")
    return text


def _py_str(value: str) -> str:
    """A Python string literal, in double quotes where that needs no escaping."""
    text = repr(value)
    if text.startswith("'") and '"' not in value and "\\" not in text:
        text = '"' + text[1:-1] + '"'
    return text


def _lines(*lines: str) -> str:
    return "\n".join(lines)


def _doc_safe(text: str) -> str:
    """Text that can sit inside a triple-quoted raw docstring (no backslashes, no triple quotes)."""
    cleaned = "".join(c if c.isprintable() or c == "\n" else " " for c in text)
    return cleaned.replace("\\", "/").replace('"""', "'''")


def _wrap(line: str, width: int, *, indent: str = "", cont: str = "", sep: str = "") -> list[str]:
    """Split ``line`` between words into lines of at most ``width``; continuation lines start with ``cont``."""
    out: list[str] = []
    current = ""
    for word in line.split(" "):
        if current and len(indent) + len(current) + 1 + len(word) + len(sep) > width:
            out.append(indent + current + sep)
            current = cont + word
        else:
            current = f"{current} {word}" if current else word
    out.append(indent + current)
    return out


def _import_lines(straight: list[tuple[str, str | None]], froms: dict[str, list[str]]) -> str:
    """Sorted as ruff's isort rules want: ``import x`` lines, then ``from x import`` lines, by module."""
    lines = [f"import {m}" + (f" as {a}" if a else "") for m, a in sorted(straight, key=lambda x: x[0].lower())]
    for module in sorted(froms, key=str.lower):
        names = set(froms[module])
        # an aliased name gets a line of its own (isort's combine-as-imports is off), before the others
        lines += [f"from {module} import {n}" for n in sorted(n for n in names if " as " in n)]
        members = sorted((n for n in names if " as " not in n), key=_member_key)
        if not members:
            continue
        line = f"from {module} import {', '.join(members)}"
        if len(line) > 120:
            line = f"from {module} import (\n" + "".join(f"    {m},\n" for m in members) + ")"
        lines.append(line)
    return "\n".join(lines)


def _member_key(member: str) -> tuple[int, str]:
    """Ruff's ``order-by-type``: CONSTANTS, Classes, then functions; case-insensitive within each."""
    name = member.split(" as ")[0]
    kind = 0 if name.isupper() and len(name) > 1 else 1 if name[:1].isupper() else 2
    return kind, name.lower()


class _Script:
    """The sections of one script; each records the imports it uses."""

    def __init__(self, lay: Layout, opts: RenderOptions) -> None:
        self.lay = lay
        self.opts = opts
        self.family = lay.strategy.family
        self.straight: list[tuple[str, str | None]] = []
        self.froms: dict[str, list[str]] = {}
        self.use("argparse", "os", "time", "torch")
        self.use_as("torch.distributed", "dist")
        self.use_as("torch.nn.functional", "F")
        self.use_from("collections.abc", "Iterator")
        self.use_from("pathlib", "Path")
        self.use_from("torch", "nn")
        self.use_from("torch.utils.data", "DataLoader", "Dataset", "DistributedSampler")

    # ---- imports -------------------------------------------------------------------------------------------
    def use(self, *modules: str) -> None:
        self.straight += [(m, None) for m in modules if (m, None) not in self.straight]

    def use_as(self, module: str, alias: str) -> None:
        if (module, alias) not in self.straight:
            self.straight.append((module, alias))

    def use_from(self, module: str, *names: str) -> None:
        self.froms.setdefault(module, []).extend(names)

    def import_block(self) -> str:
        blocks = []
        for third_party in (False, True):
            straight = [s for s in self.straight if (s[0].split(".")[0] not in _STDLIB) == third_party]
            froms = {m: n for m, n in self.froms.items() if (m.split(".")[0] not in _STDLIB) == third_party}
            if straight or froms:
                blocks.append(_import_lines(straight, froms))
        return "\n\n".join(blocks)

    # ---- what the plan says --------------------------------------------------------------------------------
    @property
    def ds(self) -> bool:
        return self.family == "deepspeed"

    @property
    def precision(self) -> Precision:
        return self.lay.precision

    @property
    def mixed(self) -> bool:
        return self.precision in (Precision.BF16_MIXED, Precision.FP16_MIXED)

    @property
    def fp16(self) -> bool:
        return self.precision is Precision.FP16_MIXED

    @property
    def compute_dtype(self) -> str:
        return _DTYPES[self.precision.compute_dtype]

    @property
    def tp(self) -> int:
        """The tensor-parallel degree (1: data parallelism only)."""
        return self.lay.dims.tp

    @property
    def pp(self) -> int:
        """The pipeline-parallel degree (1: no pipeline)."""
        return self.lay.dims.pp

    @property
    def meshed(self) -> bool:
        """Whether the script builds a device mesh of model-parallel dims (tp and/or pp) with ``build_mesh()``."""
        return self.tp > 1 or self.pp > 1

    @property
    def group(self) -> int:
        """Ranks that share one sharded replica in a hybrid (HSDP) strategy."""
        return int(self.lay.settings.get("shard_group_size", self.lay.gpus_per_node))

    # ---- sections ------------------------------------------------------------------------------------------
    def docstring(self) -> str:
        lay, plan, opts = self.lay, self.lay.plan, self.opts
        hw = plan.hardware
        if self.ds:
            launch = deepspeed_command(plan, opts, layout=lay).shell(with_env=False)
            quick = f"DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 {opts.script} "
            quick += "--deepspeed_config ds_config.json"
            note = (
                "Micro-batch, accumulation, precision, ZeRO stage and gradient clipping come from the DeepSpeed config "
                "jupyter-dist rendered from the same plan (--deepspeed_config); an optimizer section there replaces "
                "the optimizer built here."
            )
        else:
            launch = torchrun_command(plan, opts, layout=lay).shell(with_env=False)
            # processes of one model replica (tp x the shard group when hybrid); the quick check runs two replicas
            unit = self.pp * self.tp * (self.group if self.lay.strategy.hybrid else 1)
            quick = f"torchrun --standalone --nproc-per-node {unit * 2 if unit <= 2 else unit} {opts.script}"
            note = ""
        quick += f" --steps 20 --model-dim 64 --layers {max(2, self.pp)} --seq-len 64 --vocab-size 256 --num-workers 0"
        summary = (
            f"Plan: {plan.model.name} ({plan.model.params:,} parameters) on {hw.nodes} node(s) x {hw.gpus_per_node} "
            f"{hw.accelerator.label}; candidate {lay.candidate.name}. Precision {lay.precision.value}, optimizer "
            f"{lay.optimizer.value}, activation checkpointing {lay.checkpointing.value}. Per GPU {lay.micro_batch} "
            f"sequence(s) of {lay.seq_len} tokens x {lay.grad_accum} micro-step(s) x data-parallel {lay.dims.dp} = "
            f"{lay.global_batch} sequences per optimizer step."
        )
        title = f"Distributed training with {_doc_safe(lay.strategy.label)}, generated by jupyter-dist from a plan."
        lines = [title, ""]
        lines += _wrap(_doc_safe(summary), 116)
        if note:
            lines += _wrap(note, 116)
        lines += ["", "Launch (one process per GPU):", ""]
        lines += _wrap(_doc_safe(launch), 116, indent="    ", cont="    ", sep=" \\")
        lines += [""]
        lines += _wrap(
            "REPLACE build_model() and build_dataset() (a small demo transformer and synthetic tokens) with your own "
            "model and data; the rest follows the plan. A quick check on CPU processes (gloo):",
            116,
        )
        lines += [""] + _wrap(_doc_safe(quick), 116, indent="    ", cont="    ", sep=" \\")
        return 'r"""' + "\n".join(lines) + '\n"""'

    def constants(self) -> str:
        lay, opts = self.lay, self.opts
        *others, last = precision_names()
        rows = [
            ("STRATEGY", _py_str(lay.strategy.name), lay.strategy.label),
            ("PRECISION", _py_str(lay.precision.value), f"{', '.join(others)} or {last}"),
            ("ACTIVATION_CHECKPOINTING", _py_str(lay.checkpointing.value), "none, selective (attention), full"),
            ("MICRO_BATCH", str(lay.micro_batch), "sequences per GPU per micro-step"),
            ("GRAD_ACCUM", str(lay.grad_accum), "micro-steps per optimizer step"),
            ("SEQ_LEN", str(lay.seq_len), "tokens per sequence"),
        ]
        if self.family == "ddp":
            bucket = lay.settings.get("bucket_cap_mb", 25)
            rows.append(("BUCKET_CAP_MB", repr(bucket), "size of the gradient all-reduce buckets"))
        if lay.strategy.hybrid:
            rows.append(("SHARD_GROUP_SIZE", str(self.group), "ranks that share one sharded replica (inside a node)"))
        if self.pp > 1:
            rows += [
                ("PP", str(self.pp), "pipeline-parallel degree: ranks holding consecutive blocks (the outermost dim)"),
                ("SCHEDULES", '("gpipe", "1f1b", "interleaved-1f1b")', "pipeline schedules --schedule takes"),
                ("SCHEDULE", '"1f1b"', "the one the planner's bubble (PP - 1) / micro-batches assumes"),
            ]
        if self.meshed:
            rows.append(
                ("TP", str(self.tp), "tensor-parallel degree: ranks that split every layer (the innermost mesh dim)")
            )
        if self.tp > 1:
            rows.append(
                ("SEQUENCE_PARALLEL", str(lay.dims.sp), "split the norms and the residual stream along the sequence")
            )
        rows += [
            ("LR", repr(opts.lr), "learning rate (constant)"),
            ("WEIGHT_DECAY", repr(opts.weight_decay), "decoupled weight decay"),
        ]
        if not self.ds:
            rows.append(("GRAD_CLIP", repr(opts.grad_clip), "max gradient norm (0: measure it, do not clip)"))
        rows += [
            ("CHECKPOINT_DIR", _py_str(opts.checkpoint_dir), "step-<N> folders; a run resumes from the newest"),
            ("STEPS", str(DEFAULT_STEPS), "optimizer steps (not part of the plan)"),
        ]
        out = ["# ---- The plan (jupyter-dist); the command-line flags start from these values ----"]
        for name, value, comment in rows:
            line = f"{name} = {value}  # {_doc_safe(comment)}"
            out.append(line if len(line) <= 120 else f"{name} = {value}  # noqa: E501")
        return "\n".join(out)

    def arguments(self) -> str:
        strategy = _ARGS_DEEPSPEED if self.ds else _ARGS_TORCH
        if self.pp > 1:
            strategy = _lines(strategy.strip("\n"), _ARGS_PIPELINE.strip("\n"))
        return _fill(_ARGS, strategy_args=strategy)

    def setup(self) -> str:
        if self.ds:
            self.use("deepspeed")
            return _fill(
                _SETUP, who="the launcher",
                init_nccl='deepspeed.init_distributed(dist_backend="nccl")',
                init_gloo='deepspeed.init_distributed(dist_backend="gloo")',
            )  # fmt: skip
        return _fill(
            _SETUP, who="torchrun", init_nccl='dist.init_process_group("nccl", device_id=device)',
            init_gloo='dist.init_process_group("gloo")',
        )  # fmt: skip

    def checkpoint_helper(self) -> str:
        """The torch.utils.checkpoint helper (DDP, FSDP2, DeepSpeed); FSDP1 uses apply_activation_checkpointing."""
        if self.lay.checkpointing is Checkpointing.NONE:
            return ""
        if self.family == "fsdp":
            return self._op_sac()
        self.use("functools")
        self.use_from("typing", "Any")
        self.use_from("torch.utils.checkpoint", "checkpoint")
        op = self._op_sac()
        return _fill(_CHECKPOINT_ACTIVATIONS) + (f"\n\n\n{op}" if op else "")

    def _op_sac(self) -> str:
        if self.lay.checkpointing is not Checkpointing.OP:
            return ""
        self.use_from("collections", "defaultdict")
        self.use_from("typing", "Any")
        self.use_from("torch.utils.checkpoint", "CheckpointPolicy", "create_selective_checkpoint_contexts")
        return _fill(_OP_SAC)

    def activation_checkpointing(self) -> str:
        """The call that applies the plan's activation checkpointing to ``model`` (the names of AC_NAMES)."""
        mode = self.lay.checkpointing
        if mode is Checkpointing.NONE:
            return ""
        every = self.lay.plan.training.checkpoint_every if mode is Checkpointing.LAYER else 1
        cls, extra = "BLOCK_CLASS", ""
        if mode is Checkpointing.FULL:
            what = "full: keep each block's input, recompute the block in backward"
        elif mode is Checkpointing.LAYER:
            what, extra = f"layer:{every}: recompute every {every}-th block whole", f", every={every}"
        elif mode is Checkpointing.OP:
            what = "op: keep attention + every other matmul"
            extra = ", context_fn=op_sac_context"
        else:
            cls, what = "ATTENTION_CLASS", "selective: recompute the attention in backward, keep the rest"
        if self.family == "fsdp":
            self.use_from(_FSDP1_AC, "apply_activation_checkpointing")
            check = f"lambda module: isinstance(module, {cls})"
            wrapper = ""
            if mode is Checkpointing.LAYER:
                self.use("itertools")
                check = f"lambda module: isinstance(module, {cls}) and next(count) % {every} == 0"
            elif mode is Checkpointing.OP:
                self.use("functools")
                self.use_from(_FSDP1_AC, "checkpoint_wrapper")
                self.use_from("typing", "Any")
                self.use_from("torch.utils.checkpoint", "CheckpointPolicy", "create_selective_checkpoint_contexts")
                self.use_from("collections", "defaultdict")
                wrapper = "checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, context_fn=op_sac_context),"
            return _lines(
                f"# activation checkpointing, {what}",
                *(["count = itertools.count(1)  # the blocks in order"] if mode is Checkpointing.LAYER else []),
                "apply_activation_checkpointing(",
                "    model,",
                *([f"    {wrapper}"] if wrapper else []),
                f"    check_fn={check},",
                ")",
            )
        return f"checkpoint_activations(model, {cls}{extra})  # {what}"

    def _precision_comment(self) -> str:
        return (
            f"# {self.precision.value}: compute in {self.precision.compute_dtype}; reduce gradients and keep "
            "the master weights in fp32"
        )

    def parallelize(self) -> str:
        ac = self.activation_checkpointing()
        if self.family == "ddp":
            self.use_from("torch.nn.parallel", "DistributedDataParallel")
            to_dtype = ", dtype=torch.bfloat16" if self.precision is Precision.BF16_TRUE else ""
            return _fill(_PARALLELIZE_DDP, to_dtype=to_dtype, activation_checkpointing=ac)
        if self.family == "fsdp":
            self.use("functools")
            self.use_from("torch.distributed.fsdp", "FullyShardedDataParallel as FSDP", "ShardingStrategy")
            self.use_from("torch.distributed.fsdp.wrap", "transformer_auto_wrap_policy")
            precision, mixed = "", "None"
            if self.precision is Precision.BF16_TRUE:
                precision = "model = model.to(torch.bfloat16)  # bf16-true: no fp32 master copy"
            elif self.mixed:
                self.use_from("torch.distributed.fsdp", "MixedPrecision")
                precision = _lines(
                    self._precision_comment(),
                    "mixed_precision = MixedPrecision(",
                    f"    param_dtype={self.compute_dtype}, reduce_dtype=torch.float32, "
                    f"buffer_dtype={self.compute_dtype}",
                    ")",
                )
                mixed = "mixed_precision"
            mesh, device_mesh = "", ""
            if self.lay.strategy.hybrid:
                self.use_from("torch.distributed.device_mesh", "init_device_mesh")
                mesh = _fill(_HYBRID_MESH, what="HYBRID_SHARD: shard inside each group, replicate across groups",
                             names='("replicate", "shard")')  # fmt: skip
                device_mesh = "device_mesh=mesh,"
            return _fill(
                _PARALLELIZE_FSDP, sharding=FSDP1_SHARDING[self.lay.strategy.name], precision=precision, mesh=mesh,
                mixed_precision=mixed, device_mesh=device_mesh, activation_checkpointing=ac,
            )  # fmt: skip
        if self.family == "fsdp2" and self.meshed:
            return self._parallelize_mesh(ac)
        if self.family == "fsdp2":
            self.use_from("torch.distributed.device_mesh", "init_device_mesh")
            self.use_from("torch.distributed.fsdp", "fully_shard")
            if self.lay.strategy.hybrid:
                mesh = _fill(_HYBRID_MESH, what="HSDP: a 2-D mesh, shard along dp_shard, replicate along dp_replicate",
                             names='("dp_replicate", "dp_shard")')  # fmt: skip
            else:
                mesh = 'mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp_shard",))'
            precision, policy = "", ""
            if self.precision is Precision.BF16_TRUE:
                precision = "model = model.to(torch.bfloat16)  # bf16-true: no fp32 master copy"
            elif self.mixed:
                self.use_from("torch.distributed.fsdp", "MixedPrecisionPolicy")
                precision = _lines(
                    self._precision_comment(),
                    f"mp_policy = MixedPrecisionPolicy(param_dtype={self.compute_dtype}, reduce_dtype=torch.float32)",
                )
                policy = ", mp_policy=mp_policy"
            return _fill(_PARALLELIZE_FSDP2, mesh=mesh, precision=precision, policy=policy,
                         activation_checkpointing=ac)  # fmt: skip
        raise RenderError(f"no parallelize section for strategy family {self.family!r}")  # pragma: no cover

    def _fsdp2_precision(self) -> tuple[str, str, str]:
        """(what to do to the whole model first, the mixed-precision policy's lines, the fully_shard argument)."""
        if self.precision is Precision.BF16_TRUE:
            return "model = model.to(torch.bfloat16)  # bf16-true: no fp32 master copy", "", ""
        if self.mixed:
            self.use_from("torch.distributed.fsdp", "MixedPrecisionPolicy")
            policy = _lines(
                self._precision_comment(),
                f"mp_policy = MixedPrecisionPolicy(param_dtype={self.compute_dtype}, reduce_dtype=torch.float32)",
            )
            return "", policy, ", mp_policy=mp_policy"
        return "", "", ""

    def tp_plan(self) -> str:
        """The demo model's tensor-parallel layout (tensor-parallel scripts only)."""
        if self.tp == 1:
            return ""
        self.use_from("torch.distributed.tensor", "Replicate", "Shard")
        self.use_from("torch.distributed.tensor.parallel", "ColwiseParallel", "ParallelStyle", "PrepareModuleInput",
                      "RowwiseParallel", "SequenceParallel")  # fmt: skip
        if self.pp > 1:
            self.use("fnmatch")
            return _lines(_fill(_TP_PLAN), "", "", _fill(_HELD))
        return _fill(_TP_PLAN)

    def pipeline(self) -> str:
        """Stage split, stage bounds and schedule (pipeline scripts only)."""
        if self.pp == 1:
            return ""
        self.use_from("torch.distributed.pipelining", "PipelineStage", "Schedule1F1B", "ScheduleGPipe",
                      "ScheduleInterleaved1F1B")  # fmt: skip
        return _fill(_PIPELINE)

    def build_mesh(self) -> str:
        """``build_mesh()``: ``([pp,] [dp_replicate,] dp_shard[, tp])``, outermost first (tensor/pipeline scripts)."""
        if not self.meshed:
            return ""
        self.use_from("torch.distributed.device_mesh", "DeviceMesh", "init_device_mesh")
        names: list[str] = []
        sizes: list[str | None] = []  # None: the data-parallel size that fills the rest
        unit: list[str] = []
        what: list[str] = []
        if self.pp > 1:
            names.append("pp")
            sizes.append("PP")
            unit.append("PP")
            what.append(
                "The pipeline stages are the outermost dimension: a stage's ranks are world_size // PP apart (across "
                "nodes, where only the activations between stages travel)."
            )
        if self.lay.strategy.hybrid:
            names += ["dp_replicate", "dp_shard"]
            unit.append("SHARD_GROUP_SIZE")
            sizes += [None, "SHARD_GROUP_SIZE"]
            what.append(
                "Each group of SHARD_GROUP_SIZE replicas shards the model states (dp_shard), the groups hold copies "
                "(dp_replicate)."
            )
        else:
            names.append("dp_shard")
            sizes.append(None)
            what.append("The model states are sharded across the data-parallel replicas (dp_shard).")
        if self.tp > 1:
            names.append("tp")
            sizes.append("TP")
            unit.append("TP")
            what.insert(
                0, "The TP ranks of one model replica are neighbours (inside a node: their per-layer collectives stay "
                "on NVLink)."
            )  # fmt: skip
        product = " * ".join(unit)
        size_exprs = ["world_size // unit" if x is None else x for x in sizes]
        doc = _wrap(" ".join(what), 112)
        return _fill(
            _BUILD_MESH, shape=f"({', '.join(names)})", innermost=", tensor parallelism innermost" * (self.tp > 1),
            what="\n".join(doc), unit=product if len(unit) == 1 else f"({product})",
            unit_what=" x ".join(unit), sizes=", ".join(size_exprs),
            names=", ".join(f'"{n}"' for n in names),
        )  # fmt: skip

    def _parallelize_mesh(self, ac: str) -> str:
        self.use_from("torch.distributed.fsdp", "fully_shard")
        model_first, precision, policy = self._fsdp2_precision()
        if self.lay.strategy.hybrid:
            dims, what = '"dp_replicate", "dp_shard"', "HSDP: shard along dp_shard, replicate along dp_replicate"
        else:
            dims, what = '"dp_shard"', "FSDP2 shards the model states across the data-parallel replicas"
        tensor_parallel = ""
        if self.tp > 1:
            self.use_from("torch.distributed.tensor.parallel", "parallelize_module")
            layout = "held(model, tp_plan(SEQUENCE_PARALLEL))" if self.pp > 1 else "tp_plan(SEQUENCE_PARALLEL)"
            what = "each layer's weights" if self.pp == 1 else "this stage's layers"
            tensor_parallel = _lines(
                f"# split {what} over the tp ranks as tp_plan() says (taken from tp rank 0, so every rank agrees)",
                f'parallelize_module(model, mesh["tp"], {layout})',
            )
        if self.pp > 1 and self.tp > 1:
            doc = "One pipeline stage: tensor parallelism over ``tp``, then FSDP2 over the data-parallel dims."
        elif self.pp > 1:
            doc = "One pipeline stage: FSDP2 over the data-parallel dims, each block and the stage as a root."
        else:
            doc = "Tensor parallelism over ``tp``, then FSDP2 over the data-parallel dims (torchtitan's order)."
        return _fill(_PARALLELIZE_FSDP2_TP, doc=doc, precision_model=model_first, tensor_parallel=tensor_parallel,
                     activation_checkpointing=ac, precision=precision, policy=policy, dp_dims=dims,
                     dp_what=what)  # fmt: skip

    def clip_helper(self) -> str:
        """``clip_grad_norm()`` over DTensor gradients on several meshes (and pipeline stages)."""
        if not self.meshed:
            return ""
        self.use_from("torch.distributed.tensor", "DTensor")
        return _fill(_CLIP_PIPELINE if self.pp > 1 else _CLIP_MESHES)

    def optimizer(self) -> str:
        return _fill(_OPTIMIZERS[self.lay.optimizer])

    def checkpoint_io(self) -> str:
        if self.ds:
            return _fill(_CHECKPOINT_DEEPSPEED)
        self.use("re")
        self.use_as("torch.distributed.checkpoint", "dcp")
        self.use_from("torch.distributed.checkpoint.state_dict", "get_state_dict", "set_state_dict")
        if self.pp > 1:
            self.use_from("torch.distributed.checkpoint.state_dict", "StateDictOptions")
            self.use_from("typing", "Any")
            return _fill(_CHECKPOINT_PIPELINE)
        scaler = {"scaler_param": "", "scaler_state": "", "scaler_load": ""}
        if self.fp16:
            scaler = {
                "scaler_param": f", scaler: {self._scaler_class()}",
                "scaler_state": 'state["scaler"] = scaler.state_dict()',
                "scaler_load": 'scaler.load_state_dict(state["scaler"])',
            }
        return _fill(_CHECKPOINT_DCP, **scaler)

    def _scaler_class(self) -> str:
        if self.family == "ddp":
            return "torch.amp.GradScaler"
        self.use_from("torch.distributed.fsdp.sharded_grad_scaler", "ShardedGradScaler")
        return "ShardedGradScaler"

    def main(self) -> str:
        if self.ds:
            self.use("json")
            return _fill(_MAIN_DEEPSPEED, activation_checkpointing=self.activation_checkpointing())
        fam = self.family
        if self.pp > 1:
            return _fill(_MAIN_PIPELINE, clip=_lines(
                'max_norm = args.grad_clip if args.grad_clip > 0 else float("inf")  # inf: measure, do not clip',
                'grad_norm = clip_grad_norm(models, max_norm, mesh["pp"].get_group())',
            ))  # fmt: skip
        backward = "scaler.scale(loss).backward()" if self.fp16 else "loss.backward()"
        forward = "loss = compute_loss(model, inputs, targets) / args.grad_accum"
        if fam == "ddp" and self.mixed:
            forward = _lines(
                f"with torch.autocast(device.type, dtype={self.compute_dtype}):  # {self.precision.value}",
                "    " + forward,
            )
        if fam in ("ddp", "fsdp"):
            self.use("contextlib")
            verb = "all-reduce" if fam == "ddp" else "reduce-scatter"
            micro = _lines(
                f"# {verb} gradients only after the last micro-step: no_sync() accumulates them locally before",
                "sync = contextlib.nullcontext() if last else model.no_sync()",
                "with sync:",
                *("    " + x for x in forward.split("\n")),
                "    " + backward,
            )
        else:
            micro = _lines(
                "model.set_requires_gradient_sync(last)  # reduce-scatter gradients only after the last micro-step",
                forward,
                backward,
            )
        clip = ['max_norm = args.grad_clip if args.grad_clip > 0 else float("inf")  # inf: measure, do not clip']
        if self.fp16:
            clip.insert(0, "scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones")
        if fam == "fsdp":
            clip.append("grad_norm = model.clip_grad_norm_(max_norm)  # FSDP's own: the norm over all shards")
        elif self.tp > 1:
            clip.append("grad_norm = clip_grad_norm(model, max_norm)")
        else:
            clip.append("grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)")
        if fam == "fsdp2" and self.tp == 1:
            self.use_from("torch.distributed.tensor", "DTensor")
            clip += ["if isinstance(grad_norm, DTensor):", "    grad_norm = grad_norm.full_tensor()"]
        if self.fp16:
            step = _lines("scaler.step(optimizer)  # skipped when a gradient overflowed", "scaler.update()")
            if fam == "ddp":
                scaler = "scaler = torch.amp.GradScaler(device.type)  # fp16: dynamic loss scaling"
            else:
                scaler = f"scaler = {self._scaler_class()}(device=device.type)  # fp16: inf checks on all ranks"
            scaler_arg = ", scaler"
        else:
            step, scaler, scaler_arg = "optimizer.step()", "", ""
        teardown = ""
        if fam == "ddp":
            # measured: without this, 4 of 6 two-rank gloo runs hung at exit (the reducer's destructor joins gloo's
            # worker threads while holding the GIL, and a worker waits for the GIL to free its last tensors)
            teardown = _lines(
                "# DDP's reducer holds the process group: free it first, so that destroy_process_group() tears the",
                "# group down (releasing the GIL), not the reducer's destructor at exit, which can deadlock on gloo",
                "del model, optimizer",
            )
        data: dict[str, str] = {"build": "model = parallelize(build_model(args), device)", "dp_ranks": "",
                                "dp_size": "world_size", "dp_rank": "rank", "describe_mesh": ""}  # fmt: skip
        if self.tp > 1:
            data = {
                "build": _lines("mesh = build_mesh(device)", "model = parallelize(build_model(args), mesh)"),
                "dp_ranks": _lines(
                    "# data parallelism by replica, not by rank: tp is the mesh's innermost dimension, so ranks",
                    "# k*TP .. k*TP+TP-1 hold one model replica together and must all load replica k's batch",
                    "dp_rank, dp_size = rank // TP, world_size // TP",
                ),
                "dp_size": "dp_size", "dp_rank": "dp_rank",
                "describe_mesh": 'print("mesh", " x ".join(f"{n}={s}" for n, s in '
                                 "zip(mesh.mesh_dim_names, mesh.shape, strict=True)))",
            }  # fmt: skip
        return _fill(_MAIN_TORCH, micro_step=micro, clip=_lines(*clip), optimizer_step=step, scaler=scaler,
                     scaler_arg=scaler_arg, teardown=teardown, **data)  # fmt: skip


_NOT_GENERATED = (("cp", "context"), ("ep", "expert"))
_MODEL_PARALLEL = ("fsdp2", "fsdp2-hybrid")


def _check_supported(lay: Layout) -> None:
    dims, name = lay.dims, lay.candidate.name
    mp_names = [c.name for c in lay.plan.candidates if _generates_model_parallel(c.strategy, c.dims)]
    have = f" (this plan has: {', '.join(mp_names[:6])}{', ...' * (len(mp_names) > 6)})" if mp_names else ""
    for dim, what in _NOT_GENERATED:
        if getattr(dims, dim) > 1:
            raise RenderError(
                f"candidate {name}: {what} parallelism ({dim} {getattr(dims, dim)}) is not generated yet; fsdp2 and "
                f"fsdp2-hybrid candidates with tpN and/or ppN are{have}, and the data-parallel ones "
                f"({', '.join(FAMILIES)}); for cp/ep use torchtitan or Megatron-DeepSpeed"
            )
    for dim, what in (("tp", "tensor"), ("pp", "pipeline")):
        if getattr(dims, dim) > 1 and lay.strategy.name not in _MODEL_PARALLEL:
            raise RenderError(
                f"candidate {name}: {what} parallelism is generated with FSDP2 only: fsdp2 or fsdp2-hybrid with "
                f"+tpN (+sp) and/or +ppN{have}; {lay.strategy.name} with {dim} {getattr(dims, dim)} needs "
                "Megatron-DeepSpeed, or compile one of those or a data-parallel candidate "
                "(RenderOptions(candidate=...))"
            )
    if dims.pp > 1 and lay.precision is Precision.FP16_MIXED:
        raise RenderError(
            f"candidate {name}: fp16 loss scaling across pipeline stages is not generated; plan with bf16-mixed, "
            "bf16-true or fp32 (a GPU without bf16: compile a candidate without pp)"
        )
    group = int(lay.settings.get("shard_group_size", lay.gpus_per_node))
    unit = group * dims.tp * dims.pp
    if (dims.tp > 1 or dims.pp > 1) and lay.strategy.hybrid and (group < 1 or lay.world_size % unit):
        raise RenderError(
            f"candidate {name}: the mesh (pp {dims.pp}, dp_replicate, dp_shard {group}, tp {dims.tp}) does not cover "
            f"the {lay.world_size} processes ({lay.nodes} nodes x {lay.gpus_per_node}): pp x shard group x tp must "
            "divide them"
        )
    if lay.strategy.family == "fsdp" and lay.strategy.hybrid and group == 1:
        # measured with torch 2.13 on gloo: on a (2, 1) mesh FSDP1's HYBRID_SHARD gradients differ from every other
        # strategy's (wrong grad norm and loss curve), while on a (2, 2) mesh they agree exactly
        raise RenderError(
            f"candidate {lay.candidate.name} shards over groups of 1 GPU ({lay.gpus_per_node} per node), so "
            "HYBRID_SHARD only replicates, and FSDP1 reduces gradients wrongly on such a mesh; compile fsdp-no-shard, "
            "ddp or fsdp2-hybrid instead"
        )
    if lay.strategy.family not in FAMILIES:  # pragma: no cover - every strategy belongs to one of them
        raise RenderError(f"strategy family {lay.strategy.family!r} has no code generator; valid: {FAMILIES}")


def _generates_model_parallel(strategy: str, dims: ParallelDims) -> bool:
    """Whether the generator writes this combination with tensor and/or pipeline parallelism (FSDP2 or HSDP)."""
    return (dims.tp > 1 or dims.pp > 1) and strategy in _MODEL_PARALLEL and dims.cp == dims.ep == 1


def render_train_script(plan: Plan, opts: RenderOptions | None = None, *, layout: Layout | None = None) -> str:
    """A complete, runnable training script for the plan's chosen candidate (``opts.candidate`` or the best).

    Parameters
    ----------
    plan
        The plan; its candidate is resolved and checked by :func:`~jupyter_dist.render.common.layout_of`.
    opts
        Learning rate, weight decay, clipping, checkpoint folder; the script name and launcher for the launch line.
    layout
        The run's resolved layout when the caller has one (computed once per run); else resolved here.

    Returns
    -------
    str
        Python source using DDP, FSDP (FSDP1), FSDP2 (with tensor and/or pipeline parallelism for
        ``fsdp2(-hybrid)+tpN``, ``+ppN``, ``+tpN+ppM``) or DeepSpeed, per the candidate's strategy family.

    Raises
    ------
    RenderError
        When the candidate uses context or expert parallelism, tensor or pipeline parallelism with anything but
        FSDP2/HSDP, or fp16 with a pipeline (the message names the plan's candidates that can be generated), or when
        :func:`~jupyter_dist.render.common.layout_of` finds nothing consistent to compile.
    """
    opts = opts or RenderOptions()
    lay = layout or layout_of(plan, opts)
    _check_supported(lay)
    s = _Script(lay, opts)
    # the sections first: they record the imports they use
    sections = [s.constants(), _fill(_MODEL), s.tp_plan(), _fill(_MODEL_REST), s.arguments(), s.setup(),
                s.checkpoint_helper(), s.build_mesh(), s.pipeline()]  # fmt: skip
    if not s.ds:
        sections += [s.parallelize(), s.clip_helper()]
    sections += [s.optimizer(), _fill(_MICRO_BATCHES), s.checkpoint_io(), s.main()]
    sections.append('if __name__ == "__main__":\n    main()')
    body = "\n\n\n".join(x for x in sections if x)
    return f"{s.docstring()}\n\n{s.import_block()}\n\n{body}\n"
