"""The `jupyter-dist plan` contract: flags, --json shape (bytes), human output (GiB), exit 2 on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jupyter_dist.cli import main

CANDIDATE_KEYS = {"strategy", "dims", "memory", "fits", "step_time_s", "tokens_per_s", "mfu"}
MEMORY_KEYS = {"params", "grads", "optimizer", "activations", "overhead", "total"}


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_console_script_json_contract() -> None:
    """The installed console script, as other tools call it."""
    exe = Path(sys.executable).parent / "jupyter-dist"
    res = subprocess.run([str(exe), "plan", "--model", "llama-2-7b", "--json"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["model"]["params"] == 6_738_415_616
    assert data["candidates"] and isinstance(data["reasons"], list) and isinstance(data["warnings"], list)
    names = {c["name"] for c in data["candidates"]}
    assert data["recommended"] in names
    for c in data["candidates"]:
        assert CANDIDATE_KEYS <= set(c)
        assert set(c["dims"]) >= {"dp", "tp", "pp", "cp", "ep"}
        mem = c["memory"]
        assert MEMORY_KEYS <= set(mem)
        assert all(isinstance(mem[k], int) and mem[k] >= 0 for k in MEMORY_KEYS), mem
        assert mem["total"] == sum(mem[k] for k in MEMORY_KEYS - {"total"}) - mem["grads_reuse"]
        assert c["fits"] == (mem["total"] <= mem["capacity"])
        dims = c["dims"]
        assert dims["dp"] * dims["tp"] * dims["pp"] * dims["cp"] == 8
        assert 0 < c["mfu"] < 1 and c["step_time_s"] > 0 and c["tokens_per_s"] > 0


def test_human_output_uses_gib(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["plan", "--model", "gpt2", "--gpu", "a100-40gb", "--gpus-per-node", "2"], capsys)
    assert code == 0
    assert "GiB" in out and "Recommended:" in out
    assert "2 NVIDIA A100 40GB" in out


def test_strategy_flag_evaluates_only_that_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["plan", "--model", "llama-2-7b", "--strategy", "zero3", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and {c["strategy"] for c in data["candidates"]} == {"zero3"}
    assert data["recommended"] == "zero3"


def test_dimension_flags_build_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--layers", "32", "--hidden", "4096", "--heads", "32", "--ffn", "11008", "--vocab", "32000",
            "--json"]  # fmt: skip
    code, out, _ = run(args, capsys)
    assert code == 0 and json.loads(out)["model"]["params"] == 6_738_415_616  # Llama-2-7B from its dimensions


def test_preset_with_overridden_dimension(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["plan", "--model", "llama-2-7b", "--layers", "16", "--json"], capsys)
    params = json.loads(out)["model"]["params"]
    assert code == 0 and params == 6_738_415_616 - 16 * 202_383_360  # one Llama-2-7B block = 202,383,360


def test_params_and_parallel_flags(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--params", "7.5e9", "--nodes", "2", "--tp", "2", "--pp", "2", "--seq-len", "4096",
            "--micro-batch", "2", "--grad-accum", "8", "--checkpointing", "selective", "--json"]  # fmt: skip
    code, out, _ = run(args, capsys)
    data = json.loads(out)
    assert code == 0 and data["model"]["params"] == 7_500_000_000
    assert all(c["dims"]["tp"] == 2 and c["dims"]["pp"] == 2 and c["dims"]["dp"] == 4 for c in data["candidates"])


def test_hf_config_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, _ = run(["plan", "--hf-config", str(tmp_path), "--json"], capsys)
    assert code == 0 and json.loads(out)["model"]["params"] == 124_439_808


def test_list_flags(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["plan", "--list-models"], capsys)
    assert code == 0 and "llama-3.1-405b" in out and "405,853,388,800" in out
    code, out, _ = run(["plan", "--list-gpus"], capsys)
    assert code == 0 and "mi300x" in out and "infiniband-ndr" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "llama-9"], "unknown model 'llama-9'"),
        (["--model", "llama-2-7b", "--gpu", "h1000"], "unknown GPU 'h1000'"),
        (["--model", "llama-2-7b", "--gpus-per-node", "16"], "exceeds the 8"),
        (["--model", "llama-2-7b", "--tp", "3"], "does not divide world size 8"),
        (["--model", "llama-2-7b", "--precision", "fp4"], "unknown precision 'fp4'; valid: bf16-mixed"),
        (["--model", "llama-2-7b", "--optimizer", "lion"], "unknown optimizer 'lion'"),
        (["--model", "llama-2-7b", "--checkpointing", "some"], "unknown checkpointing 'some'"),
        (["--model", "llama-2-7b", "--strategy", "zero4"], "unknown strategy 'zero4'"),
        (["--model", "llama-2-7b", "--global-batch", "100", "--micro-batch", "3"], "not a multiple of"),
        (["--model", "llama-2-7b", "--params", "7e9"], "give one model source"),
        (["--layers", "32"], "needs --hidden --heads --vocab"),
        ([], "say which model"),
        (["--params", "seven"], "is not a number"),
        (["--model", "llama-2-7b", "--interconnect", "carrier-pigeon"], "unknown interconnect"),
        (["--model", "llama-2-7b", "--gpu-memory", "lots"], "is not a size"),
        (["--model", "llama-2-7b", "--ep", "2"], "mixture-of-experts"),
        (["--model", "llama-2-7b", "--pp", "8", "--layers", "4"], "cannot exceed the number of layers"),
        (["--hf-config", "/nonexistent/config.json"], "not found"),
        (["--module", "nonexistent_pkg:Model"], "cannot import"),
        (["--module", "json"], "MODULE:CALLABLE"),
        (["--model", "llama-2-7b", "--strategy", "ddp", "--tp", "2"], "does not combine with tp"),
    ],
)
def test_bad_input_exits_2_with_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["plan", *args], capsys)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert message in lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "gpt2", "--bogus"], "unrecognized arguments: --bogus"),
        (["--model", "gpt2", "--grad-accum", "2", "--global-batch", "8"], "not allowed with argument"),
        (["--model", "gpt2", "--tp", "two"], "argument --tp: want an integer in 1.."),
        (["--model", "llama-2-7b", "--gpus-per-node", "0"], "argument --gpus-per-node: want an integer in 1..1024"),
        (["--model", "llama-2-7b", "--nodes", "0"], "argument --nodes: want an integer in 1.."),
        (["--model", "llama-2-7b", "--tp", "0"], "argument --tp: want an integer in 1.."),
        (["--model", "llama-2-7b", "--micro-batch", "0"], "argument --micro-batch: want an integer in 1.."),
    ],
)
def test_argparse_errors_are_one_line_exit_2(args: list[str], message: str) -> None:
    exe = Path(sys.executable).parent / "jupyter-dist"
    res = subprocess.run([str(exe), "plan", *args], capture_output=True, text=True)
    assert res.returncode == 2
    assert len(res.stderr.strip().splitlines()) == 1 and message in res.stderr


def test_a_bad_pipeline_schedule_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "gpt2", "--pp-schedule", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "jupyter-dist plan: error: unknown pp-schedule 'nope'; valid: gpipe, 1f1b, interleaved-1f1b"
