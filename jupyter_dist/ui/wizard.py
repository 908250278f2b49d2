"""The strategy wizard: ipywidgets controls, one handler that calls the pure planner, and the answer under them.

``Wizard()`` (or ``%dist_wizard``) shows, recomputed on every change: the recommendation with its reasons and
warnings, a per-GPU memory chart of every strategy against the device limit, speed and the effective batch; a
what-if table per slider (nodes, micro-batch, sequence length) showing where each strategy stops fitting; every
artifact of the compiler's bundle with copy, download and "write to folder"; and a Launch button that runs the plan
with ``%%dist_train`` semantics and shows the run's live panels (on SkyPilot, the Launch tab first prices the requested
nodes per hour and the run, the planned step time x Steps, from SkyPilot's price list, as the dry run does), with a
Rehearse button beside it that runs the plan's worst ranks on this machine, each alone with a fake process group
(:mod:`jupyter_dist.launch.rehearse`), and shows their bytes beside the plan's.

Planning and compiling live elsewhere: the handler copies control values into a
:class:`~jupyter_dist.ui.wizard_model.WizardInputs`, calls :func:`~jupyter_dist.ui.wizard_model.evaluate`
(the planner) and :func:`~jupyter_dist.render.bundle.render_bundle` (the compiler), and shows what they return.
Invalid inputs are shown as a one-line message next to their control; the panel never shows a traceback.

What the Launch tab does (start the run through ``%%dist_train``, rehearse it, price it on SkyPilot) is
:class:`~.wizard_launch.LaunchTab`, in its own module. The rest is one piece: the controls, the one change handler
and the Plan, What-if and Configs tabs it redraws share the controls' state.
"""

from __future__ import annotations

import base64
import contextlib
import html
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..errors import JupyterDistError, MissingDependencyError
from ..plan import ACCELERATORS, INTERCONNECTS, ModelSpec, Plan, preset_names, strategy_names
from ..plan.units import GiB
from .static import figure_svg
from .wizard_launch import LaunchTab, cost_flags
from .wizard_model import (
    DIM_FIELDS,
    WHATIF_VALUES,
    Answer,
    WizardInputs,
    evaluate,
    memory_figure,
    precision_choices,
    summary_html,
    tp_layout_html,
    whatif,
    whatif_html,
)

__all__ = ["Wizard", "BUNDLE_FILES", "cost_flags"]

log = logging.getLogger(__name__)

BUNDLE_FILES = ("plan.json", "train.py", "ds_config.json", "accelerate_config.yaml", "launch.sh", "skypilot.yaml",
                "job.sbatch", "nccl.env")  # fmt: skip
"""The Configs tabs, in order (the compiler's bundle; a file a strategy does not use says so)."""

_TABS = ("Plan", "What-if", "Configs", "Launch")
_PLAN_TAB, _WHATIF_TAB, _CONFIGS_TAB, _LAUNCH_TAB = range(4)
_WARN = "#c62828"


def _widgets() -> Any:
    try:
        import ipywidgets
    except ImportError:
        raise MissingDependencyError('the wizard needs ipywidgets: pip install "jupyter-dist[notebook]"') from None
    return ipywidgets


def _row(w: Any) -> Any:
    """Let a control take the column's width (no fixed widths beyond the cell)."""
    w.layout.width = "auto"
    w.layout.flex = "1 1 auto"
    w.layout.min_width = "0"
    w.style.description_width = "108px"
    return w


def _file_pane(name: str, text: str, description: str) -> str:
    e = html.escape
    data = base64.b64encode(text.encode()).decode()
    return (
        f"<div class='jd-wiz-file' data-file='{e(name)}'><div style='margin:2px 0 4px 0'>"
        f"<button class='jd-copy' onclick=\"navigator.clipboard.writeText(atob('{data}'))\">Copy</button> "
        f"<a download='{e(name)}' href='data:text/plain;base64,{data}'><button>Download</button></a> "
        f"<small style='color:#555'>{e(description)}</small></div>"
        f"<pre style='max-height:360px;overflow:auto;margin:0;white-space:pre'>{e(text)}</pre></div>"
    )


class Wizard(LaunchTab):
    """Plan live in a notebook: controls, the recommendation, what-if, configs and a Launch button.

    Parameters
    ----------
    model
        An ``nn.Module`` (or a class / factory building one) measured on the meta device, or a preset name, or a
        :class:`~jupyter_dist.plan.ModelSpec`; default: the ``llama-2-7b`` preset.
    inputs
        Initial answers (a :class:`~jupyter_dist.ui.wizard_model.WizardInputs`); keyword ``answers`` override
        single fields, e.g. ``Wizard(gpu="a100-80gb", nodes=2, seq_len=4096)``.
    code
        The training cell the Launch button runs (default: the demo's small transformer LM, 100 steps).
    plan_var
        The notebook variable the launched plan is bound to (the printed ``%%dist_train --plan`` line uses it).
    runs_dir
        Where Launch puts run directories.

    Examples
    --------
    ::

        from jupyter_dist import Wizard
        w = Wizard(model=MyTransformer, gpu="h100-80gb", nodes=2)
        w                      # displays the panel
        w.plan.best.name       # the current recommendation
        w.bundle.files["ds_config.json"]
    """

    def __init__(self, model: Any = None, *, inputs: WizardInputs | None = None, code: str | None = None,
                 plan_var: str = "wizard_plan", runs_dir: str | os.PathLike[str] = "runs", shell: Any = None,
                 **answers: Any) -> None:  # fmt: skip
        ipw = _widgets()
        if not plan_var.isidentifier():
            raise JupyterDistError(f"plan_var {plan_var!r} must be a valid Python variable name")
        inp = inputs if inputs is not None else WizardInputs()
        known = {f.name for f in fields(WizardInputs)}
        for key, value in answers.items():
            if key not in known:
                raise JupyterDistError(f"unknown wizard input {key!r}; valid: {', '.join(sorted(known))}")
            setattr(inp, key, value)
        if model is not None:
            if isinstance(model, str):
                inp.source, inp.preset = "preset", model
            else:
                spec = model if isinstance(model, ModelSpec) else ModelSpec.from_module(model)
                inp.source, inp.module_spec = "module", spec
        self.inputs = inp
        self.module: Any = model if model is not None and not isinstance(model, (str, ModelSpec)) else None
        """The model object given (a class, a factory or ``"pkg.mod:Factory"``): what Rehearse builds."""
        self.rehearsal: Any = None
        """The last :class:`~jupyter_dist.launch.rehearse.Rehearsal` Rehearse finished."""
        self.rehearsal_thread: Any = None
        """The thread of the last rehearsal (a second one is refused while it runs)."""
        self.plan_var = plan_var
        self.runs_dir = runs_dir
        self._shell = shell
        self.answer: Answer | None = None
        self.plan: Plan | None = None
        """The current plan (the last valid one while an input is wrong)."""
        self.bundle: Any = None
        """The compiled bundle of the selected candidate (``None`` when it cannot be compiled)."""
        self.run: Any = None
        """The last run started with Launch."""
        self.dashboard: Any = None
        self.last_update_ms = 0.0
        """Wall time of the last recompute (planner, chart, configs, widget values), in milliseconds."""
        self.updates = 0
        self._holding = 0
        self._whatif_stale = True
        self._syncing = False
        self.chart_figure: dict[str, Any] | None = None
        """The figure dict the chart was drawn from (see :mod:`jupyter_dist.ui.figures`)."""
        self.train_line = ""
        """The ``%%dist_train`` line equivalent to the last Launch."""
        self._build(ipw, code)
        self.refresh()

    # ---- construction ---------------------------------------------------------------------------------------
    def _build(self, ipw: Any, code: str | None) -> None:
        inp = self.inputs
        c: dict[str, Any] = {}
        sources = [("Preset", "preset"), ("Dimensions", "dims"), ("HF config", "hf")]
        if inp.module_spec is not None:
            sources.append(("Module", "module"))
        c["source"] = ipw.ToggleButtons(options=sources, value=inp.source, tooltips=[
            "a preset from the catalog", "layers, widths, heads, experts", "a Hugging Face config.json",
            "the model object given to Wizard(model=...)"][: len(sources)])
        c["source"].style.button_width = "auto"
        c["preset"] = ipw.Dropdown(options=preset_names(), value=inp.preset, description="Preset")
        dim_desc = {"layers": "Layers", "hidden": "Hidden size", "heads": "Heads", "kv_heads": "KV heads (0=heads)",
                    "ffn": "FFN (0=auto)", "vocab": "Vocabulary", "experts": "Experts (0=dense)",
                    "top_k": "Top-k (0=2)"}  # fmt: skip
        for name in DIM_FIELDS:
            c[name] = ipw.IntText(value=getattr(inp, name), description=dim_desc[name])
        c["hf_config"] = ipw.Textarea(value=inp.hf_config, description="config.json",
                                      placeholder='paste a Hugging Face config.json: {"model_type": "llama", ...}',
                                      rows=5)  # fmt: skip
        self.upload = ipw.FileUpload(accept=".json", multiple=False, description="Upload config.json")
        self.module_label = ipw.HTML()
        c["gpu"] = ipw.Dropdown(
            options=[(f"{a.label} ({a.memory_bytes / GiB:.0f} GiB)", k) for k, a in ACCELERATORS.items()],
            value=inp.gpu, description="Accelerator",
        )  # fmt: skip
        c["gpus_per_node"] = ipw.IntText(value=inp.gpus_per_node, description="GPUs per node")
        c["nodes"] = ipw.IntText(value=inp.nodes, description="Nodes")
        c["interconnect"] = ipw.Dropdown(options=[("auto (typical for the accelerator)", "auto")]
                                         + [(i.label, k) for k, i in INTERCONNECTS.items()],
                                         value=inp.interconnect, description="Interconnect")  # fmt: skip
        c["micro_batch"] = ipw.IntText(value=inp.micro_batch, description="Micro-batch")
        c["seq_len"] = ipw.IntText(value=inp.seq_len, description="Seq. length")
        c["batch_mode"] = ipw.ToggleButtons(options=[("Accumulation", "accum"), ("Global batch", "global")],
                                            value=inp.batch_mode,
                                            tooltips=["micro-batches accumulated per step",
                                                      "sequences per optimizer step over all GPUs"])  # fmt: skip
        c["batch_mode"].style.button_width = "auto"
        c["grad_accum"] = ipw.IntText(value=inp.grad_accum, description="Grad. accum.")
        c["global_batch"] = ipw.IntText(value=inp.global_batch, description="Global batch")
        precisions = precision_choices(inp.gpu)  # fp8 only on a GPU with FP8 tensor cores
        c["precision"] = ipw.Dropdown(options=precisions + [inp.precision] * (inp.precision not in precisions),
                                      value=inp.precision, description="Precision")  # fmt: skip
        c["optimizer"] = ipw.Dropdown(options=["adamw", "adamw-8bit", "sgd"], value=inp.optimizer,
                                      description="Optimizer")  # fmt: skip
        ac = ["none", "selective", "op", "layer:2", "full"]  # plan.training.AC_NAMES, with layer:K at K = 2
        c["checkpointing"] = ipw.Dropdown(options=ac + [inp.checkpointing] * (inp.checkpointing not in ac),
                                          value=inp.checkpointing, description="Checkpointing")  # fmt: skip
        c["flash_attn"] = ipw.Checkbox(value=inp.flash_attn, description="Flash attention", indent=True)
        c["strategy"] = ipw.Dropdown(options=[("auto (best that fits)", "auto"), *((s, s) for s in strategy_names())],
                                     value=inp.strategy, description="Strategy")  # fmt: skip
        c["tp"] = ipw.IntText(value=inp.tp, description="TP (0=auto)")
        c["pp"] = ipw.IntText(value=inp.pp, description="PP (0=auto)")
        self.controls = c
        self.messages = {name: ipw.HTML(layout=ipw.Layout(margin="0 0 0 8px")) for name in c}
        self.rows = {}
        for name, w in c.items():
            _row(w)
            msg = self.messages[name]
            msg.add_class("jd-wiz-msg")
            box = ipw.VBox([w, msg], layout=ipw.Layout(width="100%", margin="0"))
            box.add_class(f"jd-wiz-{name.replace('_', '-')}")
            self.rows[name] = box
        self.upload.observe(self._on_upload, names="value")
        for w in c.values():
            w.observe(self._on_change, names="value")

        def section(title: str, names: list[str], extra: tuple[Any, ...] = ()) -> Any:
            head = ipw.HTML(f"<b>{title}</b>")
            return ipw.VBox([head, *(self.rows[n] for n in names), *extra],
                            layout=ipw.Layout(min_width="0", overflow="hidden"))  # fmt: skip

        self.dims_box = ipw.VBox([self.rows[n] for n in DIM_FIELDS])
        self.hf_box = ipw.VBox([self.rows["hf_config"], self.upload])
        model_box = section("Model", ["source", "preset"], (self.dims_box, self.hf_box, self.module_label))
        hw_box = section("Hardware", ["gpu", "gpus_per_node", "nodes", "interconnect"])
        train_box = section("Training", ["micro_batch", "seq_len", "batch_mode", "grad_accum", "global_batch"])
        num_box = section("Numerics and memory", ["precision", "optimizer", "checkpointing", "flash_attn"])
        par_box = section("Parallelism", ["strategy", "tp", "pp"])
        grid = ipw.GridBox([model_box, hw_box, train_box, num_box, par_box], layout=ipw.Layout(
            grid_template_columns="repeat(auto-fit, minmax(250px, 1fr))", grid_gap="2px 16px", width="100%"))

        # the answer
        self.status = ipw.HTML()
        self.status.add_class("jd-wiz-status")
        self.summary = ipw.HTML()
        self.summary.add_class("jd-wiz-summary-box")
        self.chart = ipw.HTML(layout=ipw.Layout(width="100%"))
        self.chart.add_class("jd-wiz-chart")
        self.show_all = ipw.Checkbox(value=False, description="all candidates (with TP/PP/CP/EP variants)",
                                     indent=False)  # fmt: skip
        self.show_all.observe(lambda _: self._draw_chart(), names="value")
        self.tp_layout = ipw.HTML(layout=ipw.Layout(width="100%", overflow="auto"))
        """The tensor-parallel layout ``jd.wrap`` derives for the selected candidate when it has tp > 1 and the model
        is a measured module (the table ``%dist_plan`` prints); empty otherwise. Shown on the Plan and Configs tabs."""
        plan_tab = ipw.VBox([self.summary, self.tp_layout, self.chart, self.show_all])

        # what-if
        self.sliders = {}
        self.whatif_tables = {}
        boxes = []
        for dim, values in WHATIF_VALUES.items():
            sl = ipw.SelectionSlider(options=[(f"{v:,}", v) for v in values], description=dim.replace("_", "-"),
                                     continuous_update=False)  # fmt: skip
            sl.value = self._nearest(dim, getattr(inp, dim))
            _row(sl)
            sl.observe(self._on_slider, names="value")
            self.sliders[dim] = sl
            table = ipw.HTML()
            table.add_class(f"jd-whatif-{dim.replace('_', '-')}")
            self.whatif_tables[dim] = table
            boxes += [sl, table]
        whatif_tab = ipw.VBox([ipw.HTML("<small>Each slider moves its input above; the tables re-plan at every "
                                        "value and show where each strategy stops fitting.</small>"), *boxes])

        # configs
        self.candidate = _row(ipw.Dropdown(options=[("recommended", "")], value="", description="Compile"))
        self.launcher = _row(ipw.Dropdown(options=["torchrun", "deepspeed", "accelerate"], value="torchrun",
                                          description="Launcher"))  # fmt: skip
        self.candidate.observe(self._on_compile_change, names="value")
        self.launcher.observe(self._on_compile_change, names="value")
        self.compile_msg = ipw.HTML()
        self.commands = ipw.HTML()
        self.file_panes = {name: ipw.HTML(layout=ipw.Layout(width="100%")) for name in BUNDLE_FILES}
        self.files_tab = ipw.Tab(children=[self.file_panes[n] for n in BUNDLE_FILES], titles=list(BUNDLE_FILES))
        self.folder = _row(ipw.Text(value="jupyter-dist-configs", description="Folder"))
        self.write_button = ipw.Button(description="Write to folder", icon="save")
        self.write_button.on_click(lambda _: self.write_configs())
        self.write_msg = ipw.HTML()
        configs_tab = ipw.VBox([
            ipw.HBox([self.candidate, self.launcher], layout=ipw.Layout(flex_flow="row wrap", width="100%")),
            self.compile_msg, self.tp_layout, self.commands, self.files_tab,
            ipw.HBox([self.folder, self.write_button], layout=ipw.Layout(width="100%")), self.write_msg,
        ])  # fmt: skip

        # launch
        from ..launch.base import BACKEND_SPECS, DEFAULT_BACKEND
        from ..launch.examples import DEMO_CELL

        self.backend = _row(ipw.Dropdown(options=[(s.label, s.name) for s in BACKEND_SPECS.values()],
                                         value=DEFAULT_BACKEND, description="Run on"))  # fmt: skip
        self.nproc = _row(ipw.IntText(value=2, description="Procs per node"))
        self.launch_nodes = _row(ipw.IntText(value=1, description="Nodes"))
        steps_tip = "optimizer steps the run takes: SkyPilot's cost estimate"
        self.launch_steps = _row(ipw.IntText(value=100, description="Steps", tooltip=steps_tip))
        self.run_name = _row(ipw.Text(value="wizard", description="Run name"))
        self.cluster_flags = _row(ipw.Text(value="", description="Cluster flags",
                                           placeholder="SLURM: --partition gpu --time 02:00:00 | SkyPilot: --gpus "
                                                       "H100:8 --infra aws --down"))  # fmt: skip
        self.launch_out = ipw.Output(layout=ipw.Layout(width="100%"))
        self.code = ipw.Textarea(value=code if code is not None else DEMO_CELL.format(steps=100).strip() + "\n",
                                 description="Training cell", rows=10, layout=ipw.Layout(width="100%"))  # fmt: skip
        self.code.style.description_width = "108px"
        self.launch_button = ipw.Button(description="Launch", icon="play", button_style="success")
        self.launch_button.on_click(lambda _: self.launch())
        self.rehearse_button = ipw.Button(description="Rehearse", icon="flask",
                                          tooltip="run the plan's worst ranks here, each alone with a fake process "
                                                  "group of the plan's world: their real bytes beside the plan's")
        self.rehearse_button.on_click(lambda _: self.rehearse())
        self.save_calibration_button = ipw.Button(description="Save calibration", icon="save", disabled=True,
                                                  tooltip="later plans of this shape on this hardware take the "
                                                          "rehearsed peak for this candidate")  # fmt: skip
        """Enabled once a rehearsal ran every rank: saves its memory as this hardware's calibration."""
        self.save_calibration_button.on_click(lambda _: self.save_rehearsal_calibration())
        self.rehearse_msg = ipw.HTML()
        self.rehearse_msg.add_class("jd-wiz-rehearse-msg")
        self.rehearse_log = ipw.HTML()
        """A line per finished rank of the running rehearsal."""
        self.rehearse_out = ipw.Output(layout=ipw.Layout(width="100%"))
        """The last rehearsal's table."""
        self.launch_msg = ipw.HTML()
        self.launch_msg.add_class("jd-wiz-launch-msg")
        self.price = ipw.HTML()
        """The cost line on SkyPilot: the requested nodes' hourly price and the run's estimate (empty elsewhere)."""
        self.price.add_class("jd-wiz-price")
        self._prices: dict[tuple[Any, ...], Any] = {}  # (accelerator, per node, nodes, infra, spot) -> Price
        for w in (self.backend, self.nproc, self.launch_nodes, self.launch_steps, self.cluster_flags):
            w.observe(lambda _: self._guard(self._draw_price), names="value")
        self.launch_line = ipw.HTML()
        self.launch_area = ipw.Box(layout=ipw.Layout(width="100%"))
        launch_tab = ipw.VBox([
            ipw.HTML("<small>Runs the selected candidate's strategy with <code>%%dist_train --plan</code>: on this "
                     "machine's processes (CPU/gloo without GPUs), or on a SLURM or SkyPilot cluster, and shows its "
                     "live panels here. <i>Rehearse</i> runs the plan's worst ranks on this machine instead, each "
                     "alone in a process with a fake process group of the plan's world, and sets their bytes beside "
                     "the plan's.</small>"),
            ipw.HBox([self.backend, self.nproc, self.launch_nodes, self.launch_steps, self.run_name],
                     layout=ipw.Layout(flex_flow="row wrap", width="100%")),
            self.cluster_flags, self.price, self.code,
            ipw.HBox([self.launch_button, self.rehearse_button, self.save_calibration_button]),
            self.rehearse_msg, self.rehearse_log, self.rehearse_out, self.launch_msg, self.launch_line,
            self.launch_out, self.launch_area,
        ])  # fmt: skip

        self.tabs = ipw.Tab(children=[plan_tab, whatif_tab, configs_tab, launch_tab], titles=list(_TABS))
        self.tabs.observe(self._on_tab, names="selected_index")
        self.widget = ipw.VBox([ipw.HTML("<b style='font-size:1.1em'>jupyter-dist: strategy wizard</b>"), grid,
                                self.status, self.tabs], layout=ipw.Layout(width="100%"))  # fmt: skip
        self.widget.add_class("jd-wizard")
        self._show_source()

    # ---- reading and writing controls ----------------------------------------------------------------------
    @contextlib.contextmanager
    def hold(self, *, refresh: bool = True) -> Iterator[None]:
        """Change several controls and recompute once at the end (``refresh=False``: not at all)."""
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1
        if refresh and not self._holding:
            self.refresh()

    def set(self, **values: Any) -> Wizard:
        """Set controls by input name (``w.set(nodes=2, seq_len=4096)``), recomputing once."""
        unknown = [k for k in values if k not in self.controls]
        if unknown:
            raise JupyterDistError(f"no wizard control {unknown[0]!r}; valid: {', '.join(self.controls)}")
        with self.hold():
            for k, v in values.items():
                self.controls[k].value = v
        return self

    def _read(self) -> WizardInputs:
        inp = self.inputs
        for name, w in self.controls.items():
            setattr(inp, name, w.value)
        return inp

    def _nearest(self, dim: str, value: Any) -> int:
        values = WHATIF_VALUES[dim]
        if not isinstance(value, int) or value < 1:
            return values[0]
        return min(values, key=lambda v: abs(v - value) / v)

    def _show_source(self) -> None:
        src = self.controls["source"].value
        self.rows["preset"].layout.display = "flex" if src == "preset" else "none"
        self.dims_box.layout.display = "flex" if src == "dims" else "none"
        self.hf_box.layout.display = "flex" if src == "hf" else "none"
        spec = self.inputs.module_spec
        if src == "module" and spec is not None:
            self.module_label.value = (f"<small>Measured on the meta device: <b>{html.escape(spec.name)}</b>, "
                                       f"{spec.params:,} parameters</small>")  # fmt: skip
        else:
            self.module_label.value = ""
        mode = self.controls["batch_mode"].value
        self.rows["grad_accum"].layout.display = "flex" if mode == "accum" else "none"
        self.rows["global_batch"].layout.display = "flex" if mode == "global" else "none"

    # ---- handlers ---------------------------------------------------------------------------------------------
    def _on_change(self, change: dict[str, Any]) -> None:
        owner = change.get("owner")
        if owner is self.controls["source"] and change["new"] == "dims" and not self._holding:
            self._prefill_dims()
            return
        if owner is self.controls["gpu"] and not self._holding:
            prec = self.controls["precision"]
            offered = precision_choices(change["new"])
            if list(prec.options) != offered:  # fp8 comes and goes with the GPU's FP8 tensor cores
                with self.hold(refresh=False):
                    value = prec.value if prec.value in offered else offered[0]
                    prec.options = offered
                    prec.value = value
            top = ACCELERATORS[change["new"]].max_gpus_per_node
            gpn = self.controls["gpus_per_node"]
            if isinstance(gpn.value, int) and gpn.value > top:
                with self.hold():
                    gpn.value = top
                return
        if not self._holding:
            self.refresh()

    def _prefill_dims(self) -> None:
        """Switching to dimensions starts from the model shown before (the preset or the measured module)."""
        try:
            spec = (self.inputs.module_spec if self.inputs.module_spec is not None
                    else ModelSpec.from_preset(self.controls["preset"].value))  # fmt: skip
        except JupyterDistError:
            return
        with self.hold():
            for name in DIM_FIELDS:
                value = getattr(spec, name, None)
                self.controls[name].value = int(value) if isinstance(value, int) else 0

    def _on_upload(self, change: dict[str, Any]) -> None:
        files = change["new"]
        if not files:
            return
        item = files[0] if isinstance(files, (list, tuple)) else next(iter(files.values()))
        try:
            text = bytes(item["content"]).decode("utf-8")
        except UnicodeDecodeError:
            self.messages["hf_config"].value = self._msg(f"{item.get('name', 'the file')} is not UTF-8 text")
            return
        with self.hold():
            self.controls["source"].value = "hf"
            self.controls["hf_config"].value = text

    def _on_slider(self, change: dict[str, Any]) -> None:
        if self._syncing:
            return
        for dim, sl in self.sliders.items():
            if change["owner"] is sl and self.controls[dim].value != change["new"]:
                self.controls[dim].value = change["new"]

    def _on_tab(self, change: dict[str, Any]) -> None:
        if change["new"] == _WHATIF_TAB and self._whatif_stale:
            self._guard(self._draw_whatif)

    def _on_compile_change(self, change: dict[str, Any]) -> None:
        if not self._holding:
            self._guard(self._compile)
            self._guard(self._draw_tp_layout)
            self._guard(self._draw_price)

    # ---- recompute --------------------------------------------------------------------------------------------
    @staticmethod
    def _msg(text: str) -> str:
        return f"<span style='color:{_WARN};font-size:0.9em'>\u26a0 {html.escape(text)}</span>"

    def _guard(self, fn: Any) -> None:
        """Run a view update; an unexpected error becomes one line in the status, never a traceback."""
        try:
            fn()
        except Exception as exc:  # the panel shows one line; the traceback goes to the log
            log.debug("wizard update failed", exc_info=True)
            self.status.value = self._msg(f"internal error while updating the wizard: {type(exc).__name__}: {exc}")

    def refresh(self) -> Answer | None:
        """Re-plan from the controls and update every view (the one handler every control calls)."""
        t0 = time.perf_counter()
        self._guard(self._refresh)
        self.last_update_ms = (time.perf_counter() - t0) * 1e3
        self.updates += 1
        return self.answer

    def _refresh(self) -> None:
        self._show_source()
        answer = evaluate(self._read())
        self.answer = answer
        for name, msg in self.messages.items():
            text = answer.problems.get(name, "")
            new = self._msg(text) if text else ""
            if msg.value != new:
                msg.value = new
        for dim, sl in self.sliders.items():
            value = self.controls[dim].value
            if value in WHATIF_VALUES[dim] and sl.value != value:
                with self.hold_sliders():
                    sl.value = value
        if answer.problems:
            first = next(iter(answer.problems.values()))
            self.status.value = (self._msg(f"fix the input marked \u26a0: {first}")
                                 + "<small style='color:#777'> (the answer below is for the last valid inputs)"
                                 "</small>")  # fmt: skip
            self.summary.layout.opacity = "0.45"
            self.chart.layout.opacity = "0.45"
            return
        self.summary.layout.opacity = "1"
        self.chart.layout.opacity = "1"
        p = answer.plan
        assert p is not None
        self.plan = p
        self.summary.value = summary_html(p)
        self._draw_chart()
        names = [c.name for c in p.candidates if c.fits] or [c.name for c in p.candidates[:1]]
        options = [(f"recommended ({p.recommended})" if p.recommended else "recommended (none fits)", ""),
                   *((n, n) for n in names)]  # fmt: skip
        with self.hold(refresh=False):  # the candidate list changes without a recompile per change
            keep = self.candidate.value if self.candidate.value in names else ""
            self.candidate.options = options
            self.candidate.value = keep
        self._compile()
        self._draw_tp_layout()
        self._draw_price()
        self._whatif_stale = True
        if self.tabs.selected_index == _WHATIF_TAB:
            self._draw_whatif()
        self.status.value = (f"<small style='color:#777' data-ms='{answer.elapsed_ms:.2f}'>planned "
                             f"{len(p.candidates)} candidates in {answer.elapsed_ms:.1f} ms</small>")  # fmt: skip

    @contextlib.contextmanager
    def hold_sliders(self) -> Iterator[None]:
        """Move sliders to follow the controls without their handler writing back."""
        self._syncing = True
        try:
            yield
        finally:
            self._syncing = False

    def _draw_chart(self) -> None:
        if self.plan is None:
            return
        fig = memory_figure(self.plan, show_all=self.show_all.value)
        self.chart_figure = fig
        rows = len(fig["categories"])
        self.chart.value = figure_svg(fig, width=720, height=74 + 17 * rows)

    def _selected(self) -> str | None:
        return self.candidate.value or (self.plan.recommended if self.plan is not None else None)

    def _compile(self) -> None:
        from ..render.bundle import FILE_DESCRIPTIONS, render_bundle
        from ..render.common import RenderOptions

        p = self.plan
        name = self._selected()
        self.bundle = None
        if p is None or name is None:
            self.compile_msg.value = self._msg("nothing fits, so there is nothing to compile; change the inputs")
            for pane in self.file_panes.values():
                pane.value = ""
            return
        try:
            bundle = render_bundle(p, RenderOptions(candidate=name, launcher=self.launcher.value))
        except JupyterDistError as exc:
            self.compile_msg.value = self._msg(str(exc))
            return
        self.bundle = bundle
        self.compile_msg.value = "".join(f"<div><small>{html.escape(n)}</small></div>" for n in bundle.notes)
        self.commands.value = "".join(
            f"<div><b>{html.escape(k)}</b>: <code>{html.escape(c.shell(with_env=False))}</code></div>"
            for k, c in bundle.commands.items()
        )
        for fname, pane in self.file_panes.items():
            text = bundle.files.get(fname)
            if text is None:
                why = next((n for n in bundle.notes if n.startswith(fname)), None)
                why = why or f"{bundle.candidate.name} does not use {fname}"
                pane.value = f"<div class='jd-wiz-file' data-file='{fname}'><i>{html.escape(why)}</i></div>"
            else:
                pane.value = _file_pane(fname, text, FILE_DESCRIPTIONS.get(fname, ""))

    def _draw_tp_layout(self) -> None:
        new = tp_layout_html(self.plan, self._selected()) if self.plan is not None else ""
        if self.tp_layout.value != new:
            self.tp_layout.value = new

    def _draw_whatif(self) -> None:
        inp = self._read()
        if self.answer is None or self.answer.problems:
            for table in self.whatif_tables.values():
                table.value = self._msg("fix the inputs marked above first")
            return
        for dim, table in self.whatif_tables.items():
            table.value = whatif_html(whatif(inp, dim), current=getattr(inp, dim))
        self._whatif_stale = False

    # ---- actions ---------------------------------------------------------------------------------------------
    def write_configs(self, folder: str | os.PathLike[str] | None = None) -> list[Path]:
        """Write the bundle's files to ``folder`` (default: the Folder field); returns the paths written."""
        if self.bundle is None:
            self.write_msg.value = self._msg("no configs to write: the plan has no compiled candidate")
            return []
        target = Path(folder if folder is not None else self.folder.value.strip() or ".").expanduser()
        try:
            paths: list[Path] = self.bundle.write_to(target)
        except OSError as exc:
            self.write_msg.value = self._msg(f"cannot write to {target}: {exc.strerror or exc}")
            return []
        self.write_msg.value = (f"<small>wrote {len(paths)} files to <code>{html.escape(str(target.resolve()))}"
                                f"</code>: {html.escape(', '.join(p.name for p in paths))}</small>")  # fmt: skip
        return paths

    # ---- display ---------------------------------------------------------------------------------------------
    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> Any:
        data = self.widget._repr_mimebundle_(include=include, exclude=exclude)
        if isinstance(data, tuple):
            data = data[0]
        data = dict(data or {})
        data["text/plain"] = repr(self)
        data["text/html"] = self.static_html()  # what a saved notebook shows without the widget (GitHub, nbconvert)
        return data

    def static_html(self) -> str:
        """The current answer as HTML with the SVG chart: no widgets, no JavaScript."""
        if self.plan is None:
            return "<div class='jd-wizard-static'><i>no valid plan</i></div>"
        return (f"<div class='jd-wizard-static' style='max-width:100%'>{summary_html(self.plan)}"
                f"{self.tp_layout.value}{self.chart.value}</div>")  # fmt: skip

    def __repr__(self) -> str:
        best = self.plan.recommended if self.plan is not None else None
        return f"Wizard(model={self.inputs.source}, recommended={best!r})"
