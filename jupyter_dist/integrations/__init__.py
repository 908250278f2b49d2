"""Callbacks that stream a training framework's logs into ``jd.log``: Hugging Face ``Trainer`` and Lightning.

* :mod:`jupyter_dist.integrations.hf` -- ``JupyterDistCallback``, a ``transformers.TrainerCallback``;
* :mod:`jupyter_dist.integrations.lightning` -- ``JupyterDistCallback``, a Lightning ``Callback``.

With them an unmodified ``Trainer`` script under ``%%dist_train`` writes ``step`` records (loss, learning rate,
throughput, eval metrics), so the live panels, the health checks and the diagnosis work as for a ``jd.log`` loop.

Under ``%%dist_train`` they attach themselves: the cell's prelude calls :func:`autoattach`, which waits (a post-import
hook, nothing imported now) until the script imports ``transformers.trainer`` or Lightning's trainer and then adds
the callback to every ``Trainer`` the script builds -- ``transformers.trainer.DEFAULT_CALLBACKS`` for Hugging Face,
the external-callbacks step of Lightning's callback connector (the one its ``lightning.pytorch.callbacks_factory``
entry points use). ``JD_AUTO_CALLBACKS=0`` (``%%dist_train --env JD_AUTO_CALLBACKS=0``) turns that off; elsewhere
add the one line ``callbacks=[JupyterDistCallback()]``. Adding it yourself as well is harmless: one instance logs.

Importing this package is cheap (stdlib only); importing a submodule without its framework raises
:class:`~jupyter_dist.errors.MissingDependencyError` with the install hint.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["autoattach", "auto_enabled", "armed", "install_late", "WATCHED"]

WATCHED: dict[str, str] = {
    "transformers.trainer": "jupyter_dist.integrations.hf",
    "lightning.pytorch.trainer.connectors.callback_connector": "jupyter_dist.integrations.lightning",
}
"""Module that, once imported, gets the callback -> the integration module whose ``install(module)`` adds it."""

_lock = threading.Lock()
_finder: _PostImportFinder | None = None


def auto_enabled() -> bool:
    """Whether the callbacks attach themselves: in a launched worker (``JD_RUN_DIR``) unless ``JD_AUTO_CALLBACKS=0``."""
    return bool(os.environ.get("JD_RUN_DIR")) and os.environ.get("JD_AUTO_CALLBACKS", "1").strip() not in ("0", "")


def armed() -> bool:
    """Whether :func:`autoattach` installed its hook in this process."""
    return _finder is not None


def _install(target: str, module: ModuleType) -> None:
    integration = importlib.import_module(WATCHED[target])
    install = getattr(integration, "install", None)
    if install is not None:  # else the integration is being imported right now and installs itself at its end
        install(module)


def install_late(integration: str) -> None:
    """Called at the end of an integration module: patch the watched modules it missed while it was being imported."""
    if not armed():
        return
    for name, owner in WATCHED.items():
        if owner == integration and name in sys.modules:
            _install(name, sys.modules[name])


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then the integration's ``install`` on the fresh module."""

    def __init__(self, loader: Any, after: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._after = after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._after(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... of the real loader
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched name it asks the finders after it and wraps the loader they return."""

    def __init__(self, watched: dict[str, str]) -> None:
        self.watched = watched
        self._busy: set[str] = set()

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:  # fmt: skip
        if fullname not in self.watched or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, lambda module: _install(fullname, module))
        return spec


def autoattach(*, force: bool = False) -> bool:
    """Attach the framework callbacks to every Trainer this process builds (see the module docstring).

    Does nothing (returns False) outside a launched worker or with ``JD_AUTO_CALLBACKS=0``, unless ``force``.
    Modules already imported get the callback now; the others when they are imported. Idempotent.
    """
    global _finder
    if not (force or auto_enabled()):
        return False
    with _lock:
        if _finder is None:
            _finder = _PostImportFinder(WATCHED)
            sys.meta_path.insert(0, _finder)
    for name in WATCHED:
        module = sys.modules.get(name)
        if module is not None:
            _install(name, module)
    return True
