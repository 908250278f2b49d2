"""The script assembler's sections that spread the model over the processes.

``parallelize()`` for DDP, FSDP and FSDP2, the tensor-parallel layout, the device mesh, pipeline stages and gradient
clipping over several meshes.
"""

from __future__ import annotations

from ...plan.strategies import FSDP1_SHARDING
from ...plan.training import Precision
from ..common import RenderError
from . import context_tpl as ct
from . import expert_tpl as et
from . import parallel_tpl as pt
from . import pipeline_tpl as ppt
from .base import ScriptBase
from .text import fill, join_lines, wrap

__all__ = ["ParallelSections"]


class ParallelSections(ScriptBase):
    """How the model is spread over the processes."""

    def parallelize(self) -> str:
        """``parallelize()``: the strategy applied to the model."""
        ac = self.activation_checkpointing()
        if self.family == "ddp":
            self.use_from("torch.nn.parallel", "DistributedDataParallel")
            to_dtype = ", dtype=torch.bfloat16" if self.precision is Precision.BF16_TRUE else ""
            return fill(pt.PARALLELIZE_DDP, to_dtype=to_dtype, activation_checkpointing=ac, **self.speed_lines())
        if self.family == "fsdp":
            self.use("functools")
            self.use_from("torch.distributed.fsdp", "FullyShardedDataParallel as FSDP", "ShardingStrategy")
            self.use_from("torch.distributed.fsdp.wrap", "transformer_auto_wrap_policy")
            precision, mixed = "", "None"
            if self.precision is Precision.BF16_TRUE:
                precision = "model = model.to(torch.bfloat16)  # bf16-true: no fp32 master copy"
            elif self.mixed:
                self.use_from("torch.distributed.fsdp", "MixedPrecision")
                precision = join_lines(
                    self._precision_comment(),
                    "mixed_precision = MixedPrecision(",
                    f"    param_dtype={self.compute_dtype}, reduce_dtype=torch.float32, "
                    f"buffer_dtype={self.compute_dtype}",
                    ")",
                )
                mixed = "mixed_precision"
            mesh, device_mesh = "", ""
            if self.lay.strategy.hybrid:
                self.use_from("torch.distributed.device_mesh", "init_device_mesh")
                mesh = fill(pt.HYBRID_MESH, what="HYBRID_SHARD: shard inside each group, replicate across groups",
                             names='("replicate", "shard")')  # fmt: skip
                device_mesh = "device_mesh=mesh,"
            return fill(
                pt.PARALLELIZE_FSDP, sharding=FSDP1_SHARDING[self.lay.strategy.name], precision=precision, mesh=mesh,
                mixed_precision=mixed, device_mesh=device_mesh, activation_checkpointing=ac, **self.speed_lines(),
            )  # fmt: skip
        if self.family == "fsdp2" and self.meshed:
            return self._parallelize_mesh(ac)
        if self.family == "fsdp2":
            self.use_from("torch.distributed.device_mesh", "init_device_mesh")
            self.use_from("torch.distributed.fsdp", "fully_shard")
            if self.lay.strategy.hybrid:
                mesh = fill(pt.HYBRID_MESH, what="HSDP: a 2-D mesh, shard along dp_shard, replicate along dp_replicate",
                             names='("dp_replicate", "dp_shard")')  # fmt: skip
            else:
                mesh = 'mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp_shard",))'
            precision, policy = "", ""
            if self.precision is Precision.BF16_TRUE:
                precision = "model = model.to(torch.bfloat16)  # bf16-true: no fp32 master copy"
            elif self.mixed:
                self.use_from("torch.distributed.fsdp", "MixedPrecisionPolicy")
                precision = join_lines(
                    self._precision_comment(),
                    f"mp_policy = MixedPrecisionPolicy(param_dtype={self.compute_dtype}, reduce_dtype=torch.float32)",
                )
                policy = ", mp_policy=mp_policy"
            return fill(pt.PARALLELIZE_FSDP2, mesh=mesh, precision=precision, policy=policy,
                         activation_checkpointing=ac, **self.speed_lines())  # fmt: skip
        raise RenderError(f"no parallelize section for strategy family {self.family!r}")  # pragma: no cover

    def _fsdp2_precision(self) -> tuple[str, str, str]:
        """(what to do to the whole model first, the mixed-precision policy's lines, the fully_shard argument)."""
        if self.precision is Precision.BF16_TRUE:
            return "model = model.to(torch.bfloat16)  # bf16-true: no fp32 master copy", "", ""
        if self.mixed:
            self.use_from("torch.distributed.fsdp", "MixedPrecisionPolicy")
            policy = join_lines(
                self._precision_comment(),
                f"mp_policy = MixedPrecisionPolicy(param_dtype={self.compute_dtype}, reduce_dtype=torch.float32)",
            )
            return "", policy, ", mp_policy=mp_policy"
        return "", "", ""

    def tp_plan(self) -> str:
        """The demo model's tensor-parallel layout (tensor-parallel scripts only)."""
        if self.tp == 1:
            return ""
        self.use_from("torch.distributed.tensor", "Replicate", "Shard")
        self.use_from("torch.distributed.tensor.parallel", "ColwiseParallel", "ParallelStyle", "PrepareModuleInput",
                      "RowwiseParallel", "SequenceParallel")  # fmt: skip
        mlp = {
            "mlp_plan": join_lines(
                '"blocks.*.mlp.0": ColwiseParallel(),  # the MLP\'s first linear (its bias is split with it)',
                '"blocks.*.mlp.2": RowwiseParallel(output_layouts=stream),  # its second (the bias stays whole)',
            ),
            "mlp_sp": '"blocks.*.mlp": PrepareModuleInput(**gather),',
        }
        if self.ep > 1:  # the router and the experts stay whole on every tp rank (expert parallelism splits experts)
            self.use_from("torch.distributed.tensor.parallel", "PrepareModuleInputOutput")
            mlp = {
                "mlp_plan": "",
                "mlp_sp": join_lines(
                    "# the mixture of experts routes whole sequences: gathered before, this rank's part kept after",
                    '"blocks.*.mlp": PrepareModuleInputOutput(',
                    "    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,",
                    "    output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True,",
                    "),",
                ),
            }
        if self.pp > 1:
            self.use("fnmatch")
            return join_lines(fill(pt.TP_PLAN, **mlp), "", "", fill(ppt.HELD))
        return fill(pt.TP_PLAN, **mlp)

    def context_parallel(self) -> str:
        """``sequence_split()``: context parallelism around each micro-batch (context-parallel scripts only)."""
        if self.cp == 1:
            return ""
        self.use("contextlib")
        self.use_from("typing", "Any")
        self.use_from("torch.distributed.tensor", "DTensor", "Shard")
        self.use_from("torch.distributed.tensor.experimental", "context_parallel")
        return fill(ct.CONTEXT_PARALLEL)

    def expert_parallel(self) -> str:
        """``ExpertParallel`` and the expert mesh (expert-parallel scripts only)."""
        if self.ep == 1:
            return ""
        self.use("functools")
        self.use_from("typing", "Any")
        self.use_from("torch.distributed._functional_collectives", "all_to_all_single_autograd")
        self.use_from("torch.distributed.tensor", "Shard", "distribute_module", "distribute_tensor")
        self.use_from("torch.distributed.tensor.parallel", "ParallelStyle")
        if self.cp > 1:  # the cp ranks shard the model states with the data-parallel ones: ep borrows from both
            return fill(et.EXPERT_PARALLEL, shard_what="dp_shard x cp ranks",
                        shard_mesh='mesh["dp_shard", "cp"]._flatten("dp_shard_cp")')  # fmt: skip
        return fill(et.EXPERT_PARALLEL, shard_what="data-parallel shard ranks", shard_mesh='mesh["dp_shard"]')

    def pipeline(self) -> str:
        """Stage split, stage bounds and schedule (pipeline scripts only)."""
        if self.pp == 1:
            return ""
        self.use_from("torch.distributed.pipelining", "PipelineStage", "Schedule1F1B", "ScheduleGPipe",
                      "ScheduleInterleaved1F1B")  # fmt: skip
        params = "stages: list[tuple[int, nn.Module]], mesh: DeviceMesh, args: argparse.Namespace, device: torch.device"
        loss = "loss_fn"
        if self.fp16:  # the last stage scales the loss (the caller passes the scaler's loss)
            self.use_from("collections.abc", "Callable")
            params = join_lines(
                params + ",",
                "loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = loss_fn,",
            )
            loss = "loss"
        return fill(ppt.PIPELINE, schedule_params=params, schedule_loss=loss)

    def build_mesh(self) -> str:
        """``build_mesh()``: ``([pp,] [dp_replicate,] dp_shard[, tp])``, outermost first (tensor/pipeline scripts)."""
        if not self.meshed:
            return ""
        self.use_from("torch.distributed.device_mesh", "DeviceMesh", "init_device_mesh")
        names: list[str] = []
        sizes: list[str | None] = []  # None: the data-parallel size that fills the rest
        unit: list[str] = []
        what: list[str] = []
        if self.pp > 1:
            names.append("pp")
            sizes.append("PP")
            unit.append("PP")
            what.append(
                "The pipeline stages are the outermost dimension: a stage's ranks are world_size // PP apart (across "
                "nodes, where only the activations between stages travel)."
            )
        if self.lay.strategy.hybrid:
            names += ["dp_replicate", "dp_shard"]
            unit.append("SHARD_GROUP_SIZE")
            sizes += [None, "SHARD_GROUP_SIZE"]
            what.append(
                "Each group of SHARD_GROUP_SIZE replicas shards the model states (dp_shard), the groups hold copies "
                "(dp_replicate)."
            )
        else:
            names.append("dp_shard")
            sizes.append(None)
            what.append("The model states are sharded across the data-parallel replicas (dp_shard).")
        if self.cp > 1 and self.lay.strategy.hybrid:  # the shard group holds the cp ranks
            names.append("cp")
            sizes[-1] = "SHARD_GROUP_SIZE // CP"
            sizes.append("CP")
            what.append("The CP ranks split every sequence; they are part of the shard group (dp_shard x cp).")
        elif self.cp > 1:
            names.append("cp")
            sizes.append("CP")
            unit.append("CP")
            what.append(
                "The CP ranks split every sequence; with the data-parallel ranks they shard the model states "
                "(dp_shard x cp)."
            )
        if self.ep > 1:
            source = "dp_shard x cp" if self.cp > 1 else "dp_shard"
            what.append(f"Expert parallelism borrows its EP ranks from {source} (expert_mesh()).")
        if self.tp > 1:
            names.append("tp")
            sizes.append("TP")
            unit.append("TP")
            what.insert(
                0, "The TP ranks of one model replica are neighbours (inside a node: their per-layer collectives stay "
                "on NVLink)."
            )  # fmt: skip
        product = " * ".join(unit) or "1"  # expert parallelism alone: a data-parallel mesh to carve the ep ranks from
        size_exprs = ["world_size // unit" if x is None else x for x in sizes]
        doc = wrap(" ".join(what), 112)
        return fill(
            pt.BUILD_MESH, shape=f"({', '.join(names)})", innermost=", tensor parallelism innermost" * (self.tp > 1),
            what="\n".join(doc), unit=product if len(unit) == 1 else f"({product})",
            unit_what=" x ".join(unit), sizes=", ".join(size_exprs) + "," * (len(names) == 1),
            names=", ".join(f'"{n}"' for n in names) + "," * (len(names) == 1),
        )  # fmt: skip

    def _parallelize_mesh(self, ac: str) -> str:
        self.use_from("torch.distributed.fsdp", "fully_shard")
        model_first, precision, policy = self._fsdp2_precision()
        if self.zero1_as_fsdp2:  # ZeRO-1's layout with DTensors: parameters gathered once per step, kept to backward
            policy += ", reshard_after_forward=False"
        if self.lay.strategy.hybrid:
            dims, dp_what = '"dp_replicate", "dp_shard"', "HSDP: shard along dp_shard, replicate along dp_replicate"
        else:
            dims, dp_what = '"dp_shard"', "FSDP2 shards the model states across the data-parallel replicas"
        dp_mesh = f"dp_mesh = mesh[{dims}]  # {dp_what}"
        if self.cp > 1:
            dims = dims.replace('"dp_shard"', '"dp_shard_cp"')
            dp_mesh = join_lines(
                "# the cp ranks hold other tokens of the same sequences: their gradients average like data-parallel",
                "# ones, so they shard the model states with the data-parallel ranks (dp_shard x cp flattened)",
                *(
                    ['dp_mesh = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")']
                    if not self.lay.strategy.hybrid
                    else ['mesh["dp_shard", "cp"]._flatten("dp_shard_cp")', f"dp_mesh = mesh[{dims}]  # {dp_what}"]
                ),
            )
        root, note = f"fully_shard(model, mesh=dp_mesh{policy})", "also moves the shards to the mesh's device"
        shard_root = f"{root}  # {note}" if len(root) + len(note) < 112 else join_lines(f"# the root: {note}", root)
        shard_experts = ""
        if self.ep > 1:
            shard_experts = self._shard_experts(policy)
        tensor_parallel = ""
        if self.tp > 1:
            self.use_from("torch.distributed.tensor.parallel", "parallelize_module")
            layout = "held(model, tp_plan(SEQUENCE_PARALLEL))" if self.pp > 1 else "tp_plan(SEQUENCE_PARALLEL)"
            what = "each layer's weights" if self.pp == 1 else "this stage's layers"
            tensor_parallel = join_lines(
                f"# split {what} over the tp ranks as tp_plan() says (taken from tp rank 0, so every rank agrees)",
                f'parallelize_module(model, mesh["tp"], {layout})',
            )
        if self.ep > 1:
            self.use_from("torch.distributed.tensor.parallel", "parallelize_module")
            tensor_parallel = join_lines(
                *([tensor_parallel] if tensor_parallel else []),
                "# split the experts over the ep ranks (each keeps EXPERTS // EP), tokens move by all-to-all",
                "experts = {n: ExpertParallel() for n, m in model.named_modules() if isinstance(m, GroupedExperts)}",
                'parallelize_module(model, expert_mesh(mesh)["ep"], experts)',
            )
        if self.pp > 1 and self.tp > 1:
            doc = "One pipeline stage: tensor parallelism over ``tp``, then FSDP2 over the data-parallel dims."
        elif self.pp > 1:
            doc = "One pipeline stage: FSDP2 over the data-parallel dims, each block and the stage as a root."
        else:
            doc = "Tensor parallelism over ``tp``, then FSDP2 over the data-parallel dims (torchtitan's order)."
        return fill(pt.PARALLELIZE_FSDP2_TP, doc=doc, precision_model=model_first, tensor_parallel=tensor_parallel,
                     activation_checkpointing=ac, precision=precision, policy=policy, dp_mesh=dp_mesh,
                     shard_root=shard_root, shard_experts=shard_experts, **self.speed_lines())  # fmt: skip

    def _shard_experts(self, policy: str) -> str:
        """FSDP2 over ``efsdp`` for each experts module, before the blocks' (which then skip their parameters)."""
        if self.lay.strategy.hybrid:
            self.use_from("torch.distributed.device_mesh", "DeviceMesh")
            emesh = 'DeviceMesh._concatenate([mesh["dp_replicate"], expert_mesh(mesh)["efsdp"]])'
        else:
            emesh = 'expert_mesh(mesh)["efsdp"]'
        return join_lines(
            "# each rank's experts are sharded over efsdp (the data-parallel ranks that hold the same experts); their",
            "# gradients sum every data-parallel rank's tokens, so they are divided by the data-parallel size",
            f"experts_mesh = {emesh}",
            "for module in model.modules():",
            "    if isinstance(module, GroupedExperts):  # first: the blocks' fully_shard then skips their parameters",
            f"        fully_shard(module, mesh=experts_mesh{policy})",
            "        module.set_gradient_divide_factor(float(dp_mesh.size()))",
            '        if expert_mesh(mesh)["efsdp"].size() > 1:  # a custom divisor is a PREMUL_SUM, which gloo lacks:',
            "            module.set_force_sum_reduction_for_comms(True)  # sum, then divide",
        )

    def clip_helper(self) -> str:
        """``clip_grad_norm()`` over DTensor gradients on several meshes (and pipeline stages)."""
        if not self.meshed:
            return ""
        self.use_from("torch.distributed.tensor", "DTensor")
        return fill(ppt.CLIP_PIPELINE if self.pp > 1 else pt.CLIP_MESHES)
