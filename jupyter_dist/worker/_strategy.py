"""Apply the planned strategy to a model and optimizer with the real libraries (torch imported lazily)."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from ..plan.strategies import FSDP1_SHARDING, get_strategy
from ..plan.training import Precision
from ._env import WorkerEnv, WorkerError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "find_blocks", "checkpoint_blocks", "apply_strategy", "rebuild_optimizer", "deepspeed_client_optimizer",
    "FSDP1_NEEDS_GPU", "mixed_dtypes", "param_names",
]  # fmt: skip

_log = logging.getLogger("jupyter_dist.worker")

FSDP1_NEEDS_GPU = (
    "jupyter_dist: strategy {name!r} uses the FSDP1 wrapper (FullyShardedDataParallel), which failed on CPU (it "
    "trains there with device_id=cpu, but parts such as sync_module_states need a GPU); use JD_STRATEGY=fsdp2 "
    "(fully_shard), which shards the same way over gloo."
)


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


def param_names(model: torch.nn.Module) -> dict[int, str]:
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
    """Point ``optimizer``'s param groups at ``model``'s (replaced) parameters, matched by name; returns it.

    Wrappers that swap parameter objects (FSDP2 turns them into DTensors, FSDP1 into flat-parameter views) would
    otherwise leave the optimizer updating tensors the model no longer uses. The optimizer object and its param-group
    dicts stay the same (only each group's ``params`` list is replaced), so an LR scheduler built on it before
    :func:`apply_strategy` keeps driving the learning rate the optimizer uses. ``pruned``: the model dropped parts
    that live on other ranks (pipeline stages); their parameters leave the optimizer (a group may end up empty).
    """
    if optimizer.state:
        raise WorkerError(
            f"jd.wrap: the {type(optimizer).__name__} already has state (a step was taken); call jd.wrap(model, "
            "optimizer) before the first optimizer.step(), or create the optimizer after jd.wrap"
        )
    new_by_name = {_clean(n): p for n, p in model.named_parameters()}
    new_params = []
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
        new_params.append(params)
    for group, params in zip(optimizer.param_groups, new_params, strict=True):  # all found: now change it
        group["params"] = params
    return optimizer


def _dtype(name: str | None) -> Any:
    import torch

    return {None: None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def mixed_dtypes(precision: str) -> tuple[Any, Any] | None:
    """(param dtype, reduce dtype) for the *-mixed precisions and fp8 (bf16 around its float8 linears), else None."""
    p = Precision(precision)
    return (_dtype(p.compute_dtype), _dtype("fp32")) if p.is_mixed else None


def require_process_group(name: str) -> None:
    """One line when a distributed strategy is asked for in a process torchrun did not start."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise WorkerError(
            f"JD_STRATEGY={name} needs a process group, and this process was not started by torchrun "
            "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT unset); run the cell with %%dist_train, or set "
            "JD_STRATEGY=none"
        )


def checkpoint_blocks(env: WorkerEnv, model: torch.nn.Module) -> list[torch.nn.Module]:
    """Apply ``JD_AC`` to the model's repeated blocks in place; answers the blocks as they now sit in the model.

    Every strategy checkpoints the same blocks the same way (the plan's memory assumes it): DDP, FSDP1, DeepSpeed
    and no strategy here, FSDP2 and the model-parallel layouts in :func:`._parallel.parallelize`. A model without
    repeated blocks runs without checkpointing, and rank 0's log says so.
    """
    blocks = find_blocks(model)
    if env.ac == "none":
        return blocks
    if not blocks:
        if env.rank == 0:
            _log.warning("jd.wrap: JD_AC=%s, but the model has no repeated blocks (a ModuleList or ModuleDict of one "
                         "class) to checkpoint: it runs without activation checkpointing", env.ac)  # fmt: skip
        return blocks
    from ._checkpointing import apply_activation_checkpointing, replace_blocks

    wrapped = apply_activation_checkpointing(blocks, env.ac)
    replace_blocks(model, blocks, wrapped)
    if env.rank == 0:
        _log.info("jd.wrap: activation checkpointing %s of %d blocks", env.ac, len(blocks))
    return wrapped


def apply_strategy(env: WorkerEnv, model: torch.nn.Module, optimizer: Any, *, device: torch.device,
                   comm_stats: Any = None) -> tuple[Any, Any]:  # fmt: skip
    """Wrap ``model`` (and rebuild or wrap ``optimizer``) for ``env.strategy``; see :func:`jupyter_dist.worker.wrap`.

    The single-mesh wrappers: none, DDP, the FSDP1 wrapper and DeepSpeed. FSDP2 (and anything on a device mesh) is
    :func:`._parallel.parallelize`'s: :meth:`._training.TrainingVerbs.wrap` sends it there.
    """
    import torch

    from ._float8 import convert_float8
    from ._speed import compile_blocks

    name = env.strategy
    family = get_strategy(name).family if name != "none" else "none"
    convert_float8(env, model, find_blocks(model), device, family=family)  # before any wrapper, as torchtitan does
    blocks = checkpoint_blocks(env, model)
    compile_blocks(env, blocks, device)  # torchtitan's order: after activation checkpointing, before the wrapper
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

    if family == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        # the blocks' own class: under ``layer:K`` only some are inside a CheckpointWrapper, and FSDP1 wraps the
        # inner block either way (the wrapper, holding no parameters of its own, stays outside the unit)
        inner = [getattr(b, "_checkpoint_wrapped_module", b) for b in blocks]
        policy = ModuleWrapPolicy({type(inner[0])}) if inner else None
        mixed = mixed_dtypes(env.precision)
        kwargs: dict[str, Any] = {}
        if get_strategy(name).hybrid:
            from torch.distributed.device_mesh import init_device_mesh

            shard = env.local_world_size
            kwargs["device_mesh"] = init_device_mesh(device.type, (env.world_size // shard, shard))
        old_names = param_names(model)
        try:
            model = FSDP(
                model,
                sharding_strategy=getattr(ShardingStrategy, FSDP1_SHARDING[name]),
                auto_wrap_policy=policy,
                mixed_precision=(
                    MixedPrecision(param_dtype=mixed[0], reduce_dtype=mixed[1], buffer_dtype=mixed[0])
                    if mixed
                    else None
                ),
                device_id=device,  # on CPU too: without it FSDP1 looks for an accelerator and refuses
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
        from ._oplocks import stale_lock_guard

        config = _load_ds_config(name, env.ds_config)
        if optimizer is not None:
            optimizer, config = deepspeed_client_optimizer(name, optimizer, config, rank=env.rank)
        kwargs = {"model_parameters": [p for p in model.parameters() if p.requires_grad]} if optimizer is None else {}
        with stale_lock_guard():  # a killed op load leaves a lock that every later load would wait on forever
            engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, **kwargs)
        return engine, ds_optimizer

    raise WorkerError(  # pragma: no cover
        f"JD_STRATEGY={name}: family {family!r} has no single-mesh wrapper (FSDP2 runs through _parallel.parallelize)"
    )


def _load_ds_config(name: str, path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise WorkerError(f"JD_STRATEGY={name}: cannot read the DeepSpeed JSON JD_DS_CONFIG={path!r}: {e}") from e
    if not isinstance(config, dict):
        raise WorkerError(f"JD_STRATEGY={name}: JD_DS_CONFIG={path!r} holds {type(config).__name__}, not an object")
    return config


# torch optimizers whose update is element-wise, so stepping ZeRO's flat 1-D partitions equals stepping the
# parameters one by one (Adafactor, Muon, LBFGS are not: they use the shape or the whole vector)
_ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "NAdam", "RAdam", "ASGD", "Rprop")


def deepspeed_client_optimizer(
    name: str, optimizer: Any, config: dict[str, Any], *, rank: int = 0
) -> tuple[Any, dict[str, Any]]:
    """The optimizer and config to hand to ``deepspeed.initialize`` for the user's torch ``optimizer``.

    * ZeRO-Offload (``offload_optimizer`` on ``cpu``/``nvme``) with ``torch.optim.Adam``/``AdamW``: DeepSpeed refuses a
      client optimizer there (ZeRORuntimeException), so this builds ``DeepSpeedCPUAdam`` (``adamw_mode`` from the class)
      with the user's hyperparameters over the *same param-group dicts*: an LR scheduler built on the user's
      optimizer, before or after ``jd.wrap``, changes the ``lr`` that DeepSpeedCPUAdam reads at every step.
    * Offload with another element-wise torch optimizer (SGD, Adagrad, ...): it runs as given on the offloaded fp32
      partitions (``zero_force_ds_cpu_optimizer: false``).
    * ZeRO with an element-wise optimizer DeepSpeed has not tested (SGD, ...): allowed
      (``zero_allow_untested_optimizer: true``); one that is not element-wise is refused, unless the config allows it.

    Each change is said once, in one log line on rank 0. ``config`` is not modified; a changed copy is returned.
    """
    import torch

    zero = config.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0) or 0)
    offload = str((zero.get("offload_optimizer") or {}).get("device", "none")).lower() in ("cpu", "nvme")
    cls = type(optimizer)
    out = dict(config)
    notes: list[str] = []
    if offload and cls in (torch.optim.Adam, torch.optim.AdamW):
        optimizer = _cpu_adam(name, optimizer)
        notes.append(
            f"{name} offloads the optimizer: your torch.optim.{cls.__name__} runs as DeepSpeedCPUAdam "
            f"(adamw_mode={optimizer.adam_w_mode}) with its hyperparameters and {len(optimizer.param_groups)} "
            "param group(s)"
        )
    elif stage > 0 or offload:
        elementwise = cls.__module__.startswith("torch.optim") and cls.__name__ in _ELEMENTWISE
        from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

        supported = isinstance(optimizer, tuple(ZERO_SUPPORTED_OPTIMIZERS))
        if not supported and not config.get("zero_allow_untested_optimizer"):
            if not elementwise:
                raise WorkerError(
                    f"jd.wrap: {name} cannot run {cls.__module__}.{cls.__name__}: ZeRO steps flat 1-D partitions of "
                    "the parameters and this optimizer is not an element-wise torch optimizer; use torch.optim."
                    f"AdamW/Adam/SGD/Adagrad/RMSprop (or {', '.join(_ELEMENTWISE[4:])}), or --strategy fsdp2 / ddp"
                )
            out["zero_allow_untested_optimizer"] = True
            notes.append(f"{name}: torch.optim.{cls.__name__} runs under ZeRO (zero_allow_untested_optimizer)")
        if offload and config.get("zero_force_ds_cpu_optimizer", True):
            out["zero_force_ds_cpu_optimizer"] = False
            notes.append(
                f"{name} offloads the optimizer: your {cls.__name__} has no DeepSpeed CPU twin and steps the "
                "offloaded fp32 partitions on the CPU as given (zero_force_ds_cpu_optimizer=false)"
            )
    if notes and rank == 0:
        _log.warning("jupyter_dist.worker: %s", "; ".join(notes))
    return optimizer, out


def _cpu_adam(name: str, optimizer: Any) -> Any:
    """``DeepSpeedCPUAdam`` sharing ``optimizer``'s param-group dicts (see :func:`deepspeed_client_optimizer`)."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    cls = type(optimizer).__name__
    if optimizer.state:
        raise WorkerError(
            f"jd.wrap: the {cls} already has state (a step was taken); call jd.wrap(model, optimizer) before the "
            "first optimizer.step()"
        )
    for group in optimizer.param_groups:
        for key in ("amsgrad", "maximize"):
            if group.get(key):
                raise WorkerError(
                    f"jd.wrap: {name} offloads the optimizer to DeepSpeedCPUAdam, which has no {key}=True; use "
                    f"torch.optim.{cls}({key}=False) or a strategy without offload (zero2, zero3, fsdp2)"
                )
    d = optimizer.defaults
    adamw = isinstance(optimizer, torch.optim.AdamW) or bool(d.get("decoupled_weight_decay"))
    betas = tuple(float(b) for b in d["betas"])
    cpu = DeepSpeedCPUAdam(optimizer.param_groups, lr=float(d["lr"]), betas=betas, eps=float(d["eps"]),
                           weight_decay=float(d["weight_decay"]), adamw_mode=adamw)  # fmt: skip
    for group in cpu.param_groups:  # DeepSpeedCPUAdam's C++ step takes floats; torch allows a tensor lr
        if isinstance(group["lr"], torch.Tensor):
            group["lr"] = float(group["lr"])
    # a scheduler built on the user's optimizer checks at its first step() that this optimizer stepped first
    inner = cpu.step

    def step(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True
        return inner(*args, **kwargs)

    cpu.step = step
    return cpu
