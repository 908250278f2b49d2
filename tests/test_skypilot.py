"""``%%dist_train --backend skypilot`` for real: SkyPilot 0.14 launches a 2-node cluster on the local SLURM cluster.

No cloud and no mock: the SDK talks to a real API server, which provisions through SkyPilot's SLURM infrastructure
(sshd on 127.0.0.1 as the login node, two slurmd "nodes"; tests/sky_slurm.py), syncs the workdir, runs the task on
both nodes, and streams the logs back through ``sky.tail_logs``. One cluster serves the whole module (one
provisioning): notebooks/cluster_skypilot.ipynb on a real kernel launches it through the magic with a 2-node FSDP2 job
on CPU/gloo whose metrics arrive through the log stream; a DeepSpeed ZeRO-2 job across both nodes is reattached from
its run.json and stopped (``sky.cancel``); ``sky.down`` at the end. Skips where SLURM/sshd/SkyPilot are missing;
fails instead with ``JD_REQUIRE_SLURM`` (CI).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("IPython")
pytest.importorskip("torch")
from conftest import cluster_train, wait_until  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402
from sky_slurm import USER, require_sky_slurm, user_processes  # noqa: E402

from jupyter_dist.launch.run import open_run  # noqa: E402

CLUSTER = f"jd-skytest-{os.getpid() % 100_000}"  # never the name of another session's cluster
TIMES: dict[str, float] = {}


def line(extra: str = "") -> str:
    # the job user runs this kernel's Python (a real cloud would `pip install jupyter-dist` in --setup instead)
    path = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
    return (f"--backend skypilot --nodes 2 --nproc 1 --cluster {CLUSTER} --infra slurm --setup '' "
            f"--env PATH={path} --telemetry-interval 0 {extra}")  # fmt: skip


@pytest.fixture(scope="module")
def sky_cluster(slurm_cluster: Any) -> Iterator[Any]:
    """SkyPilot on the local SLURM cluster for this module; the cluster is taken down after (``sky.down``)."""
    require_sky_slurm()
    from sky_slurm import SkySlurm

    s = SkySlurm(slurm_cluster)
    s.start()
    try:
        s.seed(CLUSTER)
        yield s
    finally:
        from jupyter_dist.launch.backends.skypilot import down

        try:
            TIMES["down"] = down(CLUSTER, timeout=180)
        finally:
            s.stop()
            print("\nSkyPilot on SLURM:", {k: round(v, 1) for k, v in TIMES.items()})


@pytest.mark.slow
def test_cluster_skypilot_notebook_trains_fsdp2_on_two_nodes(tmp_path: Path, sky_cluster: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """notebooks/cluster_skypilot.ipynb on a real kernel: the magic launches the cluster and a 2-node FSDP2 job whose
    metrics come back through sky.tail_logs; then the run it left is checked in detail."""
    from test_slurm import execute_notebook

    monkeypatch.setenv("PATH", str(Path(sys.executable).parent) + ":/usr/bin:/bin")
    monkeypatch.setenv("JD_SKY_CLUSTER", CLUSTER)
    monkeypatch.setenv("JD_SKY_KEEP", "1")  # the module fixture takes the cluster down after the next test
    nb = Path(__file__).resolve().parents[1] / "notebooks" / "cluster_skypilot.ipynb"
    t0 = time.time()
    out = execute_notebook(nb, tmp_path, timeout=600)
    TIMES["notebook"] = time.time() - t0
    assert "succeeded | SkyPilot job" in out and "succeeded True" in out, out[-3000:]
    (run_dir,) = (tmp_path / "runs").glob("run-*")
    run = open_run(run_dir)
    assert run.status == "succeeded" and run.remote and run.job_id
    frame = run.metrics()
    assert set(frame["rank"]) == {0, 1} and len(frame) == 60
    for rank in (0, 1):
        losses = frame[frame["rank"] == rank].sort_values("step")["loss"].tolist()
        assert losses[-1] < 0.5 * losses[0], losses
    assert "on 2 ranks with FSDPSequential" in run.logs(0)  # the rank's own lines, from the stream
    assert run.exit_codes == {0: 0, 1: 0}
    assert "(head, rank=" not in run.launcher_log() and "\x1b[" not in run.launcher_log()
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["launcher"]["kind"] == "skypilot" and meta["launcher"]["cluster"] == CLUSTER
    from jupyter_dist.ui.dashboard import Dashboard

    assert Dashboard(run, widget=False).model.status()["step"] == 29


@pytest.mark.slow
def test_deepspeed_zero2_job_reattached_and_stopped(ip: InteractiveShell, runs: Path, sky_cluster: Any) -> None:
    code = cluster_train(100000, 0.05)
    ds = f"--strategy zero2 --env DS_ACCELERATOR=cpu --env TORCH_EXTENSIONS_DIR={sky_cluster.torch_extensions()}"
    run = ip.run_cell_magic("dist_train", line(ds), code)
    wait_until(lambda: {r["rank"] for r in run.records("step")} == {0, 1} or run.done, 400,
               "steps of the ZeRO-2 engine on both nodes")  # fmt: skip
    assert run.status == "running", run.summary() + run.launcher_log()[-3000:]
    assert {(r["strategy"], r["backend"]) for r in run.records("start")} == {("zero2", "gloo")}
    attached = open_run(run.dir)  # what %dist_attach RUN_DIR does after a kernel restart
    assert attached.remote and not attached.done and attached.job_id == run.job_id
    n = len(attached.records("step"))
    wait_until(lambda: len(attached.records("step")) > n + 4, 60, "the attached run following the job")
    t0 = time.time()
    assert attached.stop() == "stopped", attached.summary()
    TIMES["stop"] = time.time() - t0
    assert run.wait(60) == "stopped"
    import sky

    status = sky.get(sky.job_status(CLUSTER, [int(run.job_id)]))
    assert str(status[int(run.job_id)]).endswith("CANCELLED"), status
    wait_until(lambda: not [p for p in user_processes(USER) if "torch" in " ".join(p.cmdline())], 30,
               "the job's ranks ending")  # fmt: skip


class _Registry:
    """A package index that records every request (and has nothing): the job must not ask it for anything."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.requests: list[str] = []
        seen = self.requests

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                seen.append(self.path)
                self.send_error(404)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


SHIP_CELL = """import importlib.metadata
import jupyter_dist, helpers
print("JD_FILE", jupyter_dist.__file__)
print("JD_VERSION", importlib.metadata.version("jupyter-dist"))
import torch
print("TORCH", torch.__version__)
print("HELPER", helpers.scaled(jd.rank))
"""


@pytest.mark.slow
def test_default_setup_installs_the_shipped_wheel_and_the_kernels_versions(
    ip: InteractiveShell, runs: Path, sky_cluster: Any, tmp_path: Path
) -> None:
    """No --setup: the job installs jupyter-dist from the wheel in its files (never asking a registry), pins the
    kernel's versions (already there: nothing downloaded), and a cell imports a helper from --workdir on both nodes."""
    import torch

    from jupyter_dist.launch.remote_env import kernel_version, package_wheel

    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "helpers.py").write_text("def scaled(rank):\n    return 10 * (rank + 1)\n")
    (proj / ".gitignore").write_text("*.ckpt\n")
    (proj / "big.ckpt").write_bytes(b"\0" * 1000)
    wheel = package_wheel()  # what the launch ships (the package as it is now)
    registry = _Registry()
    try:
        path = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
        opts = (f"--backend skypilot --nodes 2 --nproc 1 --cluster {CLUSTER} --infra slurm --env PATH={path} "
                f"--env PIP_INDEX_URL={registry.url} --env PIP_RETRIES=0 --telemetry-interval 0 "
                f"--workdir {proj}")  # fmt: skip
        run = ip.run_cell_magic("dist_train", opts, SHIP_CELL + cluster_train(steps=10))
        assert run.wait(400) == "succeeded", run.summary() + run.launcher_log()[-3000:]
    finally:
        registry.close()
    assert registry.requests == []  # not jupyter-dist, not a pin: nothing was asked of the index
    task = (run.dir / "task.yaml").read_text()
    assert f".jd/{wheel.name}" in task and "--no-index" in task and f"torch=={torch.__version__}" in task
    assert not (run.dir / "workdir" / "big.ckpt").exists() and (run.dir / "workdir" / "helpers.py").exists()
    for rank in (0, 1):
        log = run.logs(rank)
        values = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in log.splitlines() if " " in ln}
        assert values["JD_FILE"].endswith(f"sky_workdir/{wheel.site}/jupyter_dist/__init__.py"), values["JD_FILE"]
        assert values["JD_VERSION"] == wheel.version and values["TORCH"] == torch.__version__
        assert values["TORCH"] == kernel_version("torch")
        assert values["HELPER"] == str(10 * (rank + 1))
        assert "version mismatch" not in log and "on 2 ranks" in log
    assert set(run.metrics()["rank"]) == {0, 1}


PLAIN_SCRIPT = """import argparse
import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=2)
a = p.parse_args()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(a.steps):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(f"plain rank {rank}/{world} steps {a.steps} allreduce {t.item()}")
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_plain_torch_distributed_script_on_two_skypilot_nodes(ip: InteractiveShell, runs: Path, sky_cluster: Any,
                                                              tmp_path: Path) -> None:  # fmt: skip
    script = tmp_path / "plain_ddp.py"
    script.write_text(PLAIN_SCRIPT)
    run = ip.run_line_magic("dist_train", line(f"--script {script} -- --steps 3"))
    assert run.wait(400) == "succeeded", run.summary() + run.launcher_log()[-3000:]
    assert run.exit_codes == {0: 0, 1: 0}
    for rank in (0, 1):
        assert f"plain rank {rank}/2 steps 3 allreduce 3.0" in run.logs(rank)
    assert (run.dir / "workdir" / "plain_ddp.py").read_text() == PLAIN_SCRIPT  # shipped unmodified
