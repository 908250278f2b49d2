"""``%dist_tune`` / ``jupyter-dist tune``: measure the planner's top candidates on the real hardware, keep the best.

Each trial is a real run of the training cell on the launcher path of ``%%dist_train`` (:func:`.session.start_run`:
local torchrun, or SLURM / SkyPilot with ``backend=``), for a few steps, with one candidate of the plan and one
micro-batch size. A trial's measurement comes from its telemetry: the step time (median over the steps after the
warm-up, slowest rank), tokens/s (what the cell logs as ``tokens``), and the peak memory per rank (CUDA's
``peak_allocated`` on GPUs, the process's ``max_rss`` on CPU). A trial that runs out of memory is a result, "does
not fit (measured)", and so is one that crashes.

From the trials a :class:`~jupyter_dist.plan.calibration.Calibration` is fitted (matmul rate and per-operator cost by
least squares over the trials' predicted parts; the memory offset as the largest measured-minus-planned peak) and
saved for this hardware; later plans use it and say so. The best measured candidate comes back as a Plan.

Speed options are choices like the others (``options=("compile", "fused")``, ``--options compile,fused``): every
candidate and micro-batch is tried with each on/off combination of the named options (regional ``torch.compile`` of
the blocks, the optimizer's fused kernel, ``fp8`` training), predicted and run with the same setting (``JD_COMPILE``,
``JD_FUSED``, ``JD_PRECISION``). The table says what each trial ran, the best trial's options go into the returned
Plan and the ``%%dist_train`` line the result prints, and the trials of each option set fit their own calibration
(:attr:`~jupyter_dist.plan.calibration.Calibration.options`): a compiled run never calibrates the eager model.

One piece (about 600 lines): the choices a tune varies (candidates, micro-batch sizes, speed options), the trial
loop and the :class:`TuneResult` it fills and shows (table, chart, the ``%%dist_train`` line) are one flow that the
magic, the CLI and the tests drive through :func:`tune`; the measurement and the fit are :mod:`.measure`'s.

The cell reads its shape from the environment: ``JD_MICRO_BATCH`` (sequences per rank per step), ``JD_SEQ_LEN`` and
``JD_TUNE_STEPS`` (steps to run); without a cell, :data:`TUNE_CELL` trains the reference transformer of the plan's
model shape.
"""

from __future__ import annotations

import html
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import JupyterDistError
from .base import DEFAULT_BACKEND
from .measure import WARMUP_STEPS, Measured, Trial, fit_calibration, measure_run

__all__ = [
    "SPEED_OPTIONS",
    "TUNE_CELL",
    "WARMUP_STEPS",
    "Measured",
    "Trial",
    "TuneResult",
    "TuneTrial",
    "option_settings",
    "parse_options",
    "fit_calibration",
    "measure_run",
    "trial_grid",
    "tune",
]

TUNE_CELL = """
import os

import torch
import torch.nn as nn

from jupyter_dist.models import Transformer

VOCAB, DIM, LAYERS, HEADS = (int(v) for v in os.environ["JD_TUNE_MODEL"].split(","))
BATCH, SEQ, STEPS = int(os.environ["JD_MICRO_BATCH"]), int(os.environ["JD_SEQ_LEN"]), int(os.environ["JD_TUNE_STEPS"])
torch.manual_seed(0)
model = Transformer(vocab_size=VOCAB, dim=DIM, n_layers=LAYERS, n_heads=HEADS)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = jd.wrap(model, opt)


def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


for step in range(STEPS):
    g = torch.Generator().manual_seed(step * jd.dp_size + jd.dp_rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).to(jd.device)
    loss = jd.train_step(tokens[:, :-1], tokens[:, 1:], loss_fn)
    jd.log(step, loss=loss, tokens=BATCH * SEQ)
"""
"""The built-in trial cell: the reference transformer with the plan's model shape, random tokens."""

SPEED_OPTIONS = ("compile", "fused", "fp8")
"""What ``--options`` varies: regional ``torch.compile`` of the blocks, the optimizer's fused kernel, FP8 training."""

_COMPILE_FELL_BACK = "torch.compile of the blocks failed"
"""What rank 0's log says when the blocks fell back to eager (:mod:`jupyter_dist.worker._speed`)."""

_OOM_MARKERS = ("out of memory", "outofmemoryerror", "memoryerror", "cannot allocate memory", "killed by signal 9")


_COLUMNS = ["trial", "options", "step s (plan)", "step s (measured)", "tok/s (plan)", "tok/s (measured)",
            "peak MiB (plan)", "peak MiB/rank (measured)", "result"]  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class TuneTrial(Trial):
    """A trial of a tune: a :class:`~.measure.Trial` and the speed options it ran with."""

    options: str = ""
    """What the trial ran (:func:`~jupyter_dist.plan.calibration.options_key`: ``"compile+fused"``,
    ``"eager+foreach"``, ``"+fp8"`` with FP8)."""
    varied: bool = False
    """Whether the tune varied the options (then the label names them: the same candidate and micro-batch run once
    per option set)."""

    @property
    def label(self) -> str:
        """``candidate @ mb N``, with the options when the tune varied them."""
        return f"{self.candidate} @ mb {self.micro_batch}" + (f" {self.options}" if self.varied else "")


def _row(t: Trial) -> list[str]:
    """A trial's table cells with its options (``-`` for a Trial built without them)."""
    cells = t.row()
    return [f"{t.candidate} @ mb {t.micro_batch}", getattr(t, "options", "") or "-", *cells[1:]]


@dataclass(kw_only=True)
class TuneResult:
    """The trials so far, the best measured one as a Plan, and the calibration they give."""

    base: Any
    """The plan the candidates came from."""
    trials: list[Trial] = field(default_factory=list)
    """Every trial, in the order run."""
    plan: Any = None
    """The best measured candidate as a :class:`~jupyter_dist.plan.plan.Plan` (``None`` until one succeeds)."""
    calibration: Any = None
    """The :class:`~jupyter_dist.plan.calibration.Calibration` fitted from the trials (saved unless told not to)."""
    calibration_path: str = ""
    """Where it was saved ("" when not: pass ``save=True`` / ``--save``, or ``result.save_calibration()``)."""
    not_run: list[tuple[str, str]] = field(default_factory=list)
    """Candidates left out because this machine cannot run them: ``(name, "needs DeepSpeed ...")``."""
    calibrations: dict[str, Any] = field(default_factory=dict)
    """One calibration per option set the successful trials ran (``"compile+fused"`` -> its fit); :attr:`calibration`
    is the best trial's. All are saved together."""
    nproc: int = 0
    """Processes per node the trials ran (the ``%%dist_train`` line of :meth:`train_line`)."""
    nodes: int = 1
    """Nodes the trials ran on."""

    def save_calibration(self) -> str:
        """Save the fitted calibrations for the hardware they were measured on; returns the best trial's file.

        One file per option set the trials ran; later plans with those options use it.
        """
        if self.calibration is None:
            raise JupyterDistError("no calibration to save: no trial measured a step")
        for cal in self.calibrations.values():
            if cal is not self.calibration:
                cal.save()
        self.calibration_path = str(self.calibration.save())
        return self.calibration_path

    def train_line(self, var: str = "best") -> str:
        """The ``%%dist_train`` line that trains like the best trial; ``""`` when no trial measured a step.

        Its plan (``var``: the Plan the tune returned) and its speed options where they are not the ranks' default
        (compiled and fused on GPUs, eager and foreach on CPU processes).
        """
        best = self.best
        if best is None or self.plan is None:
            return ""
        vendor = self.plan.hardware.accelerator.vendor
        compiled, fused = self.plan.training.speed_options(vendor)
        gpu = vendor != "cpu"
        flags = [f"--plan {var}", f"--nproc {self.nproc or self.plan.hardware.gpus_per_node}"]
        if self.nodes > 1:
            flags.append(f"--nodes {self.nodes}")
        if compiled != gpu:
            flags.append("--compile" if compiled else "--no-compile")
        if fused != gpu:
            flags.append("--env JD_FUSED=1" if fused else "--no-fused")
        return "%%dist_train " + " ".join(flags)

    @property
    def best(self) -> Trial | None:
        """The fastest trial that measured a step (by tokens/s, else by step time)."""
        ok = [t for t in self.trials if t.ok]
        if not ok:
            return None
        return max(ok, key=lambda t: t.measured.tokens_per_s or 1.0 / t.measured.step_time_s)  # type: ignore[union-attr]

    def to_text(self) -> str:
        """The side-by-side table, the pick and the calibration."""
        rows = [_COLUMNS] + [_row(t) for t in self.trials]
        widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
        lines = ["  ".join(c.ljust(w) if i in (0, 1, 8) else c.rjust(w)
                           for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in rows]  # fmt: skip
        lines.insert(1, "-" * len(lines[0]))
        best = self.best
        lines.append("")
        lines.append(f"Best measured: {best.label}" if best else "No trial measured a step.")
        if self.train_line():
            lines.append(f"Train with it: {self.train_line()}  (best = the Plan %dist_tune returned)")
        for cname, why in self.not_run:
            lines.append(f"Not run: {cname}: {why}")
        if self.calibration is not None:
            where = (f", saved to {self.calibration_path}" if self.calibration_path
                     else " (not saved: --save, or result.save_calibration(), makes later plans use it)")  # fmt: skip
            lines.append(f"Calibration{where}: {self.calibration.describe()}")
            for cal in self.calibrations.values():
                if cal is not self.calibration:
                    lines.append(f"Calibration of the {cal.options} trials (saved with it): {cal.describe()}")
        return "\n".join(lines)

    def chart_svg(self, width: int = 560) -> str:
        """Predicted against measured tokens/s per trial, as an SVG bar chart (no JavaScript)."""
        trials = self.trials
        if not trials:
            return ""
        values = [(t.predicted.time.tokens_per_s, t.measured.tokens_per_s if t.measured else None) for t in trials]
        top = max([v for pair in values for v in pair if v], default=1.0)
        row_h, label_w = 34, 170
        bar_w = width - label_w - 90
        parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{row_h * len(trials) + 30}" '
                 'font-family="sans-serif" font-size="11" class="jd-tune-chart">',
                 '<text x="0" y="12">tokens/s: <tspan fill="#90a4ae">plan</tspan> vs '
                 '<tspan fill="#1565c0">measured</tspan></text>']  # fmt: skip
        for i, (t, (pred, meas)) in enumerate(zip(trials, values, strict=True)):
            y = 22 + i * row_h
            parts.append(f'<text x="0" y="{y + 14}">{html.escape(t.label)}</text>')
            pw = bar_w * (pred or 0) / top
            parts.append(f'<rect x="{label_w}" y="{y}" width="{pw:.1f}" height="12" fill="#90a4ae"/>')
            parts.append(f'<text x="{label_w + pw + 4:.1f}" y="{y + 10}">{pred:,.0f}</text>')
            if meas:
                mw = bar_w * meas / top
                parts.append(f'<rect x="{label_w}" y="{y + 14}" width="{mw:.1f}" height="12" fill="#1565c0"/>')
                parts.append(f'<text x="{label_w + mw + 4:.1f}" y="{y + 24}">{meas:,.0f}</text>')
            else:
                parts.append(f'<text x="{label_w}" y="{y + 24}" fill="#c62828">{html.escape(t.status)}</text>')
        parts.append("</svg>")
        return "".join(parts)

    def to_html(self) -> str:
        """Table and chart for notebooks."""
        e = html.escape
        head = "".join(f"<th>{e(c)}</th>" for c in _COLUMNS)
        best = self.best
        body = []
        for t in self.trials:
            style = ' style="font-weight:bold;background:#e8f5e9"' if best is not None and t is best else ""
            body.append(f"<tr{style}>" + "".join(f"<td>{e(c)}</td>" for c in _row(t)) + "</tr>")
        foot = f"<p>Best measured: <b>{e(best.label)}</b></p>" if best else "<p>No trial measured a step yet.</p>"
        if self.train_line():
            foot += f"<p>Train with it: <code>{e(self.train_line())}</code></p>"
        if self.calibration is not None:
            foot += f"<p>Calibration: {e(self.calibration.describe())}</p>"
        return (f'<div class="jupyter-dist-tune"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}'
                f"</tbody></table>{self.chart_svg()}{foot}</div>")  # fmt: skip

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": self.to_text(), "text/html": self.to_html()}


# ---------------------------------------------------------------------------------------------------------------
# Trials
# ---------------------------------------------------------------------------------------------------------------
def parse_options(names: Sequence[str] | str | None) -> tuple[str, ...]:
    """The speed options a tune varies, validated (``"compile,fused"`` or a list); unknown names are one line."""
    if names is None:
        return ()
    given = [n.strip().lower() for n in (names.split(",") if isinstance(names, str) else names)]
    given = [n for n in given if n]
    bad = [n for n in given if n not in SPEED_OPTIONS]
    if bad:
        raise JupyterDistError(f"--options: unknown option {bad[0]!r}; valid: {', '.join(SPEED_OPTIONS)}")
    return tuple(n for n in SPEED_OPTIONS if n in given)


def option_settings(options: Sequence[str]) -> list[dict[str, bool]]:
    """Every on/off combination of ``options`` (all off first): ``[{}]`` when none is varied."""
    return [dict(zip(options, on, strict=True)) for on in itertools.product((False, True), repeat=len(options))]


def with_options(training: Any, setting: dict[str, bool]) -> Any:
    """``training`` with the options of ``setting`` set (the others as they were).

    ``fp8`` on is precision ``fp8``; off, a plan in ``fp8`` trains in ``bf16-mixed`` (what FP8 keeps outside its
    linears), any other precision stays.
    """
    changes: dict[str, Any] = {}
    if "compile" in setting:
        changes["compile"] = setting["compile"]
    if "fused" in setting:
        changes["fused_optimizer"] = setting["fused"]
    if "fp8" in setting:
        if setting["fp8"]:
            changes["precision"] = "fp8"
        elif training.precision.value == "fp8":
            changes["precision"] = "bf16-mixed"
    return replace(training, **changes)


def _replan(base: Any, strategy: str, dims: Any, micro_batch: int, setting: dict[str, bool] | None = None) -> Any:
    """The base plan's inputs with one candidate's strategy and degrees, at ``micro_batch``, with ``setting``."""
    from ..plan.planner import plan

    fixed = {k: getattr(dims, k) for k in ("tp", "pp", "cp", "ep") if getattr(dims, k) > 1}
    training = with_options(replace(base.training, micro_batch=micro_batch), setting or {})
    return plan(base.model, base.hardware, training, strategy=strategy, sp=dims.sp if dims.tp > 1 else None,
                assumptions=base.assumptions, **fixed)  # fmt: skip


def _classify(run: Any) -> tuple[str, str]:
    """(status, one-line reason) of a run that did not succeed."""
    text = ""
    for r in range(run.world_size):
        try:
            text += run.logs(r, tail=40) + "\n"
        except JupyterDistError:
            continue
    low = text.lower()
    last = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), run.status)
    if any(m in low for m in _OOM_MARKERS):
        return "does not fit (measured)", last[:160]
    return "failed (measured)", f"{run.status}: {last[:160]}"


def missing_dependency(candidate: Any) -> str:
    """Why this machine cannot run ``candidate`` (``"needs DeepSpeed: pip install ..."``), or ``""``."""
    import importlib.util

    from ..plan.strategies import get_strategy

    if get_strategy(candidate.strategy).family == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        return 'needs DeepSpeed: pip install "jupyter-dist[deepspeed]"'
    return ""


def trial_grid(
    plan: Any,
    *,
    top: int = 3,
    candidates: Sequence[str] | None = None,
    micro_batches: Sequence[int] | None = None,
    runnable: Callable[[Any], str] | None = None,
) -> tuple[list[Any], list[int]]:
    """The candidates to measure (the plan's ``top`` fitting ones, or those named) and the micro-batch sizes.

    The sizes default to the planned one and its neighbours (half and double); a neighbour the plan says does not
    fit is skipped when the trials run. ``runnable`` (a candidate -> why it cannot run, ``""`` when it can) leaves
    the plan's candidates this machine cannot run out of the top ones, so ``top`` trials still run.
    """
    if candidates:
        chosen = []
        for cname in candidates:
            try:
                chosen.append(plan.candidate(cname))
            except KeyError:
                raise JupyterDistError(
                    f"no candidate {cname!r} in the plan; have: {', '.join(c.name for c in plan.candidates)}"
                ) from None
    else:
        fitting = [c for c in plan.candidates if c.fits]
        if not fitting:
            raise JupyterDistError("nothing in the plan fits: there is no candidate to measure")
        chosen = [c for c in fitting if runnable is None or not runnable(c)][:top]
        if not chosen:
            why = runnable(fitting[0]) if runnable is not None else ""
            raise JupyterDistError(f"no fitting candidate can run on this machine ({fitting[0].name} {why})")
    planned = plan.training.micro_batch
    if micro_batches is None:
        sizes = sorted({planned, *(b for b in (planned // 2, planned * 2) if b >= 1)})
    else:
        sizes = sorted(set(micro_batches))
        if not sizes or min(sizes) < 1:
            raise JupyterDistError(f"--micro-batches must be positive integers, got {list(micro_batches)}")
    return chosen, sizes


def tune(
    code: str | None,
    plan: Any,
    *,
    top: int = 3,
    micro_batches: Sequence[int] | None = None,
    candidates: Sequence[str] | None = None,
    steps: int = 8,
    nproc: int | None = None,
    nodes: int | None = None,
    backend: str = DEFAULT_BACKEND,
    cluster: Any = None,
    runs_dir: str = "runs",
    name: str = "tune",
    trial_timeout: float = 300.0,
    save: bool = False,
    env: dict[str, str] | None = None,
    on_trial: Callable[[TuneResult], None] | None = None,
    options: Sequence[str] | str | None = None,
) -> TuneResult:
    """Run the plan's top ``top`` fitting candidates (or the named ``candidates``) at each micro-batch size.

    ``options`` (any of :data:`SPEED_OPTIONS`) runs each of them with every on/off combination of those speed
    options; ``fp8`` is refused in one line on hardware without FP8 matmuls.

    ``micro_batches`` defaults to the planned one and its neighbours (half and double) where they fit.
    ``on_trial`` is called with the result after every trial (the magic redraws its table and chart there).
    Candidates this machine cannot run (DeepSpeed not installed) are listed in ``not_run``, never tried. The
    calibration is fitted always and saved only with ``save=True`` (``--save``): a tune changes later plans only
    when asked to.
    """
    from .session import start_run

    if plan is None or not getattr(plan, "candidates", None):
        raise JupyterDistError("tune needs a Plan with candidates (from %dist_plan / jupyter_dist.plan.plan)")
    if not 1 <= top <= 32:
        raise JupyterDistError(f"--top must be 1..32 candidates, got {top}")
    if not 1 <= steps <= 10_000:
        raise JupyterDistError(f"--steps must be 1..10000, got {steps}")
    if steps <= WARMUP_STEPS:
        raise JupyterDistError(f"--steps must be more than the {WARMUP_STEPS} warm-up steps, got {steps}")
    varied = parse_options(options)
    if "fp8" in varied:
        from ..plan.hardware import fp8_problem

        problem = fp8_problem(plan.hardware.accelerator)
        if problem:  # the worker refuses the same (JD_PRECISION=fp8 without FP8 matmuls)
            raise JupyterDistError(f"--options fp8: {problem}; tune compile,fused here")
    chosen, sizes = trial_grid(plan, top=top, candidates=candidates, micro_batches=micro_batches,
                               runnable=missing_dependency)  # fmt: skip
    from ..plan.calibration import options_key, published

    plan = replace(plan, hardware=published(plan.hardware))  # trials predicted from the published figures: the fit
    # is then absolute, not a correction of an older calibration
    planned = plan.training.micro_batch
    model = plan.model
    cell = code if code and code.strip() else TUNE_CELL
    world = plan.hardware.world_size
    nodes = nodes or plan.hardware.nodes
    nproc = nproc or world // nodes
    result = TuneResult(base=plan, nproc=nproc, nodes=nodes)
    if not candidates:  # the plan's better candidates this machine cannot run: said, not run
        best_names = {c.name for c in chosen}
        for c in plan.candidates:
            if c.fits and c.name not in best_names and missing_dependency(c) and len(result.not_run) < top:
                result.not_run.append((c.name, missing_dependency(c)))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    vendor = plan.hardware.accelerator.vendor
    for cand, setting in itertools.product(chosen, option_settings(varied)):
        why = missing_dependency(cand)
        if why:  # named by the user: said, not run
            if (cand.name, why) not in result.not_run:
                result.not_run.append((cand.name, why))
            continue
        why = _fp8_problem(cand) if setting.get("fp8") else ""
        if why:  # the worker refuses it in one line: said, not run
            result.not_run.append((f"{cand.name} with fp8", why))
            continue
        for mb in sizes:
            try:
                trial_plan = _replan(plan, cand.strategy, cand.dims, mb, setting)
                predicted = trial_plan.candidate(cand.name)
            except (JupyterDistError, KeyError):
                if mb == planned and not setting:
                    raise
                continue  # e.g. a micro-batch the global batch does not divide into
            if mb != planned and not predicted.fits:
                continue  # a neighbour the plan says does not fit: not worth a run
            compiled, fused = trial_plan.training.speed_options(vendor)
            speed = {"compile": "1" if compiled else "0", "fused": "1" if fused else "0"}  # as it was predicted
            trial_env = {"JD_MICRO_BATCH": str(mb), "JD_SEQ_LEN": str(plan.training.seq_len),
                         "JD_TUNE_STEPS": str(steps),
                         "JD_TUNE_MODEL": f"{model.vocab},{model.hidden},{model.layers},{model.heads}",
                         **(env or {})}  # fmt: skip
            trial = _run_trial(start_run, cell, trial_plan, predicted, mb, nproc=nproc, nodes=nodes, backend=backend,
                               cluster=cluster, runs_dir=runs_dir, name=f"{name}-{stamp}-{len(result.trials)}",
                               env=trial_env, timeout=trial_timeout, speed=speed)  # fmt: skip
            fields = {f: getattr(trial, f) for f in Trial.__dataclass_fields__}
            result.trials.append(TuneTrial(**{**fields, "accelerator": trial_plan.hardware.accelerator},
                                           options=options_key(trial_plan.training, vendor),
                                           varied=bool(varied)))  # fmt: skip
            if on_trial is not None:
                on_trial(result)
    _finish(result, save=save, source=str(Path(runs_dir).expanduser().resolve()))
    if on_trial is not None:
        on_trial(result)
    return result


def _run_trial(
    start_run: Callable[..., Any],
    cell: str,
    trial_plan: Any,
    predicted: Any,
    mb: int,
    *,
    nproc: int,
    nodes: int,
    backend: str,
    cluster: Any,
    runs_dir: str,
    name: str,
    env: dict[str, str],
    timeout: float,
    speed: dict[str, str] | None = None,
) -> Trial:
    """One trial: start it like %%dist_train, wait, measure; a failure is a result.

    ``speed``: the worker's ``compile`` / ``fused`` fields (``"1"``/``"0"``), as the trial was predicted. Blocks whose
    compilation failed run eager (one line in rank 0's log): such a trial is "failed (measured)", since it did not
    measure what it was predicted for.
    """
    from .options import RunOptions

    try:
        opts = RunOptions(nproc=nproc, nodes=nodes, strategy=predicted.name, plan=trial_plan, name=name,
                          runs_dir=runs_dir, timeout=timeout, env=env, backend=backend, cluster=cluster,
                          worker={"telemetry_interval_s": 0.0, "heartbeat_s": 0.25, **(speed or {})},
                          output="none")  # fmt: skip
        run = start_run(cell, opts)
    except JupyterDistError as exc:
        return Trial(candidate=predicted.name, micro_batch=mb, predicted=predicted, status="failed (measured)",
                     error=str(exc).splitlines()[0][:160])  # fmt: skip
    run.wait()
    measured = measure_run(run)
    if run.status == "succeeded":
        fell_back = _compile_fell_back(run) if (speed or {}).get("compile") == "1" else ""
        if fell_back:
            return Trial(candidate=predicted.name, micro_batch=mb, predicted=predicted, status="failed (measured)",
                         measured=measured, error=f"ran eager: {fell_back}", run_dir=str(run.dir))  # fmt: skip
        if measured.step_time_s is None:
            return Trial(candidate=predicted.name, micro_batch=mb, predicted=predicted, status="failed (measured)",
                         measured=measured, error=f"fewer than {WARMUP_STEPS + 2} steps logged with jd.log",
                         run_dir=str(run.dir))  # fmt: skip
        return Trial(candidate=predicted.name, micro_batch=mb, predicted=predicted, status="ok", measured=measured,
                     run_dir=str(run.dir))  # fmt: skip
    status, why = _classify(run)
    return Trial(candidate=predicted.name, micro_batch=mb, predicted=predicted, status=status, measured=measured,
                 error=why, run_dir=str(run.dir))  # fmt: skip


def _compile_fell_back(run: Any) -> str:
    """Rank 0's line saying its compiled blocks fell back to eager, or ``""``."""
    try:
        text = run.logs(0, tail=400)
    except JupyterDistError:
        return ""
    line = next((ln for ln in text.splitlines() if _COMPILE_FELL_BACK in ln), "")
    return line[line.index(_COMPILE_FELL_BACK):][:160] if line else ""


def _finish(result: TuneResult, *, save: bool, source: str) -> None:
    """Fit and save the calibration; the best measured candidate, re-planned with it, becomes ``result.plan``."""
    from ..plan.calibration import options_key
    from ..plan.planner import plan as make_plan

    ok = [t for t in result.trials if t.ok]
    if not ok:
        return
    base = result.base
    own = options_key(base.training, base.hardware.accelerator.vendor)
    groups: dict[str, list[Trial]] = {}
    for t in ok:  # each option set fits its own calibration: a compiled run does not calibrate the eager model
        groups.setdefault(getattr(t, "options", "") or own, []).append(t)
    for key, trials in groups.items():
        fitted = fit_calibration(trials, source=source)
        if fitted is not None:
            result.calibrations[key] = replace(fitted, options=key)
    best = result.best
    assert best is not None
    cal = result.calibrations.get(getattr(best, "options", "") or own)
    result.calibration = cal
    if cal is not None and save:
        result.save_calibration()
    dims = best.predicted.dims
    fixed = {k: getattr(dims, k) for k in ("tp", "pp", "cp", "ep") if getattr(dims, k) > 1}
    shape = replace(base.training, micro_batch=best.micro_batch)
    ran = str(getattr(best, "options", ""))
    if ran:  # the best trial's options, resolved as it ran them
        compiled, fused = _speed_of(ran)
        shape = replace(shape, compile=compiled, fused_optimizer=fused)
        fp8 = ran.endswith("+fp8")
        if fp8 != (shape.precision.value == "fp8"):
            shape = with_options(shape, {"fp8": fp8})
    tuned = make_plan(base.model, base.hardware, shape, strategy=best.predicted.strategy,
                      sp=dims.sp if dims.tp > 1 else None, assumptions=base.assumptions, calibration=cal,
                      **fixed)  # fmt: skip
    m = best.measured
    assert m is not None and m.step_time_s is not None
    note = (f"%dist_tune measured {best.label} fastest of {len(result.trials)} trial(s): {m.step_time_s:.4g} s/step"
            + (f", {m.tokens_per_s:,.0f} tokens/s" if m.tokens_per_s else "")
            + (f", peak {m.peak / 2**20:,.0f} MiB per rank ({m.memory_kind})" if m.peak else "") + ".")  # fmt: skip
    result.plan = replace(tuned, recommended=best.candidate if _has(tuned, best.candidate) else tuned.recommended,
                          reasons=(note, *tuned.reasons))  # fmt: skip


def _fp8_problem(candidate: Any) -> str:
    """Why the worker cannot run ``candidate`` in fp8 (its strategy or tensor parallelism), or ``""``."""
    from ..plan.strategies import get_strategy
    from ..plan.training import fp8_strategy_problem

    return fp8_strategy_problem(get_strategy(candidate.strategy).family, candidate.dims.tp) or ""


def _speed_of(options: str) -> tuple[bool, bool]:
    """``(compile, fused)`` of an options key (``"compile+foreach+fp8"`` -> ``(True, False)``)."""
    parts = options.split("+")
    return parts[0] == "compile", parts[1] == "fused"


def _has(plan: Any, name: str) -> bool:
    return any(c.name == name for c in plan.candidates)
