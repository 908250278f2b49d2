"""``%%dist_train --backend slurm``: a real SLURM cluster on this machine (munged, slurmctld, two slurmd "nodes").

The cluster comes from the session fixture ``slurm_cluster`` (tests/slurm_cluster.py): it skips where SLURM is not
installed, and fails instead when ``JD_REQUIRE_SLURM`` is set (``.ci/run`` sets it). Jobs are submitted through the
magic in a real IPython shell, run torchrun with gloo on CPU, and are followed through ``squeue``/``scontrol``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import cluster_train, descendants_gone, wait_until

pytest.importorskip("IPython")
pytest.importorskip("torch")
from IPython.core.error import UsageError  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402

from jupyter_dist.launch.backends.slurm import SlurmLauncher, slurm_state  # noqa: E402
from jupyter_dist.launch.backends.stream import LogRouter, clean_line  # noqa: E402
from jupyter_dist.launch.run import open_run  # noqa: E402
from jupyter_dist.launch.session import DryRun  # noqa: E402


def squeue_ids() -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=15, check=False)
    return out.stdout.split()





# ---- pure parts and errors (no cluster needed) ---------------------------------------------------------------
def test_dry_run_shows_the_sbatch_script_and_submits_nothing(ip: InteractiveShell, runs: Path) -> None:
    line = "--backend slurm --nodes 2 --nproc 1 --strategy fsdp2 --partition gpu --account proj --time 00:30:00"
    line += " --dry-run"
    res = ip.run_cell_magic("dist_train", line, "print('hi')")
    assert isinstance(res, DryRun)
    sbatch = res.files["job.sbatch"]
    for expected in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=gpu",
                     "#SBATCH --account=proj", "#SBATCH --time=00:30:00", "--node-rank \"${SLURM_NODEID}\"",
                     "jd_bootstrap.py", "JD_STRATEGY=fsdp2", 'JD_CHECKPOINT_DIR='):  # fmt: skip
        assert expected in sbatch, expected
    assert "--gpus-per-node" not in sbatch  # CPU processes (gloo): no GPU to allocate
    assert res.argv[0][:2] == ["sbatch", "--parsable"] and res.argv[0][-1].endswith("job.sbatch")
    assert "print('hi')" in res.script
    assert not list(runs.iterdir())


def test_a_plan_sets_nodes_gpus_strategy_and_precision(ip: InteractiveShell, runs: Path) -> None:
    ip.user_ns["p7b"] = ip.run_line_magic("dist_plan", "--model llama-2-7b --gpu h100-80gb --nodes 2")
    res = ip.run_cell_magic("dist_train", "--backend slurm --plan p7b --dry-run", "pass")
    sbatch = res.files["job.sbatch"]
    assert "#SBATCH --nodes=2" in sbatch and "#SBATCH --gpus-per-node=8" in sbatch and "--nproc-per-node 8" in sbatch
    assert res.env["JD_STRATEGY"] == ip.user_ns["p7b"].best.strategy and res.env["JD_PRECISION"] == "bf16-mixed"
    with pytest.raises(UsageError, match=r"--plan is for 2 node\(s\) x 8 GPU\(s\), the run asks for 3 x 8: pass"):
        ip.run_cell_magic("dist_train", "--backend slurm --plan p7b --nodes 3 --dry-run", "pass")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--backend slurm --gpus H100:8", "are SkyPilot options; with --backend slurm use --partition"),
        ("--backend slurm --time soon", "--time 'soon': write HH:MM:SS"),
        ("--backend slurm --partition 'a b'", "--partition 'a b' may only hold letters"),
        ("--backend slurm --launcher deepspeed", "cluster back-ends start torchrun on every node"),
        ("--backend slurm --hang-timeout 5", "--hang-timeout watches local ranks only"),
        ("--backend slurm --env HF_TOKEN=x", "looks like a secret: pass it with --secret HF_TOKEN"),
        ("--backend slurm --secret 9X", "--secret '9X' is not an environment variable name"),
        ("--backend slurm --secret JD_NOT_SET_ANYWHERE", "--secret JD_NOT_SET_ANYWHERE: not set in this kernel's"),
        ("--partition debug", "--partition need --backend slurm or skypilot"),
        ("--backend pbs", "argument --backend: invalid choice: 'pbs'"),
    ],
)
def test_bad_cluster_options_are_one_line_errors(ip: InteractiveShell, runs: Path, line: str, message: str) -> None:
    with pytest.raises(UsageError, match=None) as err:
        ip.run_cell_magic("dist_train", line, "pass")
    assert message in str(err.value), str(err.value)
    assert "\n" not in str(err.value)
    assert not list(runs.iterdir())


def test_missing_sbatch_says_how_to_get_it(ip: InteractiveShell, runs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(runs))  # no SLURM client here
    with pytest.raises(UsageError, match=r"sbatch not found on PATH: install the SLURM client tools .*slurm-client.* "
                                         r"or run the notebook on a login node"):  # fmt: skip
        ip.run_cell_magic("dist_train", "--backend slurm --nodes 2", "pass")


def test_slurm_states_and_launcher_round_trip(tmp_path: Path) -> None:
    raw = ("PENDING", "RUNNING", "COMPLETED", "CANCELLED by 0", "TIMEOUT", "NODE_FAIL", "FAILED", "", "WEIRD")
    assert [slurm_state(s) for s in raw] == [
        "pending", "running", "succeeded", "stopped", "timed out", "failed", "failed", "unknown", "unknown"]
    from jupyter_dist.launch.base import launcher_from_dict
    from jupyter_dist.launch.rundir import RunDir

    lau = SlurmLauncher(run_dir=RunDir(tmp_path), script="#!/bin/bash\n", job_name="x", nodes=2, partition="debug",
                        job_id="42", state="running")  # fmt: skip
    (tmp_path / "job.sbatch").write_text(lau.script)
    again = launcher_from_dict(json.loads(json.dumps(lau.to_dict())))
    assert isinstance(again, SlurmLauncher)
    assert (again.job_id, again.nodes, again.partition, again.args()) == ("42", 2, "debug", lau.args())


def test_log_router_writes_rank_logs_and_deduplicated_records(tmp_path: Path) -> None:
    from jupyter_dist.launch.rundir import RunDir

    rd = RunDir(tmp_path).create()
    rec = {"v": 1, "kind": "step", "rank": 1, "seq": 0, "t": 1.0, "step": 0, "loss": 2.5}
    line = "(worker1, rank=1, pid=77) \x1b[32m@@JD@@" + json.dumps(rec) + "\x1b[0m"
    router = LogRouter(rd)
    router(["(head, rank=0, pid=12) [rank 0] hello", line, line, "(head, rank=0, pid=12) torchrun says hi", "{torn"])
    router.close()
    assert (tmp_path / "logs" / "rank-0.log").read_text() == "hello\n"
    assert json.loads((tmp_path / "telemetry" / "rank-1.jsonl").read_text()) == rec  # once, not twice
    assert "torchrun says hi" in (tmp_path / "logs" / "launcher.log").read_text()
    again = LogRouter(rd)  # a reattach replays the stream: nothing is written twice
    again([line])
    again.close()
    assert len((tmp_path / "telemetry" / "rank-1.jsonl").read_text().splitlines()) == 1
    assert clean_line("(head, rank=0, pid=5) \x1b[1mx\x1b[0m\r\n") == "x"


# ---- a real cluster ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_unknown_partition_is_named_with_the_valid_ones(ip: InteractiveShell, runs: Path, slurm_cluster: Any) -> None:
    with pytest.raises(UsageError, match=r"SLURM partition 'nope' does not exist on this cluster; partitions: debug"):
        ip.run_cell_magic("dist_train", "--backend slurm --nodes 2 --partition nope", "pass")
    with pytest.raises(UsageError, match=r"^--nodes 3: SLURM partition 'debug' has 2 node\(s\), the job could never"):
        ip.run_cell_magic("dist_train", "--backend slurm --nodes 3", "pass")  # the cluster has 2
    failed = sorted(runs.glob("run-*"))
    assert len(failed) == 2 and all(json.loads((d / "run.json").read_text())["status"] == "failed" for d in failed)
    assert not squeue_ids()  # nothing was submitted


@pytest.mark.slow
def test_fsdp2_on_two_slurm_nodes_through_the_magic(ip: InteractiveShell, runs: Path, slurm_cluster: Any) -> None:
    t0 = time.time()
    run = ip.run_cell_magic("dist_train", "--backend slurm --nodes 2 --nproc 1 --strategy fsdp2 --partition debug "
                            "--time 00:05:00 --telemetry-interval 0 --name slurm_run", cluster_train())  # fmt: skip
    submitted = time.time() - t0
    assert ip.user_ns["slurm_run"] is run and run.remote and run.job_id
    wait_until(lambda: run.records("step") or run.done, 120, "a first step record")
    first_metric = time.time() - t0
    assert run.wait(180) == "succeeded", run.summary() + run.launcher_log()[-3000:]
    print(f"\nSLURM: submitted in {submitted:.2f} s, first metric at {first_metric:.1f} s, done at "
          f"{time.time() - t0:.1f} s")  # fmt: skip
    assert run.exit_codes == {0: 0, 1: 0}
    frame = run.metrics()
    assert set(frame["rank"]) == {0, 1} and len(frame) == 50
    for rank in (0, 1):
        losses = frame[frame["rank"] == rank].sort_values("step")["loss"].tolist()
        assert losses[-1] < 0.5 * losses[0], losses
    hosts = {r["host"] for r in run.records("start")}
    assert len(run.records("start")) == 2, hosts
    assert "on 2 ranks with FSDPSequential" in run.logs(0)
    meta = json.loads((run.dir / "run.json").read_text())
    assert meta["status"] == "succeeded" and meta["backend"] == "slurm"
    assert meta["launcher"]["kind"] == "slurm" and meta["launcher"]["job_id"] == run.job_id
    assert (run.dir / "job.sbatch").read_text().startswith("#!/bin/bash")
    assert "SLURM job" in run.summary() and run.job_id not in squeue_ids()
    from jupyter_dist.ui.dashboard import Dashboard

    dash = Dashboard(run, widget=False)  # the panels' model, from the telemetry the job wrote
    status = dash.model.status()
    assert status["step"] == 24 and status["world_size"] == 2 and status["records"] >= 50, status
    assert "loss" in json.dumps(dash.model.line_figures(), default=str)


@pytest.mark.slow
def test_stop_cancels_the_job_and_leaves_no_process(ip: InteractiveShell, runs: Path, slurm_cluster: Any) -> None:
    run = ip.run_cell_magic("dist_train", "--backend slurm --nodes 2 --nproc 1 --strategy ddp --telemetry-interval 0",
                            cluster_train(steps=10_000, pause=0.05))  # fmt: skip
    wait_until(lambda: run.records("step") or run.done, 120, "a first step record")
    assert run.status == "running", run.summary()
    assert run.stop() == "stopped"
    wait_until(lambda: run.job_id not in squeue_ids(), 30, "the job leaving the queue")
    assert descendants_gone(run, within=30), "ranks of the cancelled job are still alive"
    assert json.loads((run.dir / "run.json").read_text())["status"] == "stopped"


@pytest.mark.slow
def test_reattach_from_run_json_in_a_new_process(ip: InteractiveShell, runs: Path, slurm_cluster: Any) -> None:
    run = ip.run_cell_magic("dist_train", "--backend slurm --nodes 2 --nproc 1 --strategy ddp --telemetry-interval 0",
                            cluster_train(steps=40, pause=0.1))  # fmt: skip
    wait_until(lambda: json.loads((run.dir / "run.json").read_text()).get("status") == "running" or run.done, 60,
               "the job running")  # fmt: skip
    # a fresh interpreter (the kernel after a restart) reattaches through %dist_attach and follows the job to its end
    code = (
        "import sys\n"
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "ip = InteractiveShell.instance(); ip.run_line_magic('load_ext', 'jupyter_dist')\n"
        "run = ip.run_line_magic('dist_attach', sys.argv[1])\n"
        "assert run.remote and not run.done, run.summary()\n"
        "print('STATUS', run.wait(120), len(run.metrics()), run.job_id)\n"
    )  # fmt: skip
    res = subprocess.run([sys.executable, "-c", code, str(run.dir)], capture_output=True, text=True, timeout=150,
                         env=os.environ.copy(), check=False)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"STATUS succeeded 80 {run.job_id}" in res.stdout, res.stdout + res.stderr
    assert run.wait(30) == "succeeded"
    assert open_run(run.dir).status == "succeeded"


@pytest.mark.slow
def test_timeout_cancels_the_slurm_job(ip: InteractiveShell, runs: Path, slurm_cluster: Any) -> None:
    run = ip.run_cell_magic("dist_train", "--backend slurm --nodes 2 --nproc 1 --timeout 4",
                            "import time\nfor i in range(600):\n    time.sleep(0.1)\n")  # fmt: skip
    assert run.wait(60) == "timed out", run.summary()
    wait_until(lambda: run.job_id not in squeue_ids(), 30, "the job leaving the queue")
    assert descendants_gone(run, within=30)


@pytest.mark.slow
def test_a_failing_cell_fails_the_job_with_a_diagnosis(ip: InteractiveShell, runs: Path, slurm_cluster: Any) -> None:
    run = ip.run_cell_magic("dist_train", "--backend slurm --nodes 2 --nproc 1",
                            "import torch.distributed as dist\ndist.init_process_group('gloo')\n"
                            "if jd.rank == 1:\n    raise ValueError('bad batch')\ndist.barrier()\n")  # fmt: skip
    assert run.wait(120) == "failed", run.summary()
    assert run.exit_codes[1] == 1
    assert "ValueError: bad batch" in run.summary()


def execute_notebook(path: Path, workdir: Path, timeout: int = 600) -> Any:
    """Run every cell of ``path`` on a fresh python3 kernel (this environment) in ``workdir``; errors fail."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=timeout, store_widget_state=True,
                                     resources={"metadata": {"path": str(workdir)}})  # fmt: skip
    client.execute()
    text = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            assert out.get("output_type") != "error", "".join(out.get("traceback", []))
            text.append(out.get("text", "") or str(out.get("data", {}).get("text/plain", "")))
    return "\n".join(text)


@pytest.mark.slow
def test_cluster_slurm_notebook_runs_against_the_local_cluster(tmp_path: Path, slurm_cluster: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    nb = Path(__file__).resolve().parents[1] / "notebooks" / "cluster_slurm.ipynb"
    out = execute_notebook(nb, tmp_path, timeout=300)
    assert "succeeded | job" in out and "exit codes {0: 0, 1: 0}" in out, out[-3000:]
    assert "final loss" in out and "succeeded True 60" in out, out[-3000:]
