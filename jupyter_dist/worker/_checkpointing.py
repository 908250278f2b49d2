"""Activation checkpointing of a model's repeated blocks, as ``JD_AC`` names it (torch imported lazily).

One module for every caller: ``jd.wrap`` under each strategy (``_strategy.checkpoint_blocks``), the model-parallel
recipe (``_parallel.parallelize``), the generated scripts' twin and the memory benchmarks. The modes are the
planner's (:data:`jupyter_dist.plan.training.AC_NAMES`), so what the plan counts is what runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..plan.training import AC_NAMES

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["AC_MODES", "apply_activation_checkpointing", "checkpoint_attention_core", "op_sac_context_fn",
           "replace_blocks"]  # fmt: skip

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
