"""What the notebook shows is what happened: every logged value at its step, one throughput in every view.

Real torchrun runs on CPU/gloo through ``start_run``: each rank also writes what it logged to a file of its own,
and the tests compare ``run.metrics()``, the summary, the runs table, the panels, ``compare``, ``%dist_tune``'s
measurement and ``plan_check`` against it and against each other.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest

from jupyter_dist.launch.session import start_run
from jupyter_dist.telemetry.measurement import job_rate, measure_records
from jupyter_dist.telemetry.records import expand_steps, steps_fields

pytestmark = pytest.mark.slow

LOGGING_CELL = """
import json, time
import torch

torch.manual_seed(jd.rank)
logged = []
for step in range(STEPS):
    loss = torch.rand(()) * 3 + 1.0 / (step + 1)   # a tensor, read by the emitter in batches
    lr = 1e-3 * (1 - step / STEPS)
    logged.append([step, loss.item(), lr])
    jd.log(step, loss=loss, lr=lr, tokens=256)
    time.sleep(0.002)
with open(OUT + f"/logged-{jd.rank}.json", "w") as f:
    json.dump(logged, f)
"""


def test_a_200_step_run_keeps_every_logged_value_at_its_step(tmp_path: Path) -> None:
    """200 steps per rank, the default telemetry interval (1 s): run.metrics() holds the 200 values each rank
    logged, exactly; the summary's and the runs table's last and best loss are computed from those values."""
    from jupyter_dist.launch.runs import runs
    from jupyter_dist.telemetry.summary import read_summary

    code = f"STEPS = 200\nOUT = {str(tmp_path)!r}\n" + LOGGING_CELL
    run = start_run(code, nproc=2, strategy="ddp", runs_dir=tmp_path / "runs", name="lossless", output="none")
    assert run.wait(180) == "succeeded", run.logs()
    logged = {r: json.loads((tmp_path / f"logged-{r}.json").read_text()) for r in (0, 1)}
    frame = run.metrics()
    for rank in (0, 1):
        mine = frame[frame["rank"] == rank].sort_values("step")
        assert len(mine) == 200
        assert mine["step"].tolist() == [s for s, _, _ in logged[rank]]
        assert mine["loss"].tolist() == [v for _, v, _ in logged[rank]]  # exact: no mean, no rounding
        assert mine["lr"].tolist() == [lr for _, _, lr in logged[rank]]
    per_step = {s: (logged[0][s][1] + logged[1][s][1]) / 2 for s in range(200)}
    summary = read_summary(run.dir)
    assert summary is not None and summary["steps"] == 200
    assert summary["last_loss"] == per_step[199]
    best = min(per_step, key=lambda s: (per_step[s], s))
    assert (summary["best_loss"], summary["best_step"]) == (per_step[best], best)
    row = runs(tmp_path / "runs")[0]
    assert (row.last_loss, row.best_loss) == (per_step[199], per_step[best])
    # written in batches (about one per second per rank), not one line per call
    lines = (run.dir / "telemetry" / "rank-0.jsonl").read_text().splitlines()
    assert sum('"kind":"steps"' in ln for ln in lines) < 50


# --------------------------------------------------------------------------------------- one throughput
TRAIN_CELL = """
import torch
import torch.nn as nn
from jupyter_dist.models import MoETransformer, Transformer

VOCAB, SEQ, BATCH = 64, 16, 4
torch.manual_seed(0)
import os
if int(os.environ.get("JD_EP", "1")) > 1:
    model = MoETransformer(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_experts=4, top_k=2, ffn_dim=32)
else:
    model = Transformer(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = jd.wrap(model, opt)


def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


for step in range(12):
    g = torch.Generator().manual_seed(step * jd.dp_size + jd.dp_rank)
    tokens = (torch.randint(0, VOCAB, (BATCH, 1), generator=g) + torch.arange(SEQ + 1)) % VOCAB
    loss = jd.train_step(tokens[:, :-1], tokens[:, 1:], loss_fn)
    jd.log(step, loss=loss, tokens=BATCH * SEQ)
"""


def _plan_for(degree: str) -> Any:
    from jupyter_dist.models import MoETransformer, Transformer
    from jupyter_dist.plan import Hardware, ModelSpec, TrainingShape, get_accelerator, plan

    if degree == "ep":
        spec = ModelSpec.from_module(MoETransformer, vocab_size=64, dim=32, n_layers=2, n_heads=4, n_experts=4,
                                     top_k=2, ffn_dim=32)  # fmt: skip
    else:
        spec = ModelSpec.from_module(Transformer, vocab_size=64, dim=32, n_layers=2, n_heads=4)
    hw = Hardware(accelerator=get_accelerator("cpu"), gpus_per_node=2)
    shape = TrainingShape(micro_batch=4, seq_len=16, precision="fp32")
    return plan(spec, hw, shape, strategy="fsdp2", **{degree: 2})


@pytest.mark.parametrize("degree", ["tp", "pp", "cp", "ep"])
def test_tokens_per_s_is_one_number_in_every_view(tmp_path: Path, degree: str) -> None:
    """Under tp2, pp2 and cp2 on 2 processes there is one data-parallel replica: the job's tokens/s is one
    rank's rate, not the sum over ranks; under ep2 both ranks hold their own tokens (dp 2). Every view shows the
    same number: the summary, the runs table, the panels' status line, compare, %dist_tune's measurement,
    plan_check and Run.summary()'s text."""
    from jupyter_dist.launch.measure import measure_run
    from jupyter_dist.launch.runs import runs
    from jupyter_dist.telemetry.summary import read_summary
    from jupyter_dist.ui.compare import Comparison
    from jupyter_dist.ui.panels import DashboardModel

    p = _plan_for(degree)
    name = p.recommended if degree != "ep" else "fsdp2+ep2"
    run = start_run(TRAIN_CELL, nproc=2, plan=p, strategy=name, runs_dir=tmp_path / "runs", name=degree,
                    output="none", timeout=240)  # fmt: skip
    assert run.wait(240) == "succeeded", run.logs()
    records = run.records()
    start = [r for r in records if r["kind"] == "start"]
    want_dp = 2 if degree == "ep" else 1
    assert {r["dp_size"] for r in start} == {want_dp}

    truth = measure_records(records)
    assert truth.tokens_per_s is not None and truth.dp_size == want_dp
    per_rank = {r: statistics.median(v) for r, v in _rates(records).items()}
    assert truth.tokens_per_s == pytest.approx(sum(per_rank.values()) / len(per_rank) * want_dp)
    if want_dp == 1:  # the old views added the ranks of one tensor/pipeline/context group: twice the truth
        assert truth.tokens_per_s < 0.75 * sum(per_rank.values())

    views: dict[str, float | None] = {}
    summary = read_summary(run.dir)
    assert summary is not None and summary["throughput_unit"] == "tokens/s"
    views["summary"] = summary["throughput"]
    views["runs table"] = runs(tmp_path / "runs")[0].throughput
    panels = DashboardModel()
    panels.ingest(records)
    views["panels"] = panels.status()["throughput"]
    cmp = Comparison([run])
    views["compare"] = cmp.model.runs[0].measure.result().tokens_per_s
    views["tune"] = measure_run(run).tokens_per_s
    check = run.plan_check()
    assert check is not None and check["candidate"] == name
    views["plan_check"] = check["measured"].tokens_per_s
    for view, value in views.items():
        assert value == pytest.approx(truth.tokens_per_s, rel=1e-12), (view, views)
    assert f"{truth.tokens_per_s:,.0f} tokens/s" in run.summary()
    assert f"{truth.tokens_per_s:,.0f} tokens/s" in cmp.text()
    assert f"{truth.tokens_per_s:,.0f} tokens/s" in panels.status_html()


def _rates(records: list[dict[str, Any]]) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for r in records:
        if r["kind"] == "step" and r["step"] >= 2 and "tokens_per_s" in r:
            out.setdefault(r["rank"], []).append(r["tokens_per_s"])
    return out


# --------------------------------------------------------------------------------------- no processes
@pytest.mark.parametrize("dp, world, want", [(None, 4, 4 * 10.0), (1, 2, 10.0), (2, 4, 20.0), (4, 4, 40.0)])
def test_the_counting_rule_counts_each_replica_once(dp: int | None, world: int, want: float) -> None:
    rates = {r: 10.0 for r in range(world)}
    assert job_rate(rates, dp_size=dp, world_size=world) == want


def test_a_batch_round_trips_every_value_and_the_time_between_calls() -> None:
    calls = [(5, 100.0, {"loss": 0.1 + 0.2}), (6, 100.25, {"loss": math.pi, "tokens": 64.0}),
             (8, 100.75, {"loss": -0.0, "tokens": 64.0, "big": 1e308 * 10, "tiny": 5e-324})]  # fmt: skip
    rec = {"v": 1, "kind": "steps", "rank": 3, "seq": 9, "t": 101.0, **steps_fields(calls, (99.5, 4))}
    rec = json.loads(json.dumps(rec))
    out = expand_steps(rec)
    assert [r["step"] for r in out] == [5, 6, 8]
    assert [r["loss"] for r in out] == [0.1 + 0.2, math.pi, -0.0]
    assert math.copysign(1, out[2]["loss"]) == -1 and out[2]["big"] == math.inf and out[2]["tiny"] == 5e-324
    assert "tokens" not in out[0] and "big" not in out[1] and rec["at"] == {"tokens": [1, 2], "big": [2], "tiny": [2]}
    assert [r["step_time"] for r in out] == pytest.approx([0.5, 0.25, 0.25])
    assert out[1]["tokens_per_s"] == pytest.approx(256.0) and "tokens_per_s" not in out[0]
    assert all(r["rank"] == 3 and r["kind"] == "step" for r in out)


@pytest.mark.parametrize(
    "damage",
    [
        {"ts": "AAAA"},
        {"m": {"loss": "not base64!"}},
        {"step": 3},
        {"count": 5},
        {"enc": "csv"},
        {"at": {"loss": [0, 7]}},
    ],
)
def test_a_damaged_batch_is_skipped_and_counted(damage: dict[str, Any]) -> None:
    from jupyter_dist.telemetry.reader import RecordSet

    calls = [(0, 1.0, {"loss": 1.0}), (1, 2.0, {"loss": 2.0})]
    good = {"v": 1, "kind": "steps", "rank": 0, "seq": 1, "t": 3.0, **steps_fields(calls, None)}
    bad = {**good, "seq": 2, **damage}
    rs = RecordSet()
    rs.add_lines([json.dumps(good), json.dumps(bad)])
    assert [r["loss"] for r in rs.records] == [1.0, 2.0] and rs.bad_lines == 1


def _write_finished_run(run_dir: Path, metric: str, calls: int, spike_at: int) -> None:
    from jupyter_dist.telemetry.emitter import Emitter, JsonlFileSink, telemetry_path

    (run_dir / "telemetry").mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"name": run_dir.name, "status": "succeeded", "world_size": 2,
                                                  "nproc": 2, "strategy": "ddp", "started": 1.8e9}))  # fmt: skip
    for rank in (0, 1):
        t = [1.8e9]
        em = Emitter(rank=rank, sinks=[JsonlFileSink(telemetry_path(run_dir, rank))], clock=lambda t=t: t[0])
        em.emit("start", world_size=2, dp_size=2, local_rank=rank, pid=1, host="h", strategy="ddp")
        for step in range(calls):
            t[0] += 0.005 * (1 + rank)
            value = 100.0 if (rank, step) == (1, spike_at) else 1.0 / (1 + step)
            em.log({metric: value, "lr": 1e-3, "tokens": 64}, step)
        em.close()


@pytest.mark.parametrize("metric", ["loss", "train/nll"])
def test_a_long_finished_run_opens_from_columns_with_its_spike_and_the_one_throughput(tmp_path: Path,
                                                                                      metric: str) -> None:  # fmt: skip
    """20,000 calls per rank: the panels hold a bounded number of points, keep the one spike, pick the first metric
    when there is no loss, and show the throughput the records give (each replica counted once)."""
    from jupyter_dist.telemetry.reader import read_run_records
    from jupyter_dist.ui.dashboard import Dashboard

    _write_finished_run(tmp_path / "r", metric, 20_000, spike_at=12_345)
    dash = Dashboard(tmp_path / "r", widget=False)
    traces = {t["name"]: t for t in {f["id"]: f for f in dash.model.figures()}["loss"]["traces"]}
    assert dash.model.metric == metric
    assert 100 < len(traces["rank 1"]["x"]) <= dash.model.max_points
    assert 100.0 in traces["rank 1"]["y"] and 12_345 in traces["rank 1"]["x"]  # the spike survives thinning
    assert traces["rank 0"]["x"][-1] == 19_999
    truth = measure_records(read_run_records(tmp_path / "r" / "telemetry").records)
    assert dash.model.status()["throughput"] == pytest.approx(truth.tokens_per_s, rel=1e-12)
    assert truth.tokens_per_s == pytest.approx(64 / 0.005 + 64 / 0.010, rel=1e-4)  # dp 2: both ranks count
