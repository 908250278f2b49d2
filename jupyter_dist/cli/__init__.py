"""``jupyter-dist`` command line: mirrors the magics. ``--json`` prints one JSON object.

Exit codes: 0 success, 2 bad input (one line on stderr saying what is wrong and what is valid).

* :mod:`.flags` -- the flag groups and number types the magics share (one definition);
* :mod:`.commands` -- what each sub-command does;
* here -- the parser with its sub-commands and :func:`main` (the console script, also ``python -m jupyter_dist.cli``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from ..errors import JupyterDistError
from .flags import (  # re-exported: these have always been importable from jupyter_dist.cli
    MAX_COUNT,
    MAX_LOCAL_NPROC,
    MAX_SECONDS,
    add_check_arguments,
    add_output_argument,
    add_plan_arguments,
    add_rehearse_arguments,
    add_render_arguments,
    add_tune_arguments,
    check_from_args,
    float_arg,
    int_arg,
    plan_from_args,
    render_options_from_args,
    tune_from_args,
)

__all__ = ["main", "build_parser", "plan_from_args", "MAX_COUNT", "MAX_LOCAL_NPROC", "MAX_SECONDS", "int_arg",
           "float_arg", "add_plan_arguments", "add_render_arguments", "add_check_arguments", "add_tune_arguments",
           "check_from_args", "render_options_from_args", "tune_from_args"]  # fmt: skip


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``jupyter-dist`` parser with its sub-commands."""
    parser = _Parser(prog="jupyter-dist", description="Plan, compile, run and watch distributed PyTorch training.")
    from .._version import __version__

    parser.add_argument("--version", action="version", version=f"jupyter-dist {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    p = sub.add_parser("plan", help="which strategy, will it fit, how fast, and why",
                       description="Per-GPU memory, step time and a recommendation for every strategy. Memory in "
                                   "--json output is in bytes; the table is in GiB.")  # fmt: skip
    add_plan_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (memory in bytes)")
    p.add_argument("--all", action="store_true", help="show every candidate in the table, not the first 12")
    p.add_argument("--list-models", action="store_true", help="list model presets and exit")
    p.add_argument("--list-gpus", action="store_true", help="list accelerators and interconnects and exit")
    c = sub.add_parser("config", help="compile a plan into DeepSpeed JSON, code, commands, SkyPilot, SLURM ...",
                       description="Plan (same flags as `plan`), then compile the recommendation (or --candidate) into "
                                   "every artifact: train.py, ds_config.json, accelerate_config.yaml, launch.sh, "
                                   "skypilot.yaml, job.sbatch, nccl.env, plan.json.")  # fmt: skip
    add_plan_arguments(c)
    add_render_arguments(c)
    c.add_argument("--out", metavar="DIR", help="write every file into DIR")
    c.add_argument("--show", metavar="FILE", help="print one file (e.g. ds_config.json) to stdout")
    c.add_argument("--json", action="store_true", help="print one JSON object: files, commands (argv + env), notes")
    d = sub.add_parser("demo", help="execute the quickstart notebook: plan, train on 2 CPU processes, watch, report",
                       description="Write the quickstart notebook into RUNS_DIR/demo-<time>/, execute it on a "
                                   "real kernel (wizard plan, %%%%dist_train on fresh torchrun processes, gloo on "
                                   "CPU), print the ranks' progress, and leave the executed notebook, an offline HTML "
                                   "report and the run's panels (dashboard.html).")  # fmt: skip
    d.add_argument("--nproc", type=int_arg(1, MAX_LOCAL_NPROC), default=2, help="processes (default 2)")
    d.add_argument("--strategy", default="auto", help="auto (the plan's choice; default), ddp, fsdp2, zero2 ...")
    d.add_argument("--steps", type=int_arg(1, 10**7), help="optimizer steps (default 200; 300 with --terminal)")
    d.add_argument("--runs-dir", default="runs", help="where the demo folder goes (default ./runs)")
    d.add_argument("--terminal", action="store_true", help="no notebook: train and print progress only")
    k = sub.add_parser("check", help="preflight: versions, correctness and collective bandwidth on fresh ranks",
                       description="Run all-reduce, all-gather, reduce-scatter and broadcast over a range of message "
                                   "sizes on the launcher a training run uses; report bus bandwidth the nccl-tests "
                                   "way and a verdict (healthy / degraded / broken) with the evidence.")  # fmt: skip
    add_check_arguments(k)
    from ..launch.scriptrun import add_launch_arguments

    la = sub.add_parser("launch", help="run an existing training script on fresh ranks (local, SLURM, SkyPilot)",
                        description="Run SCRIPT unmodified on every rank (plain torch.distributed or using jd), "
                                    "follow it to the end and print its summary; exit 0 when it succeeded. "
                                    "Everything after SCRIPT is the script's.")  # fmt: skip
    add_launch_arguments(la)
    add_output_argument(la)

    s = sub.add_parser("log-to", help="forward a run's metrics to tensorboard, wandb, mlflow, trackio",
                       description="Forward the step records of a run directory to metric sinks from this process (a "
                                   "finished run at once; a running one until it ends), as %%%%dist_train --log-to "
                                   "does from the notebook.")  # fmt: skip
    s.add_argument("run_dir", metavar="RUN_DIR", help="a jupyter-dist run directory (with run.json)")
    s.add_argument("sinks", metavar="SINKS", help="comma-separated: tensorboard, wandb, mlflow, trackio")
    s.add_argument("--secret", action="append", default=[], metavar="NAME",
                   help="an environment variable the sinks need (checked, read by name, never written)")  # fmt: skip

    t = sub.add_parser("tune", help="measure the plan's top candidates on this hardware; save a calibration",
                       description="Plan (same flags as `plan`), run the top candidates (and micro-batch sizes around "
                                   "the planned one) for a few steps each on fresh torchrun processes, show predicted "
                                   "against measured step time, tokens/s and peak memory per rank, and save a "
                                   "calibration that later plans on this hardware use.")  # fmt: skip
    add_plan_arguments(t)
    add_tune_arguments(t)
    t.add_argument("--script", metavar="FILE", help="the training script (default: the reference transformer)")
    t.add_argument("--json", action="store_true", help="print one JSON object: trials, calibration, plan")

    r = sub.add_parser("rehearse", help="run one rank of a big plan in one process here: its real shards, measured",
                       description="Plan (same flags as `plan`), then rehearse ranks of the recommended candidate (or "
                                   "--candidate), each alone in a process of this machine with a fake process group of "
                                   "the plan's world size: the worker's own wrap and train step for that rank's "
                                   "coordinates, only its shards materialised, a few real steps; shows its parameter, "
                                   "gradient, optimizer-state, activation and peak bytes, its step time without "
                                   "communication and its collectives beside the plan's. The model is the plan's: "
                                   "--module, --hf-config, or the reference model of a preset's shape.")  # fmt: skip
    add_plan_arguments(r)
    add_rehearse_arguments(r)
    r.add_argument("--json", action="store_true", help="print one JSON object: candidate, notes, each rank's result")
    r.add_argument("--save", action="store_true",
                   help="save the rehearsed peak as this candidate's memory calibration: later plans of this shape on "
                        "this hardware use it (refused for a rehearsal on another device than the plan's)")  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jupyter-dist`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        from ..launch.scriptrun import cmd_launch
        from .commands import COMMANDS

        return {**COMMANDS, "launch": cmd_launch}[args.command](args)
    except JupyterDistError as exc:
        print(f"jupyter-dist {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `jupyter-dist plan | head`: the reader left; not an error worth a traceback
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second EPIPE at interpreter exit
        return 141
    except KeyboardInterrupt:  # Ctrl-C (a check or demo has already ended its processes): no traceback
        print(f"jupyter-dist {args.command}: interrupted", file=sys.stderr)
        return 130
