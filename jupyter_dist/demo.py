"""The demo job and the quickstart notebook: a small transformer LM trained on 2 CPU processes (gloo).

``jupyter-dist demo`` (the README's main job) writes the quickstart notebook into a fresh folder, executes it on a real
kernel with nbclient (plan the model with the wizard, run it with ``%%dist_train``, read the Run), prints the ranks'
progress in the terminal from the same panel model the notebook's dashboard uses, and leaves the executed notebook, an
HTML report of it and the run's static panels (``dashboard.html``), all of which open offline.
``jupyter-dist demo --terminal`` trains without a notebook (the same launch path, progress only).
``notebooks/quickstart.ipynb`` is :func:`quickstart_notebook` saved with its outputs cleared (a test keeps them equal).
"""

from __future__ import annotations

import copy
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from ._atomic import write_atomic
from .errors import JupyterDistError, MissingDependencyError
from .launch.examples import DEMO_CELL, MODEL_SOURCE

__all__ = ["DEMO_CELL", "QUICKSTART_CELLS", "quickstart_notebook", "run_demo", "run_quickstart"]

_MODEL = MODEL_SOURCE + '''


print(f"TinyLM: {sum(p.numel() for p in TinyLM().parameters()):,} parameters")'''

_TRAIN = '''%%dist_train --plan plan --nproc {nproc} --name run --ship TinyLM --wait{strategy}
import math
import torch

STEPS, VOCAB, SEQ, BATCH = {steps}, 64, 32, 16
torch.manual_seed(0)  # the same initial weights on every rank
model = TinyLM(vocab=VOCAB)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = jd.wrap(model, opt)  # the plan's strategy, on gloo (CPU) or NCCL (GPUs)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch(step: int) -> torch.Tensor:
    """Each sequence counts up from a random start (mod VOCAB): structure to learn; every rank draws its own."""
    g = torch.Generator().manual_seed(step * jd.world_size + jd.rank)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    return (start + torch.arange(SEQ + 1)) % VOCAB


for step in range(STEPS):
    tokens = batch(step).to(jd.device)
    loss = jd.train_step(tokens[:, :-1], tokens[:, 1:], loss_fn)  # forward, backward, step: under any plan
    jd.log(step, loss=loss, tokens=BATCH * SEQ)
if jd.is_main:
    print(f"final loss {loss.item():.3f} (random guessing: {math.log(VOCAB):.3f})")'''

QUICKSTART_CELLS: tuple[tuple[str, str], ...] = (
    ("markdown", "# jupyter-dist quickstart\n\n"
     "Plan a model, run it as a distributed job on fresh processes of this machine (CPU/gloo here; local GPUs use "
     "NCCL), watch it live, and read the results. About a minute on 2 CPU cores.\n\n"
     "The same notebook runs from a shell: `jupyter-dist demo` executes it and leaves the executed notebook, an HTML "
     "report and the run's panels."),
    ("code", "%load_ext jupyter_dist"),
    ("markdown", "## 1. A model\n\nAny `torch.nn.Module`. This one is a 2-block causal transformer, small enough to "
     "train on a laptop CPU in seconds."),
    ("code", _MODEL),
    ("markdown", "## 2. Plan it\n\nThe wizard measures the model on the meta device (no weights allocated), plans "
     "every strategy for the hardware and training shape, and shows which one it recommends, whether it fits, how "
     "fast, and why. Change a control and the answer follows; the *Configs* tab has every file a cluster needs. "
     "Try `h100-80gb` and 2 nodes to see what a real cluster would run.\n\n"
     "Here the hardware is {nproc} CPU processes."),
    ("code", "from jupyter_dist import Wizard\n\n"
     "w = Wizard(model=TinyLM, gpu=\"cpu\", gpus_per_node={nproc}, seq_len=32, micro_batch=16, precision=\"fp32\")\n"
     "w"),
    ("code", "plan = w.plan  # the wizard's current answer, a Plan value object\n"
     "best = plan.best\n"
     "print(f\"{best.label}: {best.memory.total / 2**30:.2f} GiB per process, {best.time.tokens_per_s:,.0f} "
     "tokens/s predicted\")"),
    ("markdown", "## 3. Run it\n\n`%%dist_train` runs the cell as the training script on fresh `torchrun` "
     "processes with the plan's strategy. Inside the cell `jd` is the worker API: `jd.wrap` applies the strategy, "
     "`jd.train_step` runs forward, backward and the optimizer step the way the plan needs (a pipeline schedule, "
     "gradient accumulation), `jd.log` feeds the live panels under the cell (loss, throughput, memory, heartbeats, "
     "communication). "
     "`--ship TinyLM` sends the class from this notebook to the ranks. `--wait` blocks until the run ends "
     "(leave it out to keep working while it trains: the cell returns at once and the panels keep updating)."),
    ("code", _TRAIN),
    ("markdown", "## 4. Read the results\n\n`run` is the Run handle: status, exit codes, logs, metrics as a "
     "DataFrame, `run.diagnosis()` when something failed. After a kernel restart, "
     "`jupyter_dist.open_run(\"runs/run-...\")` reopens it."),
    ("code", "print(run.summary())\n"
     "df = run.metrics()\n"
     "df.groupby(\"rank\").tail(1)"),
    ("markdown", "## Next\n\n"
     "- `strategies_memory.ipynb`: DDP vs FSDP2 vs ZeRO on one model, measured against the plan\n"
     "- `communication_health.ipynb`: `%dist_check` and a straggler found in a live run\n"
     "- `plan_large_models.ipynb`: 70B on 2 x 8 H100, and the configs it writes\n"
     "- `pool_quickstart.ipynb`: a persistent pool of ranks (`%dist_start`, `%%dist`)\n"
     "- `cluster_slurm.ipynb`, `cluster_skypilot.ipynb`: the same cell on SLURM and SkyPilot"),
)
"""The quickstart's cells as (kind, source) with ``{steps}``, ``{nproc}``, ``{strategy}`` placeholders."""


def quickstart_notebook(*, steps: int = 200, nproc: int = 2, strategy: str = "auto") -> Any:
    """The quickstart notebook (an ``nbformat`` v4 node), outputs empty."""
    try:
        import nbformat
    except ImportError:
        raise MissingDependencyError('the quickstart needs nbformat: pip install "jupyter-dist[notebook]"') from None
    extra = "" if strategy == "auto" else f" --strategy {strategy}"
    cells = []
    for kind, src in QUICKSTART_CELLS:
        text = src.replace("{steps}", str(steps)).replace("{nproc}", str(nproc)).replace("{strategy}", extra)
        cells.append(nbformat.v4.new_markdown_cell(text) if kind == "markdown" else nbformat.v4.new_code_cell(text))
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):  # stable ids: the saved notebook and the generated one stay equal
        cell["id"] = f"quickstart-{i:02d}"
    return nb


def _write_notebook(nb: Any, path: Path) -> None:
    """``nbformat.write``, atomically (a full disk leaves the old notebook, not half of the new one)."""
    import nbformat

    text = nbformat.writes(nb)
    write_atomic(path, text if text.endswith("\n") else text + "\n")


def _follow(dash: Any, shown: int, t0: float, out: TextIO) -> int:
    """Print rank 0's step records newer than ``shown``; return the last seq printed."""
    dash.update()
    fresh = sorted((r for r in dash.reader.buffers["step"] if r["rank"] == 0 and r["seq"] > shown),
                   key=lambda r: r["seq"])  # fmt: skip
    for rec in fresh:
        print(_progress_line(dash, rec, time.time() - t0), file=out, flush=True)
        shown = rec["seq"]
    return shown


def run_quickstart(*, nproc: int = 2, strategy: str = "auto", steps: int = 200, runs_dir: str = "runs",
                   out: TextIO = sys.stdout, timeout: float = 900.0) -> tuple[Any, Path]:  # fmt: skip
    """Execute the quickstart notebook on a real kernel in ``<runs_dir>/demo-<time>/``, printing the run's progress.

    Leaves ``quickstart.ipynb`` (executed), ``quickstart.html`` (a report that opens offline: no widget JavaScript,
    the panels as static SVG) and ``dashboard.html`` (the run's panels) there. Returns the Run and the folder.
    """
    try:
        import nbformat  # noqa: F401 - checked here, used by _write_notebook
        from nbclient import NotebookClient
        from nbclient.exceptions import CellExecutionError
    except ImportError:
        raise MissingDependencyError(
            'the demo executes the quickstart notebook: pip install "jupyter-dist[notebook]" (or use --terminal)'
        ) from None
    from .launch.run import open_run
    from .ui.dashboard import Dashboard

    folder = Path(runs_dir).expanduser().resolve() / time.strftime("demo-%Y%m%d-%H%M%S")
    n = 1
    while folder.exists():
        n += 1
        folder = folder.with_name(f"{folder.name.split('_')[0]}_{n}")
    folder.mkdir(parents=True)
    nb = quickstart_notebook(steps=steps, nproc=nproc, strategy=strategy)
    _write_notebook(nb, folder / "quickstart.ipynb")
    print(f"executing {folder / 'quickstart.ipynb'} on a {nproc}-process run (kernel: python3)", file=out, flush=True)
    client = NotebookClient(nb, kernel_name="python3", timeout=timeout, store_widget_state=True,
                            resources={"metadata": {"path": str(folder)}},
                            extra_arguments=["--IPKernelApp.log_level=ERROR"])  # fmt: skip
    failure: list[BaseException] = []

    def execute() -> None:
        try:
            client.execute()
        except BaseException as exc:  # reported below, with the cell that failed
            failure.append(exc)

    worker = threading.Thread(target=execute, name="jd-quickstart", daemon=True)
    t0 = time.time()
    worker.start()
    dash, shown = None, -1
    while worker.is_alive():
        worker.join(0.5)
        if dash is None:
            found = sorted((folder / "runs").glob("*/run.json"))
            if found:
                run = open_run(found[0].parent)
                print(f"started {run.world_size} processes; run directory {run.dir}", file=out, flush=True)
                dash = Dashboard(run, widget=False, interval=0.5)
        if dash is not None:
            shown = _follow(dash, shown, t0, out)
    _write_notebook(nb, folder / "quickstart.ipynb")
    if failure:
        exc = failure[0]
        if isinstance(exc, CellExecutionError):
            raise JupyterDistError(f"the quickstart failed in a cell ({folder / 'quickstart.ipynb'}):\n{exc}")
        raise JupyterDistError(f"the quickstart could not run: {type(exc).__name__}: {exc}")
    found = sorted((folder / "runs").glob("*/run.json"))
    if not found:
        raise JupyterDistError(f"the quickstart ran but started no run ({folder / 'quickstart.ipynb'})")
    run = open_run(found[0].parent)
    dash = Dashboard(run, widget=False, interval=0.5)
    _follow(dash, shown, t0, out)
    page = folder / "dashboard.html"
    write_atomic(page, _html_page(f"jupyter-dist demo: {run.name}", dash.static_html()))
    write_atomic(folder / "quickstart.html", offline_html(nb))
    print(run.summary(), file=out)
    print(f"notebook: {folder / 'quickstart.ipynb'}\nreport: {folder / 'quickstart.html'}\npanels: {page}", file=out)
    return run, folder


def offline_html(nb: Any) -> str:
    """An HTML export of an executed notebook that needs no network: widget views fall back to their HTML."""
    from nbconvert import HTMLExporter

    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)
    view = "application/vnd.jupyter.widget-view+json"
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data") or {}
            if view in data and "text/html" in data:
                del data[view]
    exporter = HTMLExporter(template_name="classic")
    body, _ = exporter.from_notebook_node(nb)
    return body


def run_demo(*, nproc: int = 2, strategy: str = "auto", steps: int = 300, runs_dir: str = "runs",
             out: TextIO = sys.stdout, timeout: float = 600.0) -> Any:  # fmt: skip
    """Train the demo model on ``nproc`` fresh processes without a notebook; print live progress; write the panels.

    The terminal shows what the notebook's dashboard shows (the same panel model): loss per record of rank 0 and
    the smoothed mean over ranks, throughput, memory and heartbeat state per rank. At the end the panels are
    written to ``<run dir>/dashboard.html`` (static SVG, opens in any browser without a kernel).
    """
    from .launch.options import RunOptions
    from .launch.session import start_run
    from .ui.dashboard import Dashboard

    opts = RunOptions(nproc=nproc, strategy=strategy, name="demo", runs_dir=runs_dir, timeout=timeout, output="none")
    run: Any = start_run(DEMO_CELL.format(steps=steps), opts)
    print(f"started {nproc} processes ({run.strategy or strategy}); run directory {run.dir}", file=out)
    dash = Dashboard(run, widget=False, interval=0.5)
    t0 = time.time()
    shown = -1  # the last seq of rank 0 printed
    while True:
        done = run.done
        shown = _follow(dash, shown, t0, out)
        if done:
            break
        time.sleep(0.5)
    page = Path(run.dir) / "dashboard.html"
    write_atomic(page, _html_page(f"jupyter-dist demo: {run.name}", dash.static_html()))
    print(run.summary(), file=out)
    print(f"panels: {page}", file=out)
    return run


def _progress_line(dash: Any, rec: dict[str, Any], elapsed: float) -> str:
    model = dash.model
    parts = [f"  step {rec['step']:5d}  loss {rec.get('loss', float('nan')):.3f}"]
    mean = model.lines["loss"].by_key.get("mean")
    if mean is not None and model.lines["loss"].series[mean].ys:
        parts.append(f"(mean over ranks {model.lines['loss'].series[mean].ys[-1]:.3f})")
    thr = model.lines["throughput"].series
    if thr and thr[0].ys and thr[0].ys[-1] is not None:
        parts.append(f"{thr[0].ys[-1]:,.0f} {model.rate_unit}")
    mem = model.memory_figure()["series"][0]["values"]
    if any(v is not None for v in mem):
        parts.append("RSS " + "/".join("?" if v is None else f"{v:.2f}" for v in mem) + " GiB")
    hb = model.heartbeat_figure()["labels"]
    if hb and any(hb):
        parts.append("hb " + ", ".join(label.split(" · ")[-1] if label else "?" for label in hb))
    return "  ".join(parts) + f"  ({elapsed:5.1f} s)"


def _html_page(title: str, body: str) -> str:
    import html

    head = f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
    return f"{head}<body style='font-family:sans-serif;margin:16px'><h3>{html.escape(title)}</h3>{body}</body></html>"
