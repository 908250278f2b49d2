"""The notebook side of the live dashboard under a heavy telemetry stream: kernel CPU, bytes to the browser, memory.

Run: python benchmarks/dashboard.py [--ranks 8] [--steps 50000] [--rate 2000] [--max-points 2000]

A fake run directory (``run.json`` + ``telemetry/rank-<k>.jsonl``) is written incrementally, one chunk per second
of stream: ``--ranks`` ranks each doing ``--rate`` steps/s (default 2,000: a 0.5 ms step, far faster than real
training), ``--steps`` steps per rank. Every rank writes, like a real worker, one ``start`` record and then
``step`` records (loss, tokens, step_time, tokens_per_s) and every ``--hb-s`` seconds an ``hb``, a ``mem`` (CUDA
fields) and a ``gpu`` record; each chunk ends inside a line whose rest comes with the next chunk (a torn tail, as
the follower sees mid-write). Two cases:

uncoalesced  ``JD_TELEMETRY_INTERVAL_S=0``: one step record per step per rank (the worst case);
coalesced    the default ``interval_s=1``: one step record per rank per second (``n`` = steps merged).

After each chunk the fake clock advances 1 s and ``Dashboard.update()`` runs (reader poll + parse + panel model +
what goes to the browser). The widget is real (anywidget, no front-end): its ``_send`` -- which carries both the
binary ``extend`` messages and the trait-state updates -- is replaced by a recorder that serialises each message
as the kernel's session would (JSON + binary buffers), so its CPU is counted and the wire bytes are measured
next to what ``UpdateStats.bytes_sent`` reports. The recorder also keeps each line trace's point count as the
browser would have it (whole figures replace, extends append) to check the browser-side cap.

Measured, per case: kernel CPU (``time.process_time`` around ``update()`` only, file writing excluded) per second
of stream; wall time of one update (median / p95 / max); bytes to the browser per update (median / p95 / max);
points sent; points per trace at the end (kernel and browser side, must be <= ``--max-points``); peak memory:
``ru_maxrss`` growth over the timed pass, and a second, untimed pass under ``tracemalloc`` for the Dashboard's
retained memory at the end and its peak during one update.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import resource
import statistics
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jupyter_dist.telemetry.records import encode, make_record
from jupyter_dist.ui.dashboard import Dashboard

T0 = 1_700_000_000.0
MIB = float(1 << 20)
GIB = 1 << 30


class Stream:
    """Writes what ``ranks`` workers append to their telemetry files during one second of training."""

    def __init__(self, run_dir: Path, *, ranks: int, steps: int, rate: int, hb_s: float, coalesced: bool,
                 tokens: int = 4096) -> None:  # fmt: skip
        self.ranks, self.steps, self.rate, self.coalesced, self.tokens = ranks, steps, rate, coalesced, tokens
        self.hb_every = max(1, round(hb_s * rate))
        self.seconds = math.ceil(steps / rate)
        self.seq = [0] * ranks
        self.held = [b""] * ranks  # the torn tail of each file, written with the next chunk
        self.rng = random.Random(0)
        tel = run_dir / "telemetry"
        tel.mkdir(parents=True)
        self.paths = [tel / f"rank-{r}.jsonl" for r in range(ranks)]
        meta = {"name": run_dir.name, "status": "running", "strategy": "ddp", "world_size": ranks, "nproc": ranks,
                "nodes": 1, "env": {"JD_HEARTBEAT_S": "2"}, "created": T0, "started": T0}  # fmt: skip
        (run_dir / "run.json").write_text(json.dumps(meta))
        self.records = 0
        self.bytes = 0

    def _rec(self, kind: str, rank: int, t: float, **fields: Any) -> str:
        rec = make_record(kind, rank=rank, seq=self.seq[rank], t=t, **fields)
        self.seq[rank] += 1
        self.records += 1
        return encode(rec)

    def _loss(self, rank: int, step: int) -> float:
        spike = 3.0 if step % 9973 == 0 and step else 0.0
        return 2.0 * math.exp(-step / 20_000) + 0.5 + 0.02 * rank + 0.05 * self.rng.random() + spike

    def write_second(self, sec: int) -> None:
        """Append second ``sec`` of the stream (the ``start`` records with second 0) to every rank's file."""
        lo, hi = sec * self.rate, min(self.steps, (sec + 1) * self.rate)
        last = hi >= self.steps
        for r in range(self.ranks):
            jitter = 0.0007 * r  # ranks do not write in lockstep
            lines = []
            if sec == 0:
                lines.append(self._rec("start", r, T0 + jitter, world_size=self.ranks, local_rank=r, pid=1000 + r,
                                       host="node0", strategy="ddp", precision="bf16-mixed", device=f"cuda:{r}",
                                       backend="nccl", torch="2.5.0"))  # fmt: skip
            step_time = 1.0 / self.rate
            for s in range(lo, hi):
                t = T0 + (s + 1) * step_time + jitter
                if not self.coalesced:
                    lines.append(self._rec("step", r, t, step=s, n=1, loss=self._loss(r, s), tokens=float(self.tokens),
                                           step_time=step_time * (0.9 + 0.2 * self.rng.random()),
                                           tokens_per_s=self.tokens / step_time))  # fmt: skip
                elif s == hi - 1:
                    lines.append(self._rec("step", r, t, step=s, n=hi - lo, loss=self._loss(r, s),
                                           tokens=float(self.tokens), step_time=step_time,
                                           tokens_per_s=self.tokens / step_time))  # fmt: skip
                if (s + 1) % self.hb_every == 0:
                    lines.append(self._rec("hb", r, t, step=s, phase="backward", phase_s=0.0002))
                    alloc = (30 << 30) + (s % 1000 << 20)
                    lines.append(self._rec("mem", r, t, device=f"cuda:{r}", rss=6 * GIB, max_rss=6 * GIB,
                                           allocated=alloc, reserved=34 * GIB, peak_allocated=36 * GIB,
                                           peak_active=37 * GIB, alloc_retries=0, ooms=0,
                                           device_total=80 * GIB))  # fmt: skip
                    util = 90.0 + self.rng.random() * 10
                    lines.append(self._rec("gpu", r, t, index=r, util=util, mem_util=40.0, mem_used=35 * GIB,
                                           mem_total=80 * GIB, power_w=650.0, temp_c=70.0))  # fmt: skip
            data = self.held[r] + ("\n".join(lines) + "\n").encode()
            cut = len(data) if last else len(data) - 40  # the last line is still being written
            self.held[r] = data[cut:]
            with open(self.paths[r], "ab") as f:
                f.write(data[:cut])
            self.bytes += cut


@dataclass
class Recorder:
    """Stands in for the widget's comm: sizes every message as the kernel's session would serialise it."""

    max_points: int
    messages: int = 0
    bytes: int = 0
    state_bytes: int = 0
    extend_bytes: int = 0
    browser: dict[str, list[int]] = field(default_factory=dict)  # points per trace as the browser has them
    browser_max: int = 0

    def __call__(self, msg: dict[str, Any], buffers: list[bytes] | None = None) -> None:
        size = len(json.dumps(msg, ensure_ascii=False, allow_nan=False).encode()) + sum(len(b) for b in buffers or [])
        self.messages += 1
        self.bytes += size
        if msg.get("method") == "custom" and msg["content"].get("type") == "extend":
            self.extend_bytes += size
            counts = self.browser.setdefault(msg["content"]["fig"], [])
            for j, i in enumerate(msg["content"]["traces"]):
                while len(counts) <= i:
                    counts.append(0)
                counts[i] += len(buffers[2 * j]) // 8  # type: ignore[index]
        else:
            self.state_bytes += size
            for fig in msg.get("state", {}).get("line_figs", []):
                self.browser[fig["id"]] = [len(t["x"]) for t in fig["traces"]]
        self.browser_max = max([self.browser_max] + [c for v in self.browser.values() for c in v])


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def rss_mib() -> float:
    """Resident memory of this process now (Linux), else the peak so far."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / MIB if sys.platform == "darwin" else peak / 1024


def run_case(args: argparse.Namespace, coalesced: bool, *, trace_memory: bool) -> dict[str, Any]:
    """Stream the run through a Dashboard (under tracemalloc: only the first ``--memory-seconds``); the figures."""
    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(d) / "run-bench"
        stream = Stream(run_dir, ranks=args.ranks, steps=args.steps, rate=args.rate, hb_s=args.hb_s,
                        coalesced=coalesced)  # fmt: skip
        now = [T0]
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rss_before = rss_mib()
        if trace_memory:
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
        dash = Dashboard(run_dir, interval=1.0, max_points=args.max_points, clock=lambda: now[0], widget=True)
        rec = Recorder(args.max_points)
        dash.widget._send = rec  # every comm message: extend messages and trait-state updates
        if trace_memory:
            built = tracemalloc.get_traced_memory()[0] - base
        cpu: list[float] = []
        wall: list[float] = []
        sent: list[int] = []
        wire: list[int] = []
        peak = 0
        rss: list[float] = []
        seconds = min(stream.seconds, args.memory_seconds) if trace_memory else stream.seconds
        for sec in range(seconds):
            stream.write_second(sec)
            now[0] = T0 + sec + 1
            wire0 = rec.bytes
            if trace_memory:
                tracemalloc.reset_peak()
                cur0 = tracemalloc.get_traced_memory()[0]
            c0, w0 = time.process_time(), time.perf_counter()
            stats = dash.update()
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
            if trace_memory:
                peak = max(peak, tracemalloc.get_traced_memory()[1] - cur0)
            sent.append(stats.bytes_sent)
            wire.append(rec.bytes - wire0)
            rss.append(rss_mib() - rss_before)
        out: dict[str, Any] = {"seconds": stream.seconds, "records": stream.records, "file_bytes": stream.bytes,
                               "cpu": cpu, "wall": wall, "sent": sent, "wire": wire, "stats": dash.stats,
                               "rec": rec}  # fmt: skip
        series = [s for fig in dash.model.lines.values() for s in fig.series]
        out["kernel_max"] = max((len(s.xs) for s in series), default=0)
        out["traces"] = len(series)
        out["total_points"] = sum(s.total for s in series)
        out["model_records"] = dash.model.records
        out["max_step"] = dash.model.max_step
        out["maxrss_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
        if sys.platform == "darwin":
            out["maxrss_mib"] /= 1024
        out["rss"] = rss
        if trace_memory:
            out["traced_seconds"] = seconds
            out["retained_mib"] = (tracemalloc.get_traced_memory()[0] - base) / MIB
            out["built_mib"] = built / MIB
            out["update_peak_mib"] = peak / MIB
            before = tracemalloc.get_traced_memory()[0]
            held = sum(len(b) for b in dash.reader.buffers.values())
            for buf in dash.reader.buffers.values():  # what the reader keeps that the panels never read again
                buf.clear()
            gc.collect()
            out["ring_mib"] = (before - tracemalloc.get_traced_memory()[0]) / MIB
            out["ring_records"] = held
            tracemalloc.stop()
        dash.widget.close()
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=50_000, help="steps per rank")
    ap.add_argument("--rate", type=int, default=2_000, help="steps per second per rank (one update per second)")
    ap.add_argument("--hb-s", type=float, default=0.5, help="seconds between a rank's hb + mem + gpu records")
    ap.add_argument("--max-points", type=int, default=2_000)
    ap.add_argument("--cases", default="uncoalesced,coalesced")
    ap.add_argument("--memory-seconds", type=int, default=6, help="seconds of stream in the tracemalloc pass")
    ap.add_argument("--no-memory", action="store_true", help="skip the tracemalloc pass")
    args = ap.parse_args()

    results: dict[str, dict[str, Any]] = {}
    for case in args.cases.split(","):
        coalesced = case == "coalesced"
        res = run_case(args, coalesced, trace_memory=False)
        if not args.no_memory:
            mem = run_case(args, coalesced, trace_memory=True)
            res.update(
                {
                    k: mem[k]
                    for k in (
                        "retained_mib",
                        "built_mib",
                        "update_peak_mib",
                        "ring_mib",
                        "ring_records",
                        "traced_seconds",
                    )
                }
            )
        results[case] = res

    print(f"stream: {args.ranks} ranks x {args.steps:,} steps at {args.rate:,} steps/s per rank "
          f"({args.ranks * args.rate:,} steps/s in all), hb+mem+gpu every {args.hb_s:g} s per rank, one update per "
          f"second of stream, max_points {args.max_points:,}")  # fmt: skip
    rows: list[tuple[str, str]] = []
    for case, r in results.items():
        secs, cpu, wall, sent, wire, st, rec = (r[k] for k in ("seconds", "cpu", "wall", "sent", "wire", "stats",
                                                                 "rec"))  # fmt: skip
        ok = r["kernel_max"] <= args.max_points and rec.browser_max <= args.max_points
        print(f"\n[{case}] {secs} updates, {r['records']:,} records ({r['file_bytes'] / MIB:.1f} MiB of JSONL) "
              f"-> model took {r['model_records']:,}, last step {r['max_step']:,}")  # fmt: skip
        print(f"  kernel CPU per second of stream: {sum(cpu) / secs * 1e3:.1f} ms (mean; median update "
              f"{statistics.median(cpu) * 1e3:.1f} ms, max {max(cpu) * 1e3:.1f} ms) = "
              f"{sum(cpu) / secs * 100:.1f}% of one core")  # fmt: skip
        k5 = min(5, len(cpu))
        print(f"  CPU per update over the run: first {k5} updates {statistics.fmean(cpu[:k5]) * 1e3:.1f} ms, last {k5} "
              f"{statistics.fmean(cpu[-k5:]) * 1e3:.1f} ms (flat: no growth with the run's length)"
              if statistics.fmean(cpu[-k5:]) < 1.5 * statistics.fmean(cpu[:k5]) else
              f"  CPU per update GROWS over the run: first {k5} {statistics.fmean(cpu[:k5]) * 1e3:.1f} ms, "
              f"last {k5} {statistics.fmean(cpu[-k5:]) * 1e3:.1f} ms")  # fmt: skip
        print(f"  one update, wall: median {statistics.median(wall) * 1e3:.1f} ms, p95 {pct(wall, 0.95) * 1e3:.1f} "
              f"ms, max {max(wall) * 1e3:.1f} ms")  # fmt: skip
        print(f"  to the browser per update (UpdateStats.bytes_sent): median {statistics.median(sent) / 1024:.1f} "
              f"KiB, p95 {pct(sent, 0.95) / 1024:.1f} KiB, max {max(sent) / 1024:.1f} KiB; "
              f"total {sum(sent) / MIB:.2f} MiB")  # fmt: skip
        print(f"  on the wire (recorded comm messages, JSON + buffers): median {statistics.median(wire) / 1024:.1f} "
              f"KiB, p95 {pct(wire, 0.95) / 1024:.1f} KiB, max {max(wire) / 1024:.1f} KiB; {rec.messages} messages, "
              f"{rec.extend_bytes / MIB:.2f} MiB extends + {rec.state_bytes / MIB:.2f} MiB state")  # fmt: skip
        print(f"  points sent {st.points:,} ({st.extends} extend messages, {st.whole_figures} whole-figure re-sends) "
              f"for {r['total_points']:,} points appended to {r['traces']} traces")  # fmt: skip
        print(f"  points per trace at the end: kernel max {r['kernel_max']:,}, browser max over the run "
              f"{rec.browser_max:,} (cap {args.max_points:,}: {'OK' if ok else 'OVER'})")  # fmt: skip
        rss = r["rss"]
        k = min(len(rss), args.memory_seconds) - 1
        print(f"  memory (timed pass): RSS growth since before the Dashboard: after update 1 {rss[0]:+.0f} MiB, "
              f"after update {k + 1} {rss[k]:+.0f} MiB, after the last {rss[-1]:+.0f} MiB; ru_maxrss growth "
              f"{r['maxrss_mib']:.0f} MiB")  # fmt: skip
        if "retained_mib" in r:
            print(f"  memory (tracemalloc, first {r['traced_seconds']} s of stream): Dashboard built "
                  f"{r['built_mib']:.1f} MiB (plotly.js library widget already cached), retained "
                  f"{r['retained_mib']:.1f} MiB, of which the reader's ring buffers {r['ring_mib']:.1f} MiB "
                  f"({r['ring_records']:,} records the panels never read again); peak allocated inside one update "
                  f"{r['update_peak_mib']:.1f} MiB")  # fmt: skip
        rows.append((case, f"{sum(cpu) / secs * 1e3:.0f} ms CPU/s, update {statistics.median(wall) * 1e3:.0f} ms "
                           f"(p95 {pct(wall, 0.95) * 1e3:.0f}), {statistics.median(wire) / 1024:.0f} KiB/update "
                           f"(p95 {pct(wire, 0.95) / 1024:.0f}, max {max(wire) / 1024:.0f}), max "
                           f"{max(r['kernel_max'], rec.browser_max):,} pts/trace"
                           + (f", {r['retained_mib']:.0f} MiB retained / {r['update_peak_mib']:.0f} MiB peak"
                              if "retained_mib" in r else "")))  # fmt: skip

    print("\n--- summary (paste into README) ---")
    print(f"Dashboard, {args.ranks} ranks x {args.steps:,} steps at {args.rate:,} steps/s/rank, 1 update/s, "
          f"max_points {args.max_points:,}:")  # fmt: skip
    for case, line in rows:
        print(f"  {case:12} {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
