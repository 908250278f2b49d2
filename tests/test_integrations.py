"""Framework callbacks (HF ``Trainer``, Lightning) -> ``jd.log``, attached by ``%%dist_train`` itself, and ``--log-to``.

Real components throughout: a Hugging Face ``Trainer`` on a 2-layer Llama built from a config (random tokens) and a
Lightning ``Trainer`` with its DDP strategy, both on 2 torchrun CPU processes under ``%%dist_train`` in a real IPython
shell; their records go through the dashboard's own model, and the TensorBoard sink is read back with TensorBoard's
reader. The single-process checks run the worker prelude in a fresh interpreter (the hooks patch global state of
transformers / Lightning, which must not leak into this test process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import descendants_gone
from IPython.core.error import UsageError

from jupyter_dist.integrations import auto_enabled
from jupyter_dist.launch.prepare import PRELUDE
from jupyter_dist.telemetry.reader import read_run_records
from jupyter_dist.ui.panels import DashboardModel

REPO = Path(__file__).resolve().parents[1]

HF_CELL = """\
import os
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, max_position_embeddings=64)
model = LlamaForCausalLM(cfg)
g = torch.Generator().manual_seed(1)
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (64, 16), generator=g)]
args = TrainingArguments(output_dir=os.path.join(os.environ.get("JD_RUN_DIR", "."), "hf_out"), max_steps=STEPS,
                         per_device_train_batch_size=4, logging_steps=2, eval_strategy="steps", eval_steps=4,
                         save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, learning_rate=1e-3)
trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:8], CALLBACKS)
trainer.train()
"""

LIGHTNING_CELL = """\
import os
import torch
import lightning as L
from torch.utils.data import DataLoader, TensorDataset


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_mse", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
X = torch.randn(128, 8, generator=g)
ds = TensorDataset(X, X.sum(1, keepdim=True))
trainer = L.Trainer(accelerator="cpu", devices=DEVICES, strategy=STRATEGY, max_epochs=2, limit_val_batches=2,
                    log_every_n_steps=1, enable_progress_bar=False, enable_checkpointing=False, logger=False,
                    enable_model_summary=False, default_root_dir=os.environ.get("JD_RUN_DIR", "."), CALLBACKS)
trainer.fit(Net(), DataLoader(ds, batch_size=16), DataLoader(ds, batch_size=16))
"""


def hf_cell(steps: int = 8, callbacks: str = "") -> str:
    return HF_CELL.replace("STEPS", str(steps)).replace(", CALLBACKS", callbacks)


def lightning_cell(devices: int = 2, strategy: str = '"ddp"', callbacks: str = "") -> str:
    return (LIGHTNING_CELL.replace("DEVICES", str(devices)).replace("STRATEGY", strategy)
            .replace(", CALLBACKS", callbacks))  # fmt: skip


def run_prelude_script(code: str, run_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` after the ``%%dist_train`` prelude, in a fresh interpreter that looks like one launched rank."""
    (run_dir / "telemetry").mkdir(parents=True, exist_ok=True)
    script = run_dir / "script.py"
    script.write_text(PRELUDE + code)
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "JD_RUN_DIR": str(run_dir), "JD_TELEMETRY_INTERVAL_S": "0",
                "JD_HEARTBEAT_S": "0", **env}  # fmt: skip
    full_env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=full_env, cwd=run_dir,
                          timeout=300)  # fmt: skip


def step_calls(run_dir: Path, rank: int = 0) -> list[dict[str, Any]]:
    return [r for r in read_run_records(run_dir / "telemetry").of_kind("step") if r["rank"] == rank]


# ---------------------------------------------------------------------------------------------- units
def test_hf_log_keys_become_jd_metrics() -> None:
    pytest.importorskip("transformers")
    from jupyter_dist.integrations.hf import metrics_from_logs

    logs = {"loss": 2.5, "learning_rate": 1e-3, "epoch": 0.5, "total_flos": 1e12, "n": 3, "note": "x", "ok": True}
    assert metrics_from_logs(logs) == {"loss": 2.5, "learning_rate": 1e-3, "epoch": 0.5, "hf_n": 3.0}


def test_lightning_metrics_keep_scalars_only() -> None:
    pytest.importorskip("lightning")
    import torch

    from jupyter_dist.integrations.lightning import scalar_metrics

    got = scalar_metrics({"val_loss": torch.tensor(0.25), "vec": torch.ones(3), "step": 4, "lr": 0.1})
    assert got == {"val_loss": 0.25, "pl_step": 4.0, "lr": 0.1}


def test_callbacks_attach_only_in_a_launched_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JD_RUN_DIR", raising=False)
    assert not auto_enabled()  # a notebook kernel: nothing is hooked
    monkeypatch.setenv("JD_RUN_DIR", "/tmp/some-run")
    assert auto_enabled()
    monkeypatch.setenv("JD_AUTO_CALLBACKS", "0")
    assert not auto_enabled()


def test_the_prelude_stays_three_lines() -> None:
    assert PRELUDE.count("\n") == 3 and "autoattach()" in PRELUDE  # hang / early-exit reports count script lines


BLOCK = """\
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "{mod}" or name.startswith("{mod}."):
            raise ImportError(f"No module named {{name!r}}")
sys.meta_path.insert(0, Block())
from jupyter_dist.errors import MissingDependencyError
try:
    import jupyter_dist.integrations.{sub}
except MissingDependencyError as exc:
    print("HINT", exc)
"""


@pytest.mark.parametrize(("sub", "mod", "extra"),
                         [("hf", "transformers", "hf"), ("lightning", "lightning", "lightning")])  # fmt: skip
def test_a_missing_framework_gives_the_install_hint(sub: str, mod: str, extra: str) -> None:
    out = subprocess.run([sys.executable, "-c", BLOCK.format(sub=sub, mod=mod)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)  # fmt: skip
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("HINT")]
    assert f'pip install "jupyter-dist[{extra}]"' in line, out.stderr


@pytest.mark.slow
def test_hf_trainer_gets_the_callback_once_even_when_added_by_hand(tmp_path: Path) -> None:
    """Prelude + an unmodified Trainer (plus a hand-added callback): one jd.log per step, its logs in the records."""
    pytest.importorskip("transformers")
    cell = hf_cell(6, ", callbacks=[JupyterDistCallback()]")
    cell = "from jupyter_dist.integrations.hf import JupyterDistCallback\n" + cell
    cell += textwrap.dedent("""
        import transformers.trainer as t
        print("DEFAULTS", [c.__name__ for c in t.DEFAULT_CALLBACKS])
        print("ATTACHED", sum(isinstance(c, JupyterDistCallback) for c in trainer.callback_handler.callbacks))
    """)
    out = run_prelude_script(cell, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DEFAULTS ['DefaultFlowCallback', 'JupyterDistCallback']" in out.stdout
    assert "ATTACHED 2" in out.stdout  # the automatic one and the hand-added one ...
    recs = step_calls(tmp_path)
    per_step = [r for r in recs if "samples" in r]
    assert [r["step"] for r in per_step] == list(range(1, 7))  # ... log once
    assert all(r["samples"] == 4.0 for r in per_step)
    losses = [r for r in recs if "loss" in r]
    assert [r["step"] for r in losses] == [2, 4, 6] and all(0 < r["loss"] < 10 for r in losses)
    assert [r["step"] for r in recs if "eval_loss" in r] == [4, 6]  # eval_steps=4, and at the last step
    (summary,) = [r for r in recs if "train_loss" in r]
    assert summary["step"] == 6 and summary["train_runtime"] > 0


@pytest.mark.slow
def test_hf_autoattach_can_be_turned_off(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = run_prelude_script("import transformers.trainer as t\nprint('DEFAULTS', len(t.DEFAULT_CALLBACKS))\n",
                             tmp_path, JD_AUTO_CALLBACKS="0")  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "DEFAULTS 1" in out.stdout


@pytest.mark.slow
def test_lightning_trainer_gets_the_callback_once_even_when_added_by_hand(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    cell = "from jupyter_dist.integrations.lightning import JupyterDistCallback\n"
    cell += lightning_cell(1, '"auto"', ", callbacks=[JupyterDistCallback()]")
    cell += 'print("ACTIVE", [c.active for c in trainer.callbacks if isinstance(c, JupyterDistCallback)])\n'
    out = run_prelude_script(cell, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ACTIVE [True, False]" in out.stdout  # hand-added first; the automatic one stands down
    recs = step_calls(tmp_path)
    train = [r for r in recs if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 17))  # 8 batches x 2 epochs, one call each
    assert all(r["samples"] == 16.0 and r["lr"] == pytest.approx(0.05) and "train_mse" in r for r in train)
    val = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in val] == [8, 16] and all("loss" not in r for r in val)


# ---------------------------------------------------------------------------------------------- magics
def test_log_to_errors_are_one_line_before_anything_runs(ip: Any, runs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError, match=r"^--log-to: unknown sink 'tensorbored'; valid: tensorboard, wandb, mlflow"):
        ip.run_cell_magic("dist_train", "--nproc 2 --log-to tensorbored", "pass")
    monkeypatch.delenv("JD_TEST_TOKEN", raising=False)
    with pytest.raises(UsageError, match=r"^--secret JD_TEST_TOKEN: not set in the kernel's environment"):
        ip.run_cell_magic("dist_train", "--nproc 2 --log-to tensorboard --secret JD_TEST_TOKEN", "pass")
    with pytest.raises(UsageError, match="--secret need --backend slurm or skypilot"):
        ip.run_cell_magic("dist_train", "--nproc 2 --secret JD_TEST_TOKEN", "pass")  # no sink reads it: refused
    assert list(runs.iterdir()) == []  # nothing was written or started


def test_log_to_dry_run_says_where_metrics_go(ip: Any, runs: Path) -> None:
    dry = ip.run_cell_magic("dist_train", "--nproc 2 --log-to tensorboard,trackio --dry-run", "pass")
    assert "# metrics forwarded from this kernel to: tensorboard, trackio" in dry.to_text()


# ---------------------------------------------------------------------------------------------- real runs
def loss_panel(run: Any) -> dict[str, Any]:
    model = DashboardModel(2)
    model.ingest(run.records())
    figs = {f["id"]: f for f in model.figures()}
    return {t["name"]: t for t in figs["loss"]["traces"]}


@pytest.mark.slow
def test_hf_trainer_on_two_processes_under_dist_train_fills_the_panels_tensorboard_and_mlflow(
    ip: Any, runs: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The default telemetry interval (calls batched, never averaged): a Trainer that logs its loss 8 times shows
    those 8 values in run.metrics(), the loss panel, TensorBoard and MLflow, and the runs table's last loss is the
    Trainer's last logged loss (the issue this replaces found 1 averaged point and a last loss 17 % off)."""
    pytest.importorskip("transformers")
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from jupyter_dist.launch.runs import runs as run_table

    monkeypatch.setenv("JD_TEST_SINK_SECRET", "hunter2-d4e1c0")
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "jd-hf-lossless")
    line = "--nproc 2 --name hf_run --log-to tensorboard,mlflow --secret JD_TEST_SINK_SECRET --timeout 400"
    run = ip.run_cell_magic("dist_train", line, hf_cell(16))
    run.wait(420)
    assert run.status == "succeeded", run.summary()
    assert descendants_gone(run)
    for rank in (0, 1):
        recs = step_calls(run.dir, rank)
        assert [r["step"] for r in recs if "loss" in r] == list(range(2, 17, 2)), f"rank {rank}: {recs}"
        assert [r["step"] for r in recs if "eval_loss" in r] == [4, 8, 12, 16]
        assert any(r.get("samples_per_s", 0) > 0 for r in recs) and any("learning_rate" in r for r in recs)
    rank0 = [r for r in step_calls(run.dir, 0) if "loss" in r]
    losses = [r["loss"] for r in rank0]
    assert len(set(losses)) > 1  # the values differ: a mean would show
    frame = run.metrics()
    assert set(frame["rank"]) == {0, 1} and frame["loss"].notna().sum() == 16
    assert frame[frame["rank"] == 0]["loss"].dropna().tolist() == losses
    panel = loss_panel(run)
    assert {"rank 0", "rank 1"} <= set(panel)
    assert panel["rank 0"]["x"] == list(range(2, 17, 2)) and panel["rank 0"]["y"] == pytest.approx(losses)
    assert run.sinks.wait(60) and run.sinks.errors == {}
    acc = EventAccumulator(str(run.dir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == list(range(2, 17, 2))
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx(losses, rel=1e-6)  # TensorBoard keeps float32
    client = MlflowClient(tracking_uri=uri)
    (mrun,) = client.search_runs([client.get_experiment_by_name("jd-hf-lossless").experiment_id])
    history = sorted(client.get_metric_history(mrun.info.run_id, "loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == list(zip(range(2, 17, 2), losses, strict=True))
    rank1_last = [r for r in step_calls(run.dir, 1) if "loss" in r][-1]["loss"]
    row = run_table(runs)[0]
    assert row.last_loss == (losses[-1] + rank1_last) / 2 and losses[-1] == pytest.approx(rank1_last)
    meta = json.loads((run.dir / "run.json").read_text())
    assert meta["log_to"] == ["tensorboard", "mlflow"] and meta["sink_secrets"] == ["JD_TEST_SINK_SECRET"]
    written = [p for p in run.dir.rglob("*") if p.is_file() and b"hunter2-d4e1c0" in p.read_bytes()]
    assert written == []  # the secret's value is in no file of the run
    assert "metrics -> tensorboard" in run.summary()


@pytest.mark.slow
def test_unmodified_hf_trainer_script_under_dist_train_script_fills_the_panels(
    ip: Any, runs: Path, tmp_path: Path
) -> None:
    """``%dist_train --script train.py`` (the line magic) on 2 CPU processes: the script is an unmodified HF
    ``Trainer`` (no jupyter-dist in it); the job's ``script.py`` arms the callbacks as a cell's prelude does, so its
    loss reaches the run's records, metrics and loss panel."""
    pytest.importorskip("transformers")
    script = tmp_path / "proj" / "train_hf.py"
    script.parent.mkdir()
    script.write_text(hf_cell(6))
    assert "jupyter_dist" not in script.read_text() and " jd." not in script.read_text()
    run = ip.run_line_magic("dist_train", f"--nproc 2 --name hf_script --telemetry-interval 0 --timeout 400 "
                                          f"--script {script}")  # fmt: skip
    assert ip.user_ns["hf_script"] is run
    run.wait(420)
    assert run.status == "succeeded", run.summary() + run.logs(0, tail=40)
    for rank in (0, 1):
        recs = step_calls(run.dir, rank)
        assert [r["step"] for r in recs if "loss" in r] == [2, 4, 6], f"rank {rank}: {recs}"
        assert [r["step"] for r in recs if "eval_loss" in r] == [4, 6]  # every 4 steps and at the end
    frame = run.metrics()
    assert set(frame["rank"]) == {0, 1} and frame["loss"].notna().sum() == 6
    rank0 = [r for r in step_calls(run.dir, 0) if "loss" in r]
    panel = loss_panel(run)
    assert panel["rank 0"]["x"] == [2, 4, 6] and panel["rank 0"]["y"] == pytest.approx([r["loss"] for r in rank0])
    assert "autoattach()" in (run.dir / "script.py").read_text()
    assert descendants_gone(run)


@pytest.mark.slow
def test_lightning_ddp_on_two_processes_under_dist_train_fills_the_panels(ip: Any, runs: Path) -> None:
    pytest.importorskip("lightning")
    line = "--nproc 2 --name pl_run --telemetry-interval 0 --timeout 400"
    run = ip.run_cell_magic("dist_train", line, lightning_cell(2, '"ddp"'))
    run.wait(420)
    assert run.status == "succeeded", run.summary() + run.logs(0, tail=40)
    assert descendants_gone(run)
    for rank in (0, 1):
        recs = step_calls(run.dir, rank)
        train = [r for r in recs if "loss" in r]
        assert [r["step"] for r in train] == list(range(1, 9)), f"rank {rank}: {recs}"  # 64 rows per rank / 16
        assert [r["step"] for r in recs if "val_loss" in r] == [4, 8]
        assert any(r.get("samples_per_s", 0) > 0 for r in recs)
    v0 = [r["val_loss"] for r in step_calls(run.dir, 0) if "val_loss" in r]
    v1 = [r["val_loss"] for r in step_calls(run.dir, 1) if "val_loss" in r]
    assert v0 == pytest.approx(v1)  # sync_dist: the validation loss is reduced over both ranks
    panel = loss_panel(run)
    assert len(panel["rank 0"]["x"]) == 8 and len(panel["rank 1"]["x"]) == 8
