"""Two real 2-process runs with different strategies, compared in one view; a profiled run with a slowed rank.

One module fixture starts both runs through ``%%dist_train`` in a real IPython shell (torchrun, gloo on CPU): ``ddp``
with ``--profile 3:6`` and a 0.2 s sleep on rank 1 in those steps, and ``fsdp2`` without profiling. The tests then
read them as a table, overlay them (model and static SVG), and check the traces and their summary.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from jupyter_dist.errors import JupyterDistError  # noqa: E402
from jupyter_dist.launch.runs import runs  # noqa: E402
from jupyter_dist.telemetry.profile import load_trace, profile_summary, summarize_traces  # noqa: E402
from jupyter_dist.ui.compare import CompareModel, compare  # noqa: E402

CELL = """
import time, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
model, opt = jd.wrap(model, opt)
g = torch.Generator().manual_seed(jd.rank)
X = torch.randn(64, 64, generator=g)
y = X[:, :1]
for step in range(8):
    loss = torch.nn.functional.mse_loss(model(X), y)
    if SLOW and jd.rank == 1 and 3 <= step < 6:
        time.sleep(0.2)   # the injected straggler, inside the profiled window
    jd.backward(loss)
    jd.step(opt)
    jd.log(step, loss=loss, tokens=64 * 64)
"""


@pytest.fixture(scope="module")
def two_runs(ip: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path]:
    folder = tmp_path_factory.mktemp("cmp")
    ip.config.DistMagics.runs_dir = str(folder)
    ip.magics_manager.registry["DistMagics"].runs_dir = str(folder)
    common = "--nproc 2 --telemetry-interval 0 --no-dashboard --wait"
    a = ip.run_cell_magic("dist_train", f"{common} --strategy ddp --profile 3:6 --name cmp_ddp",
                          CELL.replace("SLOW", "True"))  # fmt: skip
    b = ip.run_cell_magic("dist_train", f"{common} --strategy fsdp2 --name cmp_fsdp", CELL.replace("SLOW", "False"))
    assert a.status == "succeeded", a.summary()
    assert b.status == "succeeded", b.summary()
    return a, b, folder


@pytest.mark.slow
def test_two_strategies_compared_in_one_view(two_runs: tuple[Any, Any, Path], tmp_path: Path) -> None:
    a, b, _ = two_runs
    cmp = compare(a, b)
    assert not cmp.live
    figs = {f["id"]: f for f in cmp.figures()}
    assert set(figs) == {"cmp-loss", "cmp-throughput", "cmp-memory"}
    for fid in figs:
        names = [t["name"] for t in figs[fid]["traces"]]
        assert names == [f"{a.name} (ddp)", f"{b.name} (fsdp2)"], fid
    loss = figs["cmp-loss"]["traces"]
    assert [t["x"] for t in loss] == [list(range(8)), list(range(8))]  # one point per step, mean over ranks
    assert all(t["y"][-1] < t["y"][0] for t in loss)  # both trained
    assert figs["cmp-throughput"]["y_title"] == "tokens/s" and all(len(t["x"]) >= 7 for t in
                                                                    figs["cmp-throughput"]["traces"])  # fmt: skip
    assert all(t["y"] and min(t["y"]) > 0.01 for t in figs["cmp-memory"]["traces"])  # GiB of the ranks' RSS
    html = cmp.static_html()
    assert html.count("<svg") == 3 and "<script" not in html
    assert a.name in html and b.name in html and "succeeded" in html
    by_time = compare(a.dir, b.dir, x="time")  # run directories work too; x in seconds since each start
    xs = by_time.figures()[0]["traces"][0]["x"]
    assert xs[0] >= 0 and xs == sorted(xs) and xs[-1] < 120
    out = cmp.save(tmp_path / "cmp.html")
    assert out.read_text().count("<svg") == 3
    with pytest.raises(JupyterDistError, match="x='epoch' is not valid; valid: step, time"):
        compare(a, b, x="epoch")
    with pytest.raises(JupyterDistError, match="compare needs at least one run"):
        compare()


@pytest.mark.slow
def test_the_real_runs_in_the_table(two_runs: tuple[Any, Any, Path]) -> None:
    a, b, folder = two_runs
    assert (a.dir / "summary.json").is_file() and (b.dir / "summary.json").is_file()  # written at the end
    t = runs(folder)
    assert {r.name for r in t} == {a.name, b.name}
    for row, strategy in ((t[a.name], "ddp"), (t[b.name], "fsdp2")):
        assert (row.strategy, row.status, row.steps, row.world_size) == (strategy, "succeeded", 8, 2)
        assert row.throughput_unit == "tokens/s" and row.throughput and row.throughput > 0
        assert len(row.peak_mem) == 2 and min(row.peak_mem) > 10 << 20
        assert row.best_loss is not None and row.last_loss is not None and row.best_loss <= row.last_loss
        assert row.duration and 0 < row.duration < 300
    cmp = compare(*t)  # a whole table
    assert len(cmp.figures()[0]["traces"]) == 2


@pytest.mark.slow
def test_profiled_run_traces_and_the_slow_rank(two_runs: tuple[Any, Any, Path]) -> None:
    a, b, _ = two_runs
    files = sorted((a.dir / "profile").glob("*.json"))
    assert [f.name for f in files] == ["rank-0.pt.trace.json", "rank-1.pt.trace.json"]
    for f in files:  # the Chrome trace-event format (what Perfetto and TensorBoard's profiler read)
        data = json.loads(f.read_text())
        events = data["traceEvents"]
        assert isinstance(events, list) and events
        for e in events:
            assert {"ph", "name", "pid"} <= set(e), e
            if e["ph"] == "X":
                assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0
        steps = sorted(int(m.group(1)) for e in events if (m := re.match(r"ProfilerStep#(\d+)$", e["name"])))
        assert steps == [3, 4, 5]  # the window, and nothing outside it
        assert data["distributedInfo"]["world_size"] == 2
    assert not (b.dir / "profile").exists()  # no --profile: no profiler ran, no trace
    s = a.profile()
    assert s.slowest == 1, s.text()
    assert s.verdict().startswith("rank 1 is the slowest: rank 0 waits")
    r0, r1 = s.ranks
    assert [st.step for st in r0.steps] == [3, 4, 5]
    assert r1.mean("idle") > 0.15 and r0.mean("comm") > 0.15  # rank 1 sleeps; rank 0 waits for it
    assert r0.mean("idle") < r1.mean("idle")
    assert any(w.rank == 0 and w.on == 1 and "all_reduce" in w.collective and w.seconds > 0.4 for w in s.waits)
    assert r0.top_ops and all(sec >= 0 for _, sec, _ in r0.top_ops)
    assert "rank 1 is the slowest" in a._repr_mimebundle_()["text/html"]  # the finished run's card shows it


@pytest.mark.slow
def test_profiled_traces_open_with_holistic_trace_analysis(two_runs: tuple[Any, Any, Path]) -> None:
    """The traces open with a profiler's own loader, not only as JSON: PyTorch's HolisticTraceAnalysis (``hta``, in
    the [test] extra; it needs no other torch) parses both ranks' files as one distributed trace; its frames hold the
    profiled window's steps, and rank 0's all-reduces, which wait for the slowed rank 1, take longer than rank 1's,
    as the raw events say."""
    pytest.importorskip("hta", reason='HolisticTraceAnalysis is not installed: pip install "jupyter-dist[test]"')
    from hta.trace_analysis import TraceAnalysis

    a, _, _ = two_runs
    # include_last_profiler_step: HTA drops the last step by default (often cut short); ours is whole
    analysis = TraceAnalysis(trace_dir=str(a.dir / "profile"), include_last_profiler_step=True)
    assert sorted(analysis.t.get_ranks()) == [0, 1]  # from each file's distributedInfo
    symbols = analysis.t.symbol_table.sym_table
    waited = {}
    for rank in (0, 1):
        frame = analysis.t.get_trace(rank)
        names = frame["name"].map(lambda i: symbols[i])
        steps = sorted(int(m.group(1)) for n in names if (m := re.match(r"ProfilerStep#(\d+)$", n)))
        assert steps == [3, 4, 5], (rank, steps)
        is_ar = names.str.contains("all_reduce|allreduce", regex=True)
        assert is_ar.any(), sorted(set(names))[:40]
        waited[rank] = float(frame.loc[is_ar, "dur"].sum())
        raw = [e for e in load_trace(a.dir / "profile" / f"rank-{rank}.pt.trace.json")["traceEvents"]
               if e.get("ph") == "X" and re.search("all_reduce|allreduce", e["name"])]  # fmt: skip
        assert waited[rank] == pytest.approx(sum(e["dur"] for e in raw), rel=0.01)  # the same events, read by hta
    assert waited[0] > 2 * waited[1], waited


def test_profile_summary_errors(tmp_path: Path) -> None:
    with pytest.raises(JupyterDistError, match="no profiler traces in"):
        profile_summary(tmp_path)
    bad = tmp_path / "rank-0.pt.trace.json"
    bad.write_text("{}")
    with pytest.raises(JupyterDistError, match="not a Chrome trace"):
        load_trace(bad)


def test_summary_of_hand_made_traces_names_who_waits() -> None:
    def trace(step_ms: float, ar_ms: list[float], op_ms: float) -> dict[str, Any]:
        ev: list[dict[str, Any]] = []
        t = 0.0
        for i, ar in enumerate(ar_ms):
            ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "pid": 1, "tid": 1,
                       "ts": t, "dur": step_ms * 1e3})  # fmt: skip
            ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": t, "dur": op_ms * 1e3})
            ev.append({"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": 1, "tid": 2,
                       "ts": t + op_ms * 1e3, "dur": ar * 1e3})  # fmt: skip
            t += step_ms * 1e3
        return {"traceEvents": ev}

    s = summarize_traces({0: trace(100, [2, 2], 10), 1: trace(100, [60, 62], 10), 2: trace(100, [61, 60], 10)})
    assert s.slowest == 0  # ranks 1 and 2 wait ~58 ms each time in all_reduce: for rank 0
    assert {(w.rank, w.on) for w in s.waits} == {(1, 0), (2, 0)}
    r1 = s.ranks[1]
    assert r1.mean("compute") == pytest.approx(0.010) and r1.mean("comm") == pytest.approx(0.061)
    assert r1.mean("idle") == pytest.approx(0.029)
    assert s.ranks[0].top_ops[0][0] == "aten::mm"
    quiet = summarize_traces({0: trace(50, [1, 1], 5), 1: trace(50, [1, 1], 5)})
    assert quiet.slowest is None and quiet.verdict() == "no rank waited noticeably for another in collectives"


def test_compare_model_by_step_and_time() -> None:
    from jupyter_dist.telemetry.records import make_record

    m = CompareModel(["a", "b"], x="step")
    for i, scale in ((0, 1.0), (1, 2.0)):
        m.ingest(i, [make_record("step", rank=r, seq=s, t=100.0 + s, step=s, loss=scale * (r + 1) / (s + 1),
                                 step_time=0.5) for r in (0, 1) for s in range(4)])  # fmt: skip
        m.ingest(i, [make_record("mem", rank=0, seq=10, t=102.5, max_rss=scale * (1 << 30))])
    loss = m.loss_figure()["traces"]
    assert loss[0]["x"] == [0.0, 1.0, 2.0, 3.0] and loss[0]["y"][0] == pytest.approx(1.5)
    assert loss[1]["y"][0] == pytest.approx(3.0)
    thr = m.throughput_figure()
    assert thr["y_title"] == "steps/s" and thr["traces"][0]["y"][0] == pytest.approx(2.0)  # mean over ranks
    mem = m.memory_figure()["traces"]
    assert mem[1]["x"] == [2.0, 3.0] and mem[1]["y"] == [pytest.approx(2.0)] * 2  # from the step before, held
    mt = CompareModel(["a"], x="time")
    mt.ingest(0, [make_record("step", rank=0, seq=s, t=50.0 + 2 * s, step=s, loss=1.0) for s in range(3)])
    assert mt.loss_figure()["traces"][0]["x"] == [0.0, 2.0, 4.0]


# ---- the worker side, in this process ---------------------------------------------------------------------------
def _runtime(tmp_path: Path, **fields: Any) -> Any:
    from jupyter_dist.worker._env import WorkerEnv
    from jupyter_dist.worker._runtime import Runtime

    (tmp_path / "telemetry").mkdir(exist_ok=True)
    return Runtime(WorkerEnv(distributed=False, run_dir=str(tmp_path), heartbeat_s=0.0, **fields))


def _steps_in(path: Path) -> list[int]:
    events = json.loads(path.read_text())["traceEvents"]
    return sorted(int(m.group(1)) for e in events if (m := re.match(r"ProfilerStep#(\d+)$", e.get("name", ""))))


def test_jd_profile_records_only_its_window(tmp_path: Path) -> None:
    import torch

    rt = _runtime(tmp_path)
    assert rt.profiler is None  # no window asked: no profiler object at all
    prof = rt.profile("2:4")
    x = torch.randn(32, 32)
    for step in range(6):
        (x @ x).sum()
        rt.log(step, {"loss": 1.0})
        assert prof.active == (step in (1, 2)), step  # started after step 1's log, stopped at step 3's
    trace = tmp_path / "profile" / "rank-0.pt.trace.json"
    assert prof.written == str(trace) and _steps_in(trace) == [2, 3]
    with rt.profile() as block:  # a block: each jd.log inside marks a step
        (x @ x).sum()
        rt.log(6, {"loss": 1.0})
        (x @ x).sum()
    block_trace = Path(block.written)
    assert block_trace.name == "rank-0.block-6.pt.trace.json" and _steps_in(block_trace) == [6, 7]
    rt.emitter.close()


def test_a_window_from_env_starts_at_wrap_for_step_zero_and_bad_windows_are_one_line(tmp_path: Path) -> None:
    import torch

    from jupyter_dist.worker._env import WorkerEnv, WorkerError
    from jupyter_dist.worker._profile import parse_window

    rt = _runtime(tmp_path, profile="0:1")
    model, _ = rt.wrap(torch.nn.Linear(4, 4))
    assert rt.profiler.active  # from step 0: recording since jd.wrap returned
    model(torch.randn(2, 4)).sum().backward()
    rt.log(0, {"loss": 0.5})
    assert not rt.profiler.active and _steps_in(tmp_path / "profile" / "rank-0.pt.trace.json") == [0]
    rt.emitter.close()
    assert parse_window("5:8") == (5, 8) and parse_window(3) == (3, 4) and parse_window(range(2, 4)) == (2, 4)
    for bad, msg in (("8:5", "STOP must be > START"), ("a:b", "give STEP"), ("0:5000", "at most 1000"),
                     (-1, "STOP must be > START")):  # fmt: skip
        with pytest.raises(WorkerError, match=msg):
            parse_window(bad)
    with pytest.raises(WorkerError, match="JD_PROFILE: profile window 'x' is not valid"):
        WorkerEnv.from_environ({"JD_PROFILE": "x"})
    assert WorkerEnv.from_environ({"JD_PROFILE": "5:8"}).to_environ()["JD_PROFILE"] == "5:8"


def test_dist_train_profile_flag(ip: Any, tmp_path: Path) -> None:
    from IPython.core.error import UsageError

    dry = ip.run_cell_magic("dist_train", f"--nproc 2 --profile 3 --dry-run --runs-dir {tmp_path}", "pass")
    assert "JD_PROFILE=3:4" in str(dry._repr_mimebundle_()["text/plain"])
    with pytest.raises(UsageError, match="--profile: profile window 5:2 is empty or negative: STOP must be > START"):
        ip.run_cell_magic("dist_train", f"--nproc 2 --profile 5:2 --dry-run --runs-dir {tmp_path}", "pass")


def test_a_profiler_that_cannot_start_leaves_training_alone_and_a_bare_profile_waits_for_with(tmp_path: Path) -> None:
    import torch

    rt = _runtime(tmp_path)
    bare = rt.profile()  # no steps and no `with`: nothing is recorded
    for step in range(3):
        rt.log(step, {"loss": 1.0})
    assert not bare.active and not bare.done and not (tmp_path / "profile").exists()
    with torch.profiler.profile():  # the script's own profiler holds the process's profiler
        prof = rt.profile("4:6")
        for step in range(3, 7):
            rt.log(step, {"loss": 1.0})  # no exception reaches the training loop
    assert prof.done and prof.written is None and not (tmp_path / "profile").exists()
    rt.emitter.close()
