"""Published runs the planner could not express before issue 31: FP8 training (and compile) against torchtitan.

[torchtitan-bench] pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (formerly docs/performance.md),
Tables 1 and 3: Llama 3.1 8B, FSDP, local batch 2, seq 8192 (its Llama 3 configs), selective activation
checkpointing, on 8 and 128 H100s (Grand Teton: 96 GB HBM2e at 2.4 TB/s, 500 W; the catalog has the 80 GB SXM5 at
3.35 TB/s and 700 W, so the rows are compared as ratios between the table's own lines, which share that hardware):
TPS/GPU FSDP 5,762 / 5,605, + torch.compile 6,667 / 6,514, + compile + Float8 8,532 / 8,380.
The step time is predicted with the fused optimizer in every line (the ratio is about compile and fp8 alone).
The same tables, 128 GPUs over 8 (16 nodes over NDR-class 400 Gb/s per GPU against one NVLink node), are FSDP's
scaling on that hardware: 0.973 / 0.977 / 0.982 per GPU. Table 5: Llama 3.1 405B on 512 GPUs (FSDP 8, TP 8, PP 8),
local batch 32, full activation checkpointing, compile + Float8 + AsyncTP: 1F1B 100, interleaved 1F1B 128 TPS/GPU.
The table gives neither the micro-batches nor the stages per rank; the run's torchtitan (commit 9dec370, which the
page names) defaults to as many micro-batches as pipeline ranks (``pipeline_parallel_microbatches``: 8 of 4
sequences) and to 2 stages per rank for a multi-stage schedule (``generate_split_points``), taken here.
"""

from __future__ import annotations

import pytest

from jupyter_dist.plan import PRESETS, STRATEGIES, Assumptions, Hardware, ParallelDims, TrainingShape
from jupyter_dist.plan.perf import estimate_time

MEASURED = {8: {"eager": 5762, "compiled": 6667, "fp8": 8532}, 128: {"eager": 5605, "compiled": 6514, "fp8": 8380}}
SETUPS = {"eager": {"compile": False}, "compiled": {"compile": True}, "fp8": {"compile": True, "precision": "fp8"}}


def _tokens_per_gpu(gpus: int, setup: str) -> float:
    hw = Hardware.from_names("h100-80gb", gpus_per_node=8, nodes=gpus // 8, interconnect="infiniband-ndr")
    shape = TrainingShape(micro_batch=2, seq_len=8192, checkpointing="selective", fused_optimizer=True,
                          **SETUPS[setup])  # fmt: skip
    t = estimate_time(PRESETS["llama-3-8b"], shape, hw, STRATEGIES["fsdp2"], ParallelDims(dp=gpus), grad_accum=1,
                      assumptions=Assumptions())  # fmt: skip
    return t.tokens_per_s / gpus


@pytest.mark.parametrize("gpus", [8, 128])
def test_fp8_over_compiled_bf16_within_15_percent(gpus: int) -> None:
    """Predicted 1.41x, measured 1.28x (Table 1) / 1.29x (Table 3)."""
    predicted = _tokens_per_gpu(gpus, "fp8") / _tokens_per_gpu(gpus, "compiled")
    measured = MEASURED[gpus]["fp8"] / MEASURED[gpus]["compiled"]
    assert predicted == pytest.approx(measured, rel=0.15), f"{gpus} GPUs: {predicted:.3f} vs {measured:.3f}"


@pytest.mark.parametrize("gpus", [8, 128])
@pytest.mark.xfail(strict=True, reason="compile's gain is predicted at 11 %, measured 15.7 % / 16.2 %: the model "
                   "prices eager RMSNorm as its chain of fp32 kernels (perf.COMPOSITE_NORM_BYTES, 2 % -> 11 %); the "
                   "fp32 complex rotary of torchtitan's 2024 Llama and per-op dispatch under FSDP2 are not counted")
def test_compiled_over_eager_gain_within_15_percent(gpus: int) -> None:
    predicted = _tokens_per_gpu(gpus, "compiled") / _tokens_per_gpu(gpus, "eager") - 1
    measured = MEASURED[gpus]["compiled"] / MEASURED[gpus]["eager"] - 1
    assert predicted == pytest.approx(measured, rel=0.15)


def test_compile_and_fp8_go_the_published_way() -> None:
    for gpus in MEASURED:
        eager, compiled, fp8 = (_tokens_per_gpu(gpus, s) for s in ("eager", "compiled", "fp8"))
        assert eager < compiled < fp8


@pytest.mark.parametrize("setup", ["eager", "compiled", "fp8"])
def test_fsdp_from_8_to_128_gpus_within_15_percent(setup: str) -> None:
    """Per-GPU throughput on 128 GPUs over 8 (Table 3 / Table 1). Predicted 1.003-1.005: at local batch 2 x 8192
    tokens the 128-rank ring's latency (0.55 ms per collective, 99 per micro-batch) and the traffic hide behind a 2 s
    micro-batch, only the first gather and the last reduce-scatter show (6 ms), and the optimizer's shard shrinks
    16-fold (8 ms less); measured 0.973-0.982, a loss the model does not explain (stragglers across 16 nodes?)."""
    predicted = _tokens_per_gpu(128, setup) / _tokens_per_gpu(8, setup)
    measured = MEASURED[128][setup] / MEASURED[8][setup]
    assert predicted == pytest.approx(measured, rel=0.15), f"{setup}: {predicted:.3f} vs {measured:.3f}"


def test_interleaved_over_1f1b_within_15_percent() -> None:
    """Table 5: interleaved 1F1B over 1F1B, measured 1.28, predicted 1.25 (the bubble 7/8 of the compute halved by 2
    stages per rank); the absolute figures (146 / 181 predicted) carry the Grand Teton H100s' gap, as above."""
    hw = Hardware.from_names("h100-80gb", gpus_per_node=8, nodes=64, interconnect="infiniband-ndr")
    tps = {}
    for schedule, virtual in (("1f1b", 0), ("interleaved-1f1b", 2)):
        shape = TrainingShape(micro_batch=4, seq_len=8192, checkpointing="full", precision="fp8", compile=True,
                              pp_schedule=schedule, pp_virtual=virtual)  # fmt: skip
        t = estimate_time(PRESETS["llama-3.1-405b"], shape, hw, STRATEGIES["fsdp2"],
                          ParallelDims(dp=8, tp=8, pp=8, sp=True), grad_accum=8, assumptions=Assumptions())  # fmt: skip
        tps[schedule] = t.tokens_per_s
    predicted = tps["interleaved-1f1b"] / tps["1f1b"]
    assert predicted == pytest.approx(128 / 100, rel=0.15), f"{predicted:.3f} vs 1.28"
