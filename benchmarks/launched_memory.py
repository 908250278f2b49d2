"""Planned against measured peak memory of a launched run: the plan's checkpointing reaches the worker and holds.

``memory_calibration.py`` measures the model in its own process; this one goes the way a user's run goes:
``jupyter-dist launch`` (real torchrun, one process) of a script that builds the reference Transformer and trains it
with ``jd.wrap`` / ``jd.backward`` / ``jd.step``, with ``JD_STRATEGY``, ``JD_AC`` (the plan's checkpointing, as
``%%dist_train --plan`` writes it) and ``JD_PRECISION=bf16-true``. The rank prints
``torch.cuda.max_memory_allocated`` after its steps and how many blocks ``jd.wrap`` checkpointed; the plan is
``estimate_memory`` for the same model and shape, without what that counter cannot see (CUDA context, allocator
reserve, communication buckets). One row per (strategy, checkpointing); the ratio is measured/planned.

On a machine without CUDA it runs a small model on CPU (gloo), where it checks only that each run checkpoints the
blocks the plan names (no peak figure).

    python benchmarks/launched_memory.py [--strategies ddp,fsdp2] [--modes none,full] [--gpu h100-80gb]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = r"""
import os, torch, jupyter_dist.worker as jd
from jupyter_dist.models import Transformer, TransformerConfig
cfg = TransformerConfig(vocab_size=int(os.environ["M_VOCAB"]), dim=int(os.environ["M_DIM"]),
                        n_layers=int(os.environ["M_LAYERS"]), n_heads=int(os.environ["M_HEADS"]),
                        n_kv_heads=int(os.environ["M_KV"]))
seq, batch = int(os.environ["M_SEQ"]), int(os.environ["M_BATCH"])
torch.manual_seed(0)
model = Transformer(cfg)
model, opt = jd.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
wrapped = sum(type(m).__name__.endswith("CheckpointWrapper") for m in model.modules())
tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=jd.device)
for step in range(3):
    if step == 2 and jd.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    del logits
    jd.backward(loss)
    jd.step(opt)
    jd.log(step, loss=loss)
peak = torch.cuda.max_memory_allocated() if jd.device.type == "cuda" else -1
print(f"RESULT wrapped={wrapped} peak={peak}", flush=True)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategies", default="ddp,fsdp2", help="comma-separated JD_STRATEGY names: ddp, fsdp2")
    ap.add_argument("--modes", default="none,full", help="comma-separated checkpointing names (JD_AC)")
    ap.add_argument("--gpu", default="h100-80gb", help="accelerator name for the plan (jupyter-dist plan --list-gpus)")
    args = ap.parse_args()
    from jupyter_dist.plan.training import parse_checkpointing

    strategies, modes = args.strategies.split(","), args.modes.split(",")
    unknown = [s for s in strategies if s not in ("ddp", "fsdp2")]
    if unknown:
        ap.error(f"unknown strategy {', '.join(unknown)}; valid: ddp, fsdp2")
    for m in modes:
        try:
            parse_checkpointing(m, what="--modes")
        except ValueError as e:
            ap.error(str(e))
    import torch

    from jupyter_dist.models import TransformerConfig
    from jupyter_dist.plan import STRATEGIES, Assumptions, Hardware, ModelSpec, ParallelDims, TrainingShape
    from jupyter_dist.plan.memory import REFERENCE_LAYOUT, estimate_memory

    cuda = torch.cuda.is_available()
    dims = dict(M_VOCAB=32000, M_DIM=2048, M_LAYERS=20, M_HEADS=16, M_KV=8, M_SEQ=4096, M_BATCH=1) if cuda else \
        dict(M_VOCAB=256, M_DIM=64, M_LAYERS=4, M_HEADS=4, M_KV=2, M_SEQ=32, M_BATCH=2)  # fmt: skip
    cfg = TransformerConfig(vocab_size=dims["M_VOCAB"], dim=dims["M_DIM"], n_layers=dims["M_LAYERS"],
                            n_heads=dims["M_HEADS"], n_kv_heads=dims["M_KV"])  # fmt: skip
    spec = ModelSpec(layers=cfg.n_layers, hidden=cfg.dim, heads=cfg.n_heads, kv_heads=cfg.n_kv_heads,
                     ffn=cfg.hidden_dim, vocab=cfg.vocab_size)  # fmt: skip
    hw = Hardware.from_names(args.gpu)
    gib = 2**30
    print(f"torch {torch.__version__}, " + (torch.cuda.get_device_name() if cuda else "no CUDA: CPU smoke run")
          + f"; reference Transformer {spec.params / 1e9:.3f}B, bf16-true, seq {dims['M_SEQ']}, micro-batch "
          f"{dims['M_BATCH']}; GiB")  # fmt: skip
    print(f"{'strategy':<8} {'JD_AC':<10} {'blocks wrapped':>14} {'measured':>9} {'planned':>8} {'ratio':>6}")
    ok = True
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "train.py"
        script.write_text(SCRIPT)
        for strategy in strategies:
            for mode in modes:
                env = [f"JD_AC={mode}", "JD_PRECISION=bf16-true", *(f"{k}={v}" for k, v in dims.items())]
                cmd = [sys.executable, "-m", "jupyter_dist.cli", "launch", "--nproc", "1", "--strategy", strategy,
                       "--name", f"{strategy}-{mode.replace(':', '')}", "--runs-dir", str(Path(d) / "runs"),
                       "--timeout", "400"]  # fmt: skip
                for e in env:
                    cmd += ["--env", e]
                proc = subprocess.run([*cmd, str(script)], capture_output=True, text=True, timeout=480)
                runs = sorted((Path(d) / "runs").glob(f"{strategy}-{mode.replace(':', '')}*"))
                log = (runs[-1] / "logs" / "rank-0.log").read_text() if runs else ""
                result = [ln for ln in log.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode or not result:
                    print(f"{strategy:<8} {mode:<10} launch failed (exit {proc.returncode})\n{log[-3000:]}")
                    ok = False
                    continue
                fields = dict(kv.split("=") for kv in result[-1].split()[1:])
                wrapped, peak = int(fields["wrapped"]), int(fields["peak"])
                kind, every = parse_checkpointing(mode, what="JD_AC")
                want = {"none": 0, "full": cfg.n_layers, "layer": cfg.n_layers // every}.get(kind.value, cfg.n_layers)
                ok &= kind.value == "selective" or wrapped == want
                training = TrainingShape(micro_batch=dims["M_BATCH"], seq_len=dims["M_SEQ"], precision="bf16-true",
                                         checkpointing=mode)  # fmt: skip
                mem = estimate_memory(spec, training, hw, STRATEGIES[strategy], ParallelDims(), grad_accum=1,
                                      assumptions=Assumptions(), layout=REFERENCE_LAYOUT)  # fmt: skip
                unseen = sum(mem.detail.get(k, 0) for k in ("cuda_context", "allocator_reserve", "comm_buckets"))
                planned = mem.total - unseen
                shown = (f"{peak / gib:>9.2f} {planned / gib:>8.2f} {peak / planned:>6.3f}" if peak > 0 else
                         f"{'-':>9} {planned / gib:>8.2f} {'-':>6}")  # fmt: skip
                print(f"{strategy:<8} {mode:<10} {wrapped:>14} {shown}", flush=True)
    print("ALL CHECKS PASSED" if ok else "SOME CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
