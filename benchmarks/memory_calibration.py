"""Planned against measured memory under each activation-checkpointing mode.

On a GPU: real training steps of a ~1B reference ``jupyter_dist.models.Transformer`` (bf16 weights, AdamW, one
process: no wrapper, DDP or FSDP2 on a world of one) under ``none``, ``selective``, ``op``, ``layer:2`` and
``full``, applied as the worker applies ``JD_AC``; the peak ``torch.cuda.max_memory_allocated`` of a step against
the plan's peak without the parts the allocator counter cannot see (CUDA context, allocator reserve), and the peak
of each phase (forward + loss, backward, optimizer step) above the states held between steps. On CPU: a tiny
model, and the bytes autograd saves for backward per block (saved-tensor hooks, as tests/test_memory_measured.py
counts them) against the plan's per-layer figure.
Prints one table; each ratio is measured/planned from this one run.

    python benchmarks/memory_calibration.py [--layers 20 --dim 2048 --seq 4096 --micro-batch 1]
    python benchmarks/memory_calibration.py --hf-config benchmarks/hf_configs/llama-1.1b.json   # a Hugging Face model

With ``--hf-config`` the model is the Hugging Face ``*ForCausalLM`` built from that ``config.json`` (offline, random
weights, ``attn_implementation="sdpa"``, no KV cache) and planned from the same file (``ModelSpec.from_hf_config``,
the planner's Hugging Face layout); needs ``transformers``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import time
from typing import Any

import torch

from jupyter_dist.models import Transformer, TransformerConfig
from jupyter_dist.models.transformer import Block
from jupyter_dist.plan import STRATEGIES, Assumptions, Hardware, ModelSpec, ParallelDims, TrainingShape
from jupyter_dist.plan.memory import HF_LAYOUT, REFERENCE_LAYOUT, activation_bytes_per_layer, estimate_memory
from jupyter_dist.worker._checkpointing import apply_activation_checkpointing, replace_blocks
from jupyter_dist.worker._strategy import find_blocks

MODES = ["none", "selective", "op", "layer:2", "full"]
WRAPPERS = ("plain", "ddp", "fsdp2")


def saved_bytes(blocks: list[Any], run: Any) -> int:
    """Bytes autograd keeps after ``run()``: saved-tensor hooks + op-level SAC caches, by storage, params excluded."""
    from torch.autograd.graph import saved_tensors_hooks

    held = {p.untyped_storage().data_ptr() for b in blocks for p in b.parameters()}
    seen: dict[int, int] = {}

    def note(t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in held:
            seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())

    caches: list[Any] = []
    for b in blocks:
        fn = getattr(b, "checkpoint_fn", None)
        ctx = getattr(fn, "keywords", {}).get("context_fn") if fn is not None else None
        if ctx is not None:

            def spy(ctx: Any = ctx) -> Any:
                modes = ctx()
                caches.append(modes[0])
                return modes

            b.checkpoint_fn = functools.partial(fn.func, *fn.args, **{**fn.keywords, "context_fn": spy})

    def pack(t: Any) -> Any:
        note(t)
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        run()
    for mode in caches:
        for per_op in mode.storage.values():
            for wrapped in per_op.values():
                for leaf in torch.utils._pytree.tree_leaves(wrapped):
                    note(getattr(leaf, "val", None))
    return sum(seen.values())


def cpu_table(args: argparse.Namespace) -> None:
    b, s, h, a, kv = 2, 128, 128, 8, 2
    cfg = TransformerConfig(dim=h, n_heads=a, n_kv_heads=kv)
    spec = ModelSpec(layers=1, hidden=h, heads=a, kv_heads=kv, ffn=cfg.hidden_dim, vocab=256)
    print(f"CPU: saved bytes per block of the reference Transformer, b{b} s{s} h{h} a{a} kv{kv} F{cfg.hidden_dim}")
    print(f"{'mode':<10} {'dtype':<6} {'measured B':>12} {'planned B':>12} {'ratio':>7}")
    for mode in MODES:
        for precision, dtype in (("fp32", torch.float32), ("bf16-true", torch.bfloat16)):
            n = int(mode.partition(":")[2] or 1)
            torch.manual_seed(0)
            blocks = apply_activation_checkpointing([Block(cfg).to(dtype) for _ in range(n)], mode)
            x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)

            def run(blocks: list[Any] = blocks, x: torch.Tensor = x) -> None:
                y = x
                for blk in blocks:
                    y = blk(y)

            measured = saved_bytes(blocks, run) / n
            training = TrainingShape(micro_batch=b, seq_len=s, precision=precision, checkpointing=mode)
            planned = activation_bytes_per_layer(spec, training, ParallelDims(), layout=REFERENCE_LAYOUT)
            print(f"{mode:<10} {precision[:4]:<6} {measured:>12,.0f} {planned:>12,.0f} {measured / planned:>7.3f}")


def _wrap(model: Any, strategy: str, blocks: list[Any]) -> Any:
    """``plain`` (one process, no wrapper), or DDP / FSDP2 on a world of one, as the worker wraps them.

    ``blocks``: the model's blocks after checkpointing wrapped them (``layer:K`` wraps only some, so the blocks are
    no longer of one class and :func:`find_blocks` would not find them: the whole model became one FSDP2 unit).
    """
    if strategy == "plain":
        return model
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[0], gradient_as_bucket_view=True)
    from torch.distributed.fsdp import fully_shard

    for blk in blocks:
        fully_shard(blk)
    return fully_shard(model)


def _build(args: argparse.Namespace, dev: torch.device) -> tuple[Any, ModelSpec, Any, str]:
    """(a bf16 model on ``dev`` with each block checkpointed per ``args.mode``, its plan spec, layout, title)."""
    if args.hf_config:
        import json

        from transformers import CONFIG_MAPPING, AutoModelForCausalLM

        with open(args.hf_config) as f:
            data = json.load(f)
        spec = ModelSpec.from_hf_config(data)
        fields = {k: v for k, v in data.items() if k != "model_type" and not k.startswith("_")}
        config = CONFIG_MAPPING[data["model_type"]](**fields)
        config.use_cache = False  # training: a KV cache would hold every layer's K and V
        with torch.device(dev):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(torch.bfloat16)
        title = f"Hugging Face {type(model).__name__} ({os.path.basename(args.hf_config)})"
        return model, spec, HF_LAYOUT, title
    cfg = TransformerConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                            n_kv_heads=args.kv_heads)  # fmt: skip
    spec = ModelSpec(layers=args.layers, hidden=args.dim, heads=args.heads, kv_heads=args.kv_heads,
                     ffn=cfg.hidden_dim, vocab=args.vocab)  # fmt: skip
    with torch.device(dev):
        torch.manual_seed(0)
        model = Transformer(cfg).to(torch.bfloat16)
    return model, spec, REFERENCE_LAYOUT, "reference Transformer"


def _logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


def gpu_table(args: argparse.Namespace, device: str = "cuda") -> None:
    dev = torch.device(device)
    hw = Hardware.from_names(args.gpu)
    gib = 2**30
    header = False
    for strategy in args.strategies.split(","):
        for mode in MODES:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            model, spec, layout, title = _build(args, dev)
            if not header:
                header = True
                print(f"GPU {torch.cuda.get_device_name()}: {title} {spec.params / 1e9:.2f}B params, bf16 weights, "
                      f"AdamW ({args.optimizer}), micro-batch {args.micro_batch}, seq {args.seq}; GiB; phases: peak "
                      "above the states held between steps")  # fmt: skip
                print(f"{'strategy':<8} {'mode':<10} {'measured':>9} {'planned':>8} {'ratio':>6} {'step s':>7} "
                      f"{'reserved':>9} {'states':>7} {'fwd':>6} {'bwd':>6} {'opt':>6}")  # fmt: skip
            blocks = find_blocks(model)
            wrapped = apply_activation_checkpointing(blocks, mode)
            replace_blocks(model, blocks, wrapped)
            model = _wrap(model, strategy, wrapped)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **{args.optimizer: True})
            tokens = torch.randint(0, spec.vocab, (args.micro_batch, args.seq + 1), device=dev)
            phases: dict[str, int] = {}

            def mark(name: str | None, phases: dict[str, int] = phases) -> None:
                torch.cuda.synchronize()
                if name is not None:
                    phases[name] = torch.cuda.max_memory_allocated()
                torch.cuda.reset_peak_memory_stats()

            try:
                for step in range(3):
                    if step == 2:
                        mark(None)
                        states = torch.cuda.memory_allocated()  # parameters + optimizer states, between steps
                        t0 = time.perf_counter()
                    logits = _logits(model, tokens[:, :-1])
                    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
                    if step == 2:
                        mark("fwd")
                    loss.backward()
                    del logits, loss
                    if step == 2:
                        mark("bwd")
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                mark("opt")
                measured = max(phases.values())
                reserved = torch.cuda.max_memory_reserved()
            except torch.OutOfMemoryError:
                print(f"{strategy:<8} {mode:<10} {'OOM':>9}")
                continue
            finally:
                # every name of this row's model goes before the collection: DDP's reducer and FSDP2's state hold
                # their modules in reference cycles, and a block list left alive until the next row's assignment
                # kept a whole model (1.97 GiB at 1B) through that row's measurement (session 7's FSDP2 rows)
                del model, opt, blocks, wrapped
                gc.collect()
            plan_strategy = {"plain": "ddp"}.get(strategy, strategy)
            training = TrainingShape(micro_batch=args.micro_batch, seq_len=args.seq, precision="bf16-true",
                                     checkpointing=mode)  # fmt: skip
            mem = estimate_memory(spec, training, hw, STRATEGIES[plan_strategy], ParallelDims(), grad_accum=1,
                                  assumptions=Assumptions(), layout=layout)  # fmt: skip
            unseen = sum(mem.detail.get(k, 0) for k in ("cuda_context", "allocator_reserve", "comm_buckets"))
            planned = mem.total - unseen
            above = {k: (v - states) / gib for k, v in phases.items()}
            print(f"{strategy:<8} {mode:<10} {measured / gib:>9.2f} {planned / gib:>8.2f} {measured / planned:>6.3f} "
                  f"{dt:>7.2f} {reserved / gib:>9.2f} {states / gib:>7.2f} {above['fwd']:>6.2f} {above['bwd']:>6.2f} "
                  f"{above['opt']:>6.2f}", flush=True)  # fmt: skip
            if args.detail:
                parts = {k: round(v / gib, 3) for k, v in mem.to_dict().items() if isinstance(v, int)}
                parts.update({k: round(v / gib, 3) for k, v in mem.detail.items() if isinstance(v, (int, float))})
                print(f"    planned (GiB): {parts}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--gpu", default="h100-80gb", help="accelerator name for the plan (jupyter-dist plan --list-gpus)")
    ap.add_argument("--strategies", default="plain,ddp,fsdp2", help="GPU: plain (no wrapper), ddp, fsdp2 (world 1)")
    ap.add_argument(
        "--optimizer",
        choices=("foreach", "fused"),
        default="foreach",
        help="GPU: AdamW's implementation (foreach: PyTorch's default on CUDA; what the plan counts)",
    )
    ap.add_argument("--hf-config", help="a Hugging Face config.json: measure and plan that model (needs transformers)")
    ap.add_argument("--detail", action="store_true", help="print each mode's measured and planned parts")
    ap.add_argument("--cpu", action="store_true", help="the CPU table even when a GPU is present")
    args = ap.parse_args()
    unknown = [s for s in args.strategies.split(",") if s not in WRAPPERS]
    if unknown:
        ap.error(f"unknown strategy {', '.join(unknown)}; valid: {', '.join(WRAPPERS)}")
    if args.hf_config and not os.path.isfile(args.hf_config):
        ap.error(f"--hf-config {args.hf_config!r} is not a file; give a Hugging Face config.json")
    if torch.cuda.is_available() and not args.cpu:
        gpu_table(args)
    else:
        cpu_table(args)


if __name__ == "__main__":
    main()
