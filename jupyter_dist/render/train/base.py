"""The script assembler's base: what every generated script has.

The imports a script collects, what the plan says, and the sections every strategy has (docstring, constants,
flags, process-group set-up, activation checkpointing, optimizer, checkpoints).
"""

from __future__ import annotations

import math

from ...plan.strategies import get_strategy
from ...plan.training import TORCH_DTYPES, Checkpointing, OptimizerKind, Precision, precision_names
from ..commands import deepspeed_command, torchrun_command
from ..common import Layout, RenderOptions
from . import expert_tpl as et
from . import loop_tpl as lt
from . import model_tpl as mt
from . import pipeline_tpl as ppt
from . import speed_tpl as st
from .text import STDLIB, doc_safe, fill, import_lines, join_lines, py_str, wrap

__all__ = ["shard_group", "DEFAULT_STEPS", "DTYPES", "FSDP1_AC", "ScriptBase"]

DEFAULT_STEPS = 1000
"""Optimizer steps written as the ``--steps`` default (the plan has no run length)."""

DTYPES = {k: f"torch.{v}" for k, v in TORCH_DTYPES.items()}
FSDP1_AC = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"


def shard_group(lay: Layout) -> int:
    """Ranks that share one sharded replica under HSDP: the plan's group, widened to a multiple of cp.

    The cp ranks of a sequence shard the model states with the data-parallel ones (dp_shard x cp), so a group
    narrower than cp (e.g. 8 GPUs per node, cp16) becomes cp's.
    """
    return math.lcm(int(lay.settings.get("shard_group_size", lay.gpus_per_node)), lay.dims.cp)


class ScriptBase:
    """The sections of one script every strategy has; each records the imports it uses."""

    def __init__(self, lay: Layout, opts: RenderOptions) -> None:
        self.lay = lay
        self.opts = opts
        self.family = lay.strategy.family
        self.straight: list[tuple[str, str | None]] = []
        self.froms: dict[str, list[str]] = {}
        self.use("argparse", "os", "time", "torch")
        self.use_as("torch.distributed", "dist")
        self.use_as("torch.nn.functional", "F")
        self.use_from("collections.abc", "Iterator")
        self.use_from("pathlib", "Path")
        self.use_from("torch", "nn")
        self.use_from("torch.utils.data", "DataLoader", "Dataset", "DistributedSampler")

    # ---- imports -------------------------------------------------------------------------------------------
    def use(self, *modules: str) -> None:
        """Import ``modules`` (``import x``)."""
        self.straight += [(m, None) for m in modules if (m, None) not in self.straight]

    def use_as(self, module: str, alias: str) -> None:
        """Import ``module as alias``."""
        if (module, alias) not in self.straight:
            self.straight.append((module, alias))

    def use_from(self, module: str, *names: str) -> None:
        """Import ``names`` from ``module``."""
        self.froms.setdefault(module, []).extend(names)

    def import_block(self) -> str:
        """The recorded imports: standard library first, then the others, each sorted as ruff wants."""
        blocks = []
        for third_party in (False, True):
            straight = [s for s in self.straight if (s[0].split(".")[0] not in STDLIB) == third_party]
            froms = {m: n for m, n in self.froms.items() if (m.split(".")[0] not in STDLIB) == third_party}
            if straight or froms:
                blocks.append(import_lines(straight, froms))
        return "\n\n".join(blocks)

    # ---- what the plan says --------------------------------------------------------------------------------
    @property
    def ds(self) -> bool:
        """Whether DeepSpeed runs the script."""
        return self.family == "deepspeed"

    @property
    def precision(self) -> Precision:
        """The plan's precision."""
        return self.lay.precision

    @property
    def mixed(self) -> bool:
        """Whether the precision is mixed (low-precision compute, fp32 master weights)."""
        return self.precision.is_mixed

    @property
    def fp16(self) -> bool:
        """Whether the precision is fp16-mixed (loss scaling)."""
        return self.precision is Precision.FP16_MIXED

    @property
    def fp8(self) -> bool:
        """Whether the blocks' linear layers train in FP8 (torchao's Float8Linear)."""
        return self.precision is Precision.FP8

    @property
    def fused(self) -> bool:
        """Whether the script offers the optimizer's fused implementation (a torch AdamW/SGD; not under DeepSpeed)."""
        return not self.ds and self.lay.optimizer in (OptimizerKind.ADAMW, OptimizerKind.SGD)

    @property
    def compute_dtype(self) -> str:
        """The compute dtype as written in the script (``torch.bfloat16``)."""
        return DTYPES[self.precision.compute_dtype]

    @property
    def tp(self) -> int:
        """The tensor-parallel degree (1: data parallelism only)."""
        return self.lay.dims.tp

    @property
    def pp(self) -> int:
        """The pipeline-parallel degree (1: no pipeline)."""
        return self.lay.dims.pp

    @property
    def cp(self) -> int:
        """The context-parallel degree (1: every rank holds whole sequences)."""
        return self.lay.dims.cp

    @property
    def ep(self) -> int:
        """The expert-parallel degree (1: a dense model, or every rank holds every expert)."""
        return self.lay.dims.ep

    @property
    def meshed(self) -> bool:
        """Whether the script builds a device mesh of model-parallel dims (tp, pp, cp, ep) with ``build_mesh()``."""
        return self.tp > 1 or self.pp > 1 or self.cp > 1 or self.ep > 1

    @property
    def zero1_as_fsdp2(self) -> bool:
        """Whether the candidate is zero1 with model parallelism, which runs as FSDP2 keeping gathered parameters."""
        return self.family == "fsdp2" and get_strategy(self.lay.strategy.name).fsdp2_with_model_parallelism

    @property
    def group(self) -> int:
        """Ranks that share one sharded replica in a hybrid (HSDP) strategy (cp ranks included)."""
        return shard_group(self.lay)

    # ---- sections ------------------------------------------------------------------------------------------
    def docstring(self) -> str:
        """The script's docstring: the plan, the launch line, a quick check on CPU."""
        lay, plan, opts = self.lay, self.lay.plan, self.opts
        hw = plan.hardware
        if self.ds:
            launch = deepspeed_command(plan, opts, layout=lay).shell(with_env=False)
            quick = f"DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 {opts.script} "
            quick += "--deepspeed_config ds_config.json"
            note = (
                "Micro-batch, accumulation, precision, ZeRO stage and gradient clipping come from the DeepSpeed config "
                "jupyter-dist rendered from the same plan (--deepspeed_config); an optimizer section there replaces "
                "the optimizer built here."
            )
        else:
            launch = torchrun_command(plan, opts, layout=lay).shell(with_env=False)
            # processes of one model replica (tp x cp x the shard group when hybrid, x ep for the experts); the quick
            # check runs two replicas
            unit = self.pp * self.tp * (self.group if self.lay.strategy.hybrid else self.cp * self.ep)
            quick = f"torchrun --standalone --nproc-per-node {unit * 2 if unit <= 2 else unit} {opts.script}"
            note = ""
            if self.zero1_as_fsdp2:
                note = (
                    "zero1 with model parallelism runs as FSDP2 with reshard_after_forward=False over the "
                    "data-parallel dims, as jupyter-dist's workers run it (DeepSpeed's engine cannot take these "
                    "layouts): optimizer states and gradients sharded, parameters gathered once per step and kept to "
                    "the backward."
                )
        quick += f" --steps 20 --model-dim 64 --layers {max(2, self.pp)} --seq-len 64 --vocab-size 256 --num-workers 0"
        summary = (
            f"Plan: {plan.model.name} ({plan.model.params:,} parameters) on {hw.nodes} node(s) x {hw.gpus_per_node} "
            f"{hw.accelerator.label}; candidate {lay.candidate.name}. Precision {lay.precision.value}, optimizer "
            f"{lay.optimizer.value}, activation checkpointing {lay.checkpointing.value}. Per GPU {lay.micro_batch} "
            f"sequence(s) of {lay.seq_len} tokens x {lay.grad_accum} micro-step(s) x data-parallel {lay.dims.dp} = "
            f"{lay.global_batch} sequences per optimizer step."
        )
        title = f"Distributed training with {doc_safe(lay.strategy.label)}, generated by jupyter-dist from a plan."
        lines = [title, ""]
        lines += wrap(doc_safe(summary), 116)
        if note:
            lines += wrap(note, 116)
        lines += ["", "Launch (one process per GPU):", ""]
        lines += wrap(doc_safe(launch), 116, indent="    ", cont="    ", sep=" \\")
        lines += [""]
        lines += wrap(
            "REPLACE build_model() and build_dataset() (a small demo transformer and synthetic tokens) with your own "
            "model and data; the rest follows the plan. A quick check on CPU processes (gloo):",
            116,
        )
        lines += [""] + wrap(doc_safe(quick), 116, indent="    ", cont="    ", sep=" \\")
        return 'r"""' + "\n".join(lines) + '\n"""'

    def constants(self) -> str:
        """The plan's numbers as module-level constants (the flags' defaults)."""
        lay, opts = self.lay, self.opts
        *others, last = precision_names()
        rows = [
            ("STRATEGY", py_str(lay.strategy.name), lay.strategy.label),
            ("PRECISION", py_str(lay.precision.value), f"{', '.join(others)} or {last}"),
            ("ACTIVATION_CHECKPOINTING", py_str(lay.checkpointing.value), "none, selective (attention), full"),
            ("MICRO_BATCH", str(lay.micro_batch), "sequences per GPU per micro-step"),
            ("GRAD_ACCUM", str(lay.grad_accum), "micro-steps per optimizer step"),
            ("SEQ_LEN", str(lay.seq_len), "tokens per sequence"),
        ]
        if self.fp8:
            rows += [
                ("FP8_RECIPES", f"({', '.join(map(py_str, st.FP8_RECIPES))})", "float8 scalings (--fp8-recipe)"),
                ("FP8_RECIPE", py_str(st.FP8_RECIPES[0]), "one scale per tensor; under FSDP2 weights gathered in fp8"),
            ]
        if self.family == "ddp":
            bucket = lay.settings.get("bucket_cap_mb", 25)
            rows.append(("BUCKET_CAP_MB", repr(bucket), "size of the gradient all-reduce buckets"))
        if lay.strategy.hybrid:
            where = "dp_shard x cp" if self.cp > 1 else "inside a node"
            rows.append(("SHARD_GROUP_SIZE", str(self.group), f"ranks that share one sharded replica ({where})"))
        if self.pp > 1:
            rows += [
                ("PP", str(self.pp), "pipeline-parallel degree: ranks holding consecutive blocks (the outermost dim)"),
                ("SCHEDULES", '("gpipe", "1f1b", "interleaved-1f1b")', "pipeline schedules --schedule takes"),
                ("SCHEDULE", '"1f1b"', "the one the planner's bubble (PP - 1) / micro-batches assumes"),
            ]
        if self.cp > 1:
            rows.append(("CP", str(self.cp), "context-parallel degree: ranks that split every sequence"))
        if self.ep > 1:
            model = self.lay.plan.model
            rows += [
                ("EP", str(self.ep), "expert-parallel degree: ranks that split the experts (borrowed from dp_shard)"),
                ("EXPERTS", str(model.experts), f"routed experts per block ({doc_safe(model.name)})"),
                ("TOP_K", str(model.top_k), "experts each token goes to"),
            ]
        if self.meshed:
            rows.append(
                ("TP", str(self.tp), "tensor-parallel degree: ranks that split every layer (the innermost mesh dim)")
            )
        if self.tp > 1:
            rows.append(
                ("SEQUENCE_PARALLEL", str(lay.dims.sp), "split the norms and the residual stream along the sequence")
            )
        rows += [
            ("LR", repr(opts.lr), "learning rate (constant)"),
            ("WEIGHT_DECAY", repr(opts.weight_decay), "decoupled weight decay"),
        ]
        if not self.ds:
            rows.append(("GRAD_CLIP", repr(opts.grad_clip), "max gradient norm (0: measure it, do not clip)"))
        rows += [
            ("CHECKPOINT_DIR", py_str(opts.checkpoint_dir), "step-<N> folders; a run resumes from the newest"),
            ("STEPS", str(DEFAULT_STEPS), "optimizer steps (not part of the plan)"),
        ]
        out = ["# ---- The plan (jupyter-dist); the command-line flags start from these values ----"]
        for name, value, comment in rows:
            line = f"{name} = {value}  # {doc_safe(comment)}"
            out.append(line if len(line) <= 120 else f"{name} = {value}  # noqa: E501")
        return "\n".join(out)

    def model(self) -> str:
        """The demo model: a dense transformer, or with expert parallelism a mixture of experts in every block."""
        values = {
            "mlp": "nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))",
            "forward_params": "",
            "positions": "positions = torch.arange(x.shape[1], device=x.device)",
        }
        if self.cp > 1:
            values["forward_params"] = ", positions: torch.Tensor | None = None"
            values["positions"] = join_lines(
                "if positions is None:  # context parallelism passes the places of this rank's tokens",
                "    positions = torch.arange(x.shape[1], device=x.device)",
            )
        if self.ep == 1:
            return fill(mt.MODEL, **values)
        values["mlp"] = "MoE(dim, EXPERTS, TOP_K)  # a mixture of experts: what expert parallelism splits"
        self.use_from("torch.distributed.tensor", "DTensor")
        return join_lines(fill(mt.MODEL, **values), "", "", fill(et.MOE))

    def arguments(self) -> str:
        """``parse_args()``."""
        strategy = mt.ARGS_DEEPSPEED if self.ds else mt.ARGS_TORCH
        if self.pp > 1:
            strategy = join_lines(strategy.strip("\n"), ppt.ARGS_PIPELINE.strip("\n"))
        speed = [st.ARGS_SPEED] + [st.ARGS_FUSED] * self.fused + [st.ARGS_FP8] * self.fp8
        strategy = join_lines(strategy.strip("\n"), *(x.strip("\n") for x in speed))
        return fill(mt.ARGS, strategy_args=strategy)

    def setup(self) -> str:
        """``setup_distributed()``."""
        if self.ds:
            self.use("deepspeed")
            return fill(
                mt.SETUP, who="the launcher",
                init_nccl='deepspeed.init_distributed(dist_backend="nccl")',
                init_gloo='deepspeed.init_distributed(dist_backend="gloo")',
            )  # fmt: skip
        return fill(
            mt.SETUP, who="torchrun", init_nccl='dist.init_process_group("nccl", device_id=device)',
            init_gloo='dist.init_process_group("gloo")',
        )  # fmt: skip

    def checkpoint_helper(self) -> str:
        """The torch.utils.checkpoint helper (DDP, FSDP2, DeepSpeed); FSDP1 uses apply_activation_checkpointing."""
        if self.lay.checkpointing is Checkpointing.NONE:
            return ""
        if self.family == "fsdp":
            return self._op_sac()
        self.use("functools")
        self.use_from("typing", "Any")
        self.use_from("torch.utils.checkpoint", "checkpoint")
        op = self._op_sac()
        return fill(mt.CHECKPOINT_ACTIVATIONS) + (f"\n\n\n{op}" if op else "")

    def _op_sac(self) -> str:
        if self.lay.checkpointing is not Checkpointing.OP:
            return ""
        self.use_from("collections", "defaultdict")
        self.use_from("typing", "Any")
        self.use_from("torch.utils.checkpoint", "CheckpointPolicy", "create_selective_checkpoint_contexts")
        return fill(mt.OP_SAC)

    def activation_checkpointing(self) -> str:
        """The call that applies the plan's activation checkpointing to ``model`` (the names of AC_NAMES)."""
        mode = self.lay.checkpointing
        if mode is Checkpointing.NONE:
            return ""
        every = self.lay.plan.training.checkpoint_every if mode is Checkpointing.LAYER else 1
        cls, extra = "BLOCK_CLASS", ""
        if mode is Checkpointing.FULL:
            what = "full: keep each block's input, recompute the block in backward"
        elif mode is Checkpointing.LAYER:
            what, extra = f"layer:{every}: recompute every {every}-th block whole", f", every={every}"
        elif mode is Checkpointing.OP:
            what = "op: keep attention + every other matmul"
            extra = ", context_fn=op_sac_context"
        else:
            cls, what = "ATTENTION_CLASS", "selective: recompute the attention in backward, keep the rest"
        if self.family == "fsdp":
            self.use_from(FSDP1_AC, "apply_activation_checkpointing")
            check = f"lambda module: isinstance(module, {cls})"
            wrapper = ""
            if mode is Checkpointing.LAYER:
                self.use("itertools")
                check = f"lambda module: isinstance(module, {cls}) and next(count) % {every} == 0"
            elif mode is Checkpointing.OP:
                self.use("functools")
                self.use_from(FSDP1_AC, "checkpoint_wrapper")
                self.use_from("typing", "Any")
                self.use_from("torch.utils.checkpoint", "CheckpointPolicy", "create_selective_checkpoint_contexts")
                self.use_from("collections", "defaultdict")
                wrapper = "checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, context_fn=op_sac_context),"
            return join_lines(
                f"# activation checkpointing, {what}",
                *(["count = itertools.count(1)  # the blocks in order"] if mode is Checkpointing.LAYER else []),
                "apply_activation_checkpointing(",
                "    model,",
                *([f"    {wrapper}"] if wrapper else []),
                f"    check_fn={check},",
                ")",
            )
        return f"checkpoint_activations(model, {cls}{extra})  # {what}"

    def speed_lines(self) -> dict[str, str]:
        """The ``<<float8>>`` and ``<<compile>>`` lines of a ``parallelize()`` (DeepSpeed: ``main()``)."""
        return {
            "float8": "convert_float8(model, args)  # fp8: before checkpointing and sharding, as torchtitan" * self.fp8,
            "compile": "compile_blocks(model, on_cuda(args.compile))  # after checkpointing, before the wrapper",
        }

    def _precision_comment(self) -> str:
        return (
            f"# {self.precision.value}: compute in {self.precision.compute_dtype}; reduce gradients and keep "
            "the master weights in fp32"
        )

    def optimizer(self) -> str:
        """``build_optimizer()``; a torch AdamW/SGD with its fused implementation where ``--fused`` says."""
        if not self.fused:
            return fill(lt.OPTIMIZERS[self.lay.optimizer], fused="", fused_arg="")
        fused = "fused = True if on_cuda(args.fused) else None  # None: torch's default (foreach on CUDA)"
        return fill(lt.OPTIMIZERS[self.lay.optimizer], fused=fused, fused_arg=", fused=fused")

    def speed(self) -> str:
        """``on_cuda()``, ``compile_blocks()`` and, under fp8, ``convert_float8()`` (what the workers run)."""
        sections = [fill(st.ON_CUDA), fill(st.COMPILE_BLOCKS)]
        self.use_from("typing", "Any")
        if self.fp8:
            self.use("dataclasses")
            gather = self.family == "fsdp2"  # FSDP2 all-gathers the float8 weights under tensorwise scaling
            config = "config = dataclasses.replace(config, emulate=args.fp8_emulate)"
            if gather:
                config = join_lines(
                    "config = dataclasses.replace(",
                    "    config, emulate=args.fp8_emulate, "
                    'enable_fsdp_float8_all_gather=args.fp8_recipe == "tensorwise"',
                    ")",
                )
            sections.append(fill(
                st.FLOAT8, config=config,
                all_gather_doc="Under FSDP2 with tensorwise scaling the weights are all-gathered in float8." * gather,
            ))  # fmt: skip
        return "\n\n\n".join(sections)

    def checkpoint_io(self) -> str:
        """Checkpoint save and resume (DCP, per pipeline stage, or DeepSpeed's)."""
        if self.ds:
            return fill(lt.CHECKPOINT_DEEPSPEED)
        self.use("re")
        self.use_as("torch.distributed.checkpoint", "dcp")
        self.use_from("torch.distributed.checkpoint.state_dict", "get_state_dict", "set_state_dict")
        if self.pp > 1:
            self.use_from("torch.distributed.checkpoint.state_dict", "StateDictOptions")
            self.use_from("typing", "Any")
            return fill(ppt.CHECKPOINT_PIPELINE)
        scaler = {"scaler_param": "", "scaler_state": "", "scaler_load": ""}
        if self.fp16:
            scaler = {
                "scaler_param": f", scaler: {self._scaler_class()}",
                "scaler_state": 'state["scaler"] = scaler.state_dict()',
                "scaler_load": 'scaler.load_state_dict(state["scaler"])',
            }
        return fill(lt.CHECKPOINT_DCP, **scaler)

    def _scaler_class(self) -> str:
        if self.family == "ddp":
            return "torch.amp.GradScaler"
        self.use_from("torch.distributed.fsdp.sharded_grad_scaler", "ShardedGradScaler")
        return "ShardedGradScaler"
