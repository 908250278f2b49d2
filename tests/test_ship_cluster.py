"""Existing scripts and shipped environments on real processes: locally, and on the local SLURM cluster.

* ``%dist_train --script plain.py -- ARGS`` and ``jupyter-dist launch plain.py ARGS`` run an unmodified plain
  ``torch.distributed`` script (it knows nothing of jupyter-dist) on 2 local ranks and on 2 SLURM nodes, with the
  same Run handle (exit codes, rank logs, a failing script's diagnosis).
* ``--backend slurm --ship-env`` installs the kernel's jupyter-dist wheel on each node (the ranks import it from
  there, not from this checkout) and every rank reports, before the cell runs, the packages whose version differs
  from the kernel's: the kernel's torch and cloudpickle are faked at the narrowest point (the version the launch
  contract is built from), so the real remote environment is the mismatched one.

The same on SkyPilot-on-SLURM is in test_skypilot.py (one provisioning for the module).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("IPython")
pytest.importorskip("torch")
from conftest import cluster_train  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402

PLAIN = '''"""A plain torch.distributed script: no jupyter-dist anywhere."""
import argparse
import os

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=2)
p.add_argument("--fail-rank", type=int, default=-1)
a = p.parse_args()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(a.steps):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
if rank == a.fail_rank:
    raise ValueError(f"rank {rank} gives up")
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
w = [float(x) for x in model.module.weight.detach().flatten()]
print(f"plain rank {rank}/{world} steps {a.steps} allreduce {t.item()} node {os.environ.get('SLURM_NODEID', '-')}")
print(f"weights {w}")
dist.destroy_process_group()
'''


@pytest.fixture()
def plain(tmp_path: Path) -> Path:
    path = tmp_path / "proj" / "plain.py"
    path.parent.mkdir()
    path.write_text(PLAIN)
    return path


def _weights(log: str) -> str:
    return next(line for line in log.splitlines() if line.startswith(("weights", "[rank")) and "weights" in line)


@pytest.mark.slow
def test_plain_script_runs_locally_through_the_line_magic(ip: InteractiveShell, runs: Path, plain: Path) -> None:
    run = ip.run_line_magic("dist_train", f"--nproc 2 --name plain_local --script {plain} -- --steps 3")
    assert ip.user_ns["plain_local"] is run
    assert run.wait(180) == "succeeded", run.summary() + run.logs(0)
    assert run.exit_codes == {0: 0, 1: 0}
    for rank in (0, 1):
        assert f"plain rank {rank}/2 steps 3 allreduce 3.0" in run.logs(rank)
    assert _weights(run.logs(0)).split("weights")[1] == _weights(run.logs(1)).split("weights")[1]  # DDP in sync
    assert "runpy.run_path" in (run.dir / "script.py").read_text() and str(plain) in (run.dir / "script.py").read_text()


@pytest.mark.slow
def test_failing_plain_script_gets_the_same_diagnosis(ip: InteractiveShell, runs: Path, plain: Path) -> None:
    run = ip.run_line_magic("dist_train", f"--nproc 2 --script {plain} --fail-rank 1")  # no `--`: all the script's
    assert run.wait(180) == "failed"
    assert run.exit_codes[1] == 1 and "ValueError: rank 1 gives up" in run.logs(1)
    diag = run.diagnosis()
    assert diag is not None and diag.first_rank == 1 and "rank 1 gives up" in str(diag.root), diag
    assert "ValueError: rank 1 gives up" in run.summary(), run.summary()


JD_SCRIPT = """import argparse
import torch
import jupyter_dist.worker as jd

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=5)
a = p.parse_args()
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
model, opt = jd.wrap(model, opt)
X = torch.randn(64, 4, generator=torch.Generator().manual_seed(jd.rank))
y = X.sum(1, keepdim=True)
for step in range(a.steps):
    loss = torch.nn.functional.mse_loss(model(X), y)
    jd.backward(loss)
    jd.step(opt)
    jd.log(step, loss=loss)
"""


@pytest.mark.slow
def test_script_using_jd_feeds_the_same_metrics(ip: InteractiveShell, runs: Path, tmp_path: Path) -> None:
    script = tmp_path / "jd_train.py"
    script.write_text(JD_SCRIPT)
    run = ip.run_line_magic("dist_train", f"--nproc 2 --strategy ddp --telemetry-interval 0 --script {script} "
                                          "--steps 6")  # fmt: skip
    assert run.wait(180) == "succeeded", run.summary() + run.logs(0)
    frame = run.metrics()
    assert set(frame["rank"]) == {0, 1} and len(frame) == 12 and frame["step"].max() == 5
    assert {r["strategy"] for r in run.records("start")} == {"ddp"}


def test_script_magic_errors_are_one_line(ip: InteractiveShell, runs: Path, plain: Path) -> None:
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="needs a file"):
        ip.run_line_magic("dist_train", "--nproc 2 --script")
    with pytest.raises(UsageError, match="no such file"):
        ip.run_line_magic("dist_train", "--nproc 2 --script /no/such.py")
    with pytest.raises(UsageError, match="runs a script"):
        ip.run_line_magic("dist_train", "--nproc 2")
    with pytest.raises(UsageError, match="use %dist_train"):
        ip.run_cell_magic("dist_train", f"--script {plain}", "print(1)")


@pytest.mark.slow
def test_jupyter_dist_launch_runs_the_script_and_exits_with_its_status(tmp_path: Path, plain: Path) -> None:
    cmd = [sys.executable, "-m", "jupyter_dist.cli", "launch", "--nproc", "2", "--runs-dir", str(tmp_path / "runs")]
    ok = subprocess.run([*cmd, str(plain), "--steps", "2"], capture_output=True, text=True, timeout=300, check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "run directory:" in ok.stdout and "succeeded" in ok.stdout
    (run_dir,) = (tmp_path / "runs").glob("launch-*")
    assert "plain rank 1/2 steps 2 allreduce 3.0" in (run_dir / "logs" / "rank-1.log").read_text()
    bad = subprocess.run([*cmd, str(plain), "--fail-rank", "0"], capture_output=True, text=True, timeout=300,
                         check=False)  # fmt: skip
    assert bad.returncode == 1 and "rank 0 gives up" in bad.stdout, bad.stdout + bad.stderr
    dry = subprocess.run([*cmd, "--dry-run", str(plain), "--steps", "9"], capture_output=True, text=True, timeout=120,
                         check=True)  # fmt: skip
    assert "'--steps', '9'" in dry.stdout and "torchrun" in dry.stdout


@pytest.mark.slow
def test_plain_script_on_two_slurm_nodes(ip: InteractiveShell, runs: Path, plain: Path, slurm_cluster: Any) -> None:
    """``%dist_train --script`` and ``jupyter-dist launch`` run an unmodified script on two SLURM nodes."""
    run = ip.run_line_magic("dist_train", f"--backend slurm --nodes 2 --nproc 1 --time 00:05:00 --script {plain} "
                                          "-- --steps 4")  # fmt: skip
    assert run.remote and run.job_id
    assert run.wait(240) == "succeeded", run.summary() + run.launcher_log()[-3000:]
    assert run.exit_codes == {0: 0, 1: 0}
    assert "plain rank 0/2 steps 4 allreduce 3.0 node 0" in run.logs(0)
    assert "plain rank 1/2 steps 4 allreduce 3.0 node 1" in run.logs(1)
    # the same script through `jupyter-dist launch` on the same cluster (one cluster start for both): it submits the
    # job, follows it to its end and exits with its status
    cli = [sys.executable, "-m", "jupyter_dist.cli", "launch", "--backend", "slurm", "--runs-dir", str(runs / "cli")]
    cmd = [*cli, "--nodes", "2", "--nproc", "1", "--time", "00:05:00", "--name", "cli_slurm", str(plain), "--steps=3"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "run directory:" in res.stdout and "succeeded (2 ranks" in res.stdout, res.stdout
    (run_dir,) = (runs / "cli").glob("cli_slurm-*")
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["launcher"]["kind"] == "slurm" and meta["status"] == "succeeded", meta
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert f"plain rank {rank}/2 steps 3 allreduce 3.0 node {rank}" in log, log


@pytest.mark.slow
def test_slurm_ship_env_installs_the_wheel_per_node_and_reports_mismatches(
    ip: InteractiveShell, runs: Path, slurm_cluster: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The nodes import the shipped wheel, not this checkout; the kernel's (faked) torch and cloudpickle versions
    differ from the nodes' real ones (an old environment: ``--setup true`` replaces the pins, the wheel is still
    installed): each rank names both, before the cell's first line runs."""
    from jupyter_dist.launch import remote_env

    real = remote_env.kernel_version
    fake = {"torch": "2.0.1", "cloudpickle": "2.2.0"}
    monkeypatch.setattr(remote_env, "kernel_version", lambda name: fake.get(name) or real(name))
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "helpers.py").write_text("SCALE = 0.5\n")
    wheel = remote_env.package_wheel()
    cell = ("print('cell starts')\nimport jupyter_dist, helpers\nprint('JD_FILE', jupyter_dist.__file__)\n"
            "print('SCALE', helpers.SCALE)\n" + cluster_train(steps=5))  # fmt: skip
    run = ip.run_cell_magic("dist_train", f"--backend slurm --nodes 2 --nproc 1 --time 00:05:00 --ship-env "
                                          f"--setup true --workdir {proj} --telemetry-interval 0", cell)  # fmt: skip
    assert run.wait(240) == "succeeded", run.summary() + run.launcher_log()[-3000:] + run.logs(0)
    for rank in (0, 1):
        log = run.logs(rank)
        lines = log.splitlines()
        mism = [i for i, ln in enumerate(lines) if "version mismatch" in ln]
        assert [lines[i] for i in mism] == [
            f"jupyter-dist: version mismatch: torch {real('torch')} here, 2.0.1 in the kernel",
            f"jupyter-dist: version mismatch: cloudpickle {real('cloudpickle')} here, 2.2.0 in the kernel",
        ], log
        assert mism[-1] < lines.index("cell starts"), log  # reported before the cell ran
        jd_file = next(ln for ln in lines if ln.startswith("JD_FILE")).split()[1]
        assert jd_file == str(run.dir / f"{wheel.site}-node{rank}" / "jupyter_dist" / "__init__.py"), jd_file
        assert "SCALE 0.5" in log and "on 2 ranks" in log
    assert (run.dir / ".jd" / wheel.name).exists()
    sbatch = (run.dir / "job.sbatch").read_text()
    assert "--no-index --no-deps" in sbatch and "torch==" not in sbatch  # --setup replaced the pins
    assert "JD_VERSIONS=" in sbatch and "torch=2.0.1" in sbatch
