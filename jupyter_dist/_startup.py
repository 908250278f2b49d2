"""A training process's start: torch, then dynamo, imported outside Python's cyclic collector (stdlib until called).

``torch._dynamo`` is imported when the script imports it, with the collector paused then too. Called before anything
else imports torch in a rank: by ``jupyter_dist.worker`` on import in a training process, and by the launch bootstrap
before it loads the objects shipped from the notebook.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["import_torch_outside_the_collector"]

_done = False
"""Whether torch was imported here already in this process (the bootstrap, then ``import jupyter_dist.worker``)."""


def import_torch_outside_the_collector() -> None:
    """Import torch with Python's cyclic collector paused, then freeze what it created.

    With the collector running, each full collection during torch's import (and every one afterwards: ``torch._dynamo``,
    which every torch optimizer imports when it is built, then the training) walks the objects torch already created
    again; ``gc.freeze()`` moves them to the permanent generation, where collections skip them (module-level objects
    live as long as the process anyway). Measured on 2 cores (``benchmarks/rank_start.py``, medians): imports, an
    optimizer and 20 small steps x0.88-0.92 CPU with torch alone, x0.78 with dynamo's import as below. Nothing else
    changes: the collector is as it was afterwards.

    ``torch._dynamo`` itself is left to the script: imported here as well, it made a plain DDP script that calls
    ``destroy_process_group()`` hang at exit in 2-3 of 8 runs (the DDP reducer's last reference destroys the gloo group
    with the GIL held while gloo's thread waits for the GIL to free a tensor; 0 of 8 without). Its import, when the
    script makes it (every torch optimizer does, through ``torch._disable_dynamo``; so does transformers), runs with the
    collector paused too (:class:`_PausedImport`): 1.7 -> 1.1 CPU-s on 2 cores, the import order unchanged.

    Once per process. A torch that cannot be imported is left to the caller's own ``import torch``, which fails with
    the same error where the caller's hooks record it.
    """
    global _done
    if _done:
        return
    try:
        with _collector_paused():
            import torch  # noqa: F401
    except Exception:
        return
    gc.freeze()
    _done = True
    if "torch._dynamo" not in sys.modules:
        sys.meta_path.insert(0, _PausedImport("torch._dynamo"))


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic collector off inside, then as it was (left off where the user had turned it off)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


class _PausedImport:
    """A one-shot import hook: the first import of module ``name`` runs with the cyclic collector paused.

    Whoever makes the import, whenever: the module, its spec and its loader are the ones the import system finds
    without the hook (its loader's ``exec_module`` is wrapped on that one loader object).
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is not None and hasattr(loader, "exec_module"):
            run = loader.exec_module

            def exec_module(module: Any) -> None:
                with _collector_paused():
                    run(module)

            loader.exec_module = exec_module  # this module's own loader object (a file finder makes one per module)
        return spec
