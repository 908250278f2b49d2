"""The planner: enumerate candidates, evaluate memory and time, choose one and explain why (stdlib only)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from ..errors import ParallelismError, PlanInputError
from .calibration import Calibration, plan_shape
from .hardware import Hardware, fp8_problem
from .memory import Assumptions, comm_settings, estimate_memory, state_bytes_per_param
from .model import ModelSpec, get_preset
from .parallel import ParallelDims
from .perf import estimate_time, matmul_efficiency
from .pipeline import MAX_PIPELINE_STAGES
from .plan import Candidate, Plan
from .strategies import STRATEGIES, StrategySpec, get_strategy, runs_as
from .training import Checkpointing, Precision, TrainingShape, fp8_strategy_problem
from .units import fmt_count, fmt_gib

__all__ = ["plan", "resolve_model", "LONG_SEQUENCE"]

LONG_SEQUENCE = 16384
"""Sequence length from which context-parallel candidates are considered."""

_DP_ONLY = list(STRATEGIES.values())  # every strategy runs data-parallel only
_MODEL_PARALLEL = [s for s in STRATEGIES.values() if s.model_parallel]


def resolve_model(model: ModelSpec | str | int | float | Mapping[str, Any] | Any, *, heads: int | None = None
                  ) -> ModelSpec:  # fmt: skip
    """Accept a ``ModelSpec``, a preset name, a bare parameter count, a Hugging Face config dict, or a model.

    A model is what :meth:`ModelSpec.from_module` measures: an ``nn.Module`` instance, a class, or a zero-argument
    callable that builds one (``lambda: GPT(cfg)``, built on the meta device). ``heads`` is for such a model only,
    where its structure does not state its attention heads.
    """
    if heads is not None:
        if isinstance(model, (ModelSpec, str, int, float, Mapping)):
            raise PlanInputError(
                "heads= is for a module whose heads the planner cannot read; a preset, count or config states its own"
            )
        return module_spec(model, heads=heads)
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        try:
            return get_preset(model)
        except PlanInputError as unknown:
            try:  # "7B", "7.5e9": a bare count
                return ModelSpec.from_params(model)
            except PlanInputError:
                raise unknown from None
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        return ModelSpec.from_params(model)
    if isinstance(model, Mapping):
        return ModelSpec.from_hf_config(model)
    if hasattr(model, "parameters") or callable(model):
        return ModelSpec.from_module(model)
    raise PlanInputError(f"cannot plan for a {type(model).__name__}: give a preset name, ModelSpec, count or config")


def module_spec(model: Any, *, heads: int | None = None, name: str | None = None) -> ModelSpec:
    """:meth:`ModelSpec.from_module` of ``model``: an instance, a class or a zero-argument callable.

    ``heads``: where its structure does not state them (``jupyter_dist.plan(..., heads=)``, ``--module ... --heads``).
    """
    from ._module import measure_module

    spec: ModelSpec = measure_module(ModelSpec, model, (), {}, name=name, heads=heads)
    return spec


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(1, int(math.log2(limit)) + 1)] if limit >= 2 else []


def _dims_problem(model: ModelSpec, training: TrainingShape, dims: ParallelDims) -> str | None:
    """Why these degrees cannot work for this model, or ``None``."""
    if model.heads % dims.tp or (model.n_kv_heads % dims.tp and dims.tp % model.n_kv_heads):
        return f"tp ({dims.tp}) must divide the attention heads ({model.heads}, {model.n_kv_heads} kv)"
    if model.d_ffn % dims.tp:
        return f"tp ({dims.tp}) must divide the MLP width ({model.d_ffn})"
    slots, edges = (model.layers + 2, " + 2 (pp-light-edges: the embedding and the output take a layer's place "
                    "each)") if training.pp_light_edges else (model.layers, "")  # fmt: skip
    if dims.pp > slots:
        return f"pp ({dims.pp}) cannot exceed the number of layers ({model.layers}){edges}"
    virtual = training.pp_stages_per_rank
    if dims.pp > 1 and dims.pp * virtual > MAX_PIPELINE_STAGES:
        return (f"pp ({dims.pp}) x {virtual} stages per rank = {dims.pp * virtual:,} pipeline stages; the planner "
                f"models at most {MAX_PIPELINE_STAGES:,}")  # fmt: skip
    if dims.pp > 1 and dims.pp * virtual > slots:
        return (f"pp ({dims.pp}) x {virtual} stages per rank ({training.pp_schedule}) cannot exceed the number of "
                f"layers ({model.layers}){edges}")  # fmt: skip
    if dims.cp > 1 and training.seq_len % (2 * dims.cp):
        return (
            f"seq-len ({training.seq_len}) must be a multiple of 2 x cp ({2 * dims.cp}) "
            "for load-balanced ring attention"
        )
    if dims.ep > 1 and (not model.is_moe or model.experts % dims.ep):
        return (
            f"ep ({dims.ep}) needs a mixture-of-experts model whose experts ({model.experts}) it divides"
        )
    return None


def _enumerate(
    model: ModelSpec, training: TrainingShape, hardware: Hardware, fixed: dict[str, int], sp: bool | None
) -> list[tuple[StrategySpec, ParallelDims]]:
    world = hardware.world_size
    gpn = hardware.gpus_per_node
    if fixed:
        dims = ParallelDims.from_world(world, gpus_per_node=gpn, sp=True if sp is None else sp, **fixed)
        problem = _dims_problem(model, training, dims)
        if problem:
            raise ParallelismError(problem)
        strategies = _DP_ONLY if dims.is_data_parallel_only else _MODEL_PARALLEL
        return [(s, dims) for s in strategies if not (s.hybrid and hardware.nodes == 1)]

    out: list[tuple[StrategySpec, ParallelDims]] = []
    base = ParallelDims(dp=world)
    out += [(s, base) for s in _DP_ONLY if not (s.hybrid and hardware.nodes == 1)]
    seen = {base}
    use_sp = True if sp is None else sp

    def add(**kw: int) -> None:
        try:
            dims = ParallelDims.from_world(world, sp=use_sp, **kw)
        except ParallelismError:
            return
        if dims in seen or _dims_problem(model, training, dims):
            return
        seen.add(dims)
        out.extend((s, dims) for s in _MODEL_PARALLEL if not (s.hybrid and hardware.nodes == 1))

    tps = [1] + [t for t in _powers_of_two(min(gpn, 8)) if world % t == 0]
    pps = [1] + [p for p in _powers_of_two(min(world, 64)) if p <= model.layers]
    for tp in tps:
        for pp in pps:
            if tp * pp > 1 and world % (tp * pp) == 0:
                add(tp=tp, pp=pp)
    if model.is_moe:
        for ep in _powers_of_two(model.experts):
            for pp in (1, 2, 4):
                if world % pp == 0 and (world // pp) % ep == 0:
                    add(ep=ep, pp=pp)
    if training.seq_len >= LONG_SEQUENCE:
        for cp in _powers_of_two(min(world, 16)):
            for tp in tps:
                add(cp=cp, tp=tp)
    return out


def _evaluate(
    model: ModelSpec, training: TrainingShape, hardware: Hardware, strategy: StrategySpec, dims: ParallelDims,
    assumptions: Assumptions, memory_offset: int = 0, rehearsed: Mapping[str, int] | None = None,
) -> Candidate | None:
    try:
        grad_accum = training.accumulation_for(dims.dp)
    except PlanInputError:
        return None
    if dims.pp > 1 and training.pp_schedule == "interleaved-1f1b" and grad_accum % max(1, grad_accum // dims.pp):
        return None  # PyTorch's interleaved 1F1B needs micro-batches in whole rounds (a multiple of m // pp)
    memory = estimate_memory(model, training, hardware, strategy, dims, grad_accum=grad_accum,
                             assumptions=assumptions)  # fmt: skip
    suffix = dims.label()
    name = f"{strategy.name}+{suffix}" if suffix else strategy.name
    if rehearsed and name in rehearsed:  # this candidate of this plan rehearsed: its peak is the rehearsed one
        correction = rehearsed[name]
        memory = replace(memory, overhead=memory.overhead + correction,
                         detail={**memory.detail, "calibration": correction, "rehearsal_correction": correction})
    elif memory_offset:  # measured by %dist_tune on this hardware: what the model left out (or counted twice)
        memory = replace(memory, overhead=max(0, memory.overhead + memory_offset),
                         detail={**memory.detail, "calibration": memory_offset})  # fmt: skip
    time = estimate_time(model, training, hardware, strategy, dims, grad_accum=grad_accum, assumptions=assumptions)
    settings: dict[str, Any] = dict(comm_settings(model, strategy))
    settings["shard_group_size"] = (
        dims.shard_size // dims.hybrid_replicas(hardware.gpus_per_node) if strategy.hybrid
        else dims.shard_size if strategy.shard_optimizer else 1
    )  # fmt: skip
    if strategy.hybrid and strategy.family == "fsdp" and settings["shard_group_size"] < 2:
        # FSDP1's HYBRID_SHARD over shard groups of one GPU reduces gradients wrongly (measured with torch 2.13 on
        # gloo; the renderer refuses it too); FSDP2's hybrid mesh handles it (it only replicates then)
        return None
    notes: list[str] = []
    if strategy.offload_optimizer:
        per_node_cpu = hardware.accelerator.node_cpu_memory_bytes
        notes.append(
            f"needs {fmt_gib(memory.cpu_bytes_per_node)} of host memory per node "
            f"(DeepSpeed's estimator; a typical node has {fmt_gib(per_node_cpu, 0)})"
        )
    if dims.pp > 1 and model.layers % dims.pp:
        notes.append(f"{model.layers} layers do not split evenly into {dims.pp} stages")
    needs = _needs(model, dims)
    if training.precision is Precision.FP8:  # what jd.wrap refuses for fp8: listed, never recommended
        family = runs_as(strategy, model_parallel=not dims.is_data_parallel_only).family  # zero1+tp: FSDP2
        fp8 = fp8_strategy_problem(family, dims.tp)
        needs = "; ".join(n for n in (needs, fp8) if n)
    return Candidate(
        name=name, strategy=strategy.name, dims=dims,
        grad_accum=grad_accum, memory=memory, time=time, settings=settings, notes=tuple(notes),
        needs=needs,
    )  # fmt: skip


def _needs(model: ModelSpec, dims: ParallelDims) -> str:
    """Why the measured module cannot run these degrees (``""`` when it can; see ``ModelSpec.needs``)."""
    return "; ".join(why for dim, why in model.needs if getattr(dims, dim) > 1)


def _cpu_ok(c: Candidate, hardware: Hardware) -> bool:
    return c.memory.cpu_bytes_per_node <= hardware.accelerator.node_cpu_memory_bytes


def _rank(cands: Iterable[Candidate], hardware: Hardware, min_headroom: float) -> list[Candidate]:
    """Candidates that fit with headroom, fastest first; within 3% of the fastest the simplest first."""
    pool = [c for c in cands if c.fits and c.memory.headroom >= min_headroom and _cpu_ok(c, hardware) and not c.needs]
    if not pool:
        return []
    best = max(c.time.tokens_per_s for c in pool)

    def key(c: Candidate) -> tuple[int, int, float]:
        near = c.time.tokens_per_s >= 0.97 * best
        complexity = STRATEGIES[c.strategy].complexity + 2 * (c.dims.world_size != c.dims.dp)
        return (0 if near else 1, complexity if near else 0, -c.time.tokens_per_s)

    return sorted(pool, key=key)


def plan(
    model: ModelSpec | str | int | float | Mapping[str, Any],
    hardware: Hardware | str = "h100-80gb",
    training: TrainingShape | None = None,
    *,
    strategy: str | None = None,
    tp: int | None = None,
    pp: int | None = None,
    cp: int | None = None,
    ep: int | None = None,
    sp: bool | None = None,
    assumptions: Assumptions | None = None,
    calibration: Calibration | None = None,
    heads: int | None = None,
) -> Plan:
    """Plan distributed training of ``model`` on ``hardware``: which strategy, will it fit, how fast, and why.

    Parameters
    ----------
    model
        A :class:`ModelSpec`, a preset name (``"llama-2-7b"``), a parameter count, a Hugging Face config dict, or
        a model: an ``nn.Module``, its class, or a zero-argument callable building one (``lambda: GPT(cfg)``),
        measured on the meta device (:meth:`ModelSpec.from_module`).
    hardware
        A :class:`Hardware`, or an accelerator name for one node of it.
    training
        The training shape; defaults to micro-batch 1, sequence 2048, bf16-mixed AdamW.
    strategy
        Evaluate only this strategy (e.g. ``"zero3"``); the plan still says what else would fit.
    tp, pp, cp, ep, sp
        Fix model-parallel degrees; data parallelism takes the rest of the world.
    assumptions
        Calibration of the memory/time model.
    calibration
        Rates and memory measured on this hardware by ``%dist_tune`` (see :mod:`.calibration`), and the memory of
        candidates rehearsed for this very plan (``%dist_rehearse --save``); the plan uses them and says so.
    heads
        The attention heads of a model whose structure does not state them (asked for, never guessed).
    """
    spec = resolve_model(model, heads=heads)
    hw = Hardware.from_names(hardware) if isinstance(hardware, str) else hardware
    shape = training or TrainingShape()
    if shape.precision is Precision.FP8 and (problem := fp8_problem(hw.accelerator)):
        raise PlanInputError(problem)
    assume = assumptions or Assumptions()
    offset = 0
    rehearsed: dict[str, int] = {}
    if calibration is not None:
        hw = calibration.apply(hw)
        offset = calibration.memory_offset_bytes
        rehearsed = calibration.memory_for(plan_shape(spec, shape, hw, assume))
    requested = get_strategy(strategy) if strategy else None
    fixed = {k: v for k, v in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)) if v is not None}
    for k, v in fixed.items():
        if not isinstance(v, int) or v < 1:
            raise ParallelismError(f"{k} must be a positive integer, got {v!r}")

    pairs = _enumerate(spec, shape, hw, fixed, sp)
    evaluated = [c for s, d in pairs if (c := _evaluate(spec, shape, hw, s, d, assume, offset, rehearsed)) is not None]
    if not evaluated:
        dp = hw.world_size // math.prod(fixed.values() or [1])
        shape.accumulation_for(dp)  # raises the explanatory error
        raise PlanInputError("no candidate could be evaluated for these inputs")
    if requested is not None:
        if fixed and not requested.model_parallel and math.prod(fixed.values()) > 1:
            raise ParallelismError(
                f"strategy {requested.name} does not combine with tp/pp/cp/ep here; use fsdp2 or zero1 "
                "(torchtitan-style 2-D/3-D parallelism), or drop the degrees"
            )
        shown = [c for c in evaluated if c.strategy == requested.name]
        if not shown:  # e.g. a hybrid strategy on one node: evaluate it anyway on the base dims
            c = _evaluate(spec, shape, hw, requested, ParallelDims(dp=hw.world_size), assume, offset, rehearsed)
            shown = [c] if c else []
        if not shown and requested.hybrid and requested.family == "fsdp":
            raise ParallelismError(
                f"{requested.name} shards inside groups of {hw.unit_plural} on one node and replicates across "
                "nodes; with "
                f"{hw.units(hw.gpus_per_node)} per node{' (divided by tp)' if fixed.get('tp', 1) > 1 else ''} a group "
                "holds one GPU, where FSDP1's HYBRID_SHARD reduces gradients wrongly. Use fsdp2-hybrid, fsdp2 or "
                "fsdp-full-shard"
            )
    else:
        shown = evaluated

    ranked = _rank(shown, hw, assume.min_headroom) or _rank(shown, hw, 0.0)
    rest = sorted((c for c in shown if c not in ranked), key=lambda c: (bool(c.needs), not c.fits, c.memory.total))
    candidates = tuple(ranked + rest)
    best = ranked[0] if ranked else None
    reasons = _reasons(spec, shape, hw, assume, evaluated, best, ranked, requested)
    if calibration is not None and calibration.trials:
        reasons.append(
            f"Calibrated on this hardware by %dist_tune: {calibration.describe()}; planned memory includes the "
            f"measured {calibration.memory_offset_bytes / 2**20:+,.0f} MiB per rank (from {calibration.path()}; "
            "--no-calibration, or deleting that file, plans with the published figures)."
        )
    if calibration is not None:
        reasons += _rehearsed_reasons(calibration, rehearsed, shown)
    warnings = _warnings(spec, shape, hw, assume, evaluated, best, requested, fixed)
    if shape.precision is Precision.FP8:
        blocked = sum(1 for c in shown if "fp8" in c.needs)
        if blocked:
            warnings.append(
                f"fp8: {blocked} candidate(s) with DeepSpeed or tensor parallelism are listed, never "
                "recommended: jd.wrap runs torchao's float8 under FSDP2, FSDP1 and DDP, without tp"
            )
    for dim, why in spec.needs:
        blocked = sum(1 for c in shown if getattr(c.dims, dim) > 1)
        if blocked:
            warnings.append(f"{spec.name} cannot run {dim} > 1 as it is ({blocked} candidate(s) listed, never "
                            f"recommended): {why}")  # fmt: skip
    # a measured module: the layout jd.wrap derives for the recommended (else the requested) candidate's tp
    shown_for = best or (candidates[0] if requested is not None and candidates else None)
    layout = None
    if shown_for is not None and shown_for.dims.tp > 1 and spec.tp_layout_of is not None:
        layout = spec.tp_layout_of(shown_for.dims.tp, shown_for.dims.sp)
    return Plan(
        model=spec, hardware=hw, training=shape, assumptions=assume, candidates=candidates,
        recommended=best.name if best else None, reasons=tuple(reasons), warnings=tuple(warnings),
        requested_strategy=requested.name if requested else None, tp_layout=layout,
        tp_layout_for=shown_for.name if layout is not None and shown_for is not None else None,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Explanations
# ---------------------------------------------------------------------------------------------------------------
def _rehearsed_reasons(calibration: Calibration, rehearsed: Mapping[str, int], shown: list[Candidate]) -> list[str]:
    """A sentence per shown candidate whose memory a rehearsal calibrated, or was rehearsed for another plan."""
    out = []
    for c in shown:
        if c.name in rehearsed:
            out.append(
                f"Memory of {c.name} calibrated by a rehearsal of this plan (%dist_rehearse --save): its planned peak "
                f"is the rehearsed one, {rehearsed[c.name] / 2**20:+,.2f} MiB against the model per rank (from "
                f"{calibration.path()}; --no-calibration, or deleting that file, plans with the published figures)."
            )
        elif c.name in calibration.memory_by_candidate:
            out.append(f"The rehearsed memory of {c.name} in {calibration.path()} is for another plan "
                       f"({calibration.rehearsed_for[c.name]}): not applied here.")  # fmt: skip
    return out


def _fit_sentence(c: Candidate, unit: str = "GPU") -> str:
    mem = c.memory
    if mem.fits:
        verdict = f"fits with {100 * mem.headroom:.0f}% headroom"
    else:
        verdict = f"does not fit ({fmt_gib(mem.total - mem.capacity)} over)"
    reuse = f", less {fmt_gib(mem.grads_reuse)} of gradients in memory backward freed" if mem.grads_reuse else ""
    return (
        f"{c.label} needs {fmt_gib(mem.total)} per {unit} (model states {fmt_gib(mem.model_states)}, activations "
        f"{fmt_gib(mem.activations)}, overhead {fmt_gib(mem.overhead)}{reuse}) of {fmt_gib(mem.capacity)}: {verdict}."
    )


def _by_name(cands: list[Candidate], name: str) -> Candidate | None:
    return next((c for c in cands if c.name == name), None)


def _reasons(
    model: ModelSpec, t: TrainingShape, hw: Hardware, a: Assumptions, cands: list[Candidate],
    best: Candidate | None, ranked: list[Candidate], requested: StrategySpec | None,
) -> list[str]:
    out: list[str] = []
    pb, gb, ob = state_bytes_per_param(t.precision, t.optimizer, "deepspeed")
    per_param = pb + gb + ob
    out.append(
        f"{model.name} has {fmt_count(model.params)} parameters; {t.precision.value} with {t.optimizer.value} keeps "
        f"{per_param} bytes of model states per parameter ({pb} params + {gb} grads + {ob} optimizer; ZeRO paper "
        f"Sec. 3.1) = {fmt_gib(per_param * model.params)} before sharding, across {hw.units(hw.world_size)}."
    )
    # the decision flow: the least sharding that fits
    flow = [s.name for s in STRATEGIES.values() if s.family in ("ddp", "deepspeed")]  # DDP, then ZeRO by table order
    for name in flow:
        c = _by_name(cands, name)
        if c is None:
            continue
        out.append(_fit_sentence(c, hw.unit))
        if c.fits and c.memory.headroom >= a.min_headroom:
            break
    mp = [c for c in ranked if c.dims.world_size != c.dims.dp]
    if mp and not any(c.dims.is_data_parallel_only for c in ranked):
        out.append(
            f"No data-parallel strategy fits, so model parallelism is needed: {mp[0].name} splits the model "
            f"tp={mp[0].dims.tp} x pp={mp[0].dims.pp} and fits in {fmt_gib(mp[0].memory.total)}."
        )
    if model.is_moe:
        ep = [c for c in cands if c.dims.ep > 1 and c.fits]
        if ep:
            e = max(ep, key=lambda c: c.time.tokens_per_s)
            out.append(
                f"{model.name} is a mixture of experts ({model.experts} experts, top-{model.top_k}; "
                f"{fmt_count(model.total_expert_params)} of its parameters are experts, "
                f"{fmt_count(model.active_params)} active per token): expert parallelism ep={e.dims.ep} splits the "
                f"experts across {hw.unit_plural} ({fmt_gib(e.memory.total)} per {hw.unit}, "
                f"{e.time.tokens_per_s:,.0f} tokens/s)."
            )
    if t.seq_len >= LONG_SEQUENCE:
        base = min((c for c in cands if c.dims.cp == 1), key=lambda c: c.memory.activations, default=None)
        cpc = min((c for c in cands if c.dims.cp > 1), key=lambda c: c.memory.total, default=None)
        if base and cpc:
            out.append(
                f"Sequence length {t.seq_len:,} is long: activations take {fmt_gib(base.memory.activations)} per "
                f"{hw.unit} "
                f"without context parallelism; cp={cpc.dims.cp} splits the sequence and brings them to "
                f"{fmt_gib(cpc.memory.activations)}."
            )
    if hw.nodes > 1:
        full = _by_name(cands, "fsdp-full-shard") or _by_name(cands, "fsdp2")
        hyb = _by_name(cands, "fsdp-hybrid-shard") or _by_name(cands, "fsdp2-hybrid")
        if full and hyb and hyb.fits:
            faster = hyb.time.step_time_s < full.time.step_time_s
            out.append(
                f"{hw.nodes} nodes over {hw.interconnect.label}: sharding across all {hw.units(hw.world_size)} takes "
                f"{full.time.step_time_s:.3g} s/step, sharding inside each node and replicating across nodes "
                f"(hybrid) {hyb.time.step_time_s:.3g} s/step"
                + (" — hybrid keeps the per-layer all-gathers on the intra-node link." if faster else ".")
            )
    if best is not None:
        tm = best.time
        pool = len(ranked)
        out.append(
            f"Recommended {best.name}: the fastest of {pool} candidate(s) that fit with >= "
            f"{100 * a.min_headroom:.0f}% headroom (simplest within 3%): {tm.step_time_s:.3g} s/step, "
            f"{tm.tokens_per_s:,.0f} tokens/s, MFU {100 * tm.mfu:.0f}%, bound by {tm.bound_label}; the step is "
            f"{tm.describe()}."
        )
        acc = hw.accelerator
        rate = matmul_efficiency(acc.matmul_efficiency, model.hidden)
        if acc.calibration.startswith("--"):
            source = f"as given with {acc.calibration}"
        elif acc.calibration:
            source = f"calibrated on this hardware: {acc.calibration}"
        elif acc.vendor == "cpu":
            source = "a placeholder for CPU processes; %dist_tune measures this machine"
        else:
            source = f"from published measured utilisation on {acc.label}; %dist_tune measures it here"
        fp8 = ""
        if t.precision is Precision.FP8:
            fp8 = f" (the blocks' linear layers: of the {acc.peak_flops('fp8') / 1e12:,.0f} TFLOP/s FP8 peak)"
        out.append(
            f"Matmuls at {100 * rate:.0f}% of the {acc.peak_flops(t.precision.compute_dtype) / 1e12:.0f} TFLOP/s peak"
            f"{fp8} ({source})."
        )
        dp = best.dims.dp
        gbatch = t.micro_batch * best.grad_accum * dp
        out.append(
            f"Effective batch = micro-batch {t.micro_batch} x accumulation {best.grad_accum} x data-parallel {dp} = "
            f"{gbatch:,} sequences = {gbatch * t.seq_len:,} tokens per step."
        )
        out.append(
            "If the learning rate was tuned at another batch size B0, scale it by B/B0 for SGD (Goyal et al. 2017) "
            "or by sqrt(B/B0) for Adam-type optimizers (Malladi et al. 2022), with a linear warm-up over the first "
            "~1-2% of steps (at least a few hundred)."
        )
    else:
        smallest = min(cands, key=lambda c: c.memory.total)
        need = math.ceil(hw.world_size * smallest.memory.model_states / max(1, smallest.memory.capacity * 0.6))
        out.append(
            f"Nothing fits: the smallest candidate, {smallest.name}, needs {fmt_gib(smallest.memory.total)} per "
            f"{hw.unit} of {fmt_gib(smallest.memory.capacity)}. Options: more {hw.unit_plural} (roughly {need} for "
            "these model states), "
            "a smaller micro-batch or sequence, activation checkpointing (--checkpointing full), CPU offload, "
            "or tensor/pipeline parallelism (--tp/--pp)."
        )
        if requested is not None:
            alt = _rank(cands, hw, a.min_headroom)
            if alt:
                out.append(f"{requested.name} does not fit, but {alt[0].name} would ({fmt_gib(alt[0].memory.total)}).")
    return out


def _warnings(
    model: ModelSpec, t: TrainingShape, hw: Hardware, a: Assumptions, cands: list[Candidate],
    best: Candidate | None, requested: StrategySpec | None, fixed: dict[str, int],
) -> list[str]:
    out: list[str] = []
    acc = hw.accelerator
    half = "bf16" if acc.supports_bf16 else "fp16"
    if acc.vendor == "cpu":  # CPU processes: no tensor cores, no fp16 advice; what a rehearsal should use
        if t.precision is Precision.BF16_MIXED:
            out.append("CPU processes run bf16-mixed through CPU autocast, which casts other operators than CUDA "
                       "autocast: memory measured here does not predict bf16-mixed on CUDA; rehearse with --precision "
                       "fp32 or bf16-true.")
        elif t.precision is Precision.FP16_MIXED:
            out.append("fp16 on CPU processes is emulated and slow: use --precision fp32 or bf16-true.")
    elif t.precision is Precision.FP32:
        out.append(
            f"fp32 training: twice the bytes of bf16 for parameters, gradients and activations, and "
            f"{acc.peak_flops('fp32') / 1e12:.0f} vs {acc.peak_flops(half) / 1e12:.0f} TFLOPS on {acc.label}; "
            f"use --precision {half}-mixed."
        )
    if t.precision in (Precision.BF16_MIXED, Precision.BF16_TRUE) and not acc.supports_bf16 and acc.vendor != "cpu":
        out.append(f"{acc.label} has no bf16 tensor cores: use --precision fp16-mixed (with loss scaling).")
    if t.precision is Precision.FP16_MIXED and acc.supports_bf16 and acc.vendor != "cpu":
        out.append(
            f"fp16 needs loss scaling and can overflow; {acc.label} supports bf16: prefer --precision bf16-mixed."
        )
    ddp = _by_name(cands, "ddp")
    if ddp is not None and not ddp.fits and (requested is None or requested.name in ("ddp", "fsdp-no-shard")):
        out.append(
            f"DDP replicates all model states and needs {fmt_gib(ddp.memory.total)} per {hw.unit}: it cannot train "
            "this "
            "model here; use a sharded strategy."
        )
    if t.checkpointing is Checkpointing.NONE:
        heavy = best if best else min(cands, key=lambda c: c.memory.total)
        if t.seq_len >= 8192 or heavy.memory.activations > 0.5 * heavy.memory.capacity:
            out.append(
                f"No activation checkpointing with seq-len {t.seq_len}: activations take "
                f"{fmt_gib(heavy.memory.activations)} per {hw.unit}; --checkpointing selective (or full) cuts them "
                "(Korthikanti et al. 2022)."
            )
    z2 = _by_name(cands, "zero2")
    if requested is not None and requested.offload_optimizer and z2 is not None and z2.fits:
        out.append(
            f"{requested.name} offloads to the CPU although ZeRO-2 fits on the {hw.unit_plural} "
            f"({fmt_gib(z2.memory.total)}); "
            "offload costs PCIe transfers and a CPU optimizer step every iteration."
        )
    if requested is not None and requested.name == "fsdp-no-shard" and model.params > 1e9:
        out.append(
            f"NO_SHARD replicates all {fmt_count(model.params)} parameters' states on every GPU; "
            "use SHARD_GRAD_OP or FULL_SHARD for models over ~1B parameters."
        )
    if hw.nodes > 1 and not hw.interconnect.fast:
        out.append(
            f"Multi-node over {hw.interconnect.label} (no RDMA): gradient and parameter collectives will dominate; "
            "use InfiniBand/RoCE/EFA, or hybrid sharding with a large accumulation."
        )
    tokens_per_gpu = t.micro_batch * t.seq_len
    if hw.world_size > 1 and tokens_per_gpu < 2048 and acc.vendor != "cpu":
        out.append(
            f"Only {tokens_per_gpu} tokens per GPU per micro-batch across {hw.world_size} GPUs: the GPUs will be "
            "under-used and communication will dominate; raise --micro-batch or --seq-len."
        )
    global_seqs = best.grad_accum * t.micro_batch * best.dims.dp if best is not None else 0
    if best is not None and global_seqs * t.seq_len < 64 * 1024 and hw.world_size > 8:
        out.append(
            f"The global batch ({global_seqs} sequences) is small for "
            f"{hw.units(hw.world_size)}; large runs usually take 0.5-4M tokens per step."
        )
    if best is not None and best.dims.pp > 1 and best.grad_accum < 4 * best.dims.pp:
        bubble = (best.dims.pp - 1) / best.grad_accum
        out.append(
            f"Pipeline bubble: {best.grad_accum} micro-batches for {best.dims.pp} stages wastes {100 * bubble:.0f}% of "
            f"compute; use at least {4 * best.dims.pp} micro-batches (--grad-accum)."
        )
    if fixed:
        tp = fixed.get("tp", 1)
        if tp > hw.gpus_per_node:
            out.append(f"tp={tp} spans nodes: tensor-parallel all-reduces run over the network every layer.")
    if model.dims_assumed:
        out.append(
            f"The shape of {model.name} was guessed ({model.layers} layers, hidden {model.hidden}); give "
            "--layers/--hidden/--heads or --hf-config for exact activation memory."
        )
    if best is not None and best.memory.cpu_bytes_per_node > acc.node_cpu_memory_bytes:
        out.append(f"{best.name} needs more host memory than a typical {acc.label} node has.")
    if best is not None and best.memory.headroom < a.min_headroom:
        out.append(
            f"{best.name} fits with only {100 * best.memory.headroom:.0f}% headroom; fragmentation or an evaluation "
            "pass may push it over."
        )
    return out


