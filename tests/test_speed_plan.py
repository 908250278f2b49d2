"""The planner's compile / fused-optimizer / fp8 step-time terms, the fp8 MFU peak and FSDP2's float8 all-gather
(issue 31).

The measured figures are the issue's table (issue 31, "Why"): measured by this project on one H100 80GB SXM (torch
2.11, one process), a 1.4B GPT-2-style model (LayerNorm, GELU MLP, learned positions, fused qkv), micro-batch 4,
sequence 2048, bf16 autocast, AdamW. Its dimensions are not in the table; 24 layers x 2048 wide (16 heads, GPT-2's
50,257-token vocabulary) is what its figures back out to: 1.414B parameters, and its MFU column (0.39 at 42,619
tokens/s) is 9.07 GFLOP per token, the 6 N + 12 L h s of this shape.
"""

from __future__ import annotations

import pytest

from jupyter_dist.errors import PlanInputError
from jupyter_dist.plan import STRATEGIES, Assumptions, Hardware, ModelSpec, ParallelDims, TrainingShape
from jupyter_dist.plan.perf import OPTIMIZER_BYTES, estimate_time, fp8_params, mfu_peak, training_flops_per_token

GPT2_1B4 = ModelSpec(layers=24, hidden=2048, heads=16, vocab=50257, gated_mlp=False, norm="layernorm")
H100 = Hardware.from_names("h100-80gb", gpus_per_node=1)
MEASURED = {"eager": 42_619, "fused": 48_831, "compiled": 52_536, "fp8": 57_190}  # tokens/s, the table
SETUPS = {
    "eager": {"compile": False, "fused_optimizer": False},
    "fused": {"compile": False, "fused_optimizer": True},
    "compiled": {"compile": True, "fused_optimizer": True},
    "fp8": {"compile": True, "fused_optimizer": True, "precision": "fp8"},
}


def _time(setup: str, model: ModelSpec = GPT2_1B4, hw: Hardware = H100, strategy: str = "ddp", dp: int = 1):
    shape = TrainingShape(micro_batch=4, seq_len=2048, **SETUPS[setup])
    return estimate_time(model, shape, hw, STRATEGIES[strategy], ParallelDims(dp=dp), grad_accum=1,
                         assumptions=Assumptions())  # fmt: skip


def test_the_reference_model_has_the_tables_size_and_flops() -> None:
    assert GPT2_1B4.params == pytest.approx(1.414e9, rel=1e-3)
    model_f, _ = training_flops_per_token(GPT2_1B4, 2048, TrainingShape().checkpointing)
    assert model_f * MEASURED["eager"] / 989e12 == pytest.approx(0.39, abs=0.005)  # the table's MFU column


@pytest.mark.parametrize(("before", "after"), [("eager", "fused"), ("fused", "compiled")])
def test_fused_and_compile_speed_up_as_measured(before: str, after: str) -> None:
    """Each step's speed-up goes the measured way and is within 6 % of the measured ratio (fused: predicted 1.150
    against 1.146; compile: 1.027 against 1.076, the fused elementwise traffic being a count, not a fit)."""
    predicted = _time(after).tokens_per_s / _time(before).tokens_per_s
    measured = MEASURED[after] / MEASURED[before]
    assert predicted > 1.0
    assert predicted == pytest.approx(measured, rel=0.06), f"{before}->{after}: {predicted:.3f} vs {measured:.3f}"


@pytest.mark.xfail(strict=True, reason="the model predicts fp8 1.31x compiled bf16 on this 2048-wide model, measured "
                   "1.09x: torchao's float8 linears at this width gain less than the FP8 peak's roofline gives "
                   "(the transposed casts for the weight gradient and the scale computations are not counted)")
def test_fp8_speeds_up_as_measured() -> None:
    predicted = _time("fp8").tokens_per_s / _time("compiled").tokens_per_s
    assert predicted == pytest.approx(MEASURED["fp8"] / MEASURED["compiled"], rel=0.1)


@pytest.mark.parametrize("setup", list(MEASURED))
def test_the_reference_models_tokens_per_s_within_15_percent(setup: str) -> None:
    """Each row of the issue's table, absolute, within the issue's 15 % (predicted / measured: eager 0.954, fused
    0.957, compiled 0.914, fp8 1.098; with the former H100 matmul efficiency 0.50: 0.837, 0.824, 0.784, 0.965)."""
    predicted = _time(setup).tokens_per_s
    assert predicted == pytest.approx(MEASURED[setup], rel=0.15), f"{setup}: {predicted:.0f} vs {MEASURED[setup]}"


def test_the_reference_models_matmuls_run_at_the_rate_its_step_leaves() -> None:
    """The measured eager step (4 x 2048 tokens in 192.2 ms) less the parts the model prices apart from the matmuls
    (attention, elementwise, optimizer: counted, not fitted) leaves the matmuls' time; the model's matmul rate at this
    width is within 15 % of the rate that time implies (550-585 TFLOP/s over the table's three bf16 rows)."""
    for setup in ("eager", "fused", "compiled"):
        t = _time(setup)
        measured_step = 4 * 2048 / MEASURED[setup]
        left = measured_step - (t.step_time_s - t.breakdown["matmul"])
        flops = 6 * GPT2_1B4.matmul_params * 4 * 2048
        assert flops / t.breakdown["matmul"] == pytest.approx(flops / left, rel=0.15), setup


def test_fp8_goes_the_measured_way() -> None:
    assert _time("fp8").tokens_per_s > _time("compiled").tokens_per_s


def test_the_optimizer_step_is_its_traffic_and_fused_moves_a_third() -> None:
    eager, fused = _time("eager"), _time("fused")
    seconds = 84 * GPT2_1B4.params / (H100.accelerator.memory_bw * 0.9)
    assert eager.breakdown["optimizer"] == pytest.approx(seconds, rel=1e-9)
    assert fused.breakdown["optimizer"] / eager.breakdown["optimizer"] == pytest.approx(28 / 84, rel=1e-9)
    assert OPTIMIZER_BYTES[("adamw", True)] < OPTIMIZER_BYTES[("adamw", False)]
    # sharded optimizer states: each rank steps its share
    hw8 = Hardware.from_names("h100-80gb", gpus_per_node=8)
    zero = estimate_time(GPT2_1B4, TrainingShape(micro_batch=4, seq_len=2048, fused_optimizer=False), hw8,
                         STRATEGIES["fsdp2"], ParallelDims(dp=8), grad_accum=1, assumptions=Assumptions())  # fmt: skip
    assert zero.breakdown["optimizer"] == pytest.approx(eager.breakdown["optimizer"] / 8, rel=0.01)


def test_compile_shrinks_only_the_blocks_elementwise_traffic() -> None:
    fused, compiled = _time("fused"), _time("compiled")
    assert compiled.breakdown["matmul"] == fused.breakdown["matmul"]
    assert compiled.breakdown["attention"] == fused.breakdown["attention"]
    assert compiled.breakdown["elementwise"] < fused.breakdown["elementwise"]


def test_the_defaults_are_the_workers_on_gpu_and_off_on_cpu() -> None:
    default = TrainingShape(micro_batch=4, seq_len=2048)
    assert default.speed_options("nvidia") == (True, True)
    assert default.speed_options("cpu") == (False, False)
    assert TrainingShape(compile=False).speed_options("nvidia") == (False, True)
    gpu_default = estimate_time(GPT2_1B4, default, H100, STRATEGIES["ddp"], ParallelDims(dp=1), grad_accum=1,
                                assumptions=Assumptions())  # fmt: skip
    assert gpu_default.step_time_s == _time("compiled").step_time_s
    assert TrainingShape.from_dict(TrainingShape(compile=False).to_dict()).compile is False


@pytest.mark.parametrize("field", ["compile", "fused_optimizer"])
def test_speed_options_are_validated(field: str) -> None:
    with pytest.raises(PlanInputError, match=f"{field.replace('_', '-')} must be True, False or None"):
        TrainingShape(**{field: "yes"})


def test_fp8_mfu_is_against_the_mixed_peak() -> None:
    """MFU of an fp8 plan: against the peak at which the model's FLOPs would run, FP8 for the blocks' linears and
    bf16 for the rest, so it lies below the bf16-peak figure and between the two peaks' definitions."""
    shape = TrainingShape(micro_batch=4, seq_len=2048, precision="fp8")
    peak = mfu_peak(GPT2_1B4, shape, H100)
    acc = H100.accelerator
    assert acc.peak_flops("bf16") < peak < acc.peak_flops("fp8")
    model_f, _ = training_flops_per_token(GPT2_1B4, 2048, shape.checkpointing)
    fast = 6 * fp8_params(GPT2_1B4)
    assert model_f / peak == pytest.approx(fast / acc.peak_flops("fp8") + (model_f - fast) / acc.peak_flops("bf16"))
    t = _time("fp8")
    assert t.mfu == pytest.approx(t.model_flops / (t.step_time_s * peak), rel=1e-12)
    assert t.mfu < t.model_flops / (t.step_time_s * acc.peak_flops("bf16"))
    assert mfu_peak(GPT2_1B4, TrainingShape(), H100) == acc.peak_flops("bf16")


def test_fsdp2_all_gathers_fp8_weights_in_one_byte() -> None:
    """FSDP2 + fp8: the blocks' FP8 linears are all-gathered at 1 byte per element (torchao's float8 all-gather),
    the rest at 2; gradients are reduced as under bf16-mixed. DDP gathers nothing, so its bytes do not change."""
    hw = Hardware.from_names("h100-80gb", gpus_per_node=8)
    bf16 = _time("compiled", hw=hw, strategy="fsdp2", dp=8).comm_bytes["data_parallel"]
    fp8 = _time("fp8", hw=hw, strategy="fsdp2", dp=8).comm_bytes["data_parallel"]
    share = fp8_params(GPT2_1B4) / GPT2_1B4.params
    gathered = 2 * (7 / 8) * GPT2_1B4.params * 2  # forward + backward ring all-gathers of the bf16 model, one rank
    assert bf16 - fp8 == pytest.approx(gathered * share / 2, rel=1e-6)
    ddp_bf16 = _time("compiled", hw=hw, dp=8).comm_bytes["data_parallel"]
    assert _time("fp8", hw=hw, dp=8).comm_bytes["data_parallel"] == ddp_bf16


def test_the_plan_says_what_it_assumed() -> None:
    from jupyter_dist.plan import plan

    gpu = plan("gpt2", Hardware.from_names("h100-80gb", gpus_per_node=1)).to_text()
    assert "blocks compiled, fused optimizer" in gpu
    cpu = plan("gpt2", Hardware.from_names("cpu", gpus_per_node=2)).to_text()
    assert "blocks eager, foreach optimizer" in cpu


def test_plan_flags_price_eager_or_compiled_and_foreach_or_fused() -> None:
    """``jupyter-dist plan`` / ``%dist_plan`` take ``--compile/--no-compile`` and ``--fused/--no-fused``: the plan is
    the Python API's for the same fields, says what it assumed, and eager + foreach is the slower step on a GPU."""
    import subprocess
    import sys

    from jupyter_dist.cli.flags import plan_from_args
    from jupyter_dist.plan import plan

    hw = Hardware.from_names("h100-80gb", gpus_per_node=1)
    fast = plan("gpt2", hw)
    slow = plan("gpt2", hw, TrainingShape(compile=False, fused_optimizer=False))
    assert slow.best.time.step_time_s > fast.best.time.step_time_s
    import argparse

    from jupyter_dist.cli.flags import add_plan_arguments

    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    args = parser.parse_args(["--model", "gpt2", "--gpus-per-node", "1", "--no-compile", "--no-fused"])
    got = plan_from_args(args)
    assert got.best.time.step_time_s == slow.best.time.step_time_s
    assert "blocks eager, foreach optimizer" in got.to_text()
    on = plan_from_args(parser.parse_args(["--model", "gpt2", "--gpus-per-node", "1", "--compile", "--fused"]))
    assert on.best.time.step_time_s == fast.best.time.step_time_s
    res = subprocess.run([sys.executable, "-m", "jupyter_dist.cli", "plan", "--model", "gpt2", "--gpus-per-node", "1",
                          "--no-compile"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0 and "blocks eager, fused optimizer" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, False), (2, True)])
def test_eager_rmsnorm_is_priced_as_its_chain_of_fp32_kernels(tp: int, sp: bool) -> None:
    """Eager, an RMSNorm model moves COMPOSITE_NORM_BYTES more per normalised element than the same model with a
    fused norm: two norms per block (whole on every TP rank without sequence parallelism) and the final one; compiled,
    nothing more (the chain fuses)."""
    from dataclasses import replace

    from jupyter_dist.plan.perf import COMPOSITE_NORM_BYTES, MEMORY_EFFICIENCY, compute_parts

    rms = ModelSpec(name="m", layers=3, hidden=1024, heads=8, vocab=32000)
    fused = replace(rms, norm="layernorm")
    dims = ParallelDims(dp=1, tp=tp, sp=sp)
    hw = Hardware.from_names("h100-80gb", gpus_per_node=2)
    tokens = 4096.0
    for compiled in (False, True):
        shape = TrainingShape(micro_batch=2, seq_len=2048, precision="bf16-mixed", compile=compiled)
        a, b = (compute_parts(m, shape, hw, dims, tokens_per_gpu=tokens)["elementwise"] for m in (rms, fused))
        normed = 3 * 2 * 1024 * (tp if not sp else 1) + 1024
        extra = (COMPOSITE_NORM_BYTES[0] + 2 * COMPOSITE_NORM_BYTES[1]) * normed * tokens / (
            hw.accelerator.memory_bw * MEMORY_EFFICIENCY)  # fmt: skip
        assert a - b == pytest.approx(0.0 if compiled else extra, abs=1e-15), compiled
    assert COMPOSITE_NORM_BYTES[0] + 2 * COMPOSITE_NORM_BYTES[1] == 84
