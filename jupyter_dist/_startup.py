"""A training process's start: import torch outside Python's cyclic collector (stdlib only until it is called).

Called before anything else imports torch in a rank: by ``jupyter_dist.worker`` on import in a training process, and
by the launch bootstrap before it loads the objects shipped from the notebook.
"""

from __future__ import annotations

import gc

__all__ = ["import_torch_outside_the_collector"]


def import_torch_outside_the_collector() -> None:
    """Import torch and ``torch._dynamo`` with Python's cyclic collector paused, then freeze what they created.

    Every torch optimizer imports ``torch._dynamo`` when it is built, so a training process imports both. With the
    collector running, each full collection during those imports (and every one afterwards, in training) walks the
    objects torch already created again; ``gc.freeze()`` moves them to the permanent generation, where collections
    skip them (module-level objects live as long as the process anyway). Measured on 2 cores
    (``benchmarks/rank_start.py``, medians): imports, an optimizer and 20 small steps 4.9-5.1 -> 3.4-3.7 CPU-s
    (x0.65-0.74); a 4-rank launch of the equal-math tests (``tests/numerics/parallel_train.py``) 39-47 -> 34-42
    CPU-s. Nothing else changes: the collector is as it was afterwards.
    """
    was_on = gc.isenabled()
    gc.disable()
    try:
        import torch  # noqa: F401
        import torch._dynamo  # noqa: F401
    finally:
        if was_on:
            gc.enable()
    gc.freeze()
