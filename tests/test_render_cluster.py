"""Cluster renderers checked by their real consumers, at the narrowest boundary that runs without a cluster.

* SkyPilot task: SkyPilot's own parser (``sky.Task.from_yaml_config``, no API server) accepts every generated task and
  rejects broken ones; the ``run`` script is executed by bash (as SkyPilot does it: ``bash -i``) with the
  ``SKYPILOT_*`` variables SkyPilot would set and fake ``torchrun`` / ``deepspeed`` / ``accelerate`` programs that
  record the argv and environment they receive.
* SLURM: the batch script is executed by bash with fake ``scontrol`` / ``srun`` (srun runs its command once per
  "node" with that node's ``SLURM_NODEID``) and the same fake launchers.
* accelerate: accelerate's own config loader, its ``accelerate launch`` argument handling and the FSDP / DeepSpeed /
  parallelism plugins built from the environment it prepares. Only the CUDA device query is faked (no GPU here).
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

from jupyter_dist.errors import JupyterDistError
from jupyter_dist.plan import Hardware, Plan, TrainingShape, plan
from jupyter_dist.render.accelerate import render_accelerate_config, render_accelerate_yaml
from jupyter_dist.render.commands import torchrun_command
from jupyter_dist.render.common import RenderError, RenderOptions
from jupyter_dist.render.deepspeed import render_deepspeed_json
from jupyter_dist.render.skypilot import (
    SKYPILOT_ACCELERATORS,
    render_skypilot_run,
    render_skypilot_task,
    render_skypilot_yaml,
    skypilot_accelerator,
)
from jupyter_dist.render.slurm import render_sbatch

sky = pytest.importorskip("sky", reason="SkyPilot validates the generated tasks (pip install 'jupyter-dist[sky]')")

IPS = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]
HOSTS = ["gpu-a01", "gpu-a02", "gpu-a03", "gpu-a04"]
EVIL_ARGS = (
    "x; rm -rf / #",
    "$(touch pwned)",
    "`touch pwned`",
    'it\'s "quoted"',
    "data dir/with spaces",
    "bang!now",
    "line\nbreak",
    "",
)
EVIL_SCRIPT = 'my dir/it\'s "train".py'


# ---------------------------------------------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return {
        "1x8": plan("llama-2-7b", Hardware.from_names("h100-80gb", nodes=1)),
        "2x8": plan("llama-2-7b", Hardware.from_names("h100-80gb", nodes=2)),
        "4x4": plan("llama-2-7b", Hardware.from_names("a100-80gb", gpus_per_node=4, nodes=4)),
        "gpt2-1": plan("gpt2", Hardware.from_names("h100-80gb", gpus_per_node=1)),
        "gpt2-8": plan("gpt2", Hardware.from_names("h100-80gb", gpus_per_node=8)),
        "moe": plan("mixtral-8x7b", Hardware.from_names("h100-80gb", nodes=2)),
    }


# ---------------------------------------------------------------------------------------------------------------
# Fake programs (the narrow boundary: the launchers and the scheduler's commands)
# ---------------------------------------------------------------------------------------------------------------
_FAKE_LAUNCHER = """#!{python}
# Fake launcher: records its argv, the environment it got and what the run script prepared, then exits 0.
import json, os, sys
keep = ("MASTER_ADDR", "MASTER_PORT", "SKYPILOT_NODE_RANK", "SLURM_NODEID", "JD_CHECKPOINT_DIR", "EVIL", "HF_TOKEN")
rec = {{
    "prog": os.path.basename(sys.argv[0]),
    "argv": sys.argv[1:],
    "cwd": os.getcwd(),
    "env": {{k: v for k, v in os.environ.items() if k in keep or k.startswith(("NCCL_", "TORCH_NCCL_", "FI_"))}},
}}
if os.environ.get("DS_ENV_FILE"):
    path = os.environ["DS_ENV_FILE"]
    rec["ds_env"] = open(path).read()
    rec["ds_env_mode"] = os.stat(path).st_mode & 0o777
    rec["ds_env_path"] = path
if os.path.exists("hostfile"):
    rec["hostfile"] = open("hostfile").read()
with open(os.environ["JD_FAKE_LOG"], "a") as f:
    f.write(json.dumps(rec) + "\\n")
"""

_FAKE_SCONTROL = """#!/bin/bash
# Fake scontrol: only `scontrol show hostnames LIST`, where the test's LIST is comma separated.
[ "$1 $2" = "show hostnames" ] || exit 2
tr ',' '\\n' <<< "$3"
"""

_FAKE_SRUN = """#!/bin/bash
# Fake srun: records its options, then runs the command once per node with that node's SLURM_NODEID.
opts=()
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do opts+=("$1"); shift; done
printf '%s\\n' "${opts[@]}" > "$JD_FAKE_DIR/srun_opts"
for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i "$@" || exit $?
done
"""


@pytest.fixture()
def fake_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    launcher = _FAKE_LAUNCHER.format(python=sys.executable)
    for name, text in (("torchrun", launcher), ("deepspeed", launcher), ("accelerate", launcher),
                       ("scontrol", _FAKE_SCONTROL), ("srun", _FAKE_SRUN)):  # fmt: skip
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def _base_env(tmp_path: Path, fake_bin: Path) -> dict[str, str]:
    return {
        "PATH": f"{fake_bin}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "TMPDIR": str(tmp_path),
        "JD_FAKE_LOG": str(tmp_path / "launches.jsonl"),
        "JD_FAKE_DIR": str(tmp_path),
        "LANG": "C.UTF-8",
    }


def _records(tmp_path: Path) -> list[dict[str, Any]]:
    log = tmp_path / "launches.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def run_skypilot_node(
    task: dict[str, Any],
    tmp_path: Path,
    fake_bin: Path,
    *,
    rank: int,
    nodes: int,
    gpus: int,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the task's `run` on one node as SkyPilot does (`/bin/bash -i script`, task envs exported)."""
    workdir = tmp_path / "workdir"
    workdir.mkdir(exist_ok=True)
    script = tmp_path / f"run-{rank}.sh"
    script.write_text(task["run"])
    env = _base_env(tmp_path, fake_bin)
    env.update(task.get("envs", {}))
    env.update(
        SKYPILOT_NODE_IPS="\n".join(IPS[:nodes]) + "\n", SKYPILOT_NODE_RANK=str(rank),
        SKYPILOT_NUM_GPUS_PER_NODE=str(gpus), SKYPILOT_NUM_NODES=str(nodes), SKYPILOT_TASK_ID="sky-2024-managed-7",
    )  # fmt: skip
    env.update(extra_env or {})
    return subprocess.run(["bash", "--norc", "--noprofile", "-i", str(script)], cwd=workdir, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)  # fmt: skip


def run_sbatch(
    text: str,
    tmp_path: Path,
    fake_bin: Path,
    *,
    nodes: int,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the batch script as the batch step of a `nodes`-node allocation would."""
    workdir = tmp_path / "submit"
    workdir.mkdir(exist_ok=True)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env = _base_env(tmp_path, fake_bin)
    env.update(SLURM_JOB_NODELIST=",".join(HOSTS[:nodes]), SLURM_JOB_NUM_NODES=str(nodes), SLURM_JOB_ID="4242",
               SLURM_NODEID="0")  # fmt: skip
    env.update(extra_env or {})
    return subprocess.run(["bash", str(script)], cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def bash_syntax_ok(text: str, tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


# ---------------------------------------------------------------------------------------------------------------
# SkyPilot: the real parser
# ---------------------------------------------------------------------------------------------------------------
SKY_CASES = {
    "1x8-torchrun": ("1x8", RenderOptions()),
    "2x8-torchrun": ("2x8", RenderOptions()),
    "2x8-static": ("2x8", RenderOptions(rdzv="static")),
    "2x8-deepspeed": ("2x8", RenderOptions(launcher="deepspeed", candidate="zero3")),
    "1x8-deepspeed": ("1x8", RenderOptions(launcher="deepspeed", candidate="zero2")),
    "2x8-accelerate": ("2x8", RenderOptions(launcher="accelerate", candidate="fsdp2")),
    "4x4-spot-infra": ("4x4", RenderOptions(use_spot=True, cloud="aws/us-east-1", name="spot-run")),
    "2x8-slurm-infra": ("2x8", RenderOptions(cloud="slurm", secrets=())),
}


def parse_task(text: str, **kw: Any) -> Any:
    return sky.Task.from_yaml_config(yaml.safe_load(text), **kw)


@pytest.mark.parametrize("case", list(SKY_CASES))
def test_skypilot_parser_accepts_generated_task_with_the_plans_numbers(case: str, plans: dict[str, Plan]) -> None:
    key, opts = SKY_CASES[case]
    p = plans[key]
    text = render_skypilot_yaml(p, opts)
    task = parse_task(text)
    hw = p.hardware
    assert task.name == opts.name
    assert task.num_nodes == hw.nodes
    (res,) = list(task.resources)
    assert res.accelerators == {SKYPILOT_ACCELERATORS[hw.accelerator.name]: hw.gpus_per_node}
    assert res.use_spot is opts.use_spot
    assert (res.network_tier is not None) == (hw.nodes > 1)
    if opts.cloud is not None:
        assert str(res.cloud).lower() == opts.cloud.split("/")[0]
        if "/" in opts.cloud:
            assert res.region == opts.cloud.split("/")[1]
    assert task.envs == render_skypilot_task(p, opts)["envs"]
    assert task.envs["NCCL_DEBUG"] == "WARN" and task.envs["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    # secrets: by name only, resolved by SkyPilot at launch
    assert sorted(r.name for r in task.managed_secret_refs) == sorted(opts.secrets)
    assert task.secrets == {}
    assert task.workdir == "."


def test_skypilot_secret_values_are_supplied_at_launch_not_in_the_file(plans: dict[str, Plan]) -> None:
    text = render_skypilot_yaml(plans["2x8"])
    assert yaml.safe_load(text)["secrets"] == {"WANDB_API_KEY": None, "HF_TOKEN": None}
    # what `sky launch --secret HF_TOKEN` does with the value it reads from the launching environment
    task = parse_task(text, secrets_overrides=[("HF_TOKEN", "hf_value"), ("WANDB_API_KEY", "wb_value")])
    assert set(task.secrets) == {"HF_TOKEN", "WANDB_API_KEY"}
    assert task.managed_secret_refs == []
    assert task.secrets["HF_TOKEN"].get_secret_value() == "hf_value"


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda t: t.update(num_nodes=0), "num_nodes should be a positive int"),
        (lambda t: t.update(num_node=t.pop("num_nodes")), "did you mean 'num_nodes'"),
        (lambda t: t["resources"].update(network_tier="fastest"), "Invalid network_tier"),
        (lambda t: t["envs"].update({"BAD-NAME": "1"}), "Invalid task YAML"),
        (lambda t: t["resources"].update(infra="aws us-east-1"), "infra"),
    ],
    ids=["num_nodes-0", "misspelled-key", "network-tier", "env-name", "infra"],
)
def test_skypilot_parser_rejects_a_broken_task(mutate: Any, match: str, plans: dict[str, Plan]) -> None:
    task = yaml.safe_load(render_skypilot_yaml(plans["2x8"]))
    parse_task(yaml.safe_dump(task))  # the unbroken task passes
    mutate(task)
    with pytest.raises(Exception, match=match):
        parse_task(yaml.safe_dump(task))


def test_skypilot_yaml_is_readable_and_round_trips(plans: dict[str, Plan]) -> None:
    opts = RenderOptions(script_args=EVIL_ARGS)
    text = render_skypilot_yaml(plans["2x8"], opts)
    assert "run: |" in text  # the script is a literal block, not an escaped one-liner
    assert "sky launch -c jupyter-dist skypilot.yaml --secret WANDB_API_KEY --secret HF_TOKEN" in text
    assert yaml.safe_load(text) == render_skypilot_task(plans["2x8"], opts)


@pytest.mark.parametrize("case", list(SKY_CASES))
def test_skypilot_run_and_setup_scripts_pass_bash_n(case: str, plans: dict[str, Plan], tmp_path: Path) -> None:
    key, opts = SKY_CASES[case]
    task = render_skypilot_task(plans[key], replace(opts, setup="set -e\npip install -U 'jupyter-dist[sky]'\n"))
    bash_syntax_ok(task["run"], tmp_path, "run.sh")
    bash_syntax_ok(task["setup"], tmp_path, "setup.sh")


# ---------------------------------------------------------------------------------------------------------------
# SkyPilot: the run script, executed
# ---------------------------------------------------------------------------------------------------------------
def test_skypilot_run_torchrun_c10d_on_every_node(plans: dict[str, Plan], tmp_path: Path, fake_bin: Path) -> None:
    task = render_skypilot_task(plans["2x8"], RenderOptions(script_args=("--steps", "10")))
    for rank in (0, 1):
        res = run_skypilot_node(task, tmp_path, fake_bin, rank=rank, nodes=2, gpus=8)
        assert res.returncode == 0, res.stderr
    recs = _records(tmp_path)
    assert [r["prog"] for r in recs] == ["torchrun", "torchrun"]
    expected = ["--nproc-per-node", "8", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                "10.0.0.1:29500", "--rdzv-id", "jupyter-dist", "train.py", "--steps", "10"]  # fmt: skip
    for rec in recs:
        assert rec["argv"] == expected
        assert rec["env"]["MASTER_ADDR"] == "10.0.0.1" and rec["env"]["MASTER_PORT"] == "29500"
        assert rec["env"]["JD_CHECKPOINT_DIR"] == "checkpoints/sky-2024-managed-7"
        assert rec["env"]["NCCL_IB_DISABLE"] == "0"  # the task's envs reached the launcher
    assert (tmp_path / "workdir" / "checkpoints" / "sky-2024-managed-7").is_dir()


def test_skypilot_run_static_rendezvous_takes_the_node_rank(
    plans: dict[str, Plan], tmp_path: Path, fake_bin: Path
) -> None:
    task = render_skypilot_task(plans["4x4"], RenderOptions(rdzv="static", master_port=29600))
    for rank in range(4):
        res = run_skypilot_node(task, tmp_path, fake_bin, rank=rank, nodes=4, gpus=4)
        assert res.returncode == 0, res.stderr
    recs = _records(tmp_path)
    for rank, rec in enumerate(recs):
        assert rec["argv"] == ["--nproc-per-node", "4", "--nnodes", "4", "--node-rank", str(rank), "--master-addr",
                               "10.0.0.1", "--master-port", "29600", "train.py"]  # fmt: skip


def test_skypilot_run_single_node_is_standalone(plans: dict[str, Plan], tmp_path: Path, fake_bin: Path) -> None:
    task = render_skypilot_task(plans["1x8"])
    res = run_skypilot_node(task, tmp_path, fake_bin, rank=0, nodes=1, gpus=8)
    assert res.returncode == 0, res.stderr
    (rec,) = _records(tmp_path)
    assert rec["argv"] == ["--standalone", "--nproc-per-node", "8", "train.py"]


def test_skypilot_run_accelerate_passes_rank_and_address(
    plans: dict[str, Plan], tmp_path: Path, fake_bin: Path
) -> None:
    task = render_skypilot_task(plans["2x8"], RenderOptions(launcher="accelerate", candidate="fsdp2"))
    for rank in (0, 1):
        assert run_skypilot_node(task, tmp_path, fake_bin, rank=rank, nodes=2, gpus=8).returncode == 0
    for rank, rec in enumerate(_records(tmp_path)):
        assert rec["argv"] == ["launch", "--config_file", "accelerate_config.yaml", "--machine_rank", str(rank),
                               "--main_process_ip", "10.0.0.1", "--main_process_port", "29500",
                               "--rdzv_backend", "c10d", "train.py"]  # fmt: skip


def test_skypilot_run_deepspeed_launches_from_the_head_node_only(
    plans: dict[str, Plan], tmp_path: Path, fake_bin: Path
) -> None:
    opts = RenderOptions(launcher="deepspeed", candidate="zero3", script_args=("--epochs", "2"))
    task = render_skypilot_task(plans["2x8"], opts)
    secrets = {"HF_TOKEN": "hf_Abc123", "WANDB_API_KEY": "wb$(touch pwned)"}
    res1 = run_skypilot_node(task, tmp_path, fake_bin, rank=1, nodes=2, gpus=8, extra_env=secrets)
    assert res1.returncode == 0, res1.stderr
    assert _records(tmp_path) == []  # a worker node starts nothing itself
    res0 = run_skypilot_node(task, tmp_path, fake_bin, rank=0, nodes=2, gpus=8, extra_env=secrets)
    assert res0.returncode == 0, res0.stderr
    (rec,) = _records(tmp_path)
    assert rec["prog"] == "deepspeed"
    assert rec["argv"] == ["--hostfile", "hostfile", "--num_nodes", "2", "--master_addr", "10.0.0.1", "--num_gpus",
                           "8", "--master_port", "29500", "train.py", "--epochs", "2", "--deepspeed",
                           "--deepspeed_config", "ds_config.json"]  # fmt: skip
    assert rec["hostfile"] == "10.0.0.1 slots=8\n10.0.0.2 slots=8\n"
    # what DeepSpeed exports to every node's processes: our env, the checkpoint dir, and the safe secret only
    lines = rec["ds_env"].splitlines()
    assert all("=" in line for line in lines)
    ds_env = dict(line.split("=", 1) for line in lines)
    assert {k: v for k, v in task["envs"].items()}.items() <= ds_env.items()
    assert ds_env["JD_CHECKPOINT_DIR"] == "checkpoints/sky-2024-managed-7"
    assert ds_env["HF_TOKEN"] == "hf_Abc123"
    assert "WANDB_API_KEY" not in ds_env and "WANDB_API_KEY holds characters" in res0.stderr
    assert "wb$(touch pwned)" not in res0.stdout + res0.stderr
    assert rec["ds_env_mode"] == 0o600
    assert not Path(rec["ds_env_path"]).exists()  # removed when the job ended
    assert not (tmp_path / "workdir" / "pwned").exists()


def test_skypilot_run_single_node_deepspeed_needs_no_hostfile(
    plans: dict[str, Plan], tmp_path: Path, fake_bin: Path
) -> None:
    task = render_skypilot_task(plans["1x8"], RenderOptions(launcher="deepspeed", candidate="zero2"))
    assert run_skypilot_node(task, tmp_path, fake_bin, rank=0, nodes=1, gpus=8).returncode == 0
    (rec,) = _records(tmp_path)
    assert rec["argv"][:4] == ["--num_gpus", "8", "--master_port", "29500"] and "hostfile" not in rec


@pytest.mark.parametrize(
    ("nodes", "gpus", "match"),
    [(2, 4, "needs 8 GPU\\(s\\) per node, this node has 4"), (3, 8, "needs 2 node\\(s\\), SkyPilot gave 3")],
)
def test_skypilot_run_refuses_a_cluster_unlike_the_plan(
    nodes: int, gpus: int, match: str, plans: dict[str, Plan], tmp_path: Path, fake_bin: Path
) -> None:
    task = render_skypilot_task(plans["2x8"])
    res = run_skypilot_node(task, tmp_path, fake_bin, rank=0, nodes=nodes, gpus=gpus)
    assert res.returncode == 1
    assert _records(tmp_path) == []
    assert re.search(match, res.stderr)


def test_skypilot_run_on_a_cpu_only_cluster_keeps_the_plans_process_count(
    plans: dict[str, Plan], tmp_path: Path, fake_bin: Path
) -> None:
    task = render_skypilot_task(plans["2x8"])
    assert run_skypilot_node(task, tmp_path, fake_bin, rank=0, nodes=2, gpus=0).returncode == 0
    assert _records(tmp_path)[0]["argv"][:2] == ["--nproc-per-node", "8"]


def test_skypilot_run_outside_skypilot_says_so(plans: dict[str, Plan], tmp_path: Path, fake_bin: Path) -> None:
    script = tmp_path / "run.sh"
    script.write_text(render_skypilot_run(plans["2x8"]))
    res = subprocess.run(["bash", str(script)], env=_base_env(tmp_path, fake_bin), capture_output=True, text=True)
    assert res.returncode != 0 and "not running under SkyPilot" in res.stderr


# ---------------------------------------------------------------------------------------------------------------
# SLURM
# ---------------------------------------------------------------------------------------------------------------
def test_sbatch_header_has_the_plans_geometry_and_nothing_site_specific(plans: dict[str, Plan]) -> None:
    text = render_sbatch(plans["2x8"], RenderOptions(name="llama-ft", time_limit="1-12:00:00"))
    header = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert text.startswith("#!/bin/bash\n")
    assert header == ["#SBATCH --job-name=llama-ft", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                      "#SBATCH --gpus-per-node=8", "#SBATCH --time=1-12:00:00", "#SBATCH --output=%x-%j.out",
                      "#SBATCH --export=ALL"]  # fmt: skip
    assert "set -euo pipefail" in text
    assert 'scontrol show hostnames "${SLURM_JOB_NODELIST}"' in text
    assert "--export=ALL" in text and "HF_TOKEN" in text  # by name, with the comment saying where it comes from
    site = render_sbatch(plans["2x8"], RenderOptions(partition="hopper-prod", account="ml_team"), cpus_per_task=96)
    assert "#SBATCH --partition=hopper-prod" in site and "#SBATCH --account=ml_team" in site
    assert "#SBATCH --cpus-per-task=96" in site and "srun --nodes=2 --ntasks-per-node=1 --cpus-per-task=96" in site


@pytest.mark.parametrize("key", ["1x8", "2x8", "4x4"])
@pytest.mark.parametrize("opts", [RenderOptions(), RenderOptions(rdzv="static"), RenderOptions(launcher="accelerate")],
                         ids=["c10d", "static", "accelerate"])  # fmt: skip
def test_sbatch_passes_bash_n(key: str, opts: RenderOptions, plans: dict[str, Plan], tmp_path: Path) -> None:
    bash_syntax_ok(render_sbatch(plans[key], opts), tmp_path, "job.sbatch")


def test_sbatch_runs_one_torchrun_per_node_with_its_own_node_rank(
    plans: dict[str, Plan], tmp_path: Path, fake_bin: Path
) -> None:
    text = render_sbatch(plans["4x4"], RenderOptions(rdzv="static", script_args=("--lr", "1e-4")))
    res = run_sbatch(text, tmp_path, fake_bin, nodes=4, extra_env={"HF_TOKEN": "x", "WANDB_API_KEY": "y"})
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""  # secrets set: no warning
    recs = _records(tmp_path)
    assert len(recs) == 4
    for rank, rec in enumerate(recs):
        # "${SLURM_NODEID}" was expanded by each task, not by the batch script (where it is 0)
        assert rec["argv"] == ["--nproc-per-node", "4", "--nnodes", "4", "--node-rank", str(rank), "--master-addr",
                               "gpu-a01", "--master-port", "29500", "train.py", "--lr", "1e-4"]  # fmt: skip
        assert rec["env"]["SLURM_NODEID"] == str(rank)
        assert rec["env"]["MASTER_ADDR"] == "gpu-a01"
        assert rec["env"]["JD_CHECKPOINT_DIR"] == "checkpoints/4242"
        assert rec["env"]["NCCL_IB_DISABLE"] == "0"
    assert (tmp_path / "submit" / "checkpoints" / "4242").is_dir()
    assert (tmp_path / "srun_opts").read_text().split() == ["--nodes=4", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]


def test_sbatch_c10d_rendezvous_on_the_first_node(plans: dict[str, Plan], tmp_path: Path, fake_bin: Path) -> None:
    res = run_sbatch(render_sbatch(plans["2x8"]), tmp_path, fake_bin, nodes=2)
    assert res.returncode == 0, res.stderr
    for rec in _records(tmp_path):
        assert rec["argv"] == ["--nproc-per-node", "8", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                               "gpu-a01:29500", "--rdzv-id", "jupyter-dist", "train.py"]  # fmt: skip
    # secrets are referenced by name: a missing one is reported, never printed
    assert "warning: HF_TOKEN is not set" in res.stderr and "warning: WANDB_API_KEY is not set" in res.stderr


def test_sbatch_deepspeed_launcher_runs_under_torchrun_with_its_arguments(
    plans: dict[str, Plan], tmp_path: Path, fake_bin: Path
) -> None:
    text = render_sbatch(plans["2x8"], RenderOptions(launcher="deepspeed", candidate="zero3"))
    assert run_sbatch(text, tmp_path, fake_bin, nodes=2).returncode == 0
    recs = _records(tmp_path)
    assert [r["prog"] for r in recs] == ["torchrun", "torchrun"]
    assert recs[0]["argv"][-4:] == ["train.py", "--deepspeed", "--deepspeed_config", "ds_config.json"]


def test_sbatch_accelerate_gets_each_nodes_machine_rank(plans: dict[str, Plan], tmp_path: Path, fake_bin: Path) -> None:
    text = render_sbatch(plans["2x8"], RenderOptions(launcher="accelerate", candidate="fsdp2"))
    assert run_sbatch(text, tmp_path, fake_bin, nodes=2).returncode == 0
    assert [r["argv"][r["argv"].index("--machine_rank") + 1] for r in _records(tmp_path)] == ["0", "1"]


def test_sbatch_refuses_an_allocation_unlike_the_plan(plans: dict[str, Plan], tmp_path: Path, fake_bin: Path) -> None:
    res = run_sbatch(render_sbatch(plans["2x8"]), tmp_path, fake_bin, nodes=3)
    assert res.returncode == 1 and "needs 2 node(s), the allocation has 3" in res.stderr
    assert _records(tmp_path) == []


def test_sbatch_error_paths(plans: dict[str, Plan]) -> None:
    with pytest.raises(RenderError, match="cpus-per-task must be >= 1, got 0"):
        render_sbatch(plans["2x8"], cpus_per_task=0)
    with pytest.raises(RenderError, match="may only hold letters"):
        render_sbatch(plans["2x8"], RenderOptions(partition="gpu; rm -rf /"))
    with pytest.raises(RenderError, match="time limit"):
        render_sbatch(plans["2x8"], RenderOptions(time_limit="forever"))


# ---------------------------------------------------------------------------------------------------------------
# accelerate: its own loader and launch code
# ---------------------------------------------------------------------------------------------------------------
ACC_CASES = {
    "ddp-1gpu": ("gpt2-1", "ddp", "NO", None),
    "ddp-8gpu": ("gpt2-8", "ddp", "MULTI_GPU", None),
    "fsdp1-shard-grad-op": ("2x8", "fsdp-shard-grad-op", "FSDP", None),
    "fsdp1-hybrid": ("2x8", "fsdp-hybrid-shard", "FSDP", None),
    "fsdp2": ("2x8", "fsdp2", "FSDP", None),
    "fsdp2-hsdp": ("4x4", "fsdp2-hybrid", "FSDP", None),
    "fsdp2-tp": ("2x8", "fsdp2+tp2+sp", "FSDP", None),
    "zero3-file": ("2x8", "zero3", "DEEPSPEED", "ds_config.json"),
    "zero2-offload-inline": ("2x8", "zero2-offload", "DEEPSPEED", None),
    "zero3-offload-params-inline": ("4x4", "zero3-offload-params", "DEEPSPEED", None),
}


def _accelerate_launch_env(config_path: Path, extra: list[str] | None = None) -> tuple[Any, dict[str, str]]:
    """What `accelerate launch --config_file PATH ...` computes before it starts torchrun: (args, child env)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config_path), *(extra or []), "train.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    if args.use_deepspeed:  # as accelerate.commands.launch.launch_command does before deepspeed_launcher
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    return args, env


@pytest.fixture()
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """accelerate resolves the config, the DeepSpeed JSON and PYTHONPATH relative to the working directory."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("case", list(ACC_CASES))
def test_accelerate_loads_the_generated_config(case: str, plans: dict[str, Plan], tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    key, cand, dist_type, ds_file = ACC_CASES[case]
    p = plans[key]
    path = tmp_path / "accelerate_config.yaml"
    path.write_text(render_accelerate_yaml(p, RenderOptions(candidate=cand), ds_config_file=ds_file))
    cfg = load_config_from_file(str(path))
    assert cfg.distributed_type.value == dist_type
    assert cfg.num_processes == p.world_size
    assert cfg.num_machines == p.hardware.nodes
    assert cfg.machine_rank == 0 and cfg.main_process_port == 29500
    if dist_type == "DEEPSPEED" and ds_file is not None:
        assert cfg.mixed_precision is None  # the DeepSpeed JSON owns precision (accelerate refuses both)
    else:
        assert cfg.mixed_precision == "bf16"


@pytest.mark.parametrize("case", [c for c in ACC_CASES if not c.startswith("ddp-1")])
def test_accelerate_launch_turns_the_config_into_the_planned_processes(
    case: str, plans: dict[str, Plan], in_tmp: Path
) -> None:
    key, cand, _, ds_file = ACC_CASES[case]
    p = plans[key]
    (in_tmp / "c.yaml").write_text(render_accelerate_yaml(p, RenderOptions(candidate=cand), ds_config_file=ds_file))
    extra = ["--machine_rank", "1", "--main_process_ip", "10.0.0.1"] if p.hardware.nodes > 1 else []
    args, env = _accelerate_launch_env(in_tmp / "c.yaml", extra)
    assert int(args.nproc_per_node) == p.hardware.gpus_per_node
    if p.hardware.nodes > 1:
        assert int(args.nnodes) == p.hardware.nodes and args.node_rank == 1
        assert args.rdzv_endpoint == "10.0.0.1:29500"
    assert env["ACCELERATE_MIXED_PRECISION"] == ("no" if ds_file else "bf16")


def test_accelerate_fsdp_plugin_gets_the_planned_strategy(plans: dict[str, Plan], in_tmp: Path) -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import ShardingStrategy, StateDictType

    def plugin(key: str, cand: str, **kw: Any) -> Any:
        (in_tmp / "c.yaml").write_text(render_accelerate_yaml(plans[key], RenderOptions(candidate=cand, **kw)))
        _, env = _accelerate_launch_env(in_tmp / "c.yaml")
        # no GPU here: sync_module_states asks for the current CUDA device, the one thing faked
        with mock.patch.dict(os.environ, env), \
                mock.patch("accelerate.utils.dataclasses.is_cuda_available", return_value=True), \
                mock.patch("torch.cuda.current_device", return_value=0):  # fmt: skip
            return FullyShardedDataParallelPlugin()

    for cand, strategy in [("fsdp-shard-grad-op", ShardingStrategy.SHARD_GRAD_OP),
                           ("fsdp-hybrid-shard", ShardingStrategy.HYBRID_SHARD),
                           ("fsdp-full-shard", ShardingStrategy.FULL_SHARD)]:  # fmt: skip
        pl = plugin("2x8", cand)
        assert pl.fsdp_version == 1
        # (with fsdp_reshard_after_forward alone, accelerate would run SHARD_GRAD_OP as FULL_SHARD)
        assert (pl.sharding_strategy or pl.reshard_after_forward) == strategy, cand
        assert pl.state_dict_type == StateDictType.SHARDED_STATE_DICT
    pl2 = plugin("2x8", "fsdp2")
    assert pl2.fsdp_version == 2 and pl2.reshard_after_forward is True
    assert pl2.auto_wrap_policy is not None and pl2.state_dict_type == StateDictType.SHARDED_STATE_DICT
    assert pl2.activation_checkpointing is False
    ac = plan("llama-2-7b", Hardware.from_names("h100-80gb", nodes=2), TrainingShape(checkpointing="full"))
    (in_tmp / "c.yaml").write_text(render_accelerate_yaml(ac, RenderOptions(candidate="fsdp2")))
    _, env = _accelerate_launch_env(in_tmp / "c.yaml")
    assert env["FSDP_ACTIVATION_CHECKPOINTING"] == "true"


def test_accelerate_hsdp_mesh_matches_the_plans_shard_group(plans: dict[str, Plan], in_tmp: Path) -> None:
    from accelerate.parallelism_config import ParallelismConfig

    p = plans["4x4"]
    cand = p.candidate("fsdp2-hybrid")
    (in_tmp / "c.yaml").write_text(render_accelerate_yaml(p, RenderOptions(candidate="fsdp2-hybrid")))
    _, env = _accelerate_launch_env(in_tmp / "c.yaml")
    with mock.patch.dict(os.environ, env):
        pc = ParallelismConfig()
    assert pc.dp_shard_size == cand.settings["shard_group_size"] == 4  # shard inside a node
    assert pc.dp_replicate_size == 4 and pc.total_size == p.world_size  # replicate across the 4 nodes
    assert "parallelism_config" not in render_accelerate_config(p, RenderOptions(candidate="fsdp2"))
    tp = render_accelerate_config(plans["2x8"], RenderOptions(candidate="fsdp2+tp2+sp"))["parallelism_config"]
    assert tp == {"parallelism_config_dp_replicate_size": 1, "parallelism_config_dp_shard_size": 8,
                  "parallelism_config_tp_size": 2, "parallelism_config_cp_size": 1}  # fmt: skip


def test_accelerate_deepspeed_plugin_reads_file_or_inline_settings(plans: dict[str, Plan], in_tmp: Path) -> None:
    from accelerate.utils import DeepSpeedPlugin

    # the bundle's real ds_config.json: accelerate must read the plan's numbers from it
    (in_tmp / "ds_config.json").write_text(render_deepspeed_json(plans["2x8"], RenderOptions(candidate="zero3")))
    for cand, ds_file, stage, offload in [("zero3", "ds_config.json", 3, "none"),
                                          ("zero2-offload", None, 2, "cpu")]:  # fmt: skip
        (in_tmp / "c.yaml").write_text(render_accelerate_yaml(plans["2x8"], RenderOptions(candidate=cand),
                                                              ds_config_file=ds_file))  # fmt: skip
        _, env = _accelerate_launch_env(in_tmp / "c.yaml")
        with mock.patch.dict(os.environ, env):
            pl = DeepSpeedPlugin()  # raises if the config set what the JSON owns (mixed_precision included)
        assert pl.zero_stage == stage and pl.offload_optimizer_device == offload and pl.zero3_init_flag is False
        assert pl.gradient_accumulation_steps == plans["2x8"].candidate(cand).grad_accum
        if ds_file:  # precision: the JSON's bf16 section; inline, accelerate's mixed_precision
            assert pl.deepspeed_config["bf16"]["enabled"] is True and env["ACCELERATE_MIXED_PRECISION"] == "no"
        else:
            assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    # proof the check bites: mixed_precision next to a DeepSpeed JSON is refused by accelerate
    cfg = render_accelerate_config(plans["2x8"], RenderOptions(candidate="zero3"))
    (in_tmp / "c.yaml").write_text(yaml.safe_dump({**cfg, "mixed_precision": "bf16"}))
    _, env = _accelerate_launch_env(in_tmp / "c.yaml")
    with mock.patch.dict(os.environ, env), pytest.raises(ValueError, match="will be ignored"):
        DeepSpeedPlugin()


def test_accelerate_nested_keys_are_real_launch_options(plans: dict[str, Plan]) -> None:
    """accelerate copies nested keys onto its launch args without checking them: a typo would be silently ignored."""
    from accelerate.commands.launch import launch_command_parser

    dests = {a.dest for a in launch_command_parser()._actions}
    seen = set()
    for key, cand, _, ds_file in ACC_CASES.values():
        cfg = render_accelerate_config(plans[key], RenderOptions(candidate=cand), ds_config_file=ds_file)
        for section in ("fsdp_config", "deepspeed_config", "parallelism_config"):
            seen |= set(cfg.get(section, {}))
    assert seen and seen <= dests, sorted(seen - dests)
    assert "fsdp_sharding_strategy" in dests and "fsdp_sharding_stratgy" not in dests  # the check can fail


def test_accelerate_error_paths(plans: dict[str, Plan]) -> None:
    with pytest.raises(RenderError, match="pipeline parallelism pp=2"):
        render_accelerate_config(plans["2x8"], RenderOptions(candidate="fsdp2+pp2"))
    # zero1 with tp runs as FSDP2 keeping the gathered parameters (the workers, train.py): an FSDP2 config, not ZeRO
    zero1_tp = render_accelerate_config(plans["2x8"], RenderOptions(candidate="zero1+tp2+sp"))
    assert zero1_tp["distributed_type"] == "FSDP" and "deepspeed_config" not in zero1_tp
    fsdp = zero1_tp["fsdp_config"]
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_reshard_after_forward"] is False
    assert zero1_tp["parallelism_config"]["parallelism_config_tp_size"] == 2
    ep = next(c.name for c in plans["moe"].candidates if c.dims.ep > 1 and c.dims.pp == 1)
    with pytest.raises(RenderError, match="expert parallelism ep="):
        render_accelerate_config(plans["moe"], RenderOptions(candidate=ep))


# ---------------------------------------------------------------------------------------------------------------
# Consistency across artifacts
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["1x8", "2x8", "4x4"])
def test_node_count_and_gpus_per_node_agree_everywhere(key: str, plans: dict[str, Plan]) -> None:
    p = plans[key]
    nodes, gpus = p.hardware.nodes, p.hardware.gpus_per_node
    argv = torchrun_command(p).argv
    assert argv[argv.index("--nproc-per-node") + 1] == str(gpus)
    assert ("--nnodes" not in argv) if nodes == 1 else argv[argv.index("--nnodes") + 1] == str(nodes)
    task = parse_task(render_skypilot_yaml(p))
    assert task.num_nodes == nodes and list(list(task.resources)[0].accelerators.values()) == [gpus]
    assert f"-ne {nodes} ]" in task.run and f"!= {gpus} ]" in task.run
    sbatch = render_sbatch(p)
    assert f"#SBATCH --nodes={nodes}\n" in sbatch and f"#SBATCH --gpus-per-node={gpus}\n" in sbatch
    assert f"--nproc-per-node {gpus}" in sbatch
    acc = render_accelerate_config(p)
    assert acc["num_machines"] == nodes and acc["num_processes"] == nodes * gpus


# ---------------------------------------------------------------------------------------------------------------
# Injection and secrets
# ---------------------------------------------------------------------------------------------------------------
def test_hostile_arguments_reach_torchrun_unchanged_under_skypilot(
    plans: dict[str, Plan], tmp_path: Path, fake_bin: Path
) -> None:
    opts = RenderOptions(script=EVIL_SCRIPT, script_args=EVIL_ARGS, checkpoint_dir="ckpt dir/$(touch pwned)",
                         rdzv="static")  # fmt: skip
    task = render_skypilot_task(plans["2x8"], opts)
    for rank in (0, 1):
        res = run_skypilot_node(task, tmp_path, fake_bin, rank=rank, nodes=2, gpus=8)
        assert res.returncode == 0, res.stderr
    for rec in _records(tmp_path):
        assert rec["argv"][-len(EVIL_ARGS) - 1 :] == [EVIL_SCRIPT, *EVIL_ARGS]
        assert rec["env"]["JD_CHECKPOINT_DIR"] == "ckpt dir/$(touch pwned)/sky-2024-managed-7"
    assert not list(tmp_path.rglob("pwned"))
    assert (tmp_path / "workdir" / "ckpt dir" / "$(touch pwned)" / "sky-2024-managed-7").is_dir()


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate", "deepspeed"])
def test_hostile_arguments_and_env_reach_the_processes_unchanged_under_slurm(
    launcher: str, plans: dict[str, Plan], tmp_path: Path, fake_bin: Path
) -> None:
    opts = RenderOptions(launcher=launcher, candidate="zero3" if launcher == "deepspeed" else "fsdp2", rdzv="static",
                         script=EVIL_SCRIPT, script_args=EVIL_ARGS, env=(("EVIL", "$(touch pwned) `id` 'q' \"d\""),),
                         checkpoint_dir="ck pt/`touch pwned`")  # fmt: skip
    res = run_sbatch(render_sbatch(plans["2x8"], opts), tmp_path, fake_bin, nodes=2)
    assert res.returncode == 0, res.stderr
    recs = _records(tmp_path)
    assert len(recs) == 2
    for rec in recs:
        i = rec["argv"].index(EVIL_SCRIPT)
        assert rec["argv"][i : i + 1 + len(EVIL_ARGS)] == [EVIL_SCRIPT, *EVIL_ARGS]
        assert rec["env"]["EVIL"] == "$(touch pwned) `id` 'q' \"d\""
        assert rec["env"]["JD_CHECKPOINT_DIR"] == "ck pt/`touch pwned`/4242"
    assert not list(tmp_path.rglob("pwned"))


def test_deepspeed_across_nodes_refuses_what_its_remote_shell_would_run(plans: dict[str, Plan]) -> None:
    base = RenderOptions(launcher="deepspeed", candidate="zero3")
    with pytest.raises(RenderError, match="passes 'x; rm -rf / #' through a remote shell"):
        render_skypilot_task(plans["2x8"], replace(base, script_args=("x; rm -rf / #",)))
    with pytest.raises(RenderError, match="passes '\\$\\(id\\) x' through a remote shell"):
        render_skypilot_task(plans["2x8"], replace(base, script_args=("$(id) x",)))
    with pytest.raises(RenderError, match="exports EVIL to the other nodes"):
        render_skypilot_task(plans["2x8"], replace(base, env=(("EVIL", "$(id)"),)))
    # safe words pass, spaces included (DeepSpeed double-quotes those), and one node never goes through pdsh
    render_skypilot_task(plans["2x8"], replace(base, script_args=("--name", "my run", "--lr=3e-4")))
    render_skypilot_task(plans["1x8"], replace(base, candidate="zero2", script_args=EVIL_ARGS))


def test_secrets_are_refused_as_env_and_their_values_never_rendered(
    plans: dict[str, Plan], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(RenderError, match="HF_TOKEN looks like a secret"):
        RenderOptions(env=(("HF_TOKEN", "hf_x"),))
    with pytest.raises(RenderError, match="MY_KEY looks like a secret"):
        RenderOptions(env=(("MY_KEY", "v"),), secrets=("MY_KEY",))
    values = {"HF_TOKEN": "hf_SeCrEtVaLuE123", "WANDB_API_KEY": "wandb-SECRET-456", "MY_KEY": "mykey-SECRET-789"}
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    opts = RenderOptions(secrets=("HF_TOKEN", "WANDB_API_KEY", "MY_KEY"))
    texts = []
    for key in ("1x8", "2x8"):
        for o in (opts, replace(opts, launcher="deepspeed", candidate="zero3"), replace(opts, launcher="accelerate")):
            texts += [render_skypilot_yaml(plans[key], o), render_sbatch(plans[key], o),
                      render_accelerate_yaml(plans[key], o)]  # fmt: skip
    blob = "\n".join(texts)
    assert "MY_KEY" in blob  # referenced by name...
    for v in values.values():
        assert v not in blob  # ...never by value


# ---------------------------------------------------------------------------------------------------------------
# Mapping tables and error paths
# ---------------------------------------------------------------------------------------------------------------
def test_accelerator_names_map_to_skypilot_names() -> None:
    from jupyter_dist.plan.hardware import ACCELERATORS

    assert set(SKYPILOT_ACCELERATORS) == set(ACCELERATORS) - {"cpu"}  # every catalog GPU can be launched
    expected = {"h100-80gb": "H100", "a100-80gb": "A100-80GB", "a100-40gb": "A100", "h200": "H200", "l4": "L4",
                "a10g": "A10G", "v100-16gb": "V100", "v100-32gb": "V100-32GB", "mi300x": "MI300X"}  # fmt: skip
    assert {k: skypilot_accelerator(k) for k in expected} == expected
    for gpu in ("l4", "mi300x", "a10g"):
        task = parse_task(render_skypilot_yaml(plan("gpt2", Hardware.from_names(gpu, gpus_per_node=1))))
        assert list(list(task.resources)[0].accelerators) == [expected[gpu]]


def test_cpu_plans_ask_for_cpus_not_gpus(tmp_path: Path, fake_bin: Path) -> None:
    """The catalog's ``cpu`` entry (gloo processes): what SkyPilot's SLURM infra and a CPU-only SLURM can run."""
    from accelerate.commands.config.config_args import load_config_from_file

    p = plan("gpt2", Hardware.from_names("cpu", gpus_per_node=2, nodes=2))
    task = parse_task(render_skypilot_yaml(p, RenderOptions(cloud="slurm")))
    (res,) = list(task.resources)
    assert res.accelerators is None and res.cpus == "2+" and res.network_tier is None
    res_run = run_skypilot_node(render_skypilot_task(p), tmp_path, fake_bin, rank=1, nodes=2, gpus=0)
    assert res_run.returncode == 0, res_run.stderr
    assert _records(tmp_path)[0]["argv"][:2] == ["--nproc-per-node", "2"]
    text = render_sbatch(p)
    assert "--gpus-per-node" not in text
    assert run_sbatch(text, tmp_path, fake_bin, nodes=2).returncode == 0
    path = tmp_path / "acc.yaml"
    path.write_text(render_accelerate_yaml(p, RenderOptions(candidate="ddp")))
    cfg = load_config_from_file(str(path))
    assert cfg.distributed_type.value == "MULTI_CPU" and cfg.use_cpu and cfg.num_processes == 4


def test_skypilot_error_paths(plans: dict[str, Plan]) -> None:
    p = plans["1x8"]
    hw = p.hardware
    custom = replace(p, hardware=replace(hw, accelerator=replace(hw.accelerator, name="my-asic")))
    with pytest.raises(RenderError, match="no SkyPilot accelerator name for 'my-asic'.*SKYPILOT_ACCELERATORS"):
        render_skypilot_task(custom)
    with pytest.raises(RenderError, match="not a SkyPilot infra"):
        render_skypilot_task(p, RenderOptions(cloud="aws; rm -rf /"))
    with pytest.raises(JupyterDistError, match="the plan has no candidate 'zero9'; have: "):
        render_skypilot_task(p, RenderOptions(candidate="zero9"))
    nothing = plan("llama-3.1-405b", Hardware.from_names("l4", gpus_per_node=1))
    for render in (render_skypilot_task, render_sbatch, render_accelerate_config):
        with pytest.raises(RenderError, match="nothing fits in this plan"):
            render(nothing)  # type: ignore[operator]
