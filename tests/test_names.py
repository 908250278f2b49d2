"""No strategy or back-end name typed outside its table or registry (static, over jupyter_dist/ with ``ast``).

The strategy table (``plan/strategies.py``: ``STRATEGIES``) and the back-end registry (``launch/base.py``:
``BACKEND_SPECS``) are the one place each name is spelled: code elsewhere reads a property from the table
(``model_parallel``, ``family``, :data:`~jupyter_dist.plan.strategies.MODEL_PARALLEL`, ``SIMPLEST``, ...) or from a
back-end's spec (``cluster``, ``label``, ``priced``, ``DEFAULT_BACKEND``, its start hooks), so adding a strategy
touches the table and the worker's wrap, and adding a back-end its own module and the registry. A string literal
equal to a name anywhere else fails here, except in the allow-lists below, each with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

from jupyter_dist.launch.base import BACKEND_SPECS, BACKENDS
from jupyter_dist.plan.strategies import FAMILIES, STRATEGIES

ROOT = Path(__file__).resolve().parents[1] / "jupyter_dist"

TABLES = {"plan/strategies.py": "the strategy table", "launch/base.py": "the back-end registry"}
"""Files that define the names."""

STRATEGY_ALLOWED = {
    ("plan/planner.py", "_reasons"): "the plan's sentences about one named strategy (DDP, FSDP FULL_SHARD vs HYBRID)",
    ("plan/planner.py", "_warnings"): "warnings about one named strategy (DDP, ZeRO-2, NO_SHARD), as their text says",
}
"""(file, enclosing function) -> why a strategy name is spelled there."""

BACKEND_ALLOWED = {
    ("launch/cost.py", "price_nodes"): "SkyPilot's own infra names (SkyPilot on a SLURM cluster, Kubernetes, SSH "
    "node pools) have no price list: a SkyPilot cloud that happens to share a back-end's name, not the back-end",
}
"""(file, enclosing function) -> why a back-end's name is spelled there."""

BACKEND_DEBT: dict[str, int] = {}
"""File -> back-end names still spelled there. Empty since issue 34 put the back-ends behind their registry: keep it
so (a new name fails here; read a property of the back-end's ``BackendSpec`` instead, or add one)."""


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _is_family_context(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """The literal is a family (``ddp``, ``fsdp2``, ...), not a strategy: compared with, assigned to or passed as
    something whose name says family (``spec.family == "fsdp2"``, ``fam in ("ddp", "fsdp")``, ``family="fsdp2"``)."""
    child, up = node, parents.get(node)
    while up is not None and isinstance(up, (ast.Tuple, ast.List, ast.Set, ast.IfExp, ast.BoolOp)):
        child, up = up, parents.get(up)
    if isinstance(up, ast.Compare):
        others = [up.left, *up.comparators]
        return any("fam" in ast.unparse(o).lower() for o in others if o is not child)
    if isinstance(up, ast.keyword):
        return up.arg == "family"
    if isinstance(up, (ast.Assign, ast.AnnAssign)):
        targets = up.targets if isinstance(up, ast.Assign) else [up.target]
        return any("fam" in ast.unparse(t).lower() for t in targets)
    if isinstance(up, ast.Return):
        return "fam" in _enclosing_function(up, parents)
    if isinstance(up, ast.arguments):  # a parameter's default
        positional = [*up.posonlyargs, *up.args]
        defaulted = positional[len(positional) - len(up.defaults) :]
        pairs = [*zip(defaulted, up.defaults, strict=True), *zip(up.kwonlyargs, up.kw_defaults, strict=True)]
        return any(default is child and "fam" in arg.arg for arg, default in pairs)
    return False


def _enclosing_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str:
    up = parents.get(node)
    while up is not None and not isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)):
        up = parents.get(up)
    return up.name if up is not None else ""


def name_literals(source: str, rel: str) -> list[tuple[int, str, str]]:
    """(line, name, kind) for each string literal in ``source`` (the file ``rel`` under jupyter_dist/) that spells a
    strategy or back-end name where it must not; ``kind`` is ``"strategy"``, ``"backend"`` or ``"family"`` (a family
    context holding a strategy name that is no family)."""
    if rel in TABLES:
        return []
    tree = ast.parse(source, filename=rel)
    parents = _parents(tree)
    out: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        value = node.value
        if value in BACKENDS and rel != f"launch/backends/{value}.py":  # a back-end's own module names itself
            if (rel, _enclosing_function(node, parents)) not in BACKEND_ALLOWED:
                out.append((node.lineno, value, "backend"))
        if value in STRATEGIES:
            if _is_family_context(node, parents):
                if value not in FAMILIES:
                    out.append((node.lineno, value, "family"))
            elif (rel, _enclosing_function(node, parents)) not in STRATEGY_ALLOWED:
                out.append((node.lineno, value, "strategy"))
    return sorted(out)


def _scan() -> dict[str, list[tuple[int, str, str]]]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        hits = name_literals(path.read_text(encoding="utf-8"), rel)
        if hits:
            found[rel] = hits
    return found


def test_no_strategy_name_is_typed_outside_the_strategy_table() -> None:
    bad = {
        f"{rel}:{line}: {value!r} ({kind})"
        for rel, hits in _scan().items()
        for line, value, kind in hits
        if kind != "backend"
    }
    assert not bad, (
        "strategy names spelled outside jupyter_dist/plan/strategies.py: read a property of the table instead "
        "(or add a flag to StrategySpec)\n" + "\n".join(sorted(bad))
    )


def test_no_back_end_name_is_typed_outside_the_registry() -> None:
    assert BACKEND_DEBT == {}  # issue 34: no debt left, and none may come back
    hits = {f"{rel}:{line}: {value!r}" for rel, found in _scan().items() for line, value, kind in found
            if kind == "backend"}  # fmt: skip
    counts = {rel: n for rel, found in _scan().items() if (n := sum(k == "backend" for _, _, k in found))}
    assert counts == BACKEND_DEBT, (
        "back-end names spelled outside jupyter_dist/launch/base.py (BACKEND_SPECS) and the back-end's own module: "
        "read a property of the back-end's BackendSpec (or add one) instead\n" + "\n".join(sorted(hits))
    )


def test_the_scan_tells_strategies_from_families_and_finds_both_kinds() -> None:
    source = """
RUNNABLE = {"zero1", "none"}
def wrap(spec, fam, name, family="fsdp2"):
    if spec.family == "fsdp2" or fam in ("ddp", "deepspeed") or spec.family == "zero3":
        return replace(spec, family="ddp")
    if name == "ddp":
        return "slurm"
def family(spec):
    return "fsdp2"
"""
    assert name_literals(source, "plan/x.py") == [
        (2, "zero1", "strategy"),
        (4, "zero3", "family"),
        (6, "ddp", "strategy"),
        (7, "slurm", "backend"),
    ]
    assert name_literals('NAME = "slurm"', "launch/backends/slurm.py") == []  # a back-end's module names itself
    assert name_literals('NAME = "local"', "launch/backends/slurm.py") == [(1, "local", "backend")]  # not another's
    assert name_literals('def price_nodes():\n    return "slurm"', "launch/cost.py") == []  # allowed, with a reason
    assert name_literals('def price_for():\n    return "slurm"', "launch/cost.py") == [(2, "slurm", "backend")]
    assert name_literals('X = ("zero1", "local")', "plan/strategies.py") == []  # the table itself
    assert name_literals('def _warnings():\n    return "zero2"', "plan/planner.py") == []  # allowed, with a reason


# ---- the architecture doc's tables, from the table and the registry ------------------------------------------------
ARCH = ROOT.parent / "docs" / "architecture.md"


def strategy_rows() -> list[str]:
    """The strategy table as docs/architecture.md shows it, from ``STRATEGIES``."""
    rows = ["| strategy | family | shards | offloads | with tp/pp/cp/ep |", "|---|---|---|---|---|"]
    for s in STRATEGIES.values():
        flags = (("optimizer", s.shard_optimizer), ("gradients", s.shard_grads), ("parameters", s.shard_params))
        shards = ", ".join(k for k, v in flags if v) or "nothing"
        if s.hybrid:
            shards += " (inside a node; replicas across)"
        offloads = ", ".join(k for k, v in (("optimizer", s.offload_optimizer), ("parameters", s.offload_params)) if v)
        mp = ("yes, as FSDP2" if s.fsdp2_with_model_parallelism else "yes") if s.model_parallel else "no"
        rows.append(f"| `{s.name}` | `{s.family}` | {shards} | {offloads or '—'} | {mp} |")
    return rows


def backend_rows() -> list[str]:
    """The back-end table as docs/architecture.md shows it, from ``BACKEND_SPECS``."""
    rows = ["| back-end | launcher | wizard label | cluster start hooks |", "|---|---|---|---|"]
    for spec in BACKEND_SPECS.values():
        module, cls = spec.launcher.split(":")
        hooks = f"`{spec.start.split(':')[1]}`" if spec.start else "— (runs here)"
        rows.append(f"| `{spec.name}` | `{cls}` (`{module.replace('.', '/')}.py`) | {spec.label} | {hooks} |")
    return rows


def _doc_table(header: str) -> list[str]:
    text = ARCH.read_text(encoding="utf-8")
    table = text[text.index(header) :]
    return table[: table.index("\n\n")].split("\n")


def test_the_architecture_docs_strategy_table_is_the_strategy_table() -> None:
    assert _doc_table("| strategy | family |") == strategy_rows()


def test_the_architecture_docs_back_end_table_is_the_registry() -> None:
    assert _doc_table("| back-end | launcher |") == backend_rows()


def test_no_module_imports_a_private_name_of_another() -> None:
    """A leading underscore means "this module's own": no ``from X import _name`` between jupyter_dist's modules (an
    alias to a private name, ``import x as _x``, is the importer's own and allowed); a name another module needs is
    public in its module (in ``__all__``)."""
    crossing = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            ours = isinstance(node, ast.ImportFrom) and (
                node.level > 0 or (node.module or "").startswith("jupyter_dist")
            )
            if ours:  # torch's private names (experimental CP, _StridedShard) are torch's business
                crossing += [f"{path.relative_to(ROOT)}:{node.lineno} imports {a.name} from {node.module or '.'}"
                             for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]  # fmt: skip
    assert not crossing, "\n".join(crossing)
