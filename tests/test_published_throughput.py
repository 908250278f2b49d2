"""The step-time model against published measured throughput of real training runs (within 15 %).

Each row: the run's GPUs, TP/PP/DP, global batch, micro-batch, sequence length, activation checkpointing, and what the
paper measured, as TFLOP/s per GPU the way the paper counts them (``hfu``: executed FLOPs, recomputation included,
Narayanan et al.'s eq. 3; ``mfu``: model FLOPs, PaLM's definition) or tokens/s per GPU. The planner's prediction for
the same shape, counted the same way, must be within 15 %. Rows it misses are expected failures with the reason.

Sources:

* [Megatron-21] Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", arXiv:2104.04473, Table 1 (A100 80GB DGX nodes, 8 x 200 Gb/s HDR InfiniBand, seq 2048, vocab 51,200,
  full recomputation, mixed precision). The micro-batch is not in the table: 1 where a pipeline runs, else the whole
  per-GPU batch.
* [Korthikanti-22] Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  arXiv:2205.05198, Tables 3 and 5 (selective recomputation + sequence parallelism, micro-batch 1, MFU).
* [Llama-3] Dubey et al. 2024, "The Llama 3 Herd of Models", arXiv:2407.21783, Table 4 (405B on H100, 8,192 and
  16,384 GPUs, TP 8, PP 16, seq 8192, 16M tokens per batch; BF16 MFU 43 % / 41 %, 430 / 400 TFLOP/s per GPU), and
  Sec. 3.3.2 for the pipeline: interleaved 1F1B with the first and last stage one layer fewer (see LLAMA3_VIRTUAL).
* [torchtitan] Liang et al. 2024, "TorchTitan: One-stop PyTorch native solution for production ready LLM
  pre-training", arXiv:2410.06511, and pytorch/torchtitan docs/performance.md, Table 1 (Llama 3.1 8B, 8 H100, FSDP,
  local batch 2, seq 8192, selective checkpointing, eager: 5,762 tokens/s per GPU; the H100s there are the 96 GB
  HBM2e part at 2.4 TB/s and a 500 W power limit); and the same page's Llama 3 table on 64 A100 80GB with FSDP2,
  local batch 1 (8B, selective op checkpointing: 2,973 tokens/s per GPU, 58.2 % MFU; 70B, full checkpointing: 323,
  50.5 %). The sequence length is that of torchtitan's Llama 3 training configs (8192); the A100 cluster's network is
  not given (we take 8 x 200 Gb/s HDR; FSDP's traffic is hidden either way).
* [BLOOM] BigScience 2022, "BLOOM: A 176B-Parameter Open-Access Multilingual Language Model", arXiv:2211.05100,
  Sec. 3.4 (384 A100 80GB, TP 4, PP 12, DP 8, ZeRO-1, micro-batch 2, global batch 2048, seq 2048; 156 TFLOP/s).
* [OPT] Zhang et al. 2022, "OPT: Open Pre-trained Transformer Language Models", arXiv:2205.01068, Sec. 2.4
  (175B on 992 A100 80GB, FSDP + Megatron TP 8, ~2M tokens per batch; up to 147 TFLOP/s per GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from jupyter_dist.plan import PRESETS, STRATEGIES, Assumptions, Hardware, ModelSpec, ParallelDims, TrainingShape
from jupyter_dist.plan.perf import estimate_time, training_flops_per_token


def gpt(layers: int, hidden: int, heads: int, vocab: int = 51200) -> ModelSpec:
    """A GPT-3-style model as the papers count it: MHA, 4h GeLU MLP, LayerNorm."""
    return ModelSpec(layers=layers, hidden=hidden, heads=heads, vocab=vocab, gated_mlp=False, norm="layernorm")


@dataclass(frozen=True, kw_only=True)
class Published:
    """One measured run."""

    model: ModelSpec
    gpu: str
    interconnect: str
    gpus: int
    tp: int
    pp: int
    global_batch: int
    micro_batch: int | None  # None: the whole per-GPU batch
    seq: int
    checkpointing: str
    strategy: str
    measured: float
    unit: str  # "hfu" / "mfu" TFLOP/s per GPU, or "tokens" per s per GPU
    compile: bool | None = None  # None: the planner's default for GPUs (compiled blocks, fused optimizer)
    virtual: int = 0  # pipeline stages per rank of an interleaved 1F1B schedule (0: plain 1F1B)
    light_edges: bool = False  # Llama 3's split: the first and last stage one layer fewer


A100, H100 = "a100-80gb", "h100-80gb"
LLAMA3_VIRTUAL = 8
"""Llama 3's stages per rank, which Table 4 does not give; Sec. 3.3.2 implies it: the 126 layers are split so that
the first and last stage hold one layer fewer and then "the first model chunk on the first stage has only the
embedding, and the last model chunk on the last stage has only output projection and loss", so a chunk holds one
layer: (126 + 2) / (16 ranks x 1 layer) = 8 chunks per rank."""
HDR = "infiniband-hdr"
MISSES = {
    "megatron21-1.7B": "h=2304 on 32 GPUs without a pipeline: the per-GPU micro-batch is not published (we use all 16 "
    "sequences at once); the model predicts 16 % more than measured",
    "torchtitan-8B": "Grand Teton H100s: the 96 GB HBM2e part (2.4 TB/s) at a 500 W power limit, not the 700 W SXM5 "
    "of the catalog; and eager PyTorch (no torch.compile) moves more elementwise bytes than the model counts "
    "(torchtitan's own Table 1: +15.7 % with compile)",
}
RUNS = {
    "megatron21-1.7B": Published(model=gpt(24, 2304, 24), gpu=A100, interconnect=HDR, gpus=32, tp=1, pp=1,
                                 global_batch=512, micro_batch=None, seq=2048, checkpointing="full", strategy="ddp",
                                 measured=137, unit="hfu"),
    "megatron21-3.6B": Published(model=gpt(30, 3072, 32), gpu=A100, interconnect=HDR, gpus=64, tp=2, pp=1,
                                 global_batch=512, micro_batch=None, seq=2048, checkpointing="full", strategy="ddp",
                                 measured=138, unit="hfu"),
    "megatron21-7.5B": Published(model=gpt(36, 4096, 32), gpu=A100, interconnect=HDR, gpus=128, tp=4, pp=1,
                                 global_batch=512, micro_batch=None, seq=2048, checkpointing="full", strategy="ddp",
                                 measured=142, unit="hfu"),
    "megatron21-18.4B": Published(model=gpt(40, 6144, 48), gpu=A100, interconnect=HDR, gpus=256, tp=8, pp=1,
                                  global_batch=1024, micro_batch=None, seq=2048, checkpointing="full",
                                  strategy="ddp", measured=135, unit="hfu"),
    "megatron21-39.1B": Published(model=gpt(48, 8192, 64), gpu=A100, interconnect=HDR, gpus=512, tp=8, pp=2,
                                  global_batch=1536, micro_batch=1, seq=2048, checkpointing="full", strategy="ddp",
                                  measured=138, unit="hfu"),
    "megatron21-76.1B": Published(model=gpt(60, 10240, 80), gpu=A100, interconnect=HDR, gpus=1024, tp=8, pp=4,
                                  global_batch=1792, micro_batch=1, seq=2048, checkpointing="full", strategy="ddp",
                                  measured=140, unit="hfu"),
    "megatron21-145.6B": Published(model=gpt(80, 12288, 96), gpu=A100, interconnect=HDR, gpus=1536, tp=8, pp=8,
                                   global_batch=2304, micro_batch=1, seq=2048, checkpointing="full", strategy="ddp",
                                   measured=148, unit="hfu"),
    "megatron21-310.1B": Published(model=gpt(96, 16384, 128), gpu=A100, interconnect=HDR, gpus=1920, tp=8, pp=16,
                                   global_batch=2160, micro_batch=1, seq=2048, checkpointing="full", strategy="ddp",
                                   measured=155, unit="hfu"),
    "megatron21-529.6B": Published(model=gpt(105, 20480, 128), gpu=A100, interconnect=HDR, gpus=2520, tp=8, pp=35,
                                   global_batch=2520, micro_batch=1, seq=2048, checkpointing="full", strategy="ddp",
                                   measured=163, unit="hfu"),
    "megatron21-1T": Published(model=gpt(128, 25600, 160), gpu=A100, interconnect=HDR, gpus=3072, tp=8, pp=64,
                               global_batch=3072, micro_batch=1, seq=2048, checkpointing="full", strategy="ddp",
                               measured=163, unit="hfu"),
    "korthikanti22-22B": Published(model=gpt(48, 6144, 64), gpu=A100, interconnect=HDR, gpus=8, tp=8, pp=1,
                                   global_batch=4, micro_batch=1, seq=2048, checkpointing="selective",
                                   strategy="ddp", measured=0.415 * 312, unit="mfu"),
    "korthikanti22-175B": Published(model=gpt(96, 12288, 96), gpu=A100, interconnect=HDR, gpus=64, tp=8, pp=8,
                                    global_batch=64, micro_batch=1, seq=2048, checkpointing="selective",
                                    strategy="ddp", measured=0.514 * 312, unit="mfu"),
    "korthikanti22-530B": Published(model=gpt(105, 20480, 128), gpu=A100, interconnect=HDR, gpus=280, tp=8, pp=35,
                                    global_batch=280, micro_batch=1, seq=2048, checkpointing="selective",
                                    strategy="ddp", measured=0.560 * 312, unit="mfu"),
    "korthikanti22-1T": Published(model=gpt(128, 25600, 160), gpu=A100, interconnect=HDR, gpus=512, tp=8, pp=64,
                                  global_batch=512, micro_batch=1, seq=2048, checkpointing="selective",
                                  strategy="ddp", measured=0.563 * 312, unit="mfu"),
    "llama3-405B-8k": Published(model=PRESETS["llama-3.1-405b"], gpu=H100, interconnect="roce-400", gpus=8192, tp=8,
                                pp=16, global_batch=2048, micro_batch=1, seq=8192, checkpointing="none",
                                strategy="zero1", measured=430, unit="mfu", virtual=LLAMA3_VIRTUAL,
                                light_edges=True),
    "llama3-405B-16k": Published(model=PRESETS["llama-3.1-405b"], gpu=H100, interconnect="roce-400", gpus=16384,
                                 tp=8, pp=16, global_batch=2048, micro_batch=1, seq=8192, checkpointing="none",
                                 strategy="zero1", measured=400, unit="mfu", virtual=LLAMA3_VIRTUAL,
                                 light_edges=True),
    "torchtitan-8B": Published(model=PRESETS["llama-3-8b"], gpu=H100, interconnect="infiniband-ndr", gpus=8, tp=1,
                               pp=1, global_batch=16, micro_batch=2, seq=8192, checkpointing="selective",
                               strategy="fsdp2", measured=5762, unit="tokens", compile=False),
    "torchtitan-a100-8B": Published(model=PRESETS["llama-3-8b"], gpu=A100, interconnect=HDR, gpus=64, tp=1, pp=1,
                                    global_batch=64, micro_batch=1, seq=8192, checkpointing="selective",
                                    strategy="fsdp2", measured=2973, unit="tokens"),
    "torchtitan-a100-70B": Published(model=PRESETS["llama-3-70b"], gpu=A100, interconnect=HDR, gpus=64, tp=1, pp=1,
                                     global_batch=64, micro_batch=1, seq=8192, checkpointing="full",
                                     strategy="fsdp2", measured=323, unit="tokens"),
    "bloom-176B": Published(model=ModelSpec(layers=70, hidden=14336, heads=112, vocab=250880, gated_mlp=False,
                                            norm="layernorm"),
                            gpu=A100, interconnect="efa-400", gpus=384, tp=4, pp=12, global_batch=2048, micro_batch=2,
                            seq=2048, checkpointing="full", strategy="zero1", measured=156, unit="hfu"),
    "opt-175B": Published(model=gpt(96, 12288, 96, vocab=50272), gpu=A100, interconnect=HDR, gpus=992, tp=8, pp=1,
                          global_batch=1000, micro_batch=None, seq=2048, checkpointing="full",
                          strategy="fsdp-full-shard", measured=147, unit="hfu"),
}  # fmt: skip


def estimate(run: Published) -> Any:
    """The planner's estimate of ``run``'s step (its hardware, layout, micro-batch, schedule and options)."""
    hw = Hardware.from_names(run.gpu, gpus_per_node=min(8, run.gpus), nodes=max(1, run.gpus // 8),
                             interconnect=run.interconnect)  # fmt: skip
    dp = run.gpus // (run.tp * run.pp)
    mb = run.micro_batch or run.global_batch // dp
    pipeline = {"pp_schedule": "interleaved-1f1b", "pp_virtual": run.virtual} if run.virtual else {}
    shape = TrainingShape(micro_batch=mb, seq_len=run.seq, checkpointing=run.checkpointing, compile=run.compile,
                          pp_light_edges=run.light_edges, **pipeline)  # fmt: skip
    return estimate_time(run.model, shape, hw, STRATEGIES[run.strategy], ParallelDims(dp=dp, tp=run.tp, pp=run.pp),
                         grad_accum=run.global_batch // (dp * mb), assumptions=Assumptions())  # fmt: skip


def predicted(run: Published) -> float:
    """The planner's figure for ``run``, in the paper's unit."""
    t = estimate(run)
    per_gpu = t.tokens_per_s / run.gpus
    checkpointing = TrainingShape(checkpointing=run.checkpointing).checkpointing
    model_f, executed_f = training_flops_per_token(run.model, run.seq, checkpointing)
    return {"hfu": per_gpu * executed_f / 1e12, "mfu": per_gpu * model_f / 1e12, "tokens": per_gpu}[run.unit]


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.xfail(reason=MISSES[n], strict=True)) if n in MISSES else n for n in RUNS],
)
def test_within_15_percent_of_published_throughput(name: str) -> None:
    run = RUNS[name]
    got = predicted(run)
    assert got == pytest.approx(run.measured, rel=0.15), f"{name}: predicted {got:.1f}, measured {run.measured}"


def test_the_table_is_mostly_met() -> None:
    """At least three quarters of the runs are met; the misses are the named ones, no more."""
    missed = [n for n, r in RUNS.items() if abs(predicted(r) / r.measured - 1) > 0.15]
    assert sorted(missed) == sorted(MISSES)
    assert len(missed) <= len(RUNS) // 4
