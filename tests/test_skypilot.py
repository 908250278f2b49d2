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
