"""What each ``jupyter-dist`` sub-command does with its parsed flags.

``launch`` is in :mod:`jupyter_dist.launch.scriptrun`, beside ``%dist_train --script``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..errors import JupyterDistError
from .flags import check_from_args, plan_from_args, rehearse_from_args, render_options_from_args, tune_from_args

__all__ = ["COMMANDS"]


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.list_models:
        from ..plan import PRESETS
        from ..plan.units import fmt_count

        for name, spec in PRESETS.items():
            print(f"{name:16} {fmt_count(spec.params):>8}  ({spec.params:,} params)")
        return 0
    if args.list_gpus:
        from ..plan import ACCELERATORS, INTERCONNECTS
        from ..plan.units import fmt_gib

        for acc in ACCELERATORS.values():
            print(f"{acc.name:12} {acc.label:28} {fmt_gib(acc.memory_bytes):>10}  "
                  f"{acc.peak_flops('bf16') / 1e12:7.0f} TFLOPS  {acc.intra_node_link}")  # fmt: skip
        print()
        for ic in INTERCONNECTS.values():
            print(f"{ic.name:16} {ic.label}")
        return 0
    result = plan_from_args(args)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.to_text(limit=None if args.all else 12))
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from ..render.bundle import render_bundle

    bundle = render_bundle(plan_from_args(args), render_options_from_args(args))
    if args.show:
        if args.show not in bundle.files:
            raise JupyterDistError(f"no file {args.show!r} in this bundle; have: {', '.join(bundle.files)}")
        sys.stdout.write(bundle.files[args.show])
        return 0
    if args.json:
        print(json.dumps(bundle.to_dict(), indent=2))
        return 0
    print(bundle.to_text())
    if args.out:
        try:
            paths = bundle.write_to(args.out)
        except OSError as exc:
            from .._atomic import describe_write_error

            hint = "free space or choose another --out"
            raise JupyterDistError(describe_write_error(exc, args.out, hint=hint)) from None
        print(f"wrote {len(paths)} files to {args.out}")
    else:
        print("(--out DIR writes them; --show FILE prints one)")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo, run_quickstart
    from ..launch.session import STRATEGY_CHOICES

    steps = args.steps if args.steps is not None else (300 if args.terminal else 200)
    if args.nproc < 1 or steps < 1:
        raise JupyterDistError(f"--nproc and --steps must be >= 1, got {args.nproc} and {steps}")
    if args.strategy not in STRATEGY_CHOICES:
        raise JupyterDistError(f"--strategy {args.strategy!r} is not one of {', '.join(STRATEGY_CHOICES)}")
    if args.terminal:
        run = run_demo(nproc=args.nproc, strategy=args.strategy, steps=steps, runs_dir=args.runs_dir)
    else:
        run, _ = run_quickstart(nproc=args.nproc, strategy=args.strategy, steps=steps, runs_dir=args.runs_dir)
    return 0 if run.status == "succeeded" else 1


def _cmd_tune(args: argparse.Namespace) -> int:
    code = None
    if args.script:
        try:
            code = open(args.script, encoding="utf-8").read()
        except OSError as exc:
            raise JupyterDistError(f"--script {args.script}: {exc.strerror}") from None
    shown = [0]

    def progress(result: Any) -> None:  # a line per finished trial
        for trial in result.trials[shown[0] :]:
            if not args.json:
                print(f"  {trial.label}: {trial.status}" + (f" ({trial.error})" if trial.error else ""), flush=True)
        shown[0] = len(result.trials)

    result = tune_from_args(args, code=code, on_trial=progress)
    if args.json:
        print(json.dumps({
            "trials": [{"candidate": t.candidate, "micro_batch": t.micro_batch, "options": getattr(t, "options", ""),
                        "status": t.status, "error": t.error,
                        "predicted": {"step_time_s": t.predicted.time.step_time_s,
                                      "tokens_per_s": t.predicted.time.tokens_per_s,
                                      "peak_bytes": t.predicted.memory.total},
                        "measured": None if t.measured is None else {
                            "step_time_s": t.measured.step_time_s, "tokens_per_s": t.measured.tokens_per_s,
                            "peak_bytes": {str(k): v for k, v in t.measured.peak_bytes.items()},
                            "memory_kind": t.measured.memory_kind},
                        "run_dir": t.run_dir} for t in result.trials],
            "calibration": result.calibration.to_dict() if result.calibration is not None else None,
            "calibration_path": result.calibration_path or None,
            "plan": result.plan.to_dict() if result.plan is not None else None,
        }, indent=2))  # fmt: skip
    else:
        print(result.to_text())
        if result.plan is not None:
            print()
            print(result.plan.to_text())
    return 0 if result.plan is not None else 1


def _cmd_rehearse(args: argparse.Namespace) -> int:
    def progress(rank: Any) -> None:  # a line per finished rank
        if not args.json:
            state = "rehearsed" if rank.ok else f"could not be rehearsed: {rank.error}"
            print(f"  rank {rank.rank}: {state}", flush=True)

    result = rehearse_from_args(args, on_rank=progress)
    refused = None
    if getattr(args, "save", False):  # consent given: later plans of this shape use the rehearsed peak
        try:
            result.save_calibration()
        except JupyterDistError as exc:  # said after the table: the rehearsal took its minutes
            refused = exc
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.to_text())
    if refused is not None:
        raise refused
    return 0 if result.ok else 1


def _cmd_check(args: argparse.Namespace) -> int:
    report: Any = check_from_args(args)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.to_text())
    return {"healthy": 0, "degraded": 1}.get(report.verdict, 3)


def _cmd_log_to(args: argparse.Namespace) -> int:
    from ..launch.run import open_run

    run = open_run(args.run_dir)
    forwarder = run.log_to(args.sinks, secrets=args.secret)
    forwarder.wait()
    print(f"{run.name}: {forwarder.describe()}")
    return 1 if forwarder.errors else 0


COMMANDS = {"plan": _cmd_plan, "config": _cmd_config, "demo": _cmd_demo, "check": _cmd_check, "log-to": _cmd_log_to,
            "tune": _cmd_tune, "rehearse": _cmd_rehearse}  # fmt: skip
"""Sub-command name -> its function (``launch`` is added by :func:`jupyter_dist.cli.main`)."""
