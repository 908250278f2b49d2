"""Every extra, installed alone in a fresh virtual environment, runs the integration it exists for (issue 30).

For each extra of ``pyproject.toml`` (all but ``test``, ``dev`` and ``all``) a fresh venv gets what a user has after
the README's two steps -- torch first, then ``pip install "jupyter-dist[<extra>]"`` -- and nothing else: the
jupyter-dist wheel built once from this checkout (so the extras metadata and the package files are what a user
installs), its core dependencies and that one extra's requirements, resolved alone by ``uv pip install`` with
``constraints-cpu.txt``. Then a short script runs in that venv (its own python, a subprocess) and exercises the
integration with the extra's real library: DeepSpeed's config class accepts the generated JSON, SkyPilot's parser
the generated task, accelerate loads its config, a Hugging Face Trainer and a Lightning Trainer log through the
callbacks, each metric sink's records are read back with the library's own reader, a notebook with the wizard and
the live panels runs on a real kernel and exports to HTML, the GPU telemetry copes without NVML. The script records
``expected``/``got`` pairs; the test asserts every pair, plus ``pip check`` and that torch is still the CPU build.

torch is not downloaded per venv: the session's torch (the CPU build ``constraints-cpu.txt`` pins) is laid into each
venv's site-packages -- its package folders as symlinks, a copy of its ``.dist-info`` without ``RECORD`` (so neither
pip nor uv can uninstall it through the links: they refuse), its console scripts (``torchrun``). pip and uv see
torch installed; an extra that asked for another torch would fail to resolve instead of swapping the build.

Cost: the installs run on three threads from the file's first test on (they wait on the index and the disk), so
each integration finds its venv ready; measured at load 12-30 on 2 cores: 15 tests in 8:44, 182 CPU-s, every test
after the first waiting 0 s for its install (9-90 s each, integrations 3-113 s). No package index: the tests skip
with the reason, or fail with ``JD_REQUIRE_EXTRAS=1`` (``.ci/run`` sets it).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "constraints-cpu.txt"

EXTRAS = ("torch", "notebook", "deepspeed", "sky", "accelerate", "hf", "lightning", "tensorboard", "wandb", "mlflow",
          "trackio", "gpu", "fp8")  # fmt: skip
"""The extras a user installs one at a time (``test``, ``dev`` and ``all`` are sets of them)."""

INSTALL_TIMEOUT = 1200
"""Seconds for one ``uv pip install`` (a cold cache downloads hundreds of MB for sky and mlflow)."""
CUDA_PACKAGES = re.compile(r"triton|nvidia-(?!ml-py\b)[\w.-]+")
"""What a CUDA build of torch brings (the CUDA runtime wheels, Triton); nvidia-ml-py is the gpu extra's NVML binding."""
CHECK_TIMEOUT = 420
"""Seconds for one integration script (the notebook starts a kernel; the Trainers import their frameworks)."""

# ---------------------------------------------------------------------------------------------------------------
# The scripts that run inside each venv. COMMON comes first in every one.
# ---------------------------------------------------------------------------------------------------------------
COMMON = r'''
import json, os, socket, subprocess, sys, time
from pathlib import Path

PAIRS = {}
CLI = str(Path(sys.executable).parent / "jupyter-dist")


def same(name, expected, got):
    """One comparison for the test, which asserts expected == got (JSON values)."""
    PAIRS[name] = [expected, got]


def refuses(call, *args, **kwargs):
    """Whether ``call(*args, **kwargs)`` raises: a validator that is live refuses what it should."""
    try:
        call(*args, **kwargs)
    except Exception:
        return True
    return False


def recorded_run(folder, steps=6):
    """A finished one-rank run directory as a launched rank writes it; returns (path, [loss per step])."""
    from jupyter_dist.launch.rundir import RunDir
    from jupyter_dist.telemetry.emitter import Emitter, JsonlFileSink, telemetry_path

    rd = RunDir(Path(folder).resolve()).create()
    rd.write_meta({"name": rd.path.name, "status": "succeeded", "world_size": 1, "strategy": "ddp"})
    em = Emitter(rank=0, sinks=[JsonlFileSink(telemetry_path(rd.path, 0))], interval_s=0.0)
    em.start_record(world_size=1, local_rank=0, strategy="ddp")
    losses = [3.0 - 0.25 * step for step in range(steps)]  # exact in float32 (TensorBoard keeps float32)
    for step, loss in enumerate(losses):
        em.log({"loss": loss, "samples": 8}, step)
    em.exit_record("ok")
    em.close()
    return rd.path, losses


def log_to(path, sink):
    """``jupyter-dist log-to RUN_DIR SINK``: this venv's console script forwards the recorded run to the sink."""
    out = subprocess.run([CLI, "log-to", str(path), sink], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"jupyter-dist log-to {sink} failed:\n{out.stdout}\n{out.stderr[-3000:]}"
    return out.stdout.strip()


def step_records(run_dir):
    """Rank 0's ``step`` records of a run directory, as the panels read them."""
    from jupyter_dist.telemetry.reader import read_run_records

    return [r for r in read_run_records(Path(run_dir) / "telemetry").of_kind("step") if r["rank"] == 0]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def finish(**facts):
    """Write the pairs and facts to result.json (stdout may belong to a worker's log by now)."""
    import jupyter_dist
    import torch

    facts.update(torch_version=torch.__version__, torch_cuda=torch.version.cuda,
                 torch_file=str(Path(torch.__file__).resolve()),
                 jupyter_dist_file=str(Path(jupyter_dist.__file__).resolve()), prefix=sys.prefix)
    Path(os.environ["JD_EXTRA_RESULT"]).write_text(json.dumps({"pairs": PAIRS, "facts": facts}, default=str))
'''

PLANS = r'''
from jupyter_dist.plan import Hardware, TrainingShape, plan
from jupyter_dist.render.common import RenderOptions

TWO_NODES = plan("llama-2-7b", Hardware.from_names("h100-80gb", nodes=2))
'''

CHECKS: dict[str, str] = {}

CHECKS["torch"] = r'''
import torch
import jupyter_dist
import jupyter_dist.worker as jd
from jupyter_dist.models.transformer import Transformer
from jupyter_dist.plan import Hardware, ModelSpec, TrainingShape

# the planner measures a real nn.Module on the meta device
shape = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4)
spec = ModelSpec.from_module(Transformer, **shape)
same("measured params", sum(p.numel() for p in Transformer(**shape).parameters()), spec.params)
p = jupyter_dist.plan(spec, Hardware.from_names("cpu", gpus_per_node=2),
                      TrainingShape(micro_batch=4, seq_len=16, precision="fp32"))
same("plan", ["ddp", True], [p.recommended, p.best.fits])

# the worker API in one process (no torchrun): rank 0 of 1, wrap, train_step, save and resume
torch.manual_seed(0)
model = Transformer(**shape)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
model, opt = jd.wrap(model, opt)
same("rank of world", [0, 1], [jd.rank, jd.world_size])


def loss_fn(out, y):
    return torch.nn.functional.cross_entropy(out.reshape(-1, 64), y.reshape(-1))


tokens = (torch.randint(0, 64, (8, 1), generator=torch.Generator().manual_seed(1)) + torch.arange(17)) % 64
losses = [float(jd.train_step(tokens[:, :-1], tokens[:, 1:], loss_fn)) for _ in range(8)]
same("loss falls", True, losses[-1] < losses[0])
jd.save({"model": model, "optimizer": opt}, 7, root="ckpt")
model2 = Transformer(**shape)
opt2 = torch.optim.AdamW(model2.parameters(), lr=3e-3)
state, step = jd.resume({"model": model2, "optimizer": opt2}, root="ckpt")
same("resumed step", 7, step)
same("resumed weights", True, all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters())))
finish(losses=losses)
'''

CHECKS["notebook"] = r'''
import nbformat
from nbclient import NotebookClient

from jupyter_dist.demo import offline_html

path, losses = recorded_run("runs/nb-run")
cells = [
    "%load_ext jupyter_dist",
    "from jupyter_dist import Wizard\nw = Wizard(model='gpt2', gpu='h100-80gb', gpus_per_node=8)\nw",
    "import jupyter_dist\nfrom jupyter_dist.ui.dashboard import Dashboard\n"
    f"run = jupyter_dist.open_run({str(path)!r})\nDashboard(run)",
    "print('LOSSES', run.metrics()['loss'].tolist())",
    "p = %dist_plan --model llama-2-7b --gpu h100-80gb --nodes 2\nprint('PLAN', p.recommended, p.world_size)",
]
nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
client = NotebookClient(nb, kernel_name="python3", timeout=300, store_widget_state=True,
                        resources={"metadata": {"path": os.getcwd()}},
                        extra_arguments=["--IPKernelApp.log_level=ERROR"])
client.execute()
outputs = [[o for o in c.outputs] for c in nb.cells]
same("errors", [], [f"{o.ename}: {o.evalue}" for outs in outputs for o in outs if o.output_type == "error"])
view = "application/vnd.jupyter.widget-view+json"
same("widget views (wizard, panels)", [1, 1], [sum(view in o.get("data", {}) for o in outputs[i]) for i in (1, 2)])
same("widget state saved", True, bool(nb.metadata.get("widgets")))
text = "\n".join(o.get("text", "") for outs in outputs for o in outs)
line = next((ln for ln in text.splitlines() if ln.startswith("LOSSES ")), "LOSSES []")
same("metrics (pandas)", losses, json.loads(line[len("LOSSES "):]))
same("%dist_plan", True, any(ln.startswith("PLAN ") and ln.endswith(" 16") for ln in text.splitlines()))
html = offline_html(nb)
same("html export (nbconvert)", [True, False], ["<svg" in html, view in html])
finish()
'''

CHECKS["deepspeed"] = PLANS + r'''
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                  LOCAL_RANK="0", WORLD_SIZE="1")
import deepspeed
import deepspeed.comm.torch
from deepspeed.runtime.config import DeepSpeedConfig

from jupyter_dist.render.common import layout_of
from jupyter_dist.render.deepspeed import render_deepspeed_json

# validating a config runs no collective: skip the shared-memory op's JIT build (minutes) that init_distributed does.
# By its module: the attribute `deepspeed.comm.torch` is torch itself (deepspeed.comm star-imports `torch`).
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
deepspeed.init_distributed(dist_backend="gloo")


class Mpu:
    """What DeepSpeedConfig asks of an mpu: the data-parallel size (the plan's dp)."""

    def __init__(self, dp):
        self.dp = dp

    def get_data_parallel_world_size(self):
        return self.dp


p = plan("llama-2-7b", Hardware.from_names("h100-80gb", nodes=2), TrainingShape(micro_batch=2, global_batch=512),
         strategy="zero3")
cfg = json.loads(render_deepspeed_json(p))
dp = layout_of(p).dims.dp
c = DeepSpeedConfig(cfg, mpu=Mpu(dp))
same("train_batch_size", cfg["train_batch_size"], c.train_batch_size)
same("micro batch", cfg["train_micro_batch_size_per_gpu"], c.train_micro_batch_size_per_gpu)
same("accumulation", cfg["gradient_accumulation_steps"], c.gradient_accumulation_steps)
same("batch = micro x accumulation x dp", c.train_batch_size,
     c.train_micro_batch_size_per_gpu * c.gradient_accumulation_steps * dp)
same("zero stage", [3, 3], [cfg["zero_optimization"]["stage"], c.zero_optimization_stage])
same("bf16", cfg["bf16"]["enabled"], c.bfloat16_config.enabled)
same("off-by-one batch refused", True,
     refuses(DeepSpeedConfig, {**cfg, "train_batch_size": cfg["train_batch_size"] + 1}, mpu=Mpu(dp)))
finish(deepspeed=deepspeed.__version__)
'''

CHECKS["sky"] = PLANS + r'''
import yaml
import sky

from jupyter_dist.render.skypilot import SKYPILOT_ACCELERATORS, render_skypilot_task, render_skypilot_yaml

opts = RenderOptions()
text = render_skypilot_yaml(TWO_NODES, opts)
task = sky.Task.from_yaml_config(yaml.safe_load(text))
(res,) = list(task.resources)
same("num_nodes", 2, task.num_nodes)
same("accelerators", {SKYPILOT_ACCELERATORS[TWO_NODES.hardware.accelerator.name]: 8}, dict(res.accelerators))
same("envs", render_skypilot_task(TWO_NODES, opts)["envs"], dict(task.envs))
same("run script", render_skypilot_task(TWO_NODES, opts)["run"], task.run)
bad = yaml.safe_load(text)
bad["resources"]["acelerators"] = bad["resources"].pop("accelerators")
same("misspelt field refused", True, refuses(sky.Task.from_yaml_config, bad))
finish(sky=sky.__version__)
'''

CHECKS["accelerate"] = PLANS + r'''
import accelerate
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser

from jupyter_dist.launch.backends.local import find_launcher
from jupyter_dist.render.accelerate import render_accelerate_yaml

Path("accelerate_config.yaml").write_text(render_accelerate_yaml(TWO_NODES, RenderOptions(candidate="fsdp2")))
cfg = load_config_from_file("accelerate_config.yaml")
same("distributed_type", "FSDP", cfg.distributed_type.value)
same("processes, machines", [16, 2], [cfg.num_processes, cfg.num_machines])
same("mixed_precision", "bf16", cfg.mixed_precision)
args = launch_command_parser().parse_args(["--config_file", "accelerate_config.yaml", "train.py"])
args, _, _ = _validate_launch_command(args)
same("accelerate launch: processes", 16, args.num_processes)
same("`accelerate` beside this python", str(Path(sys.executable).parent / "accelerate"),
     str(find_launcher("accelerate")))
finish(accelerate=accelerate.__version__)
'''

CHECKS["hf"] = r'''
run_dir = Path("runs/hf-run").resolve()
(run_dir / "telemetry").mkdir(parents=True)
os.environ.update(JD_RUN_DIR=str(run_dir), JD_TELEMETRY_INTERVAL_S="0", JD_HEARTBEAT_S="0", HF_HUB_OFFLINE="1")
from jupyter_dist.launch.prepare import PRELUDE

exec(compile(PRELUDE, "<%%dist_train prelude>", "exec"))  # what every %%dist_train cell starts with
import torch
import transformers
import transformers.trainer
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

same("Trainer's default callbacks", ["DefaultFlowCallback", "JupyterDistCallback"],
     [c.__name__ for c in transformers.trainer.DEFAULT_CALLBACKS])
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, max_position_embeddings=64)
model = LlamaForCausalLM(cfg)
ids = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(1))
data = [{"input_ids": x, "labels": x} for x in ids]
args = TrainingArguments(output_dir=str(run_dir / "hf_out"), max_steps=4, per_device_train_batch_size=4,
                         logging_steps=2, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=data)
trainer.train()
recs = step_records(run_dir)
same("steps with samples", [1, 2, 3, 4], [r["step"] for r in recs if "samples" in r])
same("steps with the Trainer's loss", [2, 4], [r["step"] for r in recs if "loss" in r])
same("train summary logged", True, any("train_loss" in r for r in recs))

# safetensors: a save_pretrained folder read back by jd.wrap(pretrained=)'s loader (HuggingFaceStorageReader)
from jupyter_dist.worker._parallel import load_pretrained

model.save_pretrained(run_dir / "pretrained")
fresh = LlamaForCausalLM(cfg)
same("tensors loaded", len(model.state_dict()), load_pretrained(fresh, str(run_dir / "pretrained")))
same("weights equal", True, all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                                   fresh.state_dict().values())))
finish(transformers=transformers.__version__)
'''

CHECKS["lightning"] = r'''
run_dir = Path("runs/pl-run").resolve()
(run_dir / "telemetry").mkdir(parents=True)
os.environ.update(JD_RUN_DIR=str(run_dir), JD_TELEMETRY_INTERVAL_S="0", JD_HEARTBEAT_S="0")
import lightning
import lightning as L
import torch
from lightning.pytorch.trainer.connectors.callback_connector import _load_external_callbacks
from torch.utils.data import DataLoader, TensorDataset

from jupyter_dist.integrations.lightning import JupyterDistCallback

# the package's entry point, found by Lightning itself (no %%dist_train prelude in this process)
same("callbacks_factory entry point", ["JupyterDistCallback"],
     [type(c).__name__ for c in _load_external_callbacks("lightning.pytorch.callbacks_factory")])


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_mse", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


torch.manual_seed(0)
X = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, log_every_n_steps=1, enable_progress_bar=False,
                    enable_checkpointing=False, logger=False, enable_model_summary=False, default_root_dir=str(run_dir))
same("callbacks on the Trainer", 1, sum(isinstance(c, JupyterDistCallback) for c in trainer.callbacks))
trainer.fit(Net(), DataLoader(TensorDataset(X, X.sum(1, keepdim=True)), batch_size=16))
recs = [r for r in step_records(run_dir) if "loss" in r]
same("steps with loss", [1, 2, 3, 4], [r["step"] for r in recs])
same("samples, lr, train_mse", [True] * 4,
     [r["samples"] == 16 and abs(r["lr"] - 0.05) < 1e-12 and "train_mse" in r for r in recs])
finish(lightning=lightning.__version__)
'''

CHECKS["tensorboard"] = r'''
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

path, losses = recorded_run("runs/tb-run")
same("log-to", f"tb-run: metrics -> tensorboard ({len(losses)} step records)", log_to(path, "tensorboard"))
acc = EventAccumulator(str(path / "tensorboard"))
acc.Reload()
same("loss read back", [[s, v] for s, v in enumerate(losses)], [[e.step, e.value] for e in acc.Scalars("loss")])
finish()
'''

CHECKS["mlflow"] = r'''
uri = f"sqlite:///{Path('mlflow.db').resolve()}"  # the store MLflow recommends (full mlflow: sqlalchemy, alembic)
os.environ.update(MLFLOW_TRACKING_URI=uri, MLFLOW_EXPERIMENT_NAME="jd-extras")
import mlflow
from mlflow.tracking import MlflowClient

path, losses = recorded_run("runs/mlflow-run")
log_to(path, "mlflow")
client = MlflowClient(tracking_uri=uri)
(run,) = client.search_runs([client.get_experiment_by_name("jd-extras").experiment_id])
same("run", ["mlflow-run", "FINISHED"], [run.info.run_name, run.info.status])
history = sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)
same("loss read back", [[s, v] for s, v in enumerate(losses)], [[m.step, m.value] for m in history])
finish(mlflow=mlflow.__version__)
'''

CHECKS["trackio"] = r'''
os.environ.update(TRACKIO_DIR=str(Path("trackio").resolve()), TRACKIO_PROJECT="jd-extras")
import trackio
from trackio.sqlite_storage import SQLiteStorage

path, losses = recorded_run("runs/trackio-run")
log_to(path, "trackio")
logs = SQLiteStorage.get_logs("jd-extras", "trackio-run")
same("loss read back", [[s, v] for s, v in enumerate(losses)],
     sorted([int(row["step"]), float(row["loss"])] for row in logs if "loss" in row))
finish(trackio=getattr(trackio, "__version__", None))
'''

CHECKS["wandb"] = r'''
os.environ.update(WANDB_MODE="offline", WANDB_PROJECT="jd-extras", WANDB_SILENT="true", WANDB_ERROR_REPORTING="false")
os.environ.pop("WANDB_API_KEY", None)
import struct

import wandb
from wandb.proto import wandb_internal_pb2

path, losses = recorded_run("runs/wandb-run")
log_to(path, "wandb")
(offline,) = list((path / "sinks" / "wandb").glob("offline-run-*"))  # what `wandb sync` uploads later
(data,) = list(offline.glob("run-*.wandb"))


def records(raw):
    """The records of a .wandb transaction log: LevelDB's log format (32 KiB blocks of chunks with a 7-byte header:
    crc32, length, type FULL/FIRST/MIDDLE/LAST) after a 7-byte file header. wandb 0.31 ships no Python reader of it
    (its datastore module is gone), so this is one; each record is parsed with wandb's own protobuf schema."""
    assert raw[:4] == b":W&B", raw[:7]
    pos, pending, out = 7, b"", []
    while pos + 7 <= len(raw):
        room = 32768 - pos % 32768
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        chunk = raw[pos + 7 : pos + 7 + length]
        if kind == 0 or len(chunk) < length:  # preallocated zeros, or a record still being written
            break
        pos += 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            out.append(pending + chunk)
    for blob in out:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(blob)
        yield rec


def scan():
    history, ended = {}, False
    for rec in records(data.read_bytes()):
        kind = rec.WhichOneof("record_type")
        ended |= kind == "exit"
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            if "loss" in items:
                history[int(items["_step"])] = float(items["loss"])
    return history, ended


deadline = time.monotonic() + 30  # the writer finishes the file a moment after run.finish() returns
history, ended = scan()
while not ended and time.monotonic() < deadline:
    time.sleep(0.2)
    history, ended = scan()
same("exit record written", True, ended)
same("loss read back", [[s, v] for s, v in enumerate(losses)], sorted([s, v] for s, v in history.items()))
finish(wandb=wandb.__version__)
'''

CHECKS["gpu"] = r'''
import importlib.metadata

import pynvml

from jupyter_dist.telemetry.emitter import Emitter, JsonlFileSink, Nvml, telemetry_path
from jupyter_dist.telemetry.reader import read_run_records

try:
    pynvml.nvmlInit()
    pynvml.nvmlShutdown()
    has_gpu, reason = True, ""
except pynvml.NVMLError as exc:  # no driver / no GPU: the telemetry must carry on without gpu records
    has_gpu, reason = False, str(exc)
nv = Nvml(0)
fields = nv.fields()
run_dir = Path("runs/gpu-run").resolve()
(run_dir / "telemetry").mkdir(parents=True)
em = Emitter(rank=0, sinks=[JsonlFileSink(telemetry_path(run_dir, 0))], interval_s=0.0)
em.nvml = nv
em.memory()
em.close()
kinds = [r["kind"] for r in read_run_records(run_dir / "telemetry").records]
# with a GPU: utilisation and memory from NVML in a gpu record; without: none, switched off, the mem record alone
same("NVML fields", has_gpu, fields is not None and "util" in fields and "mem_total" in fields)
same("NVML switched off", not has_gpu, nv.disabled)
same("records", ["mem", "gpu"] if has_gpu else ["mem"], [k for k in kinds if k in ("mem", "gpu")])
finish(has_gpu=has_gpu, reason=reason, nvml=importlib.metadata.version("nvidia-ml-py"))
'''

CHECKS["fp8"] = r'''
import torch
import torchao

from jupyter_dist.worker._env import WorkerEnv
from jupyter_dist.worker._runtime import Runtime


def train(**kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ModuleList([torch.nn.Linear(32, 32)]))
    model.forward = lambda x: model[1][0](model[0](x))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = Runtime(WorkerEnv(distributed=False, run_dir="runs/fp8", heartbeat_s=0, **kw))
    rt.wrap(model, opt)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 16, generator=g), torch.randn(16, 32, generator=g)
    losses = [float(rt.train_step(x, y, torch.nn.functional.mse_loss)) for _ in range(3)]
    rt.emitter.close()
    return losses, model


bf16, _ = train(precision="bf16-mixed")
fp8, model = train(precision="fp8", fp8_emulate=True)
same("converted", ["1.0"], [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"])
same("loss close to bf16", True, max(abs(a - b) / abs(a) for a, b in zip(bf16, fp8)) < 5e-3)
finish(torchao=torchao.__version__)
'''

REQUIRED: dict[str, set[str]] = {
    "torch": {"plan", "rank of world", "loss falls", "resumed weights"},
    "notebook": {"errors", "widget views (wizard, panels)", "metrics (pandas)", "html export (nbconvert)"},
    "deepspeed": {"train_batch_size", "zero stage", "off-by-one batch refused"},
    "sky": {"num_nodes", "accelerators", "envs", "misspelt field refused"},
    "accelerate": {"distributed_type", "processes, machines", "accelerate launch: processes"},
    "hf": {"Trainer's default callbacks", "steps with the Trainer's loss", "weights equal"},
    "lightning": {"callbacks_factory entry point", "callbacks on the Trainer", "steps with loss"},
    "tensorboard": {"loss read back"},
    "wandb": {"exit record written", "loss read back"},
    "mlflow": {"run", "loss read back"},
    "trackio": {"loss read back"},
    "gpu": {"NVML fields", "NVML switched off", "records"},
    "fp8": {"converted", "loss close to bf16"},
}
"""Comparisons each extra's script must have made (so a script cannot pass by checking nothing)."""


# ---------------------------------------------------------------------------------------------------------------
# Session pieces: uv, the registry, the wheel, the torch layer
# ---------------------------------------------------------------------------------------------------------------
def tail(res: subprocess.CompletedProcess[str]) -> str:
    """The exit status and the ends of a process's output (stderr's last 3000 characters)."""
    return (f"exit {res.returncode}\n--- stdout (end) ---\n{res.stdout[-1500:]}\n"
            f"--- stderr (end) ---\n{res.stderr[-3000:]}")  # fmt: skip


def sh(argv: list[str], *, timeout: float, what: str, **kw: object) -> subprocess.CompletedProcess[str]:
    """Run ``argv``; a failure or a timeout fails the test with the end of its output."""
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload]
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else str(exc.stderr or "")
        pytest.fail(f"{what}: no answer in {timeout:.0f} s\n{err[-3000:]}")
    assert res.returncode == 0, f"{what} failed: {tail(res)}"
    return res


@pytest.fixture(scope="module")
def uv() -> str:
    """The uv of the test environment (the ``test`` extra has it)."""
    try:
        from uv import find_uv_bin

        return str(find_uv_bin())
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        assert found, 'uv is missing: pip install "jupyter-dist[test]"'
        return found


@pytest.fixture(scope="module")
def registry(uv: str) -> None:
    """Skip (fail with JD_REQUIRE_EXTRAS=1) when the package index cannot be reached: asked once, past uv's cache."""
    try:
        res = subprocess.run([uv, "pip", "compile", "--no-cache", "--no-header", "--quiet", "-"], input="pyyaml\n",
                             capture_output=True, text=True, timeout=90)  # fmt: skip
        ok, why = res.returncode == 0, res.stderr.strip()[-500:]
    except subprocess.TimeoutExpired:
        ok, why = False, "no answer in 90 s"
    if not ok:
        msg = f"no package registry reachable (uv pip compile pyyaml: {why})"
        if os.environ.get("JD_REQUIRE_EXTRAS", "") not in ("", "0"):
            pytest.fail(msg + "; JD_REQUIRE_EXTRAS is set")
        pytest.skip(msg)


@pytest.fixture(scope="module")
def wheel(uv: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """jupyter-dist's wheel, built once from a copy of this checkout (sdist, then the wheel from the sdist)."""
    root = tmp_path_factory.mktemp("jd-wheel")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "jupyter_dist", src / "jupyter_dist", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    sh([uv, "build", "--quiet", "--no-build-isolation", "--python", sys.executable, "--out-dir", str(root / "dist"),
        str(src)], timeout=300, what="uv build")  # fmt: skip
    (whl,) = list((root / "dist").glob("jupyter_dist-*.whl"))
    return whl


@dataclass(frozen=True)
class TorchLayer:
    """This environment's torch, laid into fresh venvs without copying or downloading it."""

    version: str
    packages: tuple[Path, ...]
    """torch's top-level folders (torch, functorch, torchgen) in this environment's site-packages."""
    dist_info: Path
    """A copy of torch's .dist-info without RECORD: pip and uv see torch, and refuse to uninstall it."""
    scripts: dict[str, str]
    """torch's console scripts (torchrun: the local launcher looks for it beside the kernel's python)."""

    def lay(self, venv: Path) -> None:
        site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
        assert site.is_dir(), f"no site-packages at {site}"
        shutil.copytree(self.dist_info, site / self.dist_info.name)
        for pkg in self.packages:
            (site / pkg.name).symlink_to(pkg, target_is_directory=True)
        for name, target in self.scripts.items():
            module, func = target.split(":")
            script = venv / "bin" / name
            script.write_text(f"#!{venv / 'bin' / 'python'}\nimport sys\nfrom {module} import {func}\n"
                              f"if __name__ == '__main__':\n    sys.exit({func}())\n")  # fmt: skip
            script.chmod(0o755)


@pytest.fixture(scope="module")
def torch_layer(tmp_path_factory: pytest.TempPathFactory) -> TorchLayer:
    try:
        dist = importlib.metadata.distribution("torch")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("torch is not installed in the test environment (scripts/test.sh installs the CPU build)")
    site = Path(str(dist.locate_file(""))).resolve()
    files = list(dist.files or [])
    tops = sorted({f.parts[0] for f in files if f.parts[0] != ".." and not f.parts[0].endswith(".dist-info")})
    packages = tuple(site / t for t in tops if (site / t).is_dir())
    assert any(p.name == "torch" for p in packages), f"no torch folder in {site}: {tops}"
    (src,) = [site / f.parts[0] for f in files if f.name == "METADATA" and f.parts[0].endswith(".dist-info")]
    dist_info = tmp_path_factory.mktemp("torch-layer") / src.name
    shutil.copytree(src, dist_info, ignore=shutil.ignore_patterns("RECORD", "INSTALLER", "REQUESTED", "direct_url.*"))
    (dist_info / "INSTALLER").write_text("jupyter-dist-tests\n")
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    return TorchLayer(version=dist.version, packages=packages, dist_info=dist_info, scripts=scripts)


def torch_pin() -> str:
    """The torch requirement of constraints-cpu.txt (``torch==2.13.0``)."""
    pins = [ln.strip() for ln in CONSTRAINTS.read_text().splitlines() if re.match(r"\s*torch\s*[=<>~!]", ln)]
    assert len(pins) == 1, f"constraints-cpu.txt should pin torch once: {pins}"
    return pins[0]


# ---------------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------------
def test_every_extra_has_its_integration_check() -> None:
    """A new extra in pyproject.toml needs a script here (and the list here names no extra that is gone)."""
    tomllib = pytest.importorskip("tomllib")
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    assert extras - {"test", "dev", "all"} == set(EXTRAS) == set(CHECKS) == set(REQUIRED)


@pytest.mark.slow
def test_the_wheel_carries_every_file_of_the_package(wheel: Path) -> None:
    """Package data too: the live panels' dashboard.js, py.typed (an editable install hides a missing one)."""
    on_disk = {p.relative_to(REPO).as_posix() for p in (REPO / "jupyter_dist").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}  # fmt: skip
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = {n for n in zf.namelist() if n.startswith("jupyter_dist/")}
    assert on_disk - in_wheel == set(), "files of jupyter_dist/ missing from the wheel (pyproject package-data)"


@dataclass(frozen=True)
class Installed:
    """A venv with torch laid in and ``jupyter-dist[extra]`` installed, and what its installers said."""

    venv: Path
    first: subprocess.CompletedProcess[str]
    """``uv pip install torch==...`` (the README's first step)."""
    second: subprocess.CompletedProcess[str]
    """``uv pip install jupyter-dist[extra]``."""
    listed: dict[str, str]
    """``uv pip list``: name -> version."""
    dry: subprocess.CompletedProcess[str] | None
    """``pip install --dry-run --no-deps torch==...`` (the ``torch`` extra only)."""
    seconds: float


def install_alone(extra: str, uv: str, wheel: Path, torch_layer: TorchLayer, venv: Path) -> Installed:
    """A fresh venv at ``venv``: torch laid in, then torch's pin, then ``jupyter-dist[extra]``, as a user would."""
    t0 = time.monotonic()
    py = venv / "bin" / "python"
    sh([uv, "venv", "--quiet", "--python", sys.executable, str(venv)], timeout=120, what="uv venv")
    torch_layer.lay(venv)
    install = [uv, "pip", "install", "--python", str(py), "--constraints", str(CONSTRAINTS)]
    # the README's order: torch first (the laid CPU build satisfies the pin: only its own dependencies come) ...
    first = sh([*install, torch_pin()], timeout=INSTALL_TIMEOUT, what="uv pip install torch")
    # ... then the extra, resolved alone
    second = sh([*install, f"{wheel}[{extra}]"], timeout=INSTALL_TIMEOUT, what=f"uv pip install jupyter-dist[{extra}]")
    listed = json.loads(sh([uv, "pip", "list", "--python", str(py), "--format", "json"], timeout=60,
                           what="uv pip list").stdout)  # fmt: skip
    sh([uv, "pip", "check", "--python", str(py)], timeout=60, what="uv pip check")
    sh([sys.executable, "-m", "pip", "--python", str(py), "check"], timeout=120, what="pip check")
    dry = None
    if extra == "torch":  # pip, too, takes the laid torch as installed: it would not fetch another build
        dry = sh([sys.executable, "-m", "pip", "--python", str(py), "install", "--dry-run", "--no-deps", torch_pin()],
                 timeout=120, what="pip install --dry-run torch")  # fmt: skip
    return Installed(venv=venv, first=first, second=second, listed={p["name"]: p["version"] for p in listed},
                     dry=dry, seconds=time.monotonic() - t0)  # fmt: skip


@pytest.fixture(scope="module")
def installs(uv: str, registry: None, wheel: Path, torch_layer: TorchLayer,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Installed]]]:  # fmt: skip
    """Every extra's venv, installed by three threads from the first test on, in the tests' order: the installs
    wait on the package index and the disk, so they overlap the integrations (which use the CPU) instead of
    coming one after the other between them. A failed install fails its own test."""
    with ThreadPoolExecutor(max_workers=3, thread_name_prefix="extra-install") as pool:
        futures = {extra: pool.submit(install_alone, extra, uv, wheel, torch_layer,
                                      tmp_path_factory.mktemp(f"extra-{extra}") / "venv")
                   for extra in EXTRAS}  # fmt: skip
        try:
            yield futures
        finally:
            for future in futures.values():
                future.cancel()


@pytest.mark.slow
@pytest.mark.parametrize("extra", EXTRAS)
def test_extra_installed_alone_runs_its_integration(extra: str, installs: dict[str, Future[Installed]],
                                                   torch_layer: TorchLayer, tmp_path: Path) -> None:  # fmt: skip
    """A fresh venv with torch and jupyter-dist[extra] only: it resolves, passes pip check, keeps the CPU torch, and
    the extra's integration does its job with the real library (the pairs its script recorded are equal)."""
    t0 = time.monotonic()
    done = installs[extra].result()  # raises what the install raised (its pytest.fail message)
    venv, work, home = done.venv, tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    py = venv / "bin" / "python"
    first, second, versions = done.first, done.second, done.listed
    swapped = re.findall(rf"^ [-+~] (?:torch|{CUDA_PACKAGES.pattern})==\S+", first.stderr + second.stderr, re.M)
    assert not swapped, f"installing jupyter-dist[{extra}] changed torch: {swapped}\n{second.stderr[-3000:]}"
    assert versions.get("torch") == torch_layer.version, versions
    assert versions.get("jupyter-dist"), versions
    assert not [n for n in versions if CUDA_PACKAGES.fullmatch(n)], f"CUDA packages came: {versions}"
    if extra == "torch":
        assert done.dry is not None
        dry = done.dry
        assert "Requirement already satisfied: torch" in dry.stdout and "Would install" not in dry.stdout, tail(dry)
    t1 = time.monotonic()

    (work / "check.py").write_text(COMMON + CHECKS[extra])
    result_file = work / "result.json"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JD_", "PYTHON", "VIRTUAL_ENV", "WANDB_", "MLFLOW_", "TRACKIO_", "HF_", "CONDA"))}
    env.update(HOME=str(home), PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               PYTHONNOUSERSITE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", JD_EXTRA_RESULT=str(result_file))
    try:
        res = subprocess.run([str(py), str(work / "check.py")], cwd=work, env=env, capture_output=True, text=True,
                             timeout=CHECK_TIMEOUT)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else str(exc.stderr or "")
        pytest.fail(f"jupyter-dist[{extra}]'s integration: no end in {CHECK_TIMEOUT} s\n{err[-3000:]}")
    t2 = time.monotonic()
    print(f"\n[extras alone] {extra}: venv + install {done.seconds:.1f} s (waited {t1 - t0:.1f} s), "
          f"integration {t2 - t1:.1f} s")
    assert res.returncode == 0, f"jupyter-dist[{extra}]'s integration failed: {tail(res)}"
    assert result_file.exists(), f"the {extra} script wrote no result: {tail(res)}"
    result = json.loads(result_file.read_text())
    pairs, facts = result["pairs"], result["facts"]
    wrong = {name: {"expected": e, "got": g} for name, (e, g) in pairs.items() if e != g}
    assert not wrong, f"jupyter-dist[{extra}]: {json.dumps(wrong, indent=1)[-3000:]}"
    missing = REQUIRED[extra] - set(pairs)
    assert not missing, f"the {extra} script skipped checks {sorted(missing)}; it made {sorted(pairs)}"
    # the venv's own packages, and the very torch that was laid in: still the CPU build
    assert Path(facts["jupyter_dist_file"]).is_relative_to(venv.resolve()), facts
    assert facts["torch_version"] == torch_layer.version, facts
    assert any(Path(facts["torch_file"]).is_relative_to(p) for p in torch_layer.packages), facts
    if torch_layer.version.endswith("+cpu"):  # the session's torch is the CPU build (CI): so is the venv's
        assert facts["torch_version"].endswith("+cpu") and facts["torch_cuda"] is None, facts
