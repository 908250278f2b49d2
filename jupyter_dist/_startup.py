"""A training process's start: import torch outside Python's cyclic collector (stdlib only until it is called).

Called before anything else imports torch in a rank: by ``jupyter_dist.worker`` on import in a training process, and
by the launch bootstrap before it loads the objects shipped from the notebook.
"""

from __future__ import annotations

import gc

__all__ = ["import_torch_outside_the_collector"]

_done = False
"""Whether torch was imported here already in this process (the bootstrap, then ``import jupyter_dist.worker``)."""


def import_torch_outside_the_collector() -> None:
    """Import torch with Python's cyclic collector paused, then freeze what it created.

    With the collector running, each full collection during torch's import (and every one afterwards: ``torch._dynamo``,
    which every torch optimizer imports when it is built, then the training) walks the objects torch already created
    again; ``gc.freeze()`` moves them to the permanent generation, where collections skip them (module-level objects
    live as long as the process anyway). Measured on 2 cores (``benchmarks/rank_start.py``, medians): imports, an
    optimizer and 20 small steps x0.88-0.92 CPU. Nothing else changes: the collector is as it was afterwards.

    ``torch._dynamo`` itself is left to the script: imported here as well (a further ~0.4 CPU-s), it made a plain DDP
    script that calls ``destroy_process_group()`` hang at exit in 2-3 of 8 runs (the DDP reducer's last reference
    destroys the gloo group with the GIL held while gloo's thread waits for the GIL to free a tensor; 0 of 8 without).

    Once per process. A torch that cannot be imported is left to the caller's own ``import torch``, which fails with
    the same error where the caller's hooks record it.
    """
    global _done
    if _done:
        return
    was_on = gc.isenabled()
    gc.disable()
    try:
        import torch  # noqa: F401
    except Exception:
        return
    finally:
        if was_on:
            gc.enable()
    gc.freeze()
    _done = True
