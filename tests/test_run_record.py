"""The run record (launch/record.py): one typed record, one atomic writer, every layout read, stale runs settled.

* every ``run.json`` layout the writers have produced (local, SLURM, SkyPilot, an attached SkyPilot job, the pool)
  reads into a :class:`RunRecord` and round-trips;
* :func:`write_record` is atomic and safe for concurrent writers in one process;
* a SLURM run on the local SLURM cluster records the candidate it ran (not ``plan.best``) and ``plan_check``
  compares with it;
* a local run whose kernel died and whose processes were then killed from outside is, when attached, not
  reported as running (status, summary and ``run.json`` corrected); one that finished on its own is ``succeeded``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from jupyter_dist.errors import JupyterDistError
from jupyter_dist.launch.record import (
    RECORD_VERSION,
    HparamError,
    RunRecord,
    check_hparams,
    local_pids_alive,
    read_record,
    settle_stale,
    write_record,
)
from jupyter_dist.plan.parallel import ParallelDims

REPO = Path(__file__).resolve().parents[1]

LOCAL_V1 = {"name": "run", "status": "succeeded", "strategy": "fsdp2", "candidate": "fsdp2+tp2+sp",
            "notes": ["mesh: dp_shard=2 x tp=2 (4 processes), sequence parallel on"], "world_size": 4, "nproc": 4,
            "nodes": 1, "timeout": None, "hang_timeout": 30.0, "env": {"JD_TP": "2", "JD_SP": "1"},
            "created": 1.7e9, "plan": None, "shipped": ["lr", "model"], "started": 1.7e9 + 1, "pids": [11, 12],
            "launcher": {"kind": "local", "nproc": 4}, "ended": 1.7e9 + 9, "agent_exit_codes": [0],
            "exit_codes": {"0": 0, "1": 0, "2": 0, "3": 0}, "diagnosis": {"reason": "x"}}  # fmt: skip
SLURM_V1 = {"name": "s", "status": "running", "backend": "slurm", "strategy": "ddp", "world_size": 2, "nproc": 1,
            "nodes": 2, "timeout": None, "env": {}, "created": 1.7e9, "plan": None, "shipped": [],
            "secrets": ["WANDB_API_KEY"], "started": 1.7e9, "job_id": "42",
            "launcher": {"kind": "slurm", "job_id": "42"}}  # fmt: skip
SKY_ATTACHED_V1 = {"name": "attach-c-3", "status": "pending", "backend": "skypilot", "strategy": None,
                   "world_size": None, "nodes": None, "env": {}, "created": 1.7e9, "started": 1.7e9, "cluster": "c",
                   "launcher": {"kind": "skypilot", "cluster": "c", "job_id": "3"}}  # fmt: skip
POOL_V1 = {"name": "pool", "kind": "pool", "status": "running", "strategy": "ddp", "world_size": 2, "nproc": 2,
           "nodes": 1, "timeout": None, "hang_timeout": None, "created": 1.7e9, "control": "127.0.0.1:5",
           "env": {}, "plan": None, "shipped": [], "pids": [3]}  # fmt: skip


@pytest.mark.parametrize("old", [LOCAL_V1, SLURM_V1, SKY_ATTACHED_V1, POOL_V1], ids=["local", "slurm", "sky", "pool"])
def test_every_old_layout_reads_and_round_trips(old: dict[str, Any], tmp_path: Path) -> None:
    rec = RunRecord.from_dict(old)
    assert rec.name == old["name"] and rec.status == old["status"]
    assert rec.backend == (old.get("backend") or (old.get("launcher") or {}).get("kind") or "local")
    assert rec.kind == old.get("kind", "run")
    assert RunRecord.from_dict(rec.to_dict()) == rec
    for key, value in old.items():  # every key survives, flat, where it was (extras too)
        if key == "exit_codes":
            assert rec.to_dict()[key] == value
        elif value not in (None, [], {}):
            assert rec.to_dict()[key] == value, key
    (tmp_path / "r").mkdir()
    written = write_record(tmp_path / "r", old)
    assert read_record(tmp_path / "r") == written == rec
    assert json.loads((tmp_path / "r" / "run.json").read_text())["record"] == RECORD_VERSION


def test_degrees_come_from_the_record_else_the_environment_else_the_candidate() -> None:
    rec = RunRecord.from_dict(LOCAL_V1)
    assert rec.degrees == ParallelDims(dp=2, tp=2, sp=True) and rec.exit_codes == {0: 0, 1: 0, 2: 0, 3: 0}
    by_name = RunRecord.from_dict({**LOCAL_V1, "env": {}, "candidate": "fsdp2+pp2", "world_size": 8})
    assert by_name.degrees == ParallelDims(dp=4, pp=2)
    assert RunRecord.from_dict(SKY_ATTACHED_V1).degrees is None
    explicit = RunRecord.from_dict({**LOCAL_V1, "degrees": {"dp": 1, "tp": 4}})
    assert explicit.degrees == ParallelDims(dp=1, tp=4)
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        ParallelDims(tp=0)


def test_the_record_degrees_are_the_plans_parallel_dims_and_keep_the_json_keys() -> None:
    """One degrees type from the plan to run.json: the written keys are the seven run.json always had (HSDP's
    dp_replicate included), a written record reads back equal, and the old name still imports."""
    from jupyter_dist.launch import record
    from jupyter_dist.plan.candidates import resolve_launch

    assert record.Degrees is ParallelDims
    choice = resolve_launch("fsdp2-hybrid+tp2", None, 8, nproc_per_node=4)
    rec = RunRecord(name="r", degrees=choice.degrees, world_size=8)
    written = rec.to_dict()["degrees"]
    assert list(written) == ["dp", "tp", "pp", "cp", "ep", "sp", "dp_replicate"]
    assert written == {"dp": 4, "tp": 2, "pp": 1, "cp": 1, "ep": 1, "sp": False, "dp_replicate": 2}
    assert RunRecord.from_dict(json.loads(json.dumps(rec.to_dict()))).degrees == choice.degrees
    assert RunRecord.from_dict({"name": "r", "degrees": {"dp": "2", "tp": 2, "sp": 1}}).degrees == ParallelDims(
        dp=2, tp=2, sp=True
    )
    assert ParallelDims(dp=4).to_dict() == {"dp": 4, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "sp": False}  # a plan's


def test_a_damaged_record_is_one_line_and_a_damaged_hparam_is_dropped(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text("{not json")
    with pytest.raises(JupyterDistError, match="is damaged"):
        read_record(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({**POOL_V1, "hparams": {"lr": 0.1, "bad": [1, 2]}}))
    assert read_record(tmp_path).hparams == {"lr": 0.1}


def test_check_hparams_takes_scalars_and_names_the_bad_key() -> None:
    assert check_hparams({"lr": 3e-4, "n": 2, "on": True, "opt": "adamw"}) == {"lr": 3e-4, "n": 2, "on": True,
                                                                              "opt": "adamw"}  # fmt: skip
    np = pytest.importorskip("numpy")
    got = check_hparams({"x": np.float32(0.5), "k": np.int64(3)})
    assert got == {"x": 0.5, "k": 3} and type(got["x"]) is float and type(got["k"]) is int
    for bad, needle in [({"layers": [1, 2]}, "jd.config: layers must be a number, bool or string, got list"),
                        ({"lr": float("nan")}, "jd.config: lr = nan is not finite"),
                        ({"note": "two\nlines"}, "jd.config: note must be a one-line string"),
                        ({"": 1}, "jd.config: name '' is not valid")]:  # fmt: skip
        with pytest.raises(HparamError) as info:
            check_hparams(bad)
        assert str(info.value).startswith(needle) and "\n" not in str(info.value)


def test_concurrent_writers_never_leave_a_torn_or_temporary_file(tmp_path: Path) -> None:
    rec = RunRecord.from_dict(LOCAL_V1)
    errors: list[BaseException] = []
    seen: list[int] = []

    def writer(i: int) -> None:
        try:
            for j in range(40):
                write_record(tmp_path, RunRecord.from_dict({**rec.to_dict(), "pids": [i, j]}))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def reader() -> None:
        while any(t.is_alive() for t in writers) or not seen:
            try:
                seen.append(len(read_record(tmp_path).pids))
            except JupyterDistError as exc:  # a torn file would be "damaged"; os.replace never leaves one
                errors.append(exc)

    write_record(tmp_path, rec)
    writers = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    threads = [*writers, threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert set(seen) <= {2} and seen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]  # no temporary file left behind


def test_settle_stale_leaves_live_and_cluster_runs_alone(tmp_path: Path) -> None:
    me = psutil.Process()
    live = RunRecord.from_dict({**POOL_V1, "pids": [me.pid], "started": me.create_time()})
    assert settle_stale(tmp_path, live) is live
    cluster = RunRecord.from_dict(SLURM_V1)
    assert settle_stale(tmp_path, cluster) is cluster
    gone = RunRecord.from_dict({**POOL_V1, "pids": [_dead_pid()], "started": time.time() - 10})
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank-0.exit.json").write_text(json.dumps({"code": 0}))
    settled = settle_stale(tmp_path, gone)
    assert settled.status == "failed" and settled.exit_codes == {0: 0, 1: None}
    assert "rank(s) 1 left no exit record" in (settled.reason or "")
    (tmp_path / "logs" / "rank-1.exit.json").write_text(json.dumps({"code": 0}))
    assert settle_stale(tmp_path, gone).status == "succeeded"


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---- a real SLURM run: the candidate it ran, in the record and in plan_check --------------------------------------
@pytest.mark.slow
def test_a_slurm_run_records_its_candidate_and_plan_check_compares_with_it(tmp_path: Path,
                                                                          slurm_cluster: Any) -> None:  # fmt: skip
    from conftest import cluster_train

    from jupyter_dist.launch.backends.cluster import ClusterOptions
    from jupyter_dist.launch.run import open_run
    from jupyter_dist.launch.session import start_run
    from jupyter_dist.plan import Hardware, ModelSpec, TrainingShape, plan
    from jupyter_dist.plan.hardware import get_accelerator

    hw = Hardware(accelerator=get_accelerator("cpu"), gpus_per_node=1, nodes=2)
    p = plan(ModelSpec.from_params(2e5, name="tiny"), hw, TrainingShape(precision="fp32"))
    ran = "fsdp2" if p.best.name != "fsdp2" else "ddp"
    assert ran != p.best.name and p.candidate(ran) is not None
    run = start_run(cluster_train(steps=12), backend="slurm", nproc=1, nodes=2, plan=p, strategy=ran,
                    cluster=ClusterOptions(partition="debug", time_limit="00:05:00"), runs_dir=tmp_path,
                    name="slurm_record")  # fmt: skip
    assert run.wait(240) == "succeeded", run.summary() + run.launcher_log()[-3000:]
    rec = read_record(run.dir)
    assert rec.backend == "slurm" and rec.candidate == ran and rec.strategy == ran
    assert rec.degrees == ParallelDims(dp=2) and rec.world_size == 2 and rec.exit_codes == {0: 0, 1: 0}
    assert rec.launcher["kind"] == "slurm" and rec.launcher["job_id"] == run.job_id
    assert rec.versions["python"] and rec.plan == p.to_dict()
    check = run.plan_check()
    assert check is not None and check["candidate"] == ran != p.best.name
    assert check["predicted"] is p.candidate(ran)
    again = open_run(run.dir)  # what a later kernel sees: the same candidate, from the record alone
    assert again.candidate == ran and again.plan_check()["candidate"] == ran


# ---- attaching after the kernel died ------------------------------------------------------------------------------
KERNEL = textwrap.dedent("""
    import os, signal, sys, time
    from jupyter_dist.launch.session import start_run
    code = open(sys.argv[2]).read()
    run = start_run(code, nproc=2, runs_dir=sys.argv[1], name="orphan")
    deadline = time.time() + 120
    while not run.records("step") and time.time() < deadline and not run.done:
        time.sleep(0.2)
    print(run.dir, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the kernel dies: no atexit, nobody watches the ranks any more
""")

CELL = textwrap.dedent("""
    import time
    for step in range(STEPS):
        jd.log(step, loss=1.0 / (step + 1))
        time.sleep(PAUSE)
""")


def _orphan(tmp_path: Path, steps: int, pause: float) -> Path:
    (tmp_path / "kernel.py").write_text(KERNEL)
    (tmp_path / "cell.py").write_text(CELL.replace("STEPS", str(steps)).replace("PAUSE", str(pause)))
    runs = tmp_path / "runs"
    out = subprocess.run([sys.executable, str(tmp_path / "kernel.py"), str(runs), str(tmp_path / "cell.py")],
                         capture_output=True, text=True, timeout=180, cwd=REPO)  # fmt: skip
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    return Path(out.stdout.strip().splitlines()[-1])


def _processes_of(run_dir: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid", "environ"]):
        try:
            if (proc.info["environ"] or {}).get("JD_RUN_DIR") == str(run_dir):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.slow
def test_attaching_a_run_killed_from_outside_does_not_report_it_running(tmp_path: Path) -> None:
    from jupyter_dist.launch.run import open_run

    run_dir = _orphan(tmp_path, steps=100_000, pause=0.05)
    assert read_record(run_dir).status == "running"
    live = read_record(run_dir)  # the processes still run: the check leaves the record as it is
    assert settle_stale(run_dir, live) is live
    from jupyter_dist.launch.runs import runs

    assert runs(run_dir.parent).row(run_dir.name).status == "running"
    procs = _processes_of(run_dir)
    assert len(procs) >= 3, procs  # the torchrun agent and its 2 ranks
    for proc in procs:  # from outside: no Run handle takes part
        proc.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=30)
    run = open_run(run_dir)
    assert run.status == "failed" and run.done
    assert "running (2 ranks" not in run.summary() and run.summary().startswith(f"Run {run.name}: failed (2 ranks")
    assert "ended while no kernel watched it" in run.summary()
    rec = read_record(run_dir)  # the correction is written, so every later reader agrees
    assert rec.status == "failed" and rec.exit_codes == {0: None, 1: None} and rec.ended is not None
    assert runs(run_dir.parent).row(run_dir.name).status == "failed"


@pytest.mark.slow
def test_a_run_that_finished_unwatched_attaches_as_succeeded(tmp_path: Path) -> None:
    from jupyter_dist.launch.run import open_run

    run_dir = _orphan(tmp_path, steps=30, pause=0.1)
    rec = read_record(run_dir)
    deadline = time.time() + 120
    # until the launcher has ended by the product's own test too: an exiting process has no environment left to read
    # (so _processes_of misses it) but is not a zombie yet, and under load that lasts (seen once at -n 3: "running")
    while (_processes_of(run_dir) or local_pids_alive(rec.pids, rec.started)) and time.time() < deadline:
        time.sleep(0.3)
    assert read_record(run_dir).status == "running"  # nobody settled it
    run = open_run(run_dir)
    assert run.status == "succeeded" and run.exit_codes == {0: 0, 1: 0}
    assert read_record(run_dir).status == "succeeded"
    assert len(run.metrics()) == 60  # every step of both ranks
    assert os.path.isfile(run_dir / "run.json")


# ---- the mesh as it is: DDP replicates ----------------------------------------------------------------------------
@pytest.mark.parametrize(("strategy", "world", "mesh"), [
    ("ddp", 2, "mesh: dp_replicate=2 (2 processes)"),
    ("fsdp-no-shard", 4, "mesh: dp_replicate=4 (4 processes)"),
    ("fsdp2", 2, "mesh: dp_shard=2 (2 processes)"),
    ("zero2", 2, "mesh: dp_shard=2 (2 processes)"),
    ("none", 1, "mesh: dp_replicate=1 (1 processes)"),
])  # fmt: skip
def test_the_mesh_line_names_replicas_for_strategies_that_shard_nothing(strategy: str, world: int,
                                                                        mesh: str) -> None:  # fmt: skip
    from jupyter_dist.plan.candidates import replicates, resolve_launch

    assert resolve_launch(strategy, None, world).mesh() == mesh
    assert replicates(strategy) == ("dp_replicate" in mesh)


def test_compare_and_the_summary_name_an_old_ddp_records_mesh_as_replicas(tmp_path: Path) -> None:
    from jupyter_dist.launch.run import open_run
    from jupyter_dist.ui.compare import compare

    made = []
    for name, strategy in (("old-ddp", "ddp"), ("old-fsdp2", "fsdp2")):
        d = tmp_path / name
        (d / "telemetry").mkdir(parents=True)
        write_record(d, {**LOCAL_V1, "name": name, "strategy": strategy, "candidate": strategy, "env": {},
                         "world_size": 2, "notes": ["mesh: dp_shard=2 (2 processes)"], "exit_codes": {}})  # fmt: skip
        made.append(open_run(d))
    ddp, fsdp = made
    assert ddp.mesh == "mesh: dp_replicate=2 (2 processes)" and fsdp.mesh == "mesh: dp_shard=2 (2 processes)"
    assert "\n  mesh: dp_replicate=2 (2 processes)\n" in ddp.summary() and "dp_shard" not in ddp.summary()
    header = compare(ddp, fsdp).header_html()
    assert "old-ddp (ddp): succeeded - mesh: dp_replicate=2" in header
    assert "old-fsdp2 (fsdp2): succeeded - mesh: dp_shard=2" in header and header.count("dp_shard") == 1
