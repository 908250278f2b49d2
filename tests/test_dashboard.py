"""The dashboard: panel model from recorded runs with a fake clock, the widget's messages without a front-end, a
real 2-process run feeding the panels, and a notebook executed by nbclient whose saved output keeps the curves."""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Any

import pytest

from jupyter_dist.telemetry import records
from jupyter_dist.telemetry.health import HB_COLORS
from jupyter_dist.ui.panels import DashboardModel, decimate_minmax


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def rec(kind: str, rank: int, seq: int, t: float, **fields: Any) -> dict[str, Any]:
    return records.make_record(kind, rank=rank, seq=seq, t=t, **fields)


def recorded_run(world: int = 2, steps: int = 30, t0: float = 1000.0) -> list[dict[str, Any]]:
    """What `world` ranks write for `steps` coalesced step records, one per second, with hb and mem."""
    out = []
    for r in range(world):
        seq = 0
        out.append(rec("start", r, seq, t0, world_size=world, strategy="ddp"))
        for s in range(steps):
            seq += 1
            t = t0 + 1 + s
            out.append(rec("step", r, seq, t, step=s * 10, n=10, loss=3.0 / (1 + s) + 0.01 * r, step_time=0.1,
                           tokens_per_s=5120.0))  # fmt: skip
            seq += 1
            out.append(rec("hb", r, seq, t, step=s * 10, phase="forward", phase_s=0.01))
            seq += 1
            out.append(rec("mem", r, seq, t, device="cpu", rss=(300 + s + r) << 20, max_rss=(310 + s + r) << 20))
    return out


# --------------------------------------------------------------------------- model
def test_model_builds_every_panel_from_a_recorded_run() -> None:
    clock = FakeClock(1031.0)
    m = DashboardModel(2, clock=clock)
    recs = recorded_run()
    m.ingest(sorted(recs, key=lambda r: (r["t"], -r["rank"])))  # ranks interleaved, rank 1 first
    figs = {f["id"]: f for f in m.figures()}
    assert list(figs) == ["loss", "throughput", "memory", "heartbeat", "comm"]
    loss = {t["name"]: t for t in figs["loss"]["traces"]}
    assert set(loss) == {"rank 0", "rank 1", "mean (smoothed)"}
    assert loss["rank 0"]["x"] == [s * 10 for s in range(30)] and loss["rank 1"]["y"][0] == pytest.approx(3.01)
    mean = loss["mean (smoothed)"]["y"]
    assert mean[0] == pytest.approx(3.005, rel=0.01) and mean[-1] < mean[0] / 2  # debiased, then decreasing
    (thr,) = figs["throughput"]["traces"]
    assert figs["throughput"]["y_title"] == "tokens/s" and thr["y"][-1] == pytest.approx(2 * 5120.0)
    mem = figs["memory"]
    assert mem["categories"] == ["rank 0", "rank 1"] and mem["series"][0]["name"] == "resident (RSS)"
    assert mem["series"][0]["values"] == pytest.approx([329 / 1024, 330 / 1024], abs=1e-3)
    assert mem["series"][1]["values"] == pytest.approx([339 / 1024, 340 / 1024], abs=1e-3)  # peak RSS
    assert mem["hlines"] == []  # no per-GPU overlay on a CPU run
    st = m.status()
    assert st == {**st, "state": "running", "step": 290, "world_size": 2, "ranks_alive": 2, "errors": []}


def test_heartbeat_panel_ages_with_the_clock() -> None:
    clock = FakeClock(1031.0)
    m = DashboardModel(2, hb_interval=2.0, clock=clock)
    m.ingest(recorded_run())
    hb = m.heartbeat_figure()
    assert hb["series"][0]["values"] == [1.0, 1.0] and hb["bar_colors"] == [HB_COLORS["ok"]] * 2
    assert hb["labels"] == ["forward · ok", "forward · ok"]
    clock.t += 40  # nothing for 40 s
    m.ingest([rec("hb", 1, 999, clock.t, step=290, phase="backward", phase_s=40.0)])  # rank 1 still beats
    hb = m.heartbeat_figure()
    assert hb["bar_colors"] == [HB_COLORS["hung"], HB_COLORS["ok"]] and hb["labels"][1] == "backward · ok"
    assert m.status()["ranks_alive"] == 1


def test_errors_exits_and_restarts_reach_the_status_line() -> None:
    m = DashboardModel(2, clock=FakeClock(1005.0))
    m.ingest(recorded_run(steps=3))
    m.ingest([rec("error", 1, 100, 1004.0, error_type="ValueError", error="bad <batch>", traceback="..."),
              rec("exit", 1, 101, 1004.1, status="error", error_type="ValueError", error="bad <batch>", step=20),
              rec("exit", 0, 100, 1004.2, status="terminated", error_type=None, error=None, step=20,
                  signal="SIGTERM")])  # fmt: skip
    m.ingest([rec("start", 0, 200, 1010.0, world_size=2)])  # rank 0 came back: an elastic restart
    st = m.status()
    assert st["errors"] == ["rank 1: ValueError: bad <batch>", "rank 1 exited with ValueError: bad <batch>",
                            "rank 0 was terminated (SIGTERM)"]  # fmt: skip
    assert st["restarts"] == 1
    html = m.status_html(title="run-1")
    assert "bad &lt;batch&gt;" in html and "<batch>" not in html and "1 restart(s)" in html
    labels = m.heartbeat_figure()["labels"]
    assert labels[1] == "error"


def test_gpu_memory_is_drawn_against_the_plan_and_the_device_limit() -> None:
    m = DashboardModel(2, plan_memory=40 * 2**30, clock=FakeClock())
    for r in range(2):
        m.ingest([rec("mem", r, 0, 1000.0, device=f"cuda:{r}", rss=5 << 30, allocated=(30 + r) << 30,
                      reserved=34 << 30, peak_allocated=36 << 30, peak_active=(37 + r) << 30, alloc_retries=0,
                      ooms=0, device_total=80 << 30),
                  rec("gpu", r, 1, 1000.0, index=r, util=93.0, mem_util=40.0, mem_used=35 << 30,
                      mem_total=80 << 30)])  # fmt: skip
    fig = m.memory_figure()
    assert fig["title"] == "Memory per rank (GPU)"
    assert [s["name"] for s in fig["series"]] == ["allocated", "reserved", "peak active"]
    assert fig["series"][0]["values"] == [30.0, 31.0] and fig["series"][2]["values"] == [37.0, 38.0]
    assert [(h["name"], h["y"]) for h in fig["hlines"]] == [("plan", 40.0), ("device limit", 80.0)]
    assert fig["labels"] == ["93% util", "93% util"]


def test_many_ranks_switch_to_aggregates_and_a_rank_by_time_heatmap() -> None:
    m = DashboardModel(64, clock=FakeClock(), per_rank_limit=16)
    for r in range(64):
        m.ingest([rec("step", r, s, 1000.0 + s, step=s, loss=1.0 + r / 64) for s in range(5)])
        m.ingest([rec("comm", r, 10 + s, 1000.0 + s, op="all_reduce", count=4, seconds=0.1 * (r == 7),
                      bytes=1 << 20) for s in range(5)])  # fmt: skip
    figs = {f["id"]: f for f in m.figures()}
    assert [t["name"] for t in figs["loss"]["traces"]] == ["mean (smoothed)", "min over ranks", "max over ranks"]
    assert figs["loss"]["traces"][2]["y"][-1] == pytest.approx(1 + 63 / 64)
    assert "comm" not in figs and figs["comm_heatmap"]["kind"] == "heatmap"
    z = figs["comm_heatmap"]["z"]
    assert len(z) == 64 and len(z[0]) == 5 and z[7][0] == pytest.approx(0.1) and z[6][0] == 0.0


def test_line_traces_are_capped_by_min_max_decimation_and_resent_whole() -> None:
    m = DashboardModel(1, max_points=200, clock=FakeClock())
    m.ingest([rec("step", 0, 0, 1000.0, step=0, loss=1.0)])
    m.take_extends()
    extends, whole = m.take_extends()
    assert (extends, whole) == ([], set())
    m.ingest([rec("step", 0, 1, 1001.0, step=1, loss=0.9)])
    extends, whole = m.take_extends()
    assert whole == set() and [(e.figure, e.traces, e.xs) for e in extends] == [("loss", [0, 1], [[1.0], [1.0]])]
    spike_at = 5_000
    m.ingest([rec("step", 0, s, 1000.0 + s, step=s, loss=100.0 if s == spike_at else 1 / s) for s in range(2, 10_000)])
    extends, whole = m.take_extends()
    assert "loss" in whole
    (trace, mean) = m.lines["loss"].series
    assert len(trace.xs) <= 200 and trace.total == 10_000 and trace.bucket > 0
    assert 100.0 in trace.ys and trace.xs[0] == 0 and trace.xs[-1] >= 9_999 - trace.bucket  # spike and ends survive


def test_a_fast_stream_extends_at_the_decimated_resolution_instead_of_resending() -> None:
    m = DashboardModel(1, max_points=400, clock=FakeClock())
    wholes, extended = 0, 0
    for second in range(50):  # 2,000 steps per update: five times the cap each time
        m.ingest([rec("step", 0, s, 1000.0 + s / 2000, step=s, loss=1.0 + (s % 7)) for s in
                  range(second * 2000, (second + 1) * 2000)])  # fmt: skip
        extends, whole = m.take_extends()
        wholes += "loss" in whole
        extended += sum(e.points for e in extends if e.figure == "loss")
        assert max(len(s.xs) for s in m.lines["loss"].series) <= 400
    assert wholes <= 12, wholes  # about log2(100,000 / 400) re-sends, not one per update
    assert extended > 0


def test_decimation_keeps_extremes_in_x_order() -> None:
    xs = [float(i) for i in range(1000)]
    ys = [float((i * 37) % 101) for i in range(1000)]
    dx, dy = decimate_minmax(xs, ys, 100)
    assert len(dx) <= 100 and dx == sorted(dx) and max(dy) == 100.0 and min(dy) == 0.0


# --------------------------------------------------------------------------- the widget, without a front-end
def write_run_dir(tmp_path: Path, recs: list[dict[str, Any]], status: str = "running") -> Path:
    run_dir = tmp_path / "run-1"
    (run_dir / "telemetry").mkdir(parents=True)
    (run_dir / "logs").mkdir()
    meta = {"name": "run-1", "status": status, "strategy": "ddp", "world_size": 2, "nproc": 2, "nodes": 1,
            "env": {"JD_HEARTBEAT_S": "2"}, "created": 1000.0, "started": 1000.0}  # fmt: skip
    (run_dir / "run.json").write_text(json.dumps(meta))
    append(run_dir, recs)
    return run_dir


def append(run_dir: Path, recs: list[dict[str, Any]]) -> None:
    for r in recs:
        with (run_dir / "telemetry" / f"rank-{r['rank']}.jsonl").open("a") as fh:
            fh.write(records.encode(r) + "\n")


class Sent:
    def __init__(self, widget: Any) -> None:
        self.messages: list[tuple[dict[str, Any], list[bytes]]] = []
        widget.send = lambda content, buffers=None: self.messages.append((content, list(buffers or [])))


def test_widget_state_then_binary_extends_from_a_followed_run_dir(tmp_path: Path) -> None:
    pytest.importorskip("anywidget")
    from jupyter_dist.ui.dashboard import Dashboard, _library

    recs = recorded_run(steps=30)
    first = [r for r in recs if r["t"] <= 1010.0]
    run_dir = write_run_dir(tmp_path, first)
    clock = FakeClock(1010.0)
    dash = Dashboard(run_dir, clock=clock)
    w = dash.widget
    assert w.lib == _library().model_id and len(_library().src) > 1_000_000  # plotly.js, shipped once per kernel
    assert w.layout_ids == ["loss", "throughput", "memory", "heartbeat", "comm"]
    loss0 = {t["name"]: t for t in w.line_figs[0]["traces"]}["rank 0"]
    assert loss0["x"] == [s * 10 for s in range(10)]  # the initial state holds every point so far
    sent = Sent(w)
    append(run_dir, [r for r in recs if 1010.0 < r["t"] <= 1012.0])
    clock.t = 1012.0
    stats = dash.update()
    ((content, buffers),) = [m for m in sent.messages if m[0]["fig"] == "loss"]
    assert content == {"type": "extend", "fig": "loss", "traces": [0, 1, 2]}
    xs = [list(array("d", b)) for b in buffers[0::2]]
    ys = [list(array("d", b)) for b in buffers[1::2]]
    assert xs[0] == [100.0, 110.0] and ys[0] == pytest.approx([3.0 / 11, 3.0 / 12])
    # per-rank loss 2 + 2, the mean one per step (2: a step's second record moves the EMA, adds no point),
    # throughput one per record (4)
    assert stats.records == 12 and stats.points == 2 + 2 + 2 + 4 and stats.whole_figures == 0
    mean = xs[2]
    assert mean == sorted(set(mean)), "the smoothed mean has one point per step, no vertical ticks"
    assert stats.bytes_sent < 2_000  # new points only
    assert "step 110" in w.status_html
    assert {f["id"] for f in w.small_figs} == {"memory", "heartbeat"}


def test_a_finished_run_renders_static_panels_without_javascript(tmp_path: Path) -> None:
    from jupyter_dist import open_run

    run_dir = write_run_dir(tmp_path, recorded_run(steps=5), status="succeeded")
    run = open_run(run_dir)
    bundle = run._repr_mimebundle_()
    html = bundle["text/html"]
    assert "<script" not in html and html.count("<svg") >= 4 and "Loss" in html
    assert "polyline" in html or "<path" in html


def test_a_run_shows_the_views_subscribed_to_its_hooks(tmp_path: Path) -> None:
    """launch/views.py: a Run asks its hooks for panels (the launch layer imports no ui); the package root subscribes
    the notebook's panels, and another front-end can subscribe its own."""
    from jupyter_dist.launch import views
    from jupyter_dist.launch.run import open_run
    from jupyter_dist.ui.dashboard import Dashboard

    run = open_run(write_run_dir(tmp_path, recorded_run(steps=5), status="succeeded"))
    assert isinstance(run.dashboard(widget=False), Dashboard)
    seen: list[tuple[Any, dict[str, Any]]] = []

    def live(r: Any, **kwargs: Any) -> str:
        seen.append((r, kwargs))
        return "panels"

    previous = views.subscribe(live=live, static=lambda r: f"<p>panels of {r.name}</p>")
    try:
        assert run.dashboard(interval=3) == "panels" and seen == [(run, {"interval": 3})]
        assert run._repr_mimebundle_()["text/html"].endswith(f"<p>panels of {run.name}</p>")
    finally:
        views.restore(previous)
    assert "<svg" in run._repr_mimebundle_()["text/html"]


# --------------------------------------------------------------------------- real runs
SLOW_TRAIN = """
import time
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
model, opt = jd.wrap(model, opt)
X, y = torch.randn(64, 16), torch.randn(64, 1)
for step in range(STEPS):
    loss = torch.nn.functional.mse_loss(model(X), y)
    jd.backward(loss)
    jd.step(opt)
    jd.log(step, loss=loss, tokens=64)
    time.sleep(0.02)
if jd.rank == 1:
    time.sleep(1.0)  # rank 0 waits in the barrier below: its heartbeats keep coming, phase "wait"
with jd.phase("wait"):
    jd.barrier()
"""


@pytest.mark.slow
def test_a_real_two_process_run_feeds_the_live_panels(ip: Any, runs: Path) -> None:
    pytest.importorskip("anywidget")
    magics = ip.magics_manager.registry["DistMagics"]
    magics.dashboard = "on"
    try:
        run = ip.run_cell_magic("dist_train", "--nproc 2 --strategy ddp --heartbeat 0.25 --telemetry-interval 0.2 "
                                "--timeout 120", SLOW_TRAIN.replace("STEPS", "150"))  # fmt: skip
    finally:
        magics.dashboard = "auto"
    dash = run.shown_dashboard
    assert dash is not None and dash.widget is not None and run._skip_display
    sent = Sent(dash.widget)  # the workers need seconds to start: nothing was sent yet
    assert run.wait(150) == "succeeded", run.summary()
    assert dash.finished.wait(20)
    figs = {f["id"]: f for f in dash.figures()}
    loss = {t["name"]: t for t in figs["loss"]["traces"]}
    for rank in (0, 1):
        assert len(loss[f"rank {rank}"]["x"]) >= 5 and loss[f"rank {rank}"]["x"][-1] == 149
    assert loss["rank 0"]["y"][-1] < loss["rank 0"]["y"][0]
    assert figs["throughput"]["y_title"] == "tokens/s" and len(figs["throughput"]["traces"][0]["y"]) >= 5
    assert all(v and v > 0.05 for v in figs["memory"]["series"][0]["values"])  # RSS of a torch process, GiB
    hbs = list(dash.reader.buffers["hb"])
    phases = {(r["rank"], r["phase"]) for r in hbs}
    assert sum(r["rank"] == 0 for r in hbs) >= 5 and sum(r["rank"] == 1 for r in hbs) >= 5
    assert (0, "wait") in phases  # rank 0 beat while blocked in the barrier
    assert dash.stats.extends > 0 and any(c["fig"] == "loss" for c, _ in sent.messages)
    # collective timings: DDP's bucket all-reduces on both ranks, and rank 0 waiting ~1 s in the barrier for rank 1
    comm = list(dash.reader.buffers["comm"])
    assert {r["rank"] for r in comm} == {0, 1}
    assert any("all_reduce (DDP buckets)" in r["ops"] for r in comm)
    barrier = {r["rank"]: r["ops"]["barrier"]["seconds"] for r in comm if "barrier" in r["ops"]}
    assert barrier[0] > 0.7 and barrier[0] > barrier.get(1, 0.0) + 0.5, barrier
    assert {t["name"] for t in figs["comm"]["traces"]} == {"rank 0", "rank 1"}
    assert "succeeded" in dash.widget.status_html and dash.model.status()["errors"] == []
    assert dash.reader.bad_lines == 0


def _notebook(cells: list[str]) -> Any:
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    return nb


def _execute(nb: Any, cwd: Path) -> Any:
    nbclient = pytest.importorskip("nbclient")
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=240, resources={"metadata": {"path": str(cwd)}})
    return client.execute()


@pytest.mark.slow
def test_a_notebook_keeps_the_final_curves_after_the_kernel_is_gone(tmp_path: Path) -> None:
    """nbclient runs a real kernel: the live display is replaced by static panels, which an HTML export keeps;
    a fresh kernel reopens the run from its directory and draws the same panels."""
    pytest.importorskip("anywidget")
    cell = "%%dist_train --nproc 2 --strategy ddp --wait --name r --runs-dir runs\n" + SLOW_TRAIN.replace("STEPS", "40")
    nb = _execute(_notebook(["%load_ext jupyter_dist", cell, "print(r.status, r.dir)"]), tmp_path)
    outputs = nb.cells[1].outputs
    shown = [o for o in outputs if o.get("output_type") == "display_data"]
    # the panels, and the ranks' output (rank 0's prints, streamed under the cell)
    (final,) = [o for o in shown if "[rank" not in o["data"].get("text/plain", "") and "printed" not in
                o["data"].get("text/plain", "")]  # fmt: skip
    assert len(shown) == 2
    assert "application/vnd.jupyter.widget-view+json" not in final["data"]  # turned static at the end
    html = final["data"]["text/html"]
    assert html.count("<svg") >= 4 and "<script" not in html and "succeeded" in html
    status, run_dir = nb.cells[2].outputs[0]["text"].split()
    assert status == "succeeded"
    nbconvert = pytest.importorskip("nbconvert")
    body, _ = nbconvert.HTMLExporter().from_notebook_node(nb)
    assert body.count("<svg") >= 4 and "Loss" in body

    again = _execute(_notebook([f"from jupyter_dist import open_run\nopen_run({run_dir!r})"]), tmp_path)
    data = again.cells[0].outputs[0]["data"]
    assert "succeeded" in data["text/plain"] and data["text/html"].count("<svg") >= 4
