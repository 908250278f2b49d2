"""``jd.save`` / ``jd.resume``: torch.distributed.checkpoint into ``<run dir>/checkpoints/step-<N>/``.

Layout of one checkpoint::

    step-<N>/
      COMPLETE            JSON written by rank 0 last, before the directory gets its final name
      dcp/                torch.distributed.checkpoint of the modules and optimizers (sharded for FSDP2)
      deepspeed/          engine.save_checkpoint(...) of a DeepSpeed engine, when the state holds one
      extra-rank<k>.pt    torch.save of everything else, per rank: the rank's RNG states (Python, NumPy, torch CPU
                          and CUDA, restored on resume), plain values, ``state_dict()`` of stateful objects such
                          as LR schedulers and samplers

Writing goes to ``.tmp-step-<N>`` and is renamed after a barrier, so a ``step-<N>`` directory always holds a whole
checkpoint; resume also requires the ``COMPLETE`` marker and picks the highest step.

Resume is collective-safe: before any collective load, every rank checks what it will read (``_checkpoint_check``:
the marker, its ``extra-rank<k>.pt``, DCP's ``.metadata`` and that every storage file it names is there, long enough
and holds a ``torch.save`` archive at each offset: no tensor is loaded) and the ranks agree with one MIN all-reduce.
A checkpoint damaged on any rank is skipped by every rank together; a rank that raised alone while its peers entered
DCP's ``gather_object`` would deadlock them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from typing import Any, Protocol

from ._checkpoint_check import COMPLETE, Damaged, Verified, first_line, verify
from ._env import WorkerEnv, WorkerError

__all__ = [
    "save", "commit_pending", "resume", "latest_checkpoint", "complete_checkpoints", "rng_state", "set_rng_state",
    "replay_cpu_adam_steps", "COMPLETE", "all_ranks_ok",
]  # fmt: skip

_STEP_DIR = re.compile(r"^step-(\d+)$")
_log = logging.getLogger("jupyter_dist.worker")


class CheckpointHost(Protocol):
    """What saving and resuming need of the worker's runtime; ``_runtime.Runtime`` is one.

    Named here rather than imported: ``_runtime`` calls into this module, so importing it back would be a circle.
    """

    env: WorkerEnv
    pending_save: Any
    save_group: Any

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...


def latest_checkpoint(root: str) -> tuple[int, str] | None:
    """``(step, path)`` of the newest complete checkpoint under ``root``, or ``None``."""
    try:
        names = os.listdir(root)
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for name in names:
        m = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, COMPLETE)):
            step = int(m.group(1))
            if best is None or step > best[0]:
                best = (step, path)
    return best


def _is_engine(obj: Any) -> bool:
    return any(c.__name__ == "DeepSpeedEngine" for c in type(obj).__mro__)


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class _Split:
    """A user state dict sorted into what each mechanism saves."""

    def __init__(self, state: dict[str, Any]) -> None:
        import torch

        if not isinstance(state, dict):
            raise WorkerError(f"jd.save/jd.resume take a dict such as {{'model': m, 'optimizer': o}}, got {state!r}")
        self.engines: dict[str, Any] = {}
        self.modules: dict[str, torch.nn.Module] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.stateful: dict[str, Any] = {}
        self.extras: dict[str, Any] = {}
        for key, value in state.items():
            if _is_engine(value):
                self.engines[key] = value
            elif isinstance(value, torch.nn.Module):
                self.modules[key] = value
            elif isinstance(value, torch.optim.Optimizer):
                self.optimizers[key] = value
            elif _is_stateful(value):
                self.stateful[key] = value
            else:
                self.extras[key] = value
        if len(self.engines) > 1:
            raise WorkerError(f"jd.save: one DeepSpeed engine per checkpoint, got {sorted(self.engines)}")
        # what an engine owns is in its own checkpoint
        owned = {id(getattr(e, a, None)) for e in self.engines.values() for a in ("optimizer", "lr_scheduler")}
        for group in (self.optimizers, self.stateful):
            for key in [k for k, v in group.items() if id(v) in owned]:
                del group[key]
        self.owner = {key: self._owner(key, opt) for key, opt in self.optimizers.items()}

    def _owner(self, key: str, optimizer: Any) -> Any:
        params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for module in self.modules.values():
            if any(id(p) in params for p in module.parameters()):
                return module
        raise WorkerError(
            f"jd.save: the optimizer {key!r} updates none of the modules in the state ({sorted(self.modules)}); "
            "put the model it trains in the same dict, e.g. {'model': model, 'optimizer': optimizer}"
        )

    def dcp_state(self, *, flat: bool = True) -> dict[str, Any]:
        """Model and optimizer state dicts for DCP.

        Optimizer states are flattened to one key per parameter name and hyperparameter (``state.<fqn>.exp_avg``,
        ``param_groups.<fqn>.lr``), as torchtitan saves them: the nested form keeps ``param_groups`` as a list whose
        ``params`` differ between pipeline stages, and DCP keeps one rank's copy of such a key, so a resumed stage
        got another stage's groups. ``flat=False`` reads checkpoints written before this change.
        """
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(flatten_optimizer_state_dict=flat)
        out: dict[str, Any] = {k: get_model_state_dict(m) for k, m in self.modules.items()}
        for key, opt in self.optimizers.items():
            out[key] = get_optimizer_state_dict(self.owner[key], opt, options=opts)
        return out


def _no_dist() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _single_process_ok() -> Iterator[None]:
    """DCP warns that it "assumes" a single process even when told so with ``no_dist=True``; that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save(rt: CheckpointHost, state: dict[str, Any], step: int, *, root: str | None = None, keep: int | None = None,
         async_: bool = False) -> str:  # fmt: skip
    """Write a checkpoint of ``state`` at ``step``; collective (every rank calls it). Returns the final path.

    With ``async_`` the modules and optimizers are staged to CPU memory and written by a background thread
    (``torch.distributed.checkpoint.async_save``, on a process group of its own so its collectives never interleave
    with training's) while training goes on; the checkpoint is committed (marker, rename) at the next
    ``jd.save``/``jd.checkpoint``/``jd.resume`` or at a clean exit, so until then it does not count.
    """
    import torch
    from torch.distributed.checkpoint import state_dict_saver

    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise WorkerError(f"jd.save: step must be an int >= 0, got {step!r}")
    if keep is not None and keep < 1:
        raise WorkerError(f"jd.save: keep={keep} must be >= 1 (or None to keep every checkpoint)")
    commit_pending(rt)
    split = _Split(state)
    rank = rt.rank
    tmp = os.path.join(root or "", f".tmp-step-{step}")
    final = os.path.join(root or "", f"step-{step}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    for engine in split.engines.values():
        engine.save_checkpoint(tmp, tag="deepspeed", save_latest=False)
    future = None
    if split.modules or split.optimizers:
        with _single_process_ok():
            if async_ and not split.engines:
                future = state_dict_saver.async_save(split.dcp_state(), checkpoint_id=os.path.join(tmp, "dcp"),
                                                     process_group=_save_group(rt), no_dist=_no_dist())  # fmt: skip
            else:
                state_dict_saver.save(split.dcp_state(), checkpoint_id=os.path.join(tmp, "dcp"), no_dist=_no_dist())
    extras = dict(split.extras)
    extras.update({k: v.state_dict() for k, v in split.stateful.items()})
    blob = {"step": step, "extras": extras, "stateful": sorted(split.stateful), "rng": rng_state()}
    torch.save(blob, os.path.join(tmp, f"extra-rank{rank}.pt"))
    marker = {
        "step": step, "world_size": rt.world_size, "strategy": rt.env.strategy, "modules": sorted(split.modules),
        "optimizers": sorted(split.optimizers), "engines": sorted(split.engines), "extras": sorted(extras),
        "async": future is not None,
    }  # fmt: skip
    pending = _Pending(future, tmp, final, marker, root or ".", keep)
    if future is not None:
        rt.pending_save = pending
        return final
    _commit(rt, pending)
    return final


def _save_group(rt: CheckpointHost) -> Any:
    """A gloo group for asynchronous saves (created once, collectively, at the first one)."""
    import torch.distributed as dist

    if _no_dist():
        return None
    if getattr(rt, "save_group", None) is None:
        rt.save_group = dist.new_group(backend="gloo")
    return rt.save_group


class _Pending:
    def __init__(self, future: Any, tmp: str, final: str, marker: dict[str, Any], root: str, keep: int | None) -> None:
        self.future, self.tmp, self.final, self.marker, self.root, self.keep = future, tmp, final, marker, root, keep


def commit_pending(rt: CheckpointHost) -> str | None:
    """Finish and commit an asynchronous save (collective); returns its path, or ``None`` when none is pending."""
    pending = getattr(rt, "pending_save", None)
    if pending is None:
        return None
    rt.pending_save = None
    _commit(rt, pending)
    return pending.final


def _commit(rt: CheckpointHost, p: _Pending) -> None:
    if p.future is not None:
        p.future.result()  # this rank's shards are on disk (raises what the writer raised)
    _barrier()
    if rt.rank == 0:
        marker = {**p.marker, "t": time.time()}
        with open(os.path.join(p.tmp, COMPLETE), "w") as f:
            json.dump(marker, f)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(p.final):  # saving the same step again replaces it
            old = f"{p.final}.old-{os.getpid()}"
            os.rename(p.final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(p.tmp, p.final)
        _fsync_dir(p.root)
        if p.keep is not None:
            _prune(p.root, p.keep)
    _barrier()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse
        pass
    finally:
        os.close(fd)


def _prune(root: str, keep: int) -> None:
    steps = sorted(
        (int(m.group(1)), name)
        for name in os.listdir(root)
        if (m := _STEP_DIR.match(name)) and os.path.isfile(os.path.join(root, name, COMPLETE))
    )
    for _, name in steps[:-keep]:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _agree(rt: CheckpointHost, value: Any) -> Any:
    """Rank 0's ``value`` on every rank (one broadcast when a process group exists)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and rt.world_size > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every complete checkpoint under ``root``, newest first."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = []
    for name in names:
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(root, name, COMPLETE)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found, reverse=True)


def rng_state() -> dict[str, Any]:
    """The random number generator states of this process: Python, NumPy (if imported), torch CPU and CUDA."""
    import random
    import sys

    import torch

    out: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if "numpy" in sys.modules:
        out["numpy"] = sys.modules["numpy"].random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured (generators absent now or then are left alone)."""
    import random
    import sys

    import torch

    if "python" in state:
        random.setstate(state["python"])
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state and "numpy" in sys.modules:
        sys.modules["numpy"].random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        with contextlib.suppress(RuntimeError):  # a different number of devices: leave CUDA's generators
            torch.cuda.set_rng_state_all(state["cuda"])


def all_ranks_ok(rt: CheckpointHost, ok: bool) -> bool:
    """Whether every rank says ``ok`` (one all-reduce when a process group exists)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and rt.world_size > 1:
        import torch

        flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag)
        return int(flag.item()) == 0
    return ok


def resume(rt: CheckpointHost, state: dict[str, Any], *, root: str) -> tuple[dict[str, Any], int] | None:
    """Load the newest complete checkpoint under ``root`` into ``state``'s objects; collective.

    Every rank first checks what it will read (``_checkpoint_check.verify``, no collective, no tensor loaded) and the
    ranks agree (one MIN all-reduce) before the collective load starts. A checkpoint that is damaged on any rank, or
    that fails to load on any rank (DCP reports its read errors to every rank), is skipped by every rank with a
    warning naming the rank, the file and what is wrong, and the one before it is tried; every rank agrees on which
    one was loaded.
    """
    commit_pending(rt)
    split = _Split(state)
    if rt.rank == 0:
        _log_incomplete(root)
    steps = _agree(rt, [s for s, _ in complete_checkpoints(root)] if rt.rank == 0 else None) or []
    skipped: list[str] = []
    for step in steps:
        path = os.path.join(root, f"step-{step}")  # this rank's own root: rank 0 listed the steps
        verified, damage = None, None
        try:
            verified = verify(path, step, rt.rank, engines=bool(split.engines),
                              dcp=bool(split.modules or split.optimizers))  # fmt: skip
        except Damaged as exc:
            damage = str(exc)
        except Exception as exc:  # noqa: BLE001 - whatever this rank hit, its peers must hear of it before loading
            damage = f"checking it failed ({first_line(exc)})"
        found = _damage_on_any_rank(rt, damage)
        if found:
            why = "; ".join(found)
            _skip(path, why)
            skipped.append(f"step-{step} ({why})")
            continue
        assert verified is not None
        error = None
        try:
            out = _load(rt, split, state, path, verified)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            error, out = exc, None
        if all_ranks_ok(rt, error is None):
            assert out is not None
            if skipped:
                _log.warning("jd.resume: loaded %s (step %d) after skipping %s", path, step, "; ".join(skipped))
            return out, step
        why = "failed on another rank"
        if error is not None:  # DCP wraps the cause in a multi-line report: its last line says what broke
            lines = str(error).strip().splitlines() or [""]
            why = f"{type(error).__name__}: {lines[-1][:300]}"
        _skip(path, why)
        skipped.append(f"step-{step} ({why})")
    if steps:
        raise WorkerError(f"jd.resume: none of the {len(steps)} checkpoint(s) under {root} could be loaded")
    return None


def _skip(path: str, why: str) -> None:
    warnings.warn(f"jd.resume: checkpoint {path} could not be loaded on every rank ({why}); trying the previous one",
                  RuntimeWarning, stacklevel=4)  # fmt: skip


def _log_incomplete(root: str) -> None:
    """Say in the rank's log which ``step-<N>`` directories resume passes over for want of a ``COMPLETE`` marker."""
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(root)):
            if _STEP_DIR.match(name) and not os.path.isfile(os.path.join(root, name, COMPLETE)):
                _log.warning("jd.resume: %s has no %s marker (a save that did not finish, or a damaged "
                             "checkpoint); skipped", os.path.join(root, name), COMPLETE)  # fmt: skip


def _damage_on_any_rank(rt: CheckpointHost, damage: str | None) -> list[str]:
    """``"rank k: what"`` for every rank that found damage, ``[]`` when none did.

    One MIN all-reduce of ok (1) / damaged (0) over the ranks; only when some rank found damage do the ranks (all of
    them, since they agree) gather each other's findings, so every rank's log says which rank and which file.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and rt.world_size > 1):
        return [] if damage is None else [f"rank {rt.rank}: {damage}"]
    import torch

    flag = torch.tensor([1 if damage is None else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if int(flag.item()) == 1:
        return []
    found: list[Any] = [None] * rt.world_size
    dist.all_gather_object(found, damage)
    return [f"rank {r}: {d}" for r, d in enumerate(found) if d is not None]


def _load(rt: CheckpointHost, split: _Split, state: dict[str, Any], path: str, verified: Verified) -> dict[str, Any]:
    from torch.distributed.checkpoint import state_dict_loader
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    for engine in split.engines.values():
        load_path, _ = engine.load_checkpoint(path, tag="deepspeed")
        if load_path is None:
            raise WorkerError(f"jd.resume: DeepSpeed found no checkpoint under {path}/deepspeed")
        replay_cpu_adam_steps(engine.optimizer)
    blob = verified.blob
    if split.modules or split.optimizers:
        saved = verified.metadata.state_dict_metadata
        # nested optimizer states (written before flattening) have "<key>.param_groups.0.lr"; flattened ones
        # "<key>.param_groups.<parameter name>.lr", and a parameter name never ends in a bare index
        legacy = any(k.endswith(".param_groups.0.lr") for k in saved)
        template = split.dcp_state(flat=not legacy)
        with _single_process_ok():
            state_dict_loader.load(template, checkpoint_id=os.path.join(path, "dcp"), no_dist=_no_dist())
        for key, module in split.modules.items():
            set_model_state_dict(module, template[key])
        for key, opt in split.optimizers.items():
            set_optimizer_state_dict(split.owner[key], opt, template[key])
            replay_cpu_adam_steps(opt)
    out = dict(state)
    for key, value in blob["extras"].items():
        if key in split.stateful:
            split.stateful[key].load_state_dict(value)
        else:
            out[key] = value
    if blob.get("rng") and verified.own:  # the same rank's generators; a resharded run keeps its own
        set_rng_state(blob["rng"])
    return out


def replay_cpu_adam_steps(optimizer: Any) -> int:
    """Rebuild the hidden step state of DeepSpeed's CPU Adam kernel after a resume; returns the steps replayed.

    Why a DeepSpeed ZeRO run on CPU did not resume bit-exactly (issue 16: 1.2e-10 and 4.7e-10 off an uninterrupted
    run): DeepSpeed's C++ Adam on the CPU (``Adam_Optimizer`` in ``deepspeed/ops/csrc/includes/cpu_adam.h``, behind
    ``DeepSpeedCPUAdam`` and behind ``FusedAdam`` when the accelerator is the CPU) keeps the bias-correction powers
    ``beta1**t`` and ``beta2**t`` in process memory, as float32 running products: ``IncrementStep`` multiplies them
    by beta once per step (cpu_adam.h lines 80-83) and recomputes them with ``std::pow`` only when the step jumps
    or the betas change (lines 77-78, 88-89). No checkpoint holds them. A restarted process therefore starts at
    ``std::pow(beta, 15)`` where the uninterrupted one had fifteen float32 products, which differ in the last bit,
    so ``1 / sqrt(1 - beta2**t)`` differs by an ulp and every later update drifts by ~1e-10. Model weights, fp32
    partitions, exp_avg/exp_avg_sq, step, loss scale and RNG all load exactly; this power was the one thing lost.

    The fix replays the step counter through the same C++ kernel, steps ``1..step`` on a throw-away one-element
    tensor with each param group's hyperparameters, so the running products are built by the very same float32
    multiplications as in the uninterrupted process (about a microsecond a step). Other optimizers, and FusedAdam on
    CUDA (whose kernel computes ``std::pow(beta, step)`` at every call), keep no such state and are left alone. Exact
    when the betas were constant since step 1 (a scheduler that cycles the betas makes the kernel recompute with
    ``std::pow`` at every step anyway).
    """
    import sys

    import torch

    if "deepspeed" not in sys.modules:
        return 0
    base = optimizer
    for _ in range(4):  # DeepSpeedZeroOptimizer / FP16_Optimizer / BF16_Optimizer wrap the optimizer that steps
        if isinstance(base, torch.optim.Optimizer) and not hasattr(base, "optimizer"):
            break
        base = getattr(base, "optimizer", None)
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    if isinstance(base, DeepSpeedCPUAdam):
        cpu_adam = True
    elif isinstance(base, FusedAdam):
        from deepspeed.accelerator import get_accelerator

        cpu_adam = get_accelerator().device_name() == "cpu"  # FusedAdam's CPU op is the same Adam_Optimizer
        if not cpu_adam:
            return 0
    else:
        return 0
    steps = [int(s) for s in (st.get("step") for st in base.state.values()) if isinstance(s, int | torch.Tensor)]
    n = max(steps, default=0)
    if n <= 0:
        return 0
    # every group, also those whose "params" are empty now (ZeRO-3 fills them only while a sub-group steps); with
    # one set of betas one call a step does it: the kernel ignores the other groups' calls of the same step
    groups = list(base.param_groups)
    if len({(float(g["betas"][0]), float(g["betas"][1])) for g in groups}) == 1:
        groups = groups[:1]
    t = [torch.zeros(1, dtype=torch.float32) for _ in range(4)]  # param, grad, exp_avg, exp_avg_sq: discarded
    for step in range(1, n + 1):
        for g in groups:
            lr, (b1, b2), eps, wd = float(g["lr"]), g["betas"], float(g["eps"]), float(g["weight_decay"])
            bias = bool(g.get("bias_correction", True))
            if isinstance(base, DeepSpeedCPUAdam):
                base.ds_opt_adam.adam_update(base.opt_id, step, lr, b1, b2, eps, wd, bias, t[0], t[1], t[2], t[3])
            else:
                from deepspeed.ops.adam.fused_adam import multi_tensor_applier

                multi_tensor_applier(base.multi_tensor_adam, base._dummy_overflow_buf, [[t[1]], [t[0]], [t[2]], [t[3]]],
                                     lr, b1, b2, eps, step, base.adam_w_mode, int(bias), wd)  # fmt: skip
    return n
