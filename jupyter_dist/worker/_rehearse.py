"""Rehearse one rank of a big plan in this process: its real shards, activations and temporaries, no other rank.

``python -m jupyter_dist.worker._rehearse SPEC.json OUT.json`` (what :mod:`jupyter_dist.launch.rehearse` starts, one
process per rehearsed rank) or :func:`rehearse_rank` in a process of one's own:

1. a *fake* process group of the plan's world size with this rank's number
   (``torch.testing._internal.distributed.fake_pg``): every collective returns at once without touching its output,
   every shard, gathered parameter, activation, optimizer state and temporary is real;
2. the worker's own :class:`~._runtime.Runtime` for the rank's launch contract (a :class:`~._env.WorkerEnv` with
   the plan's degrees, ``RANK`` = the rehearsed rank): ``Runtime.wrap`` -- the code ``jd.wrap`` runs, not a copy --
   builds the mesh, applies tp/sp, pipeline stages, cp, ep, activation checkpointing and FSDP2 for this rank's
   coordinates, and materialises only the local shards of a model built on the meta device;
3. ``Runtime.train_step`` -- ``jd.train_step`` -- runs ``steps`` optimizer steps on random tokens of the plan's
   micro-batch, sequence and accumulation; the first warms up (optimizer states, a pipeline's metadata), the
   others are measured.

What is measured, per rank: the bytes of the parameters, gradients and optimizer states the rank holds (its live
objects, counted as the multi-process tests count them); the step's peak of tracked allocations with its parts
(PyTorch's ``MemTracker``: parameters, gradients, optimizer states, activations, temporaries) and, on a GPU, the
CUDA allocator's own peak; the wall time of a step, which holds no communication (the fake collectives cost
nothing); and every collective the step issued, by mesh dimension, with the bytes a ring algorithm sends per rank.

Two things a lone rank cannot know are stood in for, and the stand-ins are stated here:

* **Pipeline neighbours.** ``torch.distributed.pipelining`` (torch 2.13) infers a stage's input from the metadata
  the previous stage sends, and its output gradients from what the next stage sends back. Stages are cut at block
  boundaries (:mod:`._pipeline`), so every boundary carries the residual stream (and a mixture of experts'
  balance-loss scalar): the forward metadata a stage would receive is the one the first stage sends, recorded when
  a first-stage rank is rehearsed (``boundary_out``) and handed to the later stages (``boundary``); a middle stage
  checks that what it sends on is the same. The gradients coming back have the shapes of what the stage sent.
* **Expert routing.** The all-to-all of per-expert token counts (:mod:`._expert`) would leave its output
  uninitialised; the rehearsal fills it as if every rank of the ep group routed as this one does (each source sends
  this rank what this rank sends itself), so the tokens an expert rank receives are those of a balanced router.

One piece: the fake world and its stand-ins, the instrument (memory tracker, collective counter, state bytes) and
the rank's run share one spec and one process; the instrument is also what the real multi-process runs that check
the rehearsal are measured with (``tests/numerics/rehearse_real.py``). Should it grow, the instrument is the seam.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pickle
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .._startup import import_torch_outside_the_collector
from ._env import WorkerEnv, WorkerError

__all__ = [
    "CollectiveCounter",
    "ENV_FIELDS",
    "build_model",
    "fake_world",
    "main",
    "rehearse_rank",
    "state_bytes",
    "step_memory",
]

_log = logging.getLogger("jupyter_dist.worker")

ENV_FIELDS = ("strategy", "precision", "tp", "pp", "cp", "ep", "sp", "dp_replicate", "ac", "pp_schedule", "pp_virtual",
              "microbatches", "ds_config")  # fmt: skip
"""The :class:`~._env.WorkerEnv` fields a rehearsal spec carries (the plan's launch contract); the rank's own
``rank``/``world_size``/``local_rank``/``local_world_size`` come beside them."""

OPTIMIZERS = ("adamw", "sgd")
"""Optimizers a rehearsal builds (the plan's ``--optimizer``); ``adamw-8bit`` needs bitsandbytes' own kernels."""


# ------------------------------------------------------------------------------------------------- the fake world
@contextlib.contextmanager
def fake_world(rank: int, world_size: int, *, boundary: Any = None) -> Iterator[dict[str, Any]]:
    """A fake process group of ``world_size`` with this process as ``rank``, and the stand-ins for absent ranks.

    Yields a dict in which the pipeline stand-in leaves ``"sent"``: the forward metadata this rank's stages sent on
    (a first stage's is the boundary the later stages need). Restores everything it patched and destroys the group.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        raise WorkerError("a rehearsal needs a process of its own: this one already has a process group")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    state: dict[str, Any] = {"sent": []}
    try:
        with _mirrored_all_to_all(dist), _pipeline_neighbours(boundary, state):
            yield state
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _mirrored_all_to_all(dist: Any) -> Iterator[None]:
    """``dist.all_to_all_single`` (equal splits) fills its output as if every peer sent what this rank sends itself."""
    original = dist.all_to_all_single

    def mirrored(output: Any, input: Any, output_split_sizes: Any = None, input_split_sizes: Any = None,
                 group: Any = None, async_op: bool = False) -> Any:  # fmt: skip
        work = original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        if output_split_sizes is None and input_split_sizes is None and output.numel() == input.numel():
            n = dist.get_world_size(group)
            mine = input.reshape(n, -1)[dist.get_rank(group)]
            output.view(n, -1).copy_(mine.expand(n, -1))
        return work

    dist.all_to_all_single = mirrored
    try:
        yield
    finally:
        dist.all_to_all_single = original


@contextlib.contextmanager
def _pipeline_neighbours(boundary: Any, state: dict[str, Any]) -> Iterator[None]:
    """Stand in for the previous and next pipeline stages' metadata (see the module docstring)."""
    try:
        from torch.distributed.pipelining import stage as st

        cls = st.PipelineStage
        forward_meta, backward_meta, derive = st._StageForwardMeta, st._StageBackwardMeta, st._derive_grad_metas
        recv0, send0 = cls._recv_meta, cls._send_meta
    except (ImportError, AttributeError):  # another torch: pipelines are refused when a stage asks (below)
        yield
        return

    def recv(self: Any, src_stage: int) -> Any:
        if src_stage > self.stage_index:  # the next stage sends back the gradients of what this one sent
            return backward_meta(backward_metas=derive(self._stage_meta.outputs))
        if boundary is not None:
            return boundary
        if state["sent"]:  # interleaved: the first-stage rank's later stage takes what its first stage sent
            return state["sent"][0]
        raise WorkerError(
            f"rehearsing pipeline stage {self.stage_index} needs the boundary a first-stage rank sends: rehearse a "
            "rank of the first stage first (rank 0 is one)"
        )

    def send(self: Any, meta: Any, dst_stage: int) -> None:
        if isinstance(meta, forward_meta):
            received = boundary if boundary is not None else (state["sent"][0] if state["sent"] else None)
            if received is not None and not self.is_first and _metas(meta) != _metas(received):
                raise WorkerError(
                    f"pipeline stage {self.stage_index} sends {_metas(meta)} but received {_metas(received)}: its "
                    "boundaries differ from stage to stage, which a one-rank rehearsal cannot stand in for"
                )
            state["sent"].append(meta)

    cls._recv_meta, cls._send_meta = recv, send
    try:
        yield
    finally:
        cls._recv_meta, cls._send_meta = recv0, send0


def _metas(meta: Any) -> list[tuple[Any, ...]]:
    return [(tuple(m.shape), str(m.dtype)) for m in getattr(meta, "forward_metas", ())]


# ------------------------------------------------------------------------------------------------------ the model
def build_model(source: Mapping[str, Any], *, meta: bool) -> Any:
    """Build the model a spec names, on the meta device when ``meta``.

    ``{"kind": "reference", "config": {...}}``: :class:`jupyter_dist.models.Transformer` (``MoETransformer`` with
    ``n_experts``); ``{"kind": "import", "target": "pkg.mod:factory", "path": DIR, "kwargs": {...}}``;
    ``{"kind": "hf", "config": {...}}``: a Hugging Face causal LM from its ``config.json`` (no weights);
    ``{"kind": "pickle", "file": PATH}``: a cloudpickled class or factory (a notebook's model).
    """
    import torch

    kind = source.get("kind")
    device = torch.device("meta") if meta else None
    with device if device is not None else contextlib.nullcontext():
        if kind == "reference":
            config = dict(source.get("config", {}))
            if config.get("n_experts", 1) > 1:
                from ..models import MoETransformer

                return MoETransformer(**config)
            config.pop("n_experts", None)
            config.pop("top_k", None)
            from ..models import Transformer

            return Transformer(**config)
        if kind == "import":
            factory = _import(str(source["target"]), source.get("path"))
            return factory(**dict(source.get("kwargs", {})))
        if kind == "hf":
            from transformers import AutoConfig, AutoModelForCausalLM

            data = dict(source["config"])
            model_type = data.pop("model_type")
            hf_config = AutoConfig.for_model(model_type, **data)
            return AutoModelForCausalLM.from_config(hf_config, attn_implementation=source.get("attn", "sdpa"))
        if kind == "pickle":
            with open(source["file"], "rb") as f:
                factory = pickle.load(f)  # a file this process's parent wrote (cloudpickle's output loads here)
            return factory(**dict(source.get("kwargs", {})))
    raise WorkerError(f"rehearsal: unknown model source {kind!r}; valid: reference, import, hf, pickle")


def _import(target: str, path: str | None) -> Callable[..., Any]:
    import importlib

    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise WorkerError(f"rehearsal: --module {target!r} must be 'package.module:factory' (a class or function)")
    if path and path not in sys.path:
        sys.path.insert(0, path)
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


def _vocab(model: Any) -> int:
    """The rows of the model's token embedding (the range of token ids it takes)."""
    import torch

    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if emb is None:
        emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    if emb is None:
        raise WorkerError(f"rehearsal: {type(model).__name__} has no token embedding (nn.Embedding): it cannot be "
                          "fed token ids; rehearsals train causal language models")  # fmt: skip
    return int(emb.num_embeddings)


def _optimizer(kind: str, params: Any, lr: float) -> Any:
    import torch

    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise WorkerError(f"rehearsal: optimizer {kind!r} cannot be rehearsed here; valid: {', '.join(OPTIMIZERS)}")


# ------------------------------------------------------------------------------------------------------- measuring
def local_bytes(t: Any) -> int:
    """Bytes this rank holds of ``t`` (a DTensor's local shard)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return int(t.numel() * t.element_size())


def _inner(opt: Any) -> Any:
    import torch

    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return opt


def state_bytes(model: Any, optimizer: Any, device: Any = None) -> dict[str, int]:
    """Parameters and optimizer states this rank holds, from the live objects (a DTensor's local shard).

    Optimizer states are the inner torch optimizer's state tensors of at least one dimension (Adam's step counter
    is not a model state), plus DeepSpeed's fp32 master partition under a ZeRO engine. With ``device``, what lies on
    another kind of device (offloaded to the host) is left out of both and counted as ``offloaded``.
    """
    import torch

    module = getattr(model, "module", model) if _is_engine(model) else model
    if _is_engine(model) and hasattr(next(iter(module.parameters()), None), "ds_tensor"):  # ZeRO-3
        params = [p.ds_tensor for p in module.parameters()]
    else:
        params = list(module.parameters())
    inner = _inner(optimizer)
    states = [v for st in inner.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    if _is_engine(model):
        states += list(getattr(optimizer, "fp32_partitioned_groups_flat", None)
                       or getattr(optimizer, "single_partition_of_fp32_groups", None) or [])  # fmt: skip
    kind = getattr(device, "type", device)

    def here(t: Any) -> bool:
        local = t.to_local() if hasattr(t, "to_local") else t
        return kind is None or local.device.type == kind

    return {"params": sum(local_bytes(t) for t in params if here(t)),
            "optimizer": sum(local_bytes(t) for t in states if here(t)),
            "offloaded": sum(local_bytes(t) for t in params + states if not here(t))}  # fmt: skip


def _is_engine(model: Any) -> bool:
    return any(c.__name__ == "DeepSpeedEngine" for c in type(model).__mro__)


def _grad_bytes(model: Any, optimizer: Any) -> int:
    if _is_engine(model):
        zero = optimizer
        grads = getattr(zero, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", None)
        if grads is not None:
            return sum(local_bytes(t) for t in grads.values())
        groups = getattr(zero, "averaged_gradients", None) or {}
        groups = groups.values() if isinstance(groups, dict) else groups
        return sum(local_bytes(t) for g in groups if g for t in g)
    return sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)


@contextlib.contextmanager
def step_memory(model: Any, optimizer: Any, device: Any, tracker: Any = None) -> Iterator[dict[str, Any]]:
    """Measure the block's peak: tracked allocations by part (``MemTracker``) and, on CUDA, the allocator's.

    The yielded dict is filled when the block ends: ``peak`` (tracked bytes at the peak), ``parts`` (MemTracker's
    categories at that moment), ``activation_peak`` (activations and temporaries at their own peak), ``start``
    (tracked bytes when the block began), and on CUDA ``cuda_peak`` / ``cuda_start``
    (``torch.cuda.max_memory_allocated`` / ``memory_allocated``) and ``cuda_reserved_peak``. ``tracker`` (from
    :func:`new_tracker`) keeps what it was told of between blocks (the optimizer's states, a pipeline's buffers).
    """
    import torch

    tracker = tracker if tracker is not None else new_tracker(model, optimizer)
    out: dict[str, Any] = {}
    cuda = getattr(device, "type", str(device)) == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out["cuda_start"] = int(torch.cuda.memory_allocated())
    with tracker:  # entering resets the tracker's peak to what is held now
        dev = torch.device(device)
        out["start"] = int(_snap(tracker, "current", dev).get("Total", 0))
        yield out
        if cuda:
            torch.cuda.synchronize()
        peak = _snap(tracker, "peak", dev)
    out["peak"] = int(peak.get("Total", 0))
    out["activation_peak"] = int(next((v for d, v in getattr(tracker, "act_peak", {}).items()
                                       if d.type == torch.device(device).type), 0))  # fmt: skip
    out["parts"] = {str(getattr(k, "value", k)): int(v) for k, v in peak.items() if k != "Total"}
    if cuda:
        out["cuda_peak"] = int(torch.cuda.max_memory_allocated())
        out["cuda_reserved_peak"] = int(torch.cuda.max_memory_reserved())


def new_tracker(model: Any, optimizer: Any) -> Any:
    """A ``MemTracker`` that already knows the model's parameters and buffers and the optimizer's states.

    PyTorch's tracker refuses a root module called twice in one tracked block ("multiple iterative calls"); a step
    calls it once per micro-batch (gradient accumulation, a pipeline's schedule), so this one starts that module's
    statistics over instead. Only the global peak and its parts are read here, not the per-module ones.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepTracker(MemTracker):
        act_peak: dict[Any, int] = {}  # noqa: RUF012 - set per instance in __enter__

        def __enter__(self) -> Any:
            if self._depth == 0:
                self.act_peak = {}
            return super().__enter__()

        def _update_peak_stats(self, peak_state: Any) -> None:
            super()._update_peak_stats(peak_state)
            for dev, snap in self._curr_mem_snap.items():  # activations and temporaries at their own peak
                now = sum(v for k, v in snap.items() if getattr(k, "value", k) in ("Activation", "Temp"))
                if now > self.act_peak.get(dev, 0):
                    self.act_peak[dev] = now

        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:  # the root module again: the next micro-batch
                self.memory_tracking.pop(module, None)
                super()._pre_fw_hook(module, inputs)

        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> Any:
            try:
                return super()._track_module_params_and_buffers(module, install_grad_hooks)
            except RuntimeError:  # FSDP1's parameters are views of its flat parameter: no hooks on non-leaves
                return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

        def _post_fw_hook(self, module: Any, inputs: Any, outputs: Any) -> None:
            if module in self.memory_tracking:
                super()._post_fw_hook(module, inputs, outputs)

        def _pre_bw_hook(self, module: Any, args: Any) -> None:
            if module is not None and module in self.memory_tracking:
                super()._pre_bw_hook(module, args)

        def _post_bw_hook(self, module: Any, args: Any) -> None:
            if module is not None and module in self.memory_tracking:
                super()._post_bw_hook(module, args)

    tracker = StepTracker()
    module = getattr(model, "module", model) if _is_engine(model) else model
    tracker.track_external(module, _inner(optimizer))
    return tracker


def _snap(tracker: Any, kind: str, device: Any) -> dict[Any, int]:
    snap = tracker.get_tracker_snapshot(kind)
    for dev, parts in snap.items():
        if dev.type == device.type:
            return parts  # type: ignore[no-any-return]
    return {}


class CollectiveCounter:
    """A dispatch mode that counts the collectives a block issues, by op and by mesh dimension, with their bytes.

    ``bytes`` is the tensor the collective works on (an all-gather's output, a reduce-scatter's input, an all-reduce's
    buffer, what an all-to-all or send moves); ``wire`` what a ring algorithm sends per rank for it: ``(n-1)/n`` of
    it for an all-gather, reduce-scatter or all-to-all, ``2(n-1)/n`` for an all-reduce, all of it for a send.
    Groups are named after the mesh dimensions they span (``dp_shard``, ``tp``, ``pp``, ``ep``, ``dp_shard+cp``...).
    """

    def __init__(self, groups: Mapping[str, str] | None = None, *, whole: str = "world") -> None:
        self.groups = dict(groups or {})
        """Process-group name -> mesh dimension(s) it spans."""
        self.whole = whole
        """The name of a group not in :attr:`groups` that spans every rank (``"dp"`` without a mesh)."""
        self.ops: dict[tuple[str, str], list[float]] = {}
        self._mode: Any = None

    def __enter__(self) -> CollectiveCounter:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                from torch.distributed.tensor import DTensor

                if any(t is DTensor for t in types):
                    return NotImplemented
                counter._note(func, args, kwargs or {})
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)

    def _note(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        namespace = getattr(func, "namespace", "")
        if namespace not in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
            return
        kind = _kind(func._schema.name.split("::")[-1].rstrip("_"))
        if kind not in KINDS:  # waits, barriers, autograd wrappers
            return
        group, size = self._group(args, kwargs)
        tensors = [a for a in _flat(args) if hasattr(a, "element_size") and hasattr(a, "numel")]
        if not tensors:
            return
        if kind == "all_gather" and namespace == "c10d":  # (output, input, group): the gathered output
            moved = _nbytes(tensors[0])
        elif kind == "all_gather":  # functional: (input, group size, group): the output is size x the input
            moved = _nbytes(tensors[0]) * size
        elif kind == "all_to_all" and namespace == "c10d":  # (output, input, ...): what this rank sends
            moved = _nbytes(tensors[1] if len(tensors) > 1 else tensors[0])
        elif kind == "reduce_scatter" and namespace == "c10d":  # (output, input, ...): the whole input
            moved = _nbytes(tensors[1] if len(tensors) > 1 else tensors[0])
        else:
            moved = sum(_nbytes(t) for t in tensors) if kind in ("send", "recv") else _nbytes(tensors[0])
        n = max(1, size)
        factor = {"all_reduce": 2 * (n - 1) / n, "send": 1.0, "recv": 0.0, "broadcast": (n - 1) / n}.get(
            kind, (n - 1) / n)  # fmt: skip
        entry = self.ops.setdefault((kind, group), [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += moved
        entry[2] += moved * factor

    def _group(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, int]:
        import torch
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        for a in list(args) + list(kwargs.values()):
            try:
                if isinstance(a, torch.ScriptObject):
                    pg = dist.ProcessGroup.unbox(a)
                elif isinstance(a, str):
                    pg = _resolve_process_group(a)
                else:
                    continue
            except Exception:  # a ReduceOp, a reduction's name ("sum")
                continue
            size = int(pg.size())
            if pg.group_name in self.groups:
                return self.groups[pg.group_name], size
            return (self.whole if size == dist.get_world_size() else f"group of {size}"), size
        return "other", 1

    def to_dict(self) -> list[dict[str, Any]]:
        """``[{op, dims, count, bytes, wire_bytes}]``, by dimension then op."""
        return [{"op": k, "dims": g, "count": int(v[0]), "bytes": int(v[1]), "wire_bytes": int(round(v[2]))}
                for (k, g), v in sorted(self.ops.items(), key=lambda kv: (kv[0][1], kv[0][0]))]  # fmt: skip


def _group_size(name: str) -> int:
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return int(_resolve_process_group(name).size())
    except Exception:
        return 1


KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "send", "recv", "reduce")
"""The collectives :class:`CollectiveCounter` counts."""


def _kind(name: str) -> str:
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "allreduce", "allgather", "all_to_all", "alltoall",
                 "broadcast", "send", "recv", "reduce"):  # fmt: skip
        if name.startswith(kind) or name.startswith("_" + kind):
            return {"allreduce": "all_reduce", "allgather": "all_gather", "alltoall": "all_to_all"}.get(kind, kind)
    return name


def _flat(args: Any) -> list[Any]:
    out: list[Any] = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out += _flat(a)
        else:
            out.append(a)
    return out


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size())


def _mesh_groups(mesh: Any) -> dict[str, str]:
    """Process-group name -> the mesh dimensions it spans (``dp_shard``, ``tp``, ``dp_shard+cp``, the expert ``ep``).

    Every group this process made is placed by the world-mesh coordinates that vary among its ranks (flattened
    dimensions included); the named dimensions of the world and expert meshes then name their own groups.
    """
    import itertools

    import torch.distributed as dist

    if mesh is None:
        return {}
    world = mesh.mesh
    names = world.mesh_dim_names or ()
    ranks = world.mesh
    coords = {int(ranks[idx]): idx for idx in itertools.product(*(range(s) for s in ranks.shape))}
    out: dict[str, str] = {}
    for pg, name in list(dist.distributed_c10d._world.pg_names.items()):
        try:
            members = dist.get_process_group_ranks(pg)
        except Exception:
            continue
        varying = [n for i, n in enumerate(names) if len({coords[r][i] for r in members if r in coords}) > 1]
        out[name] = "+".join(varying) if varying else "self"
    meshes = [world] + ([mesh.expert] if getattr(mesh, "expert", None) is not None else [])
    for m in meshes:
        for name in m.mesh_dim_names or ():
            with contextlib.suppress(Exception):
                out[m[name].get_group().group_name] = name
    return out


# ----------------------------------------------------------------------------------------------------- the rehearsal
def _env(spec: Mapping[str, Any]) -> WorkerEnv:
    fields = {k: spec["env"][k] for k in ENV_FIELDS if k in spec["env"]}
    rank, world = int(spec["rank"]), int(spec["world_size"])
    per_node = int(spec.get("local_world_size", world))
    return WorkerEnv(distributed=True, rank=rank, world_size=world, local_rank=rank % per_node,
                     local_world_size=per_node, heartbeat_s=0, **fields)  # fmt: skip


def _fake() -> bool:
    import torch.distributed as dist

    return bool(dist.is_initialized() and dist.get_backend() == "fake")


def _ddp_hook(buckets: list[Any], *, fake: bool) -> Any:
    """DDP's default all-reduce hook that also keeps each gradient bucket, allocated when DDP wraps the model.

    Under a fake group it returns the bucket as it is (a fake all-reduce's future carries no tensor; a real one
    reduces the bucket in place: the same memory).
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    seen: set[int] = set()

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP compares annotations: none here
        import torch

        buffer = bucket.buffer()
        if buffer.data_ptr() not in seen:
            seen.add(buffer.data_ptr())
            buckets.append(buffer)
        if not fake:
            return allreduce_hook(state, bucket)
        import torch.distributed as dist

        dist.all_reduce(buffer, group=state)  # returns at once; counted like a real one
        fut: Any = torch.futures.Future()
        fut.set_result(buffer)
        return fut

    return hook


def _resident(runtime: Any, buckets: list[Any]) -> list[Any]:
    """Tensors a warm-up step leaves that belong to neither the model nor the optimizer.

    DDP's gradient buckets and a pipeline's receive buffers.
    """
    import torch

    out: list[Any] = list(buckets)
    for stage in getattr(runtime.pipeline, "stages", ()):
        infos: list[Any] = []
        for recv in (getattr(stage, "args_recv_info", {}) or {}).values():
            infos += list(recv)
        for recv in (getattr(stage, "grad_recv_info", {}) or {}).values():
            infos += list(recv)
        for info in infos:
            buf = getattr(info, "buffer", None)
            if isinstance(buf, torch.Tensor):
                out.append(buf)
    return out


def _coordinates(env: WorkerEnv, mesh: Any) -> dict[str, int]:
    if mesh is None:
        return {"dp": env.rank}
    out = {}
    for name in mesh.mesh.mesh_dim_names or ():
        out[name] = int(mesh.mesh[name].get_local_rank())
    if getattr(mesh, "expert", None) is not None:
        out["ep"] = int(mesh.expert["ep"].get_local_rank())
    return out


def rehearse_rank(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Rehearse the rank a spec names (see :mod:`jupyter_dist.launch.rehearse` for the spec); returns the result.

    Needs a process without a process group: the fake one of the plan's world size is made here and destroyed after.
    """
    import torch

    env = _env(spec)
    device = _device(spec)
    # what a launcher sets and some libraries read themselves (DeepSpeed asserts LOCAL_RANK; its accelerator)
    os.environ.update(RANK=str(env.rank), WORLD_SIZE=str(env.world_size), LOCAL_RANK=str(env.local_rank),
                      LOCAL_WORLD_SIZE=str(env.local_world_size))  # fmt: skip
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    boundary = None
    if spec.get("boundary"):
        with open(spec["boundary"], "rb") as f:
            boundary = pickle.load(f)  # written by the rehearsal of a first-stage rank of the same plan
    from ._runtime import Runtime

    if env.family == "deepspeed":
        _deepspeed_stand_ins()
    with fake_world(env.rank, env.world_size, boundary=boundary) as world:
        # the runtime's device is cuda:<local rank % GPUs>: one GPU here, so cuda:0 stands in for the rank's
        result = run_rank(Runtime(env), spec, device)
        if world["sent"]:
            result["boundary"] = _metas(world["sent"][0])
            if spec.get("boundary_out"):
                with open(spec["boundary_out"], "wb") as f:
                    pickle.dump(world["sent"][0], f)
    result["torch"] = torch.__version__
    return result


def _deepspeed_stand_ins() -> None:
    """Let ZeRO-3's checks that every rank traced the same modules and parameters answer yes.

    Each check broadcasts a list and compares it on every rank: a lone rank's fake broadcast brings back no other
    rank's list. The checks allocate nothing.
    """
    import importlib

    def same(*_: Any, **__: Any) -> None:
        return None

    for name in ("deepspeed.runtime.zero.utils", "deepspeed.runtime.zero.partition_parameters",
                 "deepspeed.runtime.zero.partitioned_param_coordinator", "deepspeed.runtime.zero.stage3"):  # fmt: skip
        with contextlib.suppress(ImportError):
            module = importlib.import_module(name)
            for fn in ("assert_ints_same_as_other_ranks", "assert_lst_len_same_as_other_ranks"):
                if hasattr(module, fn):
                    setattr(module, fn, same)


def _device(spec: Mapping[str, Any]) -> Any:
    import torch

    name = spec.get("device") or "auto"
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise WorkerError("rehearsal: device cuda asked for, but torch sees no GPU here")
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    if name != "cpu":
        raise WorkerError(f"rehearsal: device {name!r}; valid: auto, cuda, cpu")
    return torch.device("cpu")


def run_rank(runtime: Any, spec: Mapping[str, Any], device: Any) -> dict[str, Any]:
    """Build the spec's model, ``runtime.wrap`` it, train ``steps`` steps with ``runtime.train_step``; measure.

    The one instrument of a rehearsal and of the real multi-process runs it is checked against (which call it under
    torchrun with the real process group and :func:`~._runtime.get_runtime`'s runtime): step 0 warms up (optimizer
    states, a pipeline's metadata and buffers), step 1 is measured under the memory tracker and the collective
    counter, the later ones are timed without them.
    """
    import torch

    env = runtime.env
    steps = int(spec.get("steps", 3))
    if steps < 3:
        raise WorkerError(f"rehearsal: steps={steps}; at least 3 (one warms up, one is measured, the rest are timed)")
    opt_kind = str(spec.get("optimizer", "adamw"))
    if opt_kind not in OPTIMIZERS:
        raise WorkerError(f"rehearsal: optimizer {opt_kind!r} cannot be rehearsed here; valid: {', '.join(OPTIMIZERS)}")
    result: dict[str, Any] = {"rank": env.rank, "world_size": env.world_size, "device": device.type}
    if device.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name(device)
    meta = env.family == "fsdp2" or env.model_parallel  # only the local shards are ever allocated
    torch.manual_seed(int(spec.get("seed", 0)))
    t0 = time.perf_counter()
    model = build_model(spec["model"], meta=meta)
    vocab = int(spec.get("vocab") or _vocab(model))
    optimizer = _optimizer(opt_kind, model.parameters(), float(spec.get("lr", 1e-4)))
    model, optimizer = runtime.wrap(model, optimizer)
    result["wrap_s"] = round(time.perf_counter() - t0, 3)
    _log.info("rehearsal of rank %d: wrapped in %.1f s (%s)", env.rank, result["wrap_s"], runtime.mesh and
              runtime.mesh.describe())  # fmt: skip
    result["mesh"] = runtime.mesh.describe() if runtime.mesh is not None else f"{env.strategy} on {env.world_size}"
    result["coordinates"] = _coordinates(env, runtime.mesh)
    if runtime.pipeline is not None:
        result["stages"] = {str(k): v for k, v in runtime.pipeline.layers.items()}
    buckets: list[Any] = []
    if type(model).__name__ == "DistributedDataParallel":  # its gradient buckets, which the tracker cannot see
        model.register_comm_hook(None, _ddp_hook(buckets, fake=_fake()))
    grads: list[int] = []
    clear = getattr(optimizer, "zero_grad", None)
    if clear is not None and not _is_engine(model):  # gradient bytes right before the step drops them

        def zero_grad(set_to_none: bool = True) -> None:
            grads.append(_grad_bytes(model, optimizer))
            clear(set_to_none=set_to_none)

        optimizer.zero_grad = zero_grad
    elif _is_engine(model):  # DeepSpeed: its gradient partitions right before each step of the engine
        engine_step = model.step

        def step_noting_grads(*args: Any, **kwargs: Any) -> Any:
            grads.append(_grad_bytes(model, optimizer))
            return engine_step(*args, **kwargs)

        model.step = step_noting_grads
    n = env.microbatches or (env.pp * env.stages_per_rank if env.pp > 1 else 1)
    micro, seq = int(spec["micro_batch"]), int(spec["seq_len"])
    g = torch.Generator().manual_seed(1)

    def loss_fn(out: Any, targets: Any) -> Any:
        logits = out.logits if hasattr(out, "logits") else out
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        aux = getattr(runtime.model, "aux_loss", None)
        if callable(aux):  # a mixture of experts' balance loss (under pp the last stage's carry)
            loss = loss + 0.01 * aux()
        return loss

    tracker = new_tracker(model, optimizer)
    counter = CollectiveCounter(_mesh_groups(runtime.mesh), whole="world" if runtime.mesh is not None else "dp")
    step_s: list[float] = []
    mem: dict[str, Any] = {}
    for step in range(steps):
        tokens = torch.randint(0, vocab, (micro * n, seq + 1), generator=g).to(device)
        # a pipeline's metadata inference (step 0) runs autograd.grad on leaf inputs, which the tracker's module
        # hooks cannot follow: step 0 runs without it and what it leaves is handed to it
        if step == 1:  # the optimizer's states now exist
            tracker.track_external(getattr(model, "module", model) if _is_engine(model) else model, _inner(optimizer),
                                   *_resident(runtime, buckets))  # fmt: skip
        tracked = step_memory(model, optimizer, device, tracker) if step == 1 else contextlib.nullcontext({})
        with tracked as m, counter if step == 1 else contextlib.nullcontext():
            t = time.perf_counter()
            loss = runtime.train_step(tokens[:, :-1], tokens[:, 1:], loss_fn)
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_s.append(time.perf_counter() - t)
        _log.info("rehearsal of rank %d: step %d of %d in %.1f s%s", env.rank, step + 1, steps, step_s[-1],
                  " (measured)" if step == 1 else "")  # fmt: skip
        if step == 1:
            mem = m
        if step == 0 and not math.isfinite(float(loss)):
            result["note"] = "the loss is not finite (a fake group's collectives carry no values)"
    states = state_bytes(model, optimizer, device)
    result.update(
        offloaded=states["offloaded"], params=states["params"],
        grads=grads[-1] if grads else _grad_bytes(model, optimizer),
        optimizer=states["optimizer"], peak=mem["peak"], parts=mem["parts"], step_start=mem["start"],
        activation_peak=mem["activation_peak"], step_s=[round(s, 4) for s in step_s],
        step_time_s=round(min(step_s[2:]), 4), microbatches=n, micro_batch=micro, seq_len=seq, vocab=vocab,
        collectives=counter.to_dict(),
    )  # fmt: skip
    for key in ("cuda_peak", "cuda_start", "cuda_reserved_peak"):
        if key in mem:
            result[key] = mem[key]
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m jupyter_dist.worker._rehearse SPEC.json OUT.json``: rehearse one rank, write its result.

    On a failure the result is ``{"error": "<one line>", "type": "<exception type>"}`` and the exit status 1.
    """
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m jupyter_dist.worker._rehearse SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    try:
        import_torch_outside_the_collector()  # a rank's start, as a launched one has it (jupyter_dist/_startup.py)
        result = rehearse_rank(spec)
        status = 0
    except BaseException as exc:  # the driver shows one line; the traceback stays in this process's stderr
        import traceback

        traceback.print_exc()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        result = {"error": first, "type": type(exc).__name__, "rank": spec.get("rank")}
        if isinstance(exc, MemoryError) or "out of memory" in str(exc).lower():
            result["oom"] = True
        status = 1
    tmp = argv[1] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, argv[1])
    return status


if __name__ == "__main__":
    sys.exit(main())
