"""IPython magics: thin wrappers that parse a line, call the layers and display the result.

``%dist_plan`` takes exactly the flags of ``jupyter-dist plan`` (one shared definition in
:mod:`jupyter_dist.cli.flags`).

One piece (about 700 lines): :class:`DistMagics` is one IPython ``Magics`` class whose magics share its state (the
last run that ``%dist_status``/``%dist_stop`` act on, the runs folder); the pool's magics (:mod:`.pool`) and the line
parser (:mod:`.args`) are apart.
"""

from __future__ import annotations

import argparse
from typing import Any

import traitlets
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import MagicArgumentParser

from ..cli.flags import (
    MAX_COUNT,
    MAX_LOCAL_NPROC,
    MAX_SECONDS,
    add_output_argument,
    add_plan_arguments,
    float_arg,
    int_arg,
    plan_from_args,
)
from ..errors import JupyterDistError
from ..launch.base import BACKENDS, CLUSTER_BACKENDS, DEFAULT_BACKEND, backend_spec
from .args import parse_magic_line, strip_comment

__all__ = ["DistMagics", "load_ipython_extension", "unload_ipython_extension"]


def _plan_parser() -> MagicArgumentParser:
    parser = MagicArgumentParser(  # type: ignore[no-untyped-call]
        prog="%dist_plan",
        add_help=False,
        description="Plan distributed training: which strategy, will it fit, how fast, why.",
    )
    add_plan_arguments(parser)
    return parser


def _train_parser() -> MagicArgumentParser:
    from ..launch.session import STRATEGY_CHOICES

    p = MagicArgumentParser(  # type: ignore[no-untyped-call]
        prog="%%dist_train",
        add_help=False,
        description="Run the cell as a distributed training script on fresh torchrun processes.",
    )
    p.add_argument(
        "--nproc", type=int_arg(1, MAX_LOCAL_NPROC), help="processes per node (default: local GPU count, else 2)"
    )
    p.add_argument(
        "--nodes", type=int_arg(1, 1024), default=1, help="nodes (locally: simulated torchrun agents; default 1)"
    )
    p.add_argument("--strategy", default="auto",
                   help=f"one of {', '.join(STRATEGY_CHOICES)} or a candidate name the planner prints, e.g. "
                        "fsdp2+tp2+sp (default auto: the plan's recommended candidate)")  # fmt: skip
    p.add_argument(
        "--plan",
        metavar="VAR",
        help="a Plan object from the notebook (sets the candidate with its degrees, precision, configs)",
    )
    for dim, what in (("tp", "tensor-parallel"), ("pp", "pipeline"), ("cp", "context-parallel"),
                      ("ep", "expert-parallel")):  # fmt: skip
        p.add_argument(f"--{dim}", type=int_arg(1, 1024), metavar="N",
                       help=f"{what} degree (overrides the strategy's/plan's)")  # fmt: skip
    p.add_argument(
        "--sp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sequence parallelism with tensor parallelism (--no-sp turns a candidate's off)",
    )
    p.add_argument("--launcher", default="torchrun", help="torchrun (default), deepspeed or accelerate")
    p.add_argument("--name", metavar="NAME", help="bind the Run to this notebook variable (and name the run dir)")
    p.add_argument("--ship", metavar="VAR[,VAR...]", help="send notebook objects to the workers (cloudpickle)")
    p.add_argument("--no-auto-ship", action="store_true",
                   help="send only --ship names (default: also the kernel's functions, classes and small values the "
                        "cell uses)")  # fmt: skip
    p.add_argument("--max-restarts", type=int_arg(0, 1000), default=0, help="torchrun --max-restarts (default 0)")
    p.add_argument(
        "--timeout", type=float_arg(0.0, MAX_SECONDS, lo_open=True), help="stop the run after this many seconds"
    )
    p.add_argument("--env", action="append", default=[], metavar="K=V",
                   help="environment for the workers (not RANK, WORLD_SIZE, MASTER_PORT, ...: the launcher's)")
    p.add_argument("--port", type=int_arg(1024, 65535),
                   help="rendezvous / master port, also on one node (default: a free one)")  # fmt: skip
    p.add_argument("--oversubscribe", action="store_true",
                   help="start more local ranks than the machine holds (one per GPU, else 4 per CPU core)")  # fmt: skip
    p.add_argument("--runs-dir", help="where run directories go (default: the DistMagics.runs_dir setting)")
    p.add_argument("--wait", action="store_true", help="block until the run ends, then show its summary")
    p.add_argument("--dry-run", action="store_true", help="show script, configs and commands; run nothing")
    p.add_argument("--no-dashboard", action="store_true", help="do not show live panels under the cell")
    add_output_argument(p)
    p.add_argument("--log-to", metavar="SINKS",
                   help="forward the run's metrics from this kernel to tensorboard,wandb,mlflow,trackio "
                        "(comma-separated; credentials by name with --secret)")  # fmt: skip
    p.add_argument(
        "--telemetry-interval",
        type=float_arg(0.0, 3600.0),
        metavar="S",
        help="seconds between the ranks' writes of their jd.log calls (default 1; 0: each call); every call is kept",
    )
    p.add_argument(
        "--heartbeat", type=float_arg(0.0, 3600.0), metavar="S", help="seconds between heartbeats (default 2; 0: off)"
    )
    p.add_argument(
        "--checkpoint-every",
        type=int_arg(1, MAX_COUNT),
        metavar="N",
        help="jd.checkpoint(state, step) saves every N steps (JD_CHECKPOINT_EVERY)",
    )
    p.add_argument("--keep", type=int_arg(1, 10**6), metavar="K", help="keep the newest K checkpoints (JD_KEEP)")
    p.add_argument(
        "--async-save",
        action="store_true",
        help="jd.checkpoint writes in the background while training goes on (JD_ASYNC_SAVE=1)",
    )
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a stopped run: jd.resume() loads (and jd.save writes) RUN_DIR/checkpoints",
    )
    p.add_argument(
        "--profile",
        metavar="STEPS",
        help="torch.profiler trace per rank of steps START:STOP (e.g. 5:8: steps 5-7) or one STEP; run.profile() "
        "summarises it",
    )
    p.add_argument(
        "--hang-timeout",
        type=float_arg(0.0, MAX_SECONDS, lo_open=True),
        metavar="S",
        help="stop the run with a diagnosis when no rank logs a step for S seconds (default: off)",
    )
    from ..launch.scriptrun import add_speed_arguments

    add_speed_arguments(p)
    _add_cluster_arguments(p)
    return p


def _add_cluster_arguments(p: MagicArgumentParser) -> None:
    """``--backend slurm|skypilot`` and the options of each (see jupyter_dist.launch.backends.cluster)."""
    p.add_argument("--backend", choices=tuple(BACKENDS),
                   help="where the job runs: local torchrun (default: the DistMagics.default_backend setting), a "
                        "SLURM cluster (sbatch) or SkyPilot")  # fmt: skip
    g = p.add_argument_group("SLURM (--backend slurm)")
    g.add_argument("--partition", help="SLURM partition (default: the cluster's default)")
    g.add_argument("--account", help="SLURM account to charge")
    g.add_argument("--time", dest="time_limit", metavar="T", help="SLURM time limit, HH:MM:SS or D-HH:MM:SS")
    g = p.add_argument_group("SkyPilot (--backend skypilot)")
    g.add_argument("--gpus", metavar="NAME:N", help="accelerators per node, e.g. H100:8 (default: CPU processes)")
    g.add_argument("--cluster", help="SkyPilot cluster name (reused when it is up; default jd-<name>)")
    g.add_argument("--infra", "--cloud", dest="infra", metavar="INFRA",
                   help="aws, gcp/us-central1, kubernetes, slurm, ... (default: SkyPilot chooses)")  # fmt: skip
    g.add_argument("--spot", action="store_true", help="spot / preemptible instances")
    g.add_argument(
        "--idle-minutes", type=int_arg(0, 10**6), metavar="N", help="autostop the cluster after N idle minutes"
    )
    g.add_argument("--down", action="store_true", help="tear the cluster down when the job ends (or at autostop)")
    g.add_argument(
        "--managed",
        action="store_true",
        help="managed job: recovers from preemption, resumes from checkpoints keyed on the task id",
    )
    from ..launch.scriptrun import add_ship_arguments

    add_ship_arguments(g)
    g.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="checkpoint root on the nodes (e.g. a bucket mount); the job's folder is keyed on its task id",
    )
    p.add_argument(
        "--secret",
        action="append",
        default=[],
        metavar="NAME",
        help="pass this environment variable's value by name (never written to files): to a cluster job, and to the "
        "--log-to sinks, which read it in this kernel",
    )


def _check_parser() -> MagicArgumentParser:
    from ..cli.flags import add_check_arguments

    p = MagicArgumentParser(  # type: ignore[no-untyped-call]
        prog="%dist_check",
        add_help=False,
        description="Preflight: versions, correctness and collective bandwidth on fresh ranks, with a verdict.",
    )
    add_check_arguments(p)
    p.add_argument("--plan", metavar="VAR", help="compare with this Plan's hardware")
    return p


def _wizard_parser() -> MagicArgumentParser:
    p = MagicArgumentParser(  # type: ignore[no-untyped-call]
        prog="%dist_wizard",
        add_help=False,
        description="The strategy wizard, its controls preset from the flags of %dist_plan.",
    )
    add_plan_arguments(p)
    w = p.add_argument_group("wizard")
    w.add_argument(
        "--model-var",
        metavar="VAR",
        help="an nn.Module (or a class / factory) from the notebook, measured on the meta device",
    )
    w.add_argument(
        "--plan-var",
        default="wizard_plan",
        metavar="VAR",
        help="notebook variable Launch binds the plan to (default wizard_plan)",
    )
    return p


def _runs_parser() -> MagicArgumentParser:
    p = MagicArgumentParser(  # type: ignore[no-untyped-call]
        prog="%dist_runs", add_help=False, description="The runs under a runs folder as a sortable, filterable table."
    )
    p.add_argument("folder", nargs="?", help="the runs folder (default: the DistMagics.runs_dir setting)")
    p.add_argument("--sort", default="started", metavar="COL", help="column to sort by; -COL for descending")
    p.add_argument("--filter", dest="text", metavar="TEXT", help="keep runs whose name, strategy, status, tags or "
                   "notes contain TEXT")  # fmt: skip
    p.add_argument("--tag", help="keep runs with this tag")
    p.add_argument("--status", help="keep runs with this status (running, succeeded, failed, ...)")
    p.add_argument("--table", action="store_true", help="show the HTML table, not the widget")
    return p


def _tune_parser() -> MagicArgumentParser:
    from ..cli.flags import add_tune_arguments

    p = MagicArgumentParser(  # type: ignore[no-untyped-call]
        prog="%dist_tune",
        add_help=False,
        description="Measure the plan's top candidates for a few steps each; return the best measured as a Plan.",
    )
    add_plan_arguments(p)
    add_tune_arguments(p)
    p.add_argument("--plan-var", dest="plan_var", metavar="VAR", help="tune this Plan from the notebook")
    p.add_argument("--name", metavar="VAR", help="bind the TuneResult (trials, calibration) to this variable")
    return p


def _rehearse_parser() -> MagicArgumentParser:
    from ..cli.flags import add_rehearse_arguments

    p = MagicArgumentParser(  # type: ignore[no-untyped-call]
        prog="%dist_rehearse",
        add_help=False,
        description="Rehearse ranks of a plan candidate here, each alone in a process with a fake process group: its "
                    "real shards, activations and collectives, beside the plan's figures.",
    )  # fmt: skip
    add_plan_arguments(p)
    add_rehearse_arguments(p)
    p.add_argument("--plan-var", dest="plan_var", metavar="VAR", help="rehearse this Plan from the notebook")
    p.add_argument("--model-var", dest="model_var", metavar="VAR",
                   help="the model: a class or factory from the notebook (default: the plan's)")  # fmt: skip
    p.add_argument("--name", metavar="VAR", help="bind the Rehearsal to this variable")
    p.add_argument("--save", action="store_true",
                   help="save the rehearsed peak as this candidate's memory calibration: later plans of this shape "
                        "on this hardware use it")  # fmt: skip
    return p


def _rank_parser() -> MagicArgumentParser:
    p = MagicArgumentParser(prog="%dist_logs", add_help=False)  # type: ignore[no-untyped-call]
    p.add_argument("--rank", type=int_arg(0, MAX_COUNT), help="rank to show (default: the failing rank, else 0)")
    p.add_argument("--tail", type=int_arg(0, MAX_COUNT), help="only the last N lines")
    p.add_argument("run", nargs="?", help="a Run variable (default: the last run)")
    return p


@magics_class
class DistMagics(Magics):
    """The jupyter-dist magics."""

    runs_dir = traitlets.Unicode("runs", help="Folder for run directories.").tag(config=True)
    default_backend = traitlets.Enum(
        list(BACKENDS), DEFAULT_BACKEND, help="Back-end of %%dist_train when --backend is not given."
    ).tag(config=True)
    dashboard = traitlets.Enum(
        ["auto", "on", "off"],
        "auto",
        help="Live panels under %%dist_train: auto (when a kernel with widgets runs the notebook), on, off.",
    ).tag(config=True)
    plan_parser = _plan_parser()
    train_parser = _train_parser()
    logs_parser = _rank_parser()
    check_parser = _check_parser()
    runs_parser = _runs_parser()
    wizard_parser = _wizard_parser()
    tune_parser = _tune_parser()
    rehearse_parser = _rehearse_parser()

    def __init__(self, shell: Any = None, **kwargs: Any) -> None:
        super().__init__(shell, **kwargs)
        self.last_run: Any = None
        self.last_tune: Any = None

    def _parse(self, parser: MagicArgumentParser, line: str) -> Any:
        return parse_magic_line(parser, line)

    @line_cell_magic
    def dist_train(self, line: str, cell: str | None = None) -> Any:
        """Run the cell as a distributed training job on fresh processes (torchrun), without blocking the kernel.

        Inside the cell the worker API is bound as ``jd`` (``jd.rank``, ``jd.wrap``, ``jd.log``, ``jd.save``).
        ``--backend slurm`` submits it to a SLURM cluster (sbatch), ``--backend skypilot`` launches it through
        SkyPilot; the Run, its logs, metrics and panels are the same. ``%%dist_train --help`` lists the options.

        Examples
        --------
        ::

            In [1]: %load_ext jupyter_dist
            In [2]: %%dist_train --nproc 2 --strategy fsdp2 --name run1
               ...: model, opt = jd.wrap(build_model(), None)
            In [3]: run1.wait(); run1.metrics().tail()
            In [4]: %%dist_train --backend slurm --nodes 2 --nproc 8 --partition gpu --time 04:00:00 --name run2
               ...: ...
            In [5]: %%dist_train --backend skypilot --nodes 4 --gpus H100:8 --infra aws --down --secret HF_TOKEN
               ...: ...
            In [6]: %dist_train --nproc 2 --script train.py -- --epochs 3

            In [7]: %%dist_train --nproc 2 --log-to tensorboard,wandb --secret WANDB_API_KEY
               ...: trainer = transformers.Trainer(model=model, args=args, train_dataset=ds)  # logs to jd by itself
               ...: trainer.train()

            In [8]: %%dist_train --nproc 4 --output all     # every rank's prints under the cell (default: rank 0)
               ...: print(f"rank {jd.rank} starts")

        What the ranks print appears under the panels as ``[rank0] ...`` lines while the run goes (at most 50
        lines/s; ``run.logs(k)`` keeps every line).

        ``%dist_train ... --script FILE [--] ARGS...`` (one ``%``) runs an existing script instead of a cell; every
        word after FILE is the script's.
        """
        from ..launch.scriptrun import split_script

        try:
            line, script_file, script_args = split_script(line)
        except JupyterDistError as exc:
            raise UsageError(str(exc)) from None
        if script_file is None and cell is None:
            raise UsageError("%dist_train (one %) runs a script: %dist_train --script train.py [ARGS]; "
                             "%%dist_train runs the cell")  # fmt: skip
        if script_file is not None and cell is not None and cell.strip():
            raise UsageError("--script runs a file: use %dist_train (one %), or drop --script to run the cell")
        args = self._parse(self.train_parser, line)
        if args is None:
            return None
        from ..launch.session import RunOptions, start_run

        ns = self.shell.user_ns if self.shell is not None else {}
        plan = None
        if args.plan:
            if args.plan not in ns:
                raise UsageError(f"--plan {args.plan}: no variable of that name in the notebook")
            plan = ns[args.plan]
        ship: dict[str, Any] = {}
        for name in filter(None, (args.ship or "").split(",")):
            name = name.strip()
            if not name.isidentifier():
                raise UsageError(f"--ship: {name!r} is not a variable name")
            if name not in ns:
                raise UsageError(f"--ship {name}: no variable of that name in the notebook")
            ship[name] = ns[name]
        if cell and cell.strip() and not getattr(args, "no_auto_ship", False):
            from ..launch.autoship import auto_ship

            shipping = auto_ship(cell, ns, shipped=set(ship))
            ship.update(shipping.objects)
            if shipping.line():
                print(shipping.line())
        env: dict[str, str] = {}
        for item in args.env:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise UsageError(f"--env wants NAME=VALUE, got {item!r}")
            env[key] = value
        if args.name is not None and not args.name.isidentifier():
            raise UsageError(f"--name {args.name!r} must be a valid Python variable name (the Run is bound to it)")
        worker: dict[str, Any] = {}  # WorkerEnv fields: start_run writes them as JD_* (WorkerEnv.to_environ)
        for flag, value, fld in (("--checkpoint-every", args.checkpoint_every, "checkpoint_every"),
                                 ("--keep", args.keep, "keep")):  # fmt: skip
            if value is None:
                continue
            if value < 1:
                raise UsageError(f"{flag} must be >= 1, got {value}")
            worker[fld] = value
        if args.async_save:
            worker["async_save"] = True
        from ..launch.scriptrun import speed_fields

        worker.update(speed_fields(args))
        if args.profile is not None:
            from ..worker._profile import parse_window

            try:
                start, stop = parse_window(args.profile.strip("'\""))
            except JupyterDistError as exc:
                raise UsageError(f"--profile: {exc}") from None
            worker["profile"] = f"{start}:{stop}"
        if args.resume:
            from pathlib import Path

            old = Path(args.resume.strip("'\"")).expanduser().resolve()
            if not (old / "run.json").exists():
                raise UsageError(f"--resume {args.resume}: not a jupyter-dist run directory (no run.json)")
            env.setdefault("JD_CHECKPOINT_DIR", str(old / "checkpoints"))
        for flag, value, fld in (("--telemetry-interval", args.telemetry_interval, "telemetry_interval_s"),
                                 ("--heartbeat", args.heartbeat, "heartbeat_s")):  # fmt: skip
            if value is None:
                continue
            if not value >= 0:
                raise UsageError(f"{flag} must be >= 0 seconds, got {value}")
            worker[fld] = float(value)
        backend = args.backend or self.default_backend
        if args.nproc is not None:  # a rank the run will not have: refused before it starts
            try:
                args.output.resolve(args.nproc * args.nodes)
            except JupyterDistError as exc:
                raise UsageError(str(exc)) from None
        try:
            options = RunOptions(
                script=script_file, script_args=script_args, nproc=args.nproc, nodes=args.nodes,
                strategy=args.strategy, plan=plan, launcher=args.launcher, name=args.name or "run", ship=ship,
                max_restarts=args.max_restarts, timeout=args.timeout, env=env, runs_dir=args.runs_dir or self.runs_dir,
                port=args.port, dry_run=args.dry_run, hang_timeout=args.hang_timeout, backend=backend,
                cluster=self._cluster_options(args, backend), tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
                sp=args.sp, worker=worker, log_to=args.log_to, secrets=tuple(args.secret) if args.log_to else (),
                output="none", oversubscribe=args.oversubscribe,  # the ranks' prints are shown below the panels
            )  # fmt: skip
            result = start_run(cell or "", options)
        except JupyterDistError as exc:
            raise UsageError(str(exc)) from None
        if args.dry_run:
            return result
        for note in result.notes[1:]:  # the mesh is on the card; a rehearsal is said once, here
            print(note)
        self.last_run = result
        if args.name:
            ns[args.name] = result
        if not args.no_dashboard and self._want_dashboard():
            try:
                result.show_dashboard(interval=0.5)  # its status line replaces the card
            except JupyterDistError as exc:  # e.g. anywidget missing: say how to get the panels, keep the run
                print(f"(no live panels: {exc})")
        try:  # the ranks' prints under the panels (after them, so the panels stay at the top of the cell)
            result.show_output(args.output)
        except JupyterDistError as exc:  # a rank the run does not have (--nproc left to the machine)
            print(f"(no output shown: {exc})")
        if args.wait and hasattr(result, "wait"):
            result.wait()
            if result.shown_output is not None:
                result.shown_output.wait(30.0)
            if result.shown_dashboard is not None:
                result.shown_dashboard.finished.wait(10.0)
                if args.profile is not None:  # the panels replaced the card: show the profile summary here
                    from IPython.display import display

                    try:
                        display(result.profile())
                    except JupyterDistError as exc:
                        print(f"(no profile summary: {exc})")
        return result

    @staticmethod
    def _cluster_options(args: Any, backend: str) -> Any:
        """The cluster flags as a ClusterOptions (``None`` for a local run, which refuses them)."""
        given = [f for f, v in (("--partition", args.partition), ("--account", args.account),
                                ("--time", args.time_limit), ("--gpus", args.gpus), ("--cluster", args.cluster),
                                ("--infra", args.infra), ("--spot", args.spot), ("--idle-minutes", args.idle_minutes),
                                ("--down", args.down), ("--managed", args.managed), ("--setup", args.setup),
                                ("--checkpoint-dir", args.checkpoint_dir), ("--requirements", args.requirements),
                                ("--image", args.image), ("--workdir", args.workdir), ("--mount", args.mount),
                                ("--ship-env", args.ship_env), ("--steps", args.steps),
                                ("--secret", [] if args.log_to else args.secret))  # --log-to's sinks read them here
                 if v not in (None, False, [])]  # fmt: skip
        if not backend_spec(backend).cluster:
            if given:
                raise JupyterDistError(f"{', '.join(given)} need --backend {' or '.join(CLUSTER_BACKENDS)}")
            return None
        from ..launch.backends.cluster import ClusterOptions

        return ClusterOptions(
            partition=args.partition, account=args.account, time_limit=args.time_limit, gpus=args.gpus,
            cluster=args.cluster, infra=args.infra, spot=args.spot, idle_minutes=args.idle_minutes, down=args.down,
            managed=args.managed, secrets=tuple(args.secret), setup=args.setup, checkpoint_dir=args.checkpoint_dir,
            max_restarts_on_errors=args.max_restarts if args.managed else 0, requirements=args.requirements,
            image=args.image, workdir=args.workdir, workdir_limit=args.workdir_limit, mounts=tuple(args.mount),
            ship_env=args.ship_env, steps=args.steps,
        )  # fmt: skip

    def _want_dashboard(self) -> bool:
        if self.dashboard != "auto":
            return self.dashboard == "on"
        return getattr(self.shell, "kernel", None) is not None

    def _run_arg(self, name: str | None) -> Any:
        if name:
            ns = self.shell.user_ns if self.shell is not None else {}
            if name not in ns:
                raise UsageError(f"no variable {name!r} in the notebook")
            return ns[name]
        if self.last_run is None:
            raise UsageError("no run yet in this kernel: start one with %%dist_train, or %dist_attach RUN_DIR")
        return self.last_run

    def orphans_notice(self, folder: str | None = None) -> str:
        """The runs under ``folder`` (default: the runs folder) an earlier kernel left running, as lines to print.

        Never raises: a runs folder that cannot be read says nothing (loading the extension must not fail on it).
        """
        from ..launch.runs import orphans, orphans_notice

        try:
            return orphans_notice(orphans(folder if folder is not None else self.runs_dir))
        except Exception:  # noqa: BLE001 - a notice, never an error
            return ""

    @line_magic
    def dist_runs(self, line: str) -> Any:
        """The runs under the runs folder: a table to sort, filter, open and compare (``jupyter_dist.runs()``).

        Examples
        --------
        ::

            In [1]: %dist_runs
            In [2]: %dist_runs runs --sort best_loss --filter fsdp2 --status succeeded
            In [3]: t = %dist_runs --table
            In [4]: t.open(0)                      # the newest run's panels
        """
        args = self._parse(self.runs_parser, line)
        if args is None:
            return None
        from ..launch.runs import runs

        folder = args.folder.strip("'\"") if args.folder else self.runs_dir
        notice = self.orphans_notice(folder)
        if notice:  # runs an earlier kernel left running: said above the table, with how to attach or stop them
            print(notice)
        try:
            table = runs(folder)
            if args.text:
                table = table.filter(text=args.text.strip("'\""))
            if args.tag:
                table = table.filter(tag=args.tag.strip("'\""))
            if args.status:
                table = table.filter(status=args.status.strip("'\""))
            table = table.sort(args.sort)
            if not args.table and self._want_dashboard():
                return table.widget()
        except JupyterDistError as exc:
            raise UsageError(str(exc)) from None
        return table

    @line_magic
    def dist_status(self, line: str) -> Any:
        """Show the status card of the last run (or of the Run variable named on the line)."""
        return self._run_arg(strip_comment(line).strip() or None)

    @line_magic
    def dist_logs(self, line: str) -> None:
        """Print a rank's log: ``%dist_logs [--rank K] [--tail N] [RUN]`` (default: the failing rank, else 0)."""
        args = self._parse(self.logs_parser, line)
        if args is None:
            return
        run = self._run_arg(args.run)
        try:
            print(run.logs(args.rank, tail=args.tail))
        except JupyterDistError as exc:
            raise UsageError(str(exc)) from None

    @line_magic
    def dist_stop(self, line: str) -> Any:
        """Stop the last run (or the Run variable named on the line): every worker process ends.

        ``%dist_stop --pool`` ends the interactive pool of ``%dist_start``; so does a bare ``%dist_stop`` while a pool
        runs and no run does (with both live it asks which).
        """
        from .pool import route_stop

        line = strip_comment(line)
        pool = route_stop(self.shell, line, self.last_run)
        if pool is not None:
            return pool
        run = self._run_arg(line.strip() or None)
        run.stop()
        return run

    @line_magic
    def dist_attach(self, line: str) -> Any:
        """Reopen a run after a kernel restart: ``%dist_attach RUN_DIR`` or, for SkyPilot, ``%dist_attach CLUSTER/JOB``.

        A run directory's ``run.json`` names its back-end: a SLURM or SkyPilot job still running is followed again
        (status, logs, metrics, dashboard). ``CLUSTER/JOB`` finds the run directory of that SkyPilot job under the
        runs folder, or makes one that follows the job's logs.
        """
        from pathlib import Path

        from ..launch.run import open_run

        path = strip_comment(line).strip().strip('"').strip("'")
        if not path:
            raise UsageError("usage: %dist_attach RUN_DIR  or  %dist_attach CLUSTER/JOB (SkyPilot)")
        try:
            run = None
            if not Path(path).expanduser().exists():  # a back-end's own reference (SkyPilot's CLUSTER/JOB)?
                from ..launch.base import attach_ref

                run = attach_ref(path, runs_dir=self.runs_dir)
            if run is None:
                run = open_run(path)
        except JupyterDistError as exc:
            raise UsageError(str(exc)) from None
        self.last_run = run
        return run

    @line_magic
    def dist_check(self, line: str) -> Any:
        """Preflight the communication: ``%dist_check [--nproc N] [--sizes 1K,1M,16M] [--gpu h100-80gb] [--json]``.

        Returns a report (verdict healthy / degraded / broken, with the evidence) that displays as a table.
        """
        args = self._parse(self.check_parser, line)
        if args is None:
            return None
        from ..cli.flags import check_from_args

        plan = None
        if args.plan:
            ns = self.shell.user_ns if self.shell is not None else {}
            if args.plan not in ns:
                raise UsageError(f"--plan {args.plan}: no variable of that name in the notebook")
            plan = ns[args.plan]
        if args.runs_dir == "runs":
            args.runs_dir = self.runs_dir
        try:
            report = check_from_args(args, plan=plan)
        except JupyterDistError as exc:
            raise UsageError(str(exc)) from None
        if args.json:
            import json

            print(json.dumps(report.to_dict(), indent=2))  # type: ignore[attr-defined]
            return None
        return report

    @line_magic
    def dist_plan(self, line: str) -> Any:
        """Plan distributed training and show per-GPU memory, speed and the recommendation.

        Takes the flags of ``jupyter-dist plan`` (``%dist_plan --help`` lists them); returns the
        :class:`~jupyter_dist.plan.Plan`, which displays itself as a table (memory in GiB).

        Examples
        --------
        ::

            In [1]: %load_ext jupyter_dist
            In [2]: %dist_plan --model llama-2-7b --gpu h100-80gb --nodes 2 --seq-len 4096
            In [3]: p = %dist_plan --hf-config "./my model/config.json" --checkpointing selective
            In [4]: p.best.memory.total
        """
        args = self._parse(self.plan_parser, line)
        if args is None:  # --help was printed
            return None
        try:
            return plan_from_args(args)
        except JupyterDistError as exc:
            raise UsageError(str(exc)) from None

    @line_cell_magic
    def dist_tune(self, line: str, cell: str | None = None) -> Any:
        """Measure the plan's top candidates on this hardware, side by side with the plan; returns the best as a Plan.

        Takes the flags of ``%dist_plan`` (or ``--plan-var VAR``) plus ``--top``, ``--candidates``,
        ``--micro-batches``, ``--steps`` and ``--options compile,fused,fp8`` (each speed option measured on and off,
        like any other choice; the returned Plan carries the best trial's); as a cell magic the cell is the training
        script (it reads ``JD_MICRO_BATCH``, ``JD_SEQ_LEN``, ``JD_TUNE_STEPS``), as a line magic the reference
        transformer of the plan's shape is trained. Saves a calibration that later ``%dist_plan`` calls on this
        hardware use.

        Examples
        --------
        ::

            In [1]: best = %dist_tune --model gpt2 --gpu cpu --gpus-per-node 2 --seq-len 64 --top 3
            In [2]: %%dist_tune --plan-var p --micro-batches 1,2,4 --name trials
               ...: ...training cell...
        """
        args = self._parse(self.tune_parser, line)
        if args is None:  # --help was printed
            return None
        from ..cli.flags import tune_from_args

        ns = self.shell.user_ns if self.shell is not None else {}
        plan = None
        if args.plan_var:
            if args.plan_var not in ns:
                raise UsageError(f"--plan-var {args.plan_var}: no variable of that name in the notebook")
            plan = ns[args.plan_var]
        if args.name is not None and not args.name.isidentifier():
            raise UsageError(f"--name {args.name!r} must be a valid Python variable name")
        from IPython.display import display

        handle: Any = None

        def show(result: Any) -> None:  # the table and chart, redrawn as each trial finishes
            nonlocal handle
            if handle is None:
                handle = display(result, display_id=True)
            else:
                handle.update(result)

        try:
            result = tune_from_args(args, plan=plan, code=cell, runs_dir=self.runs_dir, on_trial=show)
        except JupyterDistError as exc:
            raise UsageError(str(exc)) from None
        self.last_tune = result
        if args.name:
            ns[args.name] = result
        return result.plan

    @line_magic
    def dist_rehearse(self, line: str) -> Any:
        """Rehearse ranks of a big plan on this machine, one process each; returns a :class:`Rehearsal`.

        Takes the flags of ``%dist_plan`` (or ``--plan-var VAR``) plus ``--candidate`` (default the recommended),
        ``--ranks`` (default the first rank of the first and the last pipeline stage), ``--steps``, ``--device``,
        ``--save`` (the rehearsed peak calibrates this candidate's memory in later plans of the same shape);
        the model is ``--model-var VAR`` (a class or factory of the notebook), else the plan's own (``--module``,
        ``--hf-config``, or the reference model of a preset's shape). Each rank runs alone with a fake process
        group of the plan's world size: ``jd.wrap`` and ``jd.train_step`` for its coordinates, only its shards
        materialised; the result sets its bytes, step time and collectives beside the plan's.

        Examples
        --------
        ::

            In [1]: r = %dist_rehearse --model llama-3-8b --nodes 8 --strategy fsdp2 --seq-len 256 --precision fp32
            In [2]: %dist_rehearse --plan-var p --candidate fsdp2+tp8 --ranks 0,7 --model-var MyModel
        """
        args = self._parse(self.rehearse_parser, line)
        if args is None:  # --help was printed
            return None
        ns = self.shell.user_ns if self.shell is not None else {}
        for flag, var in (("--plan-var", args.plan_var), ("--model-var", args.model_var)):
            if var is not None and var not in ns:
                raise UsageError(f"{flag} {var}: no variable of that name in the notebook")
        if args.name is not None and not args.name.isidentifier():
            raise UsageError(f"--name {args.name!r} must be a valid Python variable name")
        from ..launch.rehearse import rehearse

        def progress(rank: Any) -> None:  # a line per finished rank
            print(f"rank {rank.rank}: " + ("rehearsed" if rank.ok else f"could not be rehearsed: {rank.error}"),
                  flush=True)  # fmt: skip

        try:
            ranks = [int(v) for v in args.ranks.split(",") if v.strip()] if args.ranks else None
        except ValueError:
            raise UsageError(f"--ranks wants comma-separated integers, got {args.ranks!r}") from None
        try:
            plan = ns[args.plan_var] if args.plan_var else plan_from_args(args)
            model = ns[args.model_var] if args.model_var else (args.module or args.hf_config or None)
            result = rehearse(plan, args.candidate, model=model, ranks=ranks, steps=args.steps, device=args.device,
                              timeout=args.rank_timeout, workdir=args.workdir, on_rank=progress)  # fmt: skip
        except JupyterDistError as exc:
            raise UsageError(str(exc)) from None
        if args.name:
            ns[args.name] = result
        if args.save:  # consent given: this candidate's memory in later plans of this shape is the rehearsed peak
            try:
                result.save_calibration()
            except JupyterDistError as exc:  # the rehearsal is still shown: it took its minutes
                from IPython.display import display

                display(result)
                raise UsageError(str(exc)) from None
        return result

    @line_magic
    def dist_wizard(self, line: str) -> Any:
        """Show the strategy wizard: controls that re-plan on every change, configs, what-if and Launch.

        Takes the flags of ``%dist_plan`` as the controls' starting values, plus ``--model-var VAR`` for a model
        object from the notebook; returns the :class:`~jupyter_dist.ui.wizard.Wizard` (its ``.plan``,
        ``.bundle`` and ``.run`` follow the panel).

        Examples
        --------
        ::

            In [1]: %dist_wizard --model llama-3-8b --gpu a100-80gb --nodes 2 --seq-len 4096
            In [2]: w = %dist_wizard --model-var net --checkpointing selective
        """
        args = self._parse(self.wizard_parser, line)
        if args is None:
            return None
        from ..ui.wizard import Wizard
        from ..ui.wizard_model import inputs_from_args

        ns = self.shell.user_ns if self.shell is not None else {}
        try:
            from ..plan.planner import module_spec

            spec = None
            if args.model_var:
                if args.model_var not in ns:
                    raise UsageError(f"--model-var {args.model_var}: no variable of that name in the notebook")
                spec = module_spec(ns[args.model_var], heads=getattr(args, "heads", None), name=args.model_var)
            elif args.module:
                from ..cli.flags import load_module as _load_module

                spec = module_spec(_load_module(args.module), heads=getattr(args, "heads", None))
            inputs = inputs_from_args(args, spec)
            w = Wizard(inputs=inputs, plan_var=args.plan_var, runs_dir=self.runs_dir, shell=self.shell)
            if spec is not None:  # what Rehearse builds: the notebook's object, or the module's pkg.mod:Factory
                w.module = ns[args.model_var] if args.model_var else args.module
            return w
        except JupyterDistError as exc:
            raise UsageError(str(exc)) from None


_registered: dict[int, DistMagics] = {}


def load_ipython_extension(ipython: Any) -> None:
    """Register :class:`DistMagics` with ``ipython``."""
    magics = DistMagics(ipython)
    ipython.register_magics(magics)
    _registered[id(ipython)] = magics
    from .pool import register as register_pool_magics  # %dist_start, %%dist, %dist_push/pull, %dist_mode

    register_pool_magics(ipython)
    notice = magics.orphans_notice()  # runs an earlier kernel left running on this machine
    if notice:
        print(notice)


def unload_ipython_extension(ipython: Any) -> None:
    """Remove the magics registered by :func:`load_ipython_extension`."""
    from .pool import unregister as unregister_pool_magics

    unregister_pool_magics(ipython)
    magics = _registered.pop(id(ipython), None)
    if magics is None:
        return
    for kind, names in magics.magics.items():
        for name in names:
            ipython.magics_manager.magics[kind].pop(name, None)
