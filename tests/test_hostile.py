"""Hostile and careless input (issue 16): the CLI, the magics, --hf-config files, run directories.

Each probe must get a one-line answer naming what is wrong and what is valid, never a traceback or a hang, and leave
no process behind. The probes that start torchrun (a cell printing 50 MB, forking, ignoring SIGTERM, ``os._exit`` on
one rank, a run directory deleted while live) and the pool's control channel are in ``test_hostile_runs.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from jupyter_dist.errors import JupyterDistError
from jupyter_dist.launch.run import Run, open_run
from jupyter_dist.launch.rundir import MAX_NAME, RunDir, new_run_dir

EXE = str(Path(sys.executable).parent / "jupyter-dist")
LONG = "a" * 300


def cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """The installed console script, as a user's shell runs it (a hang fails the test through ``timeout``)."""
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(res: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# ---- the CLI: nonsense, huge, negative, zero, NaN/inf and unicode values ------------------------------------------
PLAN = ("plan", "--model", "gpt2")
CLI_CASES = [
    ((*PLAN, "--layers", "nan"), "argument --layers: want an integer in 1..2147483647, got 'nan'"),
    ((*PLAN, "--layers", "99999999999999999999999"), "argument --layers: want an integer in 1..2147483647"),
    ((*PLAN, "--hidden", "-4096"), "argument --hidden: want an integer in 1.."),
    ((*PLAN, "--heads", "0"), "argument --heads: want an integer in 1.."),
    ((*PLAN, "--vocab", "1e5"), "argument --vocab: want an integer in 1..2147483647, got '1e5'"),
    ((*PLAN, "--micro-batch", "-1"), "argument --micro-batch: want an integer in 1.."),
    ((*PLAN, "--seq-len", "inf"), "argument --seq-len: want an integer in 1.."),
    ((*PLAN, "--seq-len", "\u0662\u0660\u0664\u0668x"), "argument --seq-len: want an integer"),
    ((*PLAN, "--nodes", "0"), "argument --nodes: want an integer in 1..1048576"),
    ((*PLAN, "--gpus-per-node", "100000"), "argument --gpus-per-node: want an integer in 1..1024"),
    ((*PLAN, "--gpu-tflops", "nan"), "argument --gpu-tflops: want a finite number in (0, 1e+09]"),
    ((*PLAN, "--gpu-tflops=-inf"), "argument --gpu-tflops: want a finite number"),
    ((*PLAN, "--min-headroom", "1.5"), "argument --min-headroom: want a finite number in [0, 1]"),
    ((*PLAN, "--efficiency", "0"), "argument --efficiency: want a finite number in (0, 1]"),
    ((*PLAN, "--tp", "-2"), "argument --tp: want an integer in 1.."),
    ((*PLAN, "--gpu", "\u202eh100"), "unknown GPU"),
    ((*PLAN, "--gpu-memory", "nanGiB"), "is not a size"),
    (("plan", "--params", "inf"), "params"),
    (("plan", "--model", LONG), "unknown model"),
    (("config", "--model", "gpt2", "--lr", "nan"), "argument --lr: want a finite number in (0, 1000]"),
    (("config", "--model", "gpt2", "--grad-clip", "inf"), "argument --grad-clip: want a finite number"),
    (("config", "--model", "gpt2", "--max-restarts", "-1"), "argument --max-restarts: want an integer in 0..1000"),
    (("config", "--model", "gpt2", "--master-port", "70000"), "argument --master-port: want an integer in 1..65535"),
    (("config", "--model", "gpt2", "--name", "../../etc"), "name '../../etc' must be 1-63 lower-case letters"),
    (("config", "--model", "gpt2", "--name", "a/b"), "must be 1-63 lower-case letters"),
    (("config", "--model", "gpt2", "--name", LONG), "must be 1-63 lower-case letters"),
    (("config", "--model", "gpt2", "--env", "=x"), "--env wants NAME=VALUE"),
    (("check", "--nproc", "100000"), "argument --nproc: want an integer in 1..512, got '100000'"),
    (("check", "--nproc", "0"), "argument --nproc: want an integer in 1..512"),
    (("check", "--nodes", "-1"), "argument --nodes: want an integer in 1..64"),
    (("check", "--timeout", "nan"), "argument --timeout: want a finite number in (0, 604800]"),
    (("check", "--timeout", "-5"), "argument --timeout: want a finite number"),
    (("check", "--iters", "0"), "argument --iters: want an integer in 1..1000000"),
    (("demo", "--nproc", "-3"), "argument --nproc: want an integer in 1..512"),
    (("demo", "--steps", "1e9"), "argument --steps: want an integer in 1..10000000"),
    (("demo", "--strategy", "zero9"), "--strategy 'zero9' is not one of auto"),
]


@pytest.mark.parametrize(("args", "message"), CLI_CASES, ids=[" ".join(a)[:60] for a, _ in CLI_CASES])
def test_cli_bad_values_are_one_line_errors(args: tuple[str, ...], message: str) -> None:
    assert_one_line_error(cli(*args), message)


def test_cli_piped_into_head_ends_without_a_traceback() -> None:
    """``jupyter-dist plan --all | head -1``: the reader leaves early (EPIPE); exit 141 quietly, as a shell tool."""
    proc = subprocess.Popen([EXE, "plan", "--model", "llama-2-70b", "--nodes", "64", "--all", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(10)
    proc.stdout.close()  # like `head -c 10`
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) in (0, 141)  # 0 when everything fitted in the pipe before it closed
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


# ---- hostile --hf-config files ------------------------------------------------------------------------------------
LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 100}


def _hf_cases(d: Path) -> list[tuple[str, str]]:
    """(path, expected message) for every hostile config; files are made here."""
    cases: list[tuple[str, str]] = []

    def put(name: str, data: bytes, message: str) -> None:
        (d / name).write_bytes(data)
        cases.append((str(d / name), message))

    put("invalid.json", b'{"hidden_size": 4096,', "is not valid JSON")
    put("list.json", b"[1, 2]", "must be a JSON object")
    put("deep.json", b"[" * 200_000 + b"]" * 200_000, "nested too deeply")
    put("digits.json", b'{"hidden_size": ' + b"9" * 100_000 + b"}", "a number with thousands of digits")
    put("huge-dim.json", json.dumps({**LLAMA, "hidden_size": 10**30}).encode(), "model hidden must be at most")
    put("negative.json", json.dumps({**LLAMA, "num_hidden_layers": -3}).encode(), "layers must be a positive integer")
    put("float.json", json.dumps({**LLAMA, "hidden_size": 64.5}).encode(), "must be an integer, got 64.5")
    put("nan.json", json.dumps({**LLAMA, "hidden_size": float("nan")}).encode(), "must be an integer, got nan")
    put("missing.json", b'{"model_type": "llama"}', "has no layers: expected one of the keys")
    put("dropout.json", json.dumps({**LLAMA, "attention_dropout": [1]}).encode(), "attention_dropout must be a number")
    put("latin1.json", '{"name": "caf\xe9"}'.encode("latin-1"), "it is not UTF-8 text")
    big = d / "100mb.json"  # sparse: 100 MB on paper, nothing on disk; it must be refused before it is read
    with open(big, "wb") as fh:
        fh.truncate(100 << 20)
    cases.append((str(big), "a Hugging Face config.json is at most 4 MiB"))
    (d / "empty-folder").mkdir()
    cases.append((str(d / "empty-folder"), "Hugging Face config not found"))
    (d / "folder-config" / "config.json").mkdir(parents=True)
    cases.append((str(d / "folder-config"), "is not a regular file (a folder, device, pipe or socket)"))
    os.mkfifo(d / "fifo.json")  # nobody writes to it: open() would block forever
    cases.append((str(d / "fifo.json"), "is not a regular file"))
    cases.append(("/dev/zero", "/dev/zero is not a regular file"))  # endless: reading it would fill the memory
    cases.append((str(d / "nope.json"), "Hugging Face config not found"))
    return cases


def test_hostile_hf_config_files_are_refused_in_one_line_fast(tmp_path: Path) -> None:
    for path, message in _hf_cases(tmp_path):
        t0 = time.monotonic()
        res = cli("plan", "--hf-config", path, timeout=30)
        assert_one_line_error(res, message)
        assert time.monotonic() - t0 < 20, path


def test_hostile_hf_config_in_the_magic(ip: InteractiveShell, tmp_path: Path) -> None:
    for path, message in _hf_cases(tmp_path):
        with pytest.raises(UsageError) as info:
            ip.run_line_magic("dist_plan", f"--hf-config '{path}'")
        assert message in str(info.value) and "\n" not in str(info.value), (path, str(info.value))


def test_hf_config_with_a_nul_in_the_path(tmp_path: Path) -> None:
    from jupyter_dist.plan import ModelSpec

    with pytest.raises(JupyterDistError, match="embedded null byte"):
        ModelSpec.from_hf_config(str(tmp_path) + "/a\x00b.json")


# ---- the magics ---------------------------------------------------------------------------------------------------
TRAIN_CASES = [
    ("--nproc 0", "argument --nproc: want an integer in 1..512, got '0'"),
    ("--nproc -1", "argument --nproc: want an integer in 1..512"),
    ("--nproc 100000", "argument --nproc: want an integer in 1..512, got '100000'"),
    ("--nproc nan", "argument --nproc: want an integer in 1..512, got 'nan'"),
    ("--nproc ²", "argument --nproc: want an integer"),
    ("--nodes 0", "argument --nodes: want an integer in 1..1024"),
    ("--nodes 99999999999999999999", "argument --nodes: want an integer in 1..1024"),
    ("--timeout nan", "argument --timeout: want a finite number in (0, 2.592e+06]"),
    ("--timeout inf", "argument --timeout: want a finite number"),
    ("--timeout 0", "argument --timeout: want a finite number in (0,"),
    ("--timeout -1", "argument --timeout: want a finite number"),
    ("--hang-timeout nan", "argument --hang-timeout: want a finite number in (0,"),
    ("--hang-timeout -3", "argument --hang-timeout: want a finite number"),
    ("--heartbeat inf", "argument --heartbeat: want a finite number in [0, 3600]"),
    ("--telemetry-interval nan", "argument --telemetry-interval: want a finite number"),
    ("--max-restarts -1", "argument --max-restarts: want an integer in 0..1000"),
    ("--port 80", "argument --port: want an integer in 1024..65535"),
    ("--port 70000", "argument --port: want an integer in 1024..65535"),
    ("--checkpoint-every 0", "argument --checkpoint-every: want an integer in 1.."),
    ("--keep -1", "argument --keep: want an integer in 1..1000000"),
    ("--name a/b", "--name 'a/b' must be a valid Python variable name"),
    ("--name ..", "--name '..' must be a valid Python variable name"),
    ("--name ../../etc/passwd", "must be a valid Python variable name"),
    ("--name 'a\x00b'", "must be a valid Python variable name"),
    ("--name ''", "must be a valid Python variable name"),
    ("--strategy zero9", "unknown strategy 'zero9' (did you mean 'zero3'?); valid: auto"),
    ("--launcher mpirun", "launcher 'mpirun' is not available for local runs; valid: torchrun"),
    ("--gpus H100:8", "--gpus need --backend slurm or skypilot"),
    ("--env =1", "--env wants NAME=VALUE"),
    ("--env 'A B=1'", "--env name 'A B' is not a valid environment variable name"),
    ("--ship 'x;import os'", "--ship: 'x;import os' is not a variable name"),
    ("--plan nosuchvar", "--plan nosuchvar: no variable of that name"),
    ("--resume /nonexistent/run", "not a jupyter-dist run directory"),
    ("--nproc 2 --bogus", "unrecognized arguments: --bogus"),
    ("--name 'unterminated", "No closing quotation"),
]


@pytest.mark.parametrize(("line", "message"), TRAIN_CASES, ids=[c[0][:40] for c in TRAIN_CASES])
def test_dist_train_bad_values_are_one_line_usage_errors(
    ip: InteractiveShell, runs: Path, line: str, message: str
) -> None:
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(UsageError) as info:
        ip.run_cell_magic("dist_train", line, "print('never runs')\n")
    text = str(info.value)
    assert message in text and "\n" not in text, text
    assert not list(runs.iterdir()), "nothing may be written for a refused run"
    assert set(psutil.Process().children(recursive=True)) <= before, "nothing may be started"


def test_a_300_character_name_is_a_run_not_a_crash(ip: InteractiveShell, runs: Path) -> None:
    """A valid identifier of 300 characters: the dry run shows commands; the run directory name is cut to fit."""
    dry = ip.run_cell_magic("dist_train", f"--name {LONG} --dry-run --nproc 1", "print(1)\n")
    assert "--nproc-per-node 1" in dry.to_text()
    rd = new_run_dir(runs, LONG)
    assert rd.path.parent == runs.resolve() and len(rd.path.name) <= MAX_NAME + 20


PLAN_MAGIC_CASES = [
    ("--model gpt2 --micro-batch 0", "argument --micro-batch: want an integer in 1.."),
    ("--model gpt2 --micro-batch 1e12", "argument --micro-batch: want an integer"),
    ("--model gpt2 --seq-len -2048", "argument --seq-len: want an integer in 1.."),
    ("--model gpt2 --seq-len nan", "argument --seq-len: want an integer"),
    ("--model gpt2 --nodes inf", "argument --nodes: want an integer"),
    ("--model gpt2 --gpu-tflops nan", "argument --gpu-tflops: want a finite number"),
    ("--model gpt2 --layers 3000000000", "argument --layers: want an integer in 1..2147483647"),
    ("--model '日本語モデル'", "unknown model '日本語モデル'"),
    ("--params -7B", "params"),
    ("--params 1e999", "params"),
]


@pytest.mark.parametrize(("line", "message"), PLAN_MAGIC_CASES, ids=[c[0] for c in PLAN_MAGIC_CASES])
def test_dist_plan_bad_values(ip: InteractiveShell, line: str, message: str) -> None:
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("dist_plan", line)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


POOL_CASES = [
    ("dist_start", "--nproc 0", "argument --nproc: want an integer in 1..512, got '0'"),
    ("dist_start", "--nproc 100000", "argument --nproc: want an integer in 1..512"),
    ("dist_start", "--start-timeout nan", "argument --start-timeout: want a finite number in (0,"),
    ("dist_start", "--start-timeout -1", "argument --start-timeout: want a finite number"),
    ("dist_start", "--name ../x", "--name '../x' must be a valid Python variable name"),
    ("dist_start", "--strategy zero9", "unknown strategy 'zero9'"),
    ("dist_pull", "x --rank -1", "argument --rank: want an integer in 0.."),
    ("dist_mode", "sideways", "want on or off"),
    ("dist_mode", "on --timeout inf", "argument --timeout: want a finite number"),
    ("dist_logs", "--tail -1", "argument --tail: want an integer in 0.."),
    ("dist_logs", "--rank nan", "argument --rank: want an integer in 0.."),
    ("dist_attach", "/nonexistent", "is not a jupyter-dist run directory (no run.json)"),
    ("dist_status", "no_such_var", "no variable 'no_such_var' in the notebook"),
    ("dist_check", "--nproc 0", "argument --nproc: want an integer in 1..512"),
    ("dist_check", "--timeout nan", "argument --timeout: want a finite number"),
]


@pytest.mark.parametrize(("magic", "line", "message"), POOL_CASES, ids=[f"{m} {ln}"[:40] for m, ln, _ in POOL_CASES])
def test_line_magics_bad_values(ip: InteractiveShell, runs: Path, magic: str, line: str, message: str) -> None:
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(UsageError) as info:
        ip.run_line_magic(magic, line)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert set(psutil.Process().children(recursive=True)) <= before


def test_pool_cell_timeout_nan(ip: InteractiveShell) -> None:
    with pytest.raises(UsageError, match=r"argument --timeout: want a finite number in \(0,"):
        ip.run_cell_magic("dist", "--timeout nan", "x = 1\n")


# ---- run directories: names, damage, two runs at once --------------------------------------------------------------
@pytest.mark.parametrize("name", ["../../etc", "a/b", "..", ".", "a\x00b", "/abs/path", "é" * 10, LONG, "", "-"])
def test_run_dir_names_stay_inside_the_runs_folder(tmp_path: Path, name: str) -> None:
    rd = new_run_dir(tmp_path / "runs", name)
    assert rd.path.parent == (tmp_path / "runs").resolve()
    assert rd.path.is_dir() and not rd.path.name.startswith(".") and "\x00" not in rd.path.name
    assert len(rd.path.name) <= MAX_NAME + 20


def test_two_runs_with_the_same_name_at_once_get_distinct_directories(tmp_path: Path) -> None:
    made: list[Path] = []
    barrier = threading.Barrier(16)

    def claim() -> None:
        barrier.wait()
        rd = new_run_dir(tmp_path, "same")
        (rd.path / "owner").write_text(str(threading.get_ident()))
        made.append(rd.path)

    threads = [threading.Thread(target=claim) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(made) == 16 and len(set(made)) == 16
    owners = {p.joinpath("owner").read_text() for p in made}
    assert len(owners) == 16, "a directory was handed to two runs (one clobbered the other's files)"


def test_runs_folder_that_is_a_file_or_unwritable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(JupyterDistError, match="cannot use .* as the runs folder"):
        new_run_dir(blocker / "runs", "r")
    with pytest.raises(JupyterDistError, match="cannot use .* as the runs folder: File exists"):
        new_run_dir(blocker, "r")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{garbage", "is damaged (not a JSON object)"),
        (b"[1, 2, 3]", "is damaged (not a JSON object)"),
        (b"\xff\xfe\x00garbage", "is damaged (not a JSON object)"),
        (b"[" * 100_000, "is damaged (not a JSON object)"),
        (b"", "is damaged (not a JSON object)"),
    ],
    ids=["garbage", "list", "binary", "deep", "empty"],
)
def test_open_run_on_a_damaged_run_json(ip: InteractiveShell, tmp_path: Path, content: bytes, message: str) -> None:
    rd = RunDir(tmp_path / "r").create()
    rd.run_json.write_bytes(content)
    with pytest.raises(JupyterDistError, match=re.escape(message)):
        open_run(rd.path)
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("dist_attach", str(rd.path))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_open_run_on_a_huge_or_odd_run_json(tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "huge").create()
    with open(rd.run_json, "wb") as fh:
        fh.truncate(200 << 20)  # sparse 200 MB: refused before it is read
    with pytest.raises(JupyterDistError, match="larger than 64 MiB"):
        open_run(rd.path)
    rd2 = RunDir(tmp_path / "dir").create()
    rd2.run_json.mkdir()
    with pytest.raises(JupyterDistError, match="no run.json"):
        open_run(rd2.path)


def _finished_run(tmp_path: Path, world: int = 2) -> RunDir:
    rd = RunDir(tmp_path / "done").create()
    rd.write_meta({"name": "done", "status": "succeeded", "world_size": world, "strategy": "ddp"})
    for r in range(world):
        (rd.logs / f"rank-{r}.exit.json").write_text(json.dumps({"rank": r, "code": 0, "t": time.time()}))
    return rd


def test_torn_and_foreign_telemetry_lines_are_counted_not_fatal(tmp_path: Path) -> None:
    from jupyter_dist.telemetry.records import SCHEMA_VERSION

    rd = _finished_run(tmp_path)
    good = [json.dumps({"v": SCHEMA_VERSION, "kind": "step", "rank": 0, "seq": i, "t": time.time(), "step": i,
                        "loss": 1.0 / (i + 1)}) for i in range(5)]  # fmt: skip
    garbage = ["{not json", "\x00\x01\x02", json.dumps([1, 2]), json.dumps({"kind": "step"}), "9" * 10_000, "{" * 5000]
    lines = good[:2] + garbage + good[2:]
    (rd.telemetry / "rank-0.jsonl").write_text("\n".join(lines) + "\n" + good[-1][:20])  # a torn last line
    (rd.telemetry / "rank-1.jsonl").write_bytes(b"\xff\xfe binary junk \n\n\n")
    run = open_run(rd.path)
    steps = run.records("step")
    assert [r["step"] for r in steps] == [0, 1, 2, 3, 4]
    frame = run.metrics()
    assert list(frame["step"]) == [0, 1, 2, 3, 4]
    bundle = run._repr_mimebundle_()
    assert "succeeded" in bundle["text/plain"] and "panels unavailable" not in bundle["text/html"]


def test_a_live_run_whose_directory_is_deleted_ends_cleanly(tmp_path: Path) -> None:
    """The watcher writes the final status into run.json; with the directory gone it must still end the run."""
    rd = RunDir(tmp_path / "live").create()
    meta: dict[str, Any] = {"name": "live", "status": "running", "world_size": 1, "started": time.time()}
    rd.write_meta(meta)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"],
                            env={**os.environ, "JD_RUN_DIR": str(rd.path)})  # fmt: skip
    run = Run(rd, meta, procs=[proc])
    shutil.rmtree(rd.path)
    assert run.wait(timeout=30) == "succeeded"
    assert run.done and not rd.path.exists()
    text = run.summary()
    assert "run.json not updated: the run directory was deleted" in text
    assert run.logs(0) == "" and run.logs(0, tail=5) == "" and run.records() == []
    with pytest.raises(JupyterDistError, match="no run.json"):
        open_run(rd.path)


def test_a_live_run_whose_directory_is_made_read_only(tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "ro").create()
    meta: dict[str, Any] = {"name": "ro", "status": "running", "world_size": 1, "started": time.time()}
    rd.write_meta(meta)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"],
                            env={**os.environ, "JD_RUN_DIR": str(rd.path)})  # fmt: skip
    run = Run(rd, meta, procs=[proc])
    # root ignores permission bits: the immutable attribute makes the folder read-only for everyone
    if subprocess.run(["chattr", "+i", str(rd.path)], capture_output=True).returncode != 0:
        os.chmod(rd.path, 0o500)
        if os.access(rd.path, os.W_OK):
            proc.kill()
            run.wait(10)
            pytest.skip("cannot make a folder read-only here (no chattr, running as root)")
    try:
        assert run.wait(timeout=30) == "succeeded"
        assert "run.json not updated: the run directory is not writable" in run.summary()
        assert open_run(rd.path).status == "running"  # what the disk still says; the handle knows better
    finally:
        subprocess.run(["chattr", "-i", str(rd.path)], capture_output=True)
        os.chmod(rd.path, 0o755)


def test_a_live_run_whose_directory_is_replaced_by_a_file(tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "swap").create()
    meta: dict[str, Any] = {"name": "swap", "status": "running", "world_size": 2, "started": time.time()}
    rd.write_meta(meta)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    run = Run(rd, meta, procs=[proc])
    shutil.rmtree(rd.path)
    rd.path.write_text("not a folder")
    assert run.wait(timeout=30) == "succeeded"
    assert "run.json not updated" in run.summary() and run.logs(1, tail=3) == ""
    with pytest.raises(JupyterDistError, match="no run.json"):
        open_run(rd.path)


def test_strays_of_a_run_are_ended_and_nothing_else(tmp_path: Path) -> None:
    """kill_strays ends the processes carrying the run's JD_RUN_DIR (a setsid'ed grandchild too), not others."""
    from jupyter_dist.launch.run import kill_strays

    mine = str(tmp_path / "mine")
    other = str(tmp_path / "other")
    stray = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"],
                             env={**os.environ, "JD_RUN_DIR": mine}, start_new_session=True,
                             stdout=subprocess.PIPE)  # fmt: skip
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 env={**os.environ, "JD_RUN_DIR": other})  # fmt: skip
    try:
        assert stray.stdout is not None and stray.stdout.readline() == b"ready\n"
        t0 = time.monotonic()
        assert kill_strays(mine, grace=1.0) == [stray.pid]
        took = time.monotonic() - t0
        assert 1.0 <= took < 10, took  # it ignored SIGTERM: SIGKILL after the grace
        assert not psutil.pid_exists(stray.pid) or psutil.Process(stray.pid).status() == psutil.STATUS_ZOMBIE
        assert bystander.poll() is None
    finally:
        for p in (stray, bystander):
            if p.poll() is None:
                p.kill()
            p.wait(5)
