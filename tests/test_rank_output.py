"""The ranks' output while a run goes (``--output``): followed from the log files, prefixed, rate-limited.

The follower on files written here (order, prefix, sentinel lines, partial lines, the rate limit's exact counts, a
SkyPilot log stream routed by the real LogRouter), the notebook's display sink, then real 2-process torchrun runs:
``%%dist_train`` in a real IPython shell (rank 0 by default, ``none``, ``all``), a rank printing 100k lines while
the sink is stuck, and ``jupyter-dist launch`` in a subprocess printing rank 0's lines while the run goes.
"""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from jupyter_dist.errors import JupyterDistError
from jupyter_dist.launch.output import DisplaySink, OutputSelection, RankOutput, parse_output
from jupyter_dist.telemetry.records import SENTINEL

DROPPED = re.compile(r"^\[rank(\d+)\] \.\.\. ([\d,]+) lines dropped \(over ([\d.]+) lines/s\); every line is in (\S+)$")


class ListSink:
    """What a follower wrote, batch by batch."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.closed = False

    @property
    def lines(self) -> list[str]:
        return [ln for b in self.batches for ln in b]

    def write(self, lines: list[str]) -> None:
        self.batches.append(list(lines))

    def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def dropped_total(lines: list[str], rank: int = 0) -> int:
    return sum(int(m.group(2).replace(",", "")) for ln in lines if (m := DROPPED.match(ln)) and int(m.group(1)) == rank)


def shown(lines: list[str], rank: int) -> list[str]:
    """The lines of ``rank`` without their prefix, notes left out."""
    prefix = f"[rank{rank}] "
    return [ln[len(prefix) :] for ln in lines if ln.startswith(prefix) and not DROPPED.match(ln)]


# ---- the flag ------------------------------------------------------------------------------------------------
def test_output_values_parse_and_bad_ones_say_what_is_valid() -> None:
    assert parse_output("0") == OutputSelection((0,))
    assert parse_output(" 0,2 ") == OutputSelection((0, 2)) and str(parse_output("2,0,2")) == "2,0"
    assert parse_output("all").resolve(3) == [0, 1, 2] and str(parse_output("ALL")) == "all"
    assert parse_output("none").resolve(3) == [] and parse_output(None).resolve(2) == []
    assert parse_output([1]).resolve(2) == [1]
    for bad in ("", "x", "0,", "-1", "0;1", "1.5", "rank0"):
        with pytest.raises(JupyterDistError, match=r"^--output .*: want all, none or rank numbers such as 0 or 0,2$"):
            parse_output(bad)
    with pytest.raises(JupyterDistError, match="want all, none"):
        parse_output([0, -1])
    with pytest.raises(JupyterDistError, match=r"^--output 0,3: the run has ranks 0..1, not 3$"):
        parse_output("0,3").resolve(2)


def test_the_cli_and_the_magic_refuse_a_bad_output_in_one_line(ip: Any, runs: Path, tmp_path: Path) -> None:
    from IPython.core.error import UsageError

    script = tmp_path / "t.py"
    script.write_text("print(1)\n")
    cli = [sys.executable, "-m", "jupyter_dist.cli", "launch", "--runs-dir", str(tmp_path / "r")]
    res = subprocess.run([*cli, "--output", "zero", str(script)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [
        "jupyter-dist launch: error: argument --output: want all, none or rank numbers such as 0 or 0,2, got 'zero' "
        "(see --help)"
    ]
    res = subprocess.run([*cli, "--nproc", "2", "--output", "0,5", str(script)], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert res.returncode == 2 and res.stderr.strip() == "jupyter-dist launch: error: --output 0,5: the run has " \
        "ranks 0..1, not 5"  # fmt: skip
    assert not (tmp_path / "r").exists()  # refused before anything was written
    with pytest.raises(UsageError, match=r"argument --output: want all, none or rank numbers such as 0 or 0,2, got "):
        ip.run_cell_magic("dist_train", "--nproc 2 --output rank0", "print(1)")
    with pytest.raises(UsageError, match=r"^--output 2: the run has ranks 0..1, not 2$"):
        ip.run_cell_magic("dist_train", "--nproc 2 --output 2", "print(1)")
    assert not list(runs.glob("run-*"))
    from jupyter_dist.launch.session import start_run

    with pytest.raises(JupyterDistError, match="want all, none"):
        start_run("print(1)", nproc=2, output="every", runs_dir=tmp_path / "s")
    assert not (tmp_path / "s").exists()


# ---- the follower on files written here ----------------------------------------------------------------------
def test_lines_in_order_with_the_prefix_without_sentinel_lines(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    sink, clock = ListSink(), Clock()
    done = threading.Event()
    out = RankOutput(logs, [0, 1], sink=sink, done=done.is_set, clock=clock)
    assert out.poll() == []  # no rank has started: no file yet
    r0, r1 = logs / "rank-0.log", logs / "rank-1.log"
    with open(r0, "ab") as fh:
        fh.write(b"hello\n" + SENTINEL.encode() + b'{"v":1,"kind":"hb"}\n' + b"caf\xc3\xa9 \xff\nprogress 10%\rprog")
    r1.write_text("from one\n")
    assert out.poll() == ["[rank0] hello", "[rank0] caf\u00e9 \ufffd", "[rank1] from one"]
    with open(r0, "ab") as fh:  # the unfinished line is shown once it ends; \r redraws keep their last state
        fh.write(b"ress 50%\rprogress 100%\r\nx" * 1 + b"\n" + b"y" * 5000 + b"\nlast without newline")
    got = out.poll()
    assert got[:2] == ["[rank0] progress 100%", "[rank0] x"]
    assert got[2].startswith("[rank0] " + "y" * 4000 + " ... (1,000 more characters in the log)")
    assert out.poll(final=True) == ["[rank0] last without newline"]
    assert out.shown == {0: 6, 1: 1} and out.dropped == {0: 0, 1: 0}
    r0.write_text("rewritten\n")  # a log stream replayed from its start (reattach) is read again from its start
    assert out.poll() == ["[rank0] rewritten"]


def test_a_flood_is_rate_limited_and_every_dropped_line_is_counted(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    sink, clock = ListSink(), Clock()
    out = RankOutput(logs, [0], sink=sink, done=lambda: False, rate=10, burst=20, clock=clock)
    path = logs / "rank-0.log"
    with open(path, "w") as fh:
        fh.writelines(f"line {i}\n" for i in range(10_000))
        fh.write(SENTINEL + "{}\n")  # never shown, never counted as dropped
    first = out.poll()
    assert first == [f"[rank0] line {i}" for i in range(20)]  # the burst; the rest is counted, said later
    clock.t += 1.0  # 10 tokens back; the rank prints on
    with open(path, "a") as fh:
        fh.writelines(f"more {i}\n" for i in range(30))
    second = out.poll()
    assert len(second) == 11 and DROPPED.match(second[0])  # the dropped count comes before the next shown line
    assert dropped_total(second) == 9_980 and second[1:] == [f"[rank0] more {i}" for i in range(10)]
    assert DROPPED.match(second[0]).group(4) == str(path)  # type: ignore[union-attr]
    clock.t += 2.5
    with open(path, "a") as fh:
        fh.writelines(f"flood {i}\n" for i in range(100))
    third = out.poll()
    assert dropped_total(third) == 20 and shown(third, 0) == [f"flood {i}" for i in range(20)]
    clock.t += 2.5  # the rank went quiet after a flood: its count is said within 2 s, not only when the run ends
    fourth = out.poll()
    assert len(fourth) == 1 and dropped_total(fourth) == 80
    assert out.poll(final=True) == []
    lines = first + second + third + fourth
    assert out.shown[0] == len(shown(lines, 0)) == 50
    assert out.dropped[0] == dropped_total(lines) == 10_000 + 30 + 100 - 50
    assert not any(SENTINEL in ln for ln in lines)


def test_a_broken_sink_stops_the_follower_and_nothing_else(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A closed terminal (`jupyter-dist launch ... | head`) or a failing display ends the showing, quietly for a gone
    reader; the follower's thread ends (``finished``) while the run would go on writing its logs."""
    (tmp_path / "rank-0.log").write_text("one\n")

    class Broken(ListSink):
        def __init__(self, exc: BaseException) -> None:
            super().__init__()
            self.exc = exc

        def write(self, lines: list[str]) -> None:
            raise self.exc

    for exc, logged in ((BrokenPipeError(32, "Broken pipe"), False), (RuntimeError("display gone"), True)):
        caplog.clear()
        sink = Broken(exc)
        out = RankOutput(tmp_path, [0], sink=sink, done=lambda: False, interval=0.01).start()
        assert out.wait(10) and sink.closed
        assert ("display gone" in caplog.text) is logged


def test_a_skypilot_log_stream_routed_into_the_run_directory_is_shown_the_same(tmp_path: Path) -> None:
    """On SkyPilot the LogRouter writes logs/rank-K.log from the job's stream: the same files, the same follower."""
    from jupyter_dist.launch.backends.stream import LogRouter
    from jupyter_dist.launch.rundir import RunDir

    router = LogRouter(RunDir(tmp_path / "run"))
    sink = ListSink()
    out = RankOutput(router.rd.logs, [0], sink=sink, done=lambda: False)
    rec = '{"v":1,"kind":"hb","rank":0,"seq":1,"t":1.0}'
    router(["(head, rank=0, pid=11) [rank 0] epoch 1\n", f"(head, rank=0, pid=11) {SENTINEL}{rec}\n",
            "(worker1, rank=1, pid=12) [rank 1] other rank\n",
            "\x1b[32m(head, rank=0, pid=11) [rank 0] epoch 2\x1b[0m\n", "I 05-01 sky: job started\n"])  # fmt: skip
    assert out.poll() == ["[rank0] epoch 1", "[rank0] epoch 2"]
    router.close()


def test_the_notebook_sink_updates_one_display_under_the_cell() -> None:
    shown_ = []

    class Handle:
        def update(self, obj: Any) -> None:
            shown_.append(obj._repr_mimebundle_()["text/plain"])

    def display(obj: Any, display_id: bool = False) -> Handle:
        assert display_id is True  # updated by its id: later updates cannot land under another cell
        shown_.append(obj._repr_mimebundle_()["text/plain"])
        return Handle()

    sink = DisplaySink("rank 0", keep=3, display=display)
    assert shown_ == ["(rank 0 has printed nothing yet)"]
    sink.write(["[rank0] a", "[rank0] b"])
    sink.write(["[rank0] c", "[rank0] d"])
    assert shown_[-2:] == ["[rank0] a\n[rank0] b",
                           "... 1 earlier lines are not shown here (the logs keep every line)\n[rank0] b\n[rank0] c\n"
                           "[rank0] d"]  # fmt: skip
    empty = DisplaySink("ranks 0, 1", display=display)
    empty.close()
    assert shown_[-1] == "(ranks 0, 1 printed nothing)"


def test_in_a_kernel_the_output_goes_to_a_display_else_to_stdout(ip: Any) -> None:
    """The sink is chosen where the run starts: a display in a kernel (IPython's real display machinery), stdout in
    a shell without one (a terminal)."""
    from IPython.utils.capture import capture_output

    from jupyter_dist.launch.output import StreamSink, default_sink

    assert isinstance(default_sink([0]), StreamSink)
    ip.kernel = object()  # what default_sink looks for (an ipykernel shell has one)
    try:
        with capture_output() as cap:
            sink = default_sink([0])
            assert isinstance(sink, DisplaySink)
            sink.write(["[rank0] hi"])
    finally:
        del ip.kernel
    texts = [(o.data["text/plain"], o.update, o.transient["display_id"]) for o in cap.outputs]
    assert [t[:2] for t in texts] == [("(rank 0 has printed nothing yet)", False), ("[rank0] hi", True)]
    assert texts[0][2] == texts[1][2]


# ---- real runs -----------------------------------------------------------------------------------------------
CELL = """import sys, time
if jd.rank == 0:
    for i in range(25):
        print(f"step {i} of rank 0")
    print("a warning on stderr", file=sys.stderr)
    print("@@JD@@" + '{"v": 1, "kind": "hb", "rank": 0, "seq": 999999, "t": 0}')
    print("done")
else:
    print("rank 1 says hi")
"""
RANK0 = [*(f"step {i} of rank 0" for i in range(25)), "a warning on stderr", "done"]


def _rank_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("[rank")]


@pytest.mark.slow
def test_dist_train_shows_rank_0s_lines_in_order_with_the_prefix(
    ip: Any, runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = ip.run_cell_magic("dist_train", "--nproc 2 --strategy none --name out0 --wait --timeout 120", CELL)
    assert run.status == "succeeded", run.summary()
    assert run.shown_output.finished.is_set()
    out = capsys.readouterr().out
    assert _rank_lines(out) == [f"[rank0] {ln}" for ln in RANK0]  # rank 1 not shown, the record line not shown
    assert SENTINEL not in out
    assert "rank 1 says hi" in run.logs(1) and SENTINEL in run.logs(0)  # the logs keep everything, as before


@pytest.mark.slow
def test_output_none_shows_nothing_and_all_shows_every_rank(
    ip: Any, runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = ip.run_cell_magic("dist_train", "--nproc 2 --strategy none --output none --wait --timeout 120", CELL)
    assert run.status == "succeeded" and run.shown_output is None
    assert _rank_lines(capsys.readouterr().out) == []
    run = ip.run_cell_magic("dist_train", "--nproc 2 --strategy none --output all --wait --timeout 120", CELL)
    assert run.status == "succeeded" and run.shown_output.ranks == [0, 1]
    lines = _rank_lines(capsys.readouterr().out)
    assert shown(lines, 0) == RANK0 and shown(lines, 1) == ["rank 1 says hi"]
    assert len(lines) == len(RANK0) + 1


FLOOD = """import time
if jd.rank == 0:
    t0 = time.perf_counter()
    for i in range(100_000):
        print(f"flood line {i}")
    took = time.perf_counter() - t0
    print(f"printed 100000 lines in {took:.3f} s")
"""


class StuckSink(ListSink):
    """A notebook that does not take lines: the first write blocks until released."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def write(self, lines: list[str]) -> None:
        self.entered.set()
        self.release.wait()
        super().write(lines)


@pytest.mark.slow
def test_a_rank_printing_100k_lines_is_never_blocked_and_the_output_is_rate_limited(tmp_path: Path) -> None:
    from jupyter_dist.launch.session import start_run

    run = start_run(FLOOD, nproc=2, strategy="none", name="flood", runs_dir=tmp_path, timeout=180, output="none")
    t0 = time.monotonic()
    listed = run.show_output("0", sink=ListSink())
    stuck = RankOutput(run.dir / "logs", [0], sink=StuckSink(), done=lambda: run.done).start()
    assert run.wait(180) == "succeeded", run.summary()
    elapsed = time.monotonic() - t0
    # the stuck sink never took a line, and the rank finished all the same: nothing on this side can block a rank
    assert stuck.sink.entered.is_set() and not stuck.sink.batches
    took = float(re.search(r"printed 100000 lines in ([\d.]+) s", run.logs(0)).group(1))  # type: ignore[union-attr]
    assert took < 15.0, f"the rank took {took} s to print 100k lines"
    assert listed.wait(30)
    lines = listed.sink.lines
    total = 100_001  # the flood and the rank's closing line
    assert listed.shown[0] + listed.dropped[0] == total and dropped_total(lines) == listed.dropped[0] > 90_000
    assert listed.shown[0] == len(shown(lines, 0)) <= listed.burst + listed.rate * elapsed + 1
    nums = [int(ln.split()[-1]) for ln in shown(lines, 0) if ln.startswith("flood line ")]
    assert nums[:10] == list(range(10)) and nums == sorted(nums)  # in order: what is shown is a prefix, then samples
    note = next(ln for ln in lines if DROPPED.match(ln))
    assert note.endswith(f"every line is in {run.dir / 'logs' / 'rank-0.log'}")
    stuck.sink.release.set()
    assert stuck.wait(30) and stuck.shown[0] + stuck.dropped[0] == total  # released, it catches up and counts


PLAIN = """import os, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} ready", flush=True)
if rank == 0:
    go = sys.argv[1]
    while not os.path.exists(go):
        time.sleep(0.05)
    for i in range(3):
        print(f"after go {i}")
"""


@pytest.mark.slow
def test_jupyter_dist_launch_prints_rank_0s_lines_while_the_run_goes(tmp_path: Path) -> None:
    script, go = tmp_path / "plain.py", tmp_path / "go"
    script.write_text(PLAIN)
    cmd = [sys.executable, "-m", "jupyter_dist.cli", "launch", "--nproc", "2", "--runs-dir", str(tmp_path / "runs"),
           "--timeout", "120", str(script), str(go)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while "[rank0] rank 0 ready" not in seen:  # rank 0 waits for `go`: this line came while the run goes
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, f"the command ended early: {seen} {proc.stderr.read() if proc.stderr else ''}"
            seen.append(line)
        go.touch()
        while (line := lines.get(timeout=120)) is not None:
            seen.append(line)
        assert proc.wait(60) == 0, seen
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _rank_lines("\n".join(seen)) == ["[rank0] rank 0 ready", *(f"[rank0] after go {i}" for i in range(3))]
    summary = next(i for i, ln in enumerate(seen) if "succeeded" in ln)
    assert summary > seen.index("[rank0] after go 2")  # the last lines before the summary
