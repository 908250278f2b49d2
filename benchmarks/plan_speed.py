"""How long a full candidate sweep takes (the wizard re-plans on every control change; target: < 20 ms).

Run: python benchmarks/plan_speed.py [--repeat N]
Prints, per scenario, the number of candidates and the median / 95th-percentile / max time of one ``plan()`` call.
"""

from __future__ import annotations

import argparse
import statistics
import time

from jupyter_dist.plan import Hardware, TrainingShape, plan

TARGET_MS = 20.0

SCENARIOS = [
    ("gpt2, 1 x 8 A100-80GB", "gpt2", Hardware.from_names("a100-80gb"), TrainingShape(micro_batch=8, seq_len=1024)),
    ("llama-2-7b, 1 x 8 H100", "llama-2-7b", Hardware.from_names("h100-80gb"),
     TrainingShape(micro_batch=2, seq_len=4096, checkpointing="selective")),
    ("llama-2-70b, 2 x 8 H100", "llama-2-70b", Hardware.from_names("h100-80gb", nodes=2),
     TrainingShape(seq_len=4096, global_batch=512, checkpointing="full")),
    ("mixtral-8x7b, 4 x 8 A100, seq 32k", "mixtral-8x7b", Hardware.from_names("a100-80gb", nodes=4),
     TrainingShape(seq_len=32768, checkpointing="full")),
    ("llama-3.1-405b, 16 x 8 H100, seq 128k", "llama-3.1-405b", Hardware.from_names("h100-80gb", nodes=16),
     TrainingShape(seq_len=131072, checkpointing="full")),
]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    worst = 0.0
    print(f"{'scenario':42} {'cands':>5} {'median ms':>10} {'p95 ms':>8} {'max ms':>8}")
    for label, model, hw, shape in SCENARIOS:
        plan(model, hw, shape)  # warm caches (imports, enum lookups)
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            p = plan(model, hw, shape)
            times.append((time.perf_counter() - t0) * 1000)
        times.sort()
        p95 = times[int(0.95 * (len(times) - 1))]
        worst = max(worst, p95)
        print(f"{label:42} {len(p.candidates):5d} {statistics.median(times):10.2f} {p95:8.2f} {times[-1]:8.2f}")
    verdict = "OK" if worst < TARGET_MS else "SLOW"
    print(f"worst p95 {worst:.2f} ms vs target {TARGET_MS:.0f} ms: {verdict}")
    return 0 if worst < TARGET_MS else 1


if __name__ == "__main__":
    raise SystemExit(main())
