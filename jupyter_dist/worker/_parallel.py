"""Model parallelism inside a worker: the device mesh from the plan, tensor/sequence parallelism, FSDP2 on top.

The order of operations follows torchtitan's ``parallelize_llama`` (read, not copied): build one ``DeviceMesh``
whose dimensions are, outermost first, ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp`` (tensor parallelism
innermost, so its per-layer collectives stay inside a node, as the planner assumes); apply the tensor-parallel
layout with ``parallelize_module`` on the ``tp`` dimension; wrap the repeated blocks for activation checkpointing;
then ``fully_shard`` the blocks and the root over the data-parallel dimensions (a 2-D ``(dp_replicate, dp_shard)``
mesh is HSDP). A model built on the meta device is sharded first and only its local shards are materialised.

Each dimension's layout lives in its own module, called from :func:`parallelize`: tensor/sequence parallelism
(where the layout comes from, the Hugging Face translation, sequence boundaries) in ``_tensor.py``, pipeline
stages in ``_pipeline.py``, context parallelism in ``_context.py``, expert parallelism in ``_expert.py``,
activation checkpointing in ``_checkpointing.py`` (shared with the data-parallel strategies). What is left here is
the mesh, meta-device materialisation and pretrained loading, and the order of application, one recipe that a
reader follows top to bottom.

Where the layout comes from, in order: ``tp_plan=`` given to ``jd.wrap``; a Hugging Face model's own plan
(``config.base_model_tp_plan`` and the head's ``_tp_plan``, strings such as ``"colwise"`` translated to PyTorch's
``ParallelStyle`` objects); a model's ``tp_plan(sequence_parallel=...)`` method (the project's reference
:class:`jupyter_dist.models.Transformer` has one).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..plan.strategies import get_strategy
from ._checkpointing import (  # re-exported: these names have always been importable from here
    AC_MODES,
    apply_activation_checkpointing,
    checkpoint_attention_core,
    op_sac_context_fn,
    replace_blocks,
)
from ._env import WorkerEnv, WorkerError
from ._expert import add_expert_mesh, apply_expert_parallel, shard_experts
from ._tensor import (  # re-exported: the TP names have always been importable from here
    HF_STYLES,
    apply_tensor_parallel,
    check_tp_divisible,
    hf_stage_sequence_boundaries,
    modules_matching,
    resolve_tp_plan,
    tied_parameters,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "MESH_DIMS",
    "HF_STYLES",
    "Mesh",
    "build_mesh",
    "resolve_tp_plan",
    "check_tp_divisible",
    "apply_tensor_parallel",
    "apply_activation_checkpointing",
    "checkpoint_attention_core",
    "op_sac_context_fn",
    "replace_blocks",
    "AC_MODES",
    "materialize",
    "load_pretrained",
]

_log = logging.getLogger("jupyter_dist.worker")

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Mesh dimension names, outermost first (torchtitan's order)."""


@dataclass(frozen=True)
class Mesh:
    """The device mesh of this run and where this rank sits in it."""

    mesh: DeviceMesh
    """The world mesh, dimensions named after :data:`MESH_DIMS` (those of size > 1, and ``dp_shard``)."""
    sizes: dict[str, int]
    """Every dimension of :data:`MESH_DIMS` with its size (1 where the mesh has no such dimension)."""
    dp_size: int
    """Data-parallel replicas (``dp_replicate * dp_shard``): how many different batches one step sees."""
    expert: DeviceMesh | None = None
    """With expert parallelism, the ``(efsdp, ep)`` mesh carved from ``dp_shard x cp`` (see ``_expert.py``)."""

    def __getitem__(self, name: str | tuple[str, ...]) -> DeviceMesh:
        return self.mesh[name]

    @property
    def dp_dims(self) -> tuple[str, ...]:
        """The data-parallel dimensions present in the mesh (for ``fully_shard``)."""
        names = self.mesh.mesh_dim_names or ()
        return tuple(n for n in ("dp_replicate", "dp_shard") if n in names)

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The data-parallel sub-mesh: 1-D ``dp_shard``, or 2-D ``(dp_replicate, dp_shard)`` for HSDP."""
        dims = self.dp_dims
        return self.mesh[dims[0]] if len(dims) == 1 else self.mesh[dims]

    def describe(self) -> str:
        """E.g. ``"dp_shard=2 x tp=2"``."""
        names = self.mesh.mesh_dim_names or ()
        out = " x ".join(f"{n}={self.sizes[n]}" for n in names)
        if self.expert is not None:
            out += f" (experts: efsdp={self.expert['efsdp'].size()} x ep={self.expert['ep'].size()})"
        return out


def build_mesh(env: WorkerEnv, device_type: str) -> Mesh:
    """One ``DeviceMesh`` over the world with the plan's degrees (tp innermost); needs the process group."""
    from torch.distributed.device_mesh import init_device_mesh

    replicate = env.dp_replicate
    if env.strategy != "none" and get_strategy(env.strategy).hybrid and replicate == 1:
        # fsdp2-hybrid started without the launch contract's JD_DP_REPLICATE: shard inside a node, replicate across
        # nodes, counted as the planner and the launch count it
        from ..plan.parallel import DegreesDoNotDivide, ParallelDims

        try:  # the one "the degrees divide the world" check
            ParallelDims.split(env.world_size, tp=env.tp, pp=env.pp, cp=env.cp)
            divides = env.world_size % env.local_world_size == 0
        except DegreesDoNotDivide:
            divides = False
        if not divides:
            raise WorkerError(
                f"{env.strategy}: LOCAL_WORLD_SIZE {env.local_world_size} does not divide WORLD_SIZE "
                f"{env.world_size}, or pp x cp x tp ({env.pp * env.cp * env.tp}) does not"
            )
        replicate = env.dims.hybrid_replicas(env.local_world_size)
    shard = env.world_size // (env.pp * replicate * env.cp * env.tp)
    sizes = {"pp": env.pp, "dp_replicate": replicate, "dp_shard": shard, "cp": env.cp, "tp": env.tp}
    total = 1
    for v in sizes.values():
        total *= v
    if total != env.world_size:
        raise WorkerError(
            f"the mesh pp={env.pp} x dp_replicate={env.dp_replicate} x dp_shard={env.dp_shard} x cp={env.cp} x "
            f"tp={env.tp} = {total} does not cover the {env.world_size} processes"
        )
    names = tuple(n for n in MESH_DIMS if sizes[n] > 1 or n == "dp_shard")
    mesh = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)
    # this rank's data-parallel index is jd.dp_rank (Runtime.dp_rank), derived from the same row-major layout
    return Mesh(mesh=mesh, sizes=sizes, dp_size=sizes["dp_replicate"] * sizes["dp_shard"])


# ------------------------------------------------------------------------------------------ meta models, weights
def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Allocate a meta-built (and already sharded) model's local shards on ``device`` and initialise them."""
    import torch

    model.to_empty(device=device)
    if callable(getattr(model, "init_weights", None)) and not _is_hf(model):
        model.init_weights()
        return
    if _is_hf(model):
        for m in model.modules():
            for attr in ("_is_hf_initialized",):
                if hasattr(m, attr):
                    delattr(m, attr)
            for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
                if hasattr(t, "_is_hf_initialized"):
                    delattr(t, "_is_hf_initialized")
        with torch.no_grad():
            model.initialize_weights()
        return
    raise WorkerError(
        f"jd.wrap: {type(model).__name__} was built on the meta device and has no init_weights() to initialise its "
        "shards; give it one, or pass pretrained=DIR to load weights"
    )


def _is_hf(model: torch.nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__)


def load_pretrained(model: torch.nn.Module, path: str) -> int:
    """Load a Hugging Face safetensors checkpoint (a ``save_pretrained`` folder) into the sharded model.

    ``torch.distributed.checkpoint`` with its ``HuggingFaceStorageReader`` reads, on each rank, only the slices of
    each tensor that rank holds. Returns the number of tensors loaded. Tensors the model has and the folder lacks
    are an error naming them (a tied head is fine: it is the embedding).
    """
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    if not os.path.isdir(path):
        raise WorkerError(f"jd.wrap: pretrained={path!r} is not a folder (a save_pretrained output with *.safetensors)")
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    if not files:
        raise WorkerError(f"jd.wrap: pretrained={path!r} holds no *.safetensors file (save with save_pretrained)")
    reader = HuggingFaceStorageReader(path)
    available = set(reader.read_metadata().state_dict_metadata)
    state = get_model_state_dict(model)
    missing = sorted(k for k in state if k not in available)
    tied = {b for a, b in tied_parameters(model)}
    missing = [k for k in missing if k not in tied]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise WorkerError(f"jd.wrap: pretrained={path!r} lacks {len(missing)} tensor(s) of the model: {shown}")
    state = {k: v for k, v in state.items() if k in available}
    import torch.distributed as dist

    dcp.load(state, storage_reader=HuggingFaceStorageReader(path), no_dist=not dist.is_initialized())
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))
    return len(state)


# ------------------------------------------------------------------------------------------------------ together
def parallelize(env: WorkerEnv, model: torch.nn.Module, optimizer: Any, *, device: torch.device,
                tp_plan: Mapping[str, Any] | None = None, pretrained: str | None = None,
                family: str = "fsdp2") -> tuple[Any, Any, Mesh | None, Any]:  # fmt: skip
    """Apply the plan's model parallelism to ``model``; the order of torchtitan's ``parallelize_llama``.

    Mesh, pipeline stages, tensor parallelism, activation checkpointing, FSDP2 over the data-parallel dims,
    materialisation.
    ``family`` is ``"fsdp2"`` (shard model states over the data-parallel dims) or ``"none"`` (model parallelism
    alone; the data-parallel size must then be 1). Returns the model (under pipeline parallelism: this rank's part
    of it, which keeps the whole model's parameter names and refuses to be called), the optimizer rebuilt over the
    new parameters (``None`` stays ``None``), the mesh, and the :class:`~._pipeline.Pipeline` (or ``None``).
    """
    import torch

    from ._float8 import convert_float8
    from ._speed import compile_blocks
    from ._strategy import checkpoint_blocks, find_blocks, mixed_dtypes, param_names, rebuild_optimizer

    for dim, issue in ():  # every dimension runs; a new one starts here refused
        if getattr(env, dim) > 1:
            raise WorkerError(
                f"jd.wrap: {issue} parallelism ({dim}{getattr(env, dim)}) cannot run yet in this version; run a "
                f"candidate without it (e.g. fsdp2+tp{env.tp}) or set JD_{dim.upper()}=1"
            )
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):  # one process (family none, tp 1): no mesh to build
        on_meta = any(p.is_meta for p in model.parameters())
        old_names = param_names(model)
        if on_meta:
            materialize(model, device)
        else:
            model = model.to(device)
        if pretrained is not None:
            load_pretrained(model, pretrained)
        if optimizer is not None:
            optimizer = rebuild_optimizer(optimizer, old_names, model)
        return model, optimizer, None, None
    mesh = build_mesh(env, device.type)
    if env.ep > 1:
        mesh = add_expert_mesh(mesh, env, family=family)
    if family == "none" and mesh.dp_size > 1:
        raise WorkerError(
            f"jd.wrap: {mesh.dp_size} data-parallel replicas with JD_STRATEGY=none; use fsdp2 with model parallelism "
            f"(e.g. fsdp2+tp{env.tp}) or launch {env.world_size // mesh.dp_size} processes"
        )
    on_meta = any(p.is_meta for p in model.parameters())
    old_names = param_names(model)
    if env.cp > 1:
        from ._context import check_context_parallel

        check_context_parallel(env, model, family)
    plan = source = None
    if env.tp > 1:  # resolved and checked on the whole model, before a pipeline split removes parts of it
        plan, source = resolve_tp_plan(model, tp_plan, sequence_parallel=env.sp, tp=env.tp)
        check_tp_divisible(model, plan, env.tp)
    stage_plan = None
    aux_total = 0
    if env.pp > 1:
        from ._pipeline import aux_layers, prune

        aux_total = len(aux_layers(model))  # the whole model's MoE layers: the balance loss is their mean
        pp_rank = mesh["pp"].get_local_rank()
        stage_plan = prune(model, pp=env.pp, pp_rank=pp_rank, virtual=env.stages_per_rank)
    if env.precision == "bf16-true" and not on_meta:
        model = model.to(torch.bfloat16)
    if not on_meta:
        model = model.to(device)
    if plan is not None:
        if stage_plan is not None:  # the parts this rank dropped are not to be parallelised
            plan = {k: v for k, v in plan.items() if modules_matching(model, k)}
            if env.sp and stage_plan.hf:
                plan = hf_stage_sequence_boundaries(stage_plan, plan)
        apply_tensor_parallel(model, mesh["tp"], plan, on_meta=on_meta)
        if source and "jd.suggest_tp_plan" in source and env.rank == 0:  # once, in rank 0's log (a notice)
            _log.warning("jd.wrap: %s has no tp layout of its own; using %s: %s", type(model).__name__, source,
                         ", ".join(f"{k}: {type(v).__name__}" for k, v in plan.items()))  # fmt: skip
        _log.info("jd.wrap: tensor parallelism tp%d%s from %s", env.tp, " with sequence parallelism" * env.sp, source)
    if env.cp > 1:
        from ._context import apply_context_parallel

        n = apply_context_parallel(model, mesh, device.type)
        _log.info("jd.wrap: context parallelism cp%d over %d attention cores (ring attention)", env.cp, n)
    if env.ep > 1:
        apply_expert_parallel(model, mesh, on_meta=on_meta)
    convert_float8(env, model, find_blocks(model), device, family=family)  # torchtitan: float8 before checkpointing
    blocks = checkpoint_blocks(env, model)
    compile_blocks(env, blocks, device)  # torchtitan's apply_compile: after tp and checkpointing, before fully_shard
    views = stage_plan.views(model) if stage_plan is not None else []
    if family == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mixed = mixed_dtypes(env.precision)
        mp = MixedPrecisionPolicy(param_dtype=mixed[0], reduce_dtype=mixed[1]) if mixed else MixedPrecisionPolicy()
        if env.cp > 1:
            from ._context import fsdp_mesh

            dp_mesh = fsdp_mesh(mesh)  # cp ranks shard model states with the dp ranks
        else:
            dp_mesh = mesh.dp_mesh
        keep: dict[str, Any] = {"reshard_after_forward": env.reshard_after_forward}
        if plan is not None and any(hasattr(v, "parts") for v in plan.values()):  # a fused projection's layout
            from ._tp_layout import fused_placement_fn

            keep["shard_placement_fn"] = fused_placement_fn(dp_mesh.shape[-1])
        if env.zero1_as_fsdp2 and env.rank == 0:  # once, in rank 0's log (a notice: the default handler shows it)
            _log.warning(
                "jd.wrap: zero1 with model parallelism runs as FSDP2 with reshard_after_forward=False over the "
                "data-parallel dims (%s): optimizer states and gradients sharded, parameters kept from forward to "
                "backward (at most ZeRO-1's memory; all-gather + reduce-scatter, the volume of its all-reduce)",
                mesh.describe(),
            )
        if env.ep > 1:
            shard_experts(model, mesh, mp, reshard_after_forward=env.reshard_after_forward)
        for block in blocks:
            fully_shard(block, mesh=dp_mesh, mp_policy=mp, **keep)
        for _, view in views:  # each stage is an FSDP root of its own (its edge parts are its direct parameters)
            fully_shard(view, mesh=dp_mesh, mp_policy=mp, **keep)
        if not views:
            fully_shard(model, mesh=dp_mesh, mp_policy=mp, **keep)
    if on_meta:
        materialize(model, device)
        if env.precision == "bf16-true":
            model = model.to(torch.bfloat16)
    if pretrained is not None:
        n = load_pretrained(model, pretrained)
        _log.info("jd.wrap: loaded %d tensors from %s, each rank reading its own slices", n, pretrained)
    if optimizer is not None:
        optimizer = rebuild_optimizer(optimizer, old_names, model, pruned=stage_plan is not None)
    pipeline = None
    if views:
        from ._pipeline import Pipeline

        container = stage_plan.container if stage_plan is not None else "layers"
        pipeline = Pipeline(env, views, mesh["pp"].get_group(), device, model=model, container=container,
                            aux_total=aux_total)  # fmt: skip
        if env.cp > 1:  # each stage's forward gets this rank's positions (after the balance-loss carry's pre-hook)
            from ._context import positions_hook

            hook = positions_hook(mesh["cp"], hf=stage_plan is not None and stage_plan.hf)
            for stage in pipeline.stages:
                stage.submod.register_forward_pre_hook(hook, with_kwargs=True)
        _refuse_direct_calls(model, env.pp)
    return model, optimizer, mesh, pipeline


def _refuse_direct_calls(model: torch.nn.Module, pp: int) -> None:
    def forward(*args: Any, **kwargs: Any) -> Any:
        raise WorkerError(
            f"under pipeline parallelism (pp{pp}) the model runs stage by stage over micro-batches: use "
            "loss = jd.train_step(inputs, targets, loss_fn) instead of calling the model"
        )

    model.forward = forward  # type: ignore[method-assign]
