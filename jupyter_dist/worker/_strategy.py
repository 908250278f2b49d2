"""Apply the planned strategy to a model and optimizer with the real libraries (torch imported lazily)."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from ..plan.strategies import get_strategy
from ._env import WorkerEnv, WorkerError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["find_blocks", "apply_strategy", "rebuild_optimizer", "FSDP1_NEEDS_GPU"]

FSDP1_NEEDS_GPU = (
    "jupyter_dist: strategy {name!r} uses the FSDP1 wrapper (FullyShardedDataParallel), which PyTorch runs only on "
    "a GPU/accelerator; on CPU use JD_STRATEGY=fsdp2 (fully_shard), which shards the same way over gloo."
)

_FSDP1_SHARDING = {
    "fsdp-full-shard": "FULL_SHARD",
    "fsdp-shard-grad-op": "SHARD_GRAD_OP",
    "fsdp-hybrid-shard": "HYBRID_SHARD",
    "fsdp-no-shard": "NO_SHARD",
}


def find_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of ``model``: children of its largest ``ModuleList``/``ModuleDict`` of one class.

    "Largest" counts parameters, then children. Answers ``[]`` when the model has no such container.
    """
    import torch.nn as nn

    best: list[nn.Module] = []
    best_key = (0, 0)
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            children = list(module)
        elif isinstance(module, nn.ModuleDict):
            children = list(module.values())
        else:
            continue
        if not children or len({type(c) for c in children}) != 1:
            continue
        key = (sum(p.numel() for c in children for p in c.parameters()), len(children))
        if key > best_key:
            best, best_key = children, key
    return best


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def _clean(name: str) -> str:
    for prefix in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(prefix, "")
    return name


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer, old_names: dict[int, str], model: torch.nn.Module, *, pruned: bool = False
) -> torch.optim.Optimizer:
    """A new optimizer of the same class and param groups over ``model``'s (replaced) parameters, matched by name.

    Wrappers that swap parameter objects (FSDP2 turns them into DTensors, FSDP1 into flat-parameter views) would
    otherwise leave the optimizer updating tensors the model no longer uses. ``pruned``: the model dropped parts
    that live on other ranks (pipeline stages); their parameters leave the optimizer (and so do emptied groups).
    """
    if optimizer.state:
        raise WorkerError(
            f"jd.wrap: the {type(optimizer).__name__} already has state (a step was taken); call jd.wrap(model, "
            "optimizer) before the first optimizer.step(), or create the optimizer after jd.wrap"
        )
    new_by_name = {_clean(n): p for n, p in model.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            name = old_names.get(id(p))
            if pruned and name is not None and _clean(name) not in new_by_name:
                continue  # held by another pipeline stage
            if name is None or _clean(name) not in new_by_name:
                raise WorkerError(
                    f"jd.wrap: the optimizer holds a parameter (shape {tuple(p.shape)}) that is not a parameter of "
                    "the model; create the optimizer over model.parameters() or after jd.wrap"
                )
            params.append(new_by_name[_clean(name)])
        if params or not pruned:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    cls = type(optimizer)
    defaults = dict(optimizer.defaults)
    sig = inspect.signature(cls.__init__)
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        defaults = {k: v for k, v in defaults.items() if k in sig.parameters}
    try:
        return cls(groups, **defaults)
    except TypeError as e:
        raise WorkerError(
            f"jd.wrap: could not rebuild {cls.__name__}(param_groups, **defaults) over the sharded parameters ({e}); "
            "create the optimizer after jd.wrap(model) instead"
        ) from e


def _dtype(name: str | None) -> Any:
    import torch

    return {None: None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _mixed(precision: str) -> tuple[Any, Any] | None:
    """(param dtype, reduce dtype) for the *-mixed precisions, else None."""
    if precision == "bf16-mixed":
        return _dtype("bf16"), _dtype("fp32")
    if precision == "fp16-mixed":
        return _dtype("fp16"), _dtype("fp32")
    return None


def require_process_group(name: str) -> None:
    """One line when a distributed strategy is asked for in a process torchrun did not start."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise WorkerError(
            f"JD_STRATEGY={name} needs a process group, and this process was not started by torchrun "
            "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT unset); run the cell with %%dist_train, or set "
            "JD_STRATEGY=none"
        )


def apply_strategy(env: WorkerEnv, model: torch.nn.Module, optimizer: Any, *, device: torch.device,
                   comm_stats: Any = None) -> tuple[Any, Any]:  # fmt: skip
    """Wrap ``model`` (and rebuild or wrap ``optimizer``) for ``env.strategy``; see :func:`jupyter_dist.worker.wrap`."""
    import torch

    name = env.strategy
    if name == "none":
        return model, optimizer
    family = get_strategy(name).family
    require_process_group(name)
    if env.precision == "bf16-true" and family != "deepspeed":
        model = model.to(torch.bfloat16)

    if family == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = model.to(device)
        ids = [device.index] if device.type == "cuda" else None
        ddp = DDP(model, device_ids=ids, gradient_as_bucket_view=True)
        if comm_stats is not None:
            from ._comm import ddp_timing_hook

            ddp.register_comm_hook(None, ddp_timing_hook(comm_stats))
        return ddp, optimizer

    if family == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if get_strategy(name).hybrid:
            shard = env.local_world_size
            if shard < 1 or env.world_size % shard:
                raise WorkerError(f"{name}: world size {env.world_size} is not a multiple of LOCAL_WORLD_SIZE {shard}")
            mesh = init_device_mesh(
                device.type, (env.world_size // shard, shard), mesh_dim_names=("replicate", "shard")
            )
        else:
            mesh = init_device_mesh(device.type, (env.world_size,), mesh_dim_names=("shard",))
        mixed = _mixed(env.precision)
        mp = MixedPrecisionPolicy(param_dtype=mixed[0], reduce_dtype=mixed[1]) if mixed else MixedPrecisionPolicy()
        old_names = _param_names(model)
        for block in find_blocks(model):
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        if optimizer is not None:
            optimizer = rebuild_optimizer(optimizer, old_names, model)
        return model, optimizer

    if family == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        blocks = find_blocks(model)
        policy = ModuleWrapPolicy({type(blocks[0])}) if blocks else None
        mixed = _mixed(env.precision)
        kwargs: dict[str, Any] = {}
        if get_strategy(name).hybrid:
            from torch.distributed.device_mesh import init_device_mesh

            shard = env.local_world_size
            kwargs["device_mesh"] = init_device_mesh(device.type, (env.world_size // shard, shard))
        old_names = _param_names(model)
        try:
            model = FSDP(
                model,
                sharding_strategy=getattr(ShardingStrategy, _FSDP1_SHARDING[name]),
                auto_wrap_policy=policy,
                mixed_precision=(
                    MixedPrecision(param_dtype=mixed[0], reduce_dtype=mixed[1], buffer_dtype=mixed[0])
                    if mixed
                    else None
                ),
                device_id=device if device.type != "cpu" else None,
                use_orig_params=True,
                **kwargs,
            )
        except Exception as e:
            if device.type == "cpu":
                prefix = FSDP1_NEEDS_GPU.format(name=name)
                if e.args and isinstance(e.args[0], str):
                    e.args = (f"{prefix}\n{e.args[0]}", *e.args[1:])
                else:
                    e.args = (prefix, *e.args)
            raise
        if optimizer is not None:
            optimizer = rebuild_optimizer(optimizer, old_names, model)
        return model, optimizer

    if family == "deepspeed":
        if not env.ds_config:
            raise WorkerError(f"JD_STRATEGY={name} needs JD_DS_CONFIG, the path of the DeepSpeed JSON; it is unset")
        try:
            import deepspeed
        except ImportError as e:
            from ..errors import MissingDependencyError

            raise MissingDependencyError(
                f"JD_STRATEGY={name} needs DeepSpeed: pip install 'jupyter_dist[deepspeed]' ({e})"
            ) from e
        kwargs = {"model_parameters": [p for p in model.parameters() if p.requires_grad]} if optimizer is None else {}
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=env.ds_config, **kwargs
        )
        return engine, ds_optimizer

    raise WorkerError(f"JD_STRATEGY={name}: family {family!r} is not supported by jd.wrap")  # pragma: no cover
