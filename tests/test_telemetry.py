"""Telemetry in the worker (coalesced step records, phases, memory, NVML) and the reader that follows it."""

from __future__ import annotations

import json
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest

from jupyter_dist.telemetry import records
from jupyter_dist.telemetry.emitter import Emitter, JsonlFileSink, Nvml, cuda_index, telemetry_path
from jupyter_dist.telemetry.health import hb_state
from jupyter_dist.telemetry.reader import Dedup, FileFollower, RecordSet, TelemetryReader, read_run_records


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def raw_records(folder: Path, rank: int) -> list[dict[str, Any]]:
    """The records as written (a ``steps`` batch is one record)."""
    lines = Path(telemetry_path(folder, rank)).read_text().splitlines()
    return [r for r in map(records.decode, lines) if r is not None]


def file_records(folder: Path, rank: int) -> list[dict[str, Any]]:
    """The records as readers see them (one ``step`` record per ``jd.log`` call)."""
    out: list[dict[str, Any]] = []
    for rec in raw_records(folder, rank):
        out.extend(records.expand_steps(rec) if rec["kind"] == "steps" else [rec])
    return out


def emitter(tmp_path: Path, clock: FakeClock, interval: float = 1.0, rank: int = 0) -> Emitter:
    return Emitter(rank=rank, sinks=[JsonlFileSink(telemetry_path(tmp_path, rank))], clock=clock, interval_s=interval)


# --------------------------------------------------------------------------- lossless step records
def test_every_call_is_kept_with_its_own_value_and_only_the_write_is_batched(tmp_path: Path) -> None:
    clock = FakeClock()
    em = emitter(tmp_path, clock)
    first = em.log({"loss": 4.0, "tokens": 512}, step=0)  # the first call writes at once
    assert first is not None and first["kind"] == "steps" and first["count"] == 1 and first["prev"] is None
    assert records.steps_columns(first)[0] == [0]
    for step in range(1, 11):  # ten steps, 0.1 s apart: one write after 1 s, holding all ten
        clock.t += 0.1
        out = em.log({"loss": 4.0 - step * 0.1, "tokens": 512}, step=step)
        assert (out is None) == (step < 10), step
    assert out is not None and records.steps_columns(out)[0] == list(range(1, 11)) and out["prev"] == [1000.0, 0]
    em.close()
    raw = raw_records(tmp_path, 0)
    assert [r["count"] for r in raw if r["kind"] == "steps"] == [1, 10]
    steps = [r for r in file_records(tmp_path, 0) if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(11))
    assert [r["loss"] for r in steps] == [4.0] + [4.0 - s * 0.1 for s in range(1, 11)]  # exactly what was logged
    assert [r["t"] for r in steps] == pytest.approx([1000.0 + 0.1 * s for s in range(11)])
    assert "step_time" not in steps[0]
    assert all(r["step_time"] == pytest.approx(0.1) for r in steps[1:])  # across the batch boundary too
    assert all(r["tokens_per_s"] == pytest.approx(5120.0) for r in steps[1:])


def test_interval_zero_writes_every_call_and_sparse_metrics_stay_absent(tmp_path: Path) -> None:
    clock = FakeClock()
    em = emitter(tmp_path, clock, interval=0)
    em.log({"loss": 1.0}, step=0)
    clock.t += 2.0
    rec = em.log({"loss": 0.5, "samples": 40}, step=10)  # jd.log every 10 steps
    assert rec is not None and records.steps_columns(rec)[0] == [10]
    em.log({"eval_loss": 0.7}, step=10)
    em.close()
    steps = [r for r in file_records(tmp_path, 0) if r["kind"] == "step"]
    assert steps[1]["step_time"] == pytest.approx(0.2) and steps[1]["samples_per_s"] == pytest.approx(20)
    assert "eval_loss" not in steps[1] and steps[2]["eval_loss"] == 0.7 and "loss" not in steps[2]


def test_a_batch_keeps_sparse_metrics_as_null_and_non_finite_values_by_name(tmp_path: Path) -> None:
    clock = FakeClock()
    em = emitter(tmp_path, clock)
    em.log({"loss": 1.0}, step=0)
    for step, values in ((1, {"loss": float("nan")}), (2, {"loss": float("inf"), "eval": 3.0}), (3, {"loss": 0.25})):
        clock.t += 0.1
        em.log(values, step=step)
    em.close()
    raw = [r for r in raw_records(tmp_path, 0) if r["kind"] == "steps"][1]
    assert raw["at"] == {"eval": [1]}  # only the calls that logged it
    cols = records.steps_columns(raw)[2]
    assert cols["loss"][0] != cols["loss"][0] and cols["loss"][1:] == [float("inf"), 0.25]
    assert cols["eval"] == [None, 3.0, None]
    steps = [r for r in file_records(tmp_path, 0) if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    assert steps[1]["loss"] != steps[1]["loss"] and steps[2]["loss"] == float("inf") and steps[3]["loss"] == 0.25
    assert [r.get("eval") for r in steps] == [None, None, 3.0, None]


def test_user_metrics_named_like_derived_ones_win_and_n_is_reserved(tmp_path: Path) -> None:
    clock = FakeClock()
    em = emitter(tmp_path, clock, interval=0)
    em.log({"loss": 1.0}, step=0)
    clock.t += 1.0
    em.log({"step_time": 9.0}, step=1)
    em.close()
    assert file_records(tmp_path, 0)[-1]["step_time"] == 9.0
    with pytest.raises(ValueError, match="reserved"):
        em.log({"n": 3}, step=2)


def test_a_batch_is_written_at_max_batch_calls_even_within_the_interval(tmp_path: Path) -> None:
    clock = FakeClock()
    em = emitter(tmp_path, clock, interval=3600.0)
    em.log({"loss": 0.0}, step=0)
    for step in range(1, records.MAX_BATCH + 5):
        em.log({"loss": float(step)}, step=step)
    assert em.pending == 4
    em.close()
    sizes = [r["count"] for r in raw_records(tmp_path, 0) if r["kind"] == "steps"]
    assert sizes == [1, records.MAX_BATCH, 4]
    assert [r["loss"] for r in file_records(tmp_path, 0) if r["kind"] == "step"] == [
        float(s) for s in range(records.MAX_BATCH + 5)
    ]


def test_a_pending_batch_is_written_by_the_monitor_tick_flush_and_close(tmp_path: Path) -> None:
    clock = FakeClock()
    em = emitter(tmp_path, clock)
    em.log({"loss": 3.0}, step=0)
    clock.t += 0.2
    assert em.log({"loss": 2.0}, step=1) is None
    em.tick()  # too young for the monitor
    assert [r["kind"] for r in file_records(tmp_path, 0)].count("step") == 1
    clock.t += 1.0
    em.tick()  # stale now: the monitor writes it
    steps = [r for r in file_records(tmp_path, 0) if r["kind"] == "step"]
    assert [(r["step"], r["loss"]) for r in steps] == [(0, 3.0), (1, 2.0)]
    clock.t += 0.1
    em.log({"loss": 1.0}, step=2)
    em.exit_record("ok")  # exit flushes first, so the last steps are never lost
    kinds = [r["kind"] for r in file_records(tmp_path, 0)]
    assert kinds[-2:] == ["step", "exit"]
    em.close()


def test_exit_on_cuda_writes_a_last_mem_record_with_the_runs_peak(tmp_path: Path) -> None:
    """A run on a GPU ends with a mem record before exit (on an H200 a 12-step run had only its first record, taken
    before any allocation: peak 0); without CUDA the exit stays the last word after the steps."""
    clock = FakeClock()
    em = emitter(tmp_path, clock)
    em.cuda_device = 0  # what the worker sets when it uses CUDA (here the fields fall back to RSS: no CUDA)
    em.log({"loss": 1.0}, step=0)
    em.exit_record("ok")
    recs = file_records(tmp_path, 0)
    assert [r["kind"] for r in recs][-3:] == ["step", "mem", "exit"]
    assert recs[-2]["max_rss"] > 0
    em.close()


def test_the_exit_record_stays_the_last_even_when_the_monitor_ticks_after_it(tmp_path: Path) -> None:
    """A SIGTERMed rank writes ``exit`` then closes; a monitor round between the two wrote a ``mem`` after the exit
    (CI, test_worker.py: rank 0's last record was ``mem``). After ``exit`` nothing more is written."""
    clock = FakeClock()
    em = emitter(tmp_path, clock)
    em.log({"loss": 1.0}, step=0)
    em.exit_record("terminated", signal="SIGTERM")
    clock.t += 5.0
    em.tick()  # a round already past its wait when the exit came
    em.log({"loss": 0.5}, step=1)
    em.flush()
    kinds = [r["kind"] for r in file_records(tmp_path, 0)]
    assert kinds[-2:] == ["step", "exit"] and kinds.count("exit") == 1
    assert em._stop.is_set()  # and the monitor's loop ends at its next wait
    em.close()


class CountingTensor:
    """Stands in for a one-element tensor: counts .item() calls (each would be a GPU sync)."""

    items = 0

    def __init__(self, value: float) -> None:
        self.value = value
        self.shape = ()

    def numel(self) -> int:
        return 1

    def detach(self) -> CountingTensor:
        return self

    def __add__(self, other: CountingTensor) -> CountingTensor:
        return CountingTensor(self.value + other.value)

    def item(self) -> float:
        CountingTensor.items += 1
        return self.value


def test_real_tensor_metrics_are_read_once_per_batch_each_value_exact() -> None:
    torch = pytest.importorskip("torch")
    clock = FakeClock()
    sink = types.SimpleNamespace(lines=[], write_line=lambda line: sink.lines.append(line), close=lambda: None)
    em = Emitter(rank=0, sinks=[sink], clock=clock, interval_s=1.0)
    values = [torch.tensor(1.0 / (k + 3), dtype=torch.bfloat16) for k in range(40)]
    calls = {"n": 0}
    real_tolist = torch.Tensor.tolist

    def counting_tolist(self: Any) -> Any:
        calls["n"] += 1
        return real_tolist(self)

    torch.Tensor.tolist = counting_tolist  # type: ignore[method-assign]
    try:
        for step, v in enumerate(values):
            clock.t += 0.01
            em.log({"loss": v, "lr": 1e-3}, step=step)
        em.close()
    finally:
        torch.Tensor.tolist = real_tolist  # type: ignore[method-assign]
    batches = [records.decode(line) for line in sink.lines]
    assert len(batches) == 2 and calls["n"] == 1  # the first call (.item()), then a batch of 39 in one .tolist()
    logged = [x for b in batches for x in records.steps_columns(b)[2]["loss"]]  # type: ignore[arg-type]
    assert logged == [v.item() for v in values]  # each bf16 value exactly, not a mean


def test_mixed_dtype_tensors_in_one_batch_are_each_converted() -> None:
    torch = pytest.importorskip("torch")
    from jupyter_dist.telemetry.emitter import _tensor_values

    vals = [torch.tensor(0.1), torch.tensor(0.3, dtype=torch.float64), torch.tensor(0.7, dtype=torch.bfloat16),
            CountingTensor(2.5)]  # fmt: skip
    assert _tensor_values(vals) == [torch.tensor(0.1).item(), 0.3, torch.tensor(0.7, dtype=torch.bfloat16).item(), 2.5]


def test_real_tensors_are_summed_on_their_device() -> None:
    torch = pytest.importorskip("torch")
    step, checked = records.check_metrics(torch.tensor(3), {"loss": torch.tensor(0.5, requires_grad=True) * 2})
    assert step == 3 and isinstance(checked["loss"], torch.Tensor) and not checked["loss"].requires_grad
    with pytest.raises(TypeError, match="shape"):
        records.check_metrics(0, {"vec": torch.ones(3)})


# --------------------------------------------------------------------------- hb, mem, gpu, error
def test_heartbeats_report_the_phase_and_time_in_it(tmp_path: Path) -> None:
    clock = FakeClock()
    em = emitter(tmp_path, clock)
    em.set_phase("backward")
    clock.t += 2.5
    hb = em.heartbeat()
    assert hb is not None and hb["phase"] == "backward" and hb["phase_s"] == pytest.approx(2.5)
    em.set_phase("backward")  # same phase: the clock is not reset
    clock.t += 1.0
    assert em.heartbeat()["phase_s"] == pytest.approx(3.5)  # type: ignore[index]
    em.close()


def test_heartbeats_keep_coming_while_the_main_thread_is_blocked(tmp_path: Path) -> None:
    em = Emitter.for_run_dir(tmp_path, rank=0)
    em.set_phase("backward")
    em.start_monitor(0.05)
    block = threading.Event()
    block.wait(0.5)  # the main thread "inside a collective"
    em.close()
    beats = [r for r in file_records(tmp_path, 0) if r["kind"] == "hb"]
    mems = [r for r in file_records(tmp_path, 0) if r["kind"] == "mem"]
    assert len(beats) >= 4 and all(b["phase"] == "backward" for b in beats)
    assert len(mems) == len(beats) and mems[0]["rss"] > 0


def test_error_records_carry_the_traceback_tail(tmp_path: Path) -> None:
    em = emitter(tmp_path, FakeClock())
    try:
        raise KeyError("batch 7")
    except KeyError as exc:
        import traceback

        em.error_record(exc, "".join(traceback.format_exception(exc, limit=-30)))
    em.close()
    (rec,) = [r for r in file_records(tmp_path, 0) if r["kind"] == "error"]
    assert rec["error_type"] == "KeyError" and "batch 7" in rec["error"]
    assert 'raise KeyError("batch 7")' in rec["traceback"]


def test_cuda_visible_devices_map_to_nvml_devices() -> None:
    assert cuda_index(1, None) == 1
    assert cuda_index(1, "4,6") == 6
    assert cuda_index(0, "GPU-1a2b, GPU-3c4d") == "GPU-1a2b"
    assert cuda_index(3, "0,1") == 3  # out of range: as is


def test_nvml_fields_at_the_library_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML cannot run without a GPU: a fake ``pynvml`` module answers what the real one returns."""
    calls: list[Any] = []
    fake = types.ModuleType("pynvml")
    fake.NVML_TEMPERATURE_GPU = 0  # type: ignore[attr-defined]
    fake.nvmlInit = lambda: calls.append("init")  # type: ignore[attr-defined]
    fake.nvmlDeviceGetHandleByIndex = lambda i: calls.append(("handle", i)) or f"h{i}"  # type: ignore[attr-defined]
    fake.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=87, memory=41)  # type: ignore[attr-defined]
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=60 << 30, total=80 << 30)  # type: ignore[attr-defined]
    fake.nvmlDeviceGetPowerUsage = lambda h: 612_000  # type: ignore[attr-defined]  # milliwatts
    fake.nvmlDeviceGetTemperature = lambda h, kind: 71  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    nv = Nvml(6)
    got = nv.fields()
    assert got == {"index": 6, "util": 87.0, "mem_util": 41.0, "mem_used": 60 << 30, "mem_total": 80 << 30,
                   "power_w": 612.0, "temp_c": 71.0}  # fmt: skip
    nv.fields()
    assert calls == ["init", ("handle", 6)]  # opened once
    fake.nvmlDeviceGetUtilizationRates = lambda h: (_ for _ in ()).throw(RuntimeError("GPU is lost"))  # type: ignore[attr-defined]
    assert nv.fields() is None and nv.disabled  # a failing device stops gpu records, never training


def test_without_pynvml_there_are_no_gpu_records(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    nv = Nvml(0)
    assert nv.fields() is None and nv.disabled


@pytest.mark.parametrize(("age", "state"), [(0.5, "ok"), (4.0, "ok"), (9.0, "slow"), (25.0, "suspect"), (31.0, "hung")])
def test_heartbeat_states(age: float, state: str) -> None:
    assert hb_state(age, 2.0) == state
    assert hb_state(age, 2.0, exited=True) == "exited"
    assert hb_state(age, 2.0, alive=False) == "dead"


# --------------------------------------------------------------------------- reader
def line(kind: str, rank: int, seq: int, **fields: Any) -> str:
    return records.encode(records.make_record(kind, rank=rank, seq=seq, t=100.0 + seq, **fields))


def test_follower_holds_back_a_torn_last_line_until_it_is_complete(tmp_path: Path) -> None:
    f = tmp_path / "rank-0.jsonl"
    full = line("step", 0, 0, step=0, loss=1.0)
    f.write_text(full[:20])
    follower = FileFollower(tmp_path)
    assert follower.poll() == [] and follower.pending_bytes == 20
    with f.open("a") as fh:
        fh.write(full[20:] + "\n" + line("step", 0, 1, step=1, loss=0.5)[:5])
    assert follower.poll() == [full]
    assert follower.poll() == []


def test_follower_picks_up_a_file_that_appears_late_and_one_that_is_replaced(tmp_path: Path) -> None:
    follower = FileFollower(tmp_path / "telemetry")
    assert follower.poll() == []  # the folder does not exist yet
    (tmp_path / "telemetry").mkdir()
    (tmp_path / "telemetry" / "rank-1.jsonl").write_text(line("hb", 1, 0, step=None) + "\n")
    assert len(follower.poll()) == 1
    (tmp_path / "telemetry" / "rank-0.jsonl").write_text(line("hb", 0, 0, step=None) + "\n")
    (tmp_path / "telemetry" / "rank-1.jsonl").write_text("")  # truncated: start again
    assert len(follower.poll()) == 1
    (tmp_path / "telemetry" / "rank-1.jsonl").write_text(line("hb", 1, 5, step=None) + "\n")
    assert [json.loads(x)["seq"] for x in follower.poll()] == [5]


def test_record_set_counts_torn_foreign_and_duplicate_lines() -> None:
    rs = RecordSet()
    good = [line("step", 0, 0, step=0, loss=1.0), line("step", 1, 0, step=0, loss=2.0)]
    added = rs.add_lines(good + good[:1] + ['{"v":1,"kind":"st', "Traceback (most recent call last):", "", "{}"])
    assert added == 2 and rs.duplicates == 1 and rs.bad_lines == 3


def test_dedup_memory_is_bounded_and_still_rejects_old_pairs() -> None:
    d = Dedup(window=100)
    assert all(d.first_time(0, s) for s in range(10_000))
    assert sum(len(v) for v in d._seen.values()) <= 201
    assert not d.first_time(0, 5) and not d.first_time(0, 9_999) and d.first_time(0, 10_000) and d.first_time(1, 5)


def test_reader_merges_files_and_a_prefixed_log_stream_without_duplicates(tmp_path: Path) -> None:
    tele = tmp_path / "telemetry"
    tele.mkdir()
    lines0 = [line("step", 0, s, step=s, loss=1.0 / (s + 1)) for s in range(5)]
    (tele / "rank-0.jsonl").write_text("\n".join(lines0) + "\n")
    reader = TelemetryReader(tele, maxlen=3)
    got: list[list[dict[str, Any]]] = []
    reader.add_listener(got.append)
    reader.add_listener(lambda recs: 1 / 0)  # a broken listener is counted, not fatal
    assert len(reader.poll()) == 5
    # the same records arrive again through SkyPilot-style prefixed log lines, plus other output
    reader.feed([f"(head, rank=0, pid=77) {records.SENTINEL}{x}" for x in lines0[3:]])
    reader.feed(["(head, rank=0, pid=77) epoch 1 done", f"(worker1, rank=1, pid=9) {records.SENTINEL}" + line(
        "step", 1, 0, step=0, loss=3.0)])  # fmt: skip
    new = reader.poll()
    assert [(r["rank"], r["seq"]) for r in new] == [(1, 0)]
    assert reader.duplicates == 2 and reader.bad_lines == 0 and reader.listener_errors == 2
    assert [r["seq"] for r in reader.buffers["step"]] == [3, 4, 0]  # ring buffer of 3
    assert reader.latest[("step", 1)]["loss"] == 3.0 and len(got) == 2


def test_reader_thread_follows_a_growing_file_and_stops_cleanly(tmp_path: Path) -> None:
    tele = tmp_path / "telemetry"
    reader = TelemetryReader(tele, interval=0.02).start()
    seen: list[int] = []
    reader.add_listener(lambda recs: seen.extend(r["seq"] for r in recs))
    tele.mkdir()
    with (tele / "rank-0.jsonl").open("a") as fh:
        for s in range(20):
            fh.write(line("step", 0, s, step=s, loss=1.0) + "\n")
            fh.flush()
            time.sleep(0.005)
    deadline = time.monotonic() + 10
    while len(seen) < 20 and time.monotonic() < deadline:
        time.sleep(0.02)
    reader.stop()
    assert seen == list(range(20)) and not reader.running


def test_read_run_records_of_a_worker_that_was_killed_mid_write(tmp_path: Path) -> None:
    em = Emitter.for_run_dir(tmp_path, rank=0, interval_s=0)
    em.log({"loss": 1.0}, step=0)
    em.close()
    with open(telemetry_path(tmp_path, 0), "a") as fh:
        fh.write('{"v":1,"kind":"step","rank":0,"seq":1,"t":1.0,"st')
    rs = read_run_records(Path(tmp_path) / "telemetry")
    assert [r["seq"] for r in rs.records] == [0] and rs.bad_lines == 0  # the incomplete line is not read yet


# --------------------------------------------------------------------------- collective timings
def test_collective_wrappers_time_blocking_and_async_calls() -> None:
    from concurrent.futures import Future

    from jupyter_dist.worker._comm import CommStats, install_collective_timers

    class Work:
        def __init__(self) -> None:
            self.fut: Future[None] = Future()

        def get_future(self) -> Future[None]:
            return self.fut

    works: list[Work] = []
    fake = types.SimpleNamespace(
        all_reduce=lambda t, async_op=False: (
            (time.sleep(0.05), None)[1] if not async_op else works.append(Work()) or works[-1]
        ),
        barrier=lambda: time.sleep(0.02),
    )  # stands in for torch.distributed: only its call shapes matter here
    stats = CommStats()
    assert sorted(install_collective_timers(fake, stats)) == ["all_reduce", "barrier"]
    assert install_collective_timers(fake, stats) == []  # idempotent

    class T:
        def numel(self) -> int:
            return 1000

        def element_size(self) -> int:
            return 4

    fake.all_reduce(T())
    fake.barrier()
    work = fake.all_reduce(T(), async_op=True)
    assert stats.take()["ops"].keys() == {"all_reduce", "barrier"}  # type: ignore[index]
    time.sleep(0.03)
    work.fut.set_result(None)  # the async all-reduce completes 30 ms after it was issued
    got = stats.take()
    assert got is not None and got["issued"] == 3 and got["count"] == 1 and got["bytes"] == 4000
    assert got["seconds"] >= 0.03 and stats.take() is None


def test_collective_timers_count_fsdp2s_calls_and_follow_a_fresh_runtime() -> None:
    """FSDP2 (torch 2.13) gathers with ``all_gather_single`` and reduce-scatters with ``reduce_scatter_single``: both
    are timed (they were not, so an FSDP2 run's comm records missed its gradient reductions). Installing again (a
    fresh runtime in the same process) keeps one wrapper, which reports to the new stats from then on."""
    import torch.distributed as dist

    from jupyter_dist.worker._comm import COLLECTIVES, CommStats, install_collective_timers

    assert {"all_gather_single", "reduce_scatter_single"} <= set(COLLECTIVES)
    assert all(callable(getattr(dist, name, None)) for name in ("all_gather_single", "reduce_scatter_single"))

    class T:
        def numel(self) -> int:
            return 8

        def element_size(self) -> int:
            return 4

    fake = types.SimpleNamespace(all_gather_single=lambda output, input, **kw: None,
                                 reduce_scatter_single=lambda output, input, **kw: None)  # fmt: skip
    first, second = CommStats(), CommStats()
    assert sorted(install_collective_timers(fake, first)) == ["all_gather_single", "reduce_scatter_single"]
    fake.reduce_scatter_single(output=T(), input=T(), op=None)
    wrapper = fake.all_gather_single
    assert install_collective_timers(fake, second) == [] and fake.all_gather_single is wrapper
    fake.all_gather_single(T(), T())
    assert first.take()["ops"] == {"reduce_scatter_single": {"count": 1, "seconds": pytest.approx(0, abs=0.1),
                                                             "bytes": 32}}  # fmt: skip
    assert second.take()["ops"].keys() == {"all_gather_single"}  # type: ignore[index]


def test_comm_timing_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from jupyter_dist.worker._comm import enabled

    monkeypatch.setenv("JD_COMM_TIMING", "0")
    assert not enabled()
    monkeypatch.setenv("JD_COMM_TIMING", "1")
    assert enabled()
