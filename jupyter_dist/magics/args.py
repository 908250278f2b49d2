"""The one magic-line parser shared by the run magics (``magics/dist.py``) and the pool magics (``magics/pool.py``).

It lives apart from both so that neither imports the other for it: ``dist.py`` registers the pool magics and routes
``%dist_stop`` to them, so ``pool.py`` must not import ``dist.py`` back (docs/architecture.md, "No import circles").
"""

from __future__ import annotations

import shlex
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import MagicArgumentParser

__all__ = ["parse_magic_line"]


def parse_magic_line(parser: MagicArgumentParser, line: str) -> Any:
    """Parse a magic's line with ``shlex`` (quotes and spaces in paths); ``--help`` prints and returns ``None``."""
    try:
        argv = shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"{parser.prog}: {exc}") from None
    if "-h" in argv or "--help" in argv:
        print(parser.format_help())
        return None
    return parser.parse_args(argv)
