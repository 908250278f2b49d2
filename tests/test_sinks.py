"""Metric sinks (``--log-to``): names and secrets checked up front, and each real library writing locally, read back.

The telemetry the forwarder follows is written by the real in-worker ``Emitter`` (one process per rank is not needed
to test the kernel side: the files are the contract). TensorBoard is read back with its own ``EventAccumulator``,
MLflow's local file store with ``MlflowClient``, Trackio's local database with its own storage reader, W&B's offline
run with its own datastore reader. wandb is an optional extra, not in the ``test`` extra: its test skips with the
reason when the library is missing (the ``test`` extra has mlflow-skinny: the SQLite-store case needs full mlflow).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from jupyter_dist.errors import JupyterDistError, MissingDependencyError
from jupyter_dist.telemetry import sinks as sinks_mod
from jupyter_dist.telemetry.emitter import Emitter, JsonlFileSink, telemetry_path
from jupyter_dist.telemetry.sinks import (
    SINKS,
    SinkContext,
    SinkError,
    SinkForwarder,
    check_sinks,
    parse_log_to,
    step_metrics,
)

STEPS = 12


def write_run(run_dir: Path, *, ranks: int = 2, steps: int = STEPS) -> dict[int, float]:
    """A run's telemetry as the ranks write it (one record per call); returns rank 0's loss per step."""
    (run_dir / "telemetry").mkdir(parents=True, exist_ok=True)
    losses: dict[int, float] = {}
    for rank in range(ranks):
        ticks = iter(float(1000 + i) for i in range(10_000))
        em = Emitter(rank=rank, sinks=[JsonlFileSink(telemetry_path(run_dir, rank))], interval_s=0.0,
                     clock=ticks.__next__)  # fmt: skip
        em.start_record(world_size=ranks, local_rank=rank, strategy="ddp")
        for step in range(steps):
            loss = 4.0 / (1 + step) + rank
            em.log({"loss": loss, "learning_rate": 1e-3 * (steps - step) / steps, "samples": 8}, step)
            if rank == 0:
                losses[step] = loss
        em.exit_record("ok")
        em.close()
    return losses


def forward(run_dir: Path, names: str, **ctx: Any) -> SinkForwarder:
    """Forward a finished run's records to ``names`` and wait until the sinks are closed."""
    context = SinkContext(run_name=run_dir.name, run_dir=run_dir, config={"strategy": "ddp", "world_size": 2}, **ctx)
    fwd = SinkForwarder(run_dir / "telemetry", parse_log_to(names), context, done=lambda: True, interval=0.05)
    fwd.start()
    assert fwd.wait(120), "the forwarder did not close its sinks"
    assert fwd.errors == {}, fwd.errors
    return fwd


def need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f'{module} is an optional extra not in the test extra: pip install "jupyter-dist[{module}]"')


# ---------------------------------------------------------------------------------------------- names and secrets
def test_parse_log_to_keeps_order_and_drops_repeats() -> None:
    assert parse_log_to("TensorBoard, wandb,tensorboard") == ("tensorboard", "wandb")
    assert parse_log_to(["mlflow", "trackio"]) == ("mlflow", "trackio")
    assert parse_log_to(None) == ()


@pytest.mark.parametrize("bad", ["tensorbord", "wandb,,mlflow", "comet"])
def test_an_unknown_sink_is_one_line_naming_the_valid_ones(bad: str) -> None:
    with pytest.raises(SinkError) as info:
        parse_log_to(bad)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("--log-to: unknown sink")
    assert "tensorboard, wandb, mlflow, trackio" in msg


def test_a_secret_must_be_set_in_the_kernel_and_its_value_is_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JD_TEST_SINK_TOKEN", raising=False)
    with pytest.raises(SinkError, match=r"--secret JD_TEST_SINK_TOKEN: not set in the kernel's environment"):
        check_sinks(["tensorboard"], ["JD_TEST_SINK_TOKEN"])
    monkeypatch.setenv("JD_TEST_SINK_TOKEN", "s3cr3t-value")
    check_sinks(["tensorboard"], ["JD_TEST_SINK_TOKEN"])  # set: accepted
    with pytest.raises(SinkError, match="not an environment variable name"):
        check_sinks([], ["WANDB-KEY"])


def test_a_missing_library_fails_before_launch_with_its_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SINKS, "wandb", ("jd_no_such_module_for_this_test", "wandb"))
    with pytest.raises(MissingDependencyError) as info:
        check_sinks(["tensorboard", "wandb"])
    assert str(info.value) == '--log-to wandb needs jd_no_such_module_for_this_test: pip install "jupyter-dist[wandb]"'
    assert isinstance(info.value, JupyterDistError)


def test_step_metrics_takes_the_numbers_of_step_records_only() -> None:
    rec = {"v": 1, "kind": "step", "rank": 0, "seq": 3, "t": 1.0, "step": 7, "n": 2, "loss": 1.5, "flag": True}
    assert step_metrics(rec) == (7, {"loss": 1.5})
    assert step_metrics({**rec, "kind": "hb"}) is None


# ---------------------------------------------------------------------------------------------- the forwarder
class Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.closed = False

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((step, metrics))

    def close(self) -> None:
        self.closed = True


class Broken(Recorder):
    name = "broken"

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise ConnectionError("tracking server unreachable\nsecond line")


def test_forwarder_follows_a_live_run_and_a_failing_sink_leaves_the_others_going(tmp_path: Path) -> None:
    run_dir = tmp_path / "run-live"
    ended = threading.Event()
    good, bad = Recorder(), Broken()
    opened = {"recorder": good, "broken": bad}
    ctx = SinkContext(run_name="run-live", run_dir=run_dir)
    fwd = SinkForwarder(run_dir / "telemetry", ["broken", "recorder"], ctx, done=ended.is_set, interval=0.05,
                        opener=lambda name, _ctx: opened[name])  # fmt: skip
    fwd.start()  # before the telemetry folder exists: it appears later
    losses = write_run(run_dir)
    ended.set()
    assert fwd.wait(30)
    assert [s for s, _ in good.logged] == list(range(STEPS))  # rank 0 only, every step, in order
    assert [m["loss"] for _, m in good.logged] == pytest.approx([losses[s] for s in range(STEPS)])
    assert good.closed and bad.closed
    assert fwd.errors == {"broken": "ConnectionError: tracking server unreachable"}
    assert fwd.forwarded == STEPS and "off: broken" in fwd.describe()


def test_a_slow_tracking_service_never_blocks_the_caller(tmp_path: Path) -> None:
    """Opening (a W&B login) and logging happen on the forwarder's thread: start() returns at once."""
    import time

    write_run(tmp_path / "r")
    release = threading.Event()
    rec = Recorder()

    def opener(name: str, ctx: SinkContext) -> Any:
        release.wait(30)
        return rec

    fwd = SinkForwarder(tmp_path / "r" / "telemetry", ["recorder"], SinkContext(run_name="r", run_dir=tmp_path / "r"),
                        done=lambda: True, interval=0.05, opener=opener)  # fmt: skip
    t0 = time.perf_counter()
    fwd.start()
    assert time.perf_counter() - t0 < 2.0 and not fwd.finished.is_set()  # the opener blocks for up to 30 s
    release.set()
    assert fwd.wait(10) and len(rec.logged) == STEPS


def test_a_sink_that_cannot_open_is_reported_and_the_forwarder_still_ends(tmp_path: Path) -> None:
    write_run(tmp_path / "r")

    def opener(name: str, ctx: SinkContext) -> Any:
        raise RuntimeError("wandb login required")

    fwd = SinkForwarder(tmp_path / "r" / "telemetry", ["wandb"], SinkContext(run_name="r", run_dir=tmp_path / "r"),
                        done=lambda: True, interval=0.05, opener=opener)  # fmt: skip
    fwd.start()
    assert fwd.wait(10) and fwd.errors == {"wandb": "RuntimeError: wandb login required"}


# ---------------------------------------------------------------------------------------------- real libraries
def test_tensorboard_event_files_read_back_with_tensorboards_own_reader(tmp_path: Path) -> None:
    need("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "tb-run"
    losses = write_run(run_dir)
    forward(run_dir, "tensorboard")
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert {"loss", "learning_rate", "samples"} <= set(acc.Tags()["scalars"])
    events = acc.Scalars("loss")
    assert [e.step for e in events] == list(range(STEPS))
    assert [e.value for e in events] == pytest.approx([losses[s] for s in range(STEPS)], rel=1e-6)


@pytest.mark.parametrize("store", ["file", "sqlite"])
def test_mlflow_local_store_read_back_with_mlflows_client(store: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The local file store (kept in MLflow 3 behind MLFLOW_ALLOW_FILE_STORE) and the SQLite store it recommends."""
    need("mlflow")
    from mlflow.tracking import MlflowClient

    if store == "file":
        uri = (tmp_path / "mlruns").as_uri()
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    else:
        for module in ("sqlalchemy", "alembic"):
            if importlib.util.find_spec(module) is None:
                pytest.skip(f"MLflow's SQLite store needs {module} (full mlflow; the test extra has mlflow-skinny)")
        uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "jd-sinks-test")
    run_dir = tmp_path / "mlflow-run"
    losses = write_run(run_dir)
    fwd = forward(run_dir, "mlflow")
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("jd-sinks-test")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "mlflow-run" and run.info.status == "FINISHED"
    assert run.data.params == {"strategy": "ddp", "world_size": "2"}
    history = client.get_metric_history(run.info.run_id, "loss")
    assert {m.step: m.value for m in history} == pytest.approx(losses) and len(history) == STEPS
    assert fwd.sinks[0].run_id == run.info.run_id


def test_trackio_local_database_read_back_with_trackios_storage(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    need("trackio")
    import sys

    if "trackio" in sys.modules:
        pytest.skip("trackio was imported before this test: TRACKIO_DIR is read once, at import")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    monkeypatch.setenv("TRACKIO_PROJECT", "jd-sinks-test")
    run_dir = tmp_path / "trackio-run"
    losses = write_run(run_dir)
    forward(run_dir, "trackio")
    from trackio.sqlite_storage import SQLiteStorage

    assert list((tmp_path / "trackio").glob("*.db")), "trackio wrote no local database"
    logs = SQLiteStorage.get_logs("jd-sinks-test", "trackio-run")
    got = {int(row["step"]): float(row["loss"]) for row in logs if "loss" in row}
    assert got == pytest.approx(losses)


def test_wandb_offline_run_read_back_from_its_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    need("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "jd-sinks-test")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run_dir = tmp_path / "wandb-run"
    losses = write_run(run_dir)
    forward(run_dir, "wandb")
    (offline,) = list((run_dir / "sinks" / "wandb").glob("offline-run-*"))  # what `wandb sync` uploads later
    (data,) = list(offline.glob("run-*.wandb"))
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    def scan() -> tuple[dict[int, float], bool]:
        ds = datastore.DataStore()
        ds.open_for_scan(str(data))
        history: dict[int, float] = {}
        ended = False
        while (raw := ds.scan_data()) is not None:
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(raw)
            kind = rec.WhichOneof("record_type")
            ended |= kind == "exit"
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                if "loss" in items:
                    history[int(items["_step"])] = float(items["loss"])
        return history, ended

    # run.finish() returns once W&B's service has the records; its writer puts them in the offline file a moment
    # later (measured: the file held only its 7-byte header right after finish() in 3 of 10 runs, all of it 0.5 s
    # later). So wait for the run's exit record, then compare.
    deadline = time.monotonic() + 30
    history, ended = scan()
    while not ended and time.monotonic() < deadline:
        time.sleep(0.2)
        history, ended = scan()
    assert ended, f"W&B never wrote the run's exit record to {data}"
    assert history == pytest.approx(losses)


def test_non_finite_losses_are_kept_for_the_sinks(tmp_path: Path) -> None:
    run_dir = tmp_path / "nan-run"
    (run_dir / "telemetry").mkdir(parents=True)
    em = Emitter(rank=0, sinks=[JsonlFileSink(telemetry_path(run_dir, 0))], interval_s=0.0)
    em.log({"loss": float("nan"), "grad_norm": float("inf")}, 0)
    em.close()
    rec = Recorder()
    fwd = SinkForwarder(run_dir / "telemetry", ["recorder"], SinkContext(run_name="n", run_dir=run_dir),
                        done=lambda: True, interval=0.05, opener=lambda n, c: rec)  # fmt: skip
    fwd.start()
    assert fwd.wait(10)
    ((step, metrics),) = rec.logged
    assert step == 0 and math.isnan(metrics["loss"]) and "grad_norm" not in metrics  # a NaN loss is the signal


def test_module_names_every_sink_it_builds() -> None:
    assert set(sinks_mod._CLASSES) == set(SINKS) == {"tensorboard", "wandb", "mlflow", "trackio"}
    assert os.environ.get("JD_RUN_DIR") is None  # the kernel side: never a launched worker


# ---------------------------------------------------------------------------------------------- CLI and Run
def recorded_run_dir(tmp_path: Path, status: str = "succeeded") -> tuple[Path, dict[int, float]]:
    from jupyter_dist.launch.rundir import RunDir

    rd = RunDir(tmp_path / "cli-run").create()
    rd.write_meta({"name": "cli-run", "status": status, "world_size": 2, "strategy": "ddp"})
    return rd.path, write_run(rd.path)


def test_cli_log_to_forwards_a_recorded_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    need("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from jupyter_dist.cli import main

    path, losses = recorded_run_dir(tmp_path)
    assert main(["log-to", str(path), "tensorboard"]) == 0
    assert capsys.readouterr().out.strip() == f"cli-run: metrics -> tensorboard ({STEPS} step records)"
    acc = EventAccumulator(str(path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx([losses[s] for s in range(STEPS)])
    assert json.loads((path / "run.json").read_text())["log_to"] == ["tensorboard"]


def test_cli_log_to_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from jupyter_dist.cli import main

    path, _ = recorded_run_dir(tmp_path)
    assert main(["log-to", str(path), "tensorboard,neptune"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("jupyter-dist log-to: error: --log-to: unknown sink 'neptune'; valid: tensorboard, wandb, mlflow, "
                   "trackio (comma-separated)")  # fmt: skip
    assert main(["log-to", str(tmp_path / "nowhere"), "tensorboard"]) == 2
    assert "is not a jupyter-dist run directory" in capsys.readouterr().err


def test_run_log_to_refuses_a_second_forwarder_while_one_runs(tmp_path: Path) -> None:
    need("tensorboard")
    from jupyter_dist.launch.run import open_run

    path, _ = recorded_run_dir(tmp_path, status="running")  # no pids: the run never ends by itself here
    run = open_run(path)
    try:
        fwd = run.log_to("tensorboard", interval=0.05)
        with pytest.raises(JupyterDistError, match="already forwards its metrics"):
            run.log_to("tensorboard")
        with pytest.raises(JupyterDistError, match="name at least one sink"):
            run.log_to([])
    finally:
        run.sinks.stop()
    assert fwd.finished.is_set() and fwd.forwarded == STEPS
