"""What runs inside each training process of ``%%dist_train``: ``import jupyter_dist.worker as jd``.

Examples
--------
::

    import torch, jupyter_dist.worker as jd

    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = jd.wrap(model, opt)              # DDP / FSDP / FSDP2 / DeepSpeed, from JD_STRATEGY
    start = jd.resume()                           # (state, step) of the newest checkpoint, or None
    first = start[1] + 1 if start else 0
    for step in range(first, 100):
        x = batch(step).to(jd.device)
        with jd.autocast():                       # JD_PRECISION=*-mixed with none/ddp; a no-op otherwise
            loss = model(x).square().mean()
        jd.backward(loss)
        jd.step()
        jd.log(step, loss=loss)                   # one record in <run dir>/telemetry/rank-<k>.jsonl
        if step % 50 == 0:
            jd.save({"model": model, "optimizer": opt}, step)

``jd.rank``, ``jd.world_size``, ``jd.local_rank``, ``jd.device`` and ``jd.is_main`` are resolved on first use:
under torchrun that first use initialises the process group (nccl with CUDA, else gloo); elsewhere they are
rank 0 of 1 with no process group. Importing this module is cheap: it loads neither torch nor any notebook
package. In a launched worker (``JD_RUN_DIR`` set) importing it also redirects stdout/stderr to
``logs/rank-<k>.log`` (``JD_LOG_STDIO=1``) and arranges for an ``exit`` record at interpreter exit (status
``ok``, ``error`` with the exception's type and message, or ``terminated`` on SIGTERM).
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

from ._data import ResumableSampler
from ._env import PRECISIONS, WorkerEnv, WorkerError
from ._runtime import Runtime, get_runtime, on_import

if TYPE_CHECKING:  # pragma: no cover
    import torch

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    is_main: bool

__all__ = [
    "rank",
    "world_size",
    "local_rank",
    "device",
    "is_main",
    "init",
    "wrap",
    "autocast",
    "backward",
    "step",
    "log",
    "save",
    "resume",
    "checkpoint",
    "ResumableSampler",
    "barrier",
    "phase",
    "finish",
    "note_exit",
    "Runtime",
    "WorkerEnv",
    "WorkerError",
    "PRECISIONS",
]

_LAZY = ("rank", "world_size", "local_rank", "device", "is_main")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(get_runtime(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def init() -> None:
    """Initialise the process group (under torchrun) and write the ``start`` record; idempotent."""
    get_runtime().init()


def wrap(model: Any, optimizer: Any = None) -> tuple[Any, Any]:
    """Apply the planned strategy (``JD_STRATEGY``) to ``model`` and ``optimizer``; returns the pair to use.

    ``none``
        both unchanged;
    ``ddp``
        ``DistributedDataParallel(model.to(jd.device), gradient_as_bucket_view=True)``, same optimizer;
    ``fsdp2``, ``fsdp2-hybrid``
        ``fully_shard`` on each repeated block (children of the model's largest ``ModuleList``/``ModuleDict`` of
        one class), then on the root, on a 1-D mesh (2-D replicate x shard mesh with ``LOCAL_WORLD_SIZE`` shards
        for hybrid), with a ``MixedPrecisionPolicy`` from ``JD_PRECISION``; the optimizer's param groups are
        pointed at the sharded parameters in place (same optimizer object, so an LR scheduler built on it before
        ``wrap`` keeps working; call ``wrap`` before the first step);
    ``fsdp-*``
        the FSDP1 ``FullyShardedDataParallel`` wrapper (``use_orig_params=True``, ``device_id=jd.device``, CPU
        included) with the matching ``ShardingStrategy``; the optimizer is re-pointed as for ``fsdp2``;
    ``zero*``
        ``deepspeed.initialize(model=..., optimizer=..., config=JD_DS_CONFIG)``; returns ``(engine, engine's
        optimizer)``. Use :func:`backward` and :func:`step`. With optimizer offload a ``torch.optim.Adam``/``AdamW``
        becomes ``DeepSpeedCPUAdam`` with the same hyperparameters and param groups (one log line says so); other
        element-wise torch optimizers (SGD, Adagrad, ...) run as given. An LR scheduler built on your optimizer
        before ``wrap`` keeps driving the learning rate; torch's schedulers refuse the engine's ZeRO optimizer
        ("is not an Optimizer"), so build yours on the optimizer you pass to ``wrap``.

    ``JD_PRECISION=bf16-true`` casts the model to bfloat16 first (except for DeepSpeed, whose JSON decides).
    """
    return get_runtime().wrap(model, optimizer)


def autocast() -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` for ``JD_PRECISION=*-mixed`` with ``none``/``ddp``; a no-op where the strategy casts."""
    return get_runtime().autocast()


def backward(loss: Any) -> None:
    """``engine.backward(loss)`` for DeepSpeed, else ``loss.backward()`` (through a GradScaler for fp16-mixed)."""
    get_runtime().backward(loss)


def step(optimizer: Any = None) -> None:
    """``engine.step()`` for DeepSpeed, else ``optimizer.step()`` and ``optimizer.zero_grad(set_to_none=True)``.

    ``optimizer`` defaults to the one returned by :func:`wrap`. Under DeepSpeed, ``jd.step()`` and ``jd.step(opt)``
    with the optimizer ``wrap`` returned both call ``engine.step()``: call it after every micro-batch's
    :func:`backward`; the engine steps the optimizer only at the ``gradient_accumulation_steps`` boundary.
    """
    get_runtime().step(optimizer)


def log(step: int, loss: Any = None, **metrics: Any) -> dict[str, Any] | None:
    """Record the metrics of ``step``; cheap enough to call every step.

    Calls are coalesced into about one ``step`` record per ``JD_TELEMETRY_INTERVAL_S`` (default 1 s) in
    ``<run dir>/telemetry/rank-<k>.jsonl``, holding the mean of each metric, the number of calls ``n``, and the
    measured ``step_time`` (s/step); log ``tokens=`` (or ``samples=``) processed since the previous call to get
    ``tokens_per_s`` (``samples_per_s``). Metrics are numbers or one-element tensors; tensors are summed on their
    device and read with ``.item()`` only when a record is written, so logging does not synchronise with the GPU
    every step. NaN and infinities are kept (written as ``null`` plus a ``nonfinite`` note, see
    :mod:`jupyter_dist.telemetry.records`). Returns the record when this call wrote one, else ``None`` (always
    ``None`` without ``JD_RUN_DIR``).
    """
    if loss is not None:
        metrics = {"loss": loss, **metrics}
    return get_runtime().log(step, metrics)


def save(
    state: dict[str, Any],
    step: int,
    *,
    root: str | os.PathLike[str] | None = None,
    keep: int | None = None,
    async_: bool = False,
) -> str | None:
    """Checkpoint ``state`` at ``step`` into ``<run dir>/checkpoints/step-<step>/``; every rank must call it.

    ``state`` maps names to modules (plain, DDP, FSDP2: saved with ``torch.distributed.checkpoint``, sharded where
    the model is), optimizers (paired with the module whose parameters they update), a DeepSpeed engine (its own
    ``save_checkpoint``), objects with ``state_dict``/``load_state_dict`` (LR schedulers, ...) and plain values
    (saved per rank). ``keep`` prunes all but the newest ``keep`` checkpoints. ``async_=True`` writes modules and
    optimizers from a background thread while training continues; the checkpoint counts (is committed) at the next
    save, resume or clean exit. Returns the directory, or ``None``
    (with a warning) when there is no run directory and no ``root``.
    """
    return get_runtime().save(state, step, root=root, keep=keep, async_=async_)


def checkpoint(state: dict[str, Any], step: int) -> str | None:
    """Periodic checkpoint: call it every step.

    Saves ``state`` like :func:`save` when ``step + 1`` is a multiple of ``--checkpoint-every``
    (``JD_CHECKPOINT_EVERY``), keeping the newest ``--keep`` (``JD_KEEP``); returns the path, or ``None``.
    """
    return get_runtime().checkpoint(state, step)


def resume(
    state: dict[str, Any] | None = None, *, root: str | os.PathLike[str] | None = None
) -> tuple[dict[str, Any], int] | None:
    """Load the newest complete checkpoint into ``state``'s objects, in place; every rank must call it.

    ``state`` defaults to ``{"model": m, "optimizer": o}`` from the last :func:`wrap`. Returns ``(state, step)`` --
    the given dict plus the plain values that were saved -- or ``None`` when there is no checkpoint yet.
    """
    return get_runtime().resume(state, root=root)


def phase(name: str) -> contextlib.AbstractContextManager[Any]:
    """Name what the block does in the heartbeats (``with jd.phase("eval"): ...``); the dashboard shows it."""
    return get_runtime().phase(name)


def barrier() -> None:
    """Wait for every rank (a no-op without a process group)."""
    get_runtime().barrier()


def finish() -> None:
    """Destroy the process group created by :func:`init` (also done at exit after a clean run)."""
    get_runtime().finish()


def note_exit(code: int, error: BaseException | None = None) -> None:
    """For a launcher's bootstrap that runs the script and catches its exception: record how it ended.

    The ``exit`` record written at interpreter exit then says ``error`` with the exception's type and message (or
    ``SystemExit`` with the code) instead of ``ok``. Call it only if this module was imported, e.g.
    ``w = sys.modules.get("jupyter_dist.worker"); w and w.note_exit(code, exc)``, so torch-free scripts stay so.
    """
    get_runtime().note_exit(code, error)


on_import()
