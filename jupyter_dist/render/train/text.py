"""Text tools of the script assembler: template filling, line wrapping, import sorting (ruff's isort order)."""

from __future__ import annotations

__all__ = ["STDLIB", "doc_safe", "fill", "import_lines", "join_lines", "member_key", "py_str", "wrap"]

STDLIB = frozenset({"argparse", "collections", "contextlib", "dataclasses", "fnmatch", "functools", "itertools", "json",
                    "os", "re", "time", "pathlib", "typing"})  # fmt: skip
"""Top-level modules of the standard library a generated script may import (they sort before torch's)."""


def fill(template: str, **values: str) -> str:
    """Fill ``<<name>>`` markers: a marker alone on its line takes an indented block, elsewhere a value."""
    out: list[str] = []
    for line in template.strip("\n").split("\n"):
        stripped = line.strip()
        key = stripped[2:-2]
        if stripped.startswith("<<") and stripped.endswith(">>") and key in values:
            indent = line[: len(line) - len(stripped)]
            out.extend(indent + x if x else "" for x in values[key].strip("\n").split("\n") if values[key])
            continue
        for name, value in values.items():
            line = line.replace(f"<<{name}>>", value)
        out.append(line)
    text = "\n".join(out)
    if "<<" in text:
        raise RuntimeError(f"unfilled template marker near {text[text.index('<<') :][:40]!r}")
    return text


def py_str(value: str) -> str:
    """A Python string literal, in double quotes where that needs no escaping."""
    text = repr(value)
    if text.startswith("'") and '"' not in value and "\\" not in text:
        text = '"' + text[1:-1] + '"'
    return text


def join_lines(*lines: str) -> str:
    """The lines joined by newlines."""
    return "\n".join(lines)


def doc_safe(text: str) -> str:
    """Text that can sit inside a triple-quoted raw docstring (no backslashes, no triple quotes)."""
    cleaned = "".join(c if c.isprintable() or c == "\n" else " " for c in text)
    return cleaned.replace("\\", "/").replace('"""', "'''")


def wrap(line: str, width: int, *, indent: str = "", cont: str = "", sep: str = "") -> list[str]:
    """Split ``line`` between words into lines of at most ``width``; continuation lines start with ``cont``."""
    out: list[str] = []
    current = ""
    for word in line.split(" "):
        if current and len(indent) + len(current) + 1 + len(word) + len(sep) > width:
            out.append(indent + current + sep)
            current = cont + word
        else:
            current = f"{current} {word}" if current else word
    out.append(indent + current)
    return out


def import_lines(straight: list[tuple[str, str | None]], froms: dict[str, list[str]]) -> str:
    """Sorted as ruff's isort rules want: ``import x`` lines, then ``from x import`` lines, by module."""
    lines = [f"import {m}" + (f" as {a}" if a else "") for m, a in sorted(straight, key=lambda x: x[0].lower())]
    for module in sorted(froms, key=str.lower):
        names = set(froms[module])
        # an aliased name gets a line of its own (isort's combine-as-imports is off), before the others
        lines += [f"from {module} import {n}" for n in sorted(n for n in names if " as " in n)]
        members = sorted((n for n in names if " as " not in n), key=member_key)
        if not members:
            continue
        line = f"from {module} import {', '.join(members)}"
        if len(line) > 120:
            line = f"from {module} import (\n" + "".join(f"    {m},\n" for m in members) + ")"
        lines.append(line)
    return "\n".join(lines)


def member_key(member: str) -> tuple[int, str]:
    """Ruff's ``order-by-type``: CONSTANTS, Classes, then functions; case-insensitive within each."""
    name = member.split(" as ")[0]
    kind = 0 if name.isupper() and len(name) > 1 else 1 if name[:1].isupper() else 2
    return kind, name.lower()
