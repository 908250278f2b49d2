"""Hyperparameters as data: ``jd.config``, shipped scalars, a Trainer's arguments, Lightning's ``hparams``.

A real 2-process run ships ``lr`` and calls ``jd.config``; the record holds both, MLflow's stored params and
TensorBoard's event files (read back with their own readers) hold them, and the runs table sorts and filters by
them; ``compare``'s legends name what differs. The framework callbacks are driven with real ``TrainingArguments``
and a real ``LightningModule``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from jupyter_dist.launch.record import HparamError, read_hparams, read_record

pytest.importorskip("torch")

CELL = """
import torch
jd.config(batch=BATCH, optimizer="sgd", momentum=torch.tensor(0.5))
for step in range(5):
    jd.log(step, loss=lr * (5 - step))
"""


def test_jd_config_checks_on_every_rank_and_rank_0_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import jupyter_dist.worker as jd

    monkeypatch.setenv("JD_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    assert jd.config(lr=0.1) == {"lr": 0.1} and read_hparams(tmp_path) == {}  # rank 1 writes nothing
    monkeypatch.setenv("RANK", "0")
    assert jd.config(lr=0.1, opt="adamw") == {"lr": 0.1, "opt": "adamw"}
    assert jd.config(lr=0.2, warm=True) == {"lr": 0.2, "opt": "adamw", "warm": True}  # later calls merge
    assert json.loads((tmp_path / "hparams.json").read_text()) == {"lr": 0.2, "opt": "adamw", "warm": True}
    with pytest.raises(HparamError, match=r"^jd.config: layers must be a number, bool or string, got dict$"):
        jd.config(layers={"a": 1})
    assert read_hparams(tmp_path)["lr"] == 0.2  # a refused call changes nothing


@pytest.mark.slow
def test_a_real_run_records_shipped_and_configured_hparams_and_every_sink_gets_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2

    from jupyter_dist.launch.runs import runs
    from jupyter_dist.launch.session import start_run
    from jupyter_dist.ui.compare import compare

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "jd-hparams")
    root = tmp_path / "runs"
    made = []
    for lr, batch in ((0.25, 8), (0.5, 16)):
        run = start_run(CELL.replace("BATCH", str(batch)), nproc=2, runs_dir=root, name=f"lr{lr}",
                        ship={"lr": lr, "big": list(range(3))}, log_to="mlflow,tensorboard")  # fmt: skip
        assert run.wait(180) == "succeeded", run.summary() + run.logs(0)
        assert run.sinks.wait(60)
        made.append((run, lr, batch))
    for run, lr, batch in made:
        want = {"lr": lr, "batch": batch, "optimizer": "sgd", "momentum": 0.5}
        assert run.hparams == want  # "big" was shipped but is no scalar
        assert read_record(run.dir).hparams == want == json.loads((run.dir / "run.json").read_text())["hparams"]
        losses = run.metrics().query("rank == 0")["loss"].tolist()
        assert losses == pytest.approx([lr * (5 - s) for s in range(5)])  # the shipped lr is the one the cell used
        # MLflow: the stored params, read back with its client
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name("jd-hparams")
        (found,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`jupyter_dist.run_dir` = '{run.dir}'")
        params = found.data.params
        assert {k: params[k] for k in want} == {k: str(v) for k, v in want.items()}
        assert params["strategy"] == "ddp" and params["world_size"] == "2"
        # TensorBoard: the HParams plugin's session start, read back from the event files
        starts = []
        for path in sorted((run.dir / "tensorboard").glob("events.out.tfevents.*")):
            for event in EventFileLoader(str(path)).Load():
                for value in event.summary.value:
                    if value.tag == "_hparams_/session_start_info":
                        data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
                        starts.append(data.session_start_info.hparams)
        assert starts, "no HParams session in the event files"
        got = starts[-1]
        assert got["lr"].number_value == pytest.approx(lr) and got["batch"].number_value == batch
        assert got["optimizer"].string_value == "sgd" and got["momentum"].number_value == pytest.approx(0.5)
    # the runs table: a column per hyperparameter, sortable and filterable
    table = runs(root)
    assert table.hparam_names == ("batch", "lr", "momentum", "optimizer")
    assert [r.hparams["lr"] for r in table.sort("-lr")] == [0.5, 0.25]
    assert [r.hparams["batch"] for r in table.sort("hp.batch")] == [8, 16]
    assert [r.name for r in table.filter(lr=0.25)] == [made[0][0].name]
    assert len(table.filter(text="optimizer=sgd")) == 2
    assert table.hparam_columns()[:2] == ("batch", "lr")  # those that differ first
    head = table.text().splitlines()[0]
    assert "batch" in head and "lr" in head and "0.25" in table.text() and "0.5" in table.html()
    assert table.records()[0]["lr"] in (0.25, 0.5)
    with pytest.raises(Exception, match="cannot sort by 'speed'.*hyperparameters: batch, lr, momentum, optimizer"):
        table.sort("speed")
    # compare's legends: what differs between the runs
    cmp = compare(*[r for r, _, _ in made])
    assert cmp.labels == [f"{r.name} (ddp) batch={b}, lr={lr:.4g}" for r, lr, b in made]


def test_training_arguments_become_hparams(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from jupyter_dist.integrations.hf import JupyterDistCallback, training_hparams

    args = TrainingArguments(output_dir=str(tmp_path / "out"), learning_rate=3e-4, per_device_train_batch_size=4,
                             max_steps=7, hub_token="secret-token", report_to=[])  # fmt: skip
    hp = training_hparams(args)
    assert hp["learning_rate"] == 3e-4 and hp["per_device_train_batch_size"] == 4 and hp["max_steps"] == 7
    assert not any("token" in k or k.startswith("hub_") for k in hp) and "report_to" not in hp
    assert "secret-token" not in json.dumps(hp)
    monkeypatch.setenv("JD_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    JupyterDistCallback._configured = None
    JupyterDistCallback().on_train_begin(args, None, None)
    saved = read_hparams(tmp_path)
    assert saved["learning_rate"] == 3e-4 and saved == hp


def test_lightning_hparams_become_hparams(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lightning")
    import lightning as L

    from jupyter_dist.integrations.lightning import JupyterDistCallback, module_hparams

    class Module(L.LightningModule):
        def __init__(self, lr: float, hidden: int, opt: dict[str, Any], layers: list[int]) -> None:
            super().__init__()
            self.save_hyperparameters()

    class Data(L.LightningDataModule):
        def __init__(self, batch_size: int) -> None:
            super().__init__()
            self.save_hyperparameters()

    module = Module(lr=0.01, hidden=64, opt={"name": "adam", "beta": 0.9}, layers=[1, 2])
    assert module_hparams(module, Data(batch_size=32)) == {"lr": 0.01, "hidden": 64, "opt.name": "adam",
                                                           "opt.beta": 0.9, "batch_size": 32}  # fmt: skip

    class Trainer:
        datamodule = Data(batch_size=32)

    monkeypatch.setenv("JD_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    JupyterDistCallback().on_train_start(Trainer(), module)
    assert read_hparams(tmp_path) == {"lr": 0.01, "hidden": 64, "opt.name": "adam", "opt.beta": 0.9,
                                      "batch_size": 32}  # fmt: skip
