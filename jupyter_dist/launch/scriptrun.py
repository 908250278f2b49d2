"""``jupyter-dist launch SCRIPT [ARGS...]``: an existing training script on any back-end, from a terminal.

The same path as ``%dist_train --script SCRIPT -- ARGS`` (:func:`~.session.start_run` with ``script=``): the script
runs unmodified as every rank's ``__main__`` (one using ``jd`` or plain ``torch.distributed``), in a run directory
with the same Run handle, logs, exit codes and diagnosis. The command follows the run until it ends (Ctrl-C stops
it), printing what rank 0 prints as it goes (``--output``: :mod:`.output`), then the summary, and exits 0 when it
succeeded, 1 otherwise; ``--detach`` returns once it started
(``%dist_attach RUN_DIR`` follows it later), ``--dry-run`` prints what would run.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .base import BACKENDS, DEFAULT_BACKEND, backend_spec

__all__ = ["add_launch_arguments", "add_ship_arguments", "add_speed_arguments", "speed_fields", "cmd_launch",
           "split_script"]  # fmt: skip


def add_speed_arguments(p: Any) -> None:
    """``--no-fused``, ``--compile`` / ``--no-compile`` (``%%dist_train`` and ``jupyter-dist launch``; issue 31).

    Both are on by default on CUDA and off elsewhere (``jupyter_dist.worker._speed``); the flags force them.
    """
    p.add_argument("--no-fused", dest="fused", action="store_const", const="0",
                   help="keep a torch Adam/AdamW/SGD's default implementation (default: fused on CUDA; JD_FUSED=0)")
    p.add_argument("--compile", dest="compile", action="store_const", const="1",
                   help="torch.compile each repeated block (default: on CUDA, off elsewhere; JD_COMPILE=1)")
    p.add_argument("--no-compile", dest="compile", action="store_const", const="0",
                   help="run the blocks eager, also on CUDA (JD_COMPILE=0)")  # fmt: skip


def speed_fields(args: argparse.Namespace) -> dict[str, str]:
    """The :class:`~jupyter_dist.worker._env.WorkerEnv` fields the speed flags give (none: the defaults)."""
    return {name: value for name in ("fused", "compile") if (value := getattr(args, name, None)) is not None}


def add_ship_arguments(g: Any) -> None:
    """What travels with a cluster job (``%%dist_train`` and ``jupyter-dist launch``; see remote_env/project)."""
    g.add_argument(
        "--setup",
        metavar="CMDS",
        help="setup commands on each node after the shipped jupyter-dist wheel (replace the version pins)",
    )
    g.add_argument("--requirements", metavar="FILE", help="install this requirements file instead of the version pins")
    g.add_argument(
        "--image", metavar="IMAGE", help="SkyPilot image_id (e.g. docker:pytorch/pytorch:...): keep its packages"
    )
    g.add_argument(
        "--workdir",
        metavar="DIR",
        help="copy this project folder to the nodes (.skyignore/.gitignore honoured); cells import from it",
    )
    g.add_argument(
        "--workdir-limit",
        metavar="SIZE",
        default="1GB",
        help="refuse a --workdir bigger than this, naming the biggest files (default 1GB)",
    )
    g.add_argument(
        "--mount",
        action="append",
        default=[],
        metavar="DEST=SRC",
        help="mount a bucket on the nodes, e.g. /data=s3://bucket/path (repeatable)",
    )
    g.add_argument(
        "--steps",
        type=_positive,
        metavar="N",
        help="steps the run takes: the dry run estimates its cost (plan's step time x N x hourly price)",
    )
    g.add_argument(
        "--ship-env",
        action="store_true",
        help="SLURM: the nodes do not share this environment: install the wheel and pins on each",
    )


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write a whole number >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def split_script(line: str) -> tuple[str, str | None, tuple[str, ...]]:
    """``"--nproc 2 --script t.py -- --lr 1"`` -> ``("--nproc 2", "t.py", ("--lr", "1"))``.

    Every word after the script's name is the script's (a ``--`` right after it is dropped).
    """
    import shlex

    from ..errors import JupyterDistError

    try:
        argv = shlex.split(line)
    except ValueError as exc:
        raise JupyterDistError(f"%dist_train: {exc}") from None
    if "--script" not in argv:
        return line, None, ()
    i = argv.index("--script")
    if i + 1 >= len(argv):
        raise JupyterDistError("--script needs a file: %dist_train --script train.py [--] ARGS...")
    rest = argv[i + 2 :]
    return shlex.join(argv[:i]), argv[i + 1], tuple(rest[1:] if rest[:1] == ["--"] else rest)


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``jupyter-dist launch`` (the ``%dist_train`` flags that apply to a script).

    The parser adds ``--output`` from :mod:`jupyter_dist.cli.flags`, shared with the magic.
    """
    p.add_argument("script", help="the training script (run as __main__ on every rank)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script (after the script's name)")
    p.add_argument("--backend", choices=tuple(BACKENDS), default=DEFAULT_BACKEND, help="where it runs")
    p.add_argument("--nproc", type=int, help="processes per node (default: local GPU count, else 2)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--strategy", default="none", help="JD_STRATEGY for scripts using jd (default none)")
    p.add_argument("--name", default="launch", help="run directory name (default launch)")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="environment for the workers")
    p.add_argument("--oversubscribe", action="store_true",
                   help="start more local ranks than the machine holds (one per GPU, else 4 per CPU core)")  # fmt: skip
    p.add_argument("--runs-dir", default="runs", help="where run directories go (default ./runs)")
    p.add_argument("--timeout", type=float, help="stop the run after this many seconds")
    p.add_argument("--dry-run", action="store_true", help="print what would run; start nothing")
    p.add_argument("--detach", action="store_true", help="return once the run started")
    add_speed_arguments(p)
    g = p.add_argument_group("clusters (see %%dist_train --help)")
    for flag in ("--partition", "--account", "--gpus", "--cluster", "--infra", "--checkpoint-dir"):
        g.add_argument(flag)
    g.add_argument("--time", dest="time_limit")
    g.add_argument("--idle-minutes", type=int)
    for flag in ("--spot", "--down", "--managed"):
        g.add_argument(flag, action="store_true")
    g.add_argument("--secret", action="append", default=[], metavar="NAME")
    add_ship_arguments(g)


def cmd_launch(args: argparse.Namespace) -> int:
    """Start the script, follow it to the end (unless ``--detach``), print the summary; 0 when it succeeded."""
    from ..errors import JupyterDistError
    from .backends.cluster import ClusterOptions
    from .options import RunOptions
    from .session import start_run

    script_args = list(args.args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    env: dict[str, str] = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise JupyterDistError(f"--env wants NAME=VALUE, got {item!r}")
        env[key] = value
    cluster: Any = None
    if backend_spec(args.backend).cluster:
        cluster = ClusterOptions(
            partition=args.partition, account=args.account, time_limit=args.time_limit, gpus=args.gpus,
            cluster=args.cluster, infra=args.infra, spot=args.spot, idle_minutes=args.idle_minutes, down=args.down,
            managed=args.managed, secrets=tuple(args.secret), setup=args.setup, checkpoint_dir=args.checkpoint_dir,
            requirements=args.requirements, image=args.image, workdir=args.workdir, workdir_limit=args.workdir_limit,
            mounts=tuple(args.mount), ship_env=args.ship_env, steps=args.steps,
        )  # fmt: skip
    options = RunOptions(script=args.script, script_args=tuple(script_args), nproc=args.nproc, nodes=args.nodes,
                         strategy=args.strategy, name=args.name, timeout=args.timeout, env=env,
                         runs_dir=args.runs_dir, dry_run=args.dry_run, backend=args.backend, cluster=cluster,
                         output="none" if args.detach else args.output, oversubscribe=args.oversubscribe,
                         worker=speed_fields(args))  # fmt: skip
    result = start_run("", options)
    if args.dry_run:
        print(result.to_text())  # type: ignore[union-attr]
        return 0
    run: Any = result
    print(f"run directory: {run.dir}", flush=True)
    if args.detach:
        return 0
    try:
        status = run.wait()
    except KeyboardInterrupt:
        status = run.stop()
    shown = run.shown_output
    if shown is not None:  # rank output followed live: its last lines before the summary
        shown.wait(30.0)
    print(run.summary())
    if status != "succeeded":
        failing = next((r for r, c in sorted((run.exit_codes or {}).items()) if c), 0)
        if shown is None or failing not in shown.ranks or shown.dropped.get(failing):
            sys.stdout.write(run.logs(failing)[-3000:])
    return 0 if status == "succeeded" else 1
