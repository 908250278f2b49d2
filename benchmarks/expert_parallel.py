"""Expert-parallel all-to-all volume: bytes each rank really sends per step against the planner's ``ep_comm`` volume.

Run: python benchmarks/expert_parallel.py [--nproc 4] [--ep 2] [--steps 5] [--experts 8] [--top-k 2]

Launches ``--nproc`` torchrun processes on gloo/CPU training the MoE reference (``jupyter_dist.models
.MoETransformer``) under ``fsdp2`` with ``JD_EP``, and counts, in every dispatch and combine all-to-all, the bytes a
rank sends to *other* ranks (its own split stays local): forward sends its input splits, backward sends back what
the forward received. The planner (``plan/perf.py``) counts ``4 * layers * (ep - 1) / ep * k s b h * bytes`` per
step: four all-to-alls per layer of the routed tokens, of which ``(ep - 1) / ep`` leave the rank when routing is
uniform. The ratio measured / planned is printed per rank; it departs from 1 exactly as far as the router is
unbalanced (a router that sends everything to local experts moves nothing), which the per-rank figures show.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = r"""
import json, os, sys
import torch
import torch.nn.functional as F
import torch.distributed._functional_collectives as fc

import jupyter_dist.worker as jd
from jupyter_dist.models import MoETransformer

sent = [0]
original = fc.all_to_all_single_autograd


def counting(x, output_split_sizes, input_split_sizes, group):
    me = torch.distributed.get_rank(group)
    row = x[0].numel() * x.element_size() if x.shape[0] else 0
    # forward sends the input splits; its backward sends back what the forward received
    sent[0] += row * (sum(input_split_sizes) - input_split_sizes[me] + sum(output_split_sizes) - output_split_sizes[me])
    return original(x, output_split_sizes, input_split_sizes, group)


fc.all_to_all_single_autograd = counting
cfg = json.loads(os.environ["BENCH_CFG"])
torch.manual_seed(0)
model = MoETransformer(vocab_size=128, dim=cfg["dim"], n_layers=cfg["layers"], n_heads=4, n_experts=cfg["experts"],
                       top_k=cfg["top_k"], ffn_dim=32)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = jd.wrap(model, opt)
b, s = cfg["micro_batch"], cfg["seq"]
per_step = []
for step in range(cfg["steps"]):
    g = torch.Generator().manual_seed(step * jd.dp_size + jd.dp_rank)
    tokens = torch.randint(0, 128, (b, s + 1), generator=g)
    sent[0] = 0
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, 128), tokens[:, 1:].reshape(-1)) + 0.01 * model.aux_loss()
    loss.backward()
    opt.step()
    opt.zero_grad()
    per_step.append(sent[0])
with open(os.path.join(os.environ["BENCH_OUT"], f"rank{jd.rank}.json"), "w") as f:
    json.dump(per_step, f)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    a = ap.parse_args()

    from jupyter_dist.models import MoETransformer
    from jupyter_dist.plan import Hardware, ModelSpec, TrainingShape, get_accelerator, plan

    cfg = {"dim": a.dim, "layers": a.layers, "experts": a.experts, "top_k": a.top_k, "micro_batch": a.micro_batch,
           "seq": a.seq, "steps": a.steps}  # fmt: skip
    spec = ModelSpec.from_module(MoETransformer, vocab_size=128, dim=a.dim, n_layers=a.layers, n_heads=4,
                                 n_experts=a.experts, top_k=a.top_k, ffn_dim=32)  # fmt: skip
    shape = TrainingShape(micro_batch=a.micro_batch, seq_len=a.seq, precision="fp32")
    hardware = Hardware(accelerator=get_accelerator("cpu"), gpus_per_node=a.nproc)
    p = plan(spec, hardware, shape, strategy="fsdp2", ep=a.ep)
    cand = p.candidate(f"fsdp2+ep{a.ep}")
    planned = cand.time.comm_bytes["expert_parallel"]
    with tempfile.TemporaryDirectory() as out:
        script = Path(out) / "worker.py"
        script.write_text(WORKER)
        env = {**os.environ, "JD_STRATEGY": "fsdp2", "JD_EP": str(a.ep), "BENCH_CFG": json.dumps(cfg),
               "BENCH_OUT": out}  # fmt: skip
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.nproc),
                str(script)]  # fmt: skip
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode:
            raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
        measured = {r: json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(a.nproc)}
    print(f"fsdp2+ep{a.ep} on {a.nproc} processes, {a.experts} experts top-{a.top_k}, {a.layers} layers, "
          f"micro-batch {a.micro_batch} x {a.seq} tokens, hidden {a.dim}, fp32")  # fmt: skip
    print(f"planned all-to-all bytes per rank per step: {planned:,.0f}")
    ratios = []
    for r, steps in measured.items():
        mean = sum(steps) / len(steps)
        ratios.append(mean / planned)
        print(f"rank {r}: measured {mean:,.0f} bytes/step (steps: {', '.join(f'{x:,}' for x in steps)}), "
              f"measured / planned = {mean / planned:.3f}")  # fmt: skip
    print(f"mean over ranks: measured / planned = {sum(ratios) / len(ratios):.3f}")


if __name__ == "__main__":
    main()
