"""The kernel's names a cell uses, shipped to the ranks without ``--ship`` (or named in one line when they cannot be).

The rule (docs/reference.md): a name the cell reads but never binds, that is not a builtin and exists in the kernel,
is sent to every rank with the cell when it is a function or a class, or a value whose pickle is at most
:data:`AUTO_SHIP_BYTES`; a bigger value (a tensor, a dataset) is shipped only when named with ``--ship`` and the cell
says so in one line, as it does for a module the cell uses without importing it. accelerate's
``notebook_launcher`` forks the kernel, so its globals just work; jupyter-dist starts fresh processes (a CUDA kernel
cannot be forked), so it sends what the cell needs instead.
"""

from __future__ import annotations

import ast
import builtins
import types
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AUTO_SHIP_BYTES", "Shipping", "free_names", "auto_ship"]

AUTO_SHIP_BYTES = 1 << 20
"""The largest pickled value sent without ``--ship`` (1 MiB): configs, lists, small arrays; not a model or data."""

_WORKER_NAMES = frozenset({"jd", "__name__", "__file__", "__builtins__"})


class _Names(ast.NodeVisitor):
    """Names read and names bound anywhere in a cell (a name bound in any scope counts as the cell's own)."""

    def __init__(self) -> None:
        self.read: dict[str, None] = {}
        self.bound: set[str] = set()

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self.read.setdefault(node.id)
        else:
            self.bound.add(node.id)

    def _bind_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        args = node.args
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
            if a is not None:
                self.bound.add(a.arg)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.bound.add(node.name)
        self._bind_function(node)
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._bind_function(node)
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.bound.add(node.name)
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.bound.add(alias.asname or alias.name.split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            self.bound.add(alias.asname or alias.name)

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name:
            self.bound.add(node.name)
        self.generic_visit(node)

    def visit_Global(self, node: ast.Global) -> None:  # declared, not bound: a read elsewhere still needs it
        self.generic_visit(node)

    def visit_MatchAs(self, node: ast.MatchAs) -> None:
        if node.name:
            self.bound.add(node.name)
        self.generic_visit(node)


def free_names(code: str) -> list[str]:
    """Names ``code`` reads but never binds (not builtins, not ``jd``), in order of first use; ``[]`` if unparsable."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return []
    names = _Names()
    names.visit(tree)
    return [n for n in names.read if n not in names.bound and n not in _WORKER_NAMES and not hasattr(builtins, n)]


@dataclass
class Shipping:
    """What :func:`auto_ship` decided for one cell."""

    objects: dict[str, Any] = field(default_factory=dict)
    """Names sent to the ranks without ``--ship``."""
    hints: list[str] = field(default_factory=list)
    """One line per name the cell uses that exists in the kernel but is not sent (say how)."""

    def line(self) -> str:
        """The cell's one line about it (``""`` when there is nothing to say)."""
        parts = []
        if self.objects:
            parts.append("shipped from the kernel: " + ", ".join(self.objects))
        parts += self.hints
        return "; ".join(parts)


def auto_ship(code: str, namespace: dict[str, Any], *, shipped: set[str] | frozenset[str] = frozenset(),
              limit: int = AUTO_SHIP_BYTES) -> Shipping:  # fmt: skip
    """Decide which of the kernel's names ``code`` needs are sent with it (see the module docstring)."""
    import pickle

    import cloudpickle

    out = Shipping()
    for name in free_names(code):
        if name in shipped or name not in namespace or name.startswith("_"):
            continue
        obj = namespace[name]
        if isinstance(obj, types.ModuleType):
            out.hints.append(f"{name} is a module in the kernel: import it in the cell")
            continue
        if callable(getattr(obj, "run_cell", None)) or type(obj).__module__.startswith(("IPython.", "ipykernel.")):
            continue  # the shell's own objects (get_ipython, In/Out helpers) are never the cell's data
        try:
            size = len(cloudpickle.dumps(obj))
        except (pickle.PicklingError, TypeError, AttributeError, RecursionError, ValueError) as exc:
            out.hints.append(f"{name} is defined in the kernel but cannot be shipped ({type(exc).__name__}): "
                             "define it in the cell")  # fmt: skip
            continue
        if isinstance(obj, (types.FunctionType, type)) or size <= limit:
            out.objects[name] = obj
        else:
            out.hints.append(f"{name} is defined in the kernel ({size / 2**20:,.1f} MiB pickled); add --ship {name} "
                             "to send it, or load it in the cell")  # fmt: skip
    return out
