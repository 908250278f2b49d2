"""``JupyterDistCallback``: a Lightning ``Callback`` that streams the Trainer's metrics to ``jd.log``.

Under ``%%dist_train`` it is attached to every ``lightning.pytorch.Trainer`` by itself
(:func:`jupyter_dist.integrations.autoattach`; the package also registers :func:`callbacks_factory` under Lightning's
``lightning.pytorch.callbacks_factory`` entry points, which does the same in a launched worker once jupyter-dist is
installed); elsewhere add one line::

    from jupyter_dist.integrations.lightning import JupyterDistCallback
    trainer = L.Trainer(..., callbacks=[JupyterDistCallback()])

After every training batch it logs, at ``trainer.global_step``: ``loss`` (from what ``training_step`` returned),
``lr`` (the first optimizer's first param group), ``samples`` (the batch's first dimension, so the records carry
``samples_per_s`` and ``step_time``) and every scalar in ``trainer.callback_metrics`` that ``self.log`` wrote during
training; after validation (not the sanity check) the scalars validation added (``val_loss``, ...). When training
starts (``on_train_start``) the module's and datamodule's ``hparams`` (what ``save_hyperparameters()`` stored)
become the run's hyperparameters (:func:`module_hparams` through ``jd.config``). The unified
``lightning`` package is supported (``import lightning as L``); the standalone ``pytorch_lightning`` package is not.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..errors import MissingDependencyError

try:
    from lightning.pytorch.callbacks import Callback
except ImportError as _exc:  # pragma: no cover - exercised by the install-hint test in a clean interpreter
    raise MissingDependencyError(
        f'jupyter_dist.integrations.lightning needs Lightning ({_exc}): pip install "jupyter-dist[lightning]"'
    ) from None

__all__ = ["JupyterDistCallback", "callbacks_factory", "install", "module_hparams", "scalar_metrics"]

_RESERVED = frozenset({"v", "kind", "rank", "seq", "t", "n", "nonfinite", "step"})


def scalar_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The one-element tensors and numbers of a Lightning metrics dict as floats (reserved names get ``pl_``)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if hasattr(value, "numel"):
            if value.numel() != 1:
                continue
            value = value.detach().float().item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"pl_{key}" if key in _RESERVED else str(key)] = float(value)
    return out


def module_hparams(module: Any, datamodule: Any = None) -> dict[str, Any]:
    """What ``save_hyperparameters()`` stored on the module and the datamodule, as ``jd.config`` takes it.

    Numbers, bools and one-line strings; a nested mapping one level deep as ``outer.inner``; the rest left out.
    """
    from ..launch.record import scalar_items

    out: dict[str, Any] = {}
    for owner in (datamodule, module):  # the module's win on a shared name
        hp = getattr(owner, "hparams", None) if owner is not None else None
        if hp is not None and hasattr(hp, "items"):
            out.update(scalar_items(dict(hp.items())))
    return out


def _batch_size(batch: Any) -> int | None:
    if hasattr(batch, "shape") and len(batch.shape) > 0:
        return int(batch.shape[0])
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_size(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_size(next(iter(batch.values())))
    return None


class JupyterDistCallback(Callback):  # type: ignore[misc]
    """Streams a Lightning Trainer's metrics into ``jd.log`` on every rank (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.active = True
        """False when another instance on the same Trainer logs (attached automatically and by hand)."""
        self._train_keys: set[str] = set()
        self._val_keys: set[str] = set()

    @staticmethod
    def _jd() -> Any:
        import jupyter_dist.worker as jd

        return jd

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Only the first instance on a Trainer logs."""
        first = next((c for c in trainer.callbacks if isinstance(c, JupyterDistCallback)), self)
        self.active = first is self

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """The module's (and the datamodule's) ``hparams`` become the run's hyperparameters (``jd.config``)."""
        if self.active:
            self._jd().config(**module_hparams(pl_module, getattr(trainer, "datamodule", None)))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Loss, learning rate, samples and the training metrics of this step."""
        if not self.active:
            return
        metrics: dict[str, Any] = {}
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if hasattr(loss, "numel") and loss.numel() == 1:
            metrics["loss"] = loss.detach()  # summed on its device; read once per record (no sync per step)
        optimizers = getattr(trainer, "optimizers", None) or []
        if optimizers and optimizers[0].param_groups:
            metrics["lr"] = float(optimizers[0].param_groups[0]["lr"])
        size = _batch_size(batch)
        if size is not None:
            metrics["samples"] = size
        # callback_metrics keeps validation's last values too: they are not this step's
        logged = {k: v for k, v in scalar_metrics(dict(trainer.callback_metrics)).items() if k not in self._val_keys}
        self._train_keys.update(logged)
        for key, value in logged.items():
            metrics.setdefault(key, value)
        self._jd().log(int(trainer.global_step), **metrics)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        """The scalars validation added (``val_loss``, accuracy, ...), at the current step."""
        if not self.active or getattr(trainer, "sanity_checking", False):
            return
        metrics = {k: v for k, v in scalar_metrics(dict(trainer.callback_metrics)).items()
                   if k not in self._train_keys}  # fmt: skip
        self._val_keys.update(metrics)
        if metrics:
            self._jd().log(int(trainer.global_step), **metrics)


def callbacks_factory() -> list[Any]:
    """Lightning's ``callbacks_factory`` entry point: the callback in a launched worker, else nothing."""
    from . import auto_enabled

    return [JupyterDistCallback()] if auto_enabled() else []


def install(module: ModuleType) -> None:
    """Wrap the callback connector's external-callbacks loader so every Trainer gets one instance."""
    load = getattr(module, "_load_external_callbacks", None)
    if load is None or getattr(load, "_jupyter_dist", False):
        return

    def load_with_jupyter_dist(group: str) -> list[Any]:
        callbacks = list(load(group))
        if group.endswith("callbacks_factory") and not any(isinstance(c, JupyterDistCallback) for c in callbacks):
            callbacks.append(JupyterDistCallback())
        return callbacks

    load_with_jupyter_dist._jupyter_dist = True  # type: ignore[attr-defined]
    module._load_external_callbacks = load_with_jupyter_dist  # type: ignore[attr-defined]


def _install_late() -> None:
    from . import install_late

    install_late(__name__)


_install_late()
