"""Tensor and sequence parallelism inside a worker: where the layout comes from, and applying it on the tp dim.

Where the layout comes from, in order: ``tp_plan=`` given to ``jd.wrap``; a Hugging Face model's own plan
(``config.base_model_tp_plan`` and the head's ``_tp_plan``, strings such as ``"colwise"`` translated to PyTorch's
``ParallelStyle`` objects, the token embedding split by vocabulary); a model's ``tp_plan(sequence_parallel=...)``
method (the project's reference :class:`jupyter_dist.models.Transformer` has one). Sequence parallelism adds the
boundaries where the stream is split along the sequence and gathered back (for a Hugging Face model at its first
decoder layer, and around each pipeline stage, whose forward needs the whole sequence for rotary angles and the
mask). :func:`apply_tensor_parallel` runs ``parallelize_module`` on the mesh's tp dimension;
:func:`jupyter_dist.worker._parallel.parallelize` calls it in its order of application.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ._env import WorkerError

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "HF_STYLES", "resolve_tp_plan", "check_tp_divisible", "apply_tensor_parallel", "hf_stage_sequence_boundaries",
    "modules_matching", "tied_parameters",
]  # fmt: skip

_log = logging.getLogger("jupyter_dist.worker")

HF_STYLES = (
    "colwise", "rowwise", "colwise_rep", "colwise_gather_output", "rowwise_rep", "rowwise_split_input",
    "embedding_rowwise", "sequence_parallel",
)  # fmt: skip
"""Hugging Face tensor-parallel style names that map onto PyTorch's own ``ParallelStyle`` objects."""


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
    tied = {a for pair in tied_parameters(model) for a in pair}
    if name is None or name in raw or f"{name}.weight" in tied:
        return None
    return name


def modules_matching(model: torch.nn.Module, pattern: str) -> list[tuple[str, torch.nn.Module]]:
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


def hf_stage_sequence_boundaries(stage_plan: Any, plan: dict[str, Any]) -> dict[str, Any]:
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
        from ._tp_layout import suggest_tp_plan

        derived = suggest_tp_plan(model, tp, sequence_parallel=sequence_parallel)
        if derived.ok:
            return dict(derived.plan), f"the layout derived from {kind}'s structure (jd.suggest_tp_plan)"
        raise WorkerError(
            f"jd.wrap: tensor parallelism (tp{tp}) needs a layout for {derived.reason}; pass "
            "jd.wrap(model, opt, tp_plan={'layers.*.attn.q_proj': 'colwise', 'layers.*.attn.o_proj': 'rowwise', ...}) "
            f"(styles: {', '.join(HF_STYLES)}), or use a Hugging Face model with a base_model_tp_plan or "
            "jupyter_dist.models.Transformer"
        )
    for key in plan:
        if not modules_matching(model, key):
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
        for name, module in modules_matching(model, key):
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

    tied = tied_parameters(model)
    keeps = ("PrepareModuleInput", "PrepareModuleOutput", "HeadLocal")  # styles that leave the weights as they are
    touched = {n for key, s in plan.items() if type(s).__name__ not in keeps for n, _ in modules_matching(model, key)}
    for a, b in tied:
        if any(a.startswith(t + ".") or b.startswith(t + ".") for t in touched):
            raise WorkerError(
                f"jd.wrap: {a} and {b} share one tensor (tied embeddings), which tensor parallelism would untie; "
                "build the model untied (e.g. tie_word_embeddings=False) or pass a tp_plan that leaves both replicated"
            )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*could not be resolved.*")
        parallelize_module(model, tp_mesh, dict(plan), src_data_rank=None if on_meta else 0)


def tied_parameters(model: torch.nn.Module) -> list[tuple[str, str]]:
    seen: dict[int, str] = {}
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            out.append((seen[id(p)], name))
        else:
            seen[id(p)] = name
    return out
