"""The CUDA paths of a real launched run, on one GPU: telemetry, bf16 autocast, CUDA RNG in checkpoints.

Runs ``jupyter-dist launch`` (real torchrun, one process, NCCL with a world of one) on a small MLP with dropout,
whose inputs come from the CUDA generator, under ``--strategy ddp`` and ``fsdp2`` with ``JD_PRECISION=bf16-mixed``:

1. uninterrupted, 12 steps, a checkpoint every 3;
2. the same run stopped after step 6 (last checkpoint: step 5), then a new launch that resumes it to step 12:
   its losses of steps 6..11 and its final parameters must equal run 1's bit for bit -- only true when the
   checkpoint carries the CUDA RNG state (the dropout masks and the inputs of the resumed steps);
3. from run 1's telemetry: the ``mem`` records (``torch.cuda.memory_stats``) and the ``gpu`` records (NVML: util,
   memory, power, temperature); the dtype autocast gave the forward (bf16 expected).

Prints one block per strategy; exits 1 when a check fails. On a machine without CUDA it runs on CPU (gloo), where
the RNG and telemetry checks still run but the GPU ones are reported as absent.

    python benchmarks/gpu_paths.py [--strategies ddp,fsdp2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = r"""
import os, torch, jupyter_dist.worker as jd
STOP = int(os.environ.get("STOP", "1000"))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Dropout(0.1),
                            torch.nn.Linear(2048, 512))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = jd.wrap(model, opt)
start = jd.start_step()
print("start", start, "device", jd.device, flush=True)
for step in range(start, 12):
    x = torch.randn(64, 512, device=jd.device)  # the default generator of jd.device: CUDA's on a GPU
    with jd.autocast():
        y = model(x)
    if step == start:
        print("forward dtype", y.dtype, flush=True)
    loss = (y.float() - x).square().mean()
    jd.backward(loss)
    jd.step(opt)
    jd.log(step, loss=loss)
    print("loss", step, repr(loss.item()), flush=True)
    jd.checkpoint({"model": model, "optimizer": opt}, step)
    if step == STOP:
        break
params = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
if jd.rank == 0:
    torch.save([p.float().cpu() for p in params], os.path.join(os.environ["JD_RUN_DIR"], "final.pt"))
"""


def launch(script: Path, runs: Path, name: str, strategy: str, ckpt: Path, stop: int | None) -> Path:
    env = ["--env", "JD_PRECISION=bf16-mixed", "--env", "JD_CHECKPOINT_EVERY=3", "--env", f"JD_CHECKPOINT_DIR={ckpt}",
           "--env", "JD_TELEMETRY_INTERVAL_S=0.2"]  # fmt: skip
    if stop is not None:
        env += ["--env", f"STOP={stop}"]
    cmd = [sys.executable, "-m", "jupyter_dist.cli", "launch", "--nproc", "1", "--strategy", strategy, "--name", name,
           "--runs-dir", str(runs), "--timeout", "240", *env, str(script)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(f"  launch {name}: exit {proc.returncode}")
    if proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-3000:])
    dirs = sorted(runs.glob(f"{name}*"), key=lambda p: p.stat().st_mtime)
    return dirs[-1]


def log_lines(run: Path) -> list[str]:
    log = run / "logs" / "rank-0.log"
    return log.read_text().splitlines() if log.exists() else []


def losses(lines: list[str]) -> dict[int, str]:
    """Each step's loss as the script printed it (repr: every bit); step records are windowed, so not those."""
    return {int(p[1]): p[2] for p in (ln.split() for ln in lines) if len(p) == 3 and p[0] == "loss"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategies", default="ddp,fsdp2", help="comma-separated JD_STRATEGY names (default ddp,fsdp2)")
    ap.add_argument("--out", default=None, help="write each uninterrupted run's telemetry records here (JSON lines)")
    args = ap.parse_args()
    from jupyter_dist.plan import STRATEGIES

    strategies = args.strategies.split(",")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        ap.error(f"unknown strategy {', '.join(unknown)}; valid: {', '.join(STRATEGIES)}")
    import torch

    from jupyter_dist.telemetry.reader import read_run_records

    ok = True
    print(f"torch {torch.__version__}, cuda {torch.cuda.is_available()}"
          + (f" ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else ""))  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        base = Path(d)
        script = base / "train.py"
        script.write_text(SCRIPT)
        for strategy in strategies:
            print(f"== {strategy}, bf16-mixed")
            whole = launch(script, base / "runs", f"{strategy}-whole", strategy, base / f"ck-{strategy}-a", None)
            ck = base / f"ck-{strategy}-b"
            launch(script, base / "runs", f"{strategy}-first", strategy, ck, 6)
            resumed = launch(script, base / "runs", f"{strategy}-resumed", strategy, ck, None)
            whole_log, resumed_log = log_lines(whole), log_lines(resumed)
            lw, lr = losses(whole_log), losses(resumed_log)
            same_losses = bool(lr) and all(lw.get(s) == v for s, v in lr.items())
            pw, pr = torch.load(whole / "final.pt"), torch.load(resumed / "final.pt")
            same_params = len(pw) == len(pr) and all(torch.equal(a, b) for a, b in zip(pw, pr, strict=True))
            start = [ln for ln in resumed_log if ln.startswith("start ")]
            print(f"  resumed run: {start[:1]}; steps {sorted(lr)}; losses equal the uninterrupted run's: "
                  f"{same_losses}; final parameters equal: {same_params}")  # fmt: skip
            ok &= same_losses and same_params and bool(start) and start[0].startswith("start 6")
            dtype = [ln for ln in whole_log if "forward dtype" in ln]
            print(f"  autocast: {dtype[:1]}")
            recs = read_run_records(whole / "telemetry")
            mem, gpu = recs.of_kind("mem"), recs.of_kind("gpu")
            cuda_mem = [r for r in mem if str(r.get("device", "")).startswith("cuda")]
            print(f"  mem records {len(mem)} (cuda {len(cuda_mem)}); gpu (NVML) records {len(gpu)}")
            if cuda_mem:
                last = cuda_mem[-1]
                print("  last cuda mem record: " + json.dumps({k: v for k, v in last.items() if k not in ("t",)}))
            if gpu:
                print("  last gpu record: " + json.dumps({k: v for k, v in gpu[-1].items() if k not in ("t",)}))
            if torch.cuda.is_available():
                ok &= bool(cuda_mem) and bool(gpu) and bool(dtype) and "bfloat16" in dtype[0]
            if args.out:
                dest = Path(args.out)
                dest.mkdir(parents=True, exist_ok=True)
                lines = [json.dumps(r) for r in recs.records]
                (dest / f"{strategy}-whole.jsonl").write_text("\n".join(lines) + "\n")
    print("ALL CHECKS PASSED" if ok else "SOME CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
