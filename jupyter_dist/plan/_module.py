"""Measure a real ``torch.nn.Module`` on the meta device (torch is imported only when this runs)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..errors import MissingDependencyError, PlanInputError

__all__ = ["measure_module"]


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise MissingDependencyError(
            "measuring an nn.Module needs torch: pip install torch (any build), then retry"
        ) from None
    return torch


def measure_module(cls: Any, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, name: str | None) -> Any:
    """Return a ``ModelSpec`` (``cls``) with the exact parameter count of ``module``.

    ``module`` is an ``nn.Module`` instance (any device, including meta), or a callable that builds one; the
    callable runs under ``torch.device("meta")`` so no weight is allocated.
    """
    torch = _torch()
    nn = torch.nn
    if isinstance(module, nn.Module):
        mod = module
    elif callable(module):
        with torch.device("meta"):
            mod = module(*args, **kwargs)
        if not isinstance(mod, nn.Module):
            raise PlanInputError(f"{module!r} returned {type(mod).__name__}, not a torch.nn.Module")
    else:
        raise PlanInputError(f"expected an nn.Module or a callable building one, got {type(module).__name__}")

    # parameters() already yields a shared (tied) parameter once; count trainable ones only
    params = [p for p in mod.parameters() if p.requires_grad]
    total = sum(int(p.numel()) for p in params)
    if total == 0:
        raise PlanInputError(f"{type(mod).__name__} has no trainable parameters")
    largest = max(
        (sum(int(p.numel()) for p in m.parameters(recurse=False)) for m in mod.modules()), default=0
    )
    label = name or type(mod).__name__

    hf_config = getattr(mod, "config", None)
    if hf_config is not None and hasattr(hf_config, "to_dict"):
        spec = cls.from_hf_config(hf_config.to_dict())
        return spec.with_(name=label, params_override=total, largest_module_override=largest, source="module")

    dims = _infer_dims(mod, nn)
    assumed = dims.pop("assumed")
    return cls(name=label, params_override=total, largest_module_override=largest, dims_assumed=assumed,
               source="module", **dims)  # fmt: skip


def _infer_dims(mod: Any, nn: Any) -> dict[str, Any]:
    """Guess layers / hidden / heads / ffn / vocab from the module tree (documented heuristics)."""
    # layers: the longest ModuleList whose children share one type (the transformer blocks)
    layers, block = 1, None
    for m in mod.modules():
        if isinstance(m, nn.ModuleList) and len(m) > layers:
            kinds = Counter(type(c) for c in m)
            if len(kinds) == 1:
                layers, block = len(m), m[0]
    embeddings = [m for m in mod.modules() if isinstance(m, nn.Embedding)]
    vocab = max((e.num_embeddings for e in embeddings), default=0)
    hidden = 0
    if embeddings:
        hidden = max(embeddings, key=lambda e: e.num_embeddings).embedding_dim
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
    heads = 0
    for m in (block or mod).modules():
        if isinstance(m, nn.MultiheadAttention):
            heads = m.num_heads
            break
        for attr in ("num_heads", "n_head", "num_attention_heads", "n_heads"):
            value = getattr(m, attr, None)
            if isinstance(value, int) and value > 0 and hidden % value == 0:
                heads = value
                break
        if heads:
            break
    if not heads:
        heads = max(1, hidden // 64) if hidden % 64 == 0 else 1
        assumed = True
    gated = sum(1 for lin in linears if lin.in_features == hidden and lin.out_features == ffn) >= 2
    return {
        "layers": layers, "hidden": hidden, "heads": heads, "ffn": ffn if ffn != hidden else 4 * hidden,
        "vocab": vocab or 32000, "gated_mlp": gated, "assumed": assumed,
    }  # fmt: skip
