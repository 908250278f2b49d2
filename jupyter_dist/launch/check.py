"""The preflight communication check (``%dist_check``, ``jupyter-dist check``).

It runs on the same launcher as a training run, then judges what the ranks measured.

The report gives, per rank, the backend and versions (and flags ranks that differ), whether an all-reduce summed
correctly, and for each collective and message size the time, the algorithm bandwidth and the bus bandwidth computed
the way nccl-tests does; the verdict compares the best all-reduce bus bandwidth with what the hardware should give.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import JupyterDistError
from ..plan.units import parse_bytes
from ..telemetry.health import bus_bandwidth

__all__ = ["CheckReport", "run_check", "DEFAULT_SIZES", "CPU_GLOO_BUSBW", "parse_size", "parse_sizes"]

DEFAULT_SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 24)
"""Message sizes (bytes) of the default sweep: 1 KiB to 16 MiB (add 256M on GPUs: ``--sizes 1K,1M,16M,256M``)."""

CPU_GLOO_BUSBW = 0.2e9
"""Bus bandwidth (bytes/s) we call normal for gloo between processes on one host (TCP over loopback). Measured on a
2-core CI machine: a 16-64 MiB all-reduce reached 0.4-0.9 GB/s bus bandwidth between 2 ranks, and less when the
machine is shared; the reference is set low so that only a real problem reads as degraded."""

HEALTHY, DEGRADED, BROKEN = "healthy", "degraded", "broken"
_VERSION_KEYS = ("torch", "nccl", "cuda", "backend", "python")


def parse_size(text: str, *, what: str = "--sizes") -> int:
    """One size: ``4096``, ``64K``/``1M``/``1G`` (binary, as nccl-tests' ``-b``/``-e``), or ``512MiB``, ``100GB``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT])\s*", text, flags=re.IGNORECASE)
    if m:
        return int(float(m.group(1)) * 1024 ** ("KMGT".index(m.group(2).upper()) + 1))
    return parse_bytes(text, what=what)


def parse_sizes(text: str) -> list[int]:
    """``"1K,1M,64M"`` -> bytes; each size must be at least 4 bytes."""
    sizes = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        size = parse_size(item)
        if size < 4:
            raise JupyterDistError(f"--sizes: {item!r} is below 4 bytes (one float32)")
        sizes.append(size)
    if not sizes:
        raise JupyterDistError("--sizes needs at least one size, e.g. 1K,1M,16M")
    return sizes


@dataclass
class CheckReport:
    """What the check measured and the verdict, with the evidence."""

    world_size: int
    ranks: list[dict[str, Any]]
    correct: bool
    results: list[dict[str, Any]]
    expected_busbw: float | None
    expected_from: str
    run_status: str = "succeeded"
    run_dir: str = ""
    verdict: str = HEALTHY
    evidence: list[str] = field(default_factory=list)

    @classmethod
    def from_raw(cls, raw: dict[str, Any], *, expected_busbw: float | None, expected_from: str,
                 run_status: str = "succeeded", run_dir: str = "") -> CheckReport:  # fmt: skip
        """Judge a ``check.json`` written by the ranks."""
        n = int(raw["world_size"])
        results = []
        for entry in raw.get("results", []):
            e = dict(entry)
            if "seconds" in e and e["seconds"] > 0 and n > 1:
                e["algbw"], e["busbw"] = bus_bandwidth(e["op"], e["bytes"], e["seconds"], n)
            results.append(e)
        report = cls(world_size=n, ranks=list(raw.get("ranks", [])), correct=bool(raw.get("correct")),
                     results=results, expected_busbw=expected_busbw, expected_from=expected_from,
                     run_status=run_status, run_dir=run_dir)  # fmt: skip
        report._judge()
        return report

    def _judge(self) -> None:
        evidence: list[str] = []
        verdict = HEALTHY
        if not self.correct:
            verdict = BROKEN
            want = self.world_size * (self.world_size + 1) // 2
            evidence.append(f"all-reduce of rank+1 over {self.world_size} ranks did not sum to {want}: data is "
                            "corrupted on the way")  # fmt: skip
        for key in _VERSION_KEYS:
            values = {str(r.get(key)) for r in self.ranks}
            if len(values) > 1:
                verdict = BROKEN if key in ("torch", "nccl", "backend") else max(verdict, DEGRADED, key=_rank)
                by = ", ".join(f"rank {r['rank']}: {r.get(key)}" for r in self.ranks)
                evidence.append(f"ranks differ in {key} ({by}): install the same versions everywhere")
        failed = [e for e in self.results if "error" in e]
        for e in failed:
            if e["op"] == "all_reduce":
                verdict = BROKEN
            evidence.append(f"{e['op']} failed at {_fmt_bytes(e['bytes'])}: {e['error']}")
        best = self.best_busbw()
        if best is not None:
            line = f"best all-reduce bus bandwidth {_fmt_bw(best)}"
            if self.expected_busbw:
                ratio = best / self.expected_busbw
                line += f" = {ratio:.0%} of the {_fmt_bw(self.expected_busbw)} expected ({self.expected_from})"
                if ratio < 0.5 and verdict == HEALTHY:
                    verdict = DEGRADED
                    line += ": below half of it. Check the transport in use (NCCL_DEBUG=INFO shows NET/Socket vs "
                    line += "NET/IB or P2P), NCCL_SOCKET_IFNAME/NCCL_IB_HCA, and other jobs sharing the links"
            else:
                line += f" (no reference: {self.expected_from})"
            evidence.append(line)
        if self.world_size < 2:
            evidence.append("one rank only: nothing crosses a link; run with --nproc 2 or more")
        self.verdict, self.evidence = verdict, evidence

    def best_busbw(self) -> float | None:
        """The highest all-reduce bus bandwidth measured (bytes/s), or ``None``."""
        values = [e["busbw"] for e in self.results if e["op"] == "all_reduce" and "busbw" in e]
        return max(values) if values else None

    # ---- output ---------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (bandwidths in bytes/s, times in seconds)."""
        return {"verdict": self.verdict, "evidence": self.evidence, "world_size": self.world_size,
                "correct": self.correct, "expected_busbw": self.expected_busbw, "expected_from": self.expected_from,
                "ranks": self.ranks, "results": self.results, "run_status": self.run_status,
                "run_dir": self.run_dir}  # fmt: skip

    def to_text(self) -> str:
        """A table per collective and the verdict with its evidence."""
        backend = self.ranks[0].get("backend") if self.ranks else "?"
        lines = [f"Communication check: {self.verdict.upper()} ({self.world_size} ranks, backend {backend})"]
        for r in self.ranks:
            nccl = f"nccl {r['nccl']} " if r.get("nccl") else ""
            lines.append(f"  rank {r['rank']}: {r.get('host')} pid {r.get('pid')} torch {r.get('torch')} {nccl}"
                         f"device {r.get('device')}")  # fmt: skip
        lines.append(f"  all-reduce correctness: {'ok' if self.correct else 'WRONG'}")
        lines.append(f"  {'collective':<15}{'size':>9}{'time':>11}{'algbw':>12}{'busbw':>12}")
        for e in self.results:
            if "error" in e:
                lines.append(f"  {e['op']:<15}{_fmt_bytes(e['bytes']):>9}  failed: {e['error']}")
                continue
            lines.append(f"  {e['op']:<15}{_fmt_bytes(e['bytes']):>9}{e['seconds'] * 1e3:>9.2f}ms"
                         f"{_fmt_bw(e.get('algbw')):>12}{_fmt_bw(e.get('busbw')):>12}")  # fmt: skip
        lines += [f"  - {x}" for x in self.evidence]
        return "\n".join(lines)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        colour = {HEALTHY: "#2e7d32", DEGRADED: "#ef6c00", BROKEN: "#c62828"}[self.verdict]
        body = html.escape(self.to_text())
        card = f'<div style="border-left:4px solid {colour};padding:4px 8px"><pre style="margin:0">{body}</pre></div>'
        return {"text/plain": self.to_text(), "text/html": card}


def _rank(verdict: str) -> int:
    return (HEALTHY, DEGRADED, BROKEN).index(verdict)


def _fmt_bytes(n: float) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return f"{int(n)}B"


def _fmt_bw(bw: float | None) -> str:
    if bw is None:
        return "-"
    return f"{bw / 1e9:.2f} GB/s" if bw >= 1e8 else f"{bw / 1e6:.1f} MB/s"


CHECK_CELL = """
from jupyter_dist.worker._check import run_check
run_check({sizes!r}, {ops!r}, iters={iters}, warmup=1, delay_rank={delay_rank}, delay_s={delay_s})
"""


def run_check(*, nproc: int | None = None, nodes: int = 1, sizes: list[int] | None = None,
              ops: list[str] | None = None, iters: int = 5, plan: Any = None, hardware: Any = None,
              expected_busbw: float | None = None, timeout: float = 180.0, runs_dir: str = "runs",
              launcher: str = "torchrun", env: dict[str, str] | None = None, delay_rank: int = -1,
              delay_s: float = 0.0) -> CheckReport:  # fmt: skip
    """Run the preflight on ``nodes x nproc`` fresh processes (blocking, at most ``timeout`` s) and judge it.

    The reference bandwidth is ``expected_busbw`` if given, else the planned hardware's (``plan`` or ``hardware``),
    else, for CPU processes, :data:`CPU_GLOO_BUSBW`.
    """
    from ..worker._check import OPS
    from .options import RunOptions
    from .session import local_gpu_count, start_run

    sizes = list(sizes or DEFAULT_SIZES)
    ops = list(ops or OPS)
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise JupyterDistError(f"unknown collective(s) {', '.join(bad)}; valid: {', '.join(OPS)}")
    if iters < 1:
        raise JupyterDistError(f"--iters must be >= 1, got {iters}")
    code = CHECK_CELL.format(sizes=sizes, ops=ops, iters=iters, delay_rank=delay_rank, delay_s=delay_s)
    opts = RunOptions(nproc=nproc, nodes=nodes, strategy="none", launcher=launcher, name="check", timeout=timeout,
                      env=dict(env or {}), worker={"heartbeat_s": 1.0}, runs_dir=runs_dir, output="none")  # fmt: skip
    run: Any = start_run(code, opts)
    status = run.wait(timeout + 30)
    path = run.dir / "check.json"
    if not path.exists():
        tail = run.logs(tail=15)
        raise JupyterDistError(f"the check did not finish ({status}); rank log tail:\n{tail}")
    raw = json.loads(path.read_text())
    world = int(raw["world_size"])
    hw = hardware if hardware is not None else getattr(plan, "hardware", None)
    if expected_busbw is not None:
        source = "given"
    elif hw is not None:
        expected_busbw = float(hw.collective_bw(world, ranks_per_node=nproc))
        source = f"{hw.accelerator.label}, {hw.interconnect.name if hw.nodes > 1 else hw.accelerator.intra_node_link}"
    elif local_gpu_count() == 0:
        expected_busbw, source = CPU_GLOO_BUSBW, "gloo between CPU processes on one host"
    else:
        source = "pass the GPU model (--gpu) to compare with its expected bandwidth"
    return CheckReport.from_raw(raw, expected_busbw=expected_busbw, expected_from=source, run_status=status,
                                run_dir=str(run.dir))  # fmt: skip
