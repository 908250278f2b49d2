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

The cell reads its shape from the environment: ``JD_MICRO_BATCH`` (sequences per rank per step), ``JD_SEQ_LEN`` and
``JD_TUNE_STEPS`` (steps to run); without a cell, :data:`TUNE_CELL` trains the reference transformer of the plan's
model shape.
"""

from __future__ import annotations

import html
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import JupyterDistError

__all__ = [
    "TUNE_CELL",
    "Measured",
    "Trial",
    "TuneResult",
    "add_tune_arguments",
    "fit_calibration",
    "measure_run",
    "trial_grid",
    "tune",
    "tune_from_args",
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

WARMUP_STEPS = 2
"""Steps left out of the step-time median (first-step allocation, lazy initialisation, compilation)."""

_OOM_MARKERS = ("out of memory", "outofmemoryerror", "memoryerror", "cannot allocate memory", "killed by signal 9")


@dataclass(frozen=True, kw_only=True, slots=True)
class Measured:
    """What one run measured."""

    step_time_s: float | None
    """Median seconds per step after the warm-up, on the slowest rank (``None``: too few steps logged)."""
    tokens_per_s: float | None
    """Tokens per second, whole job (from the ``tokens`` the cell logs; ``None`` when it logs none)."""
    peak_bytes: dict[int, int] = field(default_factory=dict)
    """Peak memory per rank: CUDA ``peak_allocated`` on GPUs, the process's ``max_rss`` on CPU."""
    memory_kind: str = "rss"
    """``"cuda"`` or ``"rss"``: what :attr:`peak_bytes` counts."""
    steps: int = 0
    """Steps logged (by the slowest rank)."""

    @property
    def peak(self) -> int:
        """The largest rank's peak (bytes; 0 when none was recorded)."""
        return max(self.peak_bytes.values(), default=0)


def measure_run(run: Any, *, warmup: int = WARMUP_STEPS) -> Measured:
    """Step time, tokens/s and peak memory per rank from a run's telemetry (any finished or running Run)."""
    steps: dict[int, list[dict[str, Any]]] = {}
    for rec in run.records("step"):
        steps.setdefault(int(rec["rank"]), []).append(rec)
    per_rank_time: list[float] = []
    per_rank_tps: dict[int, float] = {}
    logged = 0
    for rank, recs in steps.items():
        recs.sort(key=lambda r: r.get("seq", 0))
        logged = max(logged, int(recs[-1].get("step", 0)) + 1)
        # coalesced records carry n calls; weigh each record's step_time by its calls
        times = [float(r["step_time"]) for r in recs[1:] if r.get("step_time") and int(r.get("step", 0)) >= warmup]
        if times:
            per_rank_time.append(statistics.median(times))
        tps = [float(r["tokens_per_s"]) for r in recs[1:] if r.get("tokens_per_s") and int(r.get("step", 0)) >= warmup]
        if tps:
            per_rank_tps[rank] = statistics.median(tps)
    step_time = max(per_rank_time) if per_rank_time else None
    tokens = None
    if per_rank_tps:
        # ranks of a tensor/pipeline/context group share their tokens: count each data-parallel rank once
        world = max(1, int(getattr(run, "world_size", len(per_rank_tps))))
        dp = _dp_size(run, world)
        tokens = sum(per_rank_tps.values()) * dp / max(1, len(per_rank_tps)) if dp else None
    peaks: dict[int, int] = {}
    kind = "rss"
    for rec in run.records("mem"):
        rank = int(rec["rank"])
        if rec.get("peak_allocated") is not None:
            kind = "cuda"
            value = int(rec["peak_allocated"])
        else:
            value = int(rec.get("max_rss") or rec.get("rss") or 0)
        peaks[rank] = max(peaks.get(rank, 0), value)
    return Measured(step_time_s=step_time, tokens_per_s=tokens, peak_bytes=peaks, memory_kind=kind, steps=logged)


def _dp_size(run: Any, world: int) -> int:
    """Data-parallel ranks of a run (from its candidate's degrees when known, else all of them)."""
    plan = getattr(run, "plan", None)
    name = getattr(run, "candidate", None)
    if plan is not None and name:
        try:
            return int(plan.candidate(name).dims.dp) if plan.world_size == world else world
        except KeyError:
            pass
    return world


@dataclass(frozen=True, kw_only=True, slots=True)
class Trial:
    """One candidate at one micro-batch size: predicted, and what the run measured."""

    candidate: str
    """Candidate name (``"fsdp2"``, ``"fsdp2+tp2+sp"``)."""
    micro_batch: int
    """Sequences per rank per micro-batch."""
    predicted: Any
    """The plan's :class:`~jupyter_dist.plan.plan.Candidate` for this shape."""
    status: str
    """``"ok"``, ``"does not fit (measured)"`` or ``"failed (measured)"``."""
    measured: Measured | None = None
    """The measurement (``None`` when the run produced no step)."""
    error: str = ""
    """Why it failed, one line."""
    run_dir: str = ""
    """The trial's run directory."""
    accelerator: Any = None
    """The :class:`~jupyter_dist.plan.hardware.Accelerator` the prediction was made for."""

    @property
    def ok(self) -> bool:
        """Whether the trial measured a step time."""
        return self.status == "ok" and self.measured is not None and self.measured.step_time_s is not None

    @property
    def label(self) -> str:
        """``candidate @ mb N``."""
        return f"{self.candidate} @ mb {self.micro_batch}"

    def row(self) -> list[str]:
        """Table cells: trial, predicted / measured step, tokens/s, peak memory, status."""
        p = self.predicted
        m = self.measured
        mib = 2**20

        def fmt(v: float | None, spec: str) -> str:
            return "-" if v is None else format(v, spec)

        return [
            self.label,
            fmt(p.time.step_time_s, ".4g"), fmt(m.step_time_s if m else None, ".4g"),
            fmt(p.time.tokens_per_s, ",.0f"), fmt(m.tokens_per_s if m else None, ",.0f"),
            fmt(p.memory.total / mib, ",.0f"), fmt(m.peak / mib if m and m.peak else None, ",.0f"),
            self.status if not self.error else f"{self.status}: {self.error}",
        ]  # fmt: skip


_COLUMNS = ["trial", "step s (plan)", "step s (measured)", "tok/s (plan)", "tok/s (measured)", "peak MiB (plan)",
            "peak MiB/rank (measured)", "result"]  # fmt: skip


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
    """Where it was saved ("" when not)."""

    @property
    def best(self) -> Trial | None:
        """The fastest trial that measured a step (by tokens/s, else by step time)."""
        ok = [t for t in self.trials if t.ok]
        if not ok:
            return None
        return max(ok, key=lambda t: t.measured.tokens_per_s or 1.0 / t.measured.step_time_s)  # type: ignore[union-attr]

    def to_text(self) -> str:
        """The side-by-side table, the pick and the calibration."""
        rows = [_COLUMNS] + [t.row() for t in self.trials]
        widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
        lines = ["  ".join(c.ljust(w) if i in (0, 7) else c.rjust(w)
                           for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in rows]  # fmt: skip
        lines.insert(1, "-" * len(lines[0]))
        best = self.best
        lines.append("")
        lines.append(f"Best measured: {best.label}" if best else "No trial measured a step.")
        if self.calibration is not None:
            where = f", saved to {self.calibration_path}" if self.calibration_path else " (not saved)"
            lines.append(f"Calibration{where}: {self.calibration.describe()}")
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
            body.append(f"<tr{style}>" + "".join(f"<td>{e(c)}</td>" for c in t.row()) + "</tr>")
        foot = f"<p>Best measured: <b>{e(best.label)}</b></p>" if best else "<p>No trial measured a step yet.</p>"
        if self.calibration is not None:
            foot += f"<p>Calibration: {e(self.calibration.describe())}</p>"
        return (f'<div class="jupyter-dist-tune"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}'
                f"</tbody></table>{self.chart_svg()}{foot}</div>")  # fmt: skip

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": self.to_text(), "text/html": self.to_html()}


# ---------------------------------------------------------------------------------------------------------------
# Calibration fit
# ---------------------------------------------------------------------------------------------------------------
COMM_PARTS = ("dp_comm", "tp_comm", "pp_p2p", "cp_comm", "ep_comm", "offload")
"""Breakdown parts that scale with the links' speed (the calibration's ``comm_scale``)."""


def fit_calibration(trials: Sequence[Trial], *, source: str = "") -> Any:
    """Fit the matmul rate, per-operator cost and communication speed to the trials' measured step times.

    Each trial's predicted step is split into the matmul part ``a`` (at the published rate), the overhead part ``b``
    (at the published per-operator cost), the communication parts ``c`` and the rest ``d``; the measured time
    ``T = a x + b y + c z + d`` is solved by least squares for the three scales, with a weak pull towards 1 (the
    published figures), so that trials which cannot tell two parts apart share the correction between them.
    ``None`` when no trial measured a step.
    """
    from ..plan.calibration import Calibration, hardware_key

    ok = [t for t in trials if t.ok and t.accelerator is not None]
    if not ok:
        return None
    acc = ok[0].accelerator
    rows = []
    for t in ok:
        bd = t.predicted.time.breakdown
        a, b = bd.get("matmul", 0.0), bd.get("overhead", 0.0)
        c = sum(bd.get(k, 0.0) for k in COMM_PARTS)
        d = t.predicted.time.step_time_s - a - b - c
        rows.append(([a, b, c], t.measured.step_time_s - d))  # type: ignore[union-attr]
    x, y, z = _ridge(rows)
    errors = [abs(t.predicted.time.step_time_s / t.measured.step_time_s - 1) for t in ok]  # type: ignore[union-attr]
    offsets = [t.measured.peak - t.predicted.memory.total for t in ok if t.measured and t.measured.peak]
    return Calibration(
        hardware_key=hardware_key(acc.name), accelerator=acc.name,
        matmul_efficiency=min(1.0, max(1e-4, acc.matmul_efficiency / x)), op_overhead_s=acc.op_overhead_s * y,
        comm_scale=z, memory_offset_bytes=int(max(offsets, default=0)), trials=len(ok),
        step_error=statistics.fmean(errors), measured_at=time.time(), source=source,
    )  # fmt: skip


def _ridge(rows: list[tuple[list[float], float]], pull: float = 1e-3) -> list[float]:
    """Scales ``s`` (one per column, in [0.01, 1e4]) minimising ``|A s - r|^2 + pull * sum n_k (s_k - 1)^2``.

    ``n_k`` is the squared size of column k, so the pull is the same for every part whatever its seconds; a column
    that is zero in every row keeps its scale at 1.
    """
    k = len(rows[0][0])
    norm = [sum(r[0][i] ** 2 for r in rows) for i in range(k)]
    m = [[sum(r[0][i] * r[0][j] for r in rows) + (pull * norm[i] if i == j else 0.0) for j in range(k)]
         for i in range(k)]  # fmt: skip
    v = [sum(r[0][i] * r[1] for r in rows) + pull * norm[i] for i in range(k)]
    for i in range(k):  # a part absent from every trial: pin its scale at 1
        if norm[i] == 0.0:
            m[i] = [1.0 if j == i else 0.0 for j in range(k)]
            v[i] = 1.0
            for r in range(k):
                if r != i:
                    m[r][i] = 0.0
    for col in range(k):  # Gauss-Jordan with partial pivoting
        piv = max(range(col, k), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        v[col], v[piv] = v[piv], v[col]
        if abs(m[col][col]) < 1e-300:
            continue
        for r in range(k):
            if r != col and m[r][col]:
                f = m[r][col] / m[col][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[col], strict=True)]
                v[r] -= f * v[col]
    return [min(1e4, max(1e-2, v[i] / m[i][i])) if m[i][i] else 1.0 for i in range(k)]


# ---------------------------------------------------------------------------------------------------------------
# Trials
# ---------------------------------------------------------------------------------------------------------------
def _replan(base: Any, strategy: str, dims: Any, micro_batch: int) -> Any:
    """The base plan's inputs with one candidate's strategy and degrees, at ``micro_batch``."""
    from ..plan.planner import plan

    fixed = {k: getattr(dims, k) for k in ("tp", "pp", "cp", "ep") if getattr(dims, k) > 1}
    training = replace(base.training, micro_batch=micro_batch)
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


def trial_grid(
    plan: Any, *, top: int = 3, candidates: Sequence[str] | None = None, micro_batches: Sequence[int] | None = None,
) -> tuple[list[Any], list[int]]:
    """The candidates to measure (the plan's ``top`` fitting ones, or those named) and the micro-batch sizes.

    The sizes default to the planned one and its neighbours (half and double); a neighbour the plan says does not
    fit is skipped when the trials run.
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
        chosen = [c for c in plan.candidates if c.fits][:top]
        if not chosen:
            raise JupyterDistError("nothing in the plan fits: there is no candidate to measure")
    planned = plan.training.micro_batch
    if micro_batches is None:
        sizes = sorted({planned, *(b for b in (planned // 2, planned * 2) if b >= 1)})
    else:
        sizes = sorted(set(micro_batches))
        if not sizes or min(sizes) < 1:
            raise JupyterDistError(f"--micro-batches must be positive integers, got {list(micro_batches)}")
    return chosen, sizes


def tune(
    code: str | None, plan: Any, *, top: int = 3, micro_batches: Sequence[int] | None = None,
    candidates: Sequence[str] | None = None, steps: int = 8, nproc: int | None = None, nodes: int | None = None,
    backend: str = "local", cluster: Any = None, runs_dir: str = "runs", name: str = "tune",
    trial_timeout: float = 300.0, save: bool = True, env: dict[str, str] | None = None,
    on_trial: Callable[[TuneResult], None] | None = None,
) -> TuneResult:
    """Run the plan's top ``top`` fitting candidates (or the named ``candidates``) at each micro-batch size.

    ``micro_batches`` defaults to the planned one and its neighbours (half and double) where they fit.
    ``on_trial`` is called with the result after every trial (the magic redraws its table and chart there).
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
    chosen, sizes = trial_grid(plan, top=top, candidates=candidates, micro_batches=micro_batches)
    planned = plan.training.micro_batch
    model = plan.model
    cell = code if code and code.strip() else TUNE_CELL
    world = plan.hardware.world_size
    nodes = nodes or plan.hardware.nodes
    nproc = nproc or world // nodes
    result = TuneResult(base=plan)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for cand in chosen:
        for mb in sizes:
            try:
                trial_plan = _replan(plan, cand.strategy, cand.dims, mb)
                predicted = trial_plan.candidate(cand.name)
            except (JupyterDistError, KeyError):
                if mb == planned:
                    raise
                continue  # e.g. a micro-batch the global batch does not divide into
            if mb != planned and not predicted.fits:
                continue  # a neighbour the plan says does not fit: not worth a run
            trial_env = {"JD_MICRO_BATCH": str(mb), "JD_SEQ_LEN": str(plan.training.seq_len),
                         "JD_TUNE_STEPS": str(steps),
                         "JD_TUNE_MODEL": f"{model.vocab},{model.hidden},{model.layers},{model.heads}",
                         **(env or {})}  # fmt: skip
            trial = _run_trial(start_run, cell, trial_plan, predicted, mb, nproc=nproc, nodes=nodes, backend=backend,
                               cluster=cluster, runs_dir=runs_dir, name=f"{name}-{stamp}-{len(result.trials)}",
                               env=trial_env, timeout=trial_timeout)  # fmt: skip
            result.trials.append(replace(trial, accelerator=trial_plan.hardware.accelerator))
            if on_trial is not None:
                on_trial(result)
    _finish(result, save=save, source=str(Path(runs_dir).expanduser().resolve()))
    if on_trial is not None:
        on_trial(result)
    return result


def _run_trial(
    start_run: Callable[..., Any], cell: str, trial_plan: Any, predicted: Any, mb: int, *, nproc: int, nodes: int,
    backend: str, cluster: Any, runs_dir: str, name: str, env: dict[str, str], timeout: float,
) -> Trial:
    """One trial: start it like %%dist_train, wait, measure; a failure is a result."""
    try:
        run = start_run(cell, nproc=nproc, nodes=nodes, strategy=predicted.name, plan=trial_plan, name=name,
                        runs_dir=runs_dir, timeout=timeout, env=env, backend=backend, cluster=cluster,
                        worker={"telemetry_interval_s": 0.0, "heartbeat_s": 0.25})  # fmt: skip
    except JupyterDistError as exc:
        return Trial(candidate=predicted.name, micro_batch=mb, predicted=predicted, status="failed (measured)",
                     error=str(exc).splitlines()[0][:160])  # fmt: skip
    run.wait()
    measured = measure_run(run)
    if run.status == "succeeded":
        if measured.step_time_s is None:
            return Trial(candidate=predicted.name, micro_batch=mb, predicted=predicted, status="failed (measured)",
                         measured=measured, error=f"fewer than {WARMUP_STEPS + 2} steps logged with jd.log",
                         run_dir=str(run.dir))  # fmt: skip
        return Trial(candidate=predicted.name, micro_batch=mb, predicted=predicted, status="ok", measured=measured,
                     run_dir=str(run.dir))  # fmt: skip
    status, why = _classify(run)
    return Trial(candidate=predicted.name, micro_batch=mb, predicted=predicted, status=status, measured=measured,
                 error=why, run_dir=str(run.dir))  # fmt: skip


def _finish(result: TuneResult, *, save: bool, source: str) -> None:
    """Fit and save the calibration; the best measured candidate, re-planned with it, becomes ``result.plan``."""
    from ..plan.planner import plan as make_plan

    ok = [t for t in result.trials if t.ok]
    if not ok:
        return
    cal = fit_calibration(ok, source=source)
    result.calibration = cal
    if cal is not None and save:
        result.calibration_path = str(cal.save())
    best = result.best
    assert best is not None
    base = result.base
    dims = best.predicted.dims
    fixed = {k: getattr(dims, k) for k in ("tp", "pp", "cp", "ep") if getattr(dims, k) > 1}
    shape = replace(base.training, micro_batch=best.micro_batch)
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


def _has(plan: Any, name: str) -> bool:
    return any(c.name == name for c in plan.candidates)


# ---------------------------------------------------------------------------------------------------------------
# Flags (shared by ``jupyter-dist tune`` and ``%dist_tune``)
# ---------------------------------------------------------------------------------------------------------------
def add_tune_arguments(p: Any) -> None:
    """The tune flags; the plan flags (``add_plan_arguments``) say what is planned."""
    from ..cli import MAX_SECONDS, float_arg, int_arg

    g = p.add_argument_group("tune")
    g.add_argument("--top", type=int_arg(1, 32), default=3, help="measure the plan's N best fitting candidates (3)")
    g.add_argument("--candidates", metavar="A,B,...", help="measure these candidates instead (names the plan prints)")
    g.add_argument("--micro-batches", metavar="N,M,...",
                   help="micro-batch sizes to try (default: the planned one, half and double)")  # fmt: skip
    g.add_argument("--steps", type=int_arg(WARMUP_STEPS + 1, 10_000), default=8,
                   help=f"steps per trial, the first {WARMUP_STEPS} not timed (default 8)")  # fmt: skip
    g.add_argument("--trial-timeout", type=float_arg(0.0, MAX_SECONDS, lo_open=True), default=300.0, metavar="S",
                   help="stop a trial after S seconds (a result: failed, measured; default 300)")  # fmt: skip
    g.add_argument("--no-save", action="store_true", help="do not save the calibration for this hardware")
    g.add_argument("--tune-runs-dir", dest="tune_runs_dir", default=None, metavar="DIR",
                   help="where the trials' run directories go (default ./runs)")  # fmt: skip
    g.add_argument("--backend", choices=("local", "slurm", "skypilot"), default=None,
                   help="where the trials run, as for %%%%dist_train (default local)")  # fmt: skip


def _csv(text: str | None, what: str, conv: Callable[[str], Any] = str) -> list[Any] | None:
    if not text:
        return None
    try:
        return [conv(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        raise JupyterDistError(f"{what} wants a comma-separated list, got {text!r}") from None


def tune_from_args(
    args: Any, *, plan: Any = None, code: str | None = None, runs_dir: str | None = None,
    on_trial: Callable[[TuneResult], None] | None = None, cluster: Any = None,
) -> TuneResult:
    """Plan from the flags (unless ``plan`` is given), check the machine can run it, and tune."""
    from ..cli import plan_from_args
    from .session import local_gpu_count

    if plan is None:
        plan = plan_from_args(args)
    backend = args.backend or "local"
    acc = plan.hardware.accelerator
    if backend == "local":
        gpus = local_gpu_count()
        if acc.vendor == "cpu" and gpus:
            pass  # CPU processes on a GPU machine are fine: the plan is for them
        elif acc.vendor != "cpu" and gpus < plan.hardware.gpus_per_node:
            raise JupyterDistError(
                f"the plan is for {plan.hardware.gpus_per_node} x {acc.label} per node but this machine has {gpus} "
                "GPU(s): tune locally with --gpu cpu --gpus-per-node N (CPU processes), or use --backend slurm/skypilot"
            )
    sizes = _csv(getattr(args, "micro_batches", None), "--micro-batches", int)
    names = _csv(getattr(args, "candidates", None), "--candidates")
    return tune(code, plan, top=args.top, micro_batches=sizes, candidates=names, steps=args.steps,
                backend=backend, cluster=cluster, runs_dir=args.tune_runs_dir or runs_dir or "runs",
                trial_timeout=args.trial_timeout, save=not args.no_save, on_trial=on_trial)  # fmt: skip
