"""Run under ``torchrun --nproc-per-node 2``: per-rank parameter, gradient and optimizer bytes from the live objects.

Used by tests/test_memory_measured.py::test_strategy_state_bytes_equal_measured. Each ``strategy:precision``
argument (``ddp``, ``fsdp2``, ``zero1``..``zero3`` x ``fp32``, ``bf16``) trains the reference Transformer for two
steps; after the second backward it records what the rank holds: parameters (a DTensor's local shard, ZeRO-3's
``ds_tensor``), gradients (``.grad``; DeepSpeed's partitioned gradient buffers), optimizer states (the inner torch
optimizer's state tensors) and DeepSpeed's fp32 master partition, plus the bytes the optimizer step allocates on
top and, for DeepSpeed, the peak the second backward allocates (PyTorch's MemTracker). Rank 0 prints one
``RESULT <json>`` line.
"""

from __future__ import annotations

# first, as %%dist_train's preamble does: a rank imports torch outside the collector (a faster start)
import jupyter_dist.worker  # noqa: F401

# isort: split
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

from jupyter_dist.models import Transformer

VOCAB = 256


def nbytes(t: Any) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def inner(o: Any) -> Any:
    while not isinstance(o, torch.optim.Optimizer) and hasattr(o, "optimizer"):
        o = o.optimizer
    return o


def state_bytes(opt: Any) -> int:
    o = inner(opt)
    return sum(nbytes(v) for st in o.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)


def step_allocations(fn: Any, *external: Any) -> int:
    tracker = MemTracker()
    tracker.track_external(*external)
    with tracker:
        start = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        fn()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return int(peak - start)


def loss_of(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def run(strategy: str, precision: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Transformer(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4)
    out: dict[str, Any] = {"strategy": strategy, "precision": precision}
    bf16 = precision == "bf16"
    tokens = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(1))
    if strategy in ("ddp", "fsdp2"):
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            wrapped: Any = DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
            for block in model.layers.values():
                fully_shard(block, mp_policy=mp or MixedPrecisionPolicy())
            wrapped = fully_shard(model, mp_policy=mp or MixedPrecisionPolicy())
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3, fused=True)  # fused: no step temporaries
        for step in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16 and strategy == "ddp"):
                loss = loss_of(wrapped, tokens)
            loss.backward()
            if step == 1:
                out["grads"] = sum(nbytes(p.grad) for p in wrapped.parameters() if p.grad is not None)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out["params"] = sum(nbytes(p) for p in wrapped.parameters())
        out["optimizer"] = state_bytes(opt)
        return out
    import deepspeed

    stage = int(strategy[-1])
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
        "bf16": {"enabled": bf16},
        # overlap_comm and contiguous_gradients as jupyter-dist's DeepSpeed config sets them (render/deepspeed.py)
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 4096, "allgather_bucket_size": 4096,
                              "overlap_comm": True, "contiguous_gradients": True,
                              "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 4096},
    }  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    zero = engine.optimizer
    for step in range(2):
        loss = loss_of(engine, tokens)
        if step == 1:  # what backward allocates at its peak (activation gradients, gradients, reduce buckets)
            out["backward_peak"] = step_allocations(lambda loss=loss: engine.backward(loss), engine.module, inner(zero))
        else:
            engine.backward(loss)
        if step == 1:
            if stage == 3:
                grads = getattr(zero, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", {})
                out["grads"] = sum(nbytes(t) for t in grads.values())
                out["params"] = sum(nbytes(p.ds_tensor) for p in engine.module.parameters())
                masters = zero.fp32_partitioned_groups_flat
            else:
                groups = zero.averaged_gradients
                groups = groups.values() if isinstance(groups, dict) else groups
                out["grads"] = sum(nbytes(t) for g in groups if g for t in g)
                out["params"] = sum(nbytes(p) for p in engine.module.parameters())
                masters = zero.single_partition_of_fp32_groups
            out["master"] = sum(nbytes(t) for t in masters)
            held = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
            out["master_is_a_copy"] = all(t.untyped_storage().data_ptr() not in held for t in masters)
            out["step_allocations"] = step_allocations(engine.step, engine.module, inner(zero))
        else:
            engine.step()
    out["optimizer"] = state_bytes(zero) + out["master"]
    return out


def main() -> None:
    dist.init_process_group("gloo")
    results = [run(*item.split(":")) for item in sys.argv[1].split(",")]
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
