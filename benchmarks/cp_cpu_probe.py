"""Does PyTorch's context-parallel attention run on CPU/gloo? The evidence, and the ring's cost against plain SDPA.

Run: python benchmarks/cp_cpu_probe.py [--cp 2] [--seq 1024] [--heads 8] [--head-dim 64] [--batch 2] [--reps 5]
     [--device cuda --dtype bf16]

``--device cuda`` runs the same checks on the CUDA kernels (flash for bf16, memory-efficient for fp32), every rank on
GPU 0 over gloo (one GPU cannot hold two NCCL ranks), so the ring's arithmetic is checked there, not NCCL's speed.

Starts ``--cp`` gloo processes (torchrun's launcher API, on this machine) and on each:

1. stock torch: ``torch.distributed.tensor.experimental.context_parallel`` with q, k, v as its buffers, then
   ``F.scaled_dot_product_attention(..., is_causal=True)`` -- with the default backend (on CPU:
   ``aten._scaled_dot_product_flash_attention_for_cpu``) and with ``SDPBackend.MATH``; prints what happens
   (torch 2.13: no DTensor sharding strategy for the CPU flash op; the math path mixes plain tensors and DTensors);
2. with ``jupyter_dist``'s registration (``jupyter_dist.worker._context.enable_dispatcher``: the CPU flash kernel
   pair routed into PyTorch's own ``_templated_ring_attention``): the max error of the output and of dq, dk, dv
   against one process's SDPA on the whole sequence, gathered back with ``context_parallel_unshard``;
3. the wall time of forward + backward per call: the ring on ``--cp`` processes vs plain SDPA on the whole sequence
   in one process (median of ``--reps``), and the bytes of q, k, v each rank holds vs one process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def worker(args: argparse.Namespace, out_dir: str) -> None:
    import contextlib
    import traceback

    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION}  # fmt: skip
    ctx = sdpa_kernel(backends[args.backend]) if args.backend else contextlib.nullcontext()
    try:
        with ctx:
            _worker(args, out_dir)
    except Exception:
        with open(os.path.join(out_dir, f"fault{os.environ.get('RANK', '0')}-tb.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _worker(args: argparse.Namespace, out_dir: str) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fault = open(os.path.join(out_dir, f"fault{os.environ.get('RANK', '0')}.txt"), "w")  # noqa: SIM115 - process-long
    faulthandler.enable(fault)  # a crash in a kernel or collective leaves its Python stack here
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.device == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU
    mesh = init_device_mesh(args.device, (args.cp,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    q, k, v = (torch.randn(shape).to(args.device, dtype) for _ in range(3))
    report: dict[str, object] = {}
    for name, backend in (("stock default backend", None), ("stock math backend", SDPBackend.MATH)):
        qq, kk, vv = q.clone(), k.clone(), v.clone()
        try:
            with context_parallel(mesh, buffers=[qq, kk, vv], buffer_seq_dims=[2, 2, 2]):
                if backend is None:
                    F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
                else:
                    with sdpa_kernel(backend):
                        F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
            report[name] = "ran"
        except Exception as e:  # noqa: BLE001 - the probe reports whatever stock torch raises
            report[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"

    from torch import nn
    from torch.distributed.tensor.experimental._context_parallel._attention import _ContextParallel

    from jupyter_dist.worker._context import enable_dispatcher, shard

    class Core(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    core = Core()
    _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA)._apply(core, mesh)
    enable_dispatcher(args.device)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    ql, kl, vl, gl = shard(mesh, (q, k, v, grad), 2)
    ql, kl, vl = (t.clone().requires_grad_() for t in (ql, kl, vl))
    y = core(ql, kl, vl)
    y.backward(gl)
    whole = context_parallel_unshard(mesh, [y.detach(), ql.grad, kl.grad, vl.grad], [2, 2, 2, 2],
                                     load_balancer=_balancer(args.seq, args.cp, args.device))  # fmt: skip
    report["max abs error (out, dq, dk, dv)"] = [
        float((a.float() - b.float()).abs().max()) for a, b in zip(whole, (ref, qr.grad, kr.grad, vr.grad), strict=True)
    ]

    def timed(fn: object, reps: int) -> float:
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()  # type: ignore[operator]
            _sync(args.device)
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    def ring() -> None:
        a, b, c = (t.detach().requires_grad_() for t in (ql, kl, vl))
        core(a, b, c).backward(gl)

    report["ring fwd+bwd s"] = timed(ring, args.reps)
    report["qkv bytes per rank"] = 3 * ql.numel() * ql.element_size()
    if rank == 0:

        def plain() -> None:
            a, b, c = (t.detach().requires_grad_() for t in (q, k, v))
            F.scaled_dot_product_attention(a, b, c, is_causal=True).backward(grad)

        report["one process fwd+bwd s"] = timed_local(plain, args.reps, args.device)
        report["qkv bytes one process"] = 3 * q.numel() * q.element_size()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


def _balancer(seq: int, cp: int, device: str = "cpu") -> object:
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    return _HeadTailLoadBalancer(seq, cp, device)


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def timed_local(fn: object, reps: int, device: str = "cpu") -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        _sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument(
        "--backend",
        choices=("flash", "efficient", "cudnn"),
        default=None,
        help="run everything under torch.nn.attention.sdpa_kernel(this backend) (CUDA)",
    )
    ap.add_argument("--_worker", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._worker:
        worker(args, args._worker)
        return
    import subprocess

    with tempfile.TemporaryDirectory() as d:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.cp),
                __file__, *sys.argv[1:], "--_worker", d]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode:
            names = sorted(f for f in os.listdir(d) if f.startswith("fault"))
            faults = "".join(open(os.path.join(d, f)).read()[-2500:] for f in names)
            sys.exit(proc.stdout[-2000:] + proc.stderr[-1500:] + "\n--- worker stacks ---\n" + faults)
        reports = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(args.cp)]
    import torch

    r0 = reports[0]
    shape = f"{args.batch}x{args.heads}x{args.seq}x{args.head_dim}"
    print(f"torch {torch.__version__}, cp={args.cp}, q/k/v {shape} {args.dtype} on {args.device}")
    for key in ("stock default backend", "stock math backend"):
        print(f"{key:<28} {r0[key]}")
    errs = max(max(r["max abs error (out, dq, dk, dv)"]) for r in reports)
    print(f"{'ring via jupyter_dist':<28} ran; max abs error vs one process (out, dq, dk, dv; all ranks): {errs:.1e}")
    ring = max(r["ring fwd+bwd s"] for r in reports)
    print(f"{'fwd+bwd, ring on cp ranks':<28} {ring * 1e3:.1f} ms (slowest rank, median of {args.reps})")
    print(f"{'fwd+bwd, one process':<28} {r0['one process fwd+bwd s'] * 1e3:.1f} ms")
    print(f"{'q,k,v bytes per rank':<28} {r0['qkv bytes per rank']:,} vs {r0['qkv bytes one process']:,} whole")


if __name__ == "__main__":
    main()
