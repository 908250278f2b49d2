"""What runs inside each training process of ``%%dist_train``: ``import jupyter_dist.worker as jd``.

Examples
--------
::

    import torch, jupyter_dist.worker as jd

    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = jd.wrap(model, opt)              # DDP / FSDP / FSDP2 / DeepSpeed, from JD_STRATEGY
    for step in range(jd.start_step(), 100):      # loads the newest checkpoint: the step after it, else 0
        x = batch(step).to(jd.device)
        with jd.autocast():                       # JD_PRECISION=*-mixed with none/ddp; a no-op otherwise
            loss = model(x).square().mean()
        jd.backward(loss)
        jd.step()
        jd.log(step, loss=loss)                   # one record in <run dir>/telemetry/rank-<k>.jsonl
        if step % 50 == 0:
            jd.save({"model": model, "optimizer": opt}, step)

``jd.rank``, ``jd.world_size``, ``jd.local_rank``, ``jd.device``, ``jd.is_main``, ``jd.dp_rank`` and ``jd.dp_size``
(the data-parallel index and count: load batches by these) are resolved on first use; ``jd.mesh`` is the device mesh
``jd.wrap`` built under model parallelism (``None`` otherwise), ``jd.pipeline`` this rank's pipeline stages and
schedule under pipeline parallelism (``None`` otherwise). Under torchrun the first use initialises the process
group (nccl with CUDA, else gloo); elsewhere they are rank 0 of 1 with no process group. Importing this module in a
notebook kernel is cheap: it loads neither torch nor any notebook package. In a training process (torchrun's
variables or ``JD_RUN_DIR`` set) it imports torch at once, with the cyclic collector paused, and freezes it out of
later collections (~10 % less CPU to start a rank; ``jupyter_dist._startup``): import it
before torch, as ``%%dist_train``'s preamble does. In a launched worker (``JD_RUN_DIR`` set) importing it
also redirects stdout/stderr to ``logs/rank-<k>.log`` (``JD_LOG_STDIO=1``) and arranges for an ``exit`` record at
interpreter exit (status ``ok``, ``error`` with the exception's type and message, or ``terminated`` on SIGTERM).
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
    dp_rank: int
    dp_size: int
    mesh: Any
    pipeline: Any

__all__ = [
    "rank",
    "world_size",
    "local_rank",
    "device",
    "is_main",
    "dp_rank",
    "dp_size",
    "mesh",
    "pipeline",
    "init",
    "wrap",
    "suggest_tp_plan",
    "cp_shard",
    "cp_unshard",
    "autocast",
    "backward",
    "step",
    "train_step",
    "log",
    "config",
    "save",
    "resume",
    "start_step",
    "checkpoint",
    "ResumableSampler",
    "barrier",
    "phase",
    "profile",
    "finish",
    "note_exit",
    "Runtime",
    "WorkerEnv",
    "WorkerError",
    "PRECISIONS",
]

_LAZY = ("rank", "world_size", "local_rank", "device", "is_main", "dp_rank", "dp_size", "mesh", "pipeline")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(get_runtime(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def init() -> None:
    """Initialise the process group (under torchrun) and write the ``start`` record; idempotent."""
    get_runtime().init()


def wrap(model: Any, optimizer: Any = None, *, tp_plan: Any = None,
         pretrained: str | os.PathLike[str] | None = None) -> tuple[Any, Any]:  # fmt: skip
    """Apply the planned strategy (``JD_STRATEGY``) to ``model`` and ``optimizer``; returns the pair to use.

    With model parallelism (``JD_TP`` > 1, from a plan candidate such as ``fsdp2+tp2+sp``), a model built on the
    meta device, or ``pretrained=``: one device mesh ``(pp, dp_replicate, dp_shard, cp, tp)`` is built
    (:data:`mesh`), the tensor-parallel layout is applied with ``parallelize_module`` on its ``tp`` dimension --
    ``tp_plan`` (``{"layers.*.attn.q_proj": "colwise", ...}``, Hugging Face style names or ``ParallelStyle``
    objects) if given, else a Hugging Face model's own ``base_model_tp_plan``, else the model's ``tp_plan()`` method
    (:class:`jupyter_dist.models.Transformer`) -- with sequence parallelism when ``JD_SP=1``; the blocks are
    wrapped for activation checkpointing (``JD_AC``); ``fully_shard`` shards over the data-parallel dims (HSDP with
    ``JD_DP_REPLICATE`` > 1); a meta model's local shards are then allocated and initialised (its
    ``init_weights()``, or a Hugging Face model's own initialisation); ``pretrained`` (a ``save_pretrained``
    folder) is loaded into the shards, each rank reading only its slices. Load data by :data:`dp_rank` /
    :data:`dp_size` (:class:`ResumableSampler` does): ranks of one tensor-parallel group see the same batch.

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
    return get_runtime().wrap(model, optimizer, tp_plan=tp_plan, pretrained=pretrained)


def suggest_tp_plan(model: Any, tp: int | None = None, *, sequence_parallel: bool = False) -> Any:
    """Propose a tensor-parallel layout for ``model`` from its structure, in its own module names.

    Returns a ``TpLayout`` that prints as a table of (module pattern, style, why); ``layout.plan`` is what
    ``jd.wrap(model, opt, tp_plan=layout.plan)`` takes, and ``jd.wrap`` uses it by itself for a model with no
    layout of its own. A fused qkv (or gate-up) Linear is split per part, heads whole. Where the model cannot be
    split (heads or widths ``tp`` does not divide, a structure it cannot read) ``layout.reason`` says why in one
    line. Runs one forward on the meta device; needs no process group. See docs/parallelism.md.
    """
    from ._tp_layout import suggest_tp_plan as suggest

    return suggest(model, tp, sequence_parallel=sequence_parallel)


def cp_shard(*tensors: Any, seq_dim: int = 1) -> Any:
    """Keep this rank's chunks of the sequence under context parallelism (``JD_CP`` > 1); unchanged without it.

    ``tokens, targets = jd.cp_shard(batch[:, :-1], batch[:, 1:])``: every rank of one cp group loads the same batch
    (:data:`dp_rank` counts data-parallel ranks only) and keeps its part of the sequence (dim ``seq_dim``), in
    PyTorch's head-tail load-balanced order -- rank ``r`` of ``cp`` holds chunks ``r`` and ``2cp-1-r`` of ``2 x cp``,
    so the causal work is even. The sequence length must be a multiple of ``2 x cp``. The wrapped model receives the
    positions of those tokens by itself (for the rotary angles). Each rank's loss is then the mean over its tokens,
    and the gradients average over ``dp x cp`` like data-parallel ones. One tensor in, one out; several, a tuple.
    """
    out = get_runtime().cp_shard(tensors, seq_dim)
    return out[0] if len(out) == 1 else out


def cp_unshard(*tensors: Any, seq_dim: int = 1) -> Any:
    """The inverse of :func:`cp_shard`: the whole sequences, in order, on every rank of the cp group (e.g. logits)."""
    out = get_runtime().cp_shard(tensors, seq_dim, inverse=True)
    return out[0] if len(out) == 1 else out


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


def train_step(inputs: Any, targets: Any, loss_fn: Any) -> Any:
    """One optimizer step on a batch, whatever the plan: the recommended training loop.

    ``loss_fn(outputs, targets)`` is the mean loss of a micro-batch, e.g. ``lambda out, y:
    F.cross_entropy(out.flatten(0, 1), y.flatten())``. Returns the batch's mean loss (a detached tensor, the same on
    every rank of a pipeline: pass it to :func:`log`).

    Under pipeline parallelism the pipeline schedule (GPipe, 1F1B or interleaved 1F1B, ``JD_PP_SCHEDULE``) runs the
    forward and backward of every stage over the plan's micro-batches (``JD_MICROBATCHES``): the first stage takes
    ``inputs``, the last ``targets`` (other ranks may pass the same tensors or ``None``). Otherwise the batch is
    split into the plan's micro-batches (gradient accumulation, one gradient reduction per step), with DeepSpeed's
    engine doing its own accumulation. Under context parallelism it keeps this rank's load-balanced chunks of the
    sequence itself (pass whole sequences; do not call :func:`cp_shard` first) and returns the mean over the
    context-parallel ranks. Then the optimizer steps and the gradients are cleared.

    Example::

        loss = jd.train_step(tokens[:, :-1], tokens[:, 1:], lambda out, y: F.cross_entropy(out.flatten(0, 1),
                                                                                         y.flatten()))
        jd.log(step, loss=loss, tokens=tokens.numel())
    """
    return get_runtime().train_step(inputs, targets, loss_fn)


def log(step: int, loss: Any = None, **metrics: Any) -> dict[str, Any] | None:
    """Record the metrics of ``step``; cheap enough to call every step.

    Every call is kept, at its step, with the values given (never averaged): calls are buffered and written to
    ``<run dir>/telemetry/rank-<k>.jsonl`` as one ``steps`` batch about every ``JD_TELEMETRY_INTERVAL_S`` (default
    1 s; 0 writes each call at once). Readers derive ``step_time`` (s/step) from the time between calls; log
    ``tokens=`` (or ``samples=``) processed since the previous call to get ``tokens_per_s`` (``samples_per_s``).
    Metrics are numbers or one-element tensors; tensors are kept and read with one ``.tolist()`` per batch, so
    logging does not synchronise with the GPU every step. NaN and infinities are kept (see
    :mod:`jupyter_dist.telemetry.records`). Returns the ``steps`` record when this call wrote one, else ``None``
    (always ``None`` without ``JD_RUN_DIR``).
    """
    if loss is not None:
        metrics = {"loss": loss, **metrics}
    return get_runtime().log(step, metrics)


def config(**values: Any) -> dict[str, Any]:
    """Record the run's hyperparameters (``jd.config(lr=3e-4, batch=32, optimizer="adamw")``); returns all so far.

    Values are numbers, bools or one-line strings (numpy and 0-d torch scalars become numbers); anything else is a
    one-line :class:`~jupyter_dist.launch.record.HparamError` naming the key, on every rank. Rank 0 merges them
    into ``hparams.json`` in the run directory (atomically; later calls add and overwrite keys); the kernel merges
    that file into the run record: a runs-table column each, ``compare``'s legends, and the params/config of every
    ``--log-to`` sink. Without ``JD_RUN_DIR`` (a plain script) the values are only checked and returned.
    """
    from ..launch.record import check_hparams, read_hparams, write_hparams

    checked = check_hparams(values)
    run_dir = os.environ.get("JD_RUN_DIR")
    if not run_dir:
        return dict(checked)
    if int(os.environ.get("RANK", "0") or 0) != 0:
        return {**read_hparams(run_dir), **checked}
    return dict(write_hparams(run_dir, checked))


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


def start_step(state: dict[str, Any] | None = None, *, root: str | os.PathLike[str] | None = None) -> int:
    """Load the newest complete checkpoint like :func:`resume` and return the step to continue from (always an int).

    ``range(jd.start_step(), steps)`` replaces ``got = jd.resume(); start = got[1] + 1 if got else 0``: the step
    after the checkpoint's, or 0 when there is none yet. Every rank must call it.
    """
    got = resume(state, root=root)
    return 0 if got is None else int(got[1]) + 1


def phase(name: str) -> contextlib.AbstractContextManager[Any]:
    """Name what the block does in the heartbeats (``with jd.phase("eval"): ...``); the dashboard shows it."""
    return get_runtime().phase(name)


def profile(steps: Any = None) -> Any:
    """Record a ``torch.profiler`` trace of a window of steps on this rank (every rank should call it alike).

    ``jd.profile("5:8")`` (steps 5 to 7; also ``3``, ``range(5, 8)``) arms the window: it starts when ``jd.log``
    reports the step before it and stops at its last step's ``jd.log`` (``--profile 5:8`` on ``%%dist_train`` does
    the same). ``with jd.profile(): ...`` records the block (each ``jd.log`` inside it marks a step). The trace goes
    to ``<run dir>/profile/rank-<k>.pt.trace.json`` (Perfetto, TensorBoard's profiler); ``run.profile()`` in the
    notebook summarises all ranks. Outside the window no profiler runs.
    """
    return get_runtime().profile(steps)


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
