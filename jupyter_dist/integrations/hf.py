"""``JupyterDistCallback``: a Hugging Face ``transformers.TrainerCallback`` streaming the Trainer's logs to ``jd.log``.

Under ``%%dist_train`` it is attached to every ``Trainer`` by itself (:func:`jupyter_dist.integrations.autoattach`);
elsewhere add one line::

    from jupyter_dist.integrations.hf import JupyterDistCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[JupyterDistCallback()])

Every optimizer step (``on_step_end``) logs ``samples`` (per-device batch x gradient accumulation, so the records
carry ``samples_per_s`` and the measured ``step_time``) on every rank; every Trainer log (``on_log``: ``loss``,
``learning_rate``, ``grad_norm``, ``epoch``, ``eval_*`` metrics, the final ``train_*`` summary) goes to ``jd.log``
at ``state.global_step`` with its numeric values (``total_flos`` left out). With ``include_num_input_tokens_seen``
the tokens since the previous log are logged as ``tokens`` (so ``tokens_per_s`` appears too). When training
begins (``on_train_begin``) the ``TrainingArguments``' scalar fields become the run's hyperparameters
(:func:`training_hparams` through ``jd.config``: ``learning_rate``, ``per_device_train_batch_size``, ...).
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

from ..errors import MissingDependencyError

try:
    from transformers.trainer_callback import TrainerCallback
except ImportError as _exc:  # pragma: no cover - exercised by the install-hint test in a clean interpreter
    raise MissingDependencyError(
        f'jupyter_dist.integrations.hf needs transformers ({_exc}): pip install "jupyter-dist[hf]"'
    ) from None

__all__ = ["JupyterDistCallback", "install", "metrics_from_logs", "training_hparams"]

SKIPPED = frozenset({"total_flos", "step"})
"""Trainer log keys not forwarded: ``total_flos`` (a count, not a curve) and ``step`` (the record's own field)."""

_RESERVED = frozenset({"v", "kind", "rank", "seq", "t", "n", "nonfinite"})


def metrics_from_logs(logs: dict[str, Any]) -> dict[str, float]:
    """The numeric values of one Trainer ``logs`` dict, as ``jd.log`` takes them (reserved names get ``hf_``)."""
    out: dict[str, float] = {}
    for key, value in logs.items():
        if key in SKIPPED or isinstance(value, bool):
            continue
        if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
            value = value.item()
        if isinstance(value, (int, float)):
            out[f"hf_{key}" if key in _RESERVED else key] = float(value)
    return out


def training_hparams(args: Any) -> dict[str, Any]:
    """A ``TrainingArguments``' scalar fields (``learning_rate``, ``per_device_train_batch_size``, ...).

    As ``jd.config`` takes them: ``None``, lists, the hub's settings and tokens left out.
    """
    from ..launch.record import scalar_items

    values = args.to_dict() if hasattr(args, "to_dict") else dict(vars(args))
    return scalar_items({k: v for k, v in values.items() if not k.startswith(("hub_", "push_to_hub"))}, depth=0)


class JupyterDistCallback(TrainerCallback):  # type: ignore[misc]
    """Streams a ``transformers.Trainer``'s logs into ``jd.log`` on every rank (see the module docstring).

    Parameters
    ----------
    every_step
        Also log ``samples`` at every optimizer step (default True), so step time, throughput and the hang
        check follow each step and not only every ``logging_steps``.
    """

    _logged: tuple[int, int] | None = None  # (id(logs), step) of the last on_log handled by any instance
    _stepped: tuple[int, int] | None = None  # (id(state), step) of the last on_step_end handled by any instance
    _configured: int | None = None  # id(args) of the last on_train_begin handled by any instance

    def __init__(self, *, every_step: bool = True) -> None:
        self.every_step = every_step
        self._tokens_seen: float | None = None

    @staticmethod
    def _jd() -> Any:
        import jupyter_dist.worker as jd

        return jd

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """The Trainer's arguments become the run's hyperparameters (``jd.config``; rank 0 records them)."""
        if JupyterDistCallback._configured != id(args):  # a second instance on one Trainer: once
            JupyterDistCallback._configured = id(args)
            self._jd().config(**training_hparams(args))
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """One optimizer step: ``samples`` processed by this rank since the previous step."""
        key = (id(state), int(state.global_step))
        if self.every_step and JupyterDistCallback._stepped != key:  # a second instance on one Trainer: once
            JupyterDistCallback._stepped = key
            samples = int(args.per_device_train_batch_size) * max(1, int(args.gradient_accumulation_steps))
            self._jd().log(int(state.global_step), samples=samples)
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        """A Trainer log (train loss, learning rate, eval metrics, summary): its numbers go to ``jd.log``."""
        if not logs:
            return control
        key = (id(logs), int(state.global_step))
        if JupyterDistCallback._logged == key:  # the same logs dict reached a second instance: already logged
            return control
        JupyterDistCallback._logged = key
        metrics = metrics_from_logs(logs)
        seen = logs.get("num_input_tokens_seen")
        if isinstance(seen, (int, float)) and not isinstance(seen, bool):
            if self._tokens_seen is not None and seen >= self._tokens_seen:
                metrics["tokens"] = float(seen) - self._tokens_seen
            self._tokens_seen = float(seen)
        metrics = {k: v for k, v in metrics.items() if not math.isnan(v) or k == "loss"}
        if metrics:
            self._jd().log(int(state.global_step), **metrics)
        return control


def install(module: ModuleType) -> None:
    """Add the callback to ``transformers.trainer.DEFAULT_CALLBACKS`` (every Trainer built afterwards gets one)."""
    defaults = getattr(module, "DEFAULT_CALLBACKS", None)
    if isinstance(defaults, list) and JupyterDistCallback not in defaults:
        defaults.append(JupyterDistCallback)


def _install_late() -> None:
    from . import install_late

    install_late(__name__)


_install_late()
