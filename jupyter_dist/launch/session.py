"""Start a run from a cell's code: resolve the strategy, write the run directory, ship objects, launch the job.

Used by ``%%dist_train`` and usable from Python (``jupyter_dist.launch.session.start_run(code, nproc=2)``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from .._atomic import write_atomic
from ..errors import JupyterDistError
from .backends.local import LaunchError, LocalLauncher, check_capacity, check_launcher, check_user_env
from .base import backend_spec
from .options import RunOptions
from .prepare import PRELUDE, STRATEGY_CHOICES, DryRun, launch_contract, resolve_strategy, write_shipped
from .record import RunRecord, launch_record
from .run import RUNNING, Run
from .rundir import RunDir, new_run_dir, removed_on_write_error, scrub_env

__all__ = [
    "STRATEGY_CHOICES", "DryRun", "RunOptions", "launch_contract", "local_cpu_plan", "local_gpu_count",
    "resolve_strategy", "start_run",
]  # fmt: skip


def local_gpu_count() -> int:
    """GPUs on this machine, counted without importing torch or touching CUDA in the kernel."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _not_a_script(path: Path) -> str:
    """Why ``path`` (not a regular file) cannot be run: what it is, or that it is missing."""
    import stat

    try:
        mode = path.stat().st_mode
    except OSError as exc:
        return "no such file" if isinstance(exc, FileNotFoundError) else f"cannot be read ({exc.strerror or exc})"
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))  # fmt: skip
    what = next((name for test, name in kinds if test(mode)), "not a regular file")
    return f"is {what}, not a script file"


def local_cpu_plan(strategy: str, nproc: int, nodes: int) -> Any:
    """A plan for the local CPU processes, so a DeepSpeed config can be rendered without a user plan."""
    from ..plan import Hardware, ModelSpec, TrainingShape, plan
    from ..plan.hardware import get_accelerator

    hw = Hardware(accelerator=get_accelerator("cpu"), gpus_per_node=nproc, nodes=nodes)
    return plan(ModelSpec.from_params(1e6, name="cell"), hw, TrainingShape(precision="fp32"), strategy=strategy)


def start_run(code: str, options: RunOptions | None = None, /, **kwargs: Any) -> Run | DryRun:
    """Run ``code`` as the training script on ``nodes x nproc`` fresh processes; returns at once with a Run.

    The options are one :class:`~.options.RunOptions` (``options``), or its fields as keywords (``nproc=2``,
    ``strategy="fsdp2+tp2"``, ...; keywords given with ``options`` replace its fields); each is checked there.
    ``strategy`` is ``auto`` (the plan's recommended candidate), ``none``, a strategy or any candidate name the
    planner prints (``fsdp2+tp2+sp``); ``tp``/``pp``/``cp``/``ep``/``sp`` override its degrees. ``worker`` sets
    other :class:`~jupyter_dist.worker._env.WorkerEnv` fields (``checkpoint_every``, ``heartbeat_s``, ...).
    ``backend="slurm"`` or ``"skypilot"`` submits it to a cluster instead (``cluster``: a
    :class:`~.cluster.ClusterOptions`); see :mod:`jupyter_dist.launch.backends.cluster`. ``log_to``
    (``"tensorboard,wandb"``) forwards the run's metrics from this process to those sinks, ``secrets`` naming the
    environment variables they need (:meth:`Run.log_to`); both are checked before anything is launched.
    ``output`` chooses whose prints are shown while the run goes (``"0"``: rank 0, the default; ``"all"``,
    ``"none"``, ``"0,2"``), under the cell in a notebook, else on stdout (:meth:`Run.show_output`).
    A local run refuses more ranks than the machine holds (:func:`~.backends.local.check_capacity`) unless
    ``oversubscribe``.
    """
    from ..telemetry.sinks import parse_log_to
    from .output import parse_output

    opts = RunOptions.from_kwargs(options, **kwargs)
    sinks = parse_log_to(opts.log_to)
    result = _start_run(code, opts)
    if sinks and isinstance(result, DryRun):
        result.notes.append(f"metrics forwarded from this kernel to: {', '.join(sinks)}")
    elif sinks:
        result.log_to(sinks, secrets=opts.secrets)
    if not isinstance(result, DryRun):
        result.show_output(parse_output(opts.output))
    return result


def _start_run(code: str, opts: RunOptions) -> Run | DryRun:
    check_user_env(opts.env)  # RANK, MASTER_PORT, ...: the launcher would silently override them
    script = opts.script
    if script is not None:  # an existing script instead of a cell (project.script_runner is the job's script.py)
        path = Path(script).expanduser()
        if not path.is_file():
            raise JupyterDistError(f"--script {script}: {_not_a_script(path)}")
        if code.strip():
            raise JupyterDistError("give either the cell's code or --script, not both")
    if backend_spec(opts.backend).cluster:
        from .backends.cluster import start_cluster_run

        result: Run | DryRun = start_cluster_run(code, opts)
        return result
    nproc, nodes, launcher, plan, name = opts.nproc, opts.nodes, opts.launcher, opts.plan, opts.name
    check_launcher(launcher, nodes=nodes, max_restarts=opts.max_restarts)  # before anything is written
    gpus = local_gpu_count()
    if nproc is None:
        nproc = gpus or 2
    capacity_note = ""
    try:
        check_capacity(nproc, nodes, gpus=gpus, oversubscribe=opts.oversubscribe)
    except LaunchError as exc:
        if not opts.dry_run:  # a dry run starts nothing: it says what a real run would refuse
            raise
        capacity_note = f"a real run here refuses this: {exc}"
    choice, contract = launch_contract(opts.strategy, plan, nproc=nproc, nodes=nodes, degrees=opts.degrees(),
                                       worker=opts.worker)  # fmt: skip
    strat = choice.strategy
    extra_env = dict(opts.env)
    files: dict[str, str] = {}
    d = choice.dims
    if strat.startswith("zero") and max(d.tp, d.pp, d.cp, d.ep) == 1:  # zero1 with tp/pp/cp/ep runs as FSDP2
        from ..render.common import RenderOptions
        from ..render.deepspeed import render_deepspeed_json

        ds_plan = plan if plan is not None else local_cpu_plan(strat, nproc, nodes)
        files["ds_config.json"] = render_deepspeed_json(ds_plan, RenderOptions(candidate=strat))
        contract = replace(contract, ds_config="ds_config.json")
    notes = [choice.mesh(), *([choice.note] if choice.note else []), *([capacity_note] if capacity_note else [])]
    if launcher != "torchrun" and gpus == 0:
        # deepspeed's runner asks DeepSpeed's accelerator how many devices exist; accelerate's `Accelerator()` in a
        # rank started with --multi_gpu is MULTI_CPU (gloo) only with ACCELERATE_USE_CPU, else each rank runs alone
        extra_env = {**{"deepspeed": {"DS_ACCELERATOR": "cpu"}, "accelerate": {"ACCELERATE_USE_CPU": "true"}}[launcher],
                     **extra_env}  # fmt: skip
    jd_env = {**contract.to_environ(), **extra_env}
    if script is not None:
        from .project import script_runner

        script = script_runner(str(Path(script).expanduser().resolve()), opts.script_args)
    else:
        script = PRELUDE + code
    if opts.dry_run:
        rd = RunDir(Path(opts.runs_dir).expanduser().resolve() / f"{name}-DRYRUN")
        lau = LocalLauncher(run_dir=rd, nproc=nproc, nodes=nodes, launcher=launcher, max_restarts=opts.max_restarts,
                            port=opts.port, extra_env=jd_env)  # fmt: skip
        return DryRun(script=script, argv=lau.args(), env=lau.env(), files=files, notes=notes)

    rd = new_run_dir(opts.runs_dir, name)
    with removed_on_write_error(rd):  # a full disk: one line, and no half-made run folder left
        write_atomic(rd.script, script)
        for fname, text in files.items():
            write_atomic(rd.path / fname, text)
        if files.get("ds_config.json"):
            jd_env = {**replace(contract, ds_config=str(rd.path / "ds_config.json")).to_environ(), **extra_env}
        if opts.ship:
            write_shipped(rd, opts.ship)
        lau = LocalLauncher(run_dir=rd, nproc=nproc, nodes=nodes, launcher=launcher, max_restarts=opts.max_restarts,
                            port=opts.port, extra_env=jd_env)  # fmt: skip
        record = launch_record(name=name, backend=lau.kind, strategy=strat, choice=choice, nproc=nproc, nodes=nodes,
                               timeout=opts.timeout, hang_timeout=opts.hang_timeout, env=scrub_env(lau.env()),
                               plan=plan, ship=opts.ship)  # fmt: skip
        meta, procs = start_recorded(rd, record, lau)
    return Run(rd, meta, procs=procs, launcher=lau, timeout=opts.timeout, plan=plan)


def start_recorded(rd: RunDir, record: RunRecord,
                   lau: LocalLauncher) -> tuple[dict[str, Any], list[subprocess.Popen[bytes]]]:  # fmt: skip
    """Write the record, start the launcher, and record the outcome (``failed``, or running with its pids).

    Returns the record as the :class:`~.run.Run` handle keeps it (its ``run.json`` dict) and the launcher processes.
    """
    rd.write_meta(record)
    try:
        procs = lau.start()
    except LaunchError:
        rd.write_meta(replace(record, status="failed", error="launch failed"))
        raise
    kernel = {"pid": os.getpid(), "host": socket.gethostname()}  # so a later kernel knows the run is not its own
    record = replace(record, status=RUNNING, started=time.time(), pids=tuple(lau.pids), launcher=lau.to_dict(),
                     extra={**record.extra, "kernel": kernel})  # fmt: skip
    try:
        return rd.write_meta(record).to_dict(), procs
    except OSError:  # started, but its record cannot say so (a full disk): end what started, leave nothing behind
        import psutil

        for p in procs:
            try:
                tree = [*psutil.Process(p.pid).children(recursive=True), psutil.Process(p.pid)]
            except psutil.Error:
                tree = []
            for proc in tree:
                try:
                    proc.kill()
                except psutil.Error:
                    pass
            p.wait()
        raise
