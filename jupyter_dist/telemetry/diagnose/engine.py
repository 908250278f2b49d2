"""Apply the failure table to logs: :func:`classify` one rank, :func:`diagnose_ranks` across ranks.

:func:`diagnose_ranks` finds the first failing rank and puts the cause before the cascade (:class:`Diagnosis`);
:func:`split_by_rank` and :func:`parse_child_failures` read a combined log.

Part of :mod:`jupyter_dist.telemetry.diagnose`; the table is :mod:`.patterns`, NCCL's line format :mod:`.nccl`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .nccl import LINE_PREFIXES, RANK_PREFIX, NcclFacts, nccl_facts
from .patterns import KEYWORDS, KIND_INFO, NCCL_CHATTER, PRIORITY, RULES, Hit

# Roles: "cause" (a root cause on this rank), "hang" (a timeout: primary unless another rank shows a cause),
# "consequence" (this rank reports that someone else failed).
_ROLE_ORDER = {"cause": 0, "hang": 1, "consequence": 2}
_SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}
_EVIDENCE_MAX = 3
_LINE_MAX = 400

# --------------------------------------------------------------------------------------------------------------
# Findings
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """One classified problem in a rank's log."""

    kind: str
    """A stable id, one of :data:`KINDS`."""
    title: str
    """One line, specific to this occurrence (the operation, the peer, the size... when the message has them)."""
    evidence: tuple[str, ...]
    """The matching log line(s), prefixes kept, at most three."""
    fix: str
    """What to do: environment variables, flags, what to check."""
    severity: str = "error"
    """``error`` (a failure), ``warning`` (a likely problem that did not fail by itself) or ``info``."""
    primary: bool = True
    """True for a root cause on this rank; False for a consequence of another rank's failure."""
    role: str = "cause"
    """``cause``, ``hang`` (a timeout: primary only while no other rank shows a cause) or ``consequence``."""
    rank: int | None = None
    """The rank whose log this is (from a ``[rank<k>]:`` prefix, or set by :func:`diagnose_ranks`)."""
    line: int = 0
    """0-based index of the first evidence line in the log (-1 for a finding from an exit code)."""
    suspects: tuple[int, ...] = ()
    """Ranks the message itself names as the culprits (a monitored barrier, a desync report...)."""
    data: Mapping[str, Any] = field(default_factory=dict)
    """Values parsed from the message (operation, timeout, peer, status, size...)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict."""
        return {
            "kind": self.kind, "title": self.title, "evidence": list(self.evidence), "fix": self.fix,
            "severity": self.severity, "primary": self.primary, "role": self.role, "rank": self.rank,
            "line": self.line, "suspects": list(self.suspects), "data": dict(self.data),
        }  # fmt: skip


_TRACEBACK = "Traceback (most recent call last):"

# Python's final traceback line: "RuntimeError: boom", "torch.distributed.DistBackendError: NCCL error in: ..."
_EXC_LINE = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)(?::\s?(?P<msg>.*))?$")
# Lines that end an exception message's continuation: glog lines ("E1122 06:29:09.534000 15696 ..."), the
# next traceback, chained-exception separators.
_CONT_END = re.compile(r"^(?:[EWIF]\d{4} \d\d:|Traceback |During handling|The above exception|\[[EWIF]\d{4} )")


def _strip(line: str) -> str:
    """Drop launcher/excepthook prefixes, keeping the indentation that follows them."""
    return LINE_PREFIXES.sub("", line, count=1).rstrip()


def _line_rank(line: str) -> int | None:
    m = RANK_PREFIX.search(line)
    return int(m.group(1)) if m else None


class _Acc:
    def __init__(self, hit: Hit, line_no: int, line: str, rank: int | None) -> None:
        self.hit, self.line, self.rank = hit, line_no, rank
        self.evidence: list[str] = [line]
        self.suspects: set[int] = set(hit.suspects)


def _clip(line: str) -> str:
    line = line.rstrip()
    return line if len(line) <= _LINE_MAX else line[: _LINE_MAX - 1] + "…"


def classify(text: str, *, rank: int | None = None) -> list[Finding]:
    """Classify the communication and rank failures in one log; most important first.

    ``rank`` labels the findings (else the ``[rank<k>]:`` prefix torch adds to a rank's lines is used, and a log
    with one such rank is all that rank's). One finding per (kind, rank); a generic NCCL error or a communicator
    abort is dropped when a more specific error on the same rank explains it, and a Python traceback becomes a
    ``rank_exception`` only when no pattern explains its final exception.
    """
    lines = text.splitlines()
    if rank is None:
        prefixed = {r for r in map(_line_rank, lines) if r is not None}
        if len(prefixed) == 1:  # one rank's log: its unprefixed lines (NCCL's, C++ aborts) are that rank's too
            rank = prefixed.pop()
    acc: dict[tuple[str, int | None], _Acc] = {}
    matched: set[int] = set()

    def add(hit: Hit, i: int, line_rank: int | None) -> None:
        key = (hit.kind, line_rank)
        a = acc.get(key)
        if a is None:
            acc[key] = _Acc(hit, i, _clip(lines[i]), line_rank)
        else:
            a.suspects.update(hit.suspects)
            if len(a.evidence) < _EVIDENCE_MAX and _clip(lines[i]) not in a.evidence:
                a.evidence.append(_clip(lines[i]))

    for i, raw in enumerate(lines):
        body = _strip(raw)
        low = body.lower()
        if not any(k in low for k in KEYWORDS) or NCCL_CHATTER.search(body):
            continue
        for rule in RULES:
            m = rule.regex.search(body)
            if m is None:
                continue
            add(rule.describe(m), i, rank if rank is not None else _line_rank(raw))
            matched.add(i)
            break

    # Python tracebacks whose final exception no pattern explained: a plain exception on this rank
    in_tb = False
    for i, raw in enumerate(lines):
        body = _strip(raw)
        if body.strip() == _TRACEBACK:
            in_tb = True
            continue
        if not in_tb or not body or body[0].isspace():
            continue
        in_tb = False
        m = _EXC_LINE.match(body)
        if m is None:
            continue
        explained = False
        for j in range(i, min(len(lines), i + 30)):
            nxt = _strip(lines[j])
            if j > i and (not nxt.strip() or _CONT_END.match(nxt)):
                break
            if j in matched:
                explained = True
                break
        if explained:
            continue
        exc_type = m["type"].rsplit(".", 1)[-1]
        msg = (m["msg"] or "").strip()
        hit = Hit("rank_exception", f"{exc_type}: {msg}" if msg else exc_type, {"type": m["type"], "message": msg})
        line_rank = rank if rank is not None else _line_rank(raw)
        key = ("rank_exception", line_rank)
        acc.pop(key, None)  # the last traceback of a chain is what ended the process
        acc[key] = _Acc(hit, i, _clip(lines[i]), line_rank)
        frame = _last_frame(lines, i)
        if frame is not None:
            acc[key].evidence.insert(0, _clip(frame))

    findings = [_finding(a) for a in acc.values()]
    # a combined stream: an unprefixed line ("what(): ...") of a kind that prefixed lines show is one of theirs
    with_rank = {f.kind for f in findings if f.rank is not None}
    findings = [f for f in findings if f.rank is not None or f.kind not in with_rank]
    # a generic NCCL error / an abort / a launcher summary on a rank that has a more specific error is redundant
    redundant = {"nccl_error", "comm_aborted", "child_failed"}
    specific = {f.rank for f in findings if f.kind not in redundant and f.severity == "error"}
    findings = [f for f in findings if not (f.kind in redundant and f.rank in specific)]
    return sorted(findings, key=_sort_key)


def _last_frame(lines: list[str], exc_line: int) -> str | None:
    for j in range(exc_line - 1, max(-1, exc_line - 40), -1):
        body = _strip(lines[j])
        if body.lstrip().startswith('File "'):
            return lines[j]
        if body.strip() == _TRACEBACK:
            return None
    return None


def _finding(a: _Acc) -> Finding:
    info = KIND_INFO[a.hit.kind]
    role = info.role
    return Finding(
        kind=a.hit.kind, title=a.hit.title, evidence=tuple(a.evidence), fix=info.fix, severity=info.severity,
        primary=role != "consequence", role=role, rank=a.rank, line=a.line, suspects=tuple(sorted(a.suspects)),
        data=dict(a.hit.data),
    )  # fmt: skip


def _sort_key(f: Finding) -> tuple[int, int, int, int, int]:
    return (
        0 if f.primary else 1, _SEVERITY_ORDER.get(f.severity, 3), _ROLE_ORDER.get(f.role, 3),
        PRIORITY.get(f.kind, 99), f.line,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# Across ranks
# --------------------------------------------------------------------------------------------------------------

# signal number -> (name, kind, title); exit codes of torchrun's workers are -<signal> when a signal killed them
_SIGNALS: dict[int, tuple[str, str, str]] = {
    1: ("SIGHUP", "terminated", "terminated by SIGHUP"),
    2: ("SIGINT", "terminated", "interrupted (SIGINT)"),
    15: ("SIGTERM", "terminated", "terminated by SIGTERM (stopped by the launcher)"),
    9: ("SIGKILL", "host_oom", "killed by SIGKILL — the kernel's out-of-memory killer sends this"),
    11: ("SIGSEGV", "silent_exit", "crashed with a segmentation fault (SIGSEGV)"),
    6: ("SIGABRT", "silent_exit", "aborted (SIGABRT)"),
    7: ("SIGBUS", "shm_too_small", "bus error (SIGBUS), typically /dev/shm exhausted"),
}


def _exit_finding(rank: int, code: int) -> Finding:
    if code < 0 and -code in _SIGNALS:
        name, kind, title = _SIGNALS[-code]
    elif code < 0:
        name, kind, title = f"signal {-code}", "silent_exit", f"killed by signal {-code}"
    else:
        name, kind, title = "", "silent_exit", f"exited with code {code} without an error message"
    info = KIND_INFO[kind]
    return Finding(
        kind=kind, title=title, evidence=(f"exit code {code}" + (f" ({name})" if name else ""),), fix=info.fix,
        severity="error", primary=info.role != "consequence", role=info.role, rank=rank, line=-1,
        data={"exit_code": code},
    )  # fmt: skip


@dataclass
class Diagnosis:
    """Findings of every rank, the first failing rank, and the root cause first."""

    first_rank: int | None
    """The rank that failed first (None when no rank shows an error)."""
    root: Finding | None
    """The finding that explains the failure (on ``first_rank``, or the report on another rank that names it)."""
    findings: list[Finding]
    """Every finding, root cause first, then the other primary findings, then the consequences."""
    by_rank: dict[int, list[Finding]]
    facts: dict[int, NcclFacts]
    basis: str
    """How ``first_rank`` was chosen: ``signal`` (a signal killed it), ``exit_time``, ``cause``, ``named`` (a
    timeout report names it), ``timeout``, ``lowest_rank`` or ``none``."""
    suspects: list[int] = field(default_factory=list)
    """Ranks that timeout / barrier / desync reports name as not having arrived."""
    silent_ranks: list[int] = field(default_factory=list)
    """Ranks whose logs show no error at all while others failed (hung, killed, or simply stopped)."""
    hang: dict[str, Any] | None = None
    """For a run stopped by ``--hang-timeout``: the hang report of ``diagnosis.json`` (``culprit``, ``stalled_s``,
    ``reason``, ``phases``, ``issued``, ``where`` and every rank's ``stacks``); ``None`` otherwise."""

    early_exit: dict[str, Any] | None = None
    """For a run stopped because a rank ended without its normal exit (``os._exit``): the report of
    ``diagnosis.json`` (``rank``, ``code``, ``waiting``, ``where``, ``reason``); ``None`` otherwise."""

    @classmethod
    def from_report(cls, report: Mapping[str, Any]) -> Diagnosis:
        """The diagnosis the run wrote to ``diagnosis.json``: a hang report or an early-exit report."""
        if report.get("kind") == "early_exit":
            rank = report.get("rank")
            return cls(first_rank=int(rank) if isinstance(rank, int) else None, root=None, findings=[], by_rank={},
                       facts={}, basis="early_exit", early_exit=dict(report))  # fmt: skip
        return cls.from_hang(report)

    @classmethod
    def from_hang(cls, report: Mapping[str, Any]) -> Diagnosis:
        """The diagnosis of a hung run from its hang report (``first_rank`` is the rank that fell behind)."""
        culprit = report.get("culprit")
        return cls(first_rank=int(culprit) if isinstance(culprit, int) else None, root=None, findings=[],
                   by_rank={}, facts={}, basis="hang", hang=dict(report))  # fmt: skip

    def consequences(self) -> list[Finding]:
        """The findings that are consequences of the root cause."""
        return [f for f in self.findings if not f.primary]

    def summary(self) -> str:
        """One paragraph: which rank failed first and why, the fix, and what the other errors are."""
        if self.early_exit is not None:
            return str(self.early_exit.get("reason") or f"rank {self.first_rank} ended early")
        if self.hang is not None:
            h = self.hang
            phases = {str(r): p for r, p in (h.get("phases") or {}).items()}
            where = "; ".join(f"rank {r}" + (f" (phase {phases[str(r)]})" if str(r) in phases else "") + f" was at {w}"
                              for r, w in (h.get("where") or {}).items())  # fmt: skip
            who = f"rank {self.first_rank} fell behind" if self.first_rank is not None else "no rank stood out"
            progress = "no progress" if "last_step" in h and h.get("last_step") is None else "no step"
            head = f"Hung: {progress} for {h.get('stalled_s')} s ({who}); {h.get('reason')}"
            return head + (f". {where}" if where else "")
        if self.root is None or self.first_rank is None:
            n = len(self.by_rank)
            return f"No communication or rank errors found in {n} rank log{'s' if n != 1 else ''}."
        root = self.root
        if root.rank is not None and root.rank != self.first_rank:
            head = f"rank {self.first_rank} failed first: {root.title} (reported by rank {root.rank})."
        else:
            head = f"rank {self.first_rank} failed first: {root.title}."
        parts = [head[0].upper() + head[1:], f"Fix: {root.fix}"]
        others = [f for f in self.findings if f is not root and f.rank != self.first_rank]
        cons = [f for f in others if not f.primary and f.severity == "error"]
        if cons:
            counts: dict[str, set[int | None]] = {}
            for f in cons:
                counts.setdefault(KIND_INFO[f.kind].label, set()).add(f.rank)
            what = ", ".join(f"{label} ×{len(ranks)}" for label, ranks in counts.items())
            parts.append(f"The other ranks' errors ({what}) are consequences.")
        extra = sorted({f.rank for f in others if f.primary and f.severity == "error" and f.rank is not None})
        if extra:
            kinds = sorted({KIND_INFO[f.kind].label for f in others if f.primary and f.severity == "error"})
            many = len(extra) > 1
            parts.append(
                f"Rank{'s' if many else ''} {_join(extra)} also report{'' if many else 's'} {', '.join(kinds)}."
            )
        silent = [r for r in self.silent_ranks if r != self.first_rank]
        if silent and self.basis in ("timeout", "lowest_rank"):
            parts.append(
                f"Rank{'s' if len(silent) > 1 else ''} {_join(silent)} left no error: a rank that hung or was killed "
                "without a message is the likely culprit (check its exit code, `dmesg`, `py-spy dump`)."
            )
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict."""
        return {
            "first_rank": self.first_rank, "basis": self.basis,
            "root": self.root.to_dict() if self.root else None,
            "findings": [f.to_dict() for f in self.findings],
            "ranks": {str(r): {"findings": [f.to_dict() for f in fs], "facts": self.facts[r].to_dict()}
                      for r, fs in sorted(self.by_rank.items())},
            "suspects": list(self.suspects), "silent_ranks": list(self.silent_ranks), "summary": self.summary(),
            "hang": self.hang,
            "early_exit": self.early_exit,
        }  # fmt: skip


def _join(ranks: Iterable[int]) -> str:
    return ", ".join(map(str, ranks))


_WEAK_CAUSES = frozenset({"socket_connect", "store_unreachable", "nccl_error"})


def diagnose_ranks(
    logs: Mapping[int, str],
    exit_times: Mapping[int, float] | None = None,
    *,
    exit_codes: Mapping[int, int] | None = None,
    exit_notes: Mapping[int, str] | None = None,
) -> Diagnosis:
    """Classify every rank's log, find the rank that failed first and put its root cause first.

    The first failing rank is the failing rank with the earliest ``exit_times`` entry when given; else the lowest
    rank with a root cause (an exception, OOM, a configuration error...); else a rank that a timeout report
    (monitored barrier, desync report, missing ranks) names; else the lowest rank that timed out; else the lowest
    rank with any error. ``exit_codes`` (e.g. from :func:`parse_child_failures`) adds a finding for ranks that
    died without a message (-9: OOM killer, -11: segfault, -15: stopped by the launcher...). A rank a signal other
    than SIGTERM/SIGINT/SIGHUP ended is the first rank (basis ``signal``): it could not report, and its peers' lost
    connections follow from it. ``exit_notes`` replaces such a rank's finding title (``"rank 1 was killed by SIGKILL
    ...; its peak RSS was 310 MiB"``).
    """
    by_rank: dict[int, list[Finding]] = {}
    facts: dict[int, NcclFacts] = {}
    for r in sorted(logs):
        fs = classify(logs[r], rank=r)
        code = (exit_codes or {}).get(r)
        has_error = any(f.severity == "error" for f in fs)
        if code and not any(f.severity == "error" and f.primary for f in fs):
            if not has_error or (code < 0 and code not in (-15, -2, -1)):
                fs = sorted([*fs, _exit_finding(r, code)], key=_sort_key)
        by_rank[r] = fs
        facts[r] = nccl_facts(logs[r])
    for r, code in (exit_codes or {}).items():
        if r not in by_rank and code:
            by_rank[r], facts[r] = [_exit_finding(r, code)], NcclFacts()

    killed = sorted(r for r, code in (exit_codes or {}).items() if code < 0 and code not in (-15, -2, -1))
    signal_root: Finding | None = None
    if killed:
        r = killed[0]
        signal_root = _exit_finding(r, int((exit_codes or {})[r]))
        note = (exit_notes or {}).get(r)
        if note:
            signal_root = replace(signal_root, title=note.removeprefix(f"rank {r} was "))
        by_rank[r] = sorted([signal_root, *(f for f in by_rank.get(r, ()) if f.kind != signal_root.kind)],
                            key=_sort_key)  # fmt: skip

    def errors(r: int, role: str | None = None) -> list[Finding]:
        return [f for f in by_rank.get(r, ()) if f.severity == "error" and (role is None or f.role == role)]

    failing = [r for r in sorted(by_rank) if errors(r)]
    cause_ranks = [r for r in failing if errors(r, "cause")]
    hang_ranks = [r for r in failing if errors(r, "hang")]
    suspects = sorted({s for fs in by_rank.values() for f in fs if f.role == "hang" for s in f.suspects})
    silent = [r for r in sorted(by_rank) if not errors(r)] if failing else []

    first: int | None = None
    root: Finding | None = None
    basis = "none"
    timed = [r for r in failing if exit_times and r in exit_times]
    if signal_root is not None:
        first, root, basis = killed[0], signal_root, "signal"
    elif exit_times and timed:
        first, basis = min(timed, key=lambda r: (exit_times[r], r)), "exit_time"
    elif cause_ranks:
        # a rank with a definite cause beats one whose "cause" is often a side effect (cannot connect, generic NCCL)
        first = min(cause_ranks, key=lambda r: (all(f.kind in _WEAK_CAUSES for f in errors(r, "cause")), r))
        basis = "cause"
    elif suspects:
        first, basis = suspects[0], "named"
        own = [f for f in errors(first) if f.primary]
        if own:
            root = own[0]
        else:  # the named rank left no error: the report that names it is the root finding
            root = min((f for fs in by_rank.values() for f in fs if first in f.suspects), key=_sort_key)
    elif hang_ranks:
        first, basis = hang_ranks[0], "timeout"
    elif failing:
        first, basis = failing[0], "lowest_rank"
    if first is not None and root is None:
        own = errors(first)
        root = own[0] if own else None

    # once the first rank is known, the other ranks' timeouts are waits for it: consequences (unless every
    # failing rank only timed out and nothing says who is late)
    if first is not None and basis != "timeout":
        for r, fs in by_rank.items():
            if r != first:
                by_rank[r] = sorted(
                    (replace(f, primary=False) if f.role == "hang" and f is not root else f for f in fs), key=_sort_key
                )

    def order(f: Finding) -> tuple[int, int, tuple[int, int, int, int, int], int]:
        return (0 if f is root else 1, 0 if f.rank == first else 1, _sort_key(f), f.rank if f.rank is not None else -1)

    findings = sorted((f for fs in by_rank.values() for f in fs), key=order)
    return Diagnosis(first_rank=first, root=root, findings=findings, by_rank=by_rank, facts=facts, basis=basis,
                     suspects=suspects, silent_ranks=silent)  # fmt: skip


def split_by_rank(text: str) -> dict[int, str]:
    """Split one combined stream (torchrun's own output, a SkyPilot/SLURM log) by its ``[rank<k>]:`` prefixes.

    Lines without a rank prefix are left out (NCCL's own lines carry none; torchrun's ``--tee`` prefix
    ``[default<k>]:`` is the *local* rank, not the global one).
    """
    out: dict[int, list[str]] = {}
    for line in text.splitlines():
        r = _line_rank(line)
        if r is not None:
            out.setdefault(r, []).append(line)
    return {r: "\n".join(ls) for r, ls in sorted(out.items())}


# torchrun's ChildFailedError table (elastic/multiprocessing/errors/__init__.py):
#   [1]:
#     time      : 2026-11-22_06:29:09
#     host      : localhost
#     rank      : 0 (local_rank: 0)
#     exitcode  : -15 (pid: 15701)  (SIGTERM)
_CHILD_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank")
_CHILD_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


def parse_child_failures(text: str) -> dict[int, int]:
    """Exit codes per global rank from torchrun's ``ChildFailedError`` summary (empty when there is none)."""
    out: dict[int, int] = {}
    rank: int | None = None
    for line in text.splitlines():
        body = _strip(line)
        if m := _CHILD_RANK.match(body):
            rank = int(m.group(1))
        elif (m := _CHILD_EXIT.match(body)) and rank is not None:
            out[rank] = int(m.group(1))
            rank = None
    return out

