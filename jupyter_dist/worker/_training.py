"""The training verbs of the worker runtime: wrap a model by the plan, step it, and where this rank's data is.

``wrap``, ``train_step``, ``backward``, ``step``, ``autocast`` and the data-parallel and context-parallel
coordinates (``dp_size``, ``dp_rank``, ``cp_shard``).
:class:`TrainingVerbs` is the part of :class:`~._runtime.Runtime` that applies the plan to a model and runs one
optimizer step under it (the pipelined schedule under pp, sequence chunks under cp, one gradient reduction per
accumulated step otherwise, DeepSpeed's own accumulation for an engine). It reads the state the runtime sets up
(``env``, the process group through ``init()``, the emitter, ``model``/``optimizer``/``mesh``/``pipeline``).
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

from ..plan.training import TORCH_DTYPES, Precision
from ._env import WorkerEnv, WorkerError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..telemetry.emitter import Emitter

__all__ = ["TrainingVerbs"]


class TrainingVerbs:
    """Wrap a model by the plan and step it; mixed into :class:`~._runtime.Runtime`."""

    env: WorkerEnv
    model: Any
    optimizer: Any
    mesh: Any
    pipeline: Any
    comm_stats: Any
    profiler: Any
    _scaler: Any
    _last_step: int | None

    if TYPE_CHECKING:  # provided by Runtime

        @property
        def rank(self) -> int: ...

        @property
        def world_size(self) -> int: ...

        @property
        def device(self) -> torch.device: ...

        @property
        def emitter(self) -> Emitter: ...

        def init(self) -> None: ...

    @property
    def is_engine(self) -> bool:
        """Whether the wrapped model is a DeepSpeed engine."""
        return self.is_engine_model(self.model)

    @staticmethod
    def is_engine_model(model: Any) -> bool:
        """Whether ``model`` is a DeepSpeed engine (its optimizer is DeepSpeed's own)."""
        return model is not None and any(c.__name__ == "DeepSpeedEngine" for c in type(model).__mro__)

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: how many different batches one optimizer step sees (world / (pp * cp * tp))."""
        e = self.env
        return max(1, self.world_size // (e.pp * e.cp * e.tp))

    @property
    def dp_rank(self) -> int:
        """The data-parallel index of this rank; the ranks of one tensor/context-parallel group share it.

        From the mesh layout ``(pp, dp_replicate, dp_shard, cp, tp)``, row-major, tp innermost.
        """
        e = self.env
        return (self.rank // (e.cp * e.tp)) % self.dp_size

    def cp_shard(self, tensors: tuple[Any, ...], seq_dim: int = 1, *, inverse: bool = False) -> tuple[Any, ...]:
        """Keep this rank's load-balanced sequence chunks under context parallelism; unchanged without it.

        ``inverse``: the whole sequences back.
        """
        if self.env.cp <= 1:
            return tensors
        what = "jd.cp_unshard" if inverse else "jd.cp_shard"
        if not tensors:
            raise WorkerError(f"{what}: give at least one tensor, e.g. {what}(tokens, targets)")
        if self.mesh is None or "cp" not in (self.mesh.mesh.mesh_dim_names or ()):
            raise WorkerError(f"{what}: call jd.wrap(model, optimizer) first: it builds the mesh with the cp dimension")
        from ._context import shard, unshard

        return (unshard if inverse else shard)(self.mesh["cp"], tuple(tensors), seq_dim)

    def _needs_mesh(self, model: Any, tp_plan: Any, pretrained: Any) -> bool:
        if self.env.family == "fsdp2" or self.env.model_parallel or tp_plan is not None or pretrained is not None:
            return True
        params = getattr(model, "parameters", None)
        return callable(params) and any(getattr(p, "is_meta", False) for p in params())

    # ------------------------------------------------------------------ training
    def wrap(self, model: Any, optimizer: Any = None, *, tp_plan: Any = None,
             pretrained: str | os.PathLike[str] | None = None) -> tuple[Any, Any]:  # fmt: skip
        """Apply ``JD_STRATEGY`` and the model-parallel degrees; see :func:`jupyter_dist.worker.wrap`."""
        from ._strategy import apply_strategy

        self.init()
        self.emitter.set_phase("wrap")
        if self._needs_mesh(model, tp_plan, pretrained):
            from ._parallel import parallelize

            family = self.env.family
            if self.env.cp > 1 and family != "fsdp2":
                from ._context import check_context_parallel

                check_context_parallel(self.env, model, family)
            if family not in ("none", "fsdp2"):
                raise WorkerError(
                    f"jd.wrap: JD_STRATEGY={self.env.strategy} does not compose with tensor parallelism or sharded "
                    "loading here; use fsdp2 (e.g. the plan's fsdp2+tp candidate)"
                )
            from ._strategy import require_process_group

            if family != "none" or self.env.model_parallel:
                require_process_group(self.env.strategy if family != "none" else f"none with JD_TP={self.env.tp}")
            model, optimizer, self.mesh, self.pipeline = parallelize(
                self.env, model, optimizer, device=self.device, tp_plan=tp_plan,
                pretrained=None if pretrained is None else os.fspath(pretrained), family=family,
            )  # fmt: skip
        else:
            model, optimizer = apply_strategy(self.env, model, optimizer, device=self.device,
                                              comm_stats=self.comm_stats)  # fmt: skip
        if not self.is_engine_model(model):
            from ._speed import fuse_optimizer

            fuse_optimizer(self.env, optimizer, self.device)
        self.model, self.optimizer = model, optimizer
        self.emitter.set_phase("forward")
        if self.profiler is not None and self.profiler.start == 0 and self._last_step is None:
            self.profiler.begin(0)  # a window from step 0 starts once the model is wrapped
        if self.env.precision == "fp16-mixed" and self.env.family in ("none", "ddp"):
            import torch

            self._scaler = torch.amp.GradScaler(self.device.type)
        return model, optimizer

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` for the *-mixed precisions and fp8 (bf16) with ``none``/``ddp`` (others cast alone)."""
        precision = Precision(self.env.precision)
        if not precision.is_mixed or self.env.family not in ("none", "ddp"):
            return contextlib.nullcontext()
        import torch

        return torch.autocast(self.device.type, dtype=getattr(torch, TORCH_DTYPES[precision.compute_dtype]))

    def backward(self, loss: Any) -> None:
        """``engine.backward(loss)`` for DeepSpeed, else ``loss.backward()`` (scaled for fp16-mixed)."""
        self.emitter.set_phase("backward")
        if self.is_engine:
            self.model.backward(loss)
        elif self._scaler is not None:
            self._scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self, optimizer: Any = None) -> None:
        """``engine.step()`` for DeepSpeed, else ``optimizer.step()`` then ``zero_grad(set_to_none=True)``."""
        emitter = self.emitter
        emitter.set_phase("optimizer")
        try:
            self._step(optimizer)
        finally:
            emitter.set_phase("forward")

    def _step(self, optimizer: Any) -> None:
        if self.is_engine and (optimizer is None or optimizer is self.optimizer or optimizer is self.model.optimizer):
            # the engine, not the ZeRO optimizer: engine.step() counts micro-batches and steps (clipping, LR
            # scheduler, zero_grad) only at the gradient-accumulation boundary; the optimizer's own step() would
            # apply every micro-batch's partial gradient and never advance the engine's counters
            self.model.step()
            return
        opt = optimizer if optimizer is not None else self.optimizer
        if opt is None:
            raise WorkerError("jd.step() needs an optimizer: pass it to jd.wrap(model, optimizer) or to jd.step(opt)")
        if self._scaler is not None:
            self._scaler.step(opt)
            self._scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)

    def train_step(self, inputs: Any, targets: Any, loss_fn: Any) -> Any:
        """One optimizer step on a batch; see :func:`jupyter_dist.worker.train_step`."""
        import torch

        if self.model is None:
            raise WorkerError("jd.train_step: call jd.wrap(model, optimizer) first")
        emitter = self.emitter
        if self.env.cp > 1:  # this rank's load-balanced chunks of the sequence
            inputs, targets = self.cp_shard((inputs, targets))
        if self.pipeline is not None:
            emitter.set_phase("forward")
            loss = self.pipeline.step(inputs, targets, loss_fn)
            self.step(None)
            return self._cp_mean(loss)
        if self.is_engine:  # DeepSpeed accumulates itself: a backward and a step per micro-batch
            n = int(self.model.gradient_accumulation_steps())
        else:
            n = self.env.microbatches or 1
        if inputs.shape[0] % n:
            raise WorkerError(
                f"jd.train_step: a batch of {inputs.shape[0]} does not split into {n} micro-batches (the plan's "
                "gradient accumulation); use a multiple"
            )
        total = torch.zeros((), device=inputs.device)
        for i, (x, y) in enumerate(zip(inputs.chunk(n), targets.chunk(n), strict=True)):
            last = i == n - 1
            sync = contextlib.nullcontext()
            if not last and hasattr(self.model, "no_sync") and not self.is_engine:  # DDP: all-reduce once
                sync = self.model.no_sync()
            if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2: reduce-scatter once
                self.model.set_requires_gradient_sync(last)
            emitter.set_phase("forward")
            with sync:
                with self.autocast():
                    loss = loss_fn(self.model(x), y)
                total += loss.detach().float()
                self.backward(loss if self.is_engine else loss / n)
            if self.is_engine:
                self.model.step()
        if not self.is_engine:
            self.step(None)
        else:
            emitter.set_phase("forward")
        return self._cp_mean(total / n)

    def _cp_mean(self, loss: Any) -> Any:
        """Each cp rank's loss is its chunks': the batch's is the mean over the cp ranks (identity without cp)."""
        if self.env.cp > 1 and self.mesh is not None:
            import torch.distributed as dist

            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.mesh["cp"].get_group())
        return loss
