"""Guard: the pure core (plan/, render/, the in-worker telemetry emitter) never imports heavy or UI packages at
module level. Checked two ways: statically (every top-level import statement of every file) and dynamically
(importing every module in a fresh interpreter leaves no forbidden module in sys.modules)."""

from __future__ import annotations

import ast
import json
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


LAYERS = ("errors", "plan", "render", "telemetry", "launch", "worker", "ui", "demo", "cli", "magics", "pool_magics")
"""Layer order (ARCHITECTURE.md): a module imports, at module level, only its own layer and the ones before it.
Function-level imports may reach down (``Run.dashboard()`` builds ui panels lazily) and are not checked here."""


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
        pytest.fail(f"{rel}: unknown layer {layer!r}; add it to LAYERS (and to ARCHITECTURE.md)")
    allowed = set(LAYERS[: LAYERS.index(layer) + 1])
    bad = sorted({t for t in _module_level_targets(path) if t in LAYERS and t not in allowed})
    assert not bad, f"{rel} ({layer}) imports {bad} at module level; only {sorted(allowed)} are above it"
