"""The per-rank summary of a profiled window: compute, communication and idle time per step, top operators, waits.

Input: the ``torch.profiler`` Chrome traces the ranks wrote (``<run dir>/profile/rank-<k>.pt.trace.json``, see
:mod:`jupyter_dist.worker._profile`). Stdlib only. Per rank and per step (a ``ProfilerStep#<n>`` span):

compute
    time covered by operators on the step's thread (CPU ops), or by non-communication GPU kernels when the trace
    holds kernels;
communication
    time covered by collectives (``gloo:*`` / ``nccl:*`` spans on any thread, NCCL kernels) and not by compute:
    the communication the step waits for;
idle
    the rest of the step: Python between operators, data loading, a ``time.sleep``, waiting on the host.

Waits: the n-th collective of one name is the same collective on every rank (ranks issue collectives in the same
order). Its duration on a rank counts from that rank's arrival until the last rank arrives and the data moved, so
``duration - min over ranks`` is the time the rank waited for a peer, and the rank with the shortest duration is the
one the others waited on. :attr:`ProfileSummary.slowest` names the rank the others waited on the longest.
"""

from __future__ import annotations

import html
import json
import os
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import JupyterDistError

__all__ = ["StepTimes", "RankProfile", "Wait", "ProfileSummary", "load_trace", "summarize_traces", "profile_summary"]

_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_COLLECTIVE = re.compile(r"^(gloo|nccl|ucc|mpi|xccl):")
_COMM_WORDS = re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter|broadcast|all_?to_?all|barrier|"
                         r"send|recv|c10d::|record_param_comms", re.IGNORECASE)  # fmt: skip
_TRACE_GLOB = "rank-*.pt.trace.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTimes:
    """One step of one rank, in seconds."""

    step: int
    """The step number (from ``ProfilerStep#<n>``)."""
    total: float
    """Wall time of the step."""
    compute: float
    """Covered by compute (operators or kernels)."""
    comm: float
    """Covered by communication and not by compute."""
    idle: float
    """Neither."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Wait:
    """A rank waiting in collectives for a peer, summed over the window."""

    rank: int
    """The rank that waited."""
    on: int
    """The rank it waited for (the last to arrive, most often)."""
    collective: str
    """The collective (``gloo:all_reduce``)."""
    seconds: float
    """Time spent waiting."""
    count: int
    """Collectives in which it waited."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankProfile:
    """What one rank did in the window."""

    rank: int
    """The rank."""
    steps: tuple[StepTimes, ...]
    """Per step."""
    top_ops: tuple[tuple[str, float, int], ...]
    """Operators by self time: ``(name, seconds, calls)``, largest first."""
    collectives: tuple[tuple[str, float, int], ...]
    """Collectives: ``(name, seconds, calls)``, largest first."""

    def mean(self, what: str) -> float:
        """Mean of ``total``, ``compute``, ``comm`` or ``idle`` over the steps (0 without steps)."""
        return sum(getattr(s, what) for s in self.steps) / len(self.steps) if self.steps else 0.0


@dataclass(frozen=True, kw_only=True)
class ProfileSummary:
    """The profiled window of every rank, with who waited on whom."""

    ranks: tuple[RankProfile, ...]
    """Per rank, in rank order."""
    waits: tuple[Wait, ...]
    """Waits in collectives, longest first."""
    files: dict[int, str] = field(default_factory=dict)
    """The trace file of each rank."""

    @property
    def slowest(self) -> int | None:
        """The rank the others waited on the longest (``None`` when nobody waited more than 1 ms a step)."""
        per: dict[int, float] = {}
        for w in self.waits:
            per[w.on] = per.get(w.on, 0.0) + w.seconds
        steps = max((len(r.steps) for r in self.ranks), default=0) or 1
        if not per:
            return None
        rank = max(per, key=lambda k: per[k])
        return rank if per[rank] / steps > 1e-3 else None

    def verdict(self) -> str:
        """One or two sentences: who is slow and who waits for it in which collective."""
        slow = self.slowest
        if slow is None:
            return "no rank waited noticeably for another in collectives"
        steps = max((len(r.steps) for r in self.ranks), default=0) or 1
        waits = [w for w in self.waits if w.on == slow]
        parts = [f"rank {w.rank} waits {w.seconds / steps * 1e3:.1f} ms/step in {w.collective}" for w in waits[:3]]
        prof = next((r for r in self.ranks if r.rank == slow), None)
        why = ""
        if prof is not None and prof.steps:
            idle, compute = prof.mean("idle"), prof.mean("compute")
            why = (f"; rank {slow} spends {idle * 1e3:.1f} ms/step idle (outside any operator) and "
                   f"{compute * 1e3:.1f} ms/step computing")  # fmt: skip
        return f"rank {slow} is the slowest: {', '.join(parts)}{why}"

    def text(self) -> str:
        """A plain-text report."""
        lines = [self.verdict(), "", "rank  steps  step ms  compute ms  comm ms  idle ms  top operators"]
        for r in self.ranks:
            top = ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s, _ in r.top_ops[:3])
            ms = [r.mean(k) * 1e3 for k in ("total", "compute", "comm", "idle")]
            lines.append(
                f"{r.rank:<4}  {len(r.steps):<5}  {ms[0]:7.1f}  {ms[1]:10.1f}  {ms[2]:7.1f}  {ms[3]:7.1f}  {top}"
            )
        if self.files:
            lines += ["", "traces (Perfetto: ui.perfetto.dev; TensorBoard: tensorboard --logdir <run dir>):"]
            lines += [f"  rank {k}: {v}" for k, v in sorted(self.files.items())]
        return "\n".join(lines)

    def html(self) -> str:
        """A table per rank (means per step) with the verdict above it."""
        head = "".join(f'<th style="text-align:left;padding:2px 6px">{h}</th>' for h in
                       ("rank", "steps", "step ms", "compute ms", "comm ms", "idle ms", "top operators (self time)",
                        "waits"))  # fmt: skip
        rows = []
        for r in self.ranks:
            top = ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s, _ in r.top_ops[:4])
            waits = "; ".join(f"on rank {w.on} in {w.collective}: {w.seconds * 1e3:.0f} ms" for w in self.waits
                              if w.rank == r.rank)  # fmt: skip
            cells = (
                [str(r.rank), str(len(r.steps))]
                + [f"{r.mean(k) * 1e3:.1f}" for k in ("total", "compute", "comm", "idle")]
                + [top, waits or "-"]
            )
            rows.append("<tr>" + "".join(f'<td style="padding:2px 6px">{html.escape(c)}</td>' for c in cells) + "</tr>")
        return (f'<div class="jd-profile"><b>{html.escape(self.verdict())}</b><table style="border-collapse:'
                f'collapse;font-size:12px"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
                "</div>")  # fmt: skip

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": self.text(), "text/html": self.html()}


def load_trace(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read one Chrome trace (``{"traceEvents": [...]}``); a damaged one is a :class:`JupyterDistError`."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise JupyterDistError(f"cannot read the trace {os.fspath(path)}: {exc.strerror or exc}") from None
    except ValueError:
        raise JupyterDistError(f"{os.fspath(path)} is not a Chrome trace (not JSON)") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise JupyterDistError(f"{os.fspath(path)} is not a Chrome trace (no traceEvents list)")
    return data


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in intervals)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Parts of the union ``a`` not covered by the union ``b``."""
    out = []
    for lo, hi in a:
        cur = lo
        for blo, bhi in b:
            if bhi <= cur or blo >= hi:
                continue
            if blo > cur:
                out.append((cur, blo))
            cur = max(cur, bhi)
        if cur < hi:
            out.append((cur, hi))
    return out


def _is_comm(name: str) -> bool:
    return bool(_COLLECTIVE.match(name) or _COMM_WORDS.search(name))


def _rank_profile(rank: int, trace: dict[str, Any]) -> tuple[RankProfile, list[tuple[str, float, float]]]:
    events = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"
              and isinstance(e.get("ts"), (int, float)) and isinstance(e.get("dur"), (int, float))]  # fmt: skip
    steps = []
    for e in events:
        m = _STEP.match(str(e.get("name", "")))
        if m:
            steps.append((int(m.group(1)), float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("tid")))
    steps.sort(key=lambda s: s[1])
    main_tid = steps[0][3] if steps else None
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_op")]
    collectives = sorted(((str(e["name"]), float(e["ts"]), float(e["dur"])) for e in events
                          if _COLLECTIVE.match(str(e.get("name", ""))) and e.get("cat") != "kernel"),
                         key=lambda c: c[1])  # fmt: skip
    if not collectives:  # no backend spans: the c10d ops of the calling thread stand for them
        collectives = sorted(((str(e["name"]), float(e["ts"]), float(e["dur"])) for e in events
                              if str(e.get("name", "")).startswith("c10d::")), key=lambda c: c[1])  # fmt: skip
    if kernels:
        compute_iv = _union((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels
                            if not _is_comm(str(e.get("name", ""))))  # fmt: skip
        comm_iv = _union([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels
                          if _is_comm(str(e.get("name", "")))] + [(t, t + d) for _, t, d in collectives])  # fmt: skip
    else:
        # operators only: annotations (``FSDP::post_backward_reduce``, ``DistributedDataParallel.forward``) are
        # containers that also span the waits inside them
        ops = [e for e in events if e.get("tid") == main_tid and e.get("cat") == "cpu_op"]
        compute_iv = _union((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in ops
                            if not _is_comm(str(e.get("name", ""))))  # fmt: skip
        comm_iv = _union(
            [(t, t + d) for _, t, d in collectives]
            + [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in ops if _is_comm(str(e.get("name", "")))]
        )
    comm_only = _minus(comm_iv, compute_iv)
    times = []
    for step, lo, hi, _tid in steps:
        total = (hi - lo) / 1e6
        compute = _length(compute_iv, lo, hi) / 1e6
        comm = _length(comm_only, lo, hi) / 1e6
        times.append(StepTimes(step=step, total=total, compute=compute, comm=comm,
                               idle=max(0.0, total - compute - comm)))  # fmt: skip
    top = _self_times([e for e in events if e.get("cat") in ("cpu_op", "kernel") and not _is_comm(str(e["name"]))])
    coll: dict[str, list[float]] = defaultdict(list)
    for name, _t, d in collectives:
        coll[name].append(d / 1e6)
    coll_rows = sorted(((n, sum(v), len(v)) for n, v in coll.items()), key=lambda r: -r[1])
    prof = RankProfile(rank=rank, steps=tuple(times), top_ops=tuple(top[:10]), collectives=tuple(coll_rows))
    return prof, collectives


def _self_times(events: list[dict[str, Any]]) -> list[tuple[str, float, int]]:
    """Per operator name: time not spent in a nested operator of the same thread, and calls; largest first."""
    by_tid: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_tid[(e.get("pid"), e.get("tid"))].append(e)
    self_us: dict[str, float] = defaultdict(float)
    calls: Counter[str] = Counter()
    for evs in by_tid.values():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[tuple[float, str]] = []  # (end, name)
        for e in evs:
            ts, dur, name = float(e["ts"]), float(e["dur"]), str(e["name"])
            while stack and stack[-1][0] <= ts:
                stack.pop()
            if stack:
                self_us[stack[-1][1]] -= dur
            self_us[name] += dur
            calls[name] += 1
            stack.append((ts + dur, name))
    return sorted(((n, max(0.0, s) / 1e6, calls[n]) for n, s in self_us.items()), key=lambda r: -r[1])


def summarize_traces(traces: dict[int, dict[str, Any]], files: dict[int, str] | None = None) -> ProfileSummary:
    """The summary of the ranks' traces (``{rank: trace dict}``)."""
    profiles, colls = [], {}
    for rank in sorted(traces):
        prof, coll = _rank_profile(rank, traces[rank])
        profiles.append(prof)
        colls[rank] = coll
    # the n-th collective of a name is the same one on every rank
    instances: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
    for rank, coll in colls.items():
        seen: Counter[str] = Counter()
        for name, _t, d in coll:
            instances[(name, seen[name])][rank] = d / 1e6
            seen[name] += 1
    acc: dict[tuple[int, str], list[float]] = defaultdict(list)
    on: dict[tuple[int, str], Counter[int]] = defaultdict(Counter)
    for (name, _n), durs in instances.items():
        if len(durs) < 2:
            continue
        last = min(durs, key=lambda r: durs[r])
        shortest = durs[last]
        for rank, d in durs.items():
            waited = d - shortest
            if rank != last and waited > 1e-4:
                acc[(rank, name)].append(waited)
                on[(rank, name)][last] += 1
    waits = [Wait(rank=rank, on=on[(rank, name)].most_common(1)[0][0], collective=name, seconds=sum(v),
                  count=len(v)) for (rank, name), v in acc.items()]  # fmt: skip
    waits.sort(key=lambda w: -w.seconds)
    return ProfileSummary(ranks=tuple(profiles), waits=tuple(waits), files=dict(files or {}))


def profile_summary(run_dir: str | os.PathLike[str]) -> ProfileSummary:
    """The summary of a run directory's ``profile/rank-<k>.pt.trace.json`` files (or of a folder holding them)."""
    root = Path(run_dir)
    folder = root / "profile" if (root / "profile").is_dir() else root
    files: dict[int, str] = {}
    for p in sorted(folder.glob(_TRACE_GLOB)):
        m = re.fullmatch(r"rank-(\d+)\.pt\.trace\.json", p.name)  # the first window (later ones: rank-<k>.<tag>...)
        if m:
            files[int(m.group(1))] = str(p)
    if not files:
        raise JupyterDistError(f"no profiler traces in {folder} (rank-<k>.pt.trace.json); run with --profile "
                               "START:STOP or call jd.profile(...) in the script")  # fmt: skip
    return summarize_traces({k: load_trace(v) for k, v in files.items()}, files)
