"""The plan's DeepSpeed candidate as a DeepSpeed config dict / JSON (pure, stdlib only).

The renderer works in two steps, as accelerate's ``DeepSpeedPlugin`` does with ``plugin_to_config_mapping``:

1. :func:`deepspeed_fields` decides *flat* values from the resolved :class:`~jupyter_dist.render.common.Layout`
   and the options (``zero_stage=3``, ``micro_batch=2``, ``reduce_bucket_size=...``); ``None`` means "leave the
   key out";
2. :func:`nest` places each flat value at the nested DeepSpeed key that :data:`DEEPSPEED_CONFIG_MAP` names
   (``"zero_stage" -> "zero_optimization.stage"``).

Every leaf of the result therefore comes from the one table, which is what the tests check. Every value is
decided here or by the plan: no ``"auto"`` placeholders, since no trainer fills them in later. Bucket sizes come
from ``Layout.settings``, the numbers the memory plan counted, so the plan and the config agree.

DeepSpeed validates the keys *inside* most sections (pydantic, ``extra="forbid"``) but silently ignores unknown
top-level keys and unknown keys of its older, dict-based sections (``activation_checkpointing``, ``optimizer``),
and optimizer parameters fail only when ``deepspeed.initialize`` builds the optimizer on the cluster;
:func:`check_deepspeed_keys` checks those against :data:`DEEPSPEED_KNOWN_KEYS` (DeepSpeed 0.19) at render time.
"""

from __future__ import annotations

import json
from typing import Any

from ..plan.plan import Plan
from ..plan.strategies import STRATEGIES, StrategySpec, get_strategy
from ..plan.training import Checkpointing, OptimizerKind, Precision, fp8_strategy_problem
from .common import Layout, RenderError, RenderOptions, layout_of

__all__ = [
    "DEEPSPEED_CONFIG_MAP",
    "DEEPSPEED_KNOWN_KEYS",
    "DEEPSPEED_STRATEGIES",
    "check_deepspeed_keys",
    "deepspeed_fields",
    "nest",
    "render_deepspeed",
    "render_deepspeed_json",
    "zero_stage",
]

DEEPSPEED_CONFIG_MAP: dict[str, str] = {
    # batch: train_batch_size = micro x accumulation x data-parallel size (DeepSpeed asserts the identity)
    "micro_batch": "train_micro_batch_size_per_gpu",
    "grad_accum": "gradient_accumulation_steps",
    "global_batch": "train_batch_size",
    "grad_clip": "gradient_clipping",
    "steps_per_print": "steps_per_print",
    "wall_clock_breakdown": "wall_clock_breakdown",
    # client optimizers (8-bit AdamW, SGD) under ZeRO / with offload
    "allow_untested_optimizer": "zero_allow_untested_optimizer",
    "force_ds_cpu_optimizer": "zero_force_ds_cpu_optimizer",
    # precision
    "bf16": "bf16.enabled",
    "bf16_master_weights": "bf16.bf16_master_weights_and_grads",
    "bf16_optimizer_states": "bf16.bf16_optimizer_states",
    "fp16": "fp16.enabled",
    "loss_scale": "fp16.loss_scale",
    "initial_scale_power": "fp16.initial_scale_power",
    "loss_scale_window": "fp16.loss_scale_window",
    "hysteresis": "fp16.hysteresis",
    "min_loss_scale": "fp16.min_loss_scale",
    # ZeRO
    "zero_stage": "zero_optimization.stage",
    "overlap_comm": "zero_optimization.overlap_comm",
    "contiguous_gradients": "zero_optimization.contiguous_gradients",
    "reduce_scatter": "zero_optimization.reduce_scatter",
    "reduce_bucket_size": "zero_optimization.reduce_bucket_size",
    "allgather_bucket_size": "zero_optimization.allgather_bucket_size",
    "stage3_prefetch_bucket_size": "zero_optimization.stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold": "zero_optimization.stage3_param_persistence_threshold",
    "stage3_max_live_parameters": "zero_optimization.stage3_max_live_parameters",
    "stage3_max_reuse_distance": "zero_optimization.stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "offload_optimizer_pin_memory": "zero_optimization.offload_optimizer.pin_memory",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "offload_param_pin_memory": "zero_optimization.offload_param.pin_memory",
    # optimizer (AdamW only; other optimizers are passed by the client to deepspeed.initialize)
    "optimizer_type": "optimizer.type",
    "lr": "optimizer.params.lr",
    "betas": "optimizer.params.betas",
    "eps": "optimizer.params.eps",
    "weight_decay": "optimizer.params.weight_decay",
    # activation checkpointing (configures deepspeed.checkpointing.checkpoint, which the model code calls)
    "partition_activations": "activation_checkpointing.partition_activations",
    "cpu_checkpointing": "activation_checkpointing.cpu_checkpointing",
    "contiguous_memory_optimization": "activation_checkpointing.contiguous_memory_optimization",
    "synchronize_checkpoint_boundary": "activation_checkpointing.synchronize_checkpoint_boundary",
}
"""Flat field -> dotted DeepSpeed key. The one place where the nesting of the DeepSpeed config is written."""

DEEPSPEED_KNOWN_KEYS: dict[str, frozenset[str]] = {
    "": frozenset({
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
        "scheduler", "zero_optimization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
        "steps_per_print", "gradient_clipping", "fp16", "bf16", "torch_autocast", "communication_data_type",
        "prescale_gradients", "gradient_predivide_factor", "gradient_allreduce_op", "activation_checkpointing",
        "wall_clock_breakdown", "memory_breakdown", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet",
        "comms_logger", "checkpoint", "data_types", "aio", "dataloader_drop_last", "pipeline", "compile", "timers",
        "tensor_parallel", "autotuning", "data_efficiency", "hybrid_engine", "dump_state", "disable_allgather",
    }),
    "activation_checkpointing": frozenset({
        "partition_activations", "number_checkpoints", "contiguous_memory_optimization",
        "synchronize_checkpoint_boundary", "profile", "cpu_checkpointing",
    }),
    "optimizer": frozenset({"type", "params", "legacy_fusion"}),
    "optimizer.params": frozenset({"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam"}),
}  # fmt: skip
"""Keys DeepSpeed 0.19 reads where its config class does not reject unknown ones: top level (``""``), dict sections,
and the AdamW parameters we write."""

DEEPSPEED_STRATEGIES: tuple[str, ...] = tuple(s.name for s in STRATEGIES.values() if s.family == "deepspeed")
"""Strategies that have a DeepSpeed config."""

STEPS_PER_PRINT = 100
"""DeepSpeed's own progress line every this many steps (our telemetry does the real logging)."""

_FP16_DYNAMIC_LOSS_SCALE: dict[str, Any] = {
    "loss_scale": 0,  # 0 = dynamic loss scaling
    "initial_scale_power": 16,  # start at 2^16
    "loss_scale_window": 1000,  # raise the scale after this many steps without overflow
    "hysteresis": 2,  # overflows tolerated before the scale is lowered
    "min_loss_scale": 1,
}
"""DeepSpeed's documented defaults for dynamic loss scaling, written out so the JSON says what it does."""

_SETTINGS_ALL_STAGES = ("reduce_bucket_size", "allgather_bucket_size")
_SETTINGS_STAGE3 = (
    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
)  # fmt: skip


def zero_stage(strategy: StrategySpec) -> int:
    """ZeRO stage of a DeepSpeed strategy: 3 shards parameters, 2 gradients, 1 optimizer states only."""
    if strategy.shard_params:
        return 3
    if strategy.shard_grads:
        return 2
    return 1 if strategy.shard_optimizer else 0


def deepspeed_fields(layout: Layout, opts: RenderOptions | None = None) -> dict[str, Any]:
    """Flat values of the DeepSpeed config (keys of :data:`DEEPSPEED_CONFIG_MAP`); ``None`` omits a key."""
    opts = opts or RenderOptions()
    # the planned strategy, not the run's: zero1 with tp/pp/cp/ep runs as FSDP2 (no bundle writes its DeepSpeed
    # config), but asked for explicitly (e.g. for Megatron-DeepSpeed) its config is ZeRO-1's
    spec = get_strategy(layout.candidate.strategy)
    if spec.family != "deepspeed":
        raise RenderError(
            f"candidate {layout.candidate.name!r} ({spec.label}) has no DeepSpeed config; DeepSpeed configs exist "
            f"for {', '.join(DEEPSPEED_STRATEGIES)}: pick one with RenderOptions(candidate=...)"
        )
    stage = zero_stage(spec)
    offloads = spec.offload_optimizer or spec.offload_params
    if opts.nvme_path is not None and not offloads:
        raise RenderError(
            f"nvme_path is set but {spec.name} offloads nothing; use zero3-offload or zero3-offload-params "
            "for NVMe offload, or drop nvme_path"
        )
    if opts.nvme_path is not None and stage != 3:
        raise RenderError(
            f"NVMe offload needs ZeRO-3 (ZeRO-Infinity), but {spec.name} is ZeRO-{stage}, which would keep the "
            "offloaded states in CPU memory; use zero3-offload or zero3-offload-params, or drop nvme_path"
        )
    settings = layout.settings
    needed = _SETTINGS_ALL_STAGES + (_SETTINGS_STAGE3 if stage == 3 else ())
    missing = [k for k in needed if k not in settings]
    if missing:
        raise RenderError(
            f"candidate {layout.candidate.name!r} lacks the plan setting(s) {', '.join(missing)} that the "
            "DeepSpeed config needs (a plan saved by an older jupyter-dist?); plan again"
        )
    device = "nvme" if opts.nvme_path is not None else "cpu"
    client_optimizer = layout.optimizer is not OptimizerKind.ADAMW
    precision = layout.precision
    checkpointing = layout.checkpointing is not Checkpointing.NONE
    out: dict[str, Any] = {
        "micro_batch": layout.micro_batch,
        "grad_accum": layout.grad_accum,
        "global_batch": layout.global_batch,  # micro x accumulation x dims.dp: tp/pp/cp ranks do not add samples
        "grad_clip": opts.grad_clip,  # 0.0 disables clipping
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
        # 8-bit AdamW and SGD: DeepSpeed does not build them from a config, so the client passes its optimizer
        # to deepspeed.initialize(optimizer=...); ZeRO then wants it allowed explicitly, and with offload it
        # refuses any optimizer but DeepSpeedCPUAdam unless told otherwise (the client's step runs on CPU).
        "allow_untested_optimizer": True if client_optimizer else None,
        "force_ds_cpu_optimizer": False if client_optimizer and offloads else None,
        # bf16-true keeps master weights, gradients and optimizer states in bf16 (ZeRO 1-3 only), as planned
        "bf16": precision in (Precision.BF16_MIXED, Precision.BF16_TRUE),
        "bf16_master_weights": True if precision is Precision.BF16_TRUE else None,
        "bf16_optimizer_states": True if precision is Precision.BF16_TRUE else None,
        "fp16": precision is Precision.FP16_MIXED,
        **{k: (v if precision is Precision.FP16_MIXED else None) for k, v in _FP16_DYNAMIC_LOSS_SCALE.items()},
        "zero_stage": stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        **{k: int(settings[k]) for k in needed},
        "stage3_gather_16bit_weights_on_model_save": True if stage == 3 else None,
        "offload_optimizer_device": device if spec.offload_optimizer else None,
        "offload_optimizer_nvme_path": opts.nvme_path if spec.offload_optimizer else None,
        "offload_optimizer_pin_memory": True if spec.offload_optimizer else None,
        "offload_param_device": device if spec.offload_params else None,
        "offload_param_nvme_path": opts.nvme_path if spec.offload_params else None,
        "offload_param_pin_memory": True if spec.offload_params else None,
        # AdamW with torch's defaults for betas/eps, so it matches the FSDP/DDP code rendered from the same plan;
        # DeepSpeed builds FusedAdam from it (DeepSpeedCPUAdam with optimizer offload)
        "optimizer_type": None if client_optimizer else "AdamW",
        "lr": None if client_optimizer else opts.lr,
        "betas": None if client_optimizer else [0.9, 0.999],
        "eps": None if client_optimizer else 1e-8,
        "weight_decay": None if client_optimizer else opts.weight_decay,
        # full and selective recomputation look the same to DeepSpeed: the model code decides what to recompute;
        # partitioning the saved activations only helps across tensor-parallel ranks
        "partition_activations": layout.dims.tp > 1 if checkpointing else None,
        "cpu_checkpointing": False if checkpointing else None,
        "contiguous_memory_optimization": False if checkpointing else None,
        "synchronize_checkpoint_boundary": False if checkpointing else None,
    }
    return out


def nest(fields: dict[str, Any], mapping: dict[str, str] | None = None) -> dict[str, Any]:
    """Place each flat value at its dotted key from ``mapping`` (default :data:`DEEPSPEED_CONFIG_MAP`).

    ``None`` values are left out; an unknown field or two fields on one key (or a key inside a value) raise.
    """
    mapping = DEEPSPEED_CONFIG_MAP if mapping is None else mapping
    out: dict[str, Any] = {}
    for name, value in fields.items():
        if name not in mapping:
            raise RenderError(f"field {name!r} has no DeepSpeed key; known fields: {', '.join(mapping)}")
        if value is None:
            continue
        *sections, leaf = mapping[name].split(".")
        node = out
        for part in sections:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise RenderError(f"DeepSpeed key {mapping[name]!r} of field {name!r} lies inside a value")
            node = child
        if leaf in node:
            raise RenderError(f"two fields map to DeepSpeed key {mapping[name]!r}")
        node[leaf] = value
    return out


def check_deepspeed_keys(config: dict[str, Any]) -> None:
    """Raise :class:`RenderError` for a key DeepSpeed would silently ignore (see :data:`DEEPSPEED_KNOWN_KEYS`)."""
    for section, known in DEEPSPEED_KNOWN_KEYS.items():
        node: Any = config
        for part in section.split(".") if section else ():
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue
        unknown = sorted(set(node) - known)
        if unknown:
            where = f"section {section!r}" if section else "the top level"
            raise RenderError(
                f"DeepSpeed ignores unknown key(s) {', '.join(unknown)} at {where} instead of rejecting them; "
                f"known there: {', '.join(sorted(known))}"
            )


def render_deepspeed(plan: Plan, opts: RenderOptions | None = None, *, layout: Layout | None = None) -> dict[str, Any]:
    """DeepSpeed config dict for the plan's chosen candidate (``opts.candidate`` or the recommendation).

    Raises :class:`RenderError` when that candidate is not a DeepSpeed strategy, when nothing fits and no
    candidate is named, or when the options contradict the strategy (NVMe offload without ZeRO-3 offload).
    """
    opts = opts or RenderOptions()
    lay = layout or layout_of(plan, opts)
    if lay.precision is Precision.FP8 and lay.strategy.family == "deepspeed":
        raise RenderError(fp8_strategy_problem("deepspeed") or "")
    config = nest(deepspeed_fields(lay, opts))
    check_deepspeed_keys(config)
    return config


def render_deepspeed_json(plan: Plan, opts: RenderOptions | None = None, *, layout: Layout | None = None) -> str:
    """:func:`render_deepspeed` as JSON text (indent 2, ending with a newline), ready for ``ds_config.json``."""
    return json.dumps(render_deepspeed(plan, opts, layout=layout), indent=2) + "\n"
