"""The IPython magics, one module per family (see docs/architecture.md, "Layers").

* :mod:`.dist` — ``%%dist_train``, ``%dist_plan``, ``%dist_wizard``, ``%dist_check``, ``%dist_status``/``%dist_stop``
  and the extension's load/unload;
* :mod:`.pool` — the interactive pool's ``%dist_start``, ``%%dist``, ``%dist_push``/``%dist_pull``, ``%dist_mode``;
* :mod:`.args` — the one line parser both families share (so neither imports the other's internals).

Importing this package is cheap; IPython is imported by the modules above, which load on ``%load_ext jupyter_dist``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_ipython_extension", "unload_ipython_extension"]


def load_ipython_extension(ipython: Any) -> None:
    """Register every magic family with ``ipython``."""
    from .dist import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """Remove what :func:`load_ipython_extension` registered."""
    from .dist import unload_ipython_extension as unload

    unload(ipython)
