"""Every Python block in the README and docs/ runs, or says why it cannot (``<!-- illustrative: why -->``).

The runnable blocks of one page run in order in a real IPython shell with the extension loaded, in a fresh folder,
as a reader pasting them into a notebook would (magics included; real 2-process runs on CPU/gloo). A block that is a
sketch (the reader's model, a cluster, a cloud account) carries the marker, with the reason, right above its fence.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(?P<mark><!-- illustrative: (?P<why>[^>]+) -->\n)?```python\n(?P<code>.*?)```", re.S)


def blocks(page: Path) -> list[tuple[int, str, str | None]]:
    """``(line, code, why-illustrative or None)`` for each Python block of ``page``."""
    text = page.read_text(encoding="utf-8")
    return [(text[: m.start("code")].count("\n") + 1, m.group("code"), m.group("why")) for m in _BLOCK.finditer(text)]


def test_every_python_block_is_runnable_or_says_why_not() -> None:
    """The marker needs a reason; and the parse finds every fence (none hides from it)."""
    total = 0
    for page in PAGES:
        found = blocks(page)
        assert len(found) == page.read_text(encoding="utf-8").count("```python\n"), page
        for line, _code, why in found:
            assert why is None or len(why.strip()) >= 8, f"{page.name}:{line}: say why the block is illustrative"
        total += len(found)
    assert total >= 30


RUNNABLE = [p for p in PAGES if any(why is None for _, _, why in blocks(p))]


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE, ids=[p.name for p in RUNNABLE])
def test_the_runnable_blocks_of_a_page_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           ip: Any) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    ip.run_line_magic("reset", "-f")
    ip.run_line_magic("load_ext", "jupyter_dist")
    ran = 0
    for line, code, why in blocks(page):
        if why is not None:
            continue
        result = ip.run_cell(code, store_history=False)
        err = result.error_before_exec or result.error_in_exec
        assert err is None, f"{page.name}:{line}: {type(err).__name__}: {err}"
        ran += 1
    from jupyter_dist.launch.run import Run

    for name, value in list(ip.user_ns.items()):  # every run a block started has ended well
        if isinstance(value, Run):
            assert value.wait(300) == "succeeded", f"{page.name}: run {name}: {value.summary()}"
    pool = getattr(ip.magics_manager.registry.get("PoolMagics"), "pool", None)
    assert pool is None or not getattr(pool, "alive", False)
    assert ran >= 1


@pytest.mark.parametrize("line, want", [
    ("--nproc 2   # fresh ranks", ["--nproc", "2"]), ("--name run#1", ["--name", "run#1"]),
    ('--env "A= #x" # note', ["--env", "A= #x"]), ("# only a comment", []),
])  # fmt: skip
def test_a_trailing_comment_on_a_magic_line_is_dropped_as_in_a_shell(line: str, want: list[str]) -> None:
    import shlex

    from jupyter_dist.magics.args import strip_comment

    assert shlex.split(strip_comment(line)) == want
