"""Execution speed where it is safe (issue 31): the fused optimizer and regional compilation of the repeated blocks.

Both are on by default on CUDA and off elsewhere (``JD_FUSED`` / ``JD_COMPILE``: ``auto``, ``1`` forces on, ``0``
off), and each says what it did once, in rank 0's log.

* :func:`fuse_optimizer`: a ``torch.optim.Adam``/``AdamW``/``SGD`` whose implementation the user left to torch
  (``foreach`` and ``fused`` unset) steps with its fused kernel: the same update, one kernel per parameter group.
  The switch is made in place (each param group's ``fused`` flag, as torch's constructor sets it), so the optimizer
  object and its param-group dicts stay the ones an LR scheduler may already drive; it must not have stepped yet.
* :func:`compile_blocks`: ``torch.compile`` of each repeated block (``_strategy.find_blocks``'s blocks, as
  activation checkpointing and FSDP2 units see them), torchtitan's regional compilation (its ``apply_compile``:
  per block, after tensor parallelism and activation checkpointing, before ``fully_shard``), in place with
  ``Module.compile`` so parameter names do not change. A block whose compilation fails (at wrap or at its first
  call, where its backward is compiled with its forward) runs eager from then on, every block with it, and rank 0's
  log says so in one line naming the error.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ._env import WorkerEnv, WorkerError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["FUSABLE", "fuse_optimizer", "compile_blocks", "CompiledBlocks", "speed_on"]

_log = logging.getLogger("jupyter_dist.worker")

FUSABLE = ("Adam", "AdamW", "SGD")
"""The ``torch.optim`` classes switched to their fused implementation (the same math in one kernel)."""


def speed_on(value: str, device: torch.device) -> bool:
    """``JD_FUSED``/``JD_COMPILE``'s value on ``device``: ``1`` on, ``0`` off, ``auto`` on CUDA only."""
    return value == "1" or (value == "auto" and device.type == "cuda")


def fuse_optimizer(env: WorkerEnv, optimizer: Any, device: torch.device) -> bool:
    """Switch a torch Adam/AdamW/SGD to ``fused=True`` in place when ``JD_FUSED`` asks; whether it did.

    Left as it is: another class (a subclass too), an optimizer whose ``foreach`` or ``fused`` the user set, one with
    ``differentiable=True``, or parameters that are not floating point.
    """
    import torch

    if optimizer is None or not speed_on(env.fused, device):
        return False
    cls = type(optimizer)
    if cls not in tuple(getattr(torch.optim, n) for n in FUSABLE):
        return False
    groups = optimizer.param_groups
    if any(g.get("foreach") is not None or g.get("fused") or g.get("differentiable") for g in groups):
        return False  # the user chose an implementation (or one fused cannot run)
    if any(not p.is_floating_point() for g in groups for p in g["params"]):
        return False
    if optimizer.state:
        raise WorkerError(
            f"jd.wrap: the {cls.__name__} already has state (a step was taken); call jd.wrap(model, optimizer) "
            "before the first optimizer.step(), or set JD_FUSED=0"
        )
    for group in groups:
        group["fused"] = True
        group["foreach"] = None
    optimizer.defaults["fused"] = True
    optimizer._step_supports_amp_scaling = True  # as the constructor sets it with fused=True (GradScaler unscales)
    if cls.__name__ == "SGD":
        optimizer._need_device_dtype_check_for_fused = True
    if env.rank == 0:
        _log.warning("jd.wrap: torch.optim.%s steps with its fused implementation (the same update in one kernel; "
                     "--no-fused or JD_FUSED=0 keeps the default)", cls.__name__)  # fmt: skip
    return True


class CompiledBlocks:
    """The blocks compiled in place and the one switch back to eager (shared by all of them)."""

    def __init__(self, env: WorkerEnv) -> None:
        self.env = env
        self.blocks: list[Any] = []
        self.failed: BaseException | None = None
        """The error that turned compilation off (``None``: the blocks run compiled)."""

    def fall_back(self, error: BaseException) -> None:
        """Every block runs eager from now on; one line in rank 0's log names the error."""
        if self.failed is not None:
            return
        self.failed = error
        for block in self.blocks:
            block._compiled_call_impl = None
        if self.env.rank == 0:
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            _log.warning("jd.wrap: torch.compile of the blocks failed (%s: %s); they run eager",
                         type(error).__name__, first[:300])  # fmt: skip

    def _guard(self, block: Any, compiled: Any) -> Any:
        import torch._functorch.config as aot_config

        ran: list[bool] = []

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.failed is not None:
                return block._call_impl(*args, **kwargs)
            try:
                if ran:
                    return compiled(*args, **kwargs)
                # the first call compiles the backward too (AOTAutograd otherwise lowers it lazily, at the first
                # backward, where a failure could not fall back): any compiler error surfaces here
                with aot_config.patch(force_non_lazy_backward_lowering=True):
                    out = compiled(*args, **kwargs)
                ran.append(True)
                return out
            except Exception as e:  # noqa: BLE001 - any compiler error: eager is the same math
                self.fall_back(e)
                return block._call_impl(*args, **kwargs)

        return call


def _compile(fn: Any) -> Any:
    """``torch.compile`` (a seam for tests that force a failure)."""
    import torch

    return torch.compile(fn)


def compile_blocks(env: WorkerEnv, blocks: list[Any], device: torch.device) -> CompiledBlocks | None:
    """``torch.compile`` each of ``blocks`` in place when ``JD_COMPILE`` asks; ``None`` when it does not."""
    if not blocks or not speed_on(env.compile, device):
        if blocks == [] and env.compile == "1" and env.rank == 0:
            _log.warning("jd.wrap: JD_COMPILE=1, but the model has no repeated blocks (a ModuleList or ModuleDict of "
                         "one class) to compile: it runs eager")  # fmt: skip
        return None
    state = CompiledBlocks(env)
    try:
        for block in blocks:
            block._compiled_call_impl = state._guard(block, _compile(block._call_impl))
            state.blocks.append(block)
    except Exception as e:  # noqa: BLE001
        state.blocks = list(blocks)
        state.fall_back(e)
        return state
    if env.rank == 0:
        _log.info("jd.wrap: torch.compile of %d blocks (%s)", len(blocks), type(blocks[0]).__name__)
    return state
