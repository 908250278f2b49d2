"""The plan as a complete, runnable PyTorch training script (DDP, FSDP, FSDP2 with tp/pp/cp/ep, ZeRO).

:func:`render_train_script` writes one readable file for the plan's chosen candidate: process-group set-up from
torchrun's environment, the strategy with the plan's numbers (micro-batch, accumulation, bucket and shard-group
sizes), precision, activation checkpointing, gradient accumulation without redundant communication, clipping, the
optimizer, and checkpoint save/resume. Its model and dataset are a small demo transformer and synthetic tokens in a
``build_model()`` / ``build_dataset()`` pair, marked as the parts a user replaces. The generated code passes ruff and
runs as is (on CPU with gloo for a quick check, e.g. ``--steps 5 --model-dim 32 --seq-len 32``).

Tensor parallelism (``fsdp2+tpN``, ``fsdp2+tpN+sp``, ``fsdp2-hybrid+tpN(+sp)``) is written as the worker applies it
(:mod:`jupyter_dist.worker._parallel`), in plain PyTorch so the script stays self-contained: one ``init_device_mesh``
of ``(dp_shard, tp)`` or ``(dp_replicate, dp_shard, tp)``, tp innermost; the demo model's Megatron layout as a
``tp_plan(sequence_parallel)`` of ``parallelize_module`` styles next to ``BLOCK_CLASS`` (the part a user adapts to
their model); activation checkpointing; ``fully_shard`` over the data-parallel sub-mesh; data loaded by data-parallel
rank (tp ranks see the same batch); gradients clipped per mesh; DCP checkpoints.

Pipeline parallelism (``fsdp2+ppN``, ``fsdp2+tpN+ppM(+sp)``, and their ``fsdp2-hybrid`` forms) follows the worker too
(:mod:`jupyter_dist.worker._pipeline`): the mesh ``(pp, [dp_replicate,] dp_shard[, tp])``, pp outermost; the demo
model keeps its blocks in a ``ModuleDict`` keyed by index and skips parts set to ``None``, so ``split_model()`` gives
each rank its stages under the whole model's parameter names (contiguous blocks balanced by cost, cut by an inlined
copy of :func:`~jupyter_dist.plan.pipeline.stage_bounds`; ``keep_stage_part()`` is the part a user adapts); TP,
activation checkpointing and FSDP2 per stage; a ``PipelineStage`` per stage on the ``pp`` group and a GPipe, 1F1B
(default) or interleaved-1F1B schedule (``--schedule``, ``--stages-per-rank``) over the plan's micro-batches (its
gradient accumulation); data read by data-parallel rank on the first stage (inputs) and the last (targets), the
loss on the last; the gradient norm summed over the stages; one optimizer per stage; DCP checkpoints with
``StateDictOptions(flatten_optimizer_state_dict=True)`` (one key per parameter, so a checkpoint resumes under another
pipeline split).

Context parallelism (``+cpN``) runs PyTorch's ``context_parallel`` around each micro-batch's forward and backward, as
the workers do (:mod:`jupyter_dist.worker._context`): the sequence cut with causal load balancing, ring attention over
``cp``, the model given its tokens' positions, FSDP2 over ``dp_shard x cp``; on CPU the script routes the CPU flash
kernels through the same ring. Expert parallelism (``+epN``) gives the demo model a top-k mixture of grouped experts
and splits them over ``ep`` ranks borrowed from the data-parallel ones, tokens moved by all-to-all
(:mod:`jupyter_dist.worker._expert`). Every composition of tp, pp, cp and ep the planner prints is generated, with
``fsdp2``, ``fsdp2-hybrid`` or ``zero1``, which with model parallelism runs as FSDP2 with
``reshard_after_forward=False`` (:func:`~jupyter_dist.plan.strategies.runs_as`), as in the workers; under fp16 a
pipeline's last stage scales the loss and every stage unscales with one ``ShardedGradScaler``. Model parallelism under
other strategies and FSDP1's HYBRID_SHARD over one GPU per node are refused with a line naming what can be generated.

The script is assembled from templates, one module per concern in :mod:`jupyter_dist.render.train` (the model and
data, data/tensor parallelism and the mesh, the pipeline, the training loop), by the assembler there (``Script``);
this module checks what can be generated and is the entry point. Pure and stdlib only: it renders text and never
imports torch.
"""

from __future__ import annotations

from ..plan.parallel import ParallelDims
from ..plan.plan import Plan
from ..plan.strategies import FSDP1_SHARDING, MODEL_PARALLEL
from ..plan.training import Precision, fp8_strategy_problem
from .common import Layout, RenderError, RenderOptions, layout_of
from .train import loop_tpl as lt
from .train import model_tpl as mt
from .train.base import DEFAULT_STEPS, shard_group
from .train.script import Script
from .train.text import fill

__all__ = ["render_train_script", "FAMILIES", "DEFAULT_STEPS", "FSDP1_SHARDING"]

FAMILIES = ("ddp", "fsdp", "fsdp2", "deepspeed")
"""Strategy families the code generator covers (data parallelism, sharded or not; fsdp2 also with tp/pp/cp/ep)."""


_MODEL_PARALLEL = MODEL_PARALLEL
"""Strategies generated with tp/pp/cp/ep: FSDP2 and HSDP, and zero1, which runs as FSDP2 keeping gathered params."""


def _check_supported(lay: Layout) -> None:
    dims, name = lay.dims, lay.candidate.name
    mp_names = [c.name for c in lay.plan.candidates if _generates_model_parallel(c.strategy, c.dims)]
    have = f" (this plan has: {', '.join(mp_names[:6])}{', ...' * (len(mp_names) > 6)})" if mp_names else ""
    for dim, what in (("tp", "tensor"), ("pp", "pipeline"), ("cp", "context"), ("ep", "expert")):
        if getattr(dims, dim) > 1 and lay.candidate.strategy not in _MODEL_PARALLEL:
            raise RenderError(
                f"candidate {name}: {what} parallelism is generated with FSDP2 only: fsdp2, fsdp2-hybrid or zero1 "
                f"(run as FSDP2) with +tpN (+sp), +ppN, +cpN and/or +epN{have}; {lay.candidate.strategy} with {dim} "
                f"{getattr(dims, dim)} needs Megatron-DeepSpeed, or compile one of those or a data-parallel candidate "
                "(RenderOptions(candidate=...))"
            )
    model = lay.plan.model
    if dims.ep > 1 and (model.experts < 2 or model.experts % dims.ep):
        raise RenderError(
            f"candidate {name}: expert parallelism ep {dims.ep} needs a mixture-of-experts model whose experts it "
            f"divides; {model.name} has {model.experts} expert(s)"
        )
    group = shard_group(lay)
    unit = group * dims.tp * dims.pp
    meshed = not dims.is_data_parallel_only
    if meshed and lay.strategy.hybrid and (group < 1 or lay.world_size % unit or (group // dims.cp) % dims.ep):
        raise RenderError(
            f"candidate {name}: the mesh (pp {dims.pp}, dp_replicate, dp_shard x cp {group}, tp {dims.tp}) does not "
            f"cover the {lay.world_size} processes ({lay.nodes} nodes x {lay.gpus_per_node}), or ep {dims.ep} does "
            "not divide dp_shard: pp x shard group x tp must divide them"
        )
    if lay.strategy.family == "fsdp" and lay.strategy.hybrid and group == 1:
        # measured with torch 2.13 on gloo: on a (2, 1) mesh FSDP1's HYBRID_SHARD gradients differ from every other
        # strategy's (wrong grad norm and loss curve), while on a (2, 2) mesh they agree exactly
        raise RenderError(
            f"candidate {lay.candidate.name} shards over groups of 1 GPU ({lay.gpus_per_node} per node), so "
            "HYBRID_SHARD only replicates, and FSDP1 reduces gradients wrongly on such a mesh; compile fsdp-no-shard, "
            "ddp or fsdp2-hybrid instead"
        )
    if lay.strategy.family not in FAMILIES:  # pragma: no cover - every strategy belongs to one of them
        raise RenderError(f"strategy family {lay.strategy.family!r} has no code generator; valid: {FAMILIES}")


def _generates_model_parallel(strategy: str, dims: ParallelDims) -> bool:
    """Whether the generator writes this combination with model parallelism (FSDP2, HSDP, or zero1 as FSDP2)."""
    return not dims.is_data_parallel_only and strategy in _MODEL_PARALLEL


def render_train_script(plan: Plan, opts: RenderOptions | None = None, *, layout: Layout | None = None) -> str:
    """A complete, runnable training script for the plan's chosen candidate (``opts.candidate`` or the best).

    Parameters
    ----------
    plan
        The plan; its candidate is resolved and checked by :func:`~jupyter_dist.render.common.layout_of`.
    opts
        Learning rate, weight decay, clipping, checkpoint folder; the script name and launcher for the launch line.
    layout
        The run's resolved layout when the caller has one (computed once per run); else resolved here.

    Returns
    -------
    str
        Python source using DDP, FSDP (FSDP1), FSDP2 (with tensor, pipeline, context and expert parallelism for
        ``fsdp2(-hybrid)`` and ``zero1`` with ``+tpN``, ``+ppN``, ``+cpN``, ``+epN`` in any composition) or
        DeepSpeed, per the family of the strategy that runs.

    Raises
    ------
    RenderError
        When the candidate uses model parallelism with anything but FSDP2, HSDP or zero1 (the message names the
        plan's candidates that can be generated), or when
        :func:`~jupyter_dist.render.common.layout_of` finds nothing consistent to compile.
    """
    opts = opts or RenderOptions()
    lay = layout or layout_of(plan, opts)
    problem = fp8_strategy_problem(lay.strategy.family, lay.dims.tp) if lay.precision is Precision.FP8 else None
    if problem is not None:  # the worker refuses the same (jd.wrap with JD_PRECISION=fp8)
        raise RenderError(f"candidate {lay.candidate.name}: {problem}")
    _check_supported(lay)
    s = Script(lay, opts)
    # the sections first: they record the imports they use
    sections = [s.constants(), s.model(), s.tp_plan(), fill(mt.MODEL_REST), s.arguments(), s.setup(),
                s.checkpoint_helper(), s.speed(), s.build_mesh(), s.context_parallel(), s.expert_parallel(),
                s.pipeline()]  # fmt: skip
    if not s.ds:
        sections += [s.parallelize(), s.clip_helper()]
    sections += [s.optimizer(), fill(lt.MICRO_BATCHES), s.checkpoint_io(), s.main()]
    sections.append('if __name__ == "__main__":\n    main()')
    body = "\n\n\n".join(x for x in sections if x)
    return f"{s.docstring()}\n\n{s.import_block()}\n\n{body}\n"
