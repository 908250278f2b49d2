"""The structure of the package, as docs/architecture.md describes it.

* The pure core (plan/, render/, the in-worker telemetry emitter) never imports heavy or UI packages at module level,
  checked statically (every top-level import statement of every file) and dynamically (importing every module in a
  fresh interpreter leaves no forbidden module in sys.modules).
* Module-level imports follow the layer order; there is no import circle anywhere (module-level, function-level and
  TYPE_CHECKING imports all count).
* A module over 600 lines says why it is one piece or where it will split.
* docs/architecture.md names every module and only paths and code that exist; README and docs links resolve; nothing
  points at a document outside the repository; the README stays small and keeps its two commands.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "jupyter_dist"
FORBIDDEN = ("IPython", "ipywidgets", "plotly", "torch", "deepspeed", "sky", "anywidget", "numpy")
PURE_DIRS = ("plan", "render")
PURE_FILES = ("telemetry/emitter.py", "errors.py", "__init__.py")


def pure_files() -> list[Path]:
    files = [p for d in PURE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    files += [ROOT / f for f in PURE_FILES if (ROOT / f).exists()]
    return files


def module_level_imports(path: Path) -> list[str]:
    """Top-level modules imported outside any function or class body (including under if/try at top level)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                names.extend(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.append(node.module.split(".")[0])
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    for child in getattr(node, field, []):
                        visit(child.body if isinstance(child, ast.ExceptHandler) else [child])

    visit(tree.body)
    return names


@pytest.mark.parametrize("path", pure_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_core_has_no_heavy_module_level_imports(path: Path) -> None:
    bad = sorted(set(module_level_imports(path)) & set(FORBIDDEN))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad} at module level; import lazily inside the function"


def test_the_static_check_catches_a_forbidden_import(tmp_path: Path) -> None:
    f = tmp_path / "bad.py"
    f.write_text(
        "import os\ntry:\n    import torch.nn as nn\nexcept ImportError:\n    pass\ndef f():\n    import plotly\n"
    )
    assert module_level_imports(f) == ["os", "torch"]


def test_importing_the_pure_core_loads_no_forbidden_module() -> None:
    modules = []
    for p in pure_files():
        rel = p.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules.append(".".join(parts))
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(json.dumps(sorted(k for k in sys.modules if k.split('.')[0] in {FORBIDDEN!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_planning_end_to_end_loads_no_forbidden_module() -> None:
    code = (
        "import json, sys\nimport jupyter_dist\n"
        "p = jupyter_dist.plan('llama-2-7b')\n"
        "from jupyter_dist.cli import main\n"
        "import io, contextlib\n"
        "with contextlib.redirect_stdout(io.StringIO()): main(['plan', '--model', 'gpt2', '--json'])\n"
        f"print(json.dumps(sorted(k for k in sys.modules if k.split('.')[0] in {FORBIDDEN!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


LAYERS = ("_version", "_atomic", "_startup", "errors", "plan", "render", "telemetry", "launch", "worker", "models",
          "integrations", "pool", "ui", "demo", "cli", "magics")  # fmt: skip
"""Layer order (docs/architecture.md): a module imports, at module level, only its own layer and the ones before it.
Function-level imports are not held to the order here (launch reaches into worker for the contract it launches:
``WorkerEnv`` and the check's list of collectives); the circle check below counts them."""


def _layer_of(rel: Path) -> str:
    return rel.parts[0].removesuffix(".py")


def _module_level_targets(path: Path) -> list[str]:
    """The jupyter_dist layers a file imports at module level (relative or absolute imports)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(ROOT)
    out = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            if node.level > 0:
                base = list(rel.parent.parts)[: len(rel.parent.parts) - (node.level - 1)]
                parts = base + (node.module.split(".") if node.module else [])
                if parts:
                    out.append(parts[0])
            elif node.module and node.module.startswith("jupyter_dist."):
                out.append(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out += [a.name.split(".")[1] for a in node.names if a.name.startswith("jupyter_dist.")]
    return out


@pytest.mark.parametrize(
    "path",
    [p for p in sorted(ROOT.rglob("*.py")) if p.parent != ROOT or p.name != "__init__.py"],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_module_level_imports_follow_the_layer_order(path: Path) -> None:
    rel = path.relative_to(ROOT)
    layer = _layer_of(rel)
    if layer not in LAYERS:
        pytest.fail(f"{rel}: unknown layer {layer!r}; add it to LAYERS (and to docs/architecture.md)")
    allowed = set(LAYERS[: LAYERS.index(layer) + 1])
    bad = sorted({t for t in _module_level_targets(path) if t in LAYERS and t not in allowed})
    assert not bad, f"{rel} ({layer}) imports {bad} at module level; only {sorted(allowed)} are above it"


# ---- no import circles ----------------------------------------------------------------------------------------------
# The graph has one node per module of the package (a package's ``__init__.py`` is the package's node) and one edge per
# import statement that names a module of the package: module-level, function-level and ``if TYPE_CHECKING:`` imports
# alike. A lazy import inside a function still couples the two modules (neither can be read, tested or moved without
# the other); it only postpones the cost. ``from pkg import name`` is an edge to ``pkg.name`` when that is a module,
# else to ``pkg``. The packages above a module, which Python runs first, are not edges unless an import names them.


def module_name(path: Path, root: Path) -> str:
    """``<root>/a/b.py`` -> ``<root name>.a.b``; ``<root>/a/__init__.py`` -> ``<root name>.a``."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (anywhere in the file)."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets |= {known(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    full = ".".join(base + ([node.module] if node.module else []))
                else:
                    full = node.module or ""
                for a in node.names:
                    sub = f"{full}.{a.name}"
                    targets.add(sub if sub in files else known(full))
        graph[mod] = {t for t in targets if t is not None and t != mod}
    return graph


def import_groups(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected groups of two or more modules (Tarjan): each module of one reaches every other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups, key=min)


def a_circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest circle ``a -> ... -> a`` through the group's first module (breadth-first inside the group)."""
    start = min(group)
    paths = {w: [start, w] for w in sorted(graph[start] & group)}
    frontier = list(paths)
    while start not in paths:
        frontier_next = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    frontier_next.append(w)
        frontier = frontier_next
    return paths[start]


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One concrete circle per group of modules that import each other."""
    return [a_circle(graph, g) for g in import_groups(graph)]


def test_the_package_has_no_import_circle() -> None:
    graph = import_graph(ROOT)
    lines = []
    for group in import_groups(graph):  # a circle, then every import inside its group (a group can hold several)
        lines.append(" -> ".join(a_circle(graph, group)))
        lines += [f"    {a} -> {b}" for a in sorted(group) for b in sorted(graph[a] & group)]
    assert not lines, "import circles (module-, function- or TYPE_CHECKING-level; see docs/architecture.md):\n" + (
        "\n".join(lines)
    )


def test_the_circle_check_catches_circles_in_a_synthetic_package(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import c  # the package imports its child\n")
    (pkg / "a.py").write_text("from .sub import b\n")  # a -> sub.b (a module, not the package)
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import g  # lazy, still an edge\n")
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.sub\n")
    (pkg / "d.py").write_text("import os\nfrom pkg import a\n")  # d -> a: no way back, no circle
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"} and graph["pkg.d"] == {"pkg.a"}
    assert import_circles(graph) == [["pkg.a", "pkg.sub.b", "pkg.a"], ["pkg.sub", "pkg.sub.c", "pkg.sub"]]
    (pkg / "sub" / "b.py").write_text("def f():\n    pass\n")
    (pkg / "sub" / "c.py").write_text("X = 1\n")
    assert import_circles(import_graph(pkg)) == []


# ---- long modules say why ---------------------------------------------------------------------------------------
LONG_MODULE_LINES = 600
"""Past this many lines a module's docstring says why it is one piece ("One piece: ..."); else it is split along
its seams (docs/architecture.md, "Planned", says which were)."""


def missing_size_note(path: Path) -> bool:
    """Whether a module is longer than :data:`LONG_MODULE_LINES` and its docstring does not say why it is one piece.

    (A "planned split" is not enough: issue 17 split every module that had one.)
    """
    text = path.read_text()
    if text.count("\n") + 1 <= LONG_MODULE_LINES:
        return False
    doc = (ast.get_docstring(ast.parse(text, filename=str(path))) or "").lower()
    return "one piece" not in doc


def test_every_long_module_says_why_it_is_one_piece_or_where_it_splits() -> None:
    bad = [str(p.relative_to(ROOT)) for p in sorted(ROOT.rglob("*.py")) if missing_size_note(p)]
    assert not bad, (
        f"over {LONG_MODULE_LINES} lines without a sentence in the module docstring saying why it is one piece "
        f"('One piece: ...'), or split it along its seams: {bad}"
    )


def test_the_size_note_check_reads_the_docstring_of_long_files_only(tmp_path: Path) -> None:
    body = "x = 1\n" * LONG_MODULE_LINES
    short, long, noted, split, comment = (tmp_path / f"{n}.py" for n in ("short", "long", "noted", "split", "comment"))
    short.write_text('"""Short."""\n' + "x = 1\n" * 10)
    long.write_text('"""Long, with no note."""\n' + body)
    noted.write_text('"""Long.\n\nOne piece: one table and its reader.\n"""\n' + body)
    split.write_text('"""Long.\n\nPlanned split: the table apart from its reader.\n"""\n' + body)
    comment.write_text('"""Long."""\n# one piece (a comment is not the docstring)\n' + body)
    assert [missing_size_note(p) for p in (short, long, noted, split, comment)] == [False, True, False, True, True]


# ---- the architecture document matches the tree ------------------------------------------------------------------
REPO = ROOT.parent
ARCH = REPO / "docs" / "architecture.md"


def test_the_architecture_doc_names_every_module_and_only_paths_that_exist() -> None:
    text = ARCH.read_text()
    modules = [p for p in sorted(ROOT.rglob("*.py")) if len(ast.parse(p.read_text()).body) > 1]  # not docstring-only
    unnamed = [str(p.relative_to(REPO)) for p in modules if str(p.relative_to(REPO)) not in text]
    assert not unnamed, f"docs/architecture.md does not name {unnamed}: add them to 'The modules' (and their layer)"
    named = set(re.findall(r"`((?:jupyter_dist|tests|benchmarks|docs)/[\w./<>-]+?)`", text))
    missing = sorted(n for n in named if "<" not in n and not (REPO / n).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_the_architecture_doc_names_only_code_that_exists() -> None:
    """Every function, class, constant or variable the doc names in backticks (a name with ``_`` or a capital) is a
    word of the package's source, so a rename that leaves the doc behind fails here; ``name*`` / ``name<x>`` are
    prefixes."""
    texts = [p.read_text() for p in ROOT.rglob("*.py")] + [(ROOT / "ui" / "dashboard.js").read_text()]
    words = set(re.findall(r"\w+", "\n".join(texts))) | {"test_the_package_has_no_import_circle", "LAYERS"}
    unknown = set()
    for span in re.findall(r"`([^`]+)`", ARCH.read_text()):
        if re.search(r"/|\.(py|md|js|json|jsonl|log|sbatch|yaml|pkl)\b", span):  # a path: checked above
            continue
        for ident, prefix in re.findall(r"([A-Za-z_]\w*)([*<]?)", span):
            if not ("_" in ident or ident[:1].isupper()):
                continue
            if ident not in words and not (prefix and any(w.startswith(ident) for w in words)):
                unknown.add(ident)
    assert not unknown, f"docs/architecture.md names code that does not exist (renamed?): {sorted(unknown)}"


def test_docs_links_resolve_and_nothing_points_outside_the_repository() -> None:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://")) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, f"links to missing files: {broken}"
    outside = ("../" + "shared", "ARCHITECTURE" + ".md", "RECIPES" + ".md", "CONVENTIONS" + ".md")
    files = [
        p
        for d in ("jupyter_dist", "tests", "docs", "benchmarks", "scripts", "notebooks", "binder")
        for p in sorted((REPO / d).rglob("*"))
        if p.is_file() and p.suffix in (".py", ".md", ".sh", ".ipynb", ".txt", ".js")
    ]
    files += [p for p in sorted(REPO.iterdir()) if p.is_file() and p.suffix in (".md", ".toml", ".txt", ".cfg", ".py")]
    bad = [f"{p.relative_to(REPO)}: {o}" for p in files for o in outside if o in p.read_text(errors="replace")]
    assert not bad, f"references to documents outside the repository (use docs/...): {bad}"


def test_the_readme_starts_small_with_the_two_commands_and_links_every_docs_page() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.encode()) < 10 * 1024, "README.md is over 10 KB: move reference material into docs/ and link it"
    main_job = (
        "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
        'PIP_CONSTRAINT=constraints-cpu.txt pip install -e ".[notebook]" && jupyter-dist demo'
    )
    assert f"```bash\n{main_job}\n```" in text and "```bash\nbash scripts/test.sh\n```" in text
    pages = {p.name for p in (REPO / "docs").glob("*.md")}
    unlinked = sorted(p for p in pages if f"docs/{p}" not in text)
    assert not unlinked, f"README.md does not link {unlinked}"


def unresolved_relative_imports(root: Path) -> list[str]:
    """``from .x import y`` statements (anywhere in a file) whose target module or package does not exist."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        package = list(path.relative_to(root.parent).with_suffix("").parts)[:-1]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            target = Path(
                *package[: len(package) - (node.level - 1)], *(node.module or "").split(".") if node.module else ()
            )
            where = root.parent / target
            found = where.with_suffix(".py").exists() or (where / "__init__.py").exists()
            if found or (node.module is None and all((where / f"{a.name}.py").exists() or (where / a.name).is_dir()
                                                      for a in node.names)):  # fmt: skip
                continue
            bad.append(f"{path.relative_to(root.parent)}:{node.lineno}: from {'.' * node.level}{node.module or ''}")
    return bad


def test_every_relative_import_names_a_module_that_exists() -> None:
    # a lazy import inside a function fails only when that function runs; after a module moves, this finds it first
    assert unresolved_relative_imports(ROOT) == []


def test_the_relative_import_check_catches_a_stale_path(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "here.py").write_text("")
    (pkg / "sub" / "mod.py").write_text("def f():\n    from ..here import x\n    from .gone import y\n")
    assert unresolved_relative_imports(pkg) == ["pkg/sub/mod.py:3: from .gone"]


def _python_sources_of(path: Path) -> list[str]:
    """The Python text of a .py file, or of each code cell of a notebook (magics and shell lines blanked)."""
    if path.suffix == ".py":
        return [path.read_text()]
    cells = json.loads(path.read_text())["cells"]
    out = []
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        lines = "".join(cell["source"]).splitlines()
        out.append("\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in lines))
    return out


def unresolved_absolute_imports(repo: Path, dirs: tuple[str, ...] = ("jupyter_dist", "tests", "benchmarks", "scripts",
                                                                     "notebooks", "binder")) -> list[str]:  # fmt: skip
    """``import jupyter_dist.x`` / ``from jupyter_dist.x import y`` whose module does not exist (y may be a name)."""
    pkg_root = repo / "jupyter_dist"

    def exists(dotted: str) -> bool:
        where = repo.joinpath(*dotted.split("."))
        return where.with_suffix(".py").exists() or (where / "__init__.py").exists()

    bad = []
    files = [p for d in dirs for p in sorted((repo / d).rglob("*")) if p.suffix in (".py", ".ipynb") and p.is_file()]
    for path in files:
        for source in _python_sources_of(path):
            try:
                tree = ast.parse(source, filename=str(path))
            except SyntaxError:
                continue  # a cell that is a magic body or a template fragment
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names if a.name.split(".")[0] == pkg_root.name]
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    names = [node.module] if node.module.split(".")[0] == pkg_root.name else []
                else:
                    names = []
                bad += [f"{path.relative_to(repo)}:{node.lineno}: {n}" for n in names if not exists(n)]
    return bad


def test_every_absolute_import_of_the_package_names_a_module_that_exists() -> None:
    # tests, benchmarks and notebooks import modules by absolute path; after a move they fail only when run
    assert unresolved_absolute_imports(REPO) == []


def test_the_absolute_import_check_catches_a_moved_module(tmp_path: Path) -> None:
    (tmp_path / "jupyter_dist" / "launch").mkdir(parents=True)
    for f in ("__init__.py", "launch/__init__.py", "launch/base.py"):
        (tmp_path / "jupyter_dist" / f).write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "def t():\n    from jupyter_dist.launch.base import A\n    from jupyter_dist.launch.slurm import B\n"
        "    import jupyter_dist.launch\n"
    )
    assert unresolved_absolute_imports(tmp_path, ("tests",)) == ["tests/test_x.py:3: jupyter_dist.launch.slurm"]


def test_every_section_a_module_points_to_exists_in_the_architecture_doc() -> None:
    headings = set(re.findall(r"^#+ (.+)$", (REPO / "docs" / "architecture.md").read_text(), flags=re.M))
    bad = [
        f"{p.relative_to(REPO)}: {name!r}"
        for p in sorted(ROOT.rglob("*.py"))
        for name in re.findall(r'docs/architecture\.md, "([^"]+)"', p.read_text())
        if not any(h.startswith(name) for h in headings)
    ]
    assert not bad, f"docstrings point to sections docs/architecture.md does not have: {bad}"


def test_the_architecture_docs_environment_table_is_every_jd_variable_the_code_reads_or_writes() -> None:
    """The table under "Launch contract" lists exactly the ``JD_*`` names the package's source spells, and every
    field of ``WorkerEnv`` (its ``ENV_VARS``), so a new variable cannot go undocumented, nor a removed one stay."""
    from jupyter_dist.worker._env import ENV_VARS

    text = ARCH.read_text()
    table = text[text.index("| variable | meaning | set by |"):]
    table = table[: table.index("\n\n")]
    documented = set(re.findall(r"`(JD_[A-Z0-9_]+)`", table))  # digits too: JD_FP8_RECIPE
    source = "\n".join(p.read_text() for p in ROOT.rglob("*.py"))
    used = set(re.findall(r"[\"'](JD_[A-Z0-9_]+)[\"']", source))
    missing = set(ENV_VARS.values()) - documented
    assert not missing, f"WorkerEnv fields missing from the table: {sorted(missing)}"
    assert not used - documented, f"JD_* variables the code uses but the table lacks: {sorted(used - documented)}"
    assert not documented - used, f"the table documents JD_* variables no code uses: {sorted(documented - used)}"
