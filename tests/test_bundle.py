"""One plan compiled into its bundle: every artifact present, consistent with the others, written, displayed;
`jupyter-dist config` on the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jupyter_dist.cli import main
from jupyter_dist.plan import Hardware, TrainingShape, plan
from jupyter_dist.render.bundle import Bundle, render_bundle
from jupyter_dist.render.common import RenderError, RenderOptions


def bundle_for(nodes: int, gpn: int, strategy: str, **opts: object) -> Bundle:
    p = plan("llama-2-7b", Hardware.from_names("h100-80gb", nodes=nodes, gpus_per_node=gpn),
             TrainingShape(micro_batch=2, seq_len=4096, global_batch=256, checkpointing="selective"))  # fmt: skip
    return render_bundle(p, RenderOptions(candidate=strategy, **opts))  # type: ignore[arg-type]


@pytest.mark.parametrize(("nodes", "gpn"), [(1, 8), (2, 8), (4, 4)])
@pytest.mark.parametrize("strategy", ["zero3", "fsdp2", "ddp", "zero2-offload"])
def test_artifacts_agree_on_the_numbers(nodes: int, gpn: int, strategy: str) -> None:
    b = bundle_for(nodes, gpn, strategy)
    world = nodes * gpn
    expected = {"plan.json", "accelerate_config.yaml", "launch.sh", "skypilot.yaml", "job.sbatch", "nccl.env"}
    assert expected <= set(b.files)
    assert ("ds_config.json" in b.files) == strategy.startswith("zero")
    argv = b.commands["launch"].argv
    assert argv[argv.index("--nproc-per-node") + 1] == str(gpn)
    if nodes > 1:
        assert argv[argv.index("--nnodes") + 1] == str(nodes)
    task = yaml.safe_load(b.files["skypilot.yaml"])
    assert task["num_nodes"] == nodes and list(task["resources"]["accelerators"].values()) == [gpn]
    sbatch = b.files["job.sbatch"]
    assert f"#SBATCH --nodes={nodes}" in sbatch and f"#SBATCH --gpus-per-node={gpn}" in sbatch
    acc = yaml.safe_load(b.files["accelerate_config.yaml"])
    assert acc["num_processes"] == world and acc["num_machines"] == nodes
    if strategy.startswith("zero"):
        ds = json.loads(b.files["ds_config.json"])
        assert ds["train_batch_size"] == 256 == b.layout.global_batch
        assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * b.layout.dims.dp == 256
        assert argv[-2:] == ["--deepspeed_config", "ds_config.json"]  # torchrun passes the config to the script
    assert json.loads(b.files["plan.json"])["hardware"]["world_size"] == world


def test_write_to_and_scripts_parse(tmp_path: Path) -> None:
    b = bundle_for(2, 8, "zero3", script_args=("--data", "my dir; echo pwned"))
    paths = b.write_to(tmp_path / "out")
    assert {p.name for p in paths} == set(b.files)
    for name in ("launch.sh", "job.sbatch"):
        path = tmp_path / "out" / name
        assert os.access(path, os.X_OK)
        assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    if "train.py" in b.files:
        compile(b.files["train.py"], "train.py", "exec")
    assert "'my dir; echo pwned'" in b.files["launch.sh"]


def test_launch_sh_runs_with_a_fake_torchrun(tmp_path: Path) -> None:
    """Execute launch.sh (multi-node) with a fake torchrun that records its argv: values arrive intact."""
    b = bundle_for(2, 8, "fsdp2", script_args=("x; touch pwned", "$(touch pwned2)"))
    out = tmp_path / "out"
    b.write_to(out)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "torchrun").write_text("#!/usr/bin/env python3\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    (fake / "torchrun").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "MASTER_ADDR": "10.1.2.3", "NODE_RANK": "1"}
    res = subprocess.run(["bash", str(out / "launch.sh")], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    argv = json.loads(res.stdout)
    assert argv[-2:] == ["x; touch pwned", "$(touch pwned2)"]
    assert argv[argv.index("--rdzv-endpoint") + 1] == "10.1.2.3:29500"
    assert not list(tmp_path.rglob("pwned*"))
    missing = subprocess.run(["bash", str(out / "launch.sh")], capture_output=True, text=True,
                             env={k: v for k, v in env.items() if k != "MASTER_ADDR"})  # fmt: skip
    assert missing.returncode != 0 and "set MASTER_ADDR" in missing.stderr


def test_secret_values_never_reach_any_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "wandb-super-secret-value")
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value_123")
    b = bundle_for(2, 8, "zero3")
    blob = "\n".join(b.files.values()) + json.dumps(b.to_dict())
    assert "wandb-super-secret-value" not in blob and "hf_secret_value_123" not in blob
    assert "WANDB_API_KEY" in b.files["skypilot.yaml"]  # referenced by name
    with pytest.raises(RenderError, match="HF_TOKEN looks like a secret"):
        RenderOptions(env=(("HF_TOKEN", "x"),))


def test_bundle_displays_itself_with_tabs_copy_and_download() -> None:
    b = bundle_for(1, 8, "zero2")
    bundle = b._repr_mimebundle_()
    html = bundle["text/html"]
    for name in b.files:
        assert f'download="{name}"' in html
    assert html.count("<button onclick=") == len(b.files) and 'type="radio"' in html
    assert "zero2" in bundle["text/plain"] and "launch:" in bundle["text/plain"]


def test_deepspeed_launcher_needs_a_deepspeed_candidate() -> None:
    with pytest.raises(RenderError, match="deepspeed launcher needs a DeepSpeed strategy"):
        bundle_for(1, 8, "fsdp2", launcher="deepspeed")


def test_nothing_fits_needs_an_explicit_candidate() -> None:
    p = plan("llama-3.1-405b", Hardware.from_names("l4", gpus_per_node=1))
    with pytest.raises(RenderError, match="nothing fits in this plan"):
        render_bundle(p)


# ---- CLI ------------------------------------------------------------------------------------------------------
def test_cli_config_writes_the_bundle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["config", "--model", "llama-2-7b", "--nodes", "2", "--seq-len", "4096", "--candidate", "zero3",
                 "--out", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "wrote" in out
    assert json.loads((tmp_path / "ds_config.json").read_text())["zero_optimization"]["stage"] == 3
    assert (tmp_path / "job.sbatch").exists() and (tmp_path / "skypilot.yaml").exists()


def test_cli_config_show_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--model", "gpt2", "--show", "nccl.env"]) == 0
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in capsys.readouterr().out
    assert main(["config", "--model", "gpt2", "--json", "--script-arg=--epochs", "--script-arg", "3"]) == 0
    data = json.loads(capsys.readouterr().out)
    argv = data["commands"]["launch"]["argv"]
    i = argv.index("--epochs")
    assert argv[i + 1] == "3" and argv[i - 1] == "train.py" and "plan.json" in data["files"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--show", "nope.txt"], "no file 'nope.txt' in this bundle"),
        (["--env", "NOEQUALS"], "--env wants NAME=VALUE"),
        (["--env", "HF_TOKEN=abc"], "HF_TOKEN looks like a secret"),
        (["--launcher", "mpirun"], "unknown launcher 'mpirun'"),
        (["--name", "Bad Name"], "must be 1-63 lower-case letters"),
        (["--candidate", "zero9"], "the plan has no candidate 'zero9'"),
        (["--time", "forever"], "time limit 'forever'"),
        (["--master-port", "80"], "master port must be in 1024..65535"),
    ],
)
def test_cli_config_errors_exit_2(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["config", "--model", "gpt2", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_console_script_config(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "jupyter-dist"
    res = subprocess.run([str(exe), "config", "--model", "llama-2-7b", "--out", str(tmp_path)], capture_output=True,
                         text=True)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "plan.json").exists() and (tmp_path / "launch.sh").exists()


def _count_layouts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Wrap ``layout_of`` wherever a renderer holds it; returns the list each call appends its candidate to."""
    import importlib

    from jupyter_dist.render import common

    calls: list[str] = []
    real = common.layout_of

    def counting(p: object, opts: RenderOptions | None = None) -> object:
        lay = real(p, opts)  # type: ignore[arg-type]
        calls.append(lay.candidate.name)
        return lay

    for mod in ("common", "bundle", "commands", "deepspeed", "accelerate", "skypilot", "slurm", "torch_code"):
        m = importlib.import_module(f"jupyter_dist.render.{mod}")
        if hasattr(m, "layout_of"):
            monkeypatch.setattr(m, "layout_of", counting)
    return calls


@pytest.mark.parametrize("strategy", ["zero3", "fsdp2"])
def test_the_bundle_resolves_the_layout_once(monkeypatch: pytest.MonkeyPatch, strategy: str) -> None:
    calls = _count_layouts(monkeypatch)
    b = bundle_for(2, 8, strategy)
    assert {"train.py", "skypilot.yaml", "job.sbatch", "accelerate_config.yaml"} <= set(b.files)
    assert calls == [b.layout.candidate.name]  # every artifact rendered from the one Layout handed down


def test_a_cluster_run_resolves_the_layout_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from jupyter_dist.launch.backends.cluster import ClusterOptions, start_cluster_run

    calls = _count_layouts(monkeypatch)
    p = plan("llama-2-7b", Hardware.from_names("h100-80gb", nodes=2, gpus_per_node=8),
             TrainingShape(micro_batch=2, seq_len=4096, global_batch=256))  # fmt: skip
    for backend in ("slurm", "skypilot"):
        calls.clear()
        dry = start_cluster_run(
            "pass", backend=backend, cluster=ClusterOptions(), nproc=8, nodes=2, strategy="zero3", plan=p,
            launcher="torchrun", name="one-layout", ship=None, max_restarts=0, timeout=None, env={},
            runs_dir=tmp_path, port=None, dry_run=True,
        )  # fmt: skip
        assert "ds_config.json" in dry.files and calls == ["zero3"], (backend, calls)
