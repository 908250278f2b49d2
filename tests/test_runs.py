"""Runs as a collection: the per-run summary, the runs table (sort, filter, open), tags and notes, %dist_runs.

Run directories here are written record by record with the telemetry encoder (the same lines the ranks write); the
real 2-process runs that feed a table and a comparison are in tests/test_compare_profile.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from jupyter_dist.errors import JupyterDistError
from jupyter_dist.launch.run import open_run
from jupyter_dist.launch.runs import RunTable, runs
from jupyter_dist.telemetry.records import encode, make_record
from jupyter_dist.telemetry.summary import SUMMARY_FILE, read_summary, summarize_records, write_summary

GIB = 1 << 30


def make_run(root: Path, name: str, *, strategy: str = "ddp", status: str = "succeeded", steps: int = 20,
             ranks: int = 2, t0: float = 1.79e9, loss0: float = 2.0, rate: float = 1000.0, restarts: int = 0,
             summary: bool = False, peak: float = 1e9) -> Path:  # fmt: skip
    """A run directory as a finished 2-rank run leaves it (run.json + telemetry lines)."""
    d = root / name
    (d / "telemetry").mkdir(parents=True)
    meta = {"name": name, "status": status, "strategy": strategy, "candidate": strategy, "world_size": ranks,
            "notes": [f"{ranks} ranks: dp {ranks}"], "started": t0, "launcher": {"kind": "local"}}  # fmt: skip
    if status != "running":
        meta["ended"] = t0 + steps
    (d / "run.json").write_text(json.dumps(meta))
    for r in range(ranks):
        seq, lines = 0, []
        for _attempt in range(restarts + 1):
            lines.append(encode(make_record("start", rank=r, seq=seq, t=t0, world_size=ranks)))
            seq += 1
        for s in range(steps):
            t = t0 + s + 0.5
            lines.append(encode(make_record("step", rank=r, seq=seq, t=t, step=s, n=1, loss=loss0 / (1 + s) + r,
                                            step_time=0.5, tokens_per_s=rate)))  # fmt: skip
            lines.append(encode(make_record("mem", rank=r, seq=seq + 1, t=t, rss=peak / 2, max_rss=peak * (1 + r))))
            seq += 2
        (d / "telemetry" / f"rank-{r}.jsonl").write_text("\n".join(lines) + "\n")
    if summary:
        write_summary(d)
    return d


# ---- summary ----------------------------------------------------------------------------------------------------
def test_summary_condenses_the_records(tmp_path: Path) -> None:
    d = make_run(tmp_path, "a", steps=10, loss0=2.0, rate=1500.0, restarts=1, peak=2e9)
    s = write_summary(d)
    assert s["steps"] == 10
    assert s["last_loss"] == pytest.approx((2.0 / 10 + 2.0 / 10 + 1) / 2)  # mean over ranks of step 9
    assert s["best_loss"] == s["last_loss"] and s["best_step"] == 9  # decreasing loss: the best is the last
    assert s["throughput"] == pytest.approx(3000.0) and s["throughput_unit"] == "tokens/s"  # summed over ranks
    assert s["peak_mem"] == {"0": int(2e9), "1": int(4e9)}
    assert s["restarts"] == 1 and s["ranks"] == 2
    assert read_summary(d) == s and json.loads((d / SUMMARY_FILE).read_text()) == s


def test_summary_takes_steps_per_second_without_token_counts_and_skips_nonfinite() -> None:
    recs = [make_record("step", rank=0, seq=i, t=float(i), step=i, loss=v, step_time=0.25)
            for i, v in enumerate([3.0, math.nan, 1.0, 2.0])]  # fmt: skip
    s = summarize_records(recs)
    assert s["throughput"] == pytest.approx(4.0) and s["throughput_unit"] == "steps/s"
    assert s["best_loss"] == 1.0 and s["best_step"] == 2 and s["last_loss"] == 2.0 and s["steps"] == 4
    empty = summarize_records([])
    assert empty["steps"] == 0 and empty["last_loss"] is None and empty["throughput"] is None


def test_a_damaged_or_foreign_summary_is_recomputed(tmp_path: Path) -> None:
    d = make_run(tmp_path, "a", steps=5)
    (d / SUMMARY_FILE).write_text("{not json")
    assert read_summary(d) is None
    (d / SUMMARY_FILE).write_text(json.dumps({"v": 999, "steps": 1}))
    assert read_summary(d) is None
    assert runs(tmp_path)[0].steps == 5  # computed from the telemetry, then saved for the next table
    assert read_summary(d) is not None and read_summary(d)["steps"] == 5  # type: ignore[index]


# ---- the table --------------------------------------------------------------------------------------------------
@pytest.fixture
def folder(tmp_path: Path) -> Path:
    make_run(tmp_path, "ddp-a", strategy="ddp", loss0=4.0, rate=900.0, t0=1.79e9, summary=True)
    make_run(tmp_path, "fsdp-b", strategy="fsdp2", loss0=1.0, rate=1200.0, t0=1.79e9 + 100, peak=3e9)
    make_run(tmp_path, "bad-c", strategy="zero2", status="failed", steps=3, t0=1.79e9 + 200)
    make_run(tmp_path, "live-d", strategy="fsdp2", status="running", steps=2, t0=1.79e9 + 300)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "run.json").write_text("[1, 2")  # damaged: skipped, counted
    (tmp_path / "not-a-run").mkdir()  # no run.json: not a run
    return tmp_path


def test_the_table_lists_every_readable_run_newest_first(folder: Path) -> None:
    t = runs(folder)
    assert [r.name for r in t] == ["live-d", "bad-c", "fsdp-b", "ddp-a"]
    assert t.skipped == 1
    b = t["fsdp-b"]
    assert (b.backend, b.strategy, b.status, b.world_size, b.steps) == ("local", "fsdp2", "succeeded", 2, 20)
    assert b.mesh == "2 ranks: dp 2" and b.throughput == pytest.approx(2400.0) and b.throughput_unit == "tokens/s"
    assert b.peak_mem == (int(3e9), int(6e9)) and b.peak_mem_max == int(6e9) and b.duration == pytest.approx(20.0)
    assert t["live-d"].duration is not None and t["live-d"].duration > 1e6  # still running: measured to now
    assert not (folder / "live-d" / SUMMARY_FILE).exists()  # a live run's summary is not frozen
    assert (folder / "bad-c" / SUMMARY_FILE).exists()  # a finished one's is saved once


def test_sort_and_filter(folder: Path) -> None:
    t = runs(folder)
    by_loss = t.sort("best_loss")
    assert [r.name for r in by_loss] == ["fsdp-b", "ddp-a", "bad-c", "live-d"]
    assert [r.name for r in t.sort("-throughput")][0] == "fsdp-b"
    assert [r.name for r in t.sort("peak_mem_max", descending=True)][0] == "fsdp-b"
    assert [r.name for r in t.filter(strategy="fsdp2")] == ["live-d", "fsdp-b"]
    assert [r.name for r in t.filter(status=["failed", "running"])] == ["live-d", "bad-c"]
    assert [r.name for r in t.filter(text="ZERO")] == ["bad-c"]
    assert [r.name for r in t.filter(lambda r: r.steps >= 20)] == ["fsdp-b", "ddp-a"]
    assert len(t.filter(status="hung")) == 0
    assert isinstance(t[1:3], RunTable) and len(t[1:3]) == 2
    with pytest.raises(JupyterDistError, match="cannot sort by 'speed'; columns: name"):
        t.sort("speed")
    with pytest.raises(JupyterDistError, match="cannot filter by colour"):
        t.filter(colour="red")
    with pytest.raises(JupyterDistError, match="no run named 'zzz'"):
        t.row("zzz")


def test_tags_and_notes_persist_and_filter(folder: Path) -> None:
    run = open_run(folder / "ddp-a")
    assert run.tag("baseline", "lr-3e-4", "baseline") == ["baseline", "lr-3e-4"]
    run.note("first try with ddp")
    again = open_run(folder / "ddp-a")  # another handle, e.g. after a kernel restart
    assert again.tags == ["baseline", "lr-3e-4"] and again.notes_text == ["first try with ddp"]
    assert again.tag("lr-3e-4", remove=True) == ["baseline"]
    t = runs(folder)
    assert [r.name for r in t.filter(tag="baseline")] == ["ddp-a"]
    assert [r.name for r in t.filter(text="first try")] == ["ddp-a"]
    assert t["ddp-a"].notes == ("first try with ddp",)
    for bad in ("", "a,b", "x" * 65, "two\nlines"):
        with pytest.raises(JupyterDistError, match="is not valid: give 1-64 characters"):
            run.tag(bad)
    with pytest.raises(JupyterDistError, match="a note is a non-empty string"):
        run.note("  ")


def test_the_table_displays_as_html_and_text_with_escaping(folder: Path) -> None:
    open_run(folder / "fsdp-b").tag("<b>x</b>")
    t = runs(folder)
    bundle = t._repr_mimebundle_()
    assert "fsdp-b" in bundle["text/plain"] and "tokens/s" in bundle["text/plain"]
    html = bundle["text/html"]
    assert html.count("<tr data-run=") == 4 and "&lt;b&gt;x&lt;/b&gt;" in html and "<b>x</b>" not in html
    assert "1 unreadable skipped" in html and "2.79 GiB / 5.59 GiB" in html


def test_open_gives_the_panels_of_a_run(folder: Path) -> None:
    pytest.importorskip("anywidget")
    dash = runs(folder).open("fsdp", widget=False)  # a unique prefix
    assert dash.run.name == "fsdp-b"
    loss = next(f for f in dash.figures() if f["id"] == "loss")
    assert any(len(tr["x"]) == 20 for tr in loss["traces"])


def test_a_missing_folder_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(JupyterDistError, match="runs folder .* does not exist"):
        runs(tmp_path / "nope")


# ---- %dist_runs -------------------------------------------------------------------------------------------------
def test_dist_runs_magic_in_a_real_shell(ip: Any, folder: Path) -> None:
    from IPython.core.error import UsageError

    t = ip.run_line_magic("dist_runs", f'"{folder}" --table --sort best_loss --filter fsdp2')
    assert isinstance(t, RunTable) and [r.name for r in t] == ["fsdp-b", "live-d"]
    t = ip.run_line_magic("dist_runs", f"{folder} --table --status failed")
    assert [r.name for r in t] == ["bad-c"]
    ip.config.DistMagics.runs_dir = str(folder)
    ip.magics_manager.registry["DistMagics"].runs_dir = str(folder)
    assert len(ip.run_line_magic("dist_runs", "--table")) == 4
    with pytest.raises(UsageError, match="cannot sort by 'nope'"):
        ip.run_line_magic("dist_runs", "--table --sort nope")
    with pytest.raises(UsageError, match="does not exist"):
        ip.run_line_magic("dist_runs", f"{folder}/missing --table")


def test_the_widget_filters_sorts_and_opens(folder: Path) -> None:
    pytest.importorskip("ipywidgets")
    box = runs(folder).widget()
    text, sort, desc = box.children[0].children
    grid = box.children[1]
    assert grid.value.count("<tr data-run=") == 4
    text.value = "fsdp2"
    assert grid.value.count("<tr data-run=") == 2 and box.shown.rows[0].name == "live-d"
    desc.value = False
    sort.value = "best_loss"
    assert [r.name for r in box.shown] == ["fsdp-b", "live-d"]
    pick = box.children[2].children[0]
    assert list(pick.options) == ["fsdp-b", "live-d"]


def test_a_comparison_follows_a_run_that_is_still_writing(folder: Path) -> None:
    from jupyter_dist.ui.compare import compare

    live = open_run(folder / "live-d")  # "running" in its run.json: the comparison keeps following it
    cmp = compare(live, folder / "ddp-a", interval=0.05)
    assert cmp.live and [len(t["x"]) for t in cmp.figures()[0]["traces"]] == [2, 20]
    cmp.start()
    try:
        line = encode(make_record("step", rank=0, seq=500, t=1.79e9 + 400, step=2, loss=0.1, step_time=0.5))
        with open(folder / "live-d" / "telemetry" / "rank-0.jsonl", "a") as fh:
            fh.write(line + "\n")
        import time

        deadline = time.monotonic() + 10
        while len(cmp.figures()[0]["traces"][0]["x"]) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cmp.figures()[0]["traces"][0]["x"] == [0.0, 1.0, 2.0]
    finally:
        cmp.stop()


def test_a_live_run_is_read_incrementally(folder: Path) -> None:
    from jupyter_dist.launch import runs as runs_mod

    first = runs(folder)["live-d"]
    assert first.steps == 2
    live = runs_mod._LIVE[str((folder / "live-d").resolve())]
    read = live.follower._offsets.copy()
    with open(folder / "live-d" / "telemetry" / "rank-1.jsonl", "a") as fh:
        fh.write(encode(make_record("step", rank=1, seq=900, t=1.79e9 + 310, step=5, loss=0.25)) + "\n")
    again = runs(folder)["live-d"]
    assert again.steps == 6 and live.builder.n == first_records(folder) + 1  # only the new line was parsed
    assert live.follower._offsets != read
    meta = json.loads((folder / "live-d" / "run.json").read_text())
    (folder / "live-d" / "run.json").write_text(json.dumps({**meta, "status": "succeeded", "ended": 1.79e9 + 320}))
    assert runs(folder)["live-d"].status == "succeeded"
    assert str((folder / "live-d").resolve()) not in runs_mod._LIVE  # ended: no longer followed


def first_records(folder: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in (folder / "live-d" / "telemetry").glob("*.jsonl")) - 1
