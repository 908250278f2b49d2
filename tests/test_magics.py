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
    from jupyter_dist.plan import Hardware, plan

    res = ip.run_cell("p = %dist_plan --model gpt2 --gpus-per-node 2\np.recommended")
    assert res.success and res.result == plan("gpt2", Hardware.from_names("h100-80gb", gpus_per_node=2)).recommended
    assert ip.user_ns["p"].recommended == res.result


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


def test_dist_train_hands_start_run_one_run_options(
    ip: InteractiveShell, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Issue 34: the magic passes its flags to start_run whole, as one RunOptions; the same options given as
    start_run's keywords make the same value, and each option is checked once, where the value is made."""
    from jupyter_dist.launch import session
    from jupyter_dist.launch.options import RunOptions

    got: list[tuple[str, RunOptions]] = []
    monkeypatch.setattr(session, "start_run", lambda code, options: got.append((code, options)) or "dry")
    line = (f"--nproc 4 --strategy fsdp2+tp2 --pp 1 --sp --env A=1 --checkpoint-every 5 --timeout 60 --dry-run "
            f"--runs-dir {tmp_path} --no-auto-ship")  # fmt: skip
    assert ip.run_cell_magic("dist_train", line, "x = 1\n") == "dry"
    code, opts = got[0]
    assert code == "x = 1\n" and isinstance(opts, RunOptions)
    assert (opts.nproc, opts.strategy, opts.tp, opts.pp, opts.sp, opts.timeout) == (4, "fsdp2+tp2", None, 1, True, 60)
    assert opts.degrees() == {"pp": 1, "sp": True} and opts.env == {"A": "1"}
    assert opts.worker == {"checkpoint_every": 5} and opts.dry_run and opts.output == "none"
    kwargs = {f: getattr(opts, f) for f in RunOptions.__dataclass_fields__}
    assert RunOptions.from_kwargs(**kwargs) == opts == RunOptions.from_kwargs(RunOptions(), **kwargs)
    with pytest.raises(UsageError, match="--env name 'A B' is not a valid environment variable name"):
        ip.run_cell_magic("dist_train", "--dry-run --nproc 1 --env 'A B=1'", "x = 1\n")
    from jupyter_dist.errors import JupyterDistError

    with pytest.raises(JupyterDistError, match="--timeout must be positive seconds, got -1"):
        RunOptions(timeout=-1)
    with pytest.raises(JupyterDistError, match="--tp must be >= 1, got 0"):  # argparse refuses it in the magic
        RunOptions(tp=0)
    with pytest.raises(JupyterDistError, match="--hang-timeout watches local ranks only; drop it with --backend slurm"):
        RunOptions(backend="slurm", hang_timeout=5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'nprocs'"):
        RunOptions.from_kwargs(nprocs=2)
