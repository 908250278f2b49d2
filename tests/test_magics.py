"""%dist_plan in a real IPython InteractiveShell."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("IPython")
from IPython.core.error import UsageError  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402

from jupyter_dist.plan import Plan  # noqa: E402


@pytest.fixture(scope="module")
def ip() -> InteractiveShell:
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "jupyter_dist")
    return shell


def test_dist_plan_returns_a_plan(ip: InteractiveShell) -> None:
    p = ip.run_line_magic("dist_plan", "--model llama-2-7b --gpu h100-80gb --nodes 2 --seq-len 4096")
    assert isinstance(p, Plan)
    assert p.model.params == 6_738_415_616 and p.world_size == 16 and p.training.seq_len == 4096


def test_dist_plan_assignment_in_a_cell(ip: InteractiveShell) -> None:
    res = ip.run_cell("p = %dist_plan --model gpt2 --gpus-per-node 2\np.recommended")
    assert res.success and res.result == "ddp"


def test_paths_with_spaces_and_quotes(ip: InteractiveShell, tmp_path: Path) -> None:
    folder = tmp_path / "my model"
    folder.mkdir()
    cfg = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
    (folder / "config.json").write_text(json.dumps(cfg))
    p = ip.run_line_magic("dist_plan", f'--hf-config "{folder}"')
    assert p.model.params == 124_439_808


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--model llama-9", "unknown model 'llama-9'"),
        ("--model gpt2 --tp 3", "does not divide world size 8"),
        ("--model gpt2 --bogus", "unrecognized arguments: --bogus"),
        ('--hf-config "unterminated', "No closing quotation"),
    ],
)
def test_bad_input_is_a_usage_error(ip: InteractiveShell, line: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        ip.run_line_magic("dist_plan", line)


def test_usage_error_shows_one_line_without_traceback(ip: InteractiveShell, capsys: pytest.CaptureFixture[str]) -> None:
    ip.run_cell("%dist_plan --model llama-9")
    out, err = capsys.readouterr()
    text = out + err
    assert "UsageError: unknown model 'llama-9'" in text and "Traceback" not in text


def test_help_lists_the_flags(ip: InteractiveShell, capsys: pytest.CaptureFixture[str]) -> None:
    ip.run_line_magic("dist_plan", "--help")
    assert "--hf-config" in capsys.readouterr().out


def test_unload_removes_the_magic() -> None:
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "jupyter_dist")
    assert "dist_plan" in shell.magics_manager.magics["line"]
    shell.run_line_magic("unload_ext", "jupyter_dist")
    assert "dist_plan" not in shell.magics_manager.magics["line"]
    shell.run_line_magic("load_ext", "jupyter_dist")
    assert "dist_plan" in shell.magics_manager.magics["line"]
