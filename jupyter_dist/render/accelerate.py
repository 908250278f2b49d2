"""A :class:`~jupyter_dist.plan.plan.Plan` as an accelerate config file (``accelerate launch --config_file``).

Keys are those of accelerate's ``ClusterConfig`` (``accelerate/commands/config/config_args.py``); the nested
``fsdp_config`` / ``deepspeed_config`` / ``parallelism_config`` keys are ``accelerate launch`` options
(``accelerate/commands/launch.py``), which the launcher copies from the file. Two accelerate behaviours shape them:

* FSDP1: the launcher always sets ``FSDP_SHARDING_STRATEGY`` (default ``FULL_SHARD``) and the FSDP plugin prefers it
  over ``fsdp_reshard_after_forward``, so the strategy is written to both keys, or SHARD_GRAD_OP would silently run
  as FULL_SHARD.
* DeepSpeed with ``deepspeed_config_file``: every setting the JSON owns (stage, offload, accumulation, clipping and
  ``mixed_precision``) must be absent here, or the DeepSpeed plugin refuses to start; the JSON's ``bf16``/``fp16``
  section then sets the precision.

Pure: stdlib + pyyaml; accelerate itself is not imported.
"""

from __future__ import annotations

from typing import Any

from ..plan.plan import Plan
from ..plan.strategies import FSDP1_SHARDING as _FSDP1_SHARDING
from ..plan.training import Checkpointing, Precision
from .common import Layout, RenderError, RenderOptions, layout_of
from .deepspeed import zero_stage
from .skypilot import DS_CONFIG_FILE, dump_yaml

__all__ = [
    "MIXED_PRECISION", "FSDP1_SHARDING", "FP8_ACCELERATE_REFUSAL", "render_accelerate_config", "render_accelerate_yaml",
]  # fmt: skip

MIXED_PRECISION: dict[Precision, str] = {
    Precision.BF16_MIXED: "bf16",
    Precision.FP16_MIXED: "fp16",
    Precision.BF16_TRUE: "no",  # the model itself is bf16 (the script casts it); no autocast on top
    Precision.FP32: "no",
}
"""Our precision -> accelerate's ``mixed_precision``."""

FSDP1_SHARDING: dict[str, str] = _FSDP1_SHARDING
"""FSDP1 strategy -> accelerate's (and torch's ``ShardingStrategy``) name (the strategy table's)."""


FP8_ACCELERATE_REFUSAL = (
    "precision fp8: no accelerate config (its mixed_precision fp8 is not the torchao recipe the generated train.py "
    "runs itself); launch train.py with torchrun (launch.sh), or compile the plan with --precision bf16-mixed"
)
"""The one line :func:`render_accelerate_config` refuses fp8 with (``train.py`` converts to float8 itself)."""


def _not_supported(lay: Layout, what: str) -> RenderError:
    return RenderError(
        f"accelerate cannot run {lay.candidate.name} ({what}); launch it with torchrun and the generated train.py, "
        "or pick a data-parallel candidate"
    )


def _fsdp_config(lay: Layout) -> dict[str, Any]:
    s = lay.strategy
    cfg: dict[str, Any] = {"fsdp_version": 2 if s.family == "fsdp2" else 1}
    if s.family == "fsdp":
        strategy = FSDP1_SHARDING[s.name]
        cfg["fsdp_sharding_strategy"] = strategy
        cfg["fsdp_reshard_after_forward"] = strategy
    else:  # zero1 with model parallelism runs as FSDP2 keeping the gathered parameters from forward to backward
        cfg["fsdp_reshard_after_forward"] = not s.keeps_gathered_params
    cfg["fsdp_offload_params"] = s.offload_params
    cfg["fsdp_auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"  # blocks from the model's _no_split_modules
    if s.family == "fsdp":
        cfg["fsdp_backward_prefetch"] = "BACKWARD_PRE"
        cfg["fsdp_forward_prefetch"] = False
        cfg["fsdp_use_orig_params"] = True
        cfg["fsdp_sync_module_states"] = True
    cfg["fsdp_cpu_ram_efficient_loading"] = True
    cfg["fsdp_state_dict_type"] = "SHARDED_STATE_DICT"
    # accelerate recomputes whole blocks: for "selective" that stores less than the plan assumed (safe, slower)
    cfg["fsdp_activation_checkpointing"] = lay.checkpointing is not Checkpointing.NONE
    return cfg


def _parallelism_config(lay: Layout) -> dict[str, Any]:
    """FSDP2's device mesh (HSDP, TP, CP) as accelerate's ``parallelism_config``; empty when plain FSDP2."""
    d, s = lay.dims, lay.strategy
    if not s.hybrid and d.tp == 1 and d.cp == 1:
        return {}
    dp_shard = d.dp
    if s.hybrid:
        group = int(lay.settings.get("shard_group_size", d.shard_size))
        if group % d.cp or d.dp % (group // d.cp):
            raise _not_supported(lay, f"shard group {group} does not split into cp {d.cp} x a divisor of dp {d.dp}")
        dp_shard = group // d.cp
    p = "parallelism_config_"
    cfg: dict[str, Any] = {
        p + "dp_replicate_size": d.dp // dp_shard,
        p + "dp_shard_size": dp_shard,
        p + "tp_size": d.tp,
        p + "cp_size": d.cp,
    }
    return cfg


def _deepspeed_config(lay: Layout, opts: RenderOptions, ds_config_file: str | None) -> dict[str, Any]:
    s = lay.strategy
    cfg: dict[str, Any] = {}
    if ds_config_file is not None:
        cfg["deepspeed_config_file"] = ds_config_file
    else:
        stage = zero_stage(s)
        offload = "nvme" if opts.nvme_path else "cpu"
        cfg["zero_stage"] = stage
        cfg["offload_optimizer_device"] = offload if s.offload_optimizer else "none"
        cfg["offload_param_device"] = offload if s.offload_params else "none"
        if opts.nvme_path and s.offload_optimizer:
            cfg["offload_optimizer_nvme_path"] = opts.nvme_path
        if opts.nvme_path and s.offload_params:
            cfg["offload_param_nvme_path"] = opts.nvme_path
        cfg["gradient_accumulation_steps"] = lay.grad_accum
        if opts.grad_clip > 0:
            cfg["gradient_clipping"] = opts.grad_clip
        if stage == 3:
            cfg["zero3_save_16bit_model"] = False  # sharded checkpoints; consolidate offline
    # accelerate's own default; True would require transformers (deepspeed.zero.Init inside from_pretrained)
    cfg["zero3_init_flag"] = False
    if lay.multi_node:
        # every node runs `accelerate launch` itself (torchrun underneath): no pdsh/ssh, no hostfile
        cfg["deepspeed_multinode_launcher"] = "standard"
    return cfg


def render_accelerate_config(
    plan: Plan, opts: RenderOptions | None = None, *, ds_config_file: str | None = DS_CONFIG_FILE,
    layout: Layout | None = None,
) -> dict[str, Any]:
    """The config as a dict in accelerate's ``ClusterConfig`` keys.

    Parameters
    ----------
    plan
        The plan to compile (its recommendation, or ``opts.candidate``).
    opts
        Rendezvous (``rdzv``, ``master_addr``, ``master_port``) and DeepSpeed offload path (``nvme_path``).
    ds_config_file
        DeepSpeed candidates: point accelerate at this JSON (the bundle's ``ds_config.json``, which carries the
        plan's bucket sizes); ``None`` writes stage, offload, accumulation and clipping inline instead.
    layout
        The run's resolved layout when the caller has one (computed once per run); else resolved here.
    """
    opts = opts or RenderOptions()
    lay = layout or layout_of(plan, opts)
    if lay.precision is Precision.FP8:
        raise RenderError(FP8_ACCELERATE_REFUSAL)
    d, s = lay.dims, lay.strategy
    if d.pp > 1:
        raise _not_supported(lay, f"pipeline parallelism pp={d.pp}")
    if d.ep > 1:
        raise _not_supported(lay, f"expert parallelism ep={d.ep}")
    if s.family in ("ddp", "fsdp", "deepspeed") and not d.is_data_parallel_only:
        raise _not_supported(lay, f"{s.label} with {d.label()}")
    cpu = plan.hardware.accelerator.vendor == "cpu"
    cfg: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "debug": False}
    if s.family == "ddp":
        cfg["distributed_type"] = ("MULTI_CPU" if cpu else "MULTI_GPU") if lay.world_size > 1 else "NO"
    elif s.family in ("fsdp", "fsdp2"):
        cfg["distributed_type"] = "FSDP"
        cfg["fsdp_config"] = _fsdp_config(lay)
        if s.family == "fsdp2" and (par := _parallelism_config(lay)):
            cfg["parallelism_config"] = par
    elif s.family == "deepspeed":
        cfg["distributed_type"] = "DEEPSPEED"
        cfg["deepspeed_config"] = _deepspeed_config(lay, opts, ds_config_file)
    else:  # pragma: no cover - the strategy catalog has no other family
        raise RenderError(f"no accelerate mapping for strategy family {s.family!r}")
    if not (s.family == "deepspeed" and ds_config_file is not None):
        cfg["mixed_precision"] = MIXED_PRECISION[lay.precision]
    cfg.update(
        num_machines=lay.nodes,
        num_processes=lay.world_size,
        machine_rank=0,  # `accelerate launch --machine_rank` on each node overrides it
        main_process_ip=opts.master_addr,
        main_process_port=opts.master_port,
        rdzv_backend=opts.rdzv,
        # static: MASTER_ADDR/PORT; c10d: a rendezvous endpoint at main_process_ip:port (accelerate's two paths)
        same_network=opts.rdzv == "static",
        gpu_ids="all",
        use_cpu=cpu,
        enable_cpu_affinity=False,
    )
    return cfg


def render_accelerate_yaml(
    plan: Plan, opts: RenderOptions | None = None, *, ds_config_file: str | None = DS_CONFIG_FILE,
    layout: Layout | None = None,
) -> str:
    """:func:`render_accelerate_config` as YAML for ``accelerate launch --config_file accelerate_config.yaml``."""
    return dump_yaml(render_accelerate_config(plan, opts, ds_config_file=ds_config_file, layout=layout))
