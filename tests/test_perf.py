"""The step-time model against published FLOP counts and communication volumes, and its invariants.

Sources:

* [PaLM] Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways", arXiv:2204.02311, Appendix B:
  training FLOPs per token ``6N + 12 L H Q T``; MFU = model FLOPs (no recomputation) / (time x peak).
* [Narayanan] Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", arXiv:2104.04473, eq. 3: ``F = 96 B s l h^2 (1 + s/6h + V/16lh)`` per iteration with full
  activation recomputation; Sec. 2.2.1: the 1F1B pipeline bubble is ``(p - 1)/m`` of the ideal time.
* [Korthikanti] Korthikanti et al. 2022, arXiv:2205.05198, Appendix A, eq. 7: model FLOPs
  ``72 B s L h^2 (1 + s/6h + v/12hL)``; the forward attention core is ``QK^T`` ``2Bs^2h`` plus attention over values
  ``2Bs^2h`` per layer.
* [ZeRO] Rajbhandari et al. 2019, arXiv:1910.02054, Sec. 7: DP all-reduce moves ``2 Psi`` per rank (reduce-scatter
  + all-gather); P_os and P_os+g the same ``2 Psi``; P_os+g+p ``3 Psi``, "1.5x compared to the baseline DP".
* [Megatron-LM] Shoeybi et al. 2019, arXiv:1909.08053, Sec. 3 / Fig. 4: two all-reduces in the forward and two in
  the backward of each transformer layer.
* nccl-tests PERFORMANCE.md: a ring all-reduce sends ``2 (n - 1)/n`` of the buffer per rank, all-gather and
  reduce-scatter ``(n - 1)/n``; times are bytes over the bus bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from jupyter_dist.plan import (
    PRESETS,
    STRATEGIES,
    Assumptions,
    Checkpointing,
    Hardware,
    ModelSpec,
    ParallelDims,
    TrainingShape,
)
from jupyter_dist.plan.hardware import get_accelerator, get_interconnect
from jupyter_dist.plan.perf import (
    BOUND_LABELS,
    COMPUTE_PARTS,
    FLASH_RELATIVE,
    StepTime,
    estimate_time,
    matmul_efficiency,
    ring_latency,
    training_flops_per_token,
)

ASSUME = Assumptions()


def step(
    model: ModelSpec,
    strategy: str,
    *,
    hw: Hardware,
    dims: ParallelDims | None = None,
    grad_accum: int = 1,
    assumptions: Assumptions = ASSUME,
    **shape: object,
) -> StepTime:
    training = TrainingShape(**shape)  # type: ignore[arg-type]
    return estimate_time(
        model,
        training,
        hw,
        STRATEGIES[strategy],
        dims or ParallelDims(dp=hw.world_size),
        grad_accum=grad_accum,
        assumptions=assumptions,
    )


def gpt(layers: int, hidden: int, heads: int, vocab: int = 51200) -> ModelSpec:
    """A GPT-3-style dense model as the FLOP formulas assume it: MHA, 4h GeLU MLP, no biases."""
    return ModelSpec(layers=layers, hidden=hidden, heads=heads, vocab=vocab, gated_mlp=False, norm="layernorm")


# [Korthikanti] Table 3 (a, h, L) and GPT-3 sizes from Brown et al. 2020, Table 2.1 (L, h, heads)
GPT_SHAPES = [
    pytest.param(gpt(48, 6144, 64), id="22B"),
    pytest.param(gpt(96, 12288, 96), id="175B"),
    pytest.param(gpt(105, 20480, 128), id="530B"),
    pytest.param(gpt(128, 25600, 160), id="1T"),
    pytest.param(gpt(24, 2048, 16, vocab=50257), id="gpt3-xl"),
    pytest.param(gpt(32, 4096, 32, vocab=50257), id="gpt3-6.7b"),
]


# ---------------------------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", GPT_SHAPES)
@pytest.mark.parametrize("s", [512, 2048, 8192])
def test_model_flops_are_palm_and_megatron(model: ModelSpec, s: int) -> None:
    L, h, v = model.layers, model.hidden, model.vocab
    n = L * (4 * h * h + 2 * h * 4 * h) + v * h  # matmul weights: QKV + output, two MLP matrices, logits
    assert model.matmul_params == n
    flops, executed = training_flops_per_token(model, s, Checkpointing.NONE)
    assert flops == executed
    assert flops == 6 * n + 12 * L * model.heads * model.d_head * s  # [PaLM] App. B, H Q = h here
    # [Korthikanti] eq. 7 = [Narayanan] eq. 3 with 72 for 96 (no recomputation), per token (divide by B s):
    # 72 L h^2 (1 + s/6h + V/12hL) = 72 L h^2 + 12 L h s + 6 V h = 6 (12 L h^2 + V h) + 12 L h s -- the same.
    assert flops == pytest.approx(72 * L * h**2 * (1 + s / (6 * h) + v / (12 * h * L)), rel=1e-12)


@pytest.mark.parametrize("model", GPT_SHAPES)
@pytest.mark.parametrize("s", [512, 2048, 8192])
def test_full_recomputation_flops_are_narayanan_eq_3(model: ModelSpec, s: int) -> None:
    L, h, v = model.layers, model.hidden, model.vocab
    flops, executed = training_flops_per_token(model, s, Checkpointing.FULL)
    # 96 L h^2 (1 + s/6h + V/16hL): one more forward of the blocks (24 L h^2 + 4 L h s); the 6 V h of the logits
    # layer is unchanged, since the output layer is not checkpointed and so not recomputed.
    assert executed == pytest.approx(96 * L * h**2 * (1 + s / (6 * h) + v / (16 * h * L)), rel=1e-12)
    assert executed - flops == pytest.approx(24 * L * h**2 + 4 * L * h * s, rel=1e-12)


@pytest.mark.parametrize("model", GPT_SHAPES)
@pytest.mark.parametrize("s", [512, 2048, 8192])
def test_selective_recomputation_adds_the_attention_core_forward(model: ModelSpec, s: int) -> None:
    """Recomputing QK^T and attention over values once: [Korthikanti] App. A's 2Bs^2h + 2Bs^2h per layer.

    The paper's eq. 8 (hardware FLOPs ``72 B s L h^2 (1 + s/3h + v/12hL)``, used for Table 5's HFU) adds
    ``12 B s^2 h L``, three times this one extra forward; we count the forward that is actually re-run.
    """
    flops, executed = training_flops_per_token(model, s, Checkpointing.SELECTIVE)
    assert executed - flops == pytest.approx(4 * model.layers * model.hidden * s, rel=1e-12)
    assert executed / flops < 1 + s / (6 * model.hidden)


@pytest.mark.parametrize("preset", ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"])
def test_flops_with_biases_differ_from_megatron_by_the_bias_terms_only(preset: str) -> None:
    """GPT-2 has biases, a learned position embedding and LayerNorms, which the closed forms leave out.

    Our N (``matmul_params``) counts every weight and bias of the blocks' linear layers plus the (tied) logits
    matrix once: per token it is ``6 L (3h + h + 4h + h) = 54 L h`` above [Narayanan]'s count. Position embeddings
    and LayerNorm parameters are in ``params`` but do no matrix multiplies; PaLM's 6N with N = ``params`` would
    overcount by 6 x (1024 h + (2L + 1) 2h).
    """
    model = PRESETS[preset]
    L, h, v, s = model.layers, model.hidden, model.vocab, 1024
    flops, _ = training_flops_per_token(model, s, Checkpointing.NONE)
    megatron = 72 * L * h**2 * (1 + s / (6 * h) + v / (12 * h * L))
    assert flops - megatron == pytest.approx(6 * L * 9 * h, rel=1e-9)
    assert model.params - model.matmul_params == 1024 * h + (2 * L + 1) * 2 * h


def test_moe_flops_count_active_experts_only() -> None:
    model = PRESETS["mixtral-8x7b"]
    flops, _ = training_flops_per_token(model, 4096, Checkpointing.NONE)
    dense = model.with_(experts=1, top_k=1)
    per_expert = model.expert_params
    # top-2 of 8: one more expert MLP per layer than the dense twin, plus the router
    extra = model.layers * (per_expert + model.router_params)
    assert flops - training_flops_per_token(dense, 4096, Checkpointing.NONE)[0] == 6 * extra
    assert model.active_params < model.params


# ---------------------------------------------------------------------------------------------------------------
# Communication
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("interconnect", ["infiniband-ndr", "efa-400", "ethernet-100"])
@pytest.mark.parametrize("nodes", [2, 4])
@pytest.mark.parametrize(("precision", "grad_bytes"), [("bf16-mixed", 4), ("fp32", 4), ("bf16-true", 2)])
def test_ddp_multi_node_allreduce(interconnect: str, nodes: int, precision: str, grad_bytes: int) -> None:
    model = PRESETS["llama-2-7b"]
    hw = Hardware.from_names("h100-80gb", nodes=nodes, interconnect=interconnect)
    n = hw.world_size
    ic, acc = hw.interconnect, hw.accelerator
    # a ring over all GPUs: each of a node's 8 GPUs drives one rail, so the ring runs at the node's NIC bandwidth
    # per GPU, or at NVLink speed if that is slower
    busbw = min(ic.node_bw * ic.efficiency, acc.intra_node_bw * hw.intra_node_efficiency)
    volume = 2 * (n - 1) / n * grad_bytes * model.params  # PyTorch DDP all-reduces gradients in the param dtype
    exposed = step(model, "ddp", hw=hw, assumptions=Assumptions(overlap=0.0), precision=precision)
    assert exposed.comm_bytes["data_parallel"] == pytest.approx(volume, rel=1e-12)
    buckets = math.ceil(grad_bytes * model.params / (25 * 2**20))  # DDP's 25 MB buckets, each one collective
    assert exposed.breakdown["dp_comm"] == pytest.approx(volume / busbw + buckets * acc.collective_latency_s, rel=1e-12)
    hidden = step(model, "ddp", hw=hw, precision=precision)  # overlapped with the backward pass
    assert 0 <= hidden.breakdown.get("dp_comm", 0.0) <= exposed.breakdown["dp_comm"]
    assert hidden.step_time_s <= exposed.step_time_s


@pytest.mark.parametrize("gpus", [8, 16, 64])
def test_zero_communication_volumes(gpus: int) -> None:
    """[ZeRO] Sec. 7.2: 2 Psi per rank for DP, P_os and P_os+g; 3 Psi (1.5x) for P_os+g+p, at grad_accum = 1."""
    model = PRESETS["llama-2-13b"]
    hw = Hardware.from_names("h100-80gb", nodes=gpus // 8)
    names = ("ddp", "zero1", "zero2", "zero3", "fsdp-full-shard", "fsdp2", "fsdp-shard-grad-op")
    vol = {name: step(model, name, hw=hw).comm_bytes["data_parallel"] for name in names}
    psi, ring = model.params, (gpus - 1) / gpus
    # elements per rank: DDP all-reduces fp32 gradients (4 bytes), DeepSpeed moves 16-bit gradients and parameters
    assert vol["ddp"] / 4 == pytest.approx(2 * ring * psi, rel=1e-12)
    assert vol["zero1"] / 2 == pytest.approx(2 * ring * psi, rel=1e-12)  # reduce-scatter + all-gather
    assert vol["zero2"] / 2 == pytest.approx(2 * ring * psi, rel=1e-12)
    assert vol["zero3"] / 2 == pytest.approx(3 * ring * psi, rel=1e-12)
    assert (vol["zero3"] / 2) / (vol["ddp"] / 4) == pytest.approx(1.5, rel=1e-12)
    # FSDP/FSDP2: fp32 reduce-scatter, two bf16 all-gathers; SHARD_GRAD_OP one all-gather
    for name in ("fsdp-full-shard", "fsdp2"):
        assert vol[name] == pytest.approx(ring * psi * (4 + 2 * 2), rel=1e-12)
    assert vol["fsdp-shard-grad-op"] == pytest.approx(ring * psi * (4 + 2), rel=1e-12)


@pytest.mark.parametrize(("nodes", "gpus_per_node", "n", "per_node", "intra", "inter"),
                         [(1, 8, 8, 8, 7, 0), (16, 8, 128, 8, 112, 15), (124, 8, 124, 1, 0, 123)])  # fmt: skip
def test_ring_latency_is_nccls_ring_model(
    nodes: int, gpus_per_node: int, n: int, per_node: int, intra: int, inter: int
) -> None:
    """NCCL's ring all-gather / reduce-scatter (src/graph/tuning.cc): n - 1 steps, nodes - 1 of them on the network,
    3.4 us per NVLink step and 9.6 us per network step (Simple protocol), on top of the small-message floor."""
    hw = Hardware.from_names("h100-80gb", gpus_per_node=gpus_per_node, nodes=nodes)
    floor = hw.accelerator.latency_s
    assert ring_latency(hw, n, ranks_per_node=per_node) == pytest.approx(floor + intra * 3.4e-6 + inter * 9.6e-6)
    assert ring_latency(hw, 1, ranks_per_node=1) == 0.0
    cpu = Hardware.from_names("cpu", gpus_per_node=2)
    assert ring_latency(cpu, 2, ranks_per_node=2) == cpu.accelerator.latency_s  # gloo: the measured floor alone


def test_fsdp_hides_all_but_the_first_gather_and_the_last_reduce_scatter_behind_long_compute() -> None:
    """Per micro-batch, FSDP's forward gathers hide behind the forward and the backward's gathers and
    reduce-scatters behind the backward, except the first unit's gather and the last unit's reduce-scatter."""
    model, dp = PRESETS["llama-3-8b"], 128
    hw = Hardware.from_names("h100-80gb", nodes=dp // 8, interconnect="infiniband-ndr")
    t = step(model, "fsdp2", hw=hw, dims=ParallelDims(dp=dp), micro_batch=4, seq_len=8192, grad_accum=2)
    units, ring, bw = model.layers + 1, (dp - 1) / dp, hw.collective_bw(dp, ranks_per_node=8)
    gather, scatter = ring * model.params * 2 / bw / units, ring * model.params * 4 / bw / units  # bf16 / fp32
    alpha = ring_latency(hw, dp, ranks_per_node=8)
    assert t.breakdown["dp_comm"] == pytest.approx(2 * (gather + alpha + scatter + alpha), rel=1e-9)


def test_fsdp_throughput_per_gpu_falls_as_the_ring_grows_when_the_collectives_latency_dominates() -> None:
    """A small micro-batch (1 x 2048 tokens of an 8B model): three collectives per block and micro-batch, each
    costing a ring latency that grows with the data-parallel size, outgrow the compute they hide behind."""
    model = PRESETS["llama-3-8b"]
    per_gpu = []
    for dp in (64, 256, 1024):
        hw = Hardware.from_names("h100-80gb", nodes=dp // 8, interconnect="infiniband-ndr")
        t = step(model, "fsdp2", hw=hw, dims=ParallelDims(dp=dp), micro_batch=1, seq_len=2048)
        per_gpu.append(t.tokens_per_s / dp)
    assert per_gpu[0] > per_gpu[1] > per_gpu[2]
    assert per_gpu[2] < 0.8 * per_gpu[0]


def test_zero3_is_1_5x_ddp_in_bytes_when_both_move_16_bit_gradients() -> None:
    model = PRESETS["llama-2-7b"]
    hw = Hardware.from_names("h100-80gb", nodes=2)
    ddp = step(model, "ddp", hw=hw, precision="bf16-true").comm_bytes["data_parallel"]
    zero3 = step(model, "zero3", hw=hw, precision="bf16-true").comm_bytes["data_parallel"]
    assert zero3 / ddp == pytest.approx(1.5, rel=1e-12)


@pytest.mark.parametrize("m", [1, 2, 8])
def test_accumulation_repeats_only_per_micro_batch_collectives(m: int) -> None:
    model = PRESETS["llama-2-7b"]
    hw = Hardware.from_names("h100-80gb", nodes=2)
    one = {n: step(model, n, hw=hw).comm_bytes["data_parallel"] for n in ("ddp", "zero1", "zero2", "zero3")}
    many = {n: step(model, n, hw=hw, grad_accum=m).comm_bytes["data_parallel"] for n in one}
    assert many["ddp"] == pytest.approx(one["ddp"])  # no_sync until the last micro-batch
    assert many["zero1"] == pytest.approx(one["zero1"])  # reduce once at the boundary
    assert many["zero2"] == pytest.approx(one["zero2"] / 2 * (m + 1))  # RS per micro-batch, AG once
    assert many["zero3"] == pytest.approx(one["zero3"] * m)  # everything per micro-batch


@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 4, 16, 64])
def test_pipeline_bubble_is_p_minus_1_over_m(pp: int, m: int) -> None:
    model = PRESETS["llama-2-13b"]
    hw = Hardware.from_names("h100-80gb")
    t = step(model, "fsdp2", hw=hw, dims=ParallelDims(dp=8 // pp, pp=pp), grad_accum=m)
    work = sum(t.breakdown.get(k, 0.0) for k in ("matmul", "attention", "elementwise", "recompute"))
    assert t.breakdown["pp_bubble"] / work == pytest.approx((pp - 1) / m, rel=1e-12)
    assert "pp_bubble" not in step(model, "fsdp2", hw=hw, grad_accum=m).breakdown


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("checkpointing", list(Checkpointing))
def test_tensor_parallel_volume(tp: int, pp: int, checkpointing: Checkpointing) -> None:
    """[Megatron-LM]: 4 all-reduces of s b h per layer (6 with full recomputation), on the layers of one stage."""
    model = PRESETS["llama-2-70b"]  # 80 layers
    hw = Hardware.from_names("h100-80gb", nodes=4)
    s, b, m = 4096, 2, 8
    dims = ParallelDims(dp=hw.world_size // (tp * pp), tp=tp, pp=pp, sp=True)
    t = step(model, "fsdp2", hw=hw, dims=dims, grad_accum=m, seq_len=s, micro_batch=b, checkpointing=checkpointing)
    n_ar = 6 if checkpointing is Checkpointing.FULL else 4
    per_layer = n_ar * 2 * (tp - 1) / tp * s * b * model.hidden * 2
    assert t.comm_bytes["tensor_parallel"] == pytest.approx(math.ceil(model.layers / pp) * per_layer * m, rel=1e-12)
    full = step(model, "fsdp2", hw=hw, dims=ParallelDims(dp=hw.world_size // tp, tp=tp, sp=True), grad_accum=m,
                seq_len=s, micro_batch=b, checkpointing=checkpointing)  # fmt: skip
    assert t.comm_bytes["tensor_parallel"] / full.comm_bytes["tensor_parallel"] == pytest.approx(1 / pp)


# ---------------------------------------------------------------------------------------------------------------
# Utilisation and invariants
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("checkpointing", list(Checkpointing))
@pytest.mark.parametrize("efficiency", [0.3, 0.5, 1.0])
def test_single_gpu_matmul_part_is_6n_flops_at_the_achievable_rate(
    checkpointing: Checkpointing, efficiency: float
) -> None:
    """One GPU, no communication: the matmul part is ``6 N`` FLOPs per token at ``peak x matmul_efficiency(e, h)``;
    MFU counts model FLOPs over the whole step ([PaLM] App. B), so it stays under the matmul rate."""
    model = PRESETS["gpt2"]
    acc = replace(get_accelerator("h100-80gb"), matmul_efficiency=efficiency)
    hw = Hardware(accelerator=acc, gpus_per_node=1)
    t = step(model, "ddp", hw=hw, micro_batch=4, seq_len=1024, checkpointing=checkpointing)
    rate = 989e12 * matmul_efficiency(efficiency, model.hidden)
    assert t.breakdown["matmul"] == pytest.approx(6 * model.matmul_params * 4 * 1024 / rate, rel=1e-12)
    assert set(t.breakdown) <= set(COMPUTE_PARTS)  # one GPU: no communication part
    assert ("recompute" in t.breakdown) is (checkpointing is not Checkpointing.NONE)
    flops, _ = training_flops_per_token(model, 1024, checkpointing)
    assert t.mfu == pytest.approx(flops * 4 * 1024 / (t.step_time_s * 989e12), rel=1e-12)
    assert t.mfu < rate / 989e12
    assert t.model_flops == flops * 4 * 1024
    assert t.tokens_per_s == pytest.approx(4 * 1024 / t.step_time_s)


@pytest.mark.parametrize("width", [768, 2048, 4096, 8192, 25600])
def test_narrow_gemms_run_slower(width: int) -> None:
    """The matmul rate grows with the model width towards the large-GEMM rate ([Narayanan] Table 1's 137 vs 163
    TFLOP/s from h=2304 to h=25600) and is the published figure at h=8192."""
    assert matmul_efficiency(0.6, width) < matmul_efficiency(0.6, 2 * width) <= 0.6 * (1 + 512 / 8192)
    assert matmul_efficiency(0.6, 8192) == pytest.approx(0.6)


DIMS = [
    ParallelDims(dp=16),
    ParallelDims(dp=8, tp=2, sp=True),
    ParallelDims(dp=4, tp=2, pp=2),
    ParallelDims(dp=2, tp=8),
    ParallelDims(dp=8, pp=2),
    ParallelDims(dp=4, cp=4),
]


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("efficiency", [0.35, 0.5, 0.9])
def test_mfu_never_exceeds_the_matmul_rate(preset: str, efficiency: float) -> None:
    model = PRESETS[preset]
    acc = replace(get_accelerator("a100-80gb"), matmul_efficiency=efficiency)
    hw = Hardware(accelerator=acc, nodes=2, interconnect=get_interconnect("infiniband-hdr"))
    assume = ASSUME
    for name, strategy in STRATEGIES.items():
        for dims in DIMS if strategy.model_parallel else DIMS[:1]:
            if model.heads % dims.tp or (model.n_kv_heads % dims.tp and dims.tp % model.n_kv_heads):
                continue
            for ck in Checkpointing:
                t = step(model, name, hw=hw, dims=dims, grad_accum=4, assumptions=assume, checkpointing=ck)
                # PaLM's MFU counts the full (non-causal) attention FLOPs; flash runs the causal half at
                # FLASH_RELATIVE of the matmul rate, so counted FLOPs can go up to 2 x 0.75 times faster there
                bound = matmul_efficiency(efficiency, model.hidden) * max(1.0, 2 * FLASH_RELATIVE)
                assert 0 < t.mfu <= bound * (1 + 1e-12), (name, dims, ck)
                assert t.step_time_s >= t.compute_s >= t.breakdown["matmul"] > 0
                assert t.step_time_s == pytest.approx(sum(t.breakdown.values()))
                assert t.bound_by in BOUND_LABELS and t.breakdown[t.bound_by] == max(t.breakdown.values())
                assert all(v >= 0 for v in t.breakdown.values()) and all(v > 0 for v in t.comm_bytes.values())
                assert StepTime.from_dict(t.to_dict()) == t


@pytest.mark.parametrize("name", [n for n, s in STRATEGIES.items() if s.offload_optimizer])
def test_offload_costs_host_link_time(name: str) -> None:
    model = PRESETS["llama-2-13b"]
    hw = Hardware.from_names("h100-80gb")
    t = step(model, name, hw=hw)
    local = model.params / 8
    assert t.comm_bytes["host_link"] >= 4 * local  # 16-bit gradients down and parameters up
    assert t.breakdown["offload"] >= local / ASSUME.cpu_optimizer_params_per_s


def test_the_breakdown_is_reported_in_words_in_the_plan_and_the_wizard() -> None:
    """'bound by' is the largest named part; the plan's reasons and the wizard's summary list the parts."""
    from jupyter_dist.plan import plan
    from jupyter_dist.ui.wizard_model import summary_html

    shape = TrainingShape(seq_len=4096, checkpointing="full")
    # 13B: with the optimizer step's temporaries and the allocator reserve counted, 70B no longer fits 16 GPUs
    p = plan("llama-2-13b", Hardware.from_names("h100-80gb", nodes=2), shape, tp=8)
    t = p.best.time
    labels = [label for label, _, _ in t.parts()]
    assert labels[0] == t.bound_label == BOUND_LABELS[t.bound_by]
    assert sum(share for _, _, share in t.parts()) == pytest.approx(1.0)
    assert "tensor-parallel communication" in labels and "matrix multiplies" in labels
    assert any(f"the step is {t.describe()}" in r for r in p.reasons)
    assert f"Step time: {t.describe(6)}" in summary_html(p)
