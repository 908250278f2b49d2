"""The step-time model against published measured throughput, and where each run's predicted time goes.

Run: python benchmarks/speed_model.py

Prints, for every run of ``tests/test_published_throughput.py`` (Megatron-LM 2021, Korthikanti et al. 2022, Llama 3,
torchtitan, BLOOM, OPT; citations there), the measured figure, the planner's prediction in the same unit, their
ratio, and the predicted breakdown of the step. No processes are started.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_published_throughput import MISSES, RUNS, estimate, predicted  # noqa: E402


def breakdown(name: str) -> str:
    """The predicted step of run ``name``, in words (the estimate the test compares)."""
    return estimate(RUNS[name]).describe(4)


def main() -> None:
    """Print the table."""
    print(f"{'run':20} {'unit':6} {'measured':>9} {'predicted':>10} {'ratio':>6}  breakdown")
    within = 0
    for name, run in RUNS.items():
        got = predicted(run)
        ratio = got / run.measured
        within += abs(ratio - 1) <= 0.15
        flag = "  (expected miss)" if name in MISSES else ""
        print(f"{name:20} {run.unit:6} {run.measured:9.1f} {got:10.1f} {ratio:6.2f}  {breakdown(name)}{flag}")
    print(f"\nwithin 15 %: {within} of {len(RUNS)}")


if __name__ == "__main__":
    main()
