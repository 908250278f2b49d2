"""The strategy wizard without a front-end: set control values, check the plan, the chart data, the config tabs, the
inline messages and Launch. The wizard must show exactly what the planner and the compiler return (it holds no
planning logic), and never raise or show a traceback for bad input."""

from __future__ import annotations

import datetime
import html
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from IPython.core.error import UsageError

from jupyter_dist.errors import JupyterDistError
from jupyter_dist.plan import Hardware, ModelSpec, TrainingShape, plan
from jupyter_dist.plan.units import GiB
from jupyter_dist.render.bundle import render_bundle
from jupyter_dist.render.common import RenderOptions
from jupyter_dist.ui import wizard as wizard_mod
from jupyter_dist.ui.static import figure_svg
from jupyter_dist.ui.wizard import BUNDLE_FILES, Wizard
from jupyter_dist.ui.wizard_model import WizardInputs, evaluate, whatif

pytest.importorskip("ipywidgets")

LLAMA_CONFIG = {
    "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
    "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000, "tie_word_embeddings": False,
}  # fmt: skip


def problems(w: Wizard) -> dict[str, str]:
    """The inline messages shown next to controls, as plain text."""
    return {k: html.unescape(re.sub("<[^>]+>", "", m.value)) for k, m in w.messages.items() if m.value}


def pane_text(w: Wizard, name: str) -> str:
    """The file text a Configs tab shows (the unescaped <pre>)."""
    m = re.search(r"<pre[^>]*>(.*)</pre>", w.file_panes[name].value, re.S)
    assert m, w.file_panes[name].value[:200]
    return html.unescape(m.group(1))


def test_default_wizard_shows_the_planners_answer() -> None:
    w = Wizard()
    direct = plan("llama-2-7b", Hardware.from_names("h100-80gb"), TrainingShape())
    assert w.plan is not None and w.plan.recommended == direct.recommended
    assert [c.name for c in w.plan.candidates] == [c.name for c in direct.candidates]
    assert f"<code>{direct.recommended}</code>" in w.summary.value
    assert "Effective batch" in w.summary.value
    # the chart: one row per strategy, recommended first, stacked components summing to the candidate's total
    fig = w.chart_figure
    assert fig is not None and fig["kind"] == "hbar"
    assert fig["categories"][0] == f"\u2605 {direct.recommended}"
    first = direct.candidate(direct.recommended)
    assert sum(s["values"][0] for s in fig["series"]) == pytest.approx(first.memory.total / GiB)
    assert fig["vlines"][0]["x"] == pytest.approx(direct.hardware.accelerator.memory_bytes / GiB)
    for i, cat in enumerate(fig["categories"]):  # every bar, FSDP2's too (its gradients reuse freed memory)
        total = direct.candidate(cat.split()[-1]).memory.total
        assert sum(s["values"][i] for s in fig["series"]) == pytest.approx(total / GiB), cat
    assert any(direct.candidate(c.split()[-1]).memory.grads_reuse > 0 for c in fig["categories"])
    assert {c.split()[-1] for c in fig["categories"]} == {c.strategy for c in direct.candidates} | {
        direct.recommended}  # fmt: skip
    ET.fromstring(w.chart.value)  # well-formed SVG
    assert w.last_update_ms > 0 and not problems(w)


def test_changing_controls_updates_plan_chart_and_config_tabs() -> None:
    w = Wizard(model="llama-2-7b")
    before_chart = w.chart.value
    before_sbatch = w.file_panes["job.sbatch"].value
    w.controls["nodes"].value = 4
    assert w.plan is not None and w.plan.hardware.nodes == 4 and w.plan.world_size == 32
    assert w.chart.value != before_chart
    assert w.file_panes["job.sbatch"].value != before_sbatch
    assert "#SBATCH --nodes=4" in w.bundle.files["job.sbatch"]
    assert "num_nodes: 4" in w.bundle.files["skypilot.yaml"]
    # each tab shows the compiler's file for the recommended candidate, nothing else
    expected = render_bundle(w.plan, RenderOptions(candidate=w.plan.recommended))
    for name in BUNDLE_FILES:
        if name in expected.files:
            assert pane_text(w, name) == expected.files[name]
    # a longer sequence changes the recommendation's activations: the chart's purple segment grows
    acts = [s for s in w.chart_figure["series"] if s["name"] == "activations"][0]["values"][0]
    w.controls["seq_len"].value = 8192
    acts2 = [s for s in w.chart_figure["series"] if s["name"] == "activations"][0]["values"][0]
    assert acts2 > acts
    assert w.plan.training.seq_len == 8192


def test_set_batches_changes_into_one_recompute() -> None:
    w = Wizard()
    n = w.updates
    w.set(nodes=2, micro_batch=2, seq_len=4096, checkpointing="selective")
    assert w.updates == n + 1
    assert (w.plan.hardware.nodes, w.plan.training.micro_batch, w.plan.training.seq_len) == (2, 2, 4096)
    with pytest.raises(JupyterDistError, match="no wizard control 'bogus'"):
        w.set(bogus=1)


@pytest.mark.parametrize(("values", "control", "text"), [
    ({"nodes": 0}, "nodes", "nodes must be >= 1, got 0"),
    ({"gpus_per_node": 0}, "gpus_per_node", "must be >= 1"),
    ({"gpus_per_node": 16}, "gpus_per_node", "exceeds the 8"),
    ({"tp": 3}, "tp", "does not divide world size 8"),
    ({"pp": 3}, "pp", "does not divide world size 8"),
    ({"tp": -1}, "tp", "0 (the planner chooses) or a positive integer"),
    ({"micro_batch": 0}, "micro_batch", "micro-batch must be a positive integer"),
    ({"seq_len": -5}, "seq_len", "seq-len must be a positive integer"),
    ({"batch_mode": "global", "global_batch": 100}, "global_batch", "not a multiple"),
    ({"source": "hf", "hf_config": "{oops"}, "hf_config", "not valid JSON"),
    ({"source": "hf", "hf_config": ""}, "hf_config", "paste or upload"),
    ({"source": "dims", "heads": 3}, "heads", "not divisible by heads (3)"),
    ({"source": "dims", "layers": 0}, "layers", "layers must be a positive integer"),
], ids=lambda v: str(v) if not isinstance(v, dict) else ",".join(f"{k}={v[k]}" for k in v))  # fmt: skip
def test_invalid_inputs_show_a_message_next_to_their_control(values: dict[str, Any], control: str, text: str) -> None:
    w = Wizard()
    valid = w.plan
    if "global_batch" in values:  # 100 sequences never split over 8 GPUs x micro-batch 1 x any dp
        values = {**values, "micro_batch": 3}
    w.set(**values)
    shown = problems(w)
    assert control in shown, shown
    assert text in shown[control]
    assert "Traceback" not in w.status.value and "fix the input marked" in w.status.value
    assert w.plan is valid  # the last valid answer stays, dimmed
    assert w.summary.layout.opacity == "0.45"
    w.set(**{k: getattr(WizardInputs(), k) for k in values})  # back to valid: the message goes away
    assert not problems(w) and w.summary.layout.opacity == "1"


def test_no_plan_fits_says_so_and_what_would_help() -> None:
    w = Wizard(model="llama-3-70b", gpu="a10g", gpus_per_node=1, nodes=1)
    assert w.plan is not None and w.plan.recommended is None
    assert "Nothing fits" in w.summary.value
    assert w.bundle is None and "nothing to compile" in w.compile_msg.value
    assert w.launch() is None and "nothing fits" in w.launch_msg.value.lower()


def test_unexpected_errors_become_one_line_not_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    w = Wizard()

    def boom(inputs: WizardInputs) -> Any:
        raise RuntimeError("planner exploded")

    monkeypatch.setattr(wizard_mod, "evaluate", boom)
    w.controls["nodes"].value = 2  # must not raise
    assert "internal error while updating the wizard: RuntimeError: planner exploded" in w.status.value


def test_gpu_change_clamps_gpus_per_node_and_interconnect_is_used() -> None:
    w = Wizard(gpu="cpu", gpus_per_node=32, model="gpt2")
    assert w.plan.hardware.gpus_per_node == 32
    w.controls["gpu"].value = "a100-80gb"  # 8 per node at most: clamped, not an error
    assert w.controls["gpus_per_node"].value == 8 and not problems(w)
    w.set(nodes=2, interconnect="ethernet-25")
    assert w.plan.hardware.interconnect.name == "ethernet-25"


def test_hf_config_pasted_and_uploaded() -> None:
    w = Wizard()
    text = json.dumps(LLAMA_CONFIG)
    w.set(source="hf", hf_config=text)
    expected = ModelSpec.from_hf_config(LLAMA_CONFIG)
    assert w.plan.model.params == expected.params
    w2 = Wizard()
    data = json.dumps({**LLAMA_CONFIG, "num_hidden_layers": 11}).encode()
    w2.upload.value = ({"name": "config.json", "type": "application/json", "size": len(data),
                        "content": memoryview(data),
                        "last_modified": datetime.datetime.now(datetime.timezone.utc)},)  # fmt: skip
    assert w2.controls["source"].value == "hf"
    assert w2.plan.model.layers == 11


def test_a_module_from_the_notebook_is_measured_on_the_meta_device() -> None:
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(1000, 64)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
            self.head = torch.nn.Linear(64, 1000)

    w = Wizard(model=Net, gpu="cpu", gpus_per_node=2)
    real = sum(p.numel() for p in Net().parameters())
    assert w.inputs.source == "module" and w.plan.model.params == real
    assert "Module" in [label for label, _ in w.controls["source"].options]
    assert f"{real:,} parameters" in w.module_label.value
    # switching to dimensions starts from the measured shape
    w.controls["source"].value = "dims"
    assert w.controls["layers"].value == w.inputs.module_spec.layers


def test_dims_prefill_from_the_preset_when_switching() -> None:
    w = Wizard(model="llama-2-13b")
    w.controls["source"].value = "dims"
    spec = ModelSpec.from_preset("llama-2-13b")
    assert (w.controls["layers"].value, w.controls["hidden"].value, w.controls["heads"].value) == (
        spec.layers, spec.hidden, spec.heads)  # fmt: skip
    assert w.plan.model.params == pytest.approx(spec.params, rel=0.01)
    assert w.rows["preset"].layout.display == "none" and w.dims_box.layout.display == "flex"


def test_whatif_tables_and_sliders() -> None:
    w = Wizard(model="llama-2-13b")
    assert all(t.value == "" for t in w.whatif_tables.values())  # lazy: drawn when the tab is shown
    w.tabs.selected_index = 1
    table = w.whatif_tables["nodes"].value
    assert "data-dim='nodes'" in table
    # every cell agrees with a plan made at that value
    wi = whatif(w.inputs, "seq_len")
    for i, v in enumerate(wi["values"]):
        p = evaluate(WizardInputs(**{**w.inputs.to_dict(), "module_spec": None, "seq_len": v})).plan
        assert p is not None
        for strategy, cells in wi["cells"].items():
            cell = cells[i]
            best = next(c for c in ([p.best] if p.best and p.best.strategy == strategy else []) + list(p.candidates)
                        if c.strategy == strategy)  # fmt: skip
            assert cell is not None and cell[2] == best.name and cell[1] == pytest.approx(best.memory.total / GiB)
    # ddp of a 13B model never fits on one 80 GB GPU; a longer sequence only makes it worse
    assert all(c is not None and c[0] == "no" for c in wi["cells"]["ddp"])
    # a slider moves its control, the plan follows, the current column is outlined
    w.sliders["nodes"].value = 4
    assert w.controls["nodes"].value == 4 and w.plan.hardware.nodes == 4
    assert "outline:2px solid #1976d2;'>4</th>" in w.whatif_tables["nodes"].value
    # a control moves its slider (when the value is one of the slider's)
    w.controls["micro_batch"].value = 8
    assert w.sliders["micro_batch"].value == 8


def test_configs_candidate_launcher_and_write_to_folder(tmp_path: Path) -> None:
    w = Wizard(model="llama-2-7b")
    names = [v for _, v in w.candidate.options]
    assert "" in names and "zero3" in names
    w.candidate.value = "zero3"
    assert w.bundle.candidate.name == "zero3"
    ds = json.loads(w.bundle.files["ds_config.json"])
    assert ds["zero_optimization"]["stage"] == 3
    assert "&quot;stage&quot;: 3" in w.file_panes["ds_config.json"].value
    w.candidate.value = "fsdp2"
    assert "does not use ds_config.json" in w.file_panes["ds_config.json"].value
    w.launcher.value = "accelerate"
    assert "accelerate launch" in w.commands.value
    # downloads carry the exact file text
    pane = w.file_panes["train.py"].value
    import base64

    data = re.search(r"href='data:text/plain;base64,([^']+)'", pane).group(1)
    assert base64.b64decode(data).decode() == w.bundle.files["train.py"]
    written = w.write_configs(tmp_path / "out")
    assert {p.name for p in written} >= set(w.bundle.files)
    assert (tmp_path / "out" / "train.py").read_text() == w.bundle.files["train.py"]
    assert "wrote" in w.write_msg.value
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert w.write_configs(blocker / "sub") == []
    assert "cannot write to" in w.write_msg.value
    # the candidate stays selected while it still exists after a change, else it falls back to the recommendation
    w.controls["seq_len"].value = 1024
    assert w.candidate.value == "fsdp2"


def test_bundle_notes_what_accelerate_cannot_express() -> None:
    # seq 2048: at 4096 the measured Mixtral activations (tests/test_memory_measured.py) make zero1+pp2+ep8 the best,
    # whose note names pipeline parallelism first
    p = plan("mixtral-8x7b", Hardware.from_names("h100-80gb", nodes=4), TrainingShape(seq_len=2048))
    assert p.best is not None and p.best.dims.ep > 1
    b = render_bundle(p)
    assert "accelerate_config.yaml" not in b.files
    assert any("accelerate_config.yaml not generated" in n and "expert parallelism" in n for n in b.notes)
    with pytest.raises(JupyterDistError, match="expert parallelism"):
        render_bundle(p, RenderOptions(launcher="accelerate"))


def test_layout_has_no_fixed_widths() -> None:
    w = Wizard()

    def walk(widget: Any) -> Any:
        yield widget
        for child in getattr(widget, "children", ()):
            yield from walk(child)

    fixed = []
    for widget in walk(w.widget):
        layout = getattr(widget, "layout", None)
        for attr in ("width", "min_width", "max_width"):
            value = getattr(layout, attr, None) if layout is not None else None
            if value and re.search(r"\d(px|em|cm|in|pt)", str(value)):
                fixed.append((type(widget).__name__, attr, value))
    assert not fixed, fixed
    assert 'width="100%"' in w.chart.value  # the SVG scales to the cell


def test_hbar_figure_renders_rows_limit_and_escapes() -> None:
    fig = {"kind": "hbar", "title": "t", "categories": ["<a>", "b"], "x_title": "GiB",
           "series": [{"name": "p", "values": [1.0, 2.0]}, {"name": "q", "values": [3.0, None]}],
           "labels": ["4.0 fits", "2.0 fits"], "highlight": [0], "vlines": [{"x": 5.0, "name": "limit"}]}  # fmt: skip
    svg = figure_svg(fig, width=500, height=120)
    root = ET.fromstring(svg)
    rects = [r for r in root.iter("{http://www.w3.org/2000/svg}rect") if r.find("{http://www.w3.org/2000/svg}title")
             is not None]  # fmt: skip
    assert len(rects) == 3  # None is skipped
    assert "&lt;a&gt;" in svg and "limit" in svg and 'font-weight="700"' in svg
    # the widest bar (4) and the limit (5) fit inside the drawing
    xs = [float(r.get("x")) + float(r.get("width")) for r in rects]
    assert max(xs) < 500
    assert "no data yet" in figure_svg({"kind": "hbar", "categories": [], "series": []})


def test_dist_wizard_magic(ip: Any) -> None:
    w = ip.run_line_magic("dist_wizard", "--model llama-3-8b --gpu a100-80gb --nodes 2 --seq-len 4096 "
                                         "--micro-batch 2 --checkpointing selective --global-batch 64")  # fmt: skip
    assert isinstance(w, Wizard)
    assert w.controls["preset"].value == "llama-3-8b" and w.controls["gpu"].value == "a100-80gb"
    assert (w.plan.hardware.nodes, w.plan.training.seq_len, w.plan.training.micro_batch) == (2, 4096, 2)
    assert w.controls["batch_mode"].value == "global" and w.plan.training.global_batch == 64
    direct = ip.run_line_magic("dist_plan", "--model llama-3-8b --gpu a100-80gb --nodes 2 --seq-len 4096 "
                                            "--micro-batch 2 --checkpointing selective --global-batch 64")  # fmt: skip
    assert w.plan.recommended == direct.recommended  # the same plan as %dist_plan's rich output
    torch = pytest.importorskip("torch")
    ip.user_ns["net"] = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 8))
    w2 = ip.run_line_magic("dist_wizard", "--model-var net --gpu cpu --gpus-per-node 2")
    assert w2.plan.model.params == 32 * 32 + 32 + 32 * 8 + 8
    assert w2.module is ip.user_ns["net"] and w.module is None  # what Rehearse builds: the notebook's object
    with pytest.raises(UsageError, match="no variable of that name"):
        ip.run_line_magic("dist_wizard", "--model-var nope")
    with pytest.raises(UsageError, match="llama-2-7b"):
        ip.run_line_magic("dist_wizard", "--model not-a-model")
    with pytest.raises(UsageError, match="not --params"):
        ip.run_line_magic("dist_wizard", "--params 7B")


def test_launch_validates_its_inputs() -> None:
    w = Wizard(model="gpt2", gpu="cpu", gpus_per_node=2)
    w.nproc.value = 0
    assert w.launch() is None and "processes per node must be &gt;= 1" in w.launch_msg.value
    w.nproc.value = 2
    w.launch_nodes.value = 0
    assert w.launch() is None and "nodes must be &gt;= 1" in w.launch_msg.value
    w.launch_nodes.value = 1
    w.cluster_flags.value = "--partition gpu"
    assert w.launch() is None and "cluster flags need Run on: SLURM or SkyPilot" in w.launch_msg.value
    w.backend.value = "slurm"
    w.cluster_flags.value = "--partition 'unclosed"
    assert w.launch() is None and "cluster flags: No closing quotation" in w.launch_msg.value
    w.backend.value, w.cluster_flags.value = "local", ""
    w.run_name.value = "not a name"
    assert w.launch() is None and "valid Python variable name" in w.launch_msg.value
    w.controls["nodes"].value = 0
    w.run_name.value = "ok"
    assert w.launch() is None and "fix the inputs" in w.launch_msg.value
    with pytest.raises(JupyterDistError, match="plan_var"):
        Wizard(plan_var="1x")
    with pytest.raises(JupyterDistError, match="unknown wizard input 'gpus'"):
        Wizard(gpus=8)


CELL = """import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
model, opt = jd.wrap(model, opt)
X, y = torch.randn(64, 8), torch.randn(64, 1)
for step in range(15):
    loss = torch.nn.functional.mse_loss(model(X), y)
    jd.backward(loss)
    jd.step(opt)
    jd.log(step, loss=loss, samples=64)
"""


@pytest.mark.slow
def test_launch_runs_the_plan_and_the_printed_line_reproduces_it(ip: Any, runs: Path) -> None:
    from conftest import descendants_gone

    w = Wizard(model="gpt2", gpu="cpu", gpus_per_node=2, code=CELL, runs_dir=runs, shell=ip)
    assert w.plan.recommended == "ddp"
    w.run_name.value = "wiz"
    run = w.launch(timeout=180)
    assert run is not None, w.launch_msg.value
    assert ip.user_ns["wizard_plan"] is w.plan and ip.user_ns["wiz"] is run
    assert w.train_line == "%%dist_train --plan wizard_plan --nproc 2 --name wiz"
    assert w.train_line in w.launch_line.value.replace("&#x27;", "'")
    assert run.wait(180) == "succeeded", run.logs()
    assert run._meta["strategy"] == "ddp" and run._meta["plan"]["recommended"] == "ddp"
    steps = [r for r in run.records("step")]
    assert steps and max(r["step"] for r in steps) == 14
    assert descendants_gone(run)
    if w.dashboard is not None:  # the live panels sit under the Launch button
        assert w.launch_area.children == (w.dashboard.widget,)
        w.dashboard.stop() if hasattr(w.dashboard, "stop") else None
    # the printed line, run as a cell, does the same thing
    again = ip.run_cell_magic("dist_train", w.train_line.removeprefix("%%dist_train ") + " --wait --no-dashboard",
                              CELL).__class__  # fmt: skip
    rerun = ip.user_ns["wiz"]
    assert again.__name__ == "Run" and rerun is not run
    assert rerun.wait(180) == "succeeded"
    assert rerun._meta["strategy"] == run._meta["strategy"] and rerun._meta["plan"] == run._meta["plan"]
    assert descendants_gone(rerun)


@pytest.mark.slow
def test_launch_on_the_slurm_cluster(ip: Any, runs: Path, slurm_cluster: Any) -> None:
    """Run on: SLURM submits through %%dist_train --backend slurm (2 nodes x 1 process on the local cluster)."""
    w = Wizard(model="gpt2", gpu="cpu", gpus_per_node=1, nodes=2, code=CELL, runs_dir=runs, shell=ip)
    w.backend.value = "slurm"
    w.launch_nodes.value, w.nproc.value = 2, 1
    w.cluster_flags.value = "--partition debug --time 00:05:00"
    w.run_name.value = "wizslurm"
    run = w.launch(timeout=240)
    assert run is not None, w.launch_msg.value
    assert w.train_line == ("%%dist_train --plan wizard_plan --nproc 1 --name wizslurm --nodes 2 --backend slurm "
                            "--partition debug --time 00:05:00")  # fmt: skip
    assert "on SLURM" in w.launch_msg.value
    assert run.wait(240) == "succeeded", run.logs()
    assert max(r["step"] for r in run.records("step")) == 14
    assert {r["rank"] for r in run.records("step")} == {0, 1}


VMS = """InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,Region,AvailabilityZone
p5.48xlarge,H100,8,192,2048,,98.32,40.10,us-east-1,us-east-1a
p4d.24xlarge,A100,8,96,1152,,32.77,12.00,us-east-1,us-east-1a
"""


def price_text(w: Wizard) -> str:
    return html.unescape(re.sub("<[^>]+>", "", w.price.value))


def test_launch_tab_prices_the_skypilot_nodes_and_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ip: Any
) -> None:
    """On SkyPilot the Launch tab shows the requested nodes' hourly price from SkyPilot's price list (a catalog file
    here, as `sky show-gpus` caches it) and the run's estimate, the selected candidate's planned step time x Steps;
    it follows every control, says why where no price is known, and is the line the dry run of the same run prints."""
    from jupyter_dist.launch import cost

    (tmp_path / "cat" / "aws").mkdir(parents=True)
    (tmp_path / "cat" / "aws" / "vms.csv").write_text(VMS)
    monkeypatch.setattr(cost, "catalog_dir", lambda: tmp_path / "cat")
    w = Wizard(gpu="h100-80gb", gpus_per_node=8, nodes=2)
    assert w.price.value == ""  # this machine: nothing to price
    w.backend.value = "skypilot"
    w.nproc.value, w.launch_nodes.value, w.launch_steps.value = 8, 2, 1000
    w.cluster_flags.value = "--infra aws"
    step = w.plan.candidate(w.plan.recommended).time.step_time_s

    def estimate(per_hour: float, steps: int, step_s: float = step) -> str:
        return f"estimated ${per_hour * step_s * steps / 3600:,.2f} for {steps} steps x {step_s:.3g} s"

    text = price_text(w)
    assert text.startswith("price: $196.64/hour for 2 x p5.48xlarge (aws us-east-1, on demand, $98.32/node-hour")
    assert estimate(196.64, 1000) in text, text
    w.launch_steps.value = 4000  # every control moves it
    assert estimate(196.64, 4000) in price_text(w)
    w.launch_nodes.value = 4
    assert "$393.28/hour for 4 x p5.48xlarge" in price_text(w) and estimate(393.28, 4000) in price_text(w)
    w.cluster_flags.value = "--infra aws --spot --steps 500"  # the flags' --steps wins over the Steps box
    assert "$160.40/hour for 4 x p5.48xlarge (aws us-east-1, spot" in price_text(w)
    assert estimate(160.40, 500) in price_text(w)
    other = next(c for c in w.plan.candidates if c.fits and c.time.step_time_s != step)
    w.candidate.value = other.name  # the compiled candidate's step time
    assert estimate(160.40, 500, other.time.step_time_s) in price_text(w)
    w.candidate.value = ""
    w.cluster_flags.value = "--infra gcp"
    assert price_text(w).startswith("price unknown: SkyPilot's price list for gcp is not on this machine "
                                    "(`sky show-gpus H100:8 --infra gcp` downloads it)")  # fmt: skip
    w.cluster_flags.value = "--gpus H100:4 --infra aws"
    assert price_text(w) == "price unknown: no H100:4 instance in SkyPilot's price list for aws"
    w.cluster_flags.value = "--steps many"
    assert "cluster flags: --steps 'many'" in price_text(w)
    w.backend.value = "slurm"
    assert w.price.value == ""
    cpu = Wizard(model="gpt2", gpu="cpu", gpus_per_node=2)
    cpu.backend.value = "skypilot"
    assert price_text(cpu) == "price: CPU processes, no accelerator requested (not priced)"
    # the same run's dry run prints the same line
    pytest.importorskip("sky")
    w.backend.value, w.cluster_flags.value, w.launch_nodes.value = "skypilot", "--infra aws", 2
    ip.user_ns["wizard_plan"] = w.plan
    dry = ip.run_cell_magic("dist_train", f"--plan wizard_plan --nproc 8 --nodes 2 --backend skypilot --infra aws "
                                          f"--steps 4000 --dry-run --runs-dir {tmp_path}", "pass\n")  # fmt: skip
    (line,) = [n for n in dry.notes if n.startswith("price")]
    assert line == price_text(w)


# ---------------------------------------------------------------------------------------------------- Rehearse
def text_of(widget: Any) -> str:
    return html.unescape(re.sub("<[^>]+>", "", widget.value))


def test_save_calibration_before_a_rehearsal_is_one_line_and_saves_nothing() -> None:
    from jupyter_dist.plan.calibration import load_calibration

    w = tiny_wizard()
    assert w.save_rehearsal_calibration() is None and load_calibration("cpu") is None
    assert text_of(w.rehearse_msg) == "⚠ rehearse first: there is no rehearsal to save"


def tiny_wizard(**answers: Any) -> Wizard:
    """A tiny custom-dimension model planned on 2 CPU ranks, fsdp2 alone."""
    return Wizard(gpu="cpu", gpus_per_node=2, source="dims", layers=2, hidden=32, heads=2, kv_heads=1, ffn=64,
                  vocab=64, micro_batch=2, seq_len=8, precision="fp32", strategy="fsdp2", **answers)  # fmt: skip


def test_rehearse_sits_beside_launch_and_refuses_in_one_line() -> None:
    w = Wizard(model="gpt2", gpu="cpu", gpus_per_node=2)
    launch_tab = w.tabs.children[wizard_mod._LAUNCH_TAB]
    row = next(c for c in launch_tab.children if w.launch_button in getattr(c, "children", ()))
    assert list(row.children) == [w.launch_button, w.rehearse_button, w.save_calibration_button]
    assert w.rehearse_button.description == "Rehearse" and w.save_calibration_button.disabled  # nothing to save yet
    assert launch_tab.children.index(w.rehearse_out) > launch_tab.children.index(row)  # the table under the buttons
    w.rehearse_button.click()  # a preset the reference model cannot reproduce: one line, nothing started
    msg = text_of(w.rehearse_msg)
    assert "not one the reference model reproduces" in msg and "model=" in msg and "\n" not in msg, msg
    assert w.rehearsal_thread is None and w.rehearse_out.outputs == () and not w.rehearse_button.disabled
    # the wizard's own module is what a Module source rehearses; an instance cannot be rebuilt on the meta device
    torch = pytest.importorskip("torch")
    from jupyter_dist.models import Transformer

    w = Wizard(model=Transformer, gpu="cpu", gpus_per_node=2)
    assert w.module is Transformer and w._rehearse_model() is Transformer
    w.controls["source"].value = "preset"
    assert w._rehearse_model() is None  # the plan's own model now: the reference of the preset's shape
    net = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
    w = Wizard(model=net, gpu="cpu", gpus_per_node=2)
    assert w.rehearse() is None and "Wizard(model=MyModel)" in text_of(w.rehearse_msg)


PEAK = 5 * 2**20
"""The fake rehearsal's step peak (bytes)."""


def test_rehearse_runs_on_a_thread_and_refuses_a_second_click(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from jupyter_dist.launch import rehearse as rehearse_mod

    release, calls = threading.Event(), []

    def fake(plan: Any, candidate: Any = None, **kwargs: Any) -> Any:
        calls.append((candidate, kwargs))
        kwargs["on_rank"](rehearse_mod.RankRehearsal(rank=0, params=2**20))
        assert release.wait(30)
        return rehearse_mod.Rehearsal(candidate=candidate, world_size=2, plan=plan,
                                      ranks=(rehearse_mod.RankRehearsal(rank=0, params=2**20, peak=PEAK),))  # fmt: skip

    monkeypatch.setattr(rehearse_mod, "rehearse", fake)
    w = tiny_wizard()
    w.candidate.value = "fsdp2"
    w.rehearse_button.click()
    thread = w.rehearsal_thread
    assert thread is not None and thread.is_alive() and w.rehearse_button.disabled  # the kernel is free meanwhile
    w.rehearse_button.click()
    w.rehearse()
    assert "a rehearsal is running" in text_of(w.rehearse_msg) and len(calls) == 1
    assert text_of(w.rehearse_log) == "rank 0: rehearsed"
    release.set()
    thread.join(30)
    assert not thread.is_alive() and not w.rehearse_button.disabled
    candidate, kwargs = calls[0]
    assert candidate == "fsdp2" and kwargs["model"] is None and kwargs["ranks"] is None  # selected, reference, default
    assert w.rehearsal is not None and w.rehearsal.candidate == "fsdp2"
    (out,) = w.rehearse_out.outputs
    assert "<th>rank 0</th>" in out["data"]["text/html"] and "rehearsed fsdp2" in text_of(w.rehearse_msg)
    # Save calibration: the next plan of this shape takes the rehearsed peak for fsdp2, the others keep theirs
    from jupyter_dist.plan.calibration import load_calibration

    assert not w.save_calibration_button.disabled and load_calibration("cpu") is None
    before = {c.name: c.memory.total for c in w.plan.candidates}
    w.save_calibration_button.click()
    saved = load_calibration("cpu")
    assert saved is not None and f"calibration saved to {saved.path()}" in text_of(w.rehearse_msg)
    assert saved.memory_by_candidate == {"fsdp2": w.rehearsal.memory_correction()}
    assert w.save_calibration_button.disabled
    again = tiny_wizard().plan
    assert again is not None
    for c in again.candidates:
        assert c.memory.total == (before[c.name] + saved.memory_by_candidate["fsdp2"] if c.name == "fsdp2"
                                 else before[c.name]), c.name  # fmt: skip


@pytest.mark.slow
def test_rehearse_button_rehearses_the_selected_candidate_for_real() -> None:
    """A real rehearsal: rank 0 of a 2-rank fsdp2 plan of a tiny model, in a process of its own."""
    w = tiny_wizard()
    assert w.plan.recommended != "fsdp2"  # the selection, not the recommendation, is rehearsed
    w.candidate.value = "fsdp2"
    w.rehearse_button.click()
    thread = w.rehearsal_thread
    assert thread is not None
    thread.join(600)
    assert not thread.is_alive(), text_of(w.rehearse_msg)
    r = w.rehearsal
    assert r is not None and r.ok, (text_of(w.rehearse_msg), r)
    assert r.candidate == "fsdp2" and r.world_size == 2 and [x.rank for x in r.ranks] == [0]
    assert r.rank(0).params > 0 and r.rank(0).params == r.predicted.memory.params  # fsdp2's shard, to the byte
    assert text_of(w.rehearse_log) == "rank 0: rehearsed"
    (out,) = w.rehearse_out.outputs
    table = out["data"]["text/html"]
    assert "Rehearsal of fsdp2 (2 ranks)" in table and "<th>rank 0</th>" in table and "dp_shard0" in table


def test_the_wizard_plans_with_the_calibration_of_the_speed_options_it_plans() -> None:
    """On GPUs the wizard plans compiled blocks and the fused optimizer (the ranks' defaults there): a tune of those
    options calibrates its plan, an eager tune of the same GPU does not."""
    from jupyter_dist.plan.calibration import Calibration, hardware_key

    def calibrated(options: str) -> bool:
        Calibration(hardware_key=hardware_key("h100-80gb"), accelerator="h100-80gb", matmul_efficiency=0.3,
                    op_overhead_s=1e-5, memory_offset_bytes=0, trials=2, options=options).save()  # fmt: skip
        answer = evaluate(WizardInputs())
        assert answer.plan is not None, answer.problems
        return any("Calibrated on this hardware by %dist_tune" in r for r in answer.plan.reasons)

    assert not calibrated("eager+foreach")
    assert calibrated("compile+fused")
