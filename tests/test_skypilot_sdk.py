"""``%%dist_train --backend skypilot`` at the SkyPilot SDK boundary, and every generated task through SkyPilot's parser.

What only a cloud can show (provisioning, spot preemption and managed-job recovery) is tested here with the ``sky``
client functions replaced by a recorder that answers what the real API answers: request ids (``RequestId``, a
``str``), ``(job_id, handle)`` from the launch request, ``JobStatus`` / ``ManagedJobStatus`` values, and log lines
as ``sky.tail_logs(..., preload_content=False)`` yields them, with SkyPilot's ``(head, rank=0, pid=...)`` prefixes
and ANSI colours. The task handed to ``sky.launch`` is a real ``sky.Task`` built by SkyPilot's own parser. Everything
on our side (magic, launcher, run directory, log router, Run, dashboard model) is real.
"""

from __future__ import annotations

import copy
import json
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("IPython")
sky = pytest.importorskip("sky")
from conftest import wait_until  # noqa: E402
from IPython.core.error import UsageError  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402
from sky.jobs.state import ManagedJobStatus  # noqa: E402
from sky.server.common import RequestId  # noqa: E402
from sky.skylet.job_lib import JobStatus  # noqa: E402

from jupyter_dist.launch.session import DryRun  # noqa: E402
from jupyter_dist.telemetry.records import SENTINEL, encode, make_record  # noqa: E402

SECRET_VALUE = "hf_do_not_leak_0123456789"


def _records(rank: int, steps: range, seq0: int, *, attempt: int = 0) -> list[dict[str, Any]]:
    out = [make_record("start", rank=rank, seq=seq0, t=time.time(), world_size=2, host=f"node{rank}", pid=100 + rank)]
    for i, step in enumerate(steps, start=1):
        out.append(make_record("step", rank=rank, seq=seq0 + i, t=time.time(), step=step, loss=1.0 / (step + 1)))
    out.append(make_record("exit", rank=rank, seq=seq0 + len(steps) + 1, t=time.time(), status="ok", step=steps[-1]))
    del attempt
    return out


def _line(rank: int, text: str) -> str:
    """One line as SkyPilot's log tailing yields it: node prefix (node rank = torch rank here), colours, newline."""
    node = "head" if rank == 0 else f"worker{rank}"
    return f"\x1b[36m({node}, rank={rank}, pid={4000 + rank})\x1b[0m {text}\n"


def job_lines(steps: range, seq0: int = 1_700_000_000_000) -> list[str]:
    lines = [_line(0, "[rank 0] starting on 2 ranks"), _line(1, "[rank 1] starting on 2 ranks")]
    for r in (0, 1):
        lines += [_line(r, SENTINEL + encode(rec)) for rec in _records(r, steps, seq0)]
    lines.append(lines[4])  # a replayed record (rank 0's step): de-duplicated
    lines.append(_line(0, "[rank 0] final loss 0.04"))
    return lines


class SkyRecorder:
    """Stands in for the SkyPilot client: records every call, answers like the API server does."""

    def __init__(self, lines: list[str], *, statuses: list[Any] | None = None,
                 managed_statuses: list[Any] | None = None, block_tail: bool = False,
                 launch_error: BaseException | None = None, job_id: int = 3) -> None:  # fmt: skip
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.lines = lines
        self.statuses = list(statuses or [JobStatus.RUNNING])
        self.managed_statuses = list(managed_statuses or [])
        self.results: dict[str, Any] = {}
        self.block_tail = block_tail
        self.cancelled = threading.Event()
        self.tail_done = threading.Event()
        self.launch_error = launch_error
        self.job_id = job_id
        self.tasks: list[Any] = []

    def _rid(self, result: Any) -> RequestId:  # type: ignore[type-arg]
        rid = RequestId(str(uuid.uuid4()))
        self.results[str(rid)] = result
        return rid

    # ---- the client functions --------------------------------------------------------------------------------------
    def launch(self, task: Any, cluster_name: str | None = None, **kw: Any) -> RequestId:  # type: ignore[type-arg]
        self.calls.append(("launch", (task,), {"cluster_name": cluster_name, **kw}))
        self.launch_thread = threading.current_thread()  # the first SDK call may start an API server (~13 s)
        self.tasks.append(task)
        return self._rid((self.job_id, None))

    def jobs_launch(self, task: Any, name: str | None = None, **kw: Any) -> RequestId:  # type: ignore[type-arg]
        self.calls.append(("jobs.launch", (task,), {"name": name, **kw}))
        self.tasks.append(task)
        return self._rid(([self.job_id], None))

    def stream_and_get(self, request_id: Any = None, output_stream: Any = None, **kw: Any) -> Any:
        self.calls.append(("stream_and_get", (str(request_id),), kw))
        if output_stream is not None:
            output_stream.write("Considered resources (2 nodes): Slurm(cpus=1+)\n⚙︎ Launching on Slurm.\n")
        time.sleep(0.3)  # provisioning takes a while; the kernel must not wait for it
        if self.launch_error is not None:
            raise self.launch_error
        return self.results[str(request_id)]

    def get(self, request_id: Any) -> Any:
        result = self.results[str(request_id)]
        return result() if callable(result) else result

    def job_status(self, cluster_name: str, job_ids: list[int] | None = None) -> RequestId:  # type: ignore[type-arg]
        self.calls.append(("job_status", (cluster_name, job_ids), {}))

        def answer() -> dict[int, Any]:
            if self.cancelled.is_set():
                return {self.job_id: JobStatus.CANCELLED}
            if self.tail_done.is_set():
                return {self.job_id: self.statuses[-1] if len(self.statuses) > 1 else JobStatus.SUCCEEDED}
            return {self.job_id: self.statuses[0]}

        return self._rid(answer)

    def jobs_queue(self, refresh: bool, skip_finished: bool = False, all_users: bool = False,
                   job_ids: list[int] | None = None, version: int = 1) -> RequestId:  # type: ignore[type-arg]  # fmt: skip
        self.calls.append(("jobs.queue", (), {"job_ids": job_ids}))

        def answer() -> list[dict[str, Any]]:
            status = self.managed_statuses.pop(0) if len(self.managed_statuses) > 1 else self.managed_statuses[0]
            return [{"job_id": self.job_id, "status": status, "recovery_count": 1 if status in (
                ManagedJobStatus.RUNNING, ManagedJobStatus.SUCCEEDED) and not self.managed_statuses[1:] else 0}]

        return self._rid(answer)

    def tail_logs(self, cluster_name: str, job_id: int | None, follow: bool, tail: int = 0, output_stream: Any = None,
                  *, preload_content: bool = True) -> Iterator[str | None]:  # fmt: skip
        self.calls.append(("tail_logs", (cluster_name, job_id), {"follow": follow, "preload_content": preload_content}))
        assert follow and not preload_content
        return self._gen()

    def jobs_tail_logs(self, name: str | None = None, job_id: int | None = None, follow: bool = True,
                       **kw: Any) -> Iterator[str | None]:  # fmt: skip
        self.calls.append(("jobs.tail_logs", (job_id,), {"follow": follow, **kw}))
        return self._gen()

    def _gen(self) -> Iterator[str | None]:
        for line in self.lines:
            yield line
            time.sleep(0.005)
        while self.block_tail and not self.cancelled.wait(0.1):
            yield None
        self.tail_done.set()

    def cancel(self, cluster_name: str, all: bool = False, all_users: bool = False,  # noqa: A002
               job_ids: list[int] | None = None, **kw: Any) -> RequestId:  # type: ignore[type-arg]  # fmt: skip
        self.calls.append(("cancel", (cluster_name,), {"job_ids": job_ids}))
        self.cancelled.set()
        return self._rid(None)

    def jobs_cancel(self, name: str | None = None, job_ids: Any = None, **kw: Any) -> RequestId:  # type: ignore[type-arg]
        self.calls.append(("jobs.cancel", (), {"job_ids": list(job_ids or [])}))
        self.cancelled.set()
        return self._rid(None)

    def api_cancel(self, request_ids: Any = None, **kw: Any) -> RequestId:  # type: ignore[type-arg]
        self.calls.append(("api_cancel", (request_ids,), kw))
        return self._rid([str(request_ids)])

    def down(self, cluster_name: str, purge: bool = False, **kw: Any) -> RequestId:  # type: ignore[type-arg]
        self.calls.append(("down", (cluster_name,), {}))
        return self._rid(None)

    def named(self, name: str) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        return [(a, k) for n, a, k in self.calls if n == name]


@pytest.fixture()
def recorder(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Install a recorder in place of the SkyPilot client functions (the test sets its script)."""

    from jupyter_dist.launch.backends.skypilot import SkyPilotLauncher

    monkeypatch.setattr(SkyPilotLauncher, "poll_interval", 0.1)  # the recorder answers at once: poll it often

    def install(rec: SkyRecorder) -> SkyRecorder:
        for name in ("launch", "stream_and_get", "get", "job_status", "tail_logs", "cancel", "api_cancel", "down"):
            monkeypatch.setattr(sky, name, getattr(rec, name))
        for name in ("launch", "queue", "tail_logs", "cancel"):
            monkeypatch.setattr(sky.jobs, name, getattr(rec, f"jobs_{name}"))
        return rec

    return install





# ---- the SDK boundary -------------------------------------------------------------------------------------------
def test_launch_streams_metrics_back_sdk_boundary(ip: InteractiveShell, runs: Path, recorder: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("HF_TOKEN", SECRET_VALUE)
    rec = recorder(SkyRecorder(job_lines(range(5))))
    t0 = time.time()
    ip.user_ns["lr_table"] = {"warmup": 10}
    line = "--backend skypilot --nodes 2 --nproc 1 --strategy fsdp2 --cluster jd-t --infra slurm --idle-minutes 5 "
    run = ip.run_cell_magic("dist_train", line + "--down --secret HF_TOKEN --ship lr_table --name sky_run", "pass")
    assert time.time() - t0 < 5 and not run.done  # returned before the launch request finished
    assert run.wait(30) == "succeeded", run.summary()
    ((task,), kw) = rec.named("launch")[0]
    assert kw == {"cluster_name": "jd-t", "idle_minutes_to_autostop": 5, "down": True}
    assert rec.launch_thread is not threading.main_thread()  # never on the kernel's thread
    assert isinstance(task, sky.Task) and task.num_nodes == 2
    assert task.secrets["HF_TOKEN"].get_secret_value() == SECRET_VALUE  # the value reaches SkyPilot, no file
    assert Path(task.workdir) == run.dir / "workdir" and (run.dir / "workdir" / "script.py").exists()
    assert {p.name for p in (run.dir / "workdir").iterdir()} == {"script.py", "jd_bootstrap.py", "shipped.pkl", ".jd"}
    (wheel,) = (run.dir / "workdir" / ".jd").iterdir()  # the kernel's jupyter-dist, installed by the task's setup
    assert wheel.name.startswith("jupyter_dist-0.1.0+jd.") and f".jd/{wheel.name}" in task.setup
    assert rec.named("tail_logs")[0][0] == ("jd-t", 3)
    frame = run.metrics()
    assert set(frame["rank"]) == {0, 1} and len(frame) == 10  # the replayed record was dropped
    assert run.exit_codes == {0: 0, 1: 0}
    assert run.logs(0).splitlines() == ["starting on 2 ranks", "final loss 0.04"]
    assert "\x1b" not in run.launcher_log() and "(head, rank=0" not in run.launcher_log()
    assert "Launching on Slurm" in (run.dir / "logs" / "launch.log").read_text()
    for path in run.dir.rglob("*"):  # the secret's value is in no file of the run
        if path.is_file():
            assert SECRET_VALUE.encode() not in path.read_bytes(), path
    meta = json.loads((run.dir / "run.json").read_text())
    assert meta["launcher"]["job_id"] == "3" and meta["launcher"]["secrets"] == ["HF_TOKEN"]
    assert "SkyPilot job 3 on cluster jd-t" in run.summary()
    from jupyter_dist.ui.dashboard import Dashboard

    assert Dashboard(run, widget=False).model.status()["step"] == 4


def test_a_stream_cut_inside_lines_loses_no_record_sdk_boundary(ip: InteractiveShell, runs: Path,
                                                               recorder: Any) -> None:  # fmt: skip
    """SkyPilot's log stream yields chunks, not lines: a telemetry line cut between two chunks is joined again, so
    every logged row arrives (a real 2-node run kept 58 of its 60 rows when each chunk was split on its own)."""
    text = "".join(job_lines(range(5)))
    pieces = [text[i:i + 37] for i in range(0, len(text), 37)]  # 37 characters: most lines cut, some twice
    assert sum(1 for p in pieces if not p.endswith("\n")) > 10
    recorder(SkyRecorder(pieces))
    run = ip.run_cell_magic("dist_train", "--backend skypilot --nodes 2 --nproc 1 --cluster jd-t", "pass")
    assert run.wait(30) == "succeeded", run.summary()
    frame = run.metrics()
    assert set(frame["rank"]) == {0, 1} and len(frame) == 10
    assert run.logs(0).splitlines() == ["starting on 2 ranks", "final loss 0.04"]


def test_stop_cancels_the_job_sdk_boundary(ip: InteractiveShell, runs: Path, recorder: Any) -> None:
    rec = recorder(SkyRecorder(job_lines(range(3))[:4], block_tail=True))
    run = ip.run_cell_magic("dist_train", "--backend skypilot --nodes 2 --nproc 1 --cluster jd-t", "pass")
    wait_until(lambda: run.records("step") and run.status == "running", 10, "a step record, the job running")
    assert run.stop() == "stopped"
    assert rec.named("cancel") == [(("jd-t",), {"job_ids": [3]})]
    assert json.loads((run.dir / "run.json").read_text())["status"] == "stopped"


def test_a_long_job_is_polled_less_often_and_its_end_seen_at_once_sdk_boundary(
    ip: InteractiveShell, runs: Path, recorder: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each state poll is an API request the server answers over SSH on the head node: while the state stays the
    same the polls thin out (x1.5 each, up to poll_max_interval); the log stream's end wakes the watcher, so the end
    is seen at once, not after the current wait; a stop is seen at once too (test above)."""
    from jupyter_dist.launch.backends.skypilot import SkyPilotLauncher

    monkeypatch.setattr(SkyPilotLauncher, "poll_interval", 0.3)
    finish = threading.Event()

    class LongJob(SkyRecorder):
        def _gen(self) -> Iterator[str | None]:
            yield from self.lines
            while not finish.wait(0.1):
                yield None
            self.tail_done.set()  # the job ended: the stream ends, the status says SUCCEEDED

    rec = recorder(LongJob(job_lines(range(3))[:4]))
    run = ip.run_cell_magic("dist_train", "--backend skypilot --nodes 2 --nproc 1 --cluster jd-t", "pass")
    wait_until(lambda: rec.named("job_status"), 10, "the first state poll")
    time.sleep(4.0)
    polls = len(rec.named("job_status"))
    assert 4 <= polls <= 7, polls  # 0.3 s apart would be 14; thinning out: 0, 0.3, 0.75, 1.4, 2.4, 4.0 s
    t0 = time.monotonic()
    finish.set()
    assert run.wait(10) == "succeeded", run.summary()
    assert time.monotonic() - t0 < 1.5  # the wait in progress was ~2 s: the stream's end cut it short
    assert SkyPilotLauncher(run_dir=run._rd).next_poll_in(20) == SkyPilotLauncher.poll_max_interval == 30.0


def test_timeout_cancels_the_job_sdk_boundary(ip: InteractiveShell, runs: Path, recorder: Any) -> None:
    rec = recorder(SkyRecorder(job_lines(range(3))[:4], block_tail=True))
    run = ip.run_cell_magic("dist_train", "--backend skypilot --nodes 2 --nproc 1 --cluster jd-t --timeout 2", "pass")
    assert run.wait(30) == "timed out", run.summary()
    assert rec.named("cancel") == [(("jd-t",), {"job_ids": [3]})]


def test_stop_while_launching_cancels_the_request_sdk_boundary(ip: InteractiveShell, runs: Path,
                                                                 recorder: Any) -> None:  # fmt: skip
    rec = recorder(SkyRecorder([]))
    release = threading.Event()
    real = rec.stream_and_get

    def slow(request_id: Any = None, output_stream: Any = None, **kw: Any) -> Any:
        release.wait(10)
        raise RuntimeError("Request cancelled by the user")

    rec.stream_and_get = slow  # type: ignore[method-assign]
    sky.stream_and_get = slow  # monkeypatch restores the real one
    run = ip.run_cell_magic("dist_train", "--backend skypilot --nodes 2 --nproc 1", "pass")
    assert run.status == "pending"
    threading.Timer(0.5, release.set).start()
    assert run.stop() == "stopped"
    assert rec.named("api_cancel") and not rec.named("cancel")
    del real


def test_launch_failure_fails_the_run_with_the_reason_sdk_boundary(ip: InteractiveShell, runs: Path,
                                                                   recorder: Any) -> None:  # fmt: skip
    from sky import exceptions

    recorder(SkyRecorder([], launch_error=exceptions.ResourcesUnavailableError(
        "Failed to provision all possible launchable resources.\nTo keep retrying until the cluster is up, use ...")))
    run = ip.run_cell_magic("dist_train", "--backend skypilot --nodes 2 --gpus H100:8 --infra aws", "pass")
    assert run.wait(20) == "failed"
    assert "launch failed: ResourcesUnavailableError: To keep retrying" in run.summary()


def test_managed_job_preempted_then_recovered_sdk_boundary(ip: InteractiveShell, runs: Path, recorder: Any) -> None:
    first = job_lines(range(0, 3), seq0=1_700_000_000_000)[:-2]  # attempt 1: preempted after step 2, no exit record
    first = [ln for ln in first if '"kind":"exit"' not in ln]
    preempt = [_line(0, "W Cluster was preempted. Recovering (FAILOVER)...")]
    second = job_lines(range(3, 6), seq0=1_700_000_090_000)  # the recovered job resumed at step 3 on a fresh node
    statuses = [ManagedJobStatus.STARTING, ManagedJobStatus.RUNNING, ManagedJobStatus.RECOVERING,
                ManagedJobStatus.RUNNING, ManagedJobStatus.RUNNING, ManagedJobStatus.SUCCEEDED]  # fmt: skip
    rec = recorder(SkyRecorder(first + preempt + second, managed_statuses=statuses, job_id=11))
    run = ip.run_cell_magic("dist_train", "--backend skypilot --nodes 2 --nproc 1 --managed --max-restarts 2 "
                            "--checkpoint-every 1 --name managed_run", "pass")  # fmt: skip
    run._launcher.poll_interval = 0.05
    assert run.wait(30) == "succeeded", run.summary()
    ((task,), kw) = rec.named("jobs.launch")[0]
    assert kw["name"] == "jd-managed-run"
    assert task.resources and next(iter(task.resources)).job_recovery == {"strategy": "FAILOVER",
                                                                         "max_restarts_on_errors": 2}
    assert 'JD_CHECKPOINT_DIR=checkpoints/"${SKYPILOT_TASK_ID:-local}"' in task.run
    assert rec.named("jobs.tail_logs")[0][0] == (11,)
    steps = sorted(set(run.metrics()["step"]))
    assert steps == [0, 1, 2, 3, 4, 5]  # both attempts, nothing dropped as a duplicate
    assert len(run.records("start")) == 4  # 2 ranks x 2 attempts
    assert run._launcher.recoveries == 1 and "recovered 1x" in run.summary()
    from jupyter_dist.ui.dashboard import Dashboard

    assert Dashboard(run, widget=False).model.status()["restarts"] == 1  # the recovery is marked on the loss panel


def test_attach_cluster_slash_job_sdk_boundary(ip: InteractiveShell, runs: Path, recorder: Any) -> None:
    rec = recorder(SkyRecorder(job_lines(range(4)), job_id=7))
    run = ip.run_line_magic("dist_attach", "jd-other/7")  # a job this kernel never launched
    assert run.wait(20) == "succeeded", run.summary()
    assert rec.named("tail_logs")[0][0] == ("jd-other", 7)
    assert run.world_size == 2 and len(run.metrics()) == 8
    launched = ip.run_cell_magic("dist_train", "--backend skypilot --nodes 2 --nproc 1 --cluster jd-t", "pass")
    launched.wait(20)
    again = ip.run_line_magic("dist_attach", f"jd-t/{launched.job_id}")  # its run directory is found and reopened
    assert again.dir == launched.dir and again.status == "succeeded"


# ---- validation and errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "line",
    [
        "--nodes 4 --gpus H100:8 --cluster big --infra aws --spot --idle-minutes 30 --down --secret HF_TOKEN "
        "--secret WANDB_API_KEY",
        "--nodes 2 --gpus A100-80GB:4 --infra gcp/us-central1 --strategy zero3",
        "--nodes 2 --nproc 1 --strategy fsdp2 --managed --max-restarts 3 --checkpoint-dir /ckpt",
        "--nodes 2 --nproc 1 --strategy zero2 --infra slurm --setup ''",
        "--nodes 1 --gpus L4:1 --infra kubernetes",
    ],
)
def test_every_generated_task_passes_skypilots_parser(ip: InteractiveShell, runs: Path, line: str) -> None:
    res = ip.run_cell_magic("dist_train", f"--backend skypilot {line} --dry-run", "print(1)")
    assert isinstance(res, DryRun)
    cfg = yaml.safe_load(res.files["task.yaml"])
    task = sky.Task.from_yaml_config(copy.deepcopy(cfg))
    assert task.num_nodes == cfg["num_nodes"] and "jd_bootstrap.py script.py" in task.run
    assert cfg["envs"]["JD_TELEMETRY_STDOUT"] == "1" and cfg["envs"]["JD_LOG_STREAM"] == "1"
    for secret in cfg.get("secrets") or {}:
        assert cfg["secrets"][secret] is None  # by name only
    assert res.argv[0][0] == "sky" and not list(runs.iterdir())


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--gpus H100:0", "--gpus 'H100:0': write NAME[:COUNT] per node"),
        ("--gpus TPU9:8", "--gpus TPU9: not in the hardware catalog; known:"),
        ("--gpus H100:8 --nproc 4", "--nproc 4 != 8 GPUs per node from --gpus H100:8"),
        ("--cluster My_Cluster", "--cluster 'My_Cluster': 1-63 lower-case letters"),
        ("--managed --cluster c1", "--managed jobs run on clusters SkyPilot creates"),
        ("--idle-minutes -1", "argument --idle-minutes: want an integer in 0..1000000, got '-1'"),
        ("--partition debug", "--partition/--account/--time are SLURM options"),
        ("--infra 'aws; rm -rf /'", "is not a SkyPilot infra"),
        ("--secret HF_TOKEN --nodes 2 --nproc 1", "--secret HF_TOKEN: not set in this kernel's environment"),
    ],
)
def test_bad_skypilot_options_are_one_line_errors(ip: InteractiveShell, runs: Path, line: str, message: str,
                                                   monkeypatch: pytest.MonkeyPatch, recorder: Any) -> None:  # fmt: skip
    monkeypatch.delenv("HF_TOKEN", raising=False)
    rec = recorder(SkyRecorder([]))
    with pytest.raises(UsageError) as err:
        ip.run_cell_magic("dist_train", f"--backend skypilot {line}", "pass")
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not rec.named("launch")


def test_missing_skypilot_gives_the_install_hint(ip: InteractiveShell, runs: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setitem(sys.modules, "sky", None)  # import sky -> ImportError, as without the extra
    with pytest.raises(UsageError, match=r'SkyPilot is not installed: pip install "jupyter-dist\[sky\]"'):
        ip.run_cell_magic("dist_train", "--backend skypilot --nodes 2 --nproc 1", "pass")


def test_down_waits_for_the_request_sdk_boundary(recorder: Any) -> None:
    from jupyter_dist.launch.backends.skypilot import down

    rec = recorder(SkyRecorder([]))
    assert down("jd-t") < 5 and rec.named("down") == [(("jd-t",), {})]
