"""%%dist_train and the run magics in a real IPython shell, with real torchrun processes on CPU (gloo)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
from conftest import descendants_gone

pytest.importorskip("IPython")
pytest.importorskip("torch")
from IPython.core.error import UsageError  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402

from jupyter_dist.launch.backends.local import LaunchError, LocalLauncher, find_torchrun  # noqa: E402
from jupyter_dist.launch.run import open_run  # noqa: E402
from jupyter_dist.launch.rundir import RunDir, scrub_env  # noqa: E402
from jupyter_dist.launch.session import DryRun  # noqa: E402

ALLREDUCE = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item():.0f}")
dist.destroy_process_group()
"""


# ---- pure parts -----------------------------------------------------------------------------------------------
def test_launcher_args_are_pure_and_complete(tmp_path: Path) -> None:
    lau = LocalLauncher(run_dir=RunDir(tmp_path), nproc=4, nodes=1, max_restarts=2, torchrun="/x/torchrun")
    (argv,) = lau.args()
    assert argv[:2] == ["/x/torchrun", "--standalone"]
    assert argv[argv.index("--nproc-per-node") + 1] == "4" and argv[argv.index("--max-restarts") + 1] == "2"
    assert argv[-3:] == ["-m", "jupyter_dist.launch.bootstrap", str(tmp_path / "script.py")]
    multi = LocalLauncher(run_dir=RunDir(tmp_path), nproc=2, nodes=3, port=29999).args()
    assert [a[a.index("--node-rank") + 1] for a in multi] == ["0", "1", "2"]
    assert all(a[a.index("--rdzv-endpoint") + 1] == "127.0.0.1:29999" for a in multi)
    assert lau.env()["JD_RUN_DIR"] == str(tmp_path)
    again = LocalLauncher.from_dict(lau.to_dict())
    assert again.args() == lau.args()


def test_secrets_are_scrubbed_from_run_json() -> None:
    env = scrub_env({"WANDB_API_KEY": "abc", "MY_TOKEN": "t", "LR": "0.1"})
    assert env == {"WANDB_API_KEY": "<redacted>", "MY_TOKEN": "<redacted>", "LR": "0.1"}


def test_missing_torchrun_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError, match="torchrun not found next to .* or on PATH: install PyTorch"):
        find_torchrun(python=str(tmp_path / "python"))


def test_dry_run_shows_script_configs_and_argv(ip: InteractiveShell, runs: Path) -> None:
    res = ip.run_cell_magic("dist_train", "--nproc 2 --strategy zero2 --dry-run", "print('hi')")
    assert isinstance(res, DryRun)
    text = res.to_text()
    assert "print('hi')" in text and "import jupyter_dist.worker as jd" in text
    assert "torchrun --standalone --nproc-per-node 2" in text
    ds = json.loads(res.files["ds_config.json"])
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 2
    assert res.env["JD_STRATEGY"] == "zero2"
    assert not list(runs.iterdir())  # nothing written, nothing started


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--strategy zero9", "unknown strategy 'zero9' \\(did you mean 'zero3'\\?\\); valid: auto, none, ddp"),
        ("--nproc 0", "argument --nproc: want an integer in 1..512, got '0'"),
        ("--nproc two", "argument --nproc: want an integer in 1..512, got 'two'"),
        ("--ship not_defined_anywhere", "--ship not_defined_anywhere: no variable of that name"),
        ("--plan nope", "--plan nope: no variable of that name"),
        ("--env NOEQUALS", "--env wants NAME=VALUE"),
        ("--name 'bad name'", "must be a valid Python variable name"),
        ("--timeout -1", "argument --timeout: want a finite number in \\(0, "),
        ("--launcher mpirun", "launcher 'mpirun' is not available"),
        ("--bogus", "unrecognized arguments: --bogus"),
    ],
)
def test_bad_options_are_one_line_usage_errors(ip: InteractiveShell, runs: Path, line: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        ip.run_cell_magic("dist_train", line, "pass")


def test_run_magics_without_a_run(ip: InteractiveShell) -> None:
    magics = ip.magics_manager.registry["DistMagics"]
    magics.last_run = None
    with pytest.raises(UsageError, match="no run yet in this kernel"):
        ip.run_line_magic("dist_status", "")
    with pytest.raises(UsageError, match="is not a jupyter-dist run directory"):
        ip.run_line_magic("dist_attach", "/nonexistent/run")


# ---- real processes -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_cell_runs_on_two_fresh_processes_with_shipped_notebook_objects(ip: InteractiveShell, runs: Path) -> None:
    """One launch for two properties (it was two launches): the cell runs on two fresh ranks, and ``--ship`` sends
    notebook objects (an instance of a class defined in the notebook, a list) to both."""
    ip.run_cell("class Scale:\n    def __init__(self, k):\n        self.k = k\n    def __call__(self, x):\n"
                "        return x * self.k\nscale = Scale(7)\nnumbers = [1, 2, 3]")  # fmt: skip
    ship = "print('shipped', sum(scale(n) for n in numbers), type(scale).__name__)\n"
    t0 = time.time()
    run = ip.run_cell_magic(
        "dist_train", "--nproc 2 --strategy none --name r_ok --ship scale,numbers", ship + ALLREDUCE
    )
    assert time.time() - t0 < 5, "the magic must return at once"
    assert ip.user_ns["r_ok"] is run and run.status in ("running", "succeeded")
    assert run.wait(120) == "succeeded", run.summary()
    assert run.exit_codes == {0: 0, 1: 0}
    assert "rank 1 of 2 sum 3" in run.logs(1) and "rank 0 of 2 sum 3" in run.logs(0)
    assert "shipped 42 Scale" in run.logs(0) and "shipped 42 Scale" in run.logs(1)
    meta = json.loads((run.dir / "run.json").read_text())
    assert meta["status"] == "succeeded" and meta["world_size"] == 2
    assert (run.dir / "script.py").read_text().endswith(ALLREDUCE)
    assert "succeeded" in ip.run_line_magic("dist_status", "").summary()
    assert descendants_gone(run)


@pytest.mark.slow
def test_failing_rank_is_reported_first_and_others_end(ip: InteractiveShell, runs: Path) -> None:
    code = ALLREDUCE.replace(
        "dist.all_reduce(t)",
        "import os\nif os.environ['RANK'] == '1':\n"
        "    raise ValueError('boom on rank 1')\ndist.all_reduce(t)\nimport time; time.sleep(60)",
    )
    run = ip.run_cell_magic("dist_train", "--nproc 2 --strategy none", code)
    t0 = time.time()
    assert run.wait(60) == "failed"
    assert time.time() - t0 < 30
    assert run.failed_rank() == 1 and run.exit_codes[1] == 1
    summary = run.summary()
    assert "rank 1 failed first" in summary and "ValueError: boom on rank 1" in summary
    assert "bootstrap.py" not in run.logs(1)  # the traceback starts at the user's script
    assert descendants_gone(run)


@pytest.mark.slow
def test_stop_ends_every_process(ip: InteractiveShell, runs: Path) -> None:
    run = ip.run_cell_magic(
        "dist_train", "--nproc 2 --strategy none", "import time\nprint('up', flush=True)\ntime.sleep(300)"
    )
    deadline = time.time() + 60
    while "up" not in run.logs(0) and time.time() < deadline:
        time.sleep(0.2)
    t0 = time.time()
    ip.run_line_magic("dist_stop", "")
    assert run.status == "stopped" and time.time() - t0 < 10
    assert descendants_gone(run)


@pytest.mark.slow
def test_timeout_stops_with_last_lines_per_rank(ip: InteractiveShell, runs: Path) -> None:
    code = "import os, time\nprint(f'rank {os.environ[\"RANK\"]} stuck here', flush=True)\ntime.sleep(300)"
    # the timeout counts from the launch, so it must outlast the ranks' start (torch's import) under load
    run = ip.run_cell_magic("dist_train", "--nproc 2 --strategy none --timeout 20", code)
    assert run.wait(90) == "timed out"
    meta = json.loads((run.dir / "run.json").read_text())
    assert "rank 1 stuck here" in meta["timeout_report"]["1"] and "rank 0 stuck here" in meta["timeout_report"]["0"]
    assert descendants_gone(run)


@pytest.mark.slow
def test_simulated_two_node_run_and_port_taken(ip: InteractiveShell, runs: Path) -> None:
    run = ip.run_cell_magic("dist_train", "--nproc 1 --nodes 2 --strategy none", ALLREDUCE)
    assert run.wait(120) == "succeeded", run.summary() + run.launcher_log()
    assert "rank 1 of 2 sum 3" in run.logs(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(UsageError, match=f"port {port} on 127.0.0.1 is already in use"):
            ip.run_cell_magic("dist_train", f"--nproc 1 --nodes 2 --port {port}", ALLREDUCE)


@pytest.mark.slow
def test_attach_after_a_kernel_restart(ip: InteractiveShell, runs: Path) -> None:
    run = ip.run_cell_magic("dist_train", "--nproc 2 --strategy none", "import time\ntime.sleep(4)\nprint('done')")
    reopened = open_run(run.dir)  # what a new kernel sees while the run is still going
    assert reopened.status == "running"
    assert reopened.wait(60) in ("succeeded", "failed")
    run.wait(60)
    attached = ip.run_line_magic("dist_attach", str(run.dir))
    assert attached.status == "succeeded" and attached.exit_codes == {0: 0, 1: 0}
    assert "done" in attached.logs(0)
    assert os.path.isdir(attached.dir / "telemetry")


@pytest.mark.slow
def test_kernel_interrupt_while_waiting_stops_the_run(ip: InteractiveShell, runs: Path) -> None:
    import signal
    import threading

    run = ip.run_cell_magic("dist_train", "--nproc 2 --strategy none", "import time\ntime.sleep(300)")
    timer = threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGINT))  # what Jupyter's interrupt sends
    timer.start()
    t0 = time.time()
    with pytest.raises(KeyboardInterrupt):
        run.wait()
    assert run.status == "stopped" and time.time() - t0 < 3.0 + 10
    assert descendants_gone(run)


TRAIN = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, opt = jd.wrap(model, opt)
g = torch.Generator().manual_seed(jd.rank)
X = torch.randn(256, 16, generator=g)
y = X.sum(1, keepdim=True)
for step in range(25):
    loss = torch.nn.functional.mse_loss(model(X), y)
    jd.backward(loss)
    jd.step(opt)
    jd.log(step, loss=loss)
print("final loss", float(loss), "on", jd.world_size, "ranks with", type(model).__name__)
"""


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "wrapper"), [("ddp", "DistributedDataParallel"), ("fsdp2", "FSDPSequential")])
def test_training_with_the_worker_api(ip: InteractiveShell, runs: Path, strategy: str, wrapper: str) -> None:
    run = ip.run_cell_magic("dist_train", f"--nproc 2 --strategy {strategy} --telemetry-interval 0", TRAIN)
    assert run.wait(240) == "succeeded", run.summary()
    assert run.exit_codes == {0: 0, 1: 0}
    frame = run.metrics()
    assert set(frame["rank"]) == {0, 1} and len(frame) == 50
    for rank in (0, 1):
        losses = frame[frame["rank"] == rank].sort_values("step")["loss"].tolist()
        assert losses[-1] < 0.5 * losses[0], losses
    assert f"on 2 ranks with {wrapper}" in run.logs(0)
    kinds = {r["kind"] for r in run.records()}
    assert {"start", "step", "exit"} <= kinds
    assert all(r["status"] == "ok" for r in run.records("exit"))


@pytest.mark.slow
@pytest.mark.deepspeed
def test_deepspeed_zero2_through_dist_train(ip: InteractiveShell, runs: Path) -> None:
    pytest.importorskip("deepspeed")
    code = TRAIN.replace("opt = torch.optim.AdamW(model.parameters(), lr=1e-2)", "opt = None")
    run = ip.run_cell_magic(
        "dist_train", "--nproc 2 --strategy zero2 --env DS_ACCELERATOR=cpu --timeout 600 --telemetry-interval 0", code
    )
    assert run.wait(660) == "succeeded", run.summary()
    ds = json.loads((run.dir / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 2
    frame = run.metrics()
    losses = frame[frame["rank"] == 0].sort_values("step")["loss"].tolist()
    # the config's AdamW runs at the plan's default lr (3e-4): slow, but every step must lower the loss
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert "with DeepSpeedEngine" in run.logs(0)


@pytest.mark.slow
def test_a_failing_rank_writes_an_error_exit_record(ip: InteractiveShell, runs: Path) -> None:
    run = ip.run_cell_magic(
        "dist_train",
        "--nproc 2 --strategy none",
        "jd.log(0, loss=1.0)\nif jd.rank == 1:\n    raise RuntimeError('bad batch')",
    )
    assert run.wait(120) == "failed"
    exits = {r["rank"]: r for r in run.records("exit")}
    assert exits[1]["status"] == "error" and "bad batch" in json.dumps(exits[1])
