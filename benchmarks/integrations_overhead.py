"""What the framework callbacks cost a training step, and how fast the --log-to sinks take a run's records.

Run: python benchmarks/integrations_overhead.py [--calls 20000] [--records 5000] [--sinks tensorboard,mlflow,trackio]

1. The Hugging Face callback's ``on_step_end`` and ``on_log`` and the Lightning callback's ``on_train_batch_end``,
   called in a loop in a process that looks like a launched rank (``JD_RUN_DIR`` set, records written with the
   default 1 s coalescing): microseconds per call, against a bare ``jd.log`` call. The Trainer objects are the real
   ``TrainingArguments`` / ``TrainerState``; Lightning's trainer is a stand-in carrying only what the callback reads
   (``callback_metrics``, ``optimizers``, ``global_step``, ``callbacks``).
2. The kernel side: ``--records`` step records of rank 0 (plus as many of rank 1) forwarded by one
   ``SinkForwarder`` to each sink in turn, writing locally (TensorBoard event file, MLflow's file store, Trackio's
   database, W&B offline when installed): records per second, from start to the sink closed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def per_call_us(fn, calls: int) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - t0) / calls * 1e6


def callbacks(calls: int) -> None:
    import torch

    import jupyter_dist.worker as jd

    print(f"callback cost per call ({calls} calls, records coalesced every 1 s):")
    bare = per_call_us(lambda i: jd.log(i, loss=1.0, samples=4), calls)
    print(f"  bare jd.log(step, loss=..., samples=4)      {bare:7.1f} us")
    if importlib.util.find_spec("transformers"):
        from transformers import TrainingArguments
        from transformers.trainer_callback import TrainerControl, TrainerState

        from jupyter_dist.integrations.hf import JupyterDistCallback as HF

        args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, report_to="none",
                                 use_cpu=True)  # fmt: skip
        state, control, cb = TrainerState(), TrainerControl(), HF()
        base = 10**7

        def step(i: int) -> None:
            state.global_step = base + i
            cb.on_step_end(args, state, control)

        def log(i: int) -> None:
            state.global_step = 2 * base + i
            cb.on_log(args, state, control, logs={"loss": 2.0, "grad_norm": 1.0, "learning_rate": 1e-3, "epoch": 0.1})

        print(f"  HF on_step_end (samples)                    {per_call_us(step, calls):7.1f} us")
        print(f"  HF on_log (loss, grad_norm, lr, epoch)      {per_call_us(log, calls):7.1f} us")
    if importlib.util.find_spec("lightning"):
        from jupyter_dist.integrations.lightning import JupyterDistCallback as PL

        opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        trainer = SimpleNamespace(callback_metrics={"train_mse": torch.tensor(0.5)}, optimizers=[opt], global_step=0,
                                  callbacks=[], sanity_checking=False)  # fmt: skip
        cb2 = PL()
        batch = (torch.zeros(16, 8), torch.zeros(16, 1))
        loss = torch.tensor(0.5)

        def batch_end(i: int) -> None:
            trainer.global_step = 3 * 10**7 + i
            cb2.on_train_batch_end(trainer, None, loss, batch, i)

        print(f"  Lightning on_train_batch_end                {per_call_us(batch_end, calls):7.1f} us")


def sinks(records: int, names: list[str]) -> None:
    from jupyter_dist.telemetry.emitter import Emitter, JsonlFileSink, telemetry_path
    from jupyter_dist.telemetry.sinks import SinkContext, SinkForwarder

    print(f"sinks: {records} step records of rank 0 (and {records} of rank 1) forwarded from the kernel side:")
    for name in names:
        module = {"tensorboard": "tensorboard", "mlflow": "mlflow", "trackio": "trackio", "wandb": "wandb"}[name]
        if importlib.util.find_spec(module) is None:
            print(f"  {name:12} not installed")
            continue
        root = Path(tempfile.mkdtemp())
        run_dir = root / f"bench-{name}"
        for rank in (0, 1):
            em = Emitter(rank=rank, sinks=[JsonlFileSink(telemetry_path(run_dir, rank))], interval_s=0.0)
            for step in range(records):
                em.log({"loss": 1.0 / (step + 1), "learning_rate": 1e-3, "samples": 8}, step)
            em.close()
        os.environ.update(MLFLOW_TRACKING_URI=(root / "mlruns").as_uri(), MLFLOW_ALLOW_FILE_STORE="true",
                          TRACKIO_DIR=str(root / "trackio"), WANDB_MODE="offline", WANDB_SILENT="true")  # fmt: skip
        fwd = SinkForwarder(run_dir / "telemetry", [name], SinkContext(run_name=run_dir.name, run_dir=run_dir),
                            done=lambda: True, interval=0.05)  # fmt: skip
        t0 = time.perf_counter()
        fwd.start()
        fwd.wait()
        dt = time.perf_counter() - t0
        status = f"errors {fwd.errors}" if fwd.errors else f"{fwd.forwarded / dt:9.0f} records/s"
        print(f"  {name:12} {dt:6.2f} s  {status}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--records", type=int, default=5000)
    p.add_argument("--sinks", default="tensorboard,mlflow,trackio,wandb")
    a = p.parse_args()
    run_dir = Path(tempfile.mkdtemp()) / "bench-run"
    (run_dir / "telemetry").mkdir(parents=True)
    os.environ.update(JD_RUN_DIR=str(run_dir), JD_HEARTBEAT_S="0", JD_LOG_STDIO="0")
    callbacks(a.calls)
    sinks(a.records, [s.strip() for s in a.sinks.split(",") if s.strip()])


if __name__ == "__main__":
    main()
