"""The preflight communication check: nccl-tests bandwidth arithmetic, the verdict logic, and real 2-rank gloo runs
through the library, the CLI and the magic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jupyter_dist.errors import JupyterDistError
from jupyter_dist.launch.check import CheckReport, parse_sizes
from jupyter_dist.telemetry.health import bus_bandwidth, bus_factor


@pytest.mark.parametrize(("op", "n", "factor"), [("all_reduce", 8, 1.75), ("all_reduce", 2, 1.0),
                                                  ("all_gather", 8, 0.875), ("reduce_scatter", 4, 0.75),
                                                  ("broadcast", 8, 1.0)])  # fmt: skip
def test_bus_bandwidth_factors_are_the_nccl_tests_ones(op: str, n: int, factor: float) -> None:
    assert bus_factor(op, n) == pytest.approx(factor)
    alg, bus = bus_bandwidth(op, 1e9, 0.01, n)
    assert alg == pytest.approx(1e11) and bus == pytest.approx(1e11 * factor)


def test_bad_bandwidth_inputs() -> None:
    with pytest.raises(ValueError, match="valid: all_reduce"):
        bus_factor("alltoallv", 4)
    with pytest.raises(ValueError, match="> 0"):
        bus_bandwidth("all_reduce", 1, 0.0, 2)
    with pytest.raises(JupyterDistError, match="below 4 bytes"):
        parse_sizes("1K,2")
    assert parse_sizes("1K, 1M,16MiB") == [1024, 1 << 20, 16 << 20]


def raw(n: int = 2, **over: Any) -> dict[str, Any]:
    ranks = [{"rank": r, "host": "h", "pid": 10 + r, "torch": "2.13.0", "nccl": "2.21.5", "cuda": "12.4",
              "backend": "nccl", "python": "3.11.9", "device": "NVIDIA H100"} for r in range(n)]  # fmt: skip
    results = [{"op": "all_reduce", "bytes": 1 << 30, "seconds": 0.0125, "seconds_per_rank": [0.0125] * n},
               {"op": "all_gather", "bytes": 1 << 30, "seconds": 0.01}]  # fmt: skip
    return {"world_size": n, "ranks": ranks, "correct": True, "results": results, **over}


def test_verdicts_with_their_evidence() -> None:
    # 1 GiB all-reduce in 12.5 ms on 8 ranks: algbw 85.9 GB/s, busbw 150 GB/s
    ok = CheckReport.from_raw(raw(8), expected_busbw=200e9, expected_from="H100 NVLink")
    assert ok.verdict == "healthy" and ok.best_busbw() == pytest.approx((1 << 30) / 0.0125 * 1.75)
    assert "75% of the 200.00 GB/s expected (H100 NVLink)" in ok.evidence[-1]
    slow = CheckReport.from_raw(raw(8), expected_busbw=400e9, expected_from="H100 NVLink")
    assert slow.verdict == "degraded" and "NCCL_SOCKET_IFNAME" in slow.evidence[-1]
    bad = raw(2, correct=False)
    assert CheckReport.from_raw(bad, expected_busbw=None, expected_from="-").verdict == "broken"
    mixed = raw(2)
    mixed["ranks"][1]["nccl"] = "2.18.1"
    rep = CheckReport.from_raw(mixed, expected_busbw=None, expected_from="no reference")
    assert rep.verdict == "broken" and "rank 0: 2.21.5, rank 1: 2.18.1" in rep.evidence[0]
    py = raw(2)
    py["ranks"][1]["python"] = "3.12.1"
    assert CheckReport.from_raw(py, expected_busbw=None, expected_from="-").verdict == "degraded"
    failed = raw(2)
    failed["results"].append({"op": "reduce_scatter", "bytes": 1024, "error": "RuntimeError: not supported"})
    rep = CheckReport.from_raw(failed, expected_busbw=None, expected_from="-")
    assert rep.verdict == "healthy" and any("reduce_scatter failed at 1K" in e for e in rep.evidence)
    assert json.loads(json.dumps(rep.to_dict()))["verdict"] == "healthy"
    assert "reduce_scatter" in rep.to_text() and "failed: RuntimeError" in rep.to_text()


@pytest.mark.slow
def test_a_real_two_rank_check_on_gloo(tmp_path: Path) -> None:
    from jupyter_dist.launch.check import run_check

    rep = run_check(nproc=2, sizes=[4096, 1 << 20], iters=3, runs_dir=str(tmp_path), expected_busbw=1e3)
    assert rep.verdict == "healthy", rep.to_text()
    assert rep.correct and [r["backend"] for r in rep.ranks] == ["gloo", "gloo"]
    assert len({r["pid"] for r in rep.ranks}) == 2
    assert [(e["op"], e["bytes"]) for e in rep.results] == [
        (op, size) for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast") for size in (4096, 1 << 20)
    ]
    for e in rep.results:
        assert e["seconds"] == max(e["seconds_per_rank"]) > 0 and e["busbw"] > 0
    # the same figures judged against a link they cannot reach
    again = CheckReport.from_raw(json.loads((Path(rep.run_dir) / "check.json").read_text()), expected_busbw=1e15,
                                 expected_from="a 1 PB/s link")  # fmt: skip
    assert again.verdict == "degraded" and "below half" in again.evidence[-1]


@pytest.mark.slow
def test_cli_check_prints_json_and_exits_with_the_verdict(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "jupyter-dist"
    res = subprocess.run([str(exe), "check", "--nproc", "2", "--sizes", "4K,64K", "--iters", "2", "--ops",
                          "all_reduce,broadcast", "--expect-busbw", "1K", "--json", "--runs-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=180)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert out["verdict"] == "healthy" and [e["op"] for e in out["results"]] == ["all_reduce"] * 2 + ["broadcast"] * 2
    bad = subprocess.run([str(exe), "check", "--ops", "alltoallv"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown collective(s) alltoallv; valid: all_reduce" in bad.stderr


@pytest.mark.slow
def test_dist_check_magic(ip: Any, runs: Path) -> None:
    rep = ip.run_line_magic("dist_check", "--nproc 2 --sizes 4K --iters 1 --ops all_reduce --gpu h100-80gb")
    assert isinstance(rep, CheckReport) and rep.correct
    assert "NVIDIA H100" in rep.expected_from and rep.expected_busbw and rep.expected_busbw > 1e11
    assert rep.verdict == "degraded"  # gloo on CPU is nowhere near NVLink
    assert "text/html" in rep._repr_mimebundle_()
