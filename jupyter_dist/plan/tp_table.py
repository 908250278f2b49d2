"""A measured module's derived tensor-parallel layout as plan data: :class:`TpLayoutTable` (stdlib only).

The worker derives the layout (``worker/_tp_layout.py``, ``jd.suggest_tp_plan``); ``plan/_module.py`` asks it for the
candidate a plan shows and keeps its rows here as strings, so a :class:`~jupyter_dist.plan.plan.Plan` displays and
round-trips it without torch.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

__all__ = ["TpLayoutTable"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TpLayoutTable:
    """The tensor-parallel layout ``jd.wrap`` derives for a measured module (``jd.suggest_tp_plan``), as text.

    ``rows`` are (module pattern, style, why); ``reason`` is the one line saying why none could be derived.
    """

    model: str
    """The module's class name."""
    tp: int
    """The degree it was derived for."""
    sp: bool
    """With sequence parallelism."""
    rows: tuple[tuple[str, str, str], ...] = ()
    notes: tuple[str, ...] = ()
    reason: str | None = None

    def title(self, candidate: str) -> str:
        """The line above the table."""
        if self.reason is not None:
            return f"Tensor-parallel layout for {candidate}: none derived ({self.reason}); jd.wrap needs tp_plan=..."
        return (f"Tensor-parallel layout for {candidate}, derived from {self.model}'s structure "
                "(jd.suggest_tp_plan; jd.wrap uses it when you pass no tp_plan):")  # fmt: skip

    def to_text(self, candidate: str) -> list[str]:
        """The title, the (module, style, why) table and the notes, one line each."""
        out = [self.title(candidate)]
        if self.reason is None and self.rows:
            rows = [("module", "style", "why"), *self.rows]
            w0, w1 = (max(len(r[i]) for r in rows) for i in (0, 1))
            out += [f"  {a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
        return out + [f"  note: {n}" for n in self.notes]

    def to_html(self, candidate: str) -> str:
        """The title and the table as HTML."""
        e = html.escape
        if self.reason is not None or not self.rows:
            return f"<p>{e(self.title(candidate))}</p>"
        cells = "".join(f"<tr><td><code>{e(a)}</code></td><td><code>{e(b)}</code></td><td>{e(c)}</td></tr>"
                        for a, b, c in self.rows)  # fmt: skip
        notes = "".join(f"<li>{e(n)}</li>" for n in self.notes)
        return (f"<p>{e(self.title(candidate))}</p><table><thead><tr><th>module</th><th>style</th><th>why</th>"
                f"</tr></thead><tbody>{cells}</tbody></table>" + (f"<ul>{notes}</ul>" if notes else ""))  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {"model": self.model, "tp": self.tp, "sp": self.sp, "rows": [list(r) for r in self.rows],
                "notes": list(self.notes), "reason": self.reason}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TpLayoutTable:
        """Inverse of :meth:`to_dict`."""
        rows = tuple((str(a), str(b), str(c)) for a, b, c in data.get("rows", ()))
        return cls(model=str(data["model"]), tp=int(data["tp"]), sp=bool(data["sp"]), rows=rows,
                   notes=tuple(data.get("notes", ())), reason=data.get("reason"))  # fmt: skip
