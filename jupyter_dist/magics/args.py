"""The one magic-line parser shared by the run magics (``magics/dist.py``) and the pool magics (``magics/pool.py``).

It lives apart from both so that neither imports the other for it: ``dist.py`` registers the pool magics and routes
``%dist_stop`` to them, so ``pool.py`` must not import ``dist.py`` back (docs/architecture.md, "No import circles").
"""

from __future__ import annotations

import shlex
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import MagicArgumentParser

__all__ = ["parse_magic_line", "strip_comment"]


def strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment``: a ``#`` at the start of the line or after whitespace, outside quotes.

    As in a shell, so that ``%dist_start --nproc 2   # fresh ranks`` works as the docs show it; a ``#`` inside a word
    (``run#1``) or in quotes stays.
    """
    quote = ""
    prev = " "
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and prev.isspace():
            return line[:i]
        prev = ch
    return line


def parse_magic_line(parser: MagicArgumentParser, line: str) -> Any:
    """Parse a magic's line with ``shlex`` (quotes and spaces in paths); ``--help`` prints and returns ``None``.

    A trailing ``# comment`` is dropped (:func:`strip_comment`).
    """
    try:
        argv = shlex.split(strip_comment(line))
    except ValueError as exc:
        raise UsageError(f"{parser.prog}: {exc}") from None
    if "-h" in argv or "--help" in argv:
        print(parser.format_help())
        return None
    return parser.parse_args(argv)
