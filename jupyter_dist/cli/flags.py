"""The flags ``jupyter-dist`` shares with the magics, defined once.

Bounded number types, the plan, render, check, tune and output flag groups, and what they build (``plan_from_args``,
``render_options_from_args``, ``check_from_args``, ``tune_from_args``). ``%dist_plan`` takes exactly the flags of
``jupyter-dist plan``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from ..errors import JupyterDistError
from ..launch.base import BACKENDS, DEFAULT_BACKEND, backend_spec

__all__ = ["MAX_LOCAL_NPROC", "MAX_SECONDS", "MAX_COUNT", "int_arg", "float_arg", "add_plan_arguments",
           "add_render_arguments", "render_options_from_args", "plan_from_args", "add_check_arguments",
           "check_from_args", "add_tune_arguments", "tune_from_args", "load_module", "add_output_argument",
           "output_arg"]  # fmt: skip


MAX_LOCAL_NPROC = 512
"""Most processes per node a local run starts (a typo like ``--nproc 20000`` must not fork-bomb the machine)."""
MAX_SECONDS = 30 * 86400.0
"""Longest time any timeout flag takes (30 days): a run, a wait or a pool cell."""
MAX_COUNT = 2**31 - 1
"""Largest integer any count flag takes (layers, batch, sequence length, ...): beyond it a value is a typo."""


def int_arg(lo: int = 1, hi: int = MAX_COUNT) -> Callable[[str], int]:
    """An argparse ``type`` for an integer in ``lo..hi``; anything else is a one-line error naming the range."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"want an integer in {lo}..{hi}, got {_shown(text)}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"want an integer in {lo}..{hi}, got {_shown(text)}")
        return value

    parse.__name__ = "integer"
    return parse


def float_arg(lo: float = 0.0, hi: float = float("inf"), *, lo_open: bool = False) -> Callable[[str], float]:
    """An argparse ``type`` for a finite number in ``lo..hi`` (``(lo..hi`` with ``lo_open``); NaN and inf refused."""
    span = f"{'(' if lo_open else '['}{lo:g}, {'inf)' if hi == float('inf') else f'{hi:g}]'}"

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"want a number in {span}, got {_shown(text)}") from None
        if not math.isfinite(value) or value < lo or (lo_open and value == lo) or value > hi:
            raise argparse.ArgumentTypeError(f"want a finite number in {span}, got {_shown(text)}")
        return value

    parse.__name__ = "number"
    return parse


def _shown(text: str) -> str:
    """A bad value as shown in an error: repr, cut to one short line."""
    shown = repr(text)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def _bool_flag(parser: argparse._ActionsContainer, name: str, default: bool, help: str) -> None:
    parser.add_argument(f"--{name}", dest=name.replace("-", "_"), action=argparse.BooleanOptionalAction,
                        default=default, help=help)  # fmt: skip


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The plan inputs as flags; shared by ``jupyter-dist plan`` and ``%dist_plan``."""
    model = p.add_argument_group("model (one of)")
    model.add_argument("--model", help="preset name, e.g. llama-2-7b, gpt2, mixtral-8x7b (see --list-models)")
    model.add_argument("--params", help="bare parameter count, e.g. 7.5e9 or 7B (shape is guessed)")
    model.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (or its folder); no network")
    model.add_argument(
        "--module",
        metavar="MOD:CALLABLE",
        help="import a torch nn.Module class/factory and measure it on the meta device",
    )
    dims = p.add_argument_group("model dimensions (instead of, or overriding, a preset)")
    for flag, hlp in (
        ("layers", "transformer blocks"),
        ("hidden", "model width"),
        ("heads", "attention heads"),
        ("kv-heads", "key/value heads (GQA)"),
        ("ffn", "MLP width"),
        ("vocab", "vocabulary size"),
        ("experts", "MoE experts"),
        ("top-k", "experts per token"),
    ):
        dims.add_argument(f"--{flag}", type=int_arg(0 if flag in ("kv-heads", "ffn") else 1), help=hlp)
    dims.add_argument(
        "--tied-embeddings",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="input and output embeddings share weights",
    )
    dims.add_argument(
        "--gated-mlp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="SwiGLU-style gated MLP (default for dimension-given models)",
    )
    hw = p.add_argument_group("hardware")
    hw.add_argument("--gpu", default="h100-80gb", help="accelerator (see --list-gpus); default h100-80gb")
    hw.add_argument(
        "--gpus-per-node", type=int_arg(1, 1024), help="GPUs per node (default: the node size of --gpu, e.g. 8)"
    )
    hw.add_argument("--nodes", type=int_arg(1, 1 << 20), default=1, help="number of nodes (default 1)")
    hw.add_argument("--interconnect", help="inter-node network (see --list-gpus); default: typical for --gpu")
    hw.add_argument("--gpu-memory", metavar="SIZE", help="override device memory, e.g. 48GiB")
    hw.add_argument("--gpu-tflops", type=float_arg(0.0, 1e9, lo_open=True), help="override peak dense bf16/fp16 TFLOPS")
    tr = p.add_argument_group("training shape")
    tr.add_argument("--micro-batch", type=int_arg(), default=1, help="sequences per GPU per step (default 1)")
    tr.add_argument("--seq-len", type=int_arg(), default=2048, help="tokens per sequence (default 2048)")
    g = tr.add_mutually_exclusive_group()
    g.add_argument("--grad-accum", type=int_arg(), help="micro-batches per optimizer step (default 1)")
    g.add_argument(
        "--global-batch", type=int_arg(), help="sequences per optimizer step (sets grad-accum per candidate)"
    )
    from ..plan.training import precision_names

    names = precision_names()
    tr.add_argument("--precision", default=names[0], help=f"{names[0]} (default), {', '.join(names[1:])}")
    tr.add_argument("--optimizer", default="adamw", help="adamw (default), adamw-8bit, sgd")
    tr.add_argument("--checkpointing", default="none",
                    help="activation checkpointing: none (default), selective, op, layer:K, full")  # fmt: skip
    _bool_flag(tr, "flash-attn", True, "fused attention that never stores seq x seq scores (default on)")
    from ..plan.pipeline import PP_SCHEDULES

    tr.add_argument("--pp-schedule", default="1f1b",
                    help=f"pipeline schedule: {', '.join(PP_SCHEDULES)} (default 1f1b; sets activations in flight "
                         "and the bubble)")  # fmt: skip
    tr.add_argument("--pp-virtual", type=int_arg(1, 1024), default=None,
                    help="pipeline stages per rank with interleaved-1f1b (default 2)")  # fmt: skip
    tr.add_argument("--pp-light-edges", action="store_true",
                    help="Llama 3's pipeline layout: the embedding and the output each take a layer's place, so the "
                         "first and last stage hold one layer fewer (planned, not launched)")  # fmt: skip
    tr.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="price regional torch.compile of each block (default: as the ranks run, on for GPUs, off "
                         "for CPU processes)")  # fmt: skip
    tr.add_argument("--fused", dest="fused_optimizer", action=argparse.BooleanOptionalAction, default=None,
                    help="price the optimizer's fused kernel instead of torch's foreach one (default: as the ranks "
                         "run, on for GPUs, off for CPU processes)")  # fmt: skip
    par = p.add_argument_group("parallelism")
    par.add_argument("--strategy", help="evaluate only this strategy (ddp, zero1..zero3, fsdp-*, fsdp2, ...)")
    for flag in ("tp", "pp", "cp", "ep"):
        par.add_argument(
            f"--{flag}", type=int_arg(1, 1 << 20), help=f"fix the {flag.upper()} degree (data parallel takes the rest)"
        )
    par.add_argument(
        "--sp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sequence parallelism with TP (default on when tp > 1)",
    )
    par.add_argument(
        "--min-headroom", type=float_arg(0.0, 1.0), help="free memory fraction a recommendation must leave (0.10)"
    )
    par.add_argument(
        "--efficiency",
        type=float_arg(0.0, 1.0, lo_open=True),
        help="fraction of peak FLOPs the matmuls reach (default: the GPU's published figure, or its calibration)",
    )
    _bool_flag(par, "calibration", True, "use this hardware's %%dist_tune calibration when one is saved (default on)")


def add_render_arguments(p: argparse.ArgumentParser) -> None:
    """Compile options (names, launcher, scheduler, cloud); shared by ``jupyter-dist config`` and the magics."""
    g = p.add_argument_group("compile")
    g.add_argument("--candidate", help="plan candidate to compile (default: the recommendation), e.g. zero3")
    g.add_argument("--launcher", default="torchrun", help="torchrun (default), deepspeed or accelerate")
    g.add_argument("--name", default="jupyter-dist", help="run / job / cluster name (lower case, digits, dashes)")
    g.add_argument("--script", default="train.py", help="training script the commands run (default train.py)")
    g.add_argument(
        "--script-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="argument for the training script (repeatable, quoted safely; --script-arg=--flag for flags)",
    )
    g.add_argument("--rdzv", default="c10d", help="multi-node rendezvous: c10d (default) or static")
    g.add_argument("--master-port", type=int_arg(1, 65535), default=29500, help="rendezvous port (default 29500)")
    g.add_argument("--max-restarts", type=int_arg(0, 1000), default=0, help="torchrun --max-restarts (default 0)")
    g.add_argument(
        "--lr",
        type=float_arg(0.0, 1e3, lo_open=True),
        default=3e-4,
        help="learning rate in generated configs (default 3e-4)",
    )
    g.add_argument(
        "--grad-clip", type=float_arg(0.0, 1e9), default=1.0, help="gradient clipping norm, 0 = off (default 1.0)"
    )
    g.add_argument("--nvme-path", help="ZeRO-Infinity: offload to NVMe at this path")
    g.add_argument("--partition", help="SLURM partition (omitted if not given)")
    g.add_argument("--account", help="SLURM account (omitted if not given)")
    g.add_argument("--time", default="24:00:00", help="SLURM time limit (default 24:00:00)")
    g.add_argument("--cloud", help="SkyPilot infra/cloud (aws, gcp, azure, kubernetes, slurm, ...)")
    g.add_argument("--spot", action="store_true", help="SkyPilot spot instances")
    g.add_argument("--setup", help="SkyPilot setup commands (default: pip install torch [deepspeed|accelerate])")
    g.add_argument("--env", action="append", default=[], metavar="K=V", help="extra environment (repeatable)")
    g.add_argument(
        "--secret",
        action="append",
        metavar="NAME",
        help="secret forwarded by name, never written (repeatable; default WANDB_API_KEY, HF_TOKEN)",
    )
    g.add_argument("--nccl-debug", default="WARN", help="NCCL_DEBUG level (default WARN)")


def render_options_from_args(args: argparse.Namespace) -> Any:
    """Turn parsed compile flags into :class:`~jupyter_dist.render.common.RenderOptions`."""
    from ..render.common import RenderOptions

    env = []
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise JupyterDistError(f"--env wants NAME=VALUE, got {item!r}")
        env.append((key, value))
    kwargs: dict[str, Any] = dict(
        candidate=args.candidate, name=args.name, script=args.script, script_args=tuple(args.script_arg),
        launcher=args.launcher, rdzv=args.rdzv, master_port=args.master_port, max_restarts=args.max_restarts,
        lr=args.lr, grad_clip=args.grad_clip, nvme_path=args.nvme_path, partition=args.partition,
        account=args.account, time_limit=args.time, cloud=args.cloud, use_spot=args.spot, env=tuple(env),
        nccl_debug=args.nccl_debug,
    )  # fmt: skip
    if args.setup is not None:
        kwargs["setup"] = args.setup
    if args.secret is not None:
        kwargs["secrets"] = tuple(args.secret)
    return RenderOptions(**kwargs)


def load_module(target: str) -> Any:
    """The object a ``--module`` flag names (``MODULE:CALLABLE``, e.g. ``mypkg.model:GPT``)."""
    import importlib

    mod_name, _, attr = target.partition(":")
    if not mod_name or not attr:
        raise JupyterDistError(f"--module wants MODULE:CALLABLE (e.g. mypkg.model:GPT), got {target!r}")
    try:
        obj = importlib.import_module(mod_name)
    except ImportError as exc:
        raise JupyterDistError(f"--module: cannot import {mod_name!r}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise JupyterDistError(f"--module: {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def plan_from_args(args: argparse.Namespace) -> Any:
    """Turn parsed plan flags into a :class:`~jupyter_dist.plan.Plan` (raises JupyterDistError on bad input)."""
    from dataclasses import replace

    from ..plan import Assumptions, Hardware, ModelSpec, TrainingShape, get_accelerator, plan
    from ..plan.units import parse_bytes

    sources = [n for n in ("model", "params", "hf_config", "module") if getattr(args, n)]
    if len(sources) > 1:
        flags = " and ".join("--" + s.replace("_", "-") for s in sources)
        raise JupyterDistError(f"give one model source, not {flags}")
    overrides = {
        k: getattr(args, k) for k in ("layers", "hidden", "heads", "ffn", "vocab", "experts")
        if getattr(args, k) is not None
    }  # fmt: skip
    if args.kv_heads is not None:
        overrides["kv_heads"] = args.kv_heads
    if args.top_k is not None:
        overrides["top_k"] = args.top_k
    if args.tied_embeddings is not None:
        overrides["tied_embeddings"] = args.tied_embeddings
    if args.gated_mlp is not None:
        overrides["gated_mlp"] = args.gated_mlp
    if args.model:
        spec = ModelSpec.from_preset(args.model)
    elif args.params:
        spec = ModelSpec.from_params(args.params)
    elif args.hf_config:
        spec = ModelSpec.from_hf_config(args.hf_config)
    elif args.module:  # --heads: the heads its structure does not state (asked for, never guessed)
        from ..plan.planner import module_spec

        spec = module_spec(load_module(args.module), heads=overrides.pop("heads", None))
    elif overrides:
        missing = [f for f in ("layers", "hidden", "heads", "vocab") if f not in overrides]
        if missing:
            raise JupyterDistError(
                f"a model from dimensions needs --{' --'.join(missing)} too (or use --model/--params/--hf-config)"
            )
        spec = ModelSpec(name="custom", **overrides)
        overrides = {}
    else:
        raise JupyterDistError("say which model: --model NAME, --params N, --hf-config PATH or --layers/--hidden/...")
    if overrides:
        spec = spec.with_(**overrides, params_override=0, source="dims")

    acc = get_accelerator(args.gpu)
    if args.gpu_memory:
        acc = replace(acc, memory_bytes=parse_bytes(args.gpu_memory, what="--gpu-memory"))
    if args.gpu_tflops is not None:
        if args.gpu_tflops <= 0:
            raise JupyterDistError(f"--gpu-tflops must be positive, got {args.gpu_tflops}")
        acc = replace(acc, bf16_flops=args.gpu_tflops * 1e12 if acc.supports_bf16 else 0.0,
                      fp16_flops=args.gpu_tflops * 1e12)  # fmt: skip
    if args.efficiency is not None:
        acc = replace(acc, matmul_efficiency=args.efficiency, calibration="--efficiency")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise JupyterDistError(f"--gpus-per-node must be >= 1, got {args.gpus_per_node}")
    hardware = Hardware.from_names(acc, gpus_per_node=args.gpus_per_node, nodes=args.nodes,
                                   interconnect=args.interconnect)  # fmt: skip
    training = TrainingShape(
        micro_batch=args.micro_batch, seq_len=args.seq_len, grad_accum=args.grad_accum,
        global_batch=args.global_batch, precision=args.precision, optimizer=args.optimizer,
        checkpointing=args.checkpointing, flash_attention=args.flash_attn,
        pp_schedule=getattr(args, "pp_schedule", "1f1b"), pp_virtual=getattr(args, "pp_virtual", None) or 0,
        pp_light_edges=getattr(args, "pp_light_edges", False),
        compile=getattr(args, "compile", None), fused_optimizer=getattr(args, "fused_optimizer", None),
    )  # fmt: skip
    assume: dict[str, Any] = {}
    if args.min_headroom is not None:
        assume["min_headroom"] = args.min_headroom
    calibration = None
    if getattr(args, "calibration", True) and args.efficiency is None:  # --efficiency wins over a measurement
        from ..plan.calibration import load_calibration, options_key

        calibration = load_calibration(acc.name, options_key(training, acc.vendor))  # a tune of these options only
    return plan(spec, hardware, training, strategy=args.strategy, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
                sp=args.sp, assumptions=Assumptions(**assume), calibration=calibration)  # fmt: skip


def add_check_arguments(k: argparse.ArgumentParser) -> None:
    """Flags shared by ``jupyter-dist check`` and ``%dist_check``."""
    k.add_argument(
        "--nproc", type=int_arg(1, MAX_LOCAL_NPROC), help="processes per node (default: local GPU count, else 2)"
    )
    k.add_argument(
        "--nodes", type=int_arg(1, 64), default=1, help="nodes (locally: simulated torchrun agents; default 1)"
    )
    k.add_argument("--sizes", default="1K,64K,1M,16M", help="message sizes (default 1K,64K,1M,16M)")
    k.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter,broadcast", help="collectives to time")
    k.add_argument("--iters", type=int_arg(1, 10**6), default=5, help="timed calls per size (default 5)")
    k.add_argument("--gpu", help="compare with this accelerator's expected bandwidth (catalog name)")
    k.add_argument("--interconnect", help="and this interconnect between nodes (catalog name)")
    k.add_argument("--expect-busbw", metavar="BYTES_PER_S", help="reference bus bandwidth, e.g. 100GB (per second)")
    k.add_argument(
        "--timeout",
        type=float_arg(0.0, 7 * 86400, lo_open=True),
        default=180.0,
        help="give up after this many seconds (default 180)",
    )
    k.add_argument("--runs-dir", default="runs", help="where the run directory goes (default ./runs)")
    k.add_argument("--json", action="store_true", help="print one JSON object (bandwidths in bytes/s)")


def check_from_args(args: argparse.Namespace, *, plan: object = None) -> object:
    """Run the preflight described by parsed ``check`` flags; returns the :class:`CheckReport`."""
    from ..launch.check import parse_size, parse_sizes, run_check
    from ..plan.hardware import Hardware

    if args.nproc is not None and args.nproc < 1:
        raise JupyterDistError(f"--nproc must be >= 1, got {args.nproc}")
    if args.nodes < 1:
        raise JupyterDistError(f"--nodes must be >= 1, got {args.nodes}")
    if args.timeout <= 0:
        raise JupyterDistError(f"--timeout must be positive seconds, got {args.timeout}")
    hardware = None
    if args.gpu:
        hardware = Hardware.from_names(args.gpu, gpus_per_node=args.nproc, nodes=args.nodes,
                                       interconnect=args.interconnect)  # fmt: skip
    expected = parse_size(args.expect_busbw, what="--expect-busbw") if args.expect_busbw else None
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    return run_check(nproc=args.nproc, nodes=args.nodes, sizes=parse_sizes(args.sizes), ops=ops, iters=args.iters,
                     plan=plan, hardware=hardware, expected_busbw=expected, timeout=args.timeout,
                     runs_dir=args.runs_dir)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# output: whose prints a run shows, shared by ``jupyter-dist launch`` and ``%%dist_train``
# ---------------------------------------------------------------------------------------------------------------
def output_arg(text: str) -> Any:
    """An argparse ``type`` for ``--output``: ``all``, ``none``, ``0``, ``0,2`` -> an ``OutputSelection``."""
    from ..launch.output import parse_output

    try:
        return parse_output(text)
    except JupyterDistError as exc:
        why = str(exc).removeprefix(f"--output {text!r}: ")
        raise argparse.ArgumentTypeError(f"{why}, got {_shown(text)}") from None


def add_output_argument(p: argparse._ActionsContainer) -> None:
    """``--output all|0|none|0,2``: the ranks whose output is shown while the run goes (default rank 0)."""
    p.add_argument("--output", type=output_arg, default="0", metavar="RANKS",
                   help="whose prints are shown while the run goes, prefixed [rankK]: 0 (default), all, none, or "
                        "ranks such as 0,2; at most 50 lines/s (the dropped are counted); every line stays in "
                        "logs/rank-K.log")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# tune: flags shared by ``jupyter-dist tune`` and ``%dist_tune``
# ---------------------------------------------------------------------------------------------------------------
def add_tune_arguments(p: argparse.ArgumentParser) -> None:
    """The tune flags; the plan flags (``add_plan_arguments``) say what is planned."""
    from ..launch.measure import WARMUP_STEPS

    g = p.add_argument_group("tune")
    g.add_argument("--top", type=int_arg(1, 32), default=3, help="measure the plan's N best fitting candidates (3)")
    g.add_argument("--candidates", metavar="A,B,...", help="measure these candidates instead (names the plan prints)")
    g.add_argument("--micro-batches", metavar="N,M,...",
                   help="micro-batch sizes to try (default: the planned one, half and double)")  # fmt: skip
    g.add_argument("--options", metavar="compile,fused,fp8",
                   help="speed options to measure on and off, every combination, for each candidate: compile (torch."
                        "compile of each block), fused (the optimizer's fused kernel), fp8 (FP8 GPUs only; default: "
                        "none, as the plan says)")  # fmt: skip
    g.add_argument("--steps", type=int_arg(WARMUP_STEPS + 1, 10_000), default=8,
                   help=f"steps per trial, the first {WARMUP_STEPS} not timed (default 8)")  # fmt: skip
    g.add_argument("--trial-timeout", type=float_arg(0.0, MAX_SECONDS, lo_open=True), default=300.0, metavar="S",
                   help="stop a trial after S seconds (a result: failed, measured; default 300)")  # fmt: skip
    g.add_argument("--save", action="store_true",
                   help="save the calibration for this hardware: later plans use the measured speeds")  # fmt: skip
    g.add_argument("--tune-runs-dir", dest="tune_runs_dir", default=None, metavar="DIR",
                   help="where the trials' run directories go (default ./runs)")  # fmt: skip
    g.add_argument("--backend", choices=tuple(BACKENDS), default=None,
                   help="where the trials run, as for %%%%dist_train (default local)")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# rehearse: flags of ``jupyter-dist rehearse``
# ---------------------------------------------------------------------------------------------------------------
def add_rehearse_arguments(p: argparse.ArgumentParser) -> None:
    """The rehearse flags; the plan flags (``add_plan_arguments``) say what is planned, and its model is rehearsed."""
    g = p.add_argument_group("rehearse")
    g.add_argument("--candidate", help="the plan candidate to rehearse (default: the recommendation), e.g. fsdp2+tp8")
    g.add_argument("--ranks", metavar="R,S,...",
                   help="global ranks (default: the first of the first and of the last pipeline stage)")  # fmt: skip
    g.add_argument("--steps", type=int_arg(3, 1000), default=3,
                   help="steps per rank: one warms up, one is measured, the others are timed (default 3)")  # fmt: skip
    g.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="where the ranks run (default: this machine's GPU if it has one, else the CPU)")  # fmt: skip
    g.add_argument("--rank-timeout", type=float_arg(0.0, MAX_SECONDS, lo_open=True), default=3600.0, metavar="S",
                   help="give a rank up after S seconds (default 3600)")  # fmt: skip
    g.add_argument("--workdir", metavar="DIR", help="where the ranks' specs, results and logs go (default: a temp dir)")


def rehearse_from_args(args: argparse.Namespace, *, on_rank: Callable[[Any], None] | None = None) -> Any:
    """Plan from the flags and rehearse the candidate's ranks.

    The model is the plan's: ``--module``, ``--hf-config``, or the reference model of a preset's or the dimensions'
    shape.
    """
    from ..launch.rehearse import rehearse

    plan = plan_from_args(args)
    model = args.module or args.hf_config or None
    ranks = _csv(getattr(args, "ranks", None), "--ranks", int)
    return rehearse(plan, args.candidate, model=model, ranks=ranks, steps=args.steps, device=args.device,
                    timeout=args.rank_timeout, workdir=args.workdir, on_rank=on_rank)  # fmt: skip


def _csv(text: str | None, what: str, conv: Callable[[str], Any] = str) -> list[Any] | None:
    if not text:
        return None
    try:
        return [conv(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        raise JupyterDistError(f"{what} wants a comma-separated list, got {text!r}") from None


def local_gpu_names() -> list[str]:
    """The names ``nvidia-smi -L`` gives this machine's GPUs (``[]`` without NVIDIA's tools or GPUs)."""
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split(":", 1)[1].split("(UUID")[0].strip() for line in out.splitlines()
            if line.startswith("GPU ") and ":" in line]  # fmt: skip


def gpu_mismatch(accelerator: Any, names: list[str]) -> str:
    """Why the GPUs ``names`` are not the plan's ``accelerator`` (``""`` when they are, or when unknown)."""
    family = accelerator.name.split("-")[0].lower()  # "h100-80gb" -> "h100"
    if not names or accelerator.vendor == "cpu" or not family:
        return ""
    other = [n for n in names if family not in n.lower().replace(" ", "")]
    if not other:
        return ""
    return (f"the plan is for {accelerator.label} but this machine has {other[0]}: a tune measures the GPUs it runs "
            f"on, and its calibration is saved under their name; plan for this GPU (--gpu) and tune again")


def tune_from_args(
    args: argparse.Namespace,
    *,
    plan: Any = None,
    code: str | None = None,
    runs_dir: str | None = None,
    on_trial: Callable[[Any], None] | None = None,
    cluster: Any = None,
) -> Any:
    """Plan from the flags (unless ``plan`` is given), check the machine can run it, and tune."""
    from ..launch.session import local_gpu_count
    from ..launch.tune import tune

    if plan is None:
        plan = plan_from_args(args)
    backend = args.backend or DEFAULT_BACKEND
    acc = plan.hardware.accelerator
    if not backend_spec(backend).cluster:
        gpus = local_gpu_count()
        if acc.vendor == "cpu" and gpus:
            pass  # CPU processes on a GPU machine are fine: the plan is for them
        elif acc.vendor != "cpu" and gpus < plan.hardware.gpus_per_node:
            raise JupyterDistError(
                f"the plan is for {plan.hardware.gpus_per_node} x {acc.label} per node but this machine has {gpus} "
                "GPU(s): tune locally with --gpu cpu --gpus-per-node N (CPU processes), or use --backend slurm/skypilot"
            )
        mismatch = gpu_mismatch(acc, local_gpu_names()) if acc.vendor != "cpu" else ""
        if mismatch:
            raise JupyterDistError(mismatch)
    sizes = _csv(getattr(args, "micro_batches", None), "--micro-batches", int)
    names = _csv(getattr(args, "candidates", None), "--candidates")
    return tune(code, plan, top=args.top, micro_batches=sizes, candidates=names, steps=args.steps,
                backend=backend, cluster=cluster, runs_dir=args.tune_runs_dir or runs_dir or "runs",
                trial_timeout=args.trial_timeout, save=args.save, on_trial=on_trial,
                options=getattr(args, "options", None))  # fmt: skip
