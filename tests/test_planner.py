"""The planner's decisions, explanations and warnings, and the Plan value object."""

from __future__ import annotations

import json

import pytest

from jupyter_dist.errors import ParallelismError, PlanInputError
from jupyter_dist.plan import Assumptions, Hardware, ModelSpec, Plan, TrainingShape, plan
from jupyter_dist.plan.planner import LONG_SEQUENCE
from jupyter_dist.plan.units import GiB


def h100(nodes: int = 1, **kw: object) -> Hardware:
    return Hardware.from_names("h100-80gb", nodes=nodes, **kw)  # type: ignore[arg-type]


def test_small_model_gets_ddp() -> None:
    p = plan("gpt2", Hardware.from_names("a100-80gb"), TrainingShape(micro_batch=8, seq_len=1024))
    assert p.recommended == "ddp"
    assert any("PyTorch DDP needs" in r and "fits with" in r for r in p.reasons)


def test_7b_on_8_h100_shards_and_explains_why_ddp_does_not_fit() -> None:
    p = plan("llama-2-7b", h100(), TrainingShape(micro_batch=1, seq_len=2048))
    ddp = p.candidate("ddp")
    # 16 bytes per parameter of model states (ZeRO paper) = 107.8e9 bytes > 80 GB
    assert ddp.memory.model_states == 16 * 6_738_415_616
    assert not ddp.fits
    assert p.recommended not in (None, "ddp", "fsdp-no-shard")
    best = p.best
    assert best is not None and best.fits and best.memory.headroom >= 0.10
    assert any(r.startswith("PyTorch DDP needs") and "does not fit" in r for r in p.reasons)
    assert any("Recommended" in r and "tokens/s" in r and "MFU" in r for r in p.reasons)
    assert any("DDP replicates all model states" in w for w in p.warnings)


def test_recommended_is_fastest_fitting_or_simplest_within_3_percent() -> None:
    p = plan("llama-2-13b", h100(), TrainingShape(micro_batch=2, seq_len=4096, checkpointing="selective"))
    best = p.best
    assert best is not None
    pool = [c for c in p.candidates if c.fits and c.memory.headroom >= p.assumptions.min_headroom]
    fastest = max(c.time.tokens_per_s for c in pool)
    assert best.time.tokens_per_s >= 0.97 * fastest
    assert p.candidates[0] is best


def test_nothing_fits_says_so_with_options() -> None:
    p = plan("llama-3.1-405b", Hardware.from_names("l4", gpus_per_node=1))
    assert p.recommended is None and p.best is None
    assert any(r.startswith("Nothing fits") and "more GPUs" in r for r in p.reasons)
    assert "nothing fits" in p.to_text()


def test_moe_gets_expert_parallel_candidates_and_reason() -> None:
    p = plan("mixtral-8x7b", h100(nodes=2), TrainingShape(seq_len=4096, checkpointing="full"))
    assert any(c.dims.ep > 1 for c in p.candidates)
    assert any("mixture of experts" in r and "expert parallelism" in r for r in p.reasons)


def test_long_sequence_gets_context_parallel() -> None:
    p = plan("llama-3-8b", h100(), TrainingShape(seq_len=4 * LONG_SEQUENCE, checkpointing="full"))
    cps = [c for c in p.candidates if c.dims.cp > 1]
    assert cps
    base = p.candidate("fsdp2")
    cp4 = p.candidate("fsdp2+cp4")
    # every activation term is linear in the local sequence s/cp with FlashAttention, so cp=4 stores a quarter
    assert cp4.memory.activations == pytest.approx(base.memory.activations / 4, rel=1e-6)
    assert cp4.memory.model_states < base.memory.model_states * 1.001  # states sharded over dp x cp, as before
    assert any("context parallelism" in r for r in p.reasons)


def test_multi_node_compares_hybrid_sharding() -> None:
    p = plan("llama-2-7b", h100(nodes=4, interconnect="efa-400"), TrainingShape(seq_len=4096, checkpointing="full"))
    names = {c.name for c in p.candidates}
    assert {"fsdp-hybrid-shard", "fsdp2-hybrid"} <= names
    full, hyb = p.candidate("fsdp-full-shard"), p.candidate("fsdp-hybrid-shard")
    assert hyb.time.step_time_s < full.time.step_time_s  # all-gathers stay on NVLink
    assert any("hybrid" in r for r in p.reasons)


def test_hybrid_only_offered_on_multiple_nodes() -> None:
    names = {c.name for c in plan("gpt2", h100()).candidates}
    assert "fsdp-hybrid-shard" not in names and "fsdp2-hybrid" not in names


def test_fixed_degrees_apply_to_every_candidate() -> None:
    p = plan("llama-2-70b", h100(nodes=2), TrainingShape(grad_accum=16), tp=8, pp=2)
    assert p.candidates and all((c.dims.tp, c.dims.pp, c.dims.dp) == (8, 2, 1) for c in p.candidates)
    assert all(c.dims.sp for c in p.candidates)  # sequence parallel defaults on with TP


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 3}, r"tp \(3\) x pp \(1\) x cp \(1\) = 3 does not divide world size 8"),
        ({"tp": 16}, "does not divide world size 8"),
        ({"pp": 4, "tp": 4}, "does not divide world size 8"),
        ({"ep": 2}, "mixture-of-experts"),
        ({"tp": 0}, "tp must be a positive integer"),
    ],
)
def test_bad_degrees_raise(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ParallelismError, match=message):
        plan("llama-2-7b", h100(), **kwargs)  # type: ignore[arg-type]


def test_tp_must_divide_heads() -> None:
    spec = ModelSpec(name="odd", layers=4, hidden=768, heads=12, vocab=1000)
    with pytest.raises(ParallelismError, match=r"tp \(8\) must divide the attention heads \(12"):
        plan(spec, h100(), tp=8)


def test_global_batch_sets_accumulation_per_candidate() -> None:
    p = plan("llama-2-7b", h100(), TrainingShape(micro_batch=4, global_batch=512))
    for c in p.candidates:
        assert c.grad_accum * 4 * c.dims.dp == 512
    best = p.best
    assert best is not None
    assert any(f"accumulation {best.grad_accum} x data-parallel {best.dims.dp} = 512 sequences" in r for r in p.reasons)


def test_global_batch_that_does_not_split_raises() -> None:
    with pytest.raises(PlanInputError, match="not a multiple of micro-batch 3 x data-parallel size 8 = 24"):
        plan("gpt2", h100(), TrainingShape(micro_batch=3, global_batch=100))


@pytest.mark.parametrize(
    ("model", "hardware", "training", "kwargs", "needle"),
    [
        ("gpt2", "a100-80gb", {"precision": "fp32"}, {}, "fp32 training"),
        ("gpt2", "a100-80gb", {"precision": "fp16-mixed"}, {}, "prefer --precision bf16-mixed"),
        ("gpt2", "v100-32gb", {"precision": "bf16-mixed"}, {}, "no bf16 tensor cores"),
        ("llama-2-7b", "h100-80gb", {"seq_len": 16384}, {}, "No activation checkpointing with seq-len 16384"),
        ("llama-2-7b", "h100-80gb", {}, {"strategy": "zero3-offload"}, "although ZeRO-2 fits"),
        ("llama-2-7b", "h100-80gb", {}, {"strategy": "fsdp-no-shard"}, "NO_SHARD replicates"),
        ("gpt2", "h100-80gb", {"seq_len": 128}, {}, "Only 128 tokens per GPU"),
    ],
)
def test_anti_pattern_warnings(
    model: str, hardware: str, training: dict[str, object], kwargs: dict[str, str], needle: str
) -> None:
    p = plan(model, Hardware.from_names(hardware), TrainingShape(**training), **kwargs)  # type: ignore[arg-type]
    assert any(needle in w for w in p.warnings), p.warnings


def test_warning_multi_node_without_fast_network() -> None:
    p = plan("llama-2-7b", h100(nodes=2, interconnect="ethernet-25"))
    assert any("no RDMA" in w for w in p.warnings)


def test_no_spurious_warnings_for_a_sane_setup() -> None:
    p = plan("llama-2-7b", h100(), TrainingShape(micro_batch=2, seq_len=4096, checkpointing="selective",
                                                 grad_accum=8))  # fmt: skip
    assert not [w for w in p.warnings if "DDP" not in w], p.warnings


def test_pipeline_bubble_warning() -> None:
    # 4 nodes: on 2 (dp 1) the optimizer step's fp32 gradient partition (4 B/param, DeepSpeed's "4_grads_32bit";
    # AdamW's foreach sqrt for FSDP2) on 4.4B local parameters no longer fits next to 16 B/param of model states
    p = plan("llama-2-70b", h100(nodes=4), TrainingShape(grad_accum=2), tp=8, pp=2)
    assert any("Pipeline bubble" in w for w in p.warnings)


def test_requested_strategy_that_does_not_fit_points_to_one_that_does() -> None:
    p = plan("llama-2-13b", h100(), strategy="ddp")
    assert [c.strategy for c in p.candidates] == ["ddp"] and p.recommended is None
    assert any("ddp does not fit, but" in r for r in p.reasons)


def test_plan_round_trips_through_json() -> None:
    p = plan("mixtral-8x7b", h100(nodes=2), TrainingShape(micro_batch=2, seq_len=4096, global_batch=256))
    again = Plan.from_dict(json.loads(json.dumps(p.to_dict())))
    assert again == p
    assert again.to_dict() == p.to_dict()


def test_plan_from_newer_schema_is_refused() -> None:
    data = plan("gpt2").to_dict()
    data["schema"] = 99
    with pytest.raises(PlanInputError, match="newer than this jupyter-dist"):
        Plan.from_dict(data)


def test_plan_displays_itself() -> None:
    p = plan("llama-2-7b", h100())
    bundle = p._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html"}
    assert "GiB" in bundle["text/plain"] and "<table>" in bundle["text/html"]
    assert p.recommended is not None and p.recommended in bundle["text/html"]
    assert repr(p).startswith("Plan(model='llama-2-7b'")


def test_min_headroom_assumption_changes_the_pool() -> None:
    shape = TrainingShape(micro_batch=4, seq_len=4096, checkpointing="selective")
    loose = plan("llama-2-7b", h100(), shape, assumptions=Assumptions(min_headroom=0.0))
    strict = plan("llama-2-7b", h100(), shape, assumptions=Assumptions(min_headroom=0.5))
    assert loose.best is not None and strict.best is not None
    assert strict.best.memory.total <= 0.5 * 80 * GiB < loose.best.memory.total or loose.best == strict.best


@pytest.mark.parametrize("field", ["compute_efficiency", "overlap", "min_headroom", "fragmentation"])
def test_assumptions_are_validated(field: str) -> None:
    with pytest.raises(PlanInputError, match=f"assumption {field} must be in"):
        Assumptions(**{field: 1.5})


def test_plan_accepts_names_counts_and_configs() -> None:
    assert plan("llama-2-7b").model.params == 6_738_415_616
    assert plan(7.5e9).model.params == 7_500_000_000
    cfg = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
    assert plan(cfg).model.params == 124_439_808
    with pytest.raises(PlanInputError, match="cannot plan for a list"):
        plan([1, 2])  # type: ignore[arg-type]


def test_hybrid_sharding_needs_two_gpus_per_shard_group() -> None:
    from jupyter_dist.errors import ParallelismError
    from jupyter_dist.plan.hardware import Hardware
    from jupyter_dist.plan.planner import plan as make_plan

    one_per_node = Hardware.from_names("h100-80gb", gpus_per_node=1, nodes=4)
    names = [c.name for c in make_plan("llama-2-7b", one_per_node).candidates if "hybrid" in c.name]
    assert "fsdp-hybrid-shard" not in names and "fsdp2-hybrid" in names  # FSDP2's (4, 1) mesh is correct
    with pytest.raises(ParallelismError, match="with 1 GPU per node a group holds one GPU"):
        make_plan("llama-2-7b", one_per_node, strategy="fsdp-hybrid-shard")
    eight = Hardware.from_names("h100-80gb", gpus_per_node=8, nodes=2)
    hybrid = [c for c in make_plan("llama-2-7b", eight).candidates if "hybrid" in c.name]
    assert hybrid and all(c.settings["shard_group_size"] == 8 for c in hybrid if c.dims.is_data_parallel_only)
    # HSDP composes with tensor parallelism: a node's 8 GPUs hold 4 shard ranks x tp2
    assert all(c.settings["shard_group_size"] == 8 // c.dims.tp for c in hybrid if c.dims.tp > 1 and c.dims.pp == 1)


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32", "fp16-mixed", "bf16-true"])
def test_cpu_plans_speak_cpu(precision: str) -> None:
    """A plan for CPU processes says processes, never GPUs, flash-attention, tensor cores or fp16 advice; the same
    plan for GPUs still speaks of GPUs."""
    from jupyter_dist.plan import Hardware, TrainingShape, get_accelerator
    from jupyter_dist.plan import plan as make_plan

    shape = TrainingShape(micro_batch=1, seq_len=256, precision=precision)
    for model, nodes in (("gpt2", 1), ("llama-2-7b", 2)):  # the second does not fit: the "nothing fits" advice too
        p = make_plan(model, Hardware(accelerator=get_accelerator("cpu"), gpus_per_node=2, nodes=nodes), shape)
        text = p.to_text() + "\n".join(p.reasons + p.warnings) + p.to_html()
        for word in ("GPU", "flash", "tensor core", "CUDA context", "use --precision fp16"):
            assert word not in text, (word, [ln for ln in text.splitlines() if word in ln])
        assert "Per-process memory" in text
        assert ("process runtime (Python, torch, gloo)" in text) == (p.best is not None)  # the peak's rows
    gpu = make_plan("gpt2", Hardware(accelerator=get_accelerator("h100-80gb"), gpus_per_node=2), shape)
    assert "Per-GPU memory" in gpu.to_text() and "flash-attention" in gpu.to_text()


def test_light_edge_bounds_give_the_embedding_and_the_output_a_layer_place() -> None:
    """Llama 3's split (Dubey et al. 2024, Sec. 3.3.2): 126 layers on 16 ranks x 8 one-layer stages, the first
    stage's first chunk the embedding alone and the last stage's last chunk the output alone."""
    from jupyter_dist.plan.pipeline import light_edge_bounds

    bounds = light_edge_bounds(126, 128)
    sizes = [end - start for start, end in bounds]
    assert sizes[0] == sizes[-1] == 0 and set(sizes[1:-1]) == {1}
    assert bounds[0][0] == 0 and bounds[-1][1] == 126
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))  # contiguous, every layer once
    sixteen = [end - start for start, end in light_edge_bounds(126, 16)]
    assert sixteen[0] == sixteen[-1] == 7 and set(sixteen[1:-1]) == {8}
    with pytest.raises(ParallelismError, match="need at most 128"):
        light_edge_bounds(126, 129)


def test_llama3_pipeline_layout_is_planned_but_not_launched() -> None:
    """pp 16 x 8 stages per rank over 126 layers is refused, unless the embedding and the output take a layer's place
    (``pp_light_edges``); a launch of that plan's pipeline is refused in one line, the workers split by cost."""
    from jupyter_dist.plan.candidates import resolve_launch

    hw = Hardware.from_names("h100-80gb", gpus_per_node=8, nodes=16)
    shape = {"micro_batch": 1, "seq_len": 8192, "grad_accum": 32, "pp_schedule": "interleaved-1f1b", "pp_virtual": 8}
    with pytest.raises(ParallelismError, match=r"cannot exceed the number of layers \(126\)$"):
        plan("llama-3.1-405b", hw, TrainingShape(**shape), tp=8, pp=16)  # type: ignore[arg-type]
    p = plan("llama-3.1-405b", hw, TrainingShape(**shape, pp_light_edges=True), tp=8, pp=16)  # type: ignore[arg-type]
    assert p.candidates and all(c.dims.pp == 16 for c in p.candidates)
    with pytest.raises(ParallelismError, match="pp-light-edges.*--pp 1"):
        resolve_launch(p.candidates[0].name, p, 128, nproc_per_node=8)
    assert resolve_launch(p.candidates[0].name, p, 128, nproc_per_node=8, degrees={"pp": 1}).dims.pp == 1
    assert Plan.from_dict(json.loads(json.dumps(p.to_dict()))).training.pp_light_edges
    with pytest.raises(PlanInputError, match="pp-light-edges must be True or False"):
        TrainingShape(pp_light_edges="yes")  # type: ignore[arg-type]


def test_light_edges_hold_the_embedding_and_the_output_in_a_layers_place() -> None:
    """Llama 3 405B on 16 ranks x 8 stages: the edge ranks hold 7 blocks and the embedding / the output, the others 8
    blocks, so the most loaded rank (what the memory model sizes) holds 8 blocks and nothing else."""
    from jupyter_dist.plan import PRESETS, ParallelDims
    from jupyter_dist.plan.memory import stage_params

    model = PRESETS["llama-3.1-405b"]
    dense, _, block = stage_params(model, ParallelDims(dp=1, pp=16), 8, light_edges=True)
    assert dense == pytest.approx(8 * block, rel=1e-12)
    assert 7 * block + model.embedding_params < dense  # the edge ranks are lighter
    with pytest.raises(ParallelismError, match="128 pipeline stages need at least 128 layers"):
        stage_params(model, ParallelDims(dp=1, pp=16), 8)


def test_the_plan_flags_take_llamas_pipeline_layout() -> None:
    """``jupyter-dist plan`` / ``%dist_plan --pp-light-edges`` plans what ``TrainingShape(pp_light_edges=True)`` plans:
    the same candidates and step times (and without the flag, the same layout is refused as too many stages)."""
    import argparse

    from jupyter_dist.cli.flags import add_plan_arguments, plan_from_args

    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    flags = ["--model", "llama-3.1-405b", "--gpus-per-node", "8", "--nodes", "16", "--micro-batch", "1",
             "--seq-len", "8192", "--grad-accum", "32", "--pp-schedule", "interleaved-1f1b", "--pp-virtual", "8",
             "--tp", "8", "--pp", "16"]  # fmt: skip
    with pytest.raises(ParallelismError, match="cannot exceed the number of layers"):
        plan_from_args(parser.parse_args(flags))
    got = plan_from_args(parser.parse_args([*flags, "--pp-light-edges"]))
    hw = Hardware.from_names("h100-80gb", gpus_per_node=8, nodes=16)
    shape = TrainingShape(micro_batch=1, seq_len=8192, grad_accum=32, pp_schedule="interleaved-1f1b", pp_virtual=8,
                          pp_light_edges=True)  # fmt: skip
    want = plan("llama-3.1-405b", hw, shape, tp=8, pp=16)
    assert got.training.pp_light_edges
    assert {c.name: c.time.step_time_s for c in got.candidates} == {c.name: c.time.step_time_s for c in want.candidates}
