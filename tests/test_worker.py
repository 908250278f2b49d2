"""The in-worker side of %%dist_train: jupyter_dist.worker and the telemetry emitter/records.

Fast tests run in this process or a bare interpreter. The slow ones start real 2-process torchrun jobs on gloo/CPU
(DDP, FSDP2, DeepSpeed ZeRO-2) with the JD_* environment the launcher sets, and read back what the workers wrote
into the run directory: telemetry, logs, checkpoints and a result file per rank.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from jupyter_dist.telemetry import records
from jupyter_dist.telemetry.emitter import Emitter, JsonlFileSink, StreamSink, telemetry_path
from jupyter_dist.worker import Runtime, WorkerEnv, WorkerError

ROOT = Path(__file__).resolve().parents[1]
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


# --------------------------------------------------------------------------- helpers
def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launch or JD_* variables, single-threaded math, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCH_VARS and not k.startswith(("JD_", "TORCHELASTIC_", "PET_"))
    }
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), JD_HEARTBEAT_S="0", JD_TELEMETRY_INTERVAL_S="0")
    env.update(extra)
    return env


def run_bounded(argv: list[str], env: dict[str, str], timeout: float, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in its own session; on timeout (or any failure here) kill the whole process group."""
    proc = subprocess.Popen(
        argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        if isinstance(sys.exc_info()[1], subprocess.TimeoutExpired):
            pytest.fail(f"{argv[-1]} did not finish within {timeout} s; output:\n{out[-4000:]}")
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


def torchrun(script: Path, run_dir: Path, timeout: float = 150, **env: str) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node 2 script`` with the launcher's JD_* contract."""
    run_dir.mkdir(exist_ok=True)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    full = clean_env(JD_RUN_DIR=str(run_dir), JD_LOG_STDIO="1", **env)
    return run_bounded(argv, full, timeout, cwd=script.parent)


def explain(proc: subprocess.CompletedProcess[str], run_dir: Path) -> str:
    """Output and rank logs, for assertion messages."""
    parts = [f"rc={proc.returncode}", proc.stdout[-3000:]]
    for log in sorted((run_dir / "logs").glob("rank-*.log")):
        parts.append(f"--- {log.name}\n{log.read_text()[-3000:]}")
    return "\n".join(parts)


def read_records(run_dir: Path, rank: int, *, raw: bool = False) -> list[dict]:
    """A rank's records as readers see them (a ``steps`` batch as one ``step`` record per call), or as written."""
    lines = Path(telemetry_path(run_dir, rank)).read_text().splitlines()
    recs = [records.decode(line) for line in lines]
    assert all(r is not None for r in recs), lines
    if raw:
        return recs  # type: ignore[return-value]
    return [x for r in recs for x in (records.expand_steps(r) if r["kind"] == "steps" else [r])]  # type: ignore[index]


def check_telemetry(run_dir: Path, rank: int, steps: list[int]) -> list[dict]:
    recs = read_records(run_dir, rank)
    seqs = [r["seq"] for r in recs]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), seqs
    assert all(r["v"] == records.SCHEMA_VERSION and r["rank"] == rank for r in recs)
    step_recs = [r for r in recs if r["kind"] == "step"]
    assert [r["step"] for r in step_recs] == steps
    assert all(isinstance(r["loss"], float) for r in step_recs)
    assert recs[0]["kind"] == "start" and recs[0]["world_size"] == 2 and recs[0]["backend"] == "gloo"
    assert recs[-1]["kind"] == "exit" and recs[-1]["status"] == "ok"
    return recs


def tiny_env(tmp_path: Path, **kw: object) -> WorkerEnv:
    return WorkerEnv(distributed=False, run_dir=str(tmp_path), heartbeat_s=0, **kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- import contract
def test_import_loads_nothing_heavy_and_is_rank_0_of_1_outside_torchrun() -> None:
    code = textwrap.dedent(
        """
        import json, sys
        import jupyter_dist.worker as jd
        heavy = ("torch", "IPython", "ipywidgets", "plotly", "numpy", "deepspeed")
        after_import = sorted(k for k in sys.modules if k.split(".")[0] in heavy)
        ident = [jd.rank, jd.world_size, jd.local_rank, jd.is_main]
        after_ident = sorted(k for k in sys.modules if k.split(".")[0] in heavy)
        print(json.dumps([after_import, ident, after_ident, str(jd.device), jd.log(0, loss=1.0)]))
        """
    )
    out = run_bounded([sys.executable, "-c", code], clean_env(), 60, cwd=ROOT)
    assert out.returncode == 0, out.stdout
    after_import, ident, after_ident, device, logged = json.loads(out.stdout.splitlines()[-1])
    assert after_import == [] and after_ident == []
    assert ident == [0, 1, 0, True]
    assert device == "cpu" and logged is None  # no JD_RUN_DIR: log writes nothing


def test_module_attributes() -> None:
    import jupyter_dist.worker as jd

    assert {"rank", "world_size", "device", "wrap", "log", "save", "resume"} <= set(dir(jd))
    with pytest.raises(AttributeError, match="no attribute 'ranks'"):
        jd.ranks  # noqa: B018


# --------------------------------------------------------------------------- environment contract
def test_worker_env_reads_the_launch_contract() -> None:
    env = WorkerEnv.from_environ(
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
         "JD_RUN_DIR": "/r", "JD_STRATEGY": "FSDP", "JD_PRECISION": "bf16-mixed", "JD_LOG_STDIO": "1",
         "JD_DS_CONFIG": "/r/ds.json"}
    )  # fmt: skip
    assert env.distributed and (env.rank, env.world_size, env.local_rank, env.local_world_size) == (1, 2, 1, 2)
    assert env.strategy == "fsdp-full-shard" and env.family == "fsdp"  # alias resolved by the planner's table
    assert (env.run_dir, env.precision, env.log_stdio, env.ds_config) == ("/r", "bf16-mixed", True, "/r/ds.json")
    assert WorkerEnv.from_environ({"JD_STRATEGY": "zero-2"}).family == "deepspeed"
    rel = WorkerEnv.from_environ({"JD_RUN_DIR": "/r", "JD_DS_CONFIG": "ds_config.json"})  # the launcher's form
    assert rel.ds_config == "/r/ds_config.json"
    bare = WorkerEnv.from_environ({"RANK": "3"})  # RANK alone is not torchrun
    assert not bare.distributed and bare.rank == 0 and bare.strategy == "none" and bare.run_dir is None


@pytest.mark.parametrize(
    ("environ", "match"),
    [
        ({"JD_STRATEGY": "zero4"}, "JD_STRATEGY.*valid:.*zero3"),
        ({"JD_PRECISION": "fp4"}, "JD_PRECISION='fp4'.*valid: bf16-mixed, fp16-mixed, bf16-true, fp32, fp8"),
        ({"JD_HEARTBEAT_S": "often"}, "JD_HEARTBEAT_S"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, r"RANK=2 must be in \[0, WORLD"),
        ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK='x' is not an integer"),
    ],
)
def test_worker_env_errors_name_the_variable(environ: dict[str, str], match: str) -> None:
    with pytest.raises(WorkerError, match=match):
        WorkerEnv.from_environ(environ)


# --------------------------------------------------------------------------- records
def test_record_envelope_and_one_line_encoding() -> None:
    rec = records.make_record("step", rank=3, seq=7, t=1.5, **records.step_fields(2, {"loss": 0.25, "note_x": 1}))
    assert list(rec)[:5] == list(records.ENVELOPE)
    assert rec == {"v": 1, "kind": "step", "rank": 3, "seq": 7, "t": 1.5, "step": 2, "loss": 0.25, "note_x": 1.0}
    line = records.encode(records.make_record("exit", rank=0, seq=0, t=0.0, status="error", error="a\nb\u2028c"))
    assert "\n" not in line and "\u2028" not in line
    assert records.decode(line)["error"] == "a\nb\u2028c"  # type: ignore[index]
    with pytest.raises(ValueError, match="unknown record kind 'bogus'"):
        records.make_record("bogus", rank=0, seq=0, t=0.0)
    with pytest.raises(ValueError, match="clash with the envelope"):
        records.make_record("step", rank=0, seq=0, t=0.0, seq2=1, rank_=2, v=3)


def test_nonfinite_metrics_become_null_with_a_note_and_decode_back() -> None:
    rec = records.make_record(
        "step", rank=0, seq=1, t=2.0, **records.step_fields(5, {"loss": math.nan, "gn": math.inf, "m": -math.inf})
    )
    line = records.encode(rec)
    raw = json.loads(line)  # strict JSON: no NaN/Infinity tokens
    assert "NaN" not in line and "Infinity" not in line
    assert raw["loss"] is None and raw["nonfinite"] == {"loss": "nan", "gn": "inf", "m": "-inf"}
    back = records.decode(line)
    assert back is not None and "nonfinite" not in back
    assert math.isnan(back["loss"]) and back["gn"] == math.inf and back["m"] == -math.inf


def test_metric_conversion() -> None:
    torch = pytest.importorskip("torch")
    np = pytest.importorskip("numpy")
    fields = records.step_fields(
        torch.tensor(4), {"loss": torch.tensor([0.5]), "k": np.int64(3), "ok": True, "x": np.float32(1.5)}
    )
    assert fields == {"step": 4, "loss": 0.5, "k": 3.0, "ok": 1.0, "x": 1.5}
    assert all(type(v) is float for k, v in fields.items() if k != "step")
    with pytest.raises(TypeError, match="metric .vec. must be a scalar"):
        records.step_fields(0, {"vec": torch.ones(2)})
    with pytest.raises(TypeError, match="metric 'name' must be a number.*got str"):
        records.step_fields(0, {"name": "x"})
    with pytest.raises(TypeError, match="step must be an int"):
        records.step_fields(1.5, {})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"metric names \['rank', 'seq'\] are reserved"):
        records.step_fields(0, {"rank": 1, "seq": 2})


@pytest.mark.parametrize(
    "line",
    ['{"v":1,"kind":"step","rank":0,"se', "", "   ", "plain log text", "[1, 2]", '{"loss": 1}', "{broken"],
)
def test_decode_tolerates_torn_and_foreign_lines(line: str) -> None:
    assert records.decode(line) is None


def test_decode_finds_the_sentinel_anywhere_in_a_prefixed_line() -> None:
    line = records.encode(records.make_record("hb", rank=1, seq=4, t=9.0, step=None))
    got = records.decode(f"(head, rank=0, pid=123) {records.SENTINEL}{line}\n")
    assert got is not None and (got["rank"], got["seq"], got["kind"]) == (1, 4, "hb")


def test_decode_reads_old_heartbeat_records_as_hb() -> None:
    line = '{"v":1,"kind":"heartbeat","rank":0,"seq":3,"t":1.0,"step":2}'
    assert records.decode(line) == {"v": 1, "kind": "hb", "rank": 0, "seq": 3, "t": 1.0, "step": 2}


# --------------------------------------------------------------------------- emitter
def test_emitter_writes_one_line_per_record_with_increasing_seq(tmp_path: Path) -> None:
    em = Emitter.for_run_dir(tmp_path, rank=2, interval_s=0)
    em.start_record(world_size=4)
    for i in range(3):
        em.log({"loss": 1.0 / (i + 1)}, step=i)
    em.exit_record("error", ValueError("bad"))
    em.close()
    assert em.emit("step", step=9) is None  # closed: dropped
    recs = read_records(tmp_path, 2, raw=True)
    assert [r["kind"] for r in recs] == ["start", "steps", "steps", "steps", "exit"]  # interval 0: a line per call
    assert [r["seq"] for r in recs] == [0, 1, 2, 3, 4]
    assert [records.steps_columns(r)[2]["loss"] for r in recs[1:4]] == [[1.0], [0.5], [1.0 / 3]]
    assert recs[0]["pid"] == os.getpid() and recs[0]["host"]
    assert recs[-1] == {**recs[-1], "status": "error", "error_type": "ValueError", "error": "bad", "step": 2}
    assert all(recs[i]["t"] <= recs[i + 1]["t"] for i in range(4))


def test_emitter_continues_seq_after_a_previous_worker_and_its_torn_line(tmp_path: Path) -> None:
    em = Emitter.for_run_dir(tmp_path, rank=0, interval_s=0)
    em.log({"loss": 1.0}, step=0)
    em.log({"loss": 0.5}, step=1)
    em.close()
    path = Path(telemetry_path(tmp_path, 0))
    with path.open("a") as f:
        f.write('{"v":1,"kind":"step","rank":0,"seq":2,"t":1.0,"st')  # killed mid-write
    em2 = Emitter.for_run_dir(tmp_path, rank=0, interval_s=0)
    assert em2.next_seq == 2
    em2.log({"loss": 0.25}, step=2)
    em2.close()
    lines = path.read_text().splitlines()
    assert [records.decode(x) is None for x in lines] == [False, False, True, False]
    assert records.decode(lines[-1])["seq"] == 2  # type: ignore[index]


def test_emitter_is_thread_safe(tmp_path: Path) -> None:
    em = Emitter.for_run_dir(tmp_path, rank=0, interval_s=0)

    def work(k: int) -> None:
        for i in range(200):
            em.log({"loss": float(i), "thread": float(k)}, step=i)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    em.close()
    recs = read_records(tmp_path, 0)
    assert [r["seq"] for r in recs] == list(range(1600))


def test_emitter_heartbeat_thread_and_stream_sink(tmp_path: Path) -> None:
    read_fd, write_fd = os.pipe()
    em = Emitter(rank=1, sinks=[JsonlFileSink(telemetry_path(tmp_path, 1)), StreamSink(write_fd)])
    em.log({"loss": 2.0}, step=41)
    em.start_heartbeat(0.05)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and sum(r["kind"] == "hb" for r in read_records(tmp_path, 1)) < 2:
        time.sleep(0.02)
    em.close()
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        streamed = f.read().splitlines()
    recs = read_records(tmp_path, 1, raw=True)
    beats = [r for r in recs if r["kind"] == "hb"]
    assert len(beats) >= 2 and beats[0]["step"] == 41 and beats[0]["phase"] == "init" and beats[0]["phase_s"] >= 0
    mems = [r for r in recs if r["kind"] == "mem"]
    assert len(mems) >= 2 and mems[0]["device"] == "cpu" and mems[0]["rss"] > 0 and mems[0]["max_rss"] > 0
    assert all(line.startswith(records.SENTINEL) for line in streamed)
    assert [records.decode(line) for line in streamed] == recs  # both sinks got the identical records


def test_disabled_emitter_still_validates_metrics() -> None:
    em = Emitter(rank=0)
    assert not em.enabled and em.log({"loss": 1.0}, step=0) is None
    with pytest.raises(TypeError, match="metric 'loss'"):
        em.log({"loss": "high"}, step=1)


# --------------------------------------------------------------------------- runtime in this process (no torchrun)
def test_runtime_outside_torchrun_logs_and_refuses_distributed_strategies(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    rt = Runtime(tiny_env(tmp_path))
    assert (rt.rank, rt.world_size, rt.is_main, rt.device.type) == (0, 1, True, "cpu")
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert rt.wrap(model, opt) == (model, opt)  # "none": unchanged
    rt.backward(model(torch.ones(1, 2)).sum())
    rt.step()
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none=True)
    rec = rt.log(3, {"loss": torch.tensor(0.5)})
    assert rec is not None and records.steps_columns(rec)[:3:2] == ([3], {"loss": [0.5]})
    rt.emitter.close()
    assert [r["kind"] for r in read_records(tmp_path, 0, raw=True)] == ["start", "hb", "mem", "steps"]
    for strategy in ("ddp", "fsdp2", "zero2"):
        with pytest.raises(WorkerError, match=f"JD_STRATEGY={strategy} needs a process group.*torchrun"):
            Runtime(tiny_env(tmp_path, strategy=strategy)).wrap(model, opt)
    with pytest.raises(WorkerError, match=r"jd.step\(\) needs an optimizer"):
        Runtime(tiny_env(tmp_path)).step()
    with pytest.raises(WorkerError, match=r"jd.resume\(\) loads into live objects"):
        Runtime(tiny_env(tmp_path)).resume()


def test_save_and_resume_round_trip_without_a_process_group(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")

    def build() -> tuple:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        o = torch.optim.AdamW(m.parameters(), lr=0.05)
        return m, o, torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)

    rt = Runtime(tiny_env(tmp_path))
    assert rt.resume({"model": torch.nn.Linear(1, 1)}) is None  # nothing saved yet
    model, opt, sched = build()
    x = torch.randn(8, 3)
    for step in range(4):
        rt.backward(model(x).square().mean())
        rt.step(opt)
        sched.step()
        path = rt.save({"model": model, "optimizer": opt, "sched": sched, "epoch": step, "note": "hi"}, step, keep=2)
    assert path == str(tmp_path / "checkpoints" / "step-3")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-2", "step-3"]  # keep=2 pruned the rest
    marker = json.loads((tmp_path / "checkpoints" / "step-3" / "COMPLETE").read_text())
    assert marker["step"] == 3 and marker["modules"] == ["model"] and marker["optimizers"] == ["optimizer"]
    # a newer directory without the COMPLETE marker (a crash mid-save) is not picked
    (tmp_path / "checkpoints" / "step-9").mkdir()
    (tmp_path / "checkpoints" / ".tmp-step-10").mkdir()

    model2, opt2, sched2 = build()
    got = Runtime(tiny_env(tmp_path)).resume({"model": model2, "optimizer": opt2, "sched": sched2})
    assert got is not None
    state, step = got
    assert step == 3 and state["epoch"] == 3 and state["note"] == "hi" and state["model"] is model2
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert sched2.last_epoch == sched.last_epoch and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(opt.state[p]["exp_avg"], opt2.state[q]["exp_avg"])
    # the next step of the resumed copy equals the next step of the original
    for m, o in ((model, opt), (model2, opt2)):
        rt.backward(m(x).square().mean())
        rt.step(o)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters(), strict=True))
    # saving the same step again replaces it
    rt.save({"model": model, "epoch": 99}, 3)
    assert rt.resume({"model": model2})[0]["epoch"] == 99  # type: ignore[index]
    rt.emitter.close()


def test_save_errors_and_no_run_dir(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch = pytest.importorskip("torch")
    m = torch.nn.Linear(2, 2)
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    rt = Runtime(tiny_env(tmp_path))
    with pytest.raises(WorkerError, match="optimizer 'opt' updates none of the modules"):
        rt.save({"model": m, "opt": other}, 1)
    with pytest.raises(WorkerError, match="step must be an int >= 0"):
        rt.save({"model": m}, -1)
    with pytest.raises(WorkerError, match="keep=0 must be >= 1"):
        rt.save({"model": m}, 1, keep=0)
    bare = Runtime(WorkerEnv(distributed=False, heartbeat_s=0))
    with caplog.at_level("WARNING", logger="jupyter_dist.worker"):
        assert bare.save({"model": m}, 1) is None
    assert "saved nothing" in caplog.text
    assert bare.resume({"model": m}) is None
    assert bare.save({"model": m}, 1, root=tmp_path / "elsewhere") == str(tmp_path / "elsewhere" / "step-1")
    rt.emitter.close()


def test_find_blocks_and_optimizer_rebuild_rules() -> None:
    torch = pytest.importorskip("torch")
    from jupyter_dist.worker._strategy import find_blocks, rebuild_optimizer

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.ReLU()])  # mixed classes: not blocks
            self.small = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(4)])
            self.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(8, 8) for i in range(2)})

    net = Net()
    assert find_blocks(net) == list(net.layers.values())  # most parameters wins
    assert find_blocks(torch.nn.Linear(2, 2)) == []
    opt = torch.optim.AdamW([{"params": net.small.parameters(), "lr": 0.5}, {"params": net.layers.parameters()}])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)  # built before the "wrap"
    names = {id(p): n for n, p in net.named_parameters()}
    import copy

    replaced = copy.deepcopy(net)  # new parameter objects under the same names, as FSDP makes
    groups = opt.param_groups
    new = rebuild_optimizer(opt, names, replaced)
    assert new is opt and new.param_groups is groups  # re-pointed in place: the scheduler still drives it
    assert [g["lr"] for g in new.param_groups] == [0.5, opt.defaults["lr"]]
    assert [len(g["params"]) for g in new.param_groups] == [8, 4]
    assert {id(p) for g in new.param_groups for p in g["params"]} == {
        id(p) for n, p in replaced.named_parameters() if not n.startswith("heads")
    }
    new.step()
    sched.step()
    assert [g["lr"] for g in new.param_groups] == [0.25, opt.defaults["lr"] / 2]
    stray = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    before = list(stray.param_groups[0]["params"])
    with pytest.raises(WorkerError, match=r"parameter \(shape \(3,\)\) that is not a parameter of the model"):
        rebuild_optimizer(stray, names, net)
    assert stray.param_groups[0]["params"] == before  # left as it was
    opt = torch.optim.AdamW(net.parameters())
    net.layers["0"](torch.ones(1, 8)).sum().backward()
    opt.step()
    with pytest.raises(WorkerError, match="already has state"):
        rebuild_optimizer(opt, names, net)


def test_launched_worker_without_torch_records_its_crash_and_redirects_stdio(tmp_path: Path) -> None:
    """The hooks need no torch: where torch cannot even be imported, a script that dies before touching jd still
    leaves an exit record and a log (the worker's own import of torch at start gives way)."""
    (tmp_path / "torch.py").write_text("raise ImportError('a broken torch')\n")  # shadows torch for the script
    script = tmp_path / "crash.py"
    script.write_text(
        "import sys\nimport jupyter_dist.worker as jd\n"
        "print('to stdout'); print('to stderr', file=sys.stderr)\n"
        "assert 'torch' not in sys.modules\n"
        "raise KeyError('missing-thing')\n"
    )
    out = run_bounded(
        [sys.executable, str(script)], clean_env(JD_RUN_DIR=str(tmp_path), JD_LOG_STDIO="1"), 60, tmp_path
    )
    assert out.returncode == 1 and out.stdout == ""  # everything went to the log
    log = (tmp_path / "logs" / "rank-0.log").read_text()
    assert "to stdout" in log and "to stderr" in log and "KeyError: 'missing-thing'" in log and "Traceback" in log
    (exit_rec,) = read_records(tmp_path, 0)
    assert exit_rec["kind"] == "exit" and exit_rec["status"] == "error"
    assert exit_rec["error_type"] == "KeyError" and exit_rec["error"] == "'missing-thing'"


def test_a_training_process_imports_torch_outside_the_collector_and_a_kernel_imports_none(tmp_path: Path) -> None:
    """Under torchrun's variables, importing the worker imports torch with the collector paused, then freezes it;
    the collector is on again, or stays off where the user turned it off. Dynamo is left to the script (imported
    early, it made plain DDP scripts hang at exit), but its import, when the script makes it, runs with the collector
    paused (one-shot hook, gone after; the module is loaded by its usual loader): at most the one young collection as
    the import returns, where a plain process sees ~300. Without them (a kernel) it imports no torch, freezes
    nothing, hooks nothing."""
    probe = (
        "import gc, sys\n"
        "if sys.argv[1] == 'off':\n    gc.disable()\n"
        "import jupyter_dist.worker\n"
        "mods = sorted(m for m in ('torch', 'torch._dynamo') if m in sys.modules)\n"
        "print(mods, gc.isenabled(), gc.get_freeze_count() > 1000)\n"
        "hooks = [type(f).__name__ for f in sys.meta_path if 'jupyter_dist' in type(f).__module__]\n"
        "seen = []\n"
        "gc.callbacks.append(lambda phase, info: phase == 'start' and seen.append(info['generation']))\n"
        "import torch._dynamo\n"
        "gc.callbacks.clear()\n"
        "left = [f for f in sys.meta_path if 'jupyter_dist' in type(f).__module__]\n"
        "loader = type(torch._dynamo.__spec__.loader).__name__\n"
        "print(hooks, len(seen) > 10, left, loader, gc.isenabled(), callable(torch._dynamo.disable))\n"
    )  # fmt: skip
    rank = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    got = {}
    for name, env, arg in (("rank", rank, "on"), ("rank-gc-off", rank, "off"), ("kernel", {}, "on")):
        out = run_bounded([sys.executable, "-c", probe, arg], clean_env(**env), 120, tmp_path)
        assert out.returncode == 0, out.stdout
        got[name] = out.stdout.strip().splitlines()
    assert got == {
        "rank": ["['torch'] True True", "['_PausedImport'] False [] SourceFileLoader True True"],
        "rank-gc-off": ["['torch'] False True", "['_PausedImport'] False [] SourceFileLoader False True"],
        "kernel": ["[] True False", "[] True [] SourceFileLoader True True"],
    }


def test_the_launch_bootstrap_imports_torch_outside_the_collector_before_the_script(tmp_path: Path) -> None:
    """A rank started through the bootstrap (``%%dist_train``, ``jupyter-dist launch``) has torch imported and frozen
    before its script runs (and before the objects shipped from the notebook are unpickled), even when the script
    never imports jupyter_dist."""
    (tmp_path / "probe.py").write_text("import gc, sys\nprint('probe', 'torch' in sys.modules, gc.isenabled(), "
                                       "gc.get_freeze_count() > 1000)\n")  # fmt: skip
    env = clean_env(JD_RUN_DIR=str(tmp_path), RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    out = run_bounded([sys.executable, "-m", "jupyter_dist.launch.bootstrap", str(tmp_path / "probe.py")], env, 120,
                      tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stdout
    assert "probe True True True" in (tmp_path / "logs" / "rank-0.log").read_text()


def test_a_bootstrap_that_catches_the_error_reports_it_with_note_exit(tmp_path: Path) -> None:
    """A launcher's bootstrap runs the script with runpy and catches its exception, so sys.excepthook never sees
    it; jd.note_exit tells the runtime, and the exit record says error instead of ok."""
    (tmp_path / "user.py").write_text("import jupyter_dist.worker as jd\nraise OSError('disk gone')\n")
    (tmp_path / "boot.py").write_text(
        "import runpy, sys\ncode = 0\n"
        "try:\n    runpy.run_path(sys.argv[1], run_name='__main__')\n"
        "except BaseException as exc:\n    code = 1\n"
        "    w = sys.modules.get('jupyter_dist.worker')\n    w and w.note_exit(code, exc)\n"
        "sys.exit(code)\n"
    )
    (tmp_path / "quits.py").write_text("import sys\nimport jupyter_dist.worker as jd\nsys.exit(3)\n")
    for script, want in (("user.py", ("OSError", "disk gone")), ("quits.py", ("SystemExit", "3"))):
        run_dir = tmp_path / script.replace(".py", "")
        out = run_bounded(
            [sys.executable, str(tmp_path / "boot.py"), str(tmp_path / script)],
            clean_env(JD_RUN_DIR=str(run_dir)),
            60,
            tmp_path,
        )
        assert out.returncode == 1, out.stdout
        (exit_rec,) = read_records(run_dir, 0)
        assert (exit_rec["status"], exit_rec["error_type"], exit_rec["error"]) == ("error", *want)


def test_note_exit_rules(tmp_path: Path) -> None:
    for code, error, status in (
        (0, None, "ok"),
        (0, SystemExit(0), "ok"),
        (2, None, "error"),
        (1, KeyError("k"), "error"),
    ):
        rt = Runtime(tiny_env(tmp_path / f"{code}-{error!r}"))
        rt.note_exit(code, error)
        rt._at_exit()
        (rec,) = read_records(tmp_path / f"{code}-{error!r}", 0)
        assert rec["status"] == status, (code, error)


# --------------------------------------------------------------------------- real torchrun jobs
TRAIN = """
import copy, json, os, sys
import torch
import torch.distributed as dist
import torch.nn as nn
import jupyter_dist.worker as jd

PHASE = os.environ.get("TEST_PHASE", "train")
STEPS, SAVE_AT = 12, 5
OUT = os.path.join(os.environ["JD_RUN_DIR"], f"result-{PHASE}-rank{jd.rank}.json")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList([Block() for _ in range(2)])
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def data(rank):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(8, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def flat(model):
    ps = [p.full_tensor() if hasattr(p, "full_tensor") else p for _, p in sorted(model.named_parameters())]
    return torch.cat([p.detach().reshape(-1).float() for p in ps])


print(f"hello stdout from rank {jd.rank} of {jd.world_size} ({PHASE})")
print(f"hello stderr from rank {jd.rank}", file=sys.stderr)
torch.manual_seed(0 if PHASE == "train" else 1)  # the resumed run must get its weights from the checkpoint
model = Net()
# the same training in one process over both ranks' data: what data parallelism must reproduce
ref = copy.deepcopy(model)
opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
ref_opt = torch.optim.AdamW(ref.parameters(), lr=5e-3)
model, opt = jd.wrap(model, opt)
result = {"model": type(model).__name__, "params": {n: type(p).__name__ for n, p in model.named_parameters()},
          "losses": {}}
first = 0
if PHASE == "resume":
    state, saved = jd.resume()  # into the wrapped model and optimizer
    jd.resume({"model": ref, "optimizer": ref_opt})  # the same checkpoint into plain modules
    result.update(resumed_step=saved, epoch=state["epoch"], params_at_resume=flat(model).tolist())
    first = saved + 1
x, y = data(jd.rank)
xs, ys = zip(*(data(r) for r in range(jd.world_size)))
for step in range(first, STEPS):
    loss = nn.functional.mse_loss(model(x.to(jd.device)), y.to(jd.device))
    jd.backward(loss)
    jd.step()
    jd.log(step, loss=loss, lr=5e-3)
    result["losses"][step] = loss.item()
    nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    if PHASE == "train" and step == SAVE_AT:
        jd.save({"model": model, "optimizer": opt, "epoch": 7}, SAVE_AT)
        result["params_at_save"] = flat(model).tolist()
final = flat(model)
everyone = [torch.zeros_like(final) for _ in range(jd.world_size)]
dist.all_gather(everyone, final)
result["max_diff_across_ranks"] = max((g - final).abs().max().item() for g in everyone)
result["max_diff_vs_one_process"] = (final - flat(ref)).abs().max().item()
result["final"] = final.tolist()
with open(OUT, "w") as f:
    json.dump(result, f)
"""


def results(run_dir: Path, phase: str) -> list[dict]:
    return [json.loads((run_dir / f"result-{phase}-rank{r}.json").read_text()) for r in (0, 1)]


def check_training(run_dir: Path, phase: str, steps: list[int], factor: float) -> list[dict]:
    res = results(run_dir, phase)
    for r in res:
        assert r["max_diff_across_ranks"] == 0.0  # replicas (or gathered shards) agree bit for bit
        assert r["max_diff_vs_one_process"] < 1e-5  # and equal one process training on the global batch
    first = sum(r["losses"][str(steps[0])] for r in res) / 2
    last = sum(r["losses"][str(steps[-1])] for r in res) / 2
    assert last < factor * first, (first, last)
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert f"hello stdout from rank {rank} of 2 ({phase})" in log and f"hello stderr from rank {rank}" in log
    return res


@pytest.mark.slow
def test_fsdp2_then_ddp_two_processes_train_in_sync_save_and_resume(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    run_dir = tmp_path / "run"
    proc = torchrun(script, run_dir, JD_STRATEGY="fsdp2")
    assert proc.returncode == 0, explain(proc, run_dir)
    assert "hello stdout" not in proc.stdout  # redirected to the logs, not torchrun's output
    res = check_training(run_dir, "train", list(range(12)), 0.75)
    assert res[0]["model"] == "FSDPNet" and set(res[0]["params"].values()) == {"DTensor"}  # sharded, optimizer too
    for rank in (0, 1):
        recs = check_telemetry(run_dir, rank, list(range(12)))
        assert [r["loss"] for r in recs if r["kind"] == "step"] == [res[rank]["losses"][str(s)] for s in range(12)]
    ckpt = run_dir / "checkpoints" / "step-5"
    assert (ckpt / "COMPLETE").is_file() and len(list((ckpt / "dcp").glob("*.distcp"))) == 2  # one shard per rank
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))

    # a second launch, now with DDP, resumes from the sharded checkpoint (DCP reshards on load)
    proc = torchrun(script, run_dir, JD_STRATEGY="ddp", TEST_PHASE="resume")
    assert proc.returncode == 0, explain(proc, run_dir)
    resumed = check_training(run_dir, "resume", list(range(6, 12)), 0.95)
    for before, after in zip(res, resumed, strict=True):
        assert after["model"] == "DistributedDataParallel" and set(after["params"].values()) == {"Parameter"}
        assert after["resumed_step"] == 5 and after["epoch"] == 7
        assert after["params_at_resume"] == before["params_at_save"]
        # model and optimizer state came back: the resumed steps repeat the original ones
        assert max(abs(a - b) for a, b in zip(after["final"], before["final"], strict=True)) < 1e-5
        assert after["losses"] == pytest.approx({k: v for k, v in before["losses"].items() if int(k) > 5}, rel=1e-5)
    for rank in (0, 1):  # the second launch appends, continuing the sequence numbers
        recs = read_records(run_dir, rank)
        assert [r["seq"] for r in recs] == list(range(len(recs)))
        assert [r["strategy"] for r in recs if r["kind"] == "start"] == ["fsdp2", "ddp"]
        assert [r["step"] for r in recs if r["kind"] == "step"] == list(range(12)) + list(range(6, 12))
        assert [r["status"] for r in recs if r["kind"] == "exit"] == ["ok", "ok"]


FAIL = """
import dataclasses, json, os, sys, time
import torch
import jupyter_dist.worker as jd
from jupyter_dist.worker import Runtime, WorkerEnv

jd.log(0, loss=1.0)
marker = os.path.join(os.environ["JD_RUN_DIR"], "wrap-error.json")
if jd.rank == 1:
    deadline = time.monotonic() + 30
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    raise ValueError("boom from rank 1")
# rank 0: a DeepSpeed strategy without its JSON fails with our one-line error, then it waits to be stopped
zero = Runtime(dataclasses.replace(WorkerEnv.from_environ(), strategy="zero2"))
m = torch.nn.Linear(4, 4)
try:
    zero.wrap(m, torch.optim.SGD(m.parameters(), lr=0.1))
except Exception as e:
    with open(marker + ".tmp", "w") as f:
        json.dump([type(e).__name__, str(e)], f)
    os.rename(marker + ".tmp", marker)
print("rank 0 waiting", flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_a_failing_rank_records_its_error_and_the_other_is_terminated(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(FAIL)
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = torchrun(script, run_dir, JD_STRATEGY="ddp", JD_HEARTBEAT_S="0.2", timeout=90)
    assert proc.returncode != 0 and time.monotonic() - t0 < 60, explain(proc, run_dir)
    bad = read_records(run_dir, 1)
    assert [r["kind"] for r in bad if r["kind"] not in ("hb", "mem")] == ["start", "step", "error", "exit"]
    error = next(r for r in bad if r["kind"] == "error")
    assert error["error_type"] == "ValueError" and 'raise ValueError("boom from rank 1")' in error["traceback"]
    assert bad[-1]["status"] == "error" and bad[-1]["error_type"] == "ValueError"
    assert bad[-1]["error"] == "boom from rank 1" and bad[-1]["step"] == 0
    log1 = (run_dir / "logs" / "rank-1.log").read_text()
    assert "Traceback (most recent call last)" in log1 and 'raise ValueError("boom from rank 1")' in log1
    other = read_records(run_dir, 0)
    assert other[-1]["kind"] == "exit" and other[-1]["status"] == "terminated" and other[-1]["signal"] == "SIGTERM"
    assert any(r["kind"] == "hb" and r["step"] == 0 for r in other)
    kind, message = json.loads((run_dir / "wrap-error.json").read_text())
    assert kind == "WorkerError" and message.startswith("JD_STRATEGY=zero2 needs JD_DS_CONFIG, the path of the")


IN_FLIGHT = """
import os, time
import torch
import torch.distributed as dist
import jupyter_dist.worker as jd

jd.init()
group = dist.group.WORLD  # a reference to the group outlives destroy_process_group, as DeepSpeed's do
if jd.rank == 1:
    time.sleep(1.0)  # rank 0's script ends while its all-reduce still waits for rank 1
t = torch.ones(4) * (jd.rank + 1)
t.note = "a Python attribute: torch keeps this Python object alive with the C++ tensor the work holds"
marker = os.path.join(os.environ["JD_RUN_DIR"], f"done-rank{jd.rank}.json")


def done(fut):  # runs on gloo's worker thread when the work completes, and needs the GIL
    with open(marker, "w") as f:
        f.write(str(fut.value()[0].tolist()))


dist.all_reduce(t, group=group, async_op=True).get_future().add_done_callback(done)
del t
print(f"rank {jd.rank}: script ends", flush=True)
"""


@pytest.mark.slow
def test_a_collective_in_flight_at_the_end_finishes_before_the_interpreter_finalises(tmp_path: Path) -> None:
    """The clean-end teardown drains gloo's work while Python is whole.

    Without it rank 0 aborts with "terminate called without an active exception" (SIGABRT): the completion runs
    Python on gloo's worker thread after ``Py_FinalizeEx`` began, and CPython ends that thread with ``pthread_exit``.
    """
    script = tmp_path / "in_flight.py"
    script.write_text(IN_FLIGHT)
    run_dir = tmp_path / "run"
    proc = torchrun(script, run_dir, timeout=120, JD_STRATEGY="ddp")
    assert proc.returncode == 0, explain(proc, run_dir)
    for rank in (0, 1):
        assert (run_dir / f"done-rank{rank}.json").read_text() == "[3.0, 3.0, 3.0, 3.0]"
        assert read_records(run_dir, rank)[-1]["status"] == "ok"
        assert "terminate called" not in (run_dir / "logs" / f"rank-{rank}.log").read_text()


DEEPSPEED = """
import json, os
import torch
import torch.distributed as dist
import torch.nn as nn
import jupyter_dist.worker as jd

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=5e-3)  # a torch optimizer: no fused-Adam build on CPU
model, opt = jd.wrap(model, opt)
g = torch.Generator().manual_seed(jd.rank)
x = torch.randn(4, 8, generator=g)
y = x.sum(dim=1, keepdim=True).sin()


def flat():
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


losses = []
for step in range(10):
    loss = nn.functional.mse_loss(model(x), y)
    jd.backward(loss)
    jd.step()
    jd.log(step, loss=loss)
    losses.append(loss.item())
    if step == 4:
        jd.save({"model": model, "optimizer": opt, "note": "ds"}, 4)
        snap = flat().clone()
final = flat()
everyone = [torch.zeros_like(final) for _ in range(jd.world_size)]
dist.all_gather(everyone, final)
state, step = jd.resume()
with open(os.path.join(os.environ["JD_RUN_DIR"], f"ds-rank{jd.rank}.json"), "w") as f:
    json.dump({"engine": type(model).__name__, "optimizer": type(opt).__name__,
               "stage": model.zero_optimization_stage(), "losses": losses,
               "max_diff_across_ranks": max((g - final).abs().max().item() for g in everyone),
               "resumed_step": step, "note": state["note"], "moved_since_save": (final - snap).abs().max().item(),
               "diff_after_resume": (flat() - snap).abs().max().item()}, f)
"""


@pytest.mark.slow
@pytest.mark.deepspeed
def test_deepspeed_zero2_through_wrap_on_cpu(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    script = tmp_path / "ds.py"
    script.write_text(DEEPSPEED)
    config = tmp_path / "ds.json"
    config.write_text(
        json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                    "zero_optimization": {"stage": 2}, "steps_per_print": 10**6})
    )  # fmt: skip
    run_dir = tmp_path / "run"
    ext = Path(os.environ["TORCH_EXTENSIONS_DIR"])  # the suite's one folder (tests/conftest.py)
    proc = torchrun(
        script, run_dir, timeout=420, JD_STRATEGY="zero2", JD_DS_CONFIG=str(config), DS_ACCELERATOR="cpu",
        TORCH_EXTENSIONS_DIR=str(ext),
    )  # fmt: skip
    assert proc.returncode == 0, explain(proc, run_dir)
    res = [json.loads((run_dir / f"ds-rank{r}.json").read_text()) for r in (0, 1)]
    for r in res:
        assert (r["engine"], r["optimizer"], r["stage"]) == ("DeepSpeedEngine", "DeepSpeedZeroOptimizer", 2)
        assert r["max_diff_across_ranks"] == 0.0
        assert r["resumed_step"] == 4 and r["note"] == "ds"
        assert r["moved_since_save"] > 1e-3 and r["diff_after_resume"] == 0.0
    assert sum(r["losses"][-1] for r in res) < 0.6 * sum(r["losses"][0] for r in res)
    assert (run_dir / "checkpoints" / "step-4" / "deepspeed").is_dir()
    for rank in (0, 1):
        check_telemetry(run_dir, rank, list(range(10)))


def test_a_checkpoint_with_nested_optimizer_states_still_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpoints written before optimizer states were flattened per parameter name load as before."""
    torch = pytest.importorskip("torch")
    from jupyter_dist.worker import _checkpoint

    def build() -> tuple:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        return m, torch.optim.AdamW(m.parameters(), lr=0.05)

    model, opt = build()
    rt = Runtime(tiny_env(tmp_path))
    rt.backward(model(torch.randn(8, 3)).square().mean())
    rt.step(opt)
    nested = _checkpoint._Split.dcp_state
    monkeypatch.setattr(_checkpoint._Split, "dcp_state", lambda self, flat=True: nested(self, flat=False))
    rt.save({"model": model, "optimizer": opt}, 0)
    monkeypatch.undo()
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(tmp_path / "checkpoints" / "step-0" / "dcp")).read_metadata().state_dict_metadata
    assert "optimizer.param_groups.0.lr" in keys  # the old, nested layout
    model2, opt2 = build()
    assert Runtime(tiny_env(tmp_path)).resume({"model": model2, "optimizer": opt2}) is not None
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(opt.state.values(), opt2.state.values(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"JD_PP_SCHEDULE": "zigzag"}, "JD_PP_SCHEDULE='zigzag' is not valid; valid: gpipe, 1f1b, interleaved-1f1b"),
        ({"JD_PP_VIRTUAL": "-1"}, "JD_PP_VIRTUAL and JD_MICROBATCHES must be >= 0"),
        ({"JD_MICROBATCHES": "-2"}, "JD_PP_VIRTUAL and JD_MICROBATCHES must be >= 0"),
        ({"JD_PP_SCHEDULE": "interleaved-1f1b", "JD_PP_VIRTUAL": "1"}, "needs JD_PP_VIRTUAL >= 2"),
        ({"JD_AC": "sometimes"}, "JD_AC='sometimes' is not valid; valid: none, selective, op, layer:K, full"),
        ({"JD_TP": "0"}, "JD_TP=0 must be >= 1"),
        (
            {"JD_TP": "3", "RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "x", "MASTER_PORT": "1"},
            "does not divide WORLD_SIZE=4",
        ),
    ],
)
def test_model_parallel_contract_values_get_one_line(env: dict[str, str], message: str) -> None:
    with pytest.raises(WorkerError) as info:
        WorkerEnv.from_environ(env)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_every_fsdp2_run_goes_to_parallelize_not_apply_strategy(tmp_path: Path) -> None:
    """jd.wrap sends each run whose family is FSDP2 (fsdp2, HSDP, zero1 with tp) to ``_parallel.parallelize``: the
    single-mesh ``apply_strategy`` has no FSDP2 branch, so a strategy sent there would fail."""
    torch = pytest.importorskip("torch")
    from jupyter_dist.plan.strategies import STRATEGIES

    model = torch.nn.Linear(2, 2)
    layouts = [{"strategy": name} for name in STRATEGIES] + [{"strategy": "zero1", "tp": 2, "world_size": 2}]
    seen = set()
    for fields in layouts:
        rt = Runtime(tiny_env(tmp_path, **fields))
        seen.add(rt.env.family)
        meshed = rt._needs_mesh(model, None, None)
        assert meshed == (rt.env.family == "fsdp2" or rt.env.model_parallel), fields
        rt.emitter.close()
    assert seen == {s.family for s in STRATEGIES.values()}
