"""Model parallelism inside a worker: the device mesh from the plan, tensor/sequence parallelism, FSDP2 on top.

The order of operations follows torchtitan's ``parallelize_llama`` (read, not copied): build one ``DeviceMesh``
whose dimensions are, outermost first, ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp`` (tensor parallelism
innermost, so its per-layer collectives stay inside a node, as the planner assumes); apply the tensor-parallel
layout with ``parallelize_module`` on the ``tp`` dimension; wrap the repeated blocks for activation checkpointing;
then ``fully_shard`` the blocks and the root over the data-parallel dimensions (a 2-D ``(dp_replicate, dp_shard)``
mesh is HSDP). A model built on the meta device is sharded first and only its local shards are materialised.

One piece: the mesh, the layout sources and the order of application are one recipe that a reader follows top to
bottom; pipeline stages live in ``_pipeline.py``. Planned split: the Hugging Face translation (``_torch_style``,
``_hf_plan``, ``_hf_sequence_parallel``) into its own module when expert and context parallelism add theirs.

Where the layout comes from, in order: ``tp_plan=`` given to ``jd.wrap``; a Hugging Face model's own plan
(``config.base_model_tp_plan`` and the head's ``_tp_plan``, strings such as ``"colwise"`` translated to PyTorch's
``ParallelStyle`` objects); a model's ``tp_plan(sequence_parallel=...)`` method (the project's reference
:class:`jupyter_dist.models.Transformer` has one).

Planned split: each further dimension lives in its own module, called from :func:`parallelize` (expert
parallelism in ``_expert.py``); the TP layouts (Hugging Face translation, sequence boundaries) can move out next.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..plan.strategies import get_strategy
from ..plan.training import AC_NAMES
from ._env import WorkerEnv, WorkerError
from ._expert import add_expert_mesh, apply_expert_parallel, shard_experts

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "MESH_DIMS",
    "HF_STYLES",
    "Mesh",
    "build_mesh",
    "resolve_tp_plan",
    "check_tp_divisible",
    "apply_tensor_parallel",
    "apply_activation_checkpointing",
    "materialize",
    "load_pretrained",
]

_log = logging.getLogger("jupyter_dist.worker")

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Mesh dimension names, outermost first (torchtitan's order)."""

HF_STYLES = (
    "colwise", "rowwise", "colwise_rep", "colwise_gather_output", "rowwise_rep", "rowwise_split_input",
    "embedding_rowwise", "sequence_parallel",
)  # fmt: skip
"""Hugging Face tensor-parallel style names that map onto PyTorch's own ``ParallelStyle`` objects."""


@dataclass(frozen=True)
class Mesh:
    """The device mesh of this run and where this rank sits in it."""

    mesh: DeviceMesh
    """The world mesh, dimensions named after :data:`MESH_DIMS` (those of size > 1, and ``dp_shard``)."""
    sizes: dict[str, int]
    """Every dimension of :data:`MESH_DIMS` with its size (1 where the mesh has no such dimension)."""
    dp_size: int
    """Data-parallel replicas (``dp_replicate * dp_shard``): how many different batches one step sees."""
    expert: DeviceMesh | None = None
    """With expert parallelism, the ``(efsdp, ep)`` mesh carved from ``dp_shard x cp`` (see ``_expert.py``)."""

    def __getitem__(self, name: str | tuple[str, ...]) -> DeviceMesh:
        return self.mesh[name]

    @property
    def dp_dims(self) -> tuple[str, ...]:
        """The data-parallel dimensions present in the mesh (for ``fully_shard``)."""
        names = self.mesh.mesh_dim_names or ()
        return tuple(n for n in ("dp_replicate", "dp_shard") if n in names)

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The data-parallel sub-mesh: 1-D ``dp_shard``, or 2-D ``(dp_replicate, dp_shard)`` for HSDP."""
        dims = self.dp_dims
        return self.mesh[dims[0]] if len(dims) == 1 else self.mesh[dims]

    def describe(self) -> str:
        """E.g. ``"dp_shard=2 x tp=2"``."""
        names = self.mesh.mesh_dim_names or ()
        out = " x ".join(f"{n}={self.sizes[n]}" for n in names)
        if self.expert is not None:
            out += f" (experts: efsdp={self.expert['efsdp'].size()} x ep={self.expert['ep'].size()})"
        return out


def build_mesh(env: WorkerEnv, device_type: str) -> Mesh:
    """One ``DeviceMesh`` over the world with the plan's degrees (tp innermost); needs the process group."""
    from torch.distributed.device_mesh import init_device_mesh

    replicate = env.dp_replicate
    if env.strategy != "none" and get_strategy(env.strategy).hybrid and replicate == 1:
        # fsdp2-hybrid started without the launch contract's JD_DP_REPLICATE: shard inside a node, replicate across
        # nodes, counted as the planner and the launch count it
        from ..plan.parallel import ParallelDims

        if env.world_size % env.local_world_size or env.world_size % (env.pp * env.cp * env.tp):
            raise WorkerError(
                f"{env.strategy}: LOCAL_WORLD_SIZE {env.local_world_size} does not divide WORLD_SIZE "
                f"{env.world_size}, or pp x cp x tp ({env.pp * env.cp * env.tp}) does not"
            )
        dims = ParallelDims.from_world(env.world_size, tp=env.tp, pp=env.pp, cp=env.cp)
        replicate = dims.hybrid_replicas(env.local_world_size)
    shard = env.world_size // (env.pp * replicate * env.cp * env.tp)
    sizes = {"pp": env.pp, "dp_replicate": replicate, "dp_shard": shard, "cp": env.cp, "tp": env.tp}
    total = 1
    for v in sizes.values():
        total *= v
    if total != env.world_size:
        raise WorkerError(
            f"the mesh pp={env.pp} x dp_replicate={env.dp_replicate} x dp_shard={env.dp_shard} x cp={env.cp} x "
            f"tp={env.tp} = {total} does not cover the {env.world_size} processes"
        )
    names = tuple(n for n in MESH_DIMS if sizes[n] > 1 or n == "dp_shard")
    mesh = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)
    # this rank's data-parallel index is jd.dp_rank (Runtime.dp_rank), derived from the same row-major layout
    return Mesh(mesh=mesh, sizes=sizes, dp_size=sizes["dp_replicate"] * sizes["dp_shard"])


# ---------------------------------------------------------------------------------------------------------- layouts
class _SequenceBoundary:
    """Factory of a ``ParallelStyle`` that re-lays out a module's hidden-states input along the sequence.

    Hugging Face decoder layers take ``hidden_states`` positionally or by keyword and return a plain tensor; with
    sequence parallelism the stream between layers is split along dim 1, so the first layer splits it
    (``Replicate -> Shard(1)``, no communication) and each attention/MLP gathers it (``Shard(1) -> Replicate``,
    an all-gather whose backward is a reduce-scatter).
    """

    @staticmethod
    def make(src: Any, dst: Any, *, output: bool = False) -> Any:
        """The style; ``output=True`` re-lays out the module's output instead of its input."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel.style import ParallelStyle

        class SequenceBoundary(ParallelStyle):
            def __init__(self) -> None:
                super().__init__()
                self.src, self.dst = src, dst

            def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
                def convert(x: Any) -> Any:
                    import torch as _torch

                    if not isinstance(x, _torch.Tensor) or isinstance(x, DTensor):
                        return x
                    dt = DTensor.from_local(x, device_mesh, (self.src,), run_check=False)
                    return dt.redistribute(device_mesh, (self.dst,)).to_local()

                def hook(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                    if args:
                        return (convert(args[0]), *args[1:]), kwargs
                    if "hidden_states" in kwargs:
                        return args, {**kwargs, "hidden_states": convert(kwargs["hidden_states"])}
                    return None

                def out_hook(_m: Any, _args: Any, out: Any) -> Any:
                    return convert(out) if not isinstance(out, tuple) else (convert(out[0]), *out[1:])

                if output:
                    module.register_forward_hook(out_hook)
                else:
                    module.register_forward_pre_hook(hook, with_kwargs=True)
                return module

            def __repr__(self) -> str:
                return f"SequenceBoundary({self.src} -> {self.dst}{', output' * output})"

        return SequenceBoundary()

    @staticmethod
    def both(first: Any, second: Any) -> Any:
        """One style applying two (a stage of one block splits its input and gathers its output)."""
        from torch.distributed.tensor.parallel.style import ParallelStyle

        class Both(ParallelStyle):
            def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
                return second._apply(first._apply(module, device_mesh), device_mesh)

            def __repr__(self) -> str:
                return f"{first!r} + {second!r}"

        return Both()


def _torch_style(style: Any, where: str) -> Any:
    """A ``ParallelStyle`` from a Hugging Face style name (or the style itself)."""
    if not isinstance(style, str):
        return style
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    key = style.strip().lower()
    table = {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
    }
    if key not in table:
        raise WorkerError(
            f"jd.wrap: tensor-parallel style {style!r} for {where!r} is not supported; valid: {', '.join(HF_STYLES)}, "
            "or a torch.distributed.tensor.parallel ParallelStyle object"
        )
    return table[key]()


def _hf_plan(model: torch.nn.Module) -> dict[str, str] | None:
    """A Hugging Face model's own plan: ``config.base_model_tp_plan`` under the base model's prefix + ``_tp_plan``."""
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if not base:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    plan: dict[str, str] = {}
    has_prefix = bool(prefix) and hasattr(model, prefix) and getattr(model, prefix) is not model
    for key, style in base.items():
        plan[f"{prefix}.{key}" if has_prefix else key] = style
    for key, style in (getattr(model, "_tp_plan", None) or {}).items():
        plan[key] = style
    return plan


def _vocab_parallel_embedding(model: torch.nn.Module, raw: Mapping[str, Any], tp: int) -> str | None:
    """The input embedding's name, to split by vocabulary rows, where the model's own plan leaves it whole.

    Hugging Face's Llama-family plans replicate the token embedding on every tensor-parallel rank; Megatron-LM and
    torchtitan split it by vocabulary (an all-reduce of the looked-up rows), which is what the planner counts. Left
    whole when ``tp`` does not divide the vocabulary or the embedding is tied to the head.
    """
    import torch.nn as nn

    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if not isinstance(emb, nn.Embedding) or emb.num_embeddings % tp:
        return None
    name = next((n for n, m in model.named_modules() if m is emb), None)
    tied = {a for pair in _tied_parameters(model) for a in pair}
    if name is None or name in raw or f"{name}.weight" in tied:
        return None
    return name


def _modules_matching(model: torch.nn.Module, pattern: str) -> list[tuple[str, torch.nn.Module]]:
    """Submodules whose dotted name matches ``pattern`` token by token (``*`` within one name)."""
    tokens = pattern.split(".")
    out = []
    for name, module in model.named_modules():
        parts = name.split(".") if name else []
        if len(parts) == len(tokens) and all(fnmatch.fnmatchcase(p, t) for p, t in zip(parts, tokens, strict=True)):
            out.append((name, module))
    return out


def _hf_sequence_parallel(model: torch.nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """Add sequence parallelism to a Hugging Face decoder's translated plan.

    The residual stream is split along the sequence after the embedding (at the first decoder layer, so the
    model's position ids and causal mask keep the full length); norms become ``SequenceParallel``; the modules whose
    output projection is row-wise (attention, MLP) gather the sequence before and reduce-scatter after; the head
    gathers before its column-wise projection.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from ._strategy import find_blocks

    blocks = find_blocks(model)
    names = {id(m): n for n, m in model.named_modules()}
    if not blocks:
        raise WorkerError("jd.wrap: sequence parallelism needs the model's repeated decoder layers; none were found")
    first = names[id(blocks[0])]
    container = first.rsplit(".", 1)[0]
    out: dict[str, Any] = {}
    for key, style in plan.items():
        if isinstance(style, RowwiseParallel) and key.startswith(container + ".*."):
            style = RowwiseParallel(output_layouts=Shard(1))
            out[key.rsplit(".", 1)[0]] = _SequenceBoundary.make(Shard(1), Replicate())
        out[key] = style
    out[first] = _SequenceBoundary.make(Replicate(), Shard(1))
    block_ids = {id(b) for b in blocks}
    for name, module in model.named_modules():
        if "Norm" not in type(module).__name__ or not name:
            continue
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        parent_mod = model.get_submodule(parent) if parent else model
        if id(parent_mod) in block_ids:
            out[f"{container}.*.{name.rsplit('.', 1)[1]}"] = SequenceParallel(use_local_output=True)
        elif not any(name.startswith(names[id(b)] + ".") for b in blocks):
            out[name] = SequenceParallel(use_local_output=True)
    head = [k for k, s in out.items() if isinstance(s, ColwiseParallel) and not k.startswith(container + ".")]
    for key in head:
        out[key] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    return out


def _hf_stage_sequence_boundaries(stage_plan: Any, plan: dict[str, Any]) -> dict[str, Any]:
    """Under pipeline and sequence parallelism, a Hugging Face model's stream is whole between stages.

    Its forward computes the rotary angles and the causal mask from the length of the hidden states it is given,
    so a stage must receive whole sequences: the last block of every stage but the last gathers its output along
    the sequence, and the first block of every stage but the first splits its input again (no communication). The
    reference model computes its angles inside attention, after the gather, and needs neither.
    """
    from torch.distributed.tensor import Replicate, Shard

    out = dict(plan)

    def add(key: str, style: Any) -> None:  # a block may already split its input (the first) or need both
        out[key] = _SequenceBoundary.both(out[key], style) if key in out else style

    n = len(stage_plan.bounds)
    for i in stage_plan.mine:
        start, end = stage_plan.bounds[i]
        if i > 0:
            add(f"{stage_plan.container}.{start}", _SequenceBoundary.make(Replicate(), Shard(1)))
        if i < n - 1:
            add(f"{stage_plan.container}.{end - 1}", _SequenceBoundary.make(Shard(1), Replicate(), output=True))
    return out


def resolve_tp_plan(model: torch.nn.Module, tp_plan: Mapping[str, Any] | None, *, sequence_parallel: bool,
                    tp: int) -> tuple[dict[str, Any], str]:  # fmt: skip
    """The layout to apply, as ``{module name pattern: ParallelStyle}``, and where it came from (for the log)."""
    kind = type(model).__name__
    if tp_plan is not None:
        if not isinstance(tp_plan, Mapping) or not tp_plan:
            raise WorkerError(
                f"jd.wrap: tp_plan must be a non-empty dict of module name pattern -> style, got {tp_plan!r}"
            )
        plan = {str(k): _torch_style(v, str(k)) for k, v in tp_plan.items()}
        source = "the tp_plan passed to jd.wrap"
        if sequence_parallel and all(not isinstance(v, str) for v in tp_plan.values()):
            _log.warning("jd.wrap: sequence parallelism is on; the tp_plan you passed is applied as given")
        elif sequence_parallel:
            plan = _hf_sequence_parallel(model, plan)
    elif _hf_plan(model) is not None:
        raw = _hf_plan(model) or {}
        plan = {k: _torch_style(v, k) for k, v in raw.items()}
        embed = _vocab_parallel_embedding(model, raw, tp)
        if embed:
            plan[embed] = _torch_style("embedding_rowwise", embed)
        if sequence_parallel:
            plan = _hf_sequence_parallel(model, plan)
        source = f"{kind}'s own Hugging Face tp plan"
    elif callable(getattr(model, "tp_plan", None)):
        plan = dict(model.tp_plan(sequence_parallel=sequence_parallel))
        source = f"{kind}.tp_plan()"
    else:
        raise WorkerError(
            f"jd.wrap: tensor parallelism (tp{tp}) needs a layout for {kind}, which has none; pass "
            "jd.wrap(model, opt, tp_plan={'layers.*.attn.q_proj': 'colwise', 'layers.*.attn.o_proj': 'rowwise', ...}) "
            f"(styles: {', '.join(HF_STYLES)}), or use a Hugging Face model with a base_model_tp_plan or "
            "jupyter_dist.models.Transformer"
        )
    for key in plan:
        if not _modules_matching(model, key):
            raise WorkerError(
                f"jd.wrap: tp_plan key {key!r} matches no submodule of {kind}; keys are module names with * for one "
                "name, e.g. 'layers.*.attention.wq'"
            )
    return plan, source


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0 and d <= 64)


def check_tp_divisible(model: torch.nn.Module, plan: Mapping[str, Any], tp: int) -> None:
    """One line naming the first dimension ``tp`` does not divide (heads, kv heads, features, vocabulary)."""
    import torch.nn as nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    kind = type(model).__name__
    dims: dict[str, int] = {}
    if callable(getattr(model, "tp_dims", None)):
        dims.update(model.tp_dims())
    config = getattr(model, "config", None)
    for label, attr in (("attention heads", "num_attention_heads"), ("kv heads", "num_key_value_heads")):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            dims[label] = value
    for label, value in dims.items():
        if value % tp:
            raise WorkerError(
                f"jd.wrap: tp={tp} does not divide the {label} of {kind} ({value}); use a tp degree among "
                f"{_divisors(value)} (--tp N, or a plan candidate with that degree)"
            )
    for key, style in plan.items():
        for name, module in _modules_matching(model, key):
            if isinstance(module, nn.Linear):
                size, what = (
                    (module.out_features, "output features") if isinstance(style, ColwiseParallel)
                    else (module.in_features, "input features") if isinstance(style, RowwiseParallel) else (0, "")
                )  # fmt: skip
            elif isinstance(module, nn.Embedding):
                size, what = (
                    (module.num_embeddings, "vocabulary rows") if isinstance(style, RowwiseParallel)
                    else (module.embedding_dim, "embedding width") if isinstance(style, ColwiseParallel) else (0, "")
                )  # fmt: skip
            else:
                continue
            if size and size % tp:
                raise WorkerError(
                    f"jd.wrap: tp={tp} does not divide the {what} of {name} ({size}) in {kind}; use a tp degree "
                    f"among {_divisors(size)}, or pass a tp_plan that leaves {name} replicated"
                )


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, Any], *,
                          on_meta: bool) -> None:  # fmt: skip
    """Apply ``parallelize_module`` with the plan.

    Parameters of a real model are taken from tp rank 0 (so every rank starts from the same weights); a meta
    model's are left to be materialised.
    """
    import warnings

    from torch.distributed.tensor.parallel import parallelize_module

    tied = _tied_parameters(model)
    touched = {n for key in plan for n, _ in _modules_matching(model, key)}
    for a, b in tied:
        if any(a.startswith(t + ".") or b.startswith(t + ".") for t in touched):
            raise WorkerError(
                f"jd.wrap: {a} and {b} share one tensor (tied embeddings), which tensor parallelism would untie; "
                "build the model untied (e.g. tie_word_embeddings=False) or pass a tp_plan that leaves both replicated"
            )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*could not be resolved.*")
        parallelize_module(model, tp_mesh, dict(plan), src_data_rank=None if on_meta else 0)


def _tied_parameters(model: torch.nn.Module) -> list[tuple[str, str]]:
    seen: dict[int, str] = {}
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            out.append((seen[id(p)], name))
        else:
            seen[id(p)] = name
    return out


# ------------------------------------------------------------------------------------------------ checkpointing
AC_MODES = AC_NAMES
"""Activation checkpointing modes ``jd.wrap`` applies (``JD_AC``): the planner's names, one table."""

# torchtitan's op-level SAC keeps the outputs of these ops (torchtitan/distributed/activation_checkpoint.py,
# ``_save_list`` / ``_custom_policy``: "Saves output of all compute ops, except every second mm"), plus the CPU
# flash kernel and the math fallback that the CPU runs take, so the same policy is measured here.
_OP_SAC_SAVE = (
    "mm.default", "_scaled_dot_product_efficient_attention.default", "_scaled_dot_product_flash_attention.default",
    "_scaled_dot_product_cudnn_attention.default", "_scaled_dot_product_flash_attention_for_cpu.default",
)  # fmt: skip


def _aten(names: tuple[str, ...]) -> set[Any]:
    import torch

    out = set()
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload, None)
        if op is not None:
            out.add(op)
    return out


def op_sac_context_fn() -> Any:
    """The op-level policy of torchtitan as a ``context_fn``: keep attention and every other ``mm`` output."""
    from collections import defaultdict

    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save, mm = _aten(_OP_SAC_SAVE), torch.ops.aten.mm.default

    def make() -> Any:
        meta: dict[str, int] = defaultdict(int)

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
            if op == mm:
                meta[key] += 1
            keep = op in save and not (op == mm and meta[key] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return make


def checkpoint_attention_core(block: torch.nn.Module) -> torch.nn.Module:
    """Korthikanti's selective recomputation on ``block``: its attention kernel is recomputed in backward.

    Every ``scaled_dot_product_attention`` call in the block's forward runs under non-reentrant
    ``torch.utils.checkpoint``, so backward keeps what it keeps without checkpointing except the kernel's own output
    and log-sum-exp.

    A ``TorchFunctionMode`` entered by forward hooks catches the call wherever the block makes it (the reference
    models' ``attention.core``, Hugging Face's ``sdpa_attention_forward``); the block and its state-dict keys stay
    as they are. PyTorch's op-level SAC with "recompute attention, save the rest" would instead cache *every* op's
    output: measured 1.9x the memory of no checkpointing on a Llama layer (tests/test_memory_measured.py).
    """
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode
    from torch.utils.checkpoint import checkpoint

    class _RecomputeAttention(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention and torch.is_grad_enabled():
                return checkpoint(func, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)
            return func(*args, **kwargs)

    modes: list[TorchFunctionMode] = []

    def enter(_m: Any, _args: Any) -> None:
        mode = _RecomputeAttention()
        mode.__enter__()
        modes.append(mode)

    def leave(_m: Any, _args: Any, _out: Any) -> None:
        if modes:
            modes.pop().__exit__(None, None, None)

    block.register_forward_pre_hook(enter)
    block.register_forward_hook(leave, always_call=True)
    return block


def apply_activation_checkpointing(blocks: list[torch.nn.Module], mode: str) -> list[torch.nn.Module]:
    """Wrap each block for activation checkpointing; returns the wrapped blocks (the caller puts them in place).

    ``full`` recomputes every block in backward; ``layer:K`` every K-th (torchtitan counts blocks from 1 and wraps
    those whose count is a multiple of K); ``op`` is torchtitan's op-level policy (:func:`op_sac_context_fn`);
    ``selective`` is Korthikanti et al. 2022's: the attention kernel alone is recomputed
    (:func:`checkpoint_attention_core`).
    """
    from ..plan.training import Checkpointing, parse_checkpointing

    kind, every = parse_checkpointing(mode, what="JD_AC")
    if kind is Checkpointing.NONE:
        return blocks
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if kind is Checkpointing.FULL:
        return [checkpoint_wrapper(b, preserve_rng_state=False) for b in blocks]
    if kind is Checkpointing.LAYER:
        return [checkpoint_wrapper(b, preserve_rng_state=False) if (i + 1) % every == 0 else b
                for i, b in enumerate(blocks)]  # fmt: skip
    if kind is Checkpointing.OP:
        return [checkpoint_wrapper(b, context_fn=op_sac_context_fn(), preserve_rng_state=False) for b in blocks]
    return [checkpoint_attention_core(b) for b in blocks]


def replace_blocks(model: torch.nn.Module, old: list[torch.nn.Module], new: list[torch.nn.Module]) -> None:
    """Put ``new[i]`` where ``old[i]`` sits in its parent container."""
    import torch.nn as nn

    where = {id(b): i for i, b in enumerate(old)}
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for i, child in enumerate(module):
                if id(child) in where:
                    module[i] = new[where[id(child)]]
        elif isinstance(module, nn.ModuleDict):
            for key, child in module.items():
                if id(child) in where:
                    module[key] = new[where[id(child)]]


# ------------------------------------------------------------------------------------------ meta models, weights
def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Allocate a meta-built (and already sharded) model's local shards on ``device`` and initialise them."""
    import torch

    model.to_empty(device=device)
    if callable(getattr(model, "init_weights", None)) and not _is_hf(model):
        model.init_weights()
        return
    if _is_hf(model):
        for m in model.modules():
            for attr in ("_is_hf_initialized",):
                if hasattr(m, attr):
                    delattr(m, attr)
            for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
                if hasattr(t, "_is_hf_initialized"):
                    delattr(t, "_is_hf_initialized")
        with torch.no_grad():
            model.initialize_weights()
        return
    raise WorkerError(
        f"jd.wrap: {type(model).__name__} was built on the meta device and has no init_weights() to initialise its "
        "shards; give it one, or pass pretrained=DIR to load weights"
    )


def _is_hf(model: torch.nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__)


def load_pretrained(model: torch.nn.Module, path: str) -> int:
    """Load a Hugging Face safetensors checkpoint (a ``save_pretrained`` folder) into the sharded model.

    ``torch.distributed.checkpoint`` with its ``HuggingFaceStorageReader`` reads, on each rank, only the slices of
    each tensor that rank holds. Returns the number of tensors loaded. Tensors the model has and the folder lacks
    are an error naming them (a tied head is fine: it is the embedding).
    """
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    if not os.path.isdir(path):
        raise WorkerError(f"jd.wrap: pretrained={path!r} is not a folder (a save_pretrained output with *.safetensors)")
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    if not files:
        raise WorkerError(f"jd.wrap: pretrained={path!r} holds no *.safetensors file (save with save_pretrained)")
    reader = HuggingFaceStorageReader(path)
    available = set(reader.read_metadata().state_dict_metadata)
    state = get_model_state_dict(model)
    missing = sorted(k for k in state if k not in available)
    tied = {b for a, b in _tied_parameters(model)}
    missing = [k for k in missing if k not in tied]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise WorkerError(f"jd.wrap: pretrained={path!r} lacks {len(missing)} tensor(s) of the model: {shown}")
    state = {k: v for k, v in state.items() if k in available}
    import torch.distributed as dist

    dcp.load(state, storage_reader=HuggingFaceStorageReader(path), no_dist=not dist.is_initialized())
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))
    return len(state)


# ------------------------------------------------------------------------------------------------------ together
def parallelize(env: WorkerEnv, model: torch.nn.Module, optimizer: Any, *, device: torch.device,
                tp_plan: Mapping[str, Any] | None = None, pretrained: str | None = None,
                family: str = "fsdp2") -> tuple[Any, Any, Mesh | None, Any]:  # fmt: skip
    """Apply the plan's model parallelism to ``model``; the order of torchtitan's ``parallelize_llama``.

    Mesh, pipeline stages, tensor parallelism, activation checkpointing, FSDP2 over the data-parallel dims,
    materialisation.
    ``family`` is ``"fsdp2"`` (shard model states over the data-parallel dims) or ``"none"`` (model parallelism
    alone; the data-parallel size must then be 1). Returns the model (under pipeline parallelism: this rank's part
    of it, which keeps the whole model's parameter names and refuses to be called), the optimizer rebuilt over the
    new parameters (``None`` stays ``None``), the mesh, and the :class:`~._pipeline.Pipeline` (or ``None``).
    """
    import torch

    from ._strategy import _mixed, _param_names, find_blocks, rebuild_optimizer

    for dim, issue in ():  # every dimension runs; a new one starts here refused
        if getattr(env, dim) > 1:
            raise WorkerError(
                f"jd.wrap: {issue} parallelism ({dim}{getattr(env, dim)}) cannot run yet in this version; run a "
                f"candidate without it (e.g. fsdp2+tp{env.tp}) or set JD_{dim.upper()}=1"
            )
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):  # one process (family none, tp 1): no mesh to build
        on_meta = any(p.is_meta for p in model.parameters())
        old_names = _param_names(model)
        if on_meta:
            materialize(model, device)
        else:
            model = model.to(device)
        if pretrained is not None:
            load_pretrained(model, pretrained)
        if optimizer is not None:
            optimizer = rebuild_optimizer(optimizer, old_names, model)
        return model, optimizer, None, None
    mesh = build_mesh(env, device.type)
    if env.ep > 1:
        mesh = add_expert_mesh(mesh, env, family=family)
    if family == "none" and mesh.dp_size > 1:
        raise WorkerError(
            f"jd.wrap: {mesh.dp_size} data-parallel replicas with JD_STRATEGY=none; use fsdp2 with model parallelism "
            f"(e.g. fsdp2+tp{env.tp}) or launch {env.world_size // mesh.dp_size} processes"
        )
    on_meta = any(p.is_meta for p in model.parameters())
    old_names = _param_names(model)
    if env.cp > 1:
        from ._context import check_context_parallel

        check_context_parallel(env, model, family)
    plan = source = None
    if env.tp > 1:  # resolved and checked on the whole model, before a pipeline split removes parts of it
        plan, source = resolve_tp_plan(model, tp_plan, sequence_parallel=env.sp, tp=env.tp)
        check_tp_divisible(model, plan, env.tp)
    stage_plan = None
    aux_total = 0
    if env.pp > 1:
        from ._pipeline import aux_layers, prune

        aux_total = len(aux_layers(model))  # the whole model's MoE layers: the balance loss is their mean
        pp_rank = mesh["pp"].get_local_rank()
        stage_plan = prune(model, pp=env.pp, pp_rank=pp_rank, virtual=env.stages_per_rank)
    if env.precision == "bf16-true" and not on_meta:
        model = model.to(torch.bfloat16)
    if not on_meta:
        model = model.to(device)
    if plan is not None:
        if stage_plan is not None:  # the parts this rank dropped are not to be parallelised
            plan = {k: v for k, v in plan.items() if _modules_matching(model, k)}
            if env.sp and stage_plan.hf:
                plan = _hf_stage_sequence_boundaries(stage_plan, plan)
        apply_tensor_parallel(model, mesh["tp"], plan, on_meta=on_meta)
        _log.info("jd.wrap: tensor parallelism tp%d%s from %s", env.tp, " with sequence parallelism" * env.sp, source)
    if env.cp > 1:
        from ._context import apply_context_parallel

        n = apply_context_parallel(model, mesh, device.type)
        _log.info("jd.wrap: context parallelism cp%d over %d attention cores (ring attention)", env.cp, n)
    if env.ep > 1:
        apply_expert_parallel(model, mesh, on_meta=on_meta)
    blocks = find_blocks(model)
    if env.ac != "none" and blocks:
        wrapped = apply_activation_checkpointing(blocks, env.ac)
        replace_blocks(model, blocks, wrapped)
        blocks = wrapped
    views = stage_plan.views(model) if stage_plan is not None else []
    if family == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mixed = _mixed(env.precision)
        mp = MixedPrecisionPolicy(param_dtype=mixed[0], reduce_dtype=mixed[1]) if mixed else MixedPrecisionPolicy()
        if env.cp > 1:
            from ._context import fsdp_mesh

            dp_mesh = fsdp_mesh(mesh)  # cp ranks shard model states with the dp ranks
        else:
            dp_mesh = mesh.dp_mesh
        keep = {"reshard_after_forward": env.reshard_after_forward}
        if env.zero1_as_fsdp2 and env.rank == 0:  # once, in rank 0's log (a notice: the default handler shows it)
            _log.warning(
                "jd.wrap: zero1 with model parallelism runs as FSDP2 with reshard_after_forward=False over the "
                "data-parallel dims (%s): optimizer states and gradients sharded, parameters kept from forward to "
                "backward (at most ZeRO-1's memory; all-gather + reduce-scatter, the volume of its all-reduce)",
                mesh.describe(),
            )
        if env.ep > 1:
            shard_experts(model, mesh, mp, **keep)
        for block in blocks:
            fully_shard(block, mesh=dp_mesh, mp_policy=mp, **keep)
        for _, view in views:  # each stage is an FSDP root of its own (its edge parts are its direct parameters)
            fully_shard(view, mesh=dp_mesh, mp_policy=mp, **keep)
        if not views:
            fully_shard(model, mesh=dp_mesh, mp_policy=mp, **keep)
    if on_meta:
        materialize(model, device)
        if env.precision == "bf16-true":
            model = model.to(torch.bfloat16)
    if pretrained is not None:
        n = load_pretrained(model, pretrained)
        _log.info("jd.wrap: loaded %d tensors from %s, each rank reading its own slices", n, pretrained)
    if optimizer is not None:
        optimizer = rebuild_optimizer(optimizer, old_names, model, pruned=stage_plan is not None)
    pipeline = None
    if views:
        from ._pipeline import Pipeline

        container = stage_plan.container if stage_plan is not None else "layers"
        pipeline = Pipeline(env, views, mesh["pp"].get_group(), device, model=model, container=container,
                            aux_total=aux_total)  # fmt: skip
        if env.cp > 1:  # each stage's forward gets this rank's positions (after the balance-loss carry's pre-hook)
            from ._context import positions_hook

            hook = positions_hook(mesh["cp"], hf=stage_plan is not None and stage_plan.hf)
            for stage in pipeline.stages:
                stage.submod.register_forward_pre_hook(hook, with_kwargs=True)
        _refuse_direct_calls(model, env.pp)
    return model, optimizer, mesh, pipeline


def _refuse_direct_calls(model: torch.nn.Module, pp: int) -> None:
    def forward(*args: Any, **kwargs: Any) -> Any:
        raise WorkerError(
            f"under pipeline parallelism (pp{pp}) the model runs stage by stage over micro-batches: use "
            "loss = jd.train_step(inputs, targets, loss_fn) instead of calling the model"
        )

    model.forward = forward  # type: ignore[method-assign]
