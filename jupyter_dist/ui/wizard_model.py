"""What the strategy wizard shows, computed without any widget: answers in, plan and views out (stdlib only).

The wizard (:mod:`jupyter_dist.ui.wizard`) is controls plus this module: it copies its control values into a
:class:`WizardInputs`, calls :func:`evaluate` (which calls the pure planner and nothing else decides), and shows
the HTML and figure dicts built here. Errors are not raised to the widget: :func:`evaluate` maps each one to the
input it concerns (``Answer.problems``), so the panel can show it next to that control and never a traceback.
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..errors import JupyterDistError
from ..plan import (
    ACCELERATORS,
    INTERCONNECTS,
    Assumptions,
    Candidate,
    Hardware,
    ModelSpec,
    Plan,
    TrainingShape,
    get_accelerator,
    get_strategy,
    plan,
    preset_names,
)
from ..plan.training import precision_names
from ..plan.units import GiB, fmt_count
from .figures import Figure

__all__ = [
    "Answer",
    "MODEL_SOURCES",
    "WHATIF_VALUES",
    "WizardInputs",
    "chart_rows",
    "evaluate",
    "inputs_from_args",
    "memory_figure",
    "precision_choices",
    "summary_html",
    "tp_layout_html",
    "tp_layout_of",
    "train_line",
    "whatif",
    "whatif_html",
]

MODEL_SOURCES = ("preset", "dims", "hf", "module")
"""Where the model comes from: a preset name, dimensions, a Hugging Face config.json, a measured nn.Module."""

DIM_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "experts", "top_k")
"""Dimension inputs; 0 in ``kv_heads``, ``ffn``, ``experts``, ``top_k`` means "the default"."""


def precision_choices(gpu: str) -> list[str]:
    """The precisions the wizard offers for this accelerator: ``fp8`` only where it has FP8 tensor cores."""
    acc = ACCELERATORS.get(gpu)
    return [p for p in precision_names() if p != "fp8" or (acc is not None and acc.supports_fp8)]


WHATIF_VALUES: dict[str, tuple[int, ...]] = {
    "nodes": (1, 2, 4, 8, 16, 32, 64),
    "micro_batch": (1, 2, 4, 8, 16, 32),
    "seq_len": (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536),
}
"""The values the what-if sliders step through (powers of two)."""

# memory components, bottom to top of each stacked bar, with their colours
COMPONENTS = (
    ("params", "parameters", "#1f77b4"),
    ("grads", "gradients (at the peak)", "#ff7f0e"),
    ("optimizer", "optimizer states", "#2ca02c"),
    ("activations", "activations", "#9467bd"),
    ("overhead", "overhead", "#8c8c8c"),
)
FIT, TIGHT, NOFIT = "#2e7d32", "#ef6c00", "#c62828"
NEEDS = "#757575"
"""A candidate the given module cannot run (``Candidate.needs``; the plan's warnings say why in full)."""


@dataclass(kw_only=True)
class WizardInputs:
    """Every answer the wizard asks for; the defaults are what the panel starts with."""

    source: str = "preset"
    preset: str = "llama-2-7b"
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 0
    ffn: int = 0
    vocab: int = 32000
    experts: int = 0
    top_k: int = 0
    hf_config: str = ""
    """config.json text (uploaded or pasted)."""
    module_spec: ModelSpec | None = None
    """A model measured on the meta device (``Wizard(model=...)``)."""
    gpu: str = "h100-80gb"
    gpus_per_node: int = 8
    nodes: int = 1
    interconnect: str = "auto"
    micro_batch: int = 1
    seq_len: int = 2048
    batch_mode: str = "accum"
    """``accum`` (``grad_accum`` given) or ``global`` (``global_batch`` given)."""
    grad_accum: int = 1
    global_batch: int = 512
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    checkpointing: str = "none"
    flash_attn: bool = True
    strategy: str = "auto"
    tp: int = 0
    """0: the planner chooses."""
    pp: int = 0
    """0: the planner chooses."""
    min_headroom: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values (the measured module as its spec dict)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["module_spec"] = self.module_spec.to_dict() if self.module_spec is not None else None
        return out


@dataclass
class Answer:
    """What :func:`evaluate` found: a plan, or the problems that stop one (input name -> one-line message)."""

    inputs: WizardInputs
    plan: Plan | None = None
    problems: dict[str, str] = field(default_factory=dict)
    elapsed_ms: float = 0.0

    @property
    def ok(self) -> bool:
        """A plan was made (it may still recommend nothing when no candidate fits)."""
        return self.plan is not None and not self.problems


_DIM_WORDS = {
    "layers": ("layers", "num_hidden_layers", "n_layer"), "hidden": ("hidden", "d_model", "n_embd"),
    "heads": ("heads", "attention_heads", "n_head"), "kv_heads": ("kv_heads", "kv-heads", "key_value"),
    "ffn": ("ffn", "intermediate"), "vocab": ("vocab",), "experts": ("experts",), "top_k": ("top_k", "top-k"),
}  # fmt: skip


def _model_field(inputs: WizardInputs, message: str) -> str:
    if inputs.source != "dims":
        return {"preset": "preset", "hf": "hf_config", "module": "source"}[inputs.source]
    low = message.lower()
    for name in ("kv_heads", "top_k", "heads", "layers", "hidden", "ffn", "vocab", "experts"):
        if any(w in low for w in _DIM_WORDS[name]):
            return name
    return "layers"


def _model(inputs: WizardInputs) -> ModelSpec:
    if inputs.source not in MODEL_SOURCES:
        raise JupyterDistError(f"model source {inputs.source!r} is not one of {', '.join(MODEL_SOURCES)}")
    if inputs.source == "preset":
        return ModelSpec.from_preset(inputs.preset)
    if inputs.source == "module":
        if inputs.module_spec is None:
            raise JupyterDistError("no model object was given: Wizard(model=my_module) measures one")
        return inputs.module_spec
    if inputs.source == "hf":
        text = inputs.hf_config.strip()
        if not text:
            raise JupyterDistError("paste or upload a Hugging Face config.json")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise JupyterDistError(f"config.json is not valid JSON: {exc.msg} at line {exc.lineno}") from None
        if not isinstance(data, dict):
            raise JupyterDistError(f"config.json must hold a JSON object, got {type(data).__name__}")
        return ModelSpec.from_hf_config(data)
    for name in DIM_FIELDS:
        value = getattr(inputs, name)
        least = 1 if name in ("layers", "hidden", "heads", "vocab") else 0
        if not isinstance(value, int) or value < least:
            what = "a positive integer" if least else "0 (default) or a positive integer"
            raise JupyterDistError(f"{name.replace('_', '-')} must be {what}, got {value!r}")
    dims: dict[str, Any] = {n: getattr(inputs, n) for n in ("layers", "hidden", "heads", "vocab")}
    for name in ("kv_heads", "ffn", "experts", "top_k"):
        if getattr(inputs, name):
            dims[name] = getattr(inputs, name)
    if dims.get("experts") and not dims.get("top_k"):
        dims["top_k"] = 2
    return ModelSpec(name="custom", **dims)


def _hardware(inputs: WizardInputs) -> Hardware:
    ic = None if inputs.interconnect in ("", "auto") else inputs.interconnect
    if not isinstance(inputs.gpus_per_node, int) or inputs.gpus_per_node < 1:
        raise JupyterDistError(f"gpus_per_node must be >= 1, got {inputs.gpus_per_node!r}")
    return Hardware.from_names(inputs.gpu, gpus_per_node=inputs.gpus_per_node, nodes=inputs.nodes,
                               interconnect=ic)  # fmt: skip


def _hardware_field(message: str) -> str:
    low = message.lower()
    if "gpus_per_node" in low or "gpus a node" in low:
        return "gpus_per_node"
    if "nodes" in low:
        return "nodes"
    if "interconnect" in low or "network" in low:
        return "interconnect"
    return "gpu"


def _training(inputs: WizardInputs) -> TrainingShape:
    accum, glob = (inputs.grad_accum, None) if inputs.batch_mode == "accum" else (None, inputs.global_batch)
    if inputs.batch_mode not in ("accum", "global"):
        raise JupyterDistError(f"batch mode {inputs.batch_mode!r} is not 'accum' or 'global'")
    return TrainingShape(micro_batch=inputs.micro_batch, seq_len=inputs.seq_len, grad_accum=accum, global_batch=glob,
                         precision=inputs.precision, optimizer=inputs.optimizer, checkpointing=inputs.checkpointing,
                         flash_attention=bool(inputs.flash_attn))  # fmt: skip


def _training_field(message: str) -> str:
    low = message.lower()
    for words, name in ((("global batch", "global-batch"), "global_batch"), (("grad-accum", "accum"), "grad_accum"),
                        (("micro-batch", "micro_batch"), "micro_batch"), (("seq-len", "seq_len"), "seq_len"),
                        (("precision",), "precision"), (("optimizer",), "optimizer"),
                        (("checkpointing",), "checkpointing")):  # fmt: skip
        if any(w in low for w in words):
            return name
    return "micro_batch"


def _plan_field(inputs: WizardInputs, message: str) -> str:
    low = message.lower()
    if "global batch" in low:
        return "global_batch"
    if low.startswith("tp") or "tp (" in low or "tensor" in low:
        return "pp" if low.startswith("pp") or (inputs.tp in (0, 1) and inputs.pp > 1) else "tp"
    if low.startswith("pp") or "pipeline" in low:
        return "pp"
    if "strategy" in low or "hybrid" in low or "does not combine" in low:
        return "strategy"
    if "head" in low or "layers" in low:
        return _model_field(inputs, message) if inputs.source == "dims" else "tp"
    return "strategy"


def evaluate(inputs: WizardInputs) -> Answer:
    """Plan for ``inputs``; every input error lands in ``Answer.problems`` under the input it concerns."""
    t0 = time.perf_counter()
    answer = Answer(inputs=inputs)
    problems = answer.problems
    spec = hw = shape = None
    try:
        spec = _model(inputs)
    except JupyterDistError as exc:
        problems[_model_field(inputs, str(exc))] = str(exc)
    try:
        hw = _hardware(inputs)
    except JupyterDistError as exc:
        problems[_hardware_field(str(exc))] = str(exc)
    try:
        shape = _training(inputs)
    except JupyterDistError as exc:
        problems[_training_field(str(exc))] = str(exc)
    for name in ("tp", "pp"):
        value = getattr(inputs, name)
        if not isinstance(value, int) or value < 0:
            problems[name] = f"{name.upper()} must be 0 (the planner chooses) or a positive integer, got {value!r}"
    if inputs.strategy != "auto":
        try:
            get_strategy(inputs.strategy)
        except JupyterDistError as exc:
            problems["strategy"] = str(exc)
    if spec is not None and hw is not None and shape is not None and not problems:
        assume = Assumptions() if inputs.min_headroom is None else Assumptions(min_headroom=inputs.min_headroom)
        try:
            from ..plan.calibration import load_calibration, options_key  # %dist_tune's, for these speed options

            answer.plan = plan(spec, hw, shape, strategy=None if inputs.strategy == "auto" else inputs.strategy,
                               tp=inputs.tp or None, pp=inputs.pp or None, assumptions=assume,
                               calibration=load_calibration(hw.accelerator.name,
                                                            options_key(shape, hw.accelerator.vendor)))  # fmt: skip
        except JupyterDistError as exc:
            problems[_plan_field(inputs, str(exc))] = str(exc)
    answer.elapsed_ms = (time.perf_counter() - t0) * 1e3
    return answer


# ---------------------------------------------------------------------------------------------------------------
# Views
# ---------------------------------------------------------------------------------------------------------------
def _short(text: str, limit: int = 90) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _fit_state(c: Candidate, min_headroom: float) -> str:
    if c.needs:  # the given module cannot run it (Candidate.needs says why): never recommended
        return "needs"
    if not c.fits:
        return "no"
    return "tight" if c.memory.headroom < min_headroom else "yes"


def chart_rows(p: Plan, *, show_all: bool = False, limit: int = 14) -> list[Candidate]:
    """The candidates the chart shows: the best variant of each strategy (all of them with ``show_all``)."""
    if show_all:
        return list(p.candidates)
    rows: list[Candidate] = []
    seen: set[str] = set()
    best = p.best
    if best is not None:
        rows.append(best)
        seen.add(best.strategy)
    for c in p.candidates:
        if c.strategy not in seen:
            rows.append(c)
            seen.add(c.strategy)
    return rows[:limit]


def _axis_end(rows: list[Candidate], cap_gib: float) -> float | None:
    """Cut the axis at twice the device memory when a bar goes beyond it (DDP of a 70B model needs ~1.3 TiB)."""
    top = max((c.memory.total / GiB for c in rows), default=0.0)
    return 2 * cap_gib if top > 2.2 * cap_gib else None


def _component(c: Candidate, key: str) -> int:
    """One bar segment; the gradients as they stand at the peak, so that the segments add up to the total.

    FSDP2's gradients reuse memory backward freed (``MemoryBreakdown.grads_reuse``).
    """
    value = getattr(c.memory, key)
    return value - c.memory.grads_reuse if key == "grads" else value


def memory_figure(p: Plan, *, show_all: bool = False) -> Figure:
    """A stacked bar per candidate (GiB per GPU by component) against the device's memory."""
    rows = chart_rows(p, show_all=show_all)
    cap = p.hardware.accelerator.memory_bytes / GiB
    labels, colors = [], []
    for c in rows:
        state = _fit_state(c, p.assumptions.min_headroom)
        words = {"yes": "fits", "tight": "tight", "no": "does not fit",
                 "needs": f"cannot run: {_short(c.needs)}"}[state]  # fmt: skip
        labels.append(f"{c.memory.total / GiB:.1f} " + words)
        colors.append({"yes": FIT, "tight": TIGHT, "no": NOFIT, "needs": NEEDS}[state])
    cats = [("\u2605 " if c.name == p.recommended else "") + c.name for c in rows]
    acc = p.hardware.accelerator
    return {
        "id": "plan-memory", "kind": "hbar", "title": f"Peak memory per {p.hardware.unit}, by strategy",
        "x_title": f"GiB per {p.hardware.unit} (1 GiB = 2^30 bytes)", "categories": cats,
        "series": [{"name": label, "values": [_component(c, key) / GiB for c in rows], "color": color}
                   for key, label, color in COMPONENTS],
        "labels": labels, "label_colors": colors,
        "highlight": [i for i, c in enumerate(rows) if c.name == p.recommended],
        "vlines": [{"x": cap, "name": f"{acc.label}: {cap:.1f} GiB", "color": NOFIT}],
        "x_max": _axis_end(rows, cap),
        "note": "no candidate",
    }  # fmt: skip


def _num(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def _effective_batch(p: Plan, c: Candidate) -> str:
    seqs = p.training.micro_batch * c.grad_accum * c.dims.dp
    return (f"{seqs:,} sequences = {seqs * p.training.seq_len:,} tokens per step (micro-batch {p.training.micro_batch}"
            f" \u00d7 accumulation {c.grad_accum} \u00d7 data-parallel {c.dims.dp})")  # fmt: skip


def summary_html(p: Plan, *, candidate: str | None = None) -> str:
    """The headline (recommendation, fit, speed, effective batch), the reasons and the warnings."""
    e = html.escape
    hw = p.hardware
    head = (f"<div style='color:#555'>{e(p.model.name)}: {fmt_count(p.model.params)} parameters on {hw.nodes} "
            f"\u00d7 {hw.gpus_per_node} {e(hw.accelerator.label)} ({hw.units(p.world_size)})</div>")  # fmt: skip
    best = p.candidate(candidate) if candidate else p.best
    if best is None:
        closest = min(p.candidates, key=lambda c: c.memory.total)
        need = closest.memory.total / GiB
        cap = closest.memory.capacity / GiB
        body = (f"<div class='jd-wiz-verdict' data-fits='no' style='font-size:1.15em;color:{NOFIT}'><b>Nothing fits."
                f"</b> The smallest candidate, {e(closest.name)}, needs {need:.1f} GiB per {hw.unit} of "
                f"{cap:.1f} GiB. More {hw.unit_plural} or nodes, a shorter sequence, a smaller micro-batch, "
                "activation checkpointing or offload can change that (see the warnings).</div>")  # fmt: skip
    else:
        state = _fit_state(best, p.assumptions.min_headroom)
        color = {"yes": FIT, "tight": TIGHT, "no": NOFIT}[state]
        t = best.time
        mem = best.memory
        what = "Recommended" if best.name == p.recommended else "Selected"
        body = (
            f"<div class='jd-wiz-verdict' data-fits='{state}' data-candidate='{e(best.name)}' style='font-size:1.15em'>"
            f"{what}: <b class='jd-wiz-recommended'>{e(best.label)}</b> <code>{e(best.name)}</code></div>"
            "<div style='display:flex;flex-wrap:wrap;gap:4px 18px;margin:4px 0'>"
            f"<span><b style='color:{color}'>{mem.total / GiB:.1f}</b> of {mem.capacity / GiB:.1f} GiB per {hw.unit} "
            f"({max(mem.headroom, 0) * 100:.0f}% free)</span>"
            f"<span><b>{t.step_time_s:.3g} s</b>/step</span>"
            f"<span><b>{_num(t.tokens_per_s)}</b> tokens/s</span>"
            f"<span>MFU <b>{t.mfu * 100:.0f}%</b></span><span>bound by {e(t.bound_label)}</span></div>"
            f"<div class='jd-wiz-breakdown'>Step time: {e(t.describe(6))}</div>"
            f"<div>Effective batch: {e(_effective_batch(p, best))}</div>"
        )  # fmt: skip
    reasons = "".join(f"<li>{e(r)}</li>" for r in p.reasons)
    warns = "".join(f"<li style='color:{TIGHT}'>{e(w)}</li>" for w in p.warnings)
    return (
        f"<div class='jd-wiz-summary' style='line-height:1.45'>{head}{body}"
        + (f"<details><summary>Why ({len(p.reasons)} reasons)</summary><ul>{reasons}</ul></details>" if reasons else "")
        + (f"<div class='jd-wiz-warnings'><b>Warnings</b><ul style='margin:2px 0'>{warns}</ul></div>" if warns else "")
        + "</div>"
    )


def tp_layout_of(p: Plan, candidate: str | None = None) -> Any:
    """The tensor-parallel layout ``jd.wrap`` derives for the measured module under ``candidate``, as plan data.

    ``candidate`` defaults to the recommended one, else the requested one the plan's own table is for; the result is
    a :class:`~jupyter_dist.plan.tp_table.TpLayoutTable`, the one ``%dist_plan`` prints.

    ``None`` where there is none to show: the candidate has tp 1 or is not in the plan, the model is not a measured
    module (a preset, dimensions, a Hugging Face config), or the module has a layout of its own (a ``tp_plan()``
    method, a Hugging Face tp plan). The plan's own table is reused when it is for that candidate.
    """
    name = candidate or p.recommended or p.tp_layout_for
    c = next((x for x in p.candidates if x.name == name), None) if name else None
    if c is None or c.dims.tp <= 1:
        return None
    if p.tp_layout is not None and p.tp_layout_for == c.name:
        return p.tp_layout
    ask = p.model.tp_layout_of
    return ask(c.dims.tp, c.dims.sp) if ask is not None else None


def tp_layout_html(p: Plan, candidate: str | None = None) -> str:
    """:func:`tp_layout_of` as HTML in a ``jd-wiz-tp-layout`` box naming its candidate; ``""`` when none to show.

    The title, the module / style / why table and the notes; or the one line saying why none could be derived.
    """
    table = tp_layout_of(p, candidate)
    if table is None:
        return ""
    name = candidate or p.recommended or p.tp_layout_for or ""
    state = "derived" if table.reason is None else "none"
    return (f"<div class='jd-wiz-tp-layout' data-candidate='{html.escape(name)}' data-layout='{state}' "
            f"style='margin:6px 0;font-size:0.92em'>{table.to_html(name)}</div>")  # fmt: skip


def whatif(inputs: WizardInputs, dim: str, values: Iterable[int] | None = None) -> dict[str, Any]:
    """Re-plan with ``dim`` (nodes, micro_batch or seq_len) at each value; per strategy, its best variant's fit.

    Returns ``{"dim", "values", "strategies", "cells": {strategy: [(state, total GiB, name) | None per value]},
    "recommended": [name | None per value]}``; ``state`` is ``yes``, ``tight`` or ``no``.
    """
    if dim not in WHATIF_VALUES:
        raise JupyterDistError(f"what-if dimension {dim!r} is not one of {', '.join(WHATIF_VALUES)}")
    vals = list(values if values is not None else WHATIF_VALUES[dim])
    cells: dict[str, list[tuple[str, float, str] | None]] = {}
    recommended: list[str | None] = []
    for i, v in enumerate(vals):
        ans = evaluate(replace(inputs, **{dim: v}))
        p = ans.plan
        recommended.append(p.recommended if p is not None and not ans.problems else None)
        if p is None or ans.problems:
            continue
        for c in chart_rows(p, limit=100):
            row = cells.setdefault(c.strategy, [None] * len(vals))
            row[i] = (_fit_state(c, p.assumptions.min_headroom), c.memory.total / GiB, c.name)
    order = sorted(cells, key=lambda s: (-sum(1 for x in cells[s] if x and x[0] != "no"), s))
    return {"dim": dim, "values": vals, "strategies": order, "cells": cells, "recommended": recommended}


_DIM_LABEL = {"nodes": "nodes", "micro_batch": "micro-batch", "seq_len": "sequence length"}


def whatif_html(table: Mapping[str, Any], current: int | None = None) -> str:
    """The what-if table: strategies x values, each cell coloured by fit, the current value outlined."""
    e = html.escape
    vals = table["values"]
    head = "".join(
        f"<th style='padding:2px 6px;{'outline:2px solid #1976d2;' if v == current else ''}'>{v:,}</th>" for v in vals
    )
    rows = []
    for s in table["strategies"]:
        tds = []
        for i, cell in enumerate(table["cells"][s]):
            outline = "outline:2px solid #1976d2;" if vals[i] == current else ""
            if cell is None:
                tds.append(f"<td style='{outline}color:#999;text-align:center'>\u2013</td>")
                continue
            state, gib, name = cell
            bg = {"yes": "#e8f5e9", "tight": "#fff3e0", "no": "#ffebee", "needs": "#eeeeee"}[state]
            mark = {"yes": "\u2713", "tight": "~", "no": "\u2717", "needs": "\u2298"}[state]
            star = " \u2605" if table["recommended"][i] == name else ""
            tds.append(f"<td data-state='{state}' title='{e(name)}: {gib:.1f} GiB per GPU' style='{outline}"
                       f"background:{bg};text-align:center;padding:1px 6px'>{mark} {gib:.0f}{star}</td>")  # fmt: skip
        rows.append(f"<tr data-strategy='{e(s)}'><td style='padding:1px 6px'>{e(s)}</td>{''.join(tds)}</tr>")
    label = _DIM_LABEL.get(table["dim"], table["dim"])
    return (f"<div style='overflow-x:auto'><table class='jd-whatif' data-dim='{e(table['dim'])}' "
            f"style='border-collapse:collapse;font-size:0.9em'><caption style='text-align:left'><b>{e(label)}</b>: "
            "GiB per GPU of each strategy's best variant (\u2713 fits, ~ tight, \u2717 does not fit, \u2298 the model "
            "cannot run it, "
            "\u2605 recommended)"
            f"</caption><tr><th></th>{head}</tr>{''.join(rows)}</table></div>")  # fmt: skip


def train_line(plan_var: str, *, nproc: int, name: str | None = None, extra: str = "") -> str:
    """The ``%%dist_train`` line equivalent to the wizard's Launch button."""
    parts = ["%%dist_train", "--plan", plan_var, "--nproc", str(nproc)]
    if name:
        parts += ["--name", name]
    return " ".join(parts) + (f" {extra}" if extra else "")


def inputs_from_args(args: Any, module_spec: ModelSpec | None = None) -> WizardInputs:
    """Initial wizard answers from ``%dist_plan``-style parsed flags (the flags of ``jupyter-dist plan``)."""
    inp = WizardInputs()
    if getattr(args, "model", None):
        if args.model not in preset_names():
            ModelSpec.from_preset(args.model)  # raises the error that lists the presets
        inp.source, inp.preset = "preset", args.model
    elif getattr(args, "hf_config", None):
        from pathlib import Path

        path = Path(args.hf_config).expanduser()
        path = path / "config.json" if path.is_dir() else path
        try:
            inp.hf_config = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise JupyterDistError(f"--hf-config {args.hf_config}: cannot read it ({exc.strerror})") from None
        inp.source = "hf"
    elif getattr(args, "params", None):
        raise JupyterDistError("the wizard takes --model, --hf-config, --module or dimensions, not --params")
    elif module_spec is not None:
        inp.source, inp.module_spec = "module", module_spec
    dims = {n: getattr(args, n, None) for n in DIM_FIELDS}
    if any(v is not None for v in dims.values()):
        inp.source = "dims"
        base = ModelSpec.from_preset(args.model) if getattr(args, "model", None) else None
        for n in DIM_FIELDS:
            v = dims[n]
            if v is None and base is not None:
                v = getattr(base, n, None) or 0
            if v is not None:
                setattr(inp, n, int(v))
    acc = get_accelerator(args.gpu) if getattr(args, "gpu", None) else ACCELERATORS[inp.gpu]
    inp.gpu = acc.name
    inp.gpus_per_node = args.gpus_per_node or acc.node_gpus
    inp.nodes = args.nodes if args.nodes is not None else 1
    if getattr(args, "interconnect", None):
        if args.interconnect not in INTERCONNECTS:
            raise JupyterDistError(f"--interconnect {args.interconnect!r}; valid: {', '.join(INTERCONNECTS)}")
        inp.interconnect = args.interconnect
    inp.micro_batch, inp.seq_len = args.micro_batch, args.seq_len
    if args.global_batch is not None:
        inp.batch_mode, inp.global_batch = "global", args.global_batch
    elif args.grad_accum is not None:
        inp.grad_accum = args.grad_accum
    inp.precision, inp.optimizer, inp.checkpointing = args.precision, args.optimizer, args.checkpointing
    inp.flash_attn = bool(args.flash_attn)
    if args.strategy:
        inp.strategy = get_strategy(args.strategy).name
    inp.tp, inp.pp = args.tp or 0, args.pp or 0
    inp.min_headroom = args.min_headroom
    return inp
