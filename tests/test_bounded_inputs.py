"""Inputs that cannot exhaust the machine (issue 29): the planner at its caps, local runs against cores and GPUs."""

from __future__ import annotations

import random
import time
import types
from pathlib import Path

import pytest

from jupyter_dist.cli import main
from jupyter_dist.cli.flags import MAX_COUNT
from jupyter_dist.errors import ParallelismError
from jupyter_dist.launch.backends.local import LaunchError, check_capacity
from jupyter_dist.plan.memory import _rank_peak
from jupyter_dist.plan.pipeline import expand_runs, schedule_actions, schedule_runs, stage_bounds


# ------------------------------------------------------------------------------------------------ the planner
def _stage_bounds_by_enumeration(n_layers: int, n_stages: int, fe: float, le: float) -> list[tuple[int, int]]:
    """The split as it was computed before issue 29 (every limit enumerated, one block taken at a time)."""
    if n_stages == 1:
        return [(0, n_layers)]
    extra = [fe] + [0.0] * (n_stages - 2) + [le]

    def capacities(limit: float) -> list[int] | None:
        caps = [int(limit - e + 1e-9) for e in extra]
        return caps if min(caps) >= 1 and sum(caps) >= n_layers else None

    limits = sorted({k + e for k in range(1, n_layers + 1) for e in (0.0, fe, le)})
    caps = next(c for c in (capacities(m) for m in limits) if c is not None)
    for _ in range(sum(caps) - n_layers):
        i = max((k for k in range(n_stages) if caps[k] > 1), key=lambda k: (caps[k] + extra[k], k))
        caps[i] -= 1
    out, start = [], 0
    for c in caps:
        out.append((start, start + c))
        start += c
    return out


def test_stage_bounds_cut_as_before_on_every_small_shape() -> None:
    rng = random.Random(29)
    shapes = [(layers, stages, fe, le) for layers in range(1, 25) for stages in range(1, min(layers, 9) + 1)
              for fe in (0.0, 0.3, 1.0, 2.5, 7.0) for le in (0.0, 1 / 3, 1.0, 45.7)]  # fmt: skip
    for _ in range(150):
        layers = rng.randint(1, 150)
        fe = rng.choice([0.0, rng.random() * 5, float(rng.randint(0, 5)), rng.random() * 300])
        shapes.append((layers, rng.randint(1, min(layers, 40)), fe, rng.choice([0.0, rng.random() * 300, fe])))
    for layers, stages, fe, le in shapes:
        assert stage_bounds(layers, stages, first_extra=fe, last_extra=le) == _stage_bounds_by_enumeration(
            layers, stages, fe, le), (layers, stages, fe, le)


@pytest.mark.parametrize(("stages", "last_extra"), [(2, 0.0), (64, 3.7), (4096, 1e6), (2, 1e12), (1 << 20, 0.5)])
def test_stage_bounds_at_the_layer_cap_answer_at_once(stages: int, last_extra: float) -> None:
    t0 = time.perf_counter()
    bounds = stage_bounds(MAX_COUNT, stages, first_extra=0.25, last_extra=last_extra)
    assert time.perf_counter() - t0 < 3.0
    assert len(bounds) == stages and bounds[0][0] == 0 and bounds[-1][1] == MAX_COUNT
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(bounds, bounds[1:], strict=False))


def test_schedule_runs_expand_to_the_schedule() -> None:
    for schedule, virtuals in (("gpipe", (1,)), ("1f1b", (1,)), ("interleaved-1f1b", (1, 2, 3, 4))):
        for pp in range(1, 7):
            for m in range(1, 30):
                for v in virtuals:
                    for rank in range(pp):
                        try:
                            want = schedule_actions(schedule, pp=pp, microbatches=m, rank=rank, virtual=v)
                        except ParallelismError as exc:
                            with pytest.raises(ParallelismError, match=str(exc)[:30]):
                                schedule_runs(schedule, pp=pp, microbatches=m, rank=rank, virtual=v)
                            continue
                        got = schedule_runs(schedule, pp=pp, microbatches=m, rank=rank, virtual=v)
                        assert expand_runs(got) == want, (schedule, pp, m, v, rank)
    runs = schedule_runs("interleaved-1f1b", pp=4, microbatches=1 << 30, rank=1, virtual=8)
    assert len(runs) < 64


def _peak_one_by_one(schedule: str, pp: int, m: int, rank: int, held: list[float],
                     during: list[float]) -> tuple[float, int]:  # fmt: skip
    now, count, peak, peak_count = 0.0, 0, 0.0, 0
    for kind, stage in schedule_actions(schedule, pp=pp, microbatches=m, rank=rank, virtual=len(held) // pp):
        if kind == "F":
            now, count = now + held[stage], count + 1
            if now > peak:
                peak, peak_count = now, count
            continue
        if now - held[stage] + during[stage] > peak:
            peak, peak_count = now - held[stage] + during[stage], count
        now, count = now - held[stage], count - 1
    return peak, peak_count


def test_the_activation_peak_follows_runs_as_it_followed_actions() -> None:
    rng = random.Random(7)
    for _ in range(600):
        schedule = rng.choice(["gpipe", "1f1b", "interleaved-1f1b"])
        pp = rng.randint(2, 6)
        v = rng.randint(1, 4) if schedule == "interleaved-1f1b" else 1
        m = rng.choice([rng.randint(1, 40), rng.randint(65, 400)])
        if schedule == "interleaved-1f1b" and m % max(1, m // pp):
            continue
        held = [rng.random() * rng.choice([1.0, 1e9]) for _ in range(pp * v)]
        during = [h + rng.random() * rng.choice([0.0, 1.0, 1e9]) for h in held]
        shape = types.SimpleNamespace(pp_schedule=schedule)
        for rank in range(pp):
            want = _peak_one_by_one(schedule, pp, m, rank, held, during)
            got = _rank_peak(shape, pp, m, rank, held, during)  # type: ignore[arg-type]
            if m <= 64:  # followed one action at a time: the same floats
                assert got == want
            else:
                assert got[1] == want[1] and got[0] == pytest.approx(want[0], rel=1e-9)


M = str(MAX_COUNT)
BIG = ["--layers", M, "--hidden", "4096", "--heads", "32", "--vocab", "32000"]


@pytest.mark.parametrize("argv", [
    ["--model", "llama-2-7b", "--layers", M],
    ["--model", "llama-2-7b", "--layers", M, "--nodes", str(1 << 20)],
    [*BIG, "--nodes", str(1 << 20), "--pp", "4096"],
    [*BIG, "--nodes", str(1 << 20), "--pp", "2048", "--pp-schedule", "interleaved-1f1b", "--pp-virtual", "2"],
    [*BIG, "--gpus-per-node", "4", "--pp", "4", "--pp-schedule", "interleaved-1f1b", "--pp-virtual", "1024",
     "--global-batch", str(MAX_COUNT - 3)],
    ["--model", "llama-2-7b", "--gpus-per-node", "2", "--pp", "2", "--global-batch", M],
    ["--model", "llama-2-7b", "--gpus-per-node", "2", "--pp", "2", "--pp-schedule", "gpipe", "--grad-accum", M],
    ["--layers", M, "--hidden", M, "--heads", M, "--kv-heads", M, "--ffn", M, "--vocab", M, "--micro-batch", M,
     "--seq-len", M, "--grad-accum", M, "--nodes", str(1 << 20), "--pp-schedule", "interleaved-1f1b",
     "--pp-virtual", "1024"],
])  # fmt: skip
def test_the_planner_answers_at_the_caps_within_seconds(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.perf_counter()
    assert main(["plan", *argv]) == 0
    assert time.perf_counter() - t0 < 5.0, argv
    assert "candidate" in capsys.readouterr().out


def test_a_pipeline_too_long_to_model_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *BIG, "--nodes", str(1 << 20), "--pp", str(1 << 20)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("jupyter-dist plan: error: pp (1048576) x 1 stages per rank = 1,048,576 pipeline stages; "
                       "the planner models at most 4,096")  # fmt: skip


# ------------------------------------------------------------------------------------- local ranks vs machine
def test_capacity_rules() -> None:
    check_capacity(8, 1, gpus=0, cores=2)  # the test-suite runs 4 ranks on 2 cores: up to 8 without a flag
    check_capacity(2, 4, gpus=0, cores=2)
    check_capacity(64, 1, gpus=0, cores=16)
    check_capacity(8, 1, gpus=8, cores=2)
    check_capacity(512, 1, gpus=0, cores=2, oversubscribe=True)
    with pytest.raises(LaunchError) as e:
        check_capacity(512, 1, gpus=0, cores=2)
    assert str(e.value) == ("--nproc 512 starts 512 processes on this machine, which has 2 CPU cores (at most 8 "
                            "ranks, 4 per core); pass --oversubscribe to start them anyway")  # fmt: skip
    with pytest.raises(LaunchError) as e:
        check_capacity(8, 2, gpus=8, cores=32)
    assert str(e.value) == ("--nodes 2 x --nproc 8 starts 16 processes on this machine, which has 8 GPUs (one rank "
                            "per GPU) and 32 CPU cores; pass --oversubscribe to start them anyway")  # fmt: skip
    with pytest.raises(LaunchError) as e:
        check_capacity(512, 1024, gpus=0, cores=2, oversubscribe=True)
    assert str(e.value) == ("--nodes 1024 x --nproc 512 starts 524,288 processes on this machine; a local run "
                            "starts at most 512, even with --oversubscribe")  # fmt: skip


@pytest.fixture()
def two_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    import jupyter_dist.launch.backends.local as local
    import jupyter_dist.launch.session as session

    monkeypatch.setattr(local, "local_cores", lambda: 2)
    monkeypatch.setattr(session, "local_gpu_count", lambda: 0)


@pytest.mark.usefixtures("two_cores")
@pytest.mark.parametrize(("line", "error"), [
    ("--nodes 1024 --nproc 512", "--nodes 1024 x --nproc 512 starts 524,288 processes on this machine; a local "
                                 "run starts at most 512, even with --oversubscribe"),
    ("--nproc 512", "--nproc 512 starts 512 processes on this machine, which has 2 CPU cores (at most 8 ranks, 4 per "
                    "core); pass --oversubscribe to start them anyway"),
    ("--nodes 3 --nproc 3", "--nodes 3 x --nproc 3 starts 9 processes on this machine, which has 2 CPU cores (at "
                            "most 8 ranks, 4 per core); pass --oversubscribe to start them anyway"),
])  # fmt: skip
def test_dist_train_refuses_more_ranks_than_the_machine_holds(ip: object, runs: Path, line: str, error: str) -> None:
    from IPython.core.error import UsageError

    with pytest.raises(UsageError) as e:
        ip.run_cell_magic("dist_train", line, "pass")  # type: ignore[attr-defined]
    assert str(e.value) == error
    assert not list(runs.iterdir())  # refused before anything is written


@pytest.mark.usefixtures("two_cores")
def test_oversubscribe_lets_them_start(ip: object, runs: Path) -> None:
    dry = ip.run_cell_magic("dist_train", "--nproc 12 --oversubscribe --dry-run", "pass")  # type: ignore[attr-defined]
    assert "--nproc-per-node" in dry.argv[0] and "12" in dry.argv[0]


@pytest.mark.usefixtures("two_cores")
def test_a_dry_run_says_what_a_real_run_would_refuse(ip: object, runs: Path) -> None:
    dry = ip.run_cell_magic("dist_train", "--nodes 2 --nproc 8 --dry-run", "pass")  # type: ignore[attr-defined]
    assert ("a real run here refuses this: --nodes 2 x --nproc 8 starts 16 processes on this machine, which has 2 CPU "
            "cores (at most 8 ranks, 4 per core); pass --oversubscribe to start them anyway") in dry.notes


@pytest.mark.usefixtures("two_cores")
def test_dist_start_refuses_more_ranks_too(ip: object, runs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from IPython.core.error import UsageError

    with pytest.raises(UsageError) as e:
        ip.run_line_magic("dist_start", "--nproc 64")  # type: ignore[attr-defined]
    assert str(e.value) == ("--nproc 64 starts 64 processes on this machine, which has 2 CPU cores (at most 8 ranks, 4 "
                            "per core); pass --oversubscribe to start them anyway")  # fmt: skip
    with pytest.raises(UsageError) as e:
        ip.run_line_magic("dist_start", "--nproc 2 --env MASTER_ADDR=x")  # type: ignore[attr-defined]
    assert str(e.value).startswith("--env MASTER_ADDR: set by the launcher for each rank")
    assert not list(runs.iterdir())


@pytest.mark.usefixtures("two_cores")
def test_jupyter_dist_launch_refuses_them_and_takes_oversubscribe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("print(1)\n")
    assert main(["launch", "--nproc", "100000", "t.py"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "jupyter-dist launch: error: --nproc 100000 starts 100,000 processes on this machine; a local run starts at "
        "most 512, even with --oversubscribe"]  # fmt: skip
    assert main(["launch", "--nproc", "12", "--oversubscribe", "--dry-run", "t.py"]) == 0
    assert "--nproc-per-node 12" in capsys.readouterr().out and not (tmp_path / "runs").exists()
