"""Measure a real ``torch.nn.Module`` on the meta device (torch is imported only when this runs)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..errors import MissingDependencyError, PlanInputError

__all__ = ["measure_module", "tp_layout_table", "block_activations", "LAYOUT_FAMILIES"]

LAYOUT_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "mixtral"})
"""Hugging Face ``model_type`` s whose blocks the planner's layout table describes (measured in
tests/test_memory_measured.py); a module of any other family, or without a Hugging Face config, has its
activations measured (:func:`block_activations`)."""


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise MissingDependencyError(
            "measuring an nn.Module needs torch: pip install torch (any build), then retry"
        ) from None
    return torch


def measure_module(cls: Any, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, name: str | None,
                   heads: int | None = None) -> Any:  # fmt: skip
    """Return a ``ModelSpec`` (``cls``) with the exact parameter count of ``module``.

    ``module`` is an ``nn.Module`` instance (any device, including meta), or a class or zero-argument callable
    that builds one (``lambda: GPT(cfg)``); the callable runs under ``torch.device("meta")`` so no weight is
    allocated, and one that fails is refused in one line. ``heads``: the attention heads, where the module's
    structure does not say them (they are asked for, never guessed: see :func:`_infer_dims`).
    """
    torch = _torch()
    nn = torch.nn
    if heads is not None and (not isinstance(heads, int) or isinstance(heads, bool) or heads < 1):
        raise PlanInputError(f"heads must be a positive integer, got {heads!r}")
    if isinstance(module, nn.Module):
        mod = module
    elif callable(module):
        what = getattr(module, "__qualname__", None) or type(module).__name__
        try:
            with torch.device("meta"):
                mod = module(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the user's code: any failure is reported in one line
            why = " ".join(str(exc).split()) or type(exc).__name__
            raise PlanInputError(
                f"building the model with {what}() on the meta device failed: {type(exc).__name__}: {why[:300]}"
            ) from None
        if not isinstance(mod, nn.Module):
            raise PlanInputError(f"{module!r} returned {type(mod).__name__}, not a torch.nn.Module")
    else:
        raise PlanInputError(f"expected an nn.Module or a callable building one, got {type(module).__name__}")

    # parameters() already yields a shared (tied) parameter once; count trainable ones only
    params = [p for p in mod.parameters() if p.requires_grad]
    total = sum(int(p.numel()) for p in params)
    if total == 0:
        raise PlanInputError(f"{type(mod).__name__} has no trainable parameters")
    largest = max((sum(int(p.numel()) for p in m.parameters(recurse=False)) for m in mod.modules()), default=0)
    label = name or type(mod).__name__

    hf_config = getattr(mod, "config", None)
    if hf_config is not None and hasattr(hf_config, "to_dict"):
        try:
            spec = cls.from_hf_config(hf_config.to_dict())
        except PlanInputError:
            pass  # a ``config`` that is not a transformer's Hugging Face config: measure the structure instead
        else:
            family = str(hf_config.to_dict().get("model_type", "")).lower()
            measured = None if family in LAYOUT_FAMILIES else block_activations(mod)
            return spec.with_(name=label, params_override=total, largest_module_override=largest, source="module",
                              needs=module_needs(mod), tp_layout_of=_layout_of(mod),
                              activations_of=measured)  # fmt: skip

    dims = _infer_dims(mod, nn, heads, label)
    assumed = dims.pop("assumed")
    return cls(name=label, params_override=total, largest_module_override=largest, dims_assumed=assumed,
               source="module", needs=module_needs(mod), tp_layout_of=_layout_of(mod),
               activations_of=None if assumed else block_activations(mod), **dims)  # fmt: skip


MAX_MEASURED_BLOCK_BYTES = 1 << 30
"""Largest block (its fp32 weights) made real on the CPU to be measured; a larger one keeps the layout table."""


class _Captured(Exception):
    """Stops the capturing forward once the first block's inputs are seen."""


def block_activations(mod: Any) -> Any:
    """``(micro_batch, seq_len, e) -> bytes`` one block of ``mod`` saves for backward, measured; or ``None``.

    The first repeated block's inputs are captured by one forward of ``(b, s)`` token ids on the module's device
    (the meta device for a model built there); a copy of that block alone is made real on the CPU (its weights
    random where they were meta), cast to the planned dtype (``e`` = 4: fp32, 2: bf16, the precision the block
    runs in), and run on real inputs of the captured shapes under ``torch.autograd.graph.saved_tensors_hooks``:
    the bytes of every storage autograd packs, each once, less the block's parameters and its inputs (the caller
    holds them), as tests/test_memory_measured.py counts. Measured at ``(1, s0)``, ``(1, 2s0)``, ``(1, 4s0)``,
    ``(2, s0)`` and ``(2, 2s0)`` (micro-batch, tokens; ``s0`` = 8), the bytes are fitted exactly (rational
    arithmetic) as ``b·s·A + b·s²·D + s·B + s²·E + C``: per-token tensors, the attention scores of an eager kernel
    (``b·s²``), per-position tables a block builds (rotary) and masks it derives (``s²``), and fixed ones; the
    planner scales that to its micro-batch and sequence.
    ``None`` when the module has no repeated blocks, its block's fp32 weights exceed
    :data:`MAX_MEASURED_BLOCK_BYTES`, or its forward cannot be run on token ids (the planner keeps its layout
    then). Each dtype is measured once per module.
    """
    try:
        from ..worker._strategy import find_blocks
    except ImportError:
        return None
    blocks = find_blocks(mod)
    if not blocks or 4 * sum(int(p.numel()) for p in blocks[0].parameters()) > MAX_MEASURED_BLOCK_BYTES:
        return None
    fits: dict[int, Any] = {}

    def activations(b: int, s: int, e: int) -> int | None:
        if e not in fits:
            try:
                fits[e] = _fit(mod, blocks[0], e)
            except Exception:  # noqa: BLE001 - a forward the planner cannot drive: keep the layout
                fits[e] = None
        fit = fits[e]
        if fit is None:
            return None
        a, d, bb, ee, c = fit
        return int(b * s * a + b * s * s * d + s * bb + s * s * ee + c)

    return activations


def _fit(mod: Any, block: Any, e: int) -> tuple[Any, ...]:
    """``(A, D, B, E, C)`` of ``b·s·A + b·s²·D + s·B + s²·E + C`` from five sizes (see :func:`block_activations`)."""
    from fractions import Fraction

    s0 = 8
    sizes = ((1, s0), (1, 2 * s0), (1, 4 * s0), (2, s0), (2, 2 * s0))
    f11, f12, f14, f21, f22 = (Fraction(_saved_bytes(mod, block, b, s, e)) for b, s in sizes)
    # b = 1: g(s) = s(A + B) + s^2 (D + E) + C at s0, 2s0, 4s0
    de = (f14 - 3 * f12 + 2 * f11) / (6 * s0 * s0)
    ab = (f12 - f11) / s0 - 3 * s0 * de
    c = f11 - s0 * ab - s0 * s0 * de
    # the second sample of the batch: s A + s^2 D at s0 and 2s0
    x1, x2 = f21 - f11, f22 - f12
    d = (x2 - 2 * x1) / (2 * s0 * s0)
    a = (x1 - s0 * s0 * d) / s0
    return a, d, ab - a, de - d, c


def _saved_bytes(mod: Any, block: Any, b: int, s: int, e: int) -> int:
    """Bytes ``block`` saves for backward run alone on the CPU with ``mod``'s inputs to it at ``(b, s)`` tokens."""
    import copy

    torch = _torch()
    dtype = {4: torch.float32, 2: torch.bfloat16}[e]
    param = next(mod.parameters())
    seen_args: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def pre(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen_args.append((args, kwargs))
        raise _Captured

    handle = block.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.no_grad():
            mod(torch.zeros(b, s, dtype=torch.long, device=param.device))
    except _Captured:
        pass
    finally:
        handle.remove()
    if not seen_args:
        raise RuntimeError("the first block was not called")
    args, kwargs = seen_args[0]
    real = copy.deepcopy(block)
    if any(p.is_meta for p in real.parameters()) or any(t.is_meta for t in real.buffers()):
        real = real.to_empty(device="cpu")
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for t in list(real.parameters()) + list(real.buffers()):
                if t.is_floating_point():
                    t.copy_(torch.randn(t.shape, generator=gen) * 0.02)
                else:
                    t.zero_()
    real = real.to(device="cpu", dtype=dtype)
    real.train()
    gen = torch.Generator().manual_seed(0)
    inputs: list[Any] = []

    def make(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x.is_floating_point():
                t = torch.randn(x.shape, generator=gen).to(dtype)
                if x.dim() >= 2 and x.shape[-1] == _width(block):
                    t.requires_grad_(True)  # the hidden states: what backward flows into
            elif x.dtype == torch.bool:
                t = torch.ones(x.shape, dtype=torch.bool)
            else:
                t = torch.zeros(x.shape, dtype=x.dtype)
            inputs.append(t)
            return t
        if isinstance(x, tuple):
            return tuple(make(y) for y in x)
        if isinstance(x, list):
            return [make(y) for y in x]
        if isinstance(x, dict):
            return {k: make(v) for k, v in x.items()}
        return x

    real_args, real_kwargs = make(args), make(kwargs)
    from torch.autograd.graph import saved_tensors_hooks

    held = {p.untyped_storage().data_ptr() for p in real.parameters()}
    held |= {t.untyped_storage().data_ptr() for t in real.buffers()}
    held |= {t.untyped_storage().data_ptr() for t in inputs}
    seen: dict[int, int] = {}

    def pack(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key and key not in held and key not in seen:
                seen[key] = int(storage.nbytes())
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        out = real(*real_args, **real_kwargs)
    del out
    return sum(seen.values())


def _width(block: Any) -> int:
    """The residual width of ``block``: the most common input width of its linear layers (0 if none)."""
    nn = _torch().nn
    widths = [m.in_features for m in block.modules() if isinstance(m, nn.Linear)]
    return Counter(widths).most_common(1)[0][0] if widths else 0


def _layout_of(mod: Any) -> Any:
    """``(tp, sp) -> TpLayoutTable | None`` for ``mod`` (see :func:`tp_layout_table`), each derived once.

    The plan measures a module once, and the wizard asks again on every change (its what-if tables, per value).
    """
    known: dict[tuple[int, bool], Any] = {}

    def layout_of(tp: int, sp: bool) -> Any:
        key = (int(tp), bool(sp))
        if key not in known:
            known[key] = tp_layout_table(mod, *key)
        return known[key]

    return layout_of


def tp_layout_table(mod: Any, tp: int, sp: bool) -> Any:
    """The layout ``jd.wrap`` derives for ``mod`` at ``tp`` (``sp``: with sequence parallelism) as plan data.

    ``worker/_tp_layout.py``'s ``suggest_tp_plan`` on the meta device, its rows as strings (module pattern, style,
    why), or its one-line reason. ``None`` where ``jd.wrap`` would not use a derived layout (a Hugging Face tp plan,
    a ``tp_plan()`` method) or the worker cannot be imported.
    """
    from .tp_table import TpLayoutTable

    config = getattr(mod, "config", None)
    if getattr(config, "base_model_tp_plan", None) or callable(getattr(mod, "tp_plan", None)):
        return None
    try:
        from ..worker._tp_layout import suggest_tp_plan
    except ImportError:
        return None
    got = suggest_tp_plan(mod, tp, sequence_parallel=sp)
    return TpLayoutTable(model=type(mod).__name__, tp=tp, sp=sp, rows=tuple(got.rows()), notes=tuple(got.notes),
                         reason=got.reason)  # fmt: skip


def module_needs(mod: Any) -> tuple[tuple[str, str], ...]:
    """What ``mod`` cannot run as it is: ``(dim, reason)`` for pipeline and tensor parallelism.

    Pipelines: the worker's own check (:func:`jupyter_dist.worker._pipeline.pipeline_problem`: a block list its
    forward loops over, found and checked by one forward on the module's device). Tensor parallelism: the derived
    layout's verdict (``worker/_tp_layout.py``'s ``suggest_tp_plan``, structure only: the heads' divisibility by
    each degree is the planner's check); without it a Hugging Face tp plan, a ``tp_plan()`` method, or blocks
    holding ``nn.Linear`` layers.
    """
    from ..worker._pipeline import pipeline_problem

    out: list[tuple[str, str]] = []
    pp = pipeline_problem(mod)
    if pp:
        out.append(("pp", pp))
    tp = _tp_problem(mod)
    if tp:
        out.append(("tp", tp))
    return tuple(out)


def _tp_problem(mod: Any) -> str | None:
    """Why tensor parallelism cannot lay ``mod`` out, or ``None`` (see :func:`module_needs`)."""
    try:  # the derived layout (issue 32): its one-line reason where it cannot lay the module out
        from ..worker._tp_layout import suggest_tp_plan
    except ImportError:
        pass
    else:
        reason = getattr(suggest_tp_plan(mod), "reason", None)
        return str(reason) if reason else None
    nn = _torch().nn
    config = getattr(mod, "config", None)
    if getattr(config, "base_model_tp_plan", None) or callable(getattr(mod, "tp_plan", None)):
        return None
    from ..worker._strategy import find_blocks

    blocks = find_blocks(mod)
    if blocks and any(isinstance(m, nn.Linear) for m in blocks[0].modules()):
        return None
    return (f"tensor parallelism needs blocks holding nn.Linear layers to split; {type(mod).__name__} has "
            f"{'no repeated blocks' if not blocks else 'none in its blocks'}")  # fmt: skip


def _infer_dims(mod: Any, nn: Any, given_heads: int | None = None, label: str = "") -> dict[str, Any]:
    """Infer layers / hidden / heads / ffn / vocab from the module tree (documented heuristics).

    The heads come from ``given_heads``, an ``nn.MultiheadAttention``, a heads attribute (``n_head``,
    ``num_heads``, ...) of a block's module or of a ``config`` object it holds (nanoGPT keeps ``self.config``), or a
    list of per-head modules (each projecting ``hidden`` to ``hidden / n``); a model with an embedding and blocks of
    layers whose heads none of these give is refused in one line naming ``heads=`` (a width guess once planned 32
    heads for a 16-head model of width 2048). Only a module without that structure (no embedding, or blocks that are
    single layers: no attention to read) keeps an assumed shape, marked ``dims_assumed`` and warned about.
    """
    # layers: the ModuleList, ModuleDict (keyed by layer index, as pipeline-friendly models are) or Sequential of one
    # child type that holds the most parameters (the transformer blocks). Not the longest one: a MoE block's list of
    # experts can be longer than the list of blocks (64 experts, 27 layers), and so can a block's list of heads.
    layers, block, most = 1, None, 0
    for m in mod.modules():
        children = list(m.values()) if isinstance(m, nn.ModuleDict) else list(m) if isinstance(
            m, (nn.ModuleList, nn.Sequential)) else []  # fmt: skip
        if children and len({type(c) for c in children}) == 1:
            n = sum(int(p.numel()) for p in m.parameters())
            if n > most:
                layers, block, most = len(children), children[0], n
    embeddings = [m for m in mod.modules() if isinstance(m, nn.Embedding)]
    # the token embedding: the one an output projection maps back to (else the largest); a learned position table
    # can have more rows than a small vocabulary (65 characters, 256 positions)
    projections = {(m.in_features, m.out_features) for m in mod.modules() if isinstance(m, nn.Linear)}
    matched = [e for e in embeddings if (e.embedding_dim, e.num_embeddings) in projections]
    token = max(matched or embeddings, key=lambda e: e.num_embeddings) if embeddings else None
    vocab = token.num_embeddings if token is not None else 0
    hidden = token.embedding_dim if token is not None else 0
    linears = [m for m in (block or mod).modules() if isinstance(m, nn.Linear)]
    if not hidden and linears:
        hidden = Counter(lin.in_features for lin in linears).most_common(1)[0][0]
    assumed = not (block is not None and embeddings)
    if not hidden:
        raise PlanInputError(
            f"cannot find the width of {type(mod).__name__}: it has no nn.Embedding or nn.Linear; "
            "pass hidden=... and layers=... to ModelSpec instead"
        )
    ffn = max((lin.out_features for lin in linears if lin.in_features == hidden), default=4 * hidden)
    heads = given_heads or _find_heads(block or mod, nn, hidden)
    if given_heads and hidden % given_heads:
        raise PlanInputError(f"heads={given_heads} does not divide the width of {label or type(mod).__name__} "
                             f"({hidden})")  # fmt: skip
    kv_heads = 0
    if heads:
        kv_heads = _int_attr(block or mod, ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_kv_head"))
        if kv_heads and (kv_heads > heads or heads % kv_heads):
            kv_heads = 0
    if not heads and block is not None and embeddings and any(True for _ in block.children()):
        raise PlanInputError(
            f"cannot find the attention heads of {label or type(mod).__name__} (width {hidden}): pass heads=N "
            "(jupyter_dist.plan(model, heads=N), %dist_plan/jupyter-dist plan --module ... --heads N)"
        )
    if not heads:  # no blocks of layers after an embedding: no attention to read; the shape is assumed (and said so)
        heads = max(1, hidden // 64) if hidden % 64 == 0 else 1
        assumed = True
    gated = sum(1 for lin in linears if lin.in_features == hidden and lin.out_features == ffn) >= 2
    # MoE: a list of identical MLPs inside a block (the experts; not a list of attention heads, whose linear
    # layers do not widen to ffn); top-k from the router's attribute
    experts, top_k = 1, 1
    if block is not None:
        for m in block.modules():
            if (
                isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(c) for c in m}) == 1
                and any(isinstance(x, nn.Linear) and x.in_features == hidden and x.out_features == ffn
                        for x in m[0].modules())
            ):  # fmt: skip
                experts = len(m)
                break
    grouped = _grouped_experts(block, hidden) if block is not None and experts == 1 else None
    if grouped:
        experts, ffn, gated = grouped
    if experts > 1:
        top_k = _int_attr(block, ("num_experts_per_tok", "top_k", "topk", "moe_topk", "n_activated_experts"))
        if not 1 <= top_k <= experts:
            top_k, assumed = 1, True
    # tied: the output projection's weight is the token embedding's (parameters() yields it once)
    tied = token is not None and any(lin.weight is token.weight for lin in mod.modules() if isinstance(lin, nn.Linear))
    norm = "layernorm" if any(isinstance(m, nn.LayerNorm) for m in (block or mod).modules()) else "rmsnorm"
    return {
        "layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads if kv_heads != heads else 0,
        "ffn": ffn if ffn != hidden else 4 * hidden, "vocab": vocab or 32000, "gated_mlp": gated,
        "experts": experts, "top_k": top_k, "tied_embeddings": tied, "norm": norm, "assumed": assumed,
    }  # fmt: skip


_HEAD_ATTRS = ("num_heads", "n_head", "num_attention_heads", "n_heads")


def _find_heads(root: Any, nn: Any, hidden: int) -> int:
    """The attention heads ``root``'s structure states, or 0 (see :func:`_infer_dims`)."""
    for m in root.modules():
        if isinstance(m, nn.MultiheadAttention):
            return int(m.num_heads)
        for holder in (m, getattr(m, "config", None)):
            for attr in _HEAD_ATTRS:
                value = getattr(holder, attr, None) if holder is not None else None
                if isinstance(value, int) and not isinstance(value, bool) and value > 0 and hidden % value == 0:
                    return value
    for m in root.modules():  # a list of per-head modules, each projecting hidden to hidden / n
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(c) for c in m}) == 1 and hidden % len(m) == 0:
            lins = [x for x in m[0].modules() if isinstance(x, nn.Linear)]
            if lins and all(x.in_features == hidden and x.out_features == hidden // len(m) for x in lins):
                return len(m)
    return 0


def _grouped_experts(block: Any, hidden: int) -> tuple[int, int, bool] | None:
    """``(experts, ffn, gated)`` of experts stored as grouped 3-D parameters, or ``None``.

    torchtitan, transformers 5 (Mixtral, Qwen-MoE) and :class:`jupyter_dist.models.MoETransformer` keep a block's
    experts as a few ``(experts, a, b)`` tensors with one of ``a``, ``b`` the hidden size (expert parallelism splits
    them along dim 0): the module whose own parameters are all such tensors, with one leading size above 1. The
    expert width is the other size (the smallest, so a fused gate-and-up projection of ``2 * ffn`` reads as ``ffn``);
    the MLP is gated when one expert holds ``3 * hidden * ffn`` weights.
    """
    for m in block.modules():
        ps = list(m.parameters(recurse=False))
        if len(ps) < 2 or any(p.dim() != 3 or hidden not in p.shape[1:] for p in ps):
            continue
        n = {int(p.shape[0]) for p in ps}
        if len(n) != 1 or min(n) < 2:
            continue
        experts = n.pop()
        others = [int(d) for p in ps for d in p.shape[1:] if d != hidden] or [hidden]
        ffn = min(others)
        per_expert = sum(int(p.numel()) for p in ps) // experts
        return experts, ffn, per_expert >= 3 * hidden * ffn
    return None


def _int_attr(root: Any, names: tuple[str, ...]) -> int:
    """The first positive integer attribute among ``names`` on ``root`` or its submodules (0 if none)."""
    for m in root.modules():
        for attr in names:
            value = getattr(m, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 0
