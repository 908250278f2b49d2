"""IPython magics: thin wrappers that parse a line, call the layers and display the result.

``%dist_plan`` takes exactly the flags of ``jupyter-dist plan`` (one shared definition in :mod:`jupyter_dist.cli`).
"""

from __future__ import annotations

import shlex
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import MagicArgumentParser

from .cli import add_plan_arguments, plan_from_args
from .errors import JupyterDistError

__all__ = ["DistMagics", "load_ipython_extension", "unload_ipython_extension"]


def _plan_parser() -> MagicArgumentParser:
    parser = MagicArgumentParser(  # type: ignore[no-untyped-call]
        prog="%dist_plan", add_help=False,
        description="Plan distributed training: which strategy, will it fit, how fast, why.",
    )
    add_plan_arguments(parser)
    return parser


@magics_class
class DistMagics(Magics):
    """The jupyter-dist magics."""

    plan_parser = _plan_parser()

    @line_magic
    def dist_plan(self, line: str) -> Any:
        """Plan distributed training and show per-GPU memory, speed and the recommendation.

        Takes the flags of ``jupyter-dist plan`` (``%dist_plan --help`` lists them); returns the
        :class:`~jupyter_dist.plan.Plan`, which displays itself as a table (memory in GiB).

        Examples
        --------
        ::

            In [1]: %load_ext jupyter_dist
            In [2]: %dist_plan --model llama-2-7b --gpu h100-80gb --nodes 2 --seq-len 4096
            In [3]: p = %dist_plan --hf-config "./my model/config.json" --checkpointing selective
            In [4]: p.best.memory.total
        """
        # parse_argstring keeps quotes (posix=False); shlex.split handles paths with spaces
        try:
            argv = shlex.split(line)
        except ValueError as exc:
            raise UsageError(f"%dist_plan: {exc}") from None
        if "-h" in argv or "--help" in argv:
            print(self.plan_parser.format_help())
            return None
        args = self.plan_parser.parse_args(argv)
        try:
            return plan_from_args(args)
        except JupyterDistError as exc:
            raise UsageError(str(exc)) from None


_registered: dict[int, DistMagics] = {}


def load_ipython_extension(ipython: Any) -> None:
    """Register :class:`DistMagics` with ``ipython``."""
    magics = DistMagics(ipython)
    ipython.register_magics(magics)
    _registered[id(ipython)] = magics


def unload_ipython_extension(ipython: Any) -> None:
    """Remove the magics registered by :func:`load_ipython_extension`."""
    magics = _registered.pop(id(ipython), None)
    if magics is None:
        return
    for kind, names in magics.magics.items():
        for name in names:
            ipython.magics_manager.magics[kind].pop(name, None)
