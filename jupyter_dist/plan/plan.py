"""The :class:`Plan` value object and its :class:`Candidate` rows; they display themselves (stdlib only)."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

from .hardware import Hardware
from .memory import Assumptions, MemoryBreakdown
from .model import ModelSpec
from .parallel import ParallelDims
from .perf import StepTime
from .strategies import get_strategy
from .tp_table import TpLayoutTable
from .training import TrainingShape
from .units import GiB, fmt_count, fmt_gib

__all__ = ["Candidate", "Plan", "TpLayoutTable", "REHEARSED_MARK", "SCHEMA_VERSION"]

SCHEMA_VERSION = 1

REHEARSED_MARK = "^"
"""After a candidate's total in the table: its peak is the one a rehearsal measured (a saved calibration)."""
_REHEARSED_NOTE = f"{REHEARSED_MARK} the step peak a rehearsal of this plan measured (%dist_rehearse --save; see below)"


def _row(cells: list[str], widths: list[int]) -> str:
    """One table line: the first column left-aligned, the others right-aligned."""
    return "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(cells, widths, strict=True)))



_CPU_LABELS = {"CUDA context + NCCL": "process runtime (Python, torch, gloo)",
               "caching-allocator reserve": "allocator slack"}
"""What the GPU rows of a memory breakdown stand for in a CPU process (the same bytes, its own words)."""

@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One strategy with its parallel degrees, evaluated: memory, fit and speed."""

    name: str
    """Unique name, the strategy plus model-parallel degrees, e.g. ``"fsdp2+tp4+pp2"``."""
    strategy: str
    """Strategy name (see :data:`~jupyter_dist.plan.strategies.STRATEGIES`)."""
    dims: ParallelDims
    """Parallel degrees."""
    grad_accum: int
    """Micro-batches per optimizer step."""
    memory: MemoryBreakdown
    """Peak per-GPU memory."""
    time: StepTime
    """Estimated step time."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Decisions the compiler renders (bucket sizes, sharding group sizes)."""
    notes: tuple[str, ...] = ()
    """Remarks specific to this candidate."""
    needs: str = ""
    """Why the given module cannot run this candidate (``""`` when it can): such a candidate is never recommended."""

    @property
    def fits(self) -> bool:
        """Whether the peak fits in device memory."""
        return self.memory.fits

    @property
    def label(self) -> str:
        """Human label, e.g. ``"DeepSpeed ZeRO-2"`` or ``"FSDP2 fully_shard + tp4+pp2"``."""
        extra = self.dims.label()
        base = get_strategy(self.strategy).label
        return f"{base} + {extra}" if extra else base

    def to_dict(self) -> dict[str, Any]:
        """The CLI's JSON row: strategy, dims, memory (bytes), fits, step_time_s, tokens_per_s, mfu, ..."""
        return {
            "name": self.name, "strategy": self.strategy, "label": self.label, "dims": self.dims.to_dict(),
            "grad_accum": self.grad_accum, "memory": self.memory.to_dict(), "fits": self.fits,
            "step_time_s": self.time.step_time_s, "tokens_per_s": self.time.tokens_per_s, "mfu": self.time.mfu,
            "bound_by": self.time.bound_by, "time": self.time.to_dict(), "settings": dict(self.settings),
            "notes": list(self.notes), "needs": self.needs,
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Candidate:
        """Inverse of :meth:`to_dict`."""
        return cls(
            name=data["name"], strategy=data["strategy"], dims=ParallelDims.from_dict(data["dims"]),
            grad_accum=int(data["grad_accum"]), memory=MemoryBreakdown.from_dict(data["memory"]),
            time=StepTime.from_dict(data["time"]), settings=dict(data.get("settings", {})),
            notes=tuple(data.get("notes", ())), needs=str(data.get("needs", "")),
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """Which strategy, will it fit, how fast, and why: the planner's answer, consumed by every later layer."""

    model: ModelSpec
    """The model planned for."""
    hardware: Hardware
    """The machines."""
    training: TrainingShape
    """The training shape."""
    assumptions: Assumptions
    """Calibration of the model."""
    candidates: tuple[Candidate, ...]
    """Every evaluated candidate, best first among those that fit."""
    recommended: str | None
    """Name of the recommended candidate, or ``None`` when nothing fits."""
    reasons: tuple[str, ...] = ()
    """The decision, one sentence each, with its numbers."""
    warnings: tuple[str, ...] = ()
    """Anti-patterns and risks found in the inputs."""
    requested_strategy: str | None = None
    """The strategy the user asked to evaluate alone, if any."""
    tp_layout: TpLayoutTable | None = None
    """For a measured module, the derived tensor-parallel layout of :attr:`tp_layout_for` (the recommended
    candidate, else the requested strategy's first) when its tp > 1."""
    tp_layout_for: str | None = None
    """The candidate :attr:`tp_layout` is for."""

    # ---- access ---------------------------------------------------------------------------------------------
    @property
    def best(self) -> Candidate | None:
        """The recommended candidate."""
        return self.candidate(self.recommended) if self.recommended else None

    def candidate(self, name: str) -> Candidate:
        """The candidate called ``name`` (e.g. ``"zero3"``, ``"fsdp2+tp2"``)."""
        for c in self.candidates:
            if c.name == name:
                return c
        raise KeyError(f"no candidate {name!r}; have: {', '.join(c.name for c in self.candidates)}")

    @property
    def world_size(self) -> int:
        """GPUs in the job."""
        return self.hardware.world_size

    # ---- serialisation --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; memory in bytes. ``Plan.from_dict(p.to_dict()) == p``."""
        return {
            "schema": SCHEMA_VERSION,
            "model": self.model.to_dict(),
            "hardware": self.hardware.to_dict(),
            "training": self.training.to_dict(),
            "assumptions": self.assumptions.to_dict(),
            "candidates": [c.to_dict() for c in self.candidates],
            "recommended": self.recommended,
            "reasons": list(self.reasons),
            "warnings": list(self.warnings),
            "requested_strategy": self.requested_strategy,
            "tp_layout": self.tp_layout.to_dict() if self.tp_layout is not None else None,
            "tp_layout_for": self.tp_layout_for,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Rebuild a plan saved with :meth:`to_dict` (e.g. from a run's ``run.json``) without re-planning."""
        if data.get("schema", SCHEMA_VERSION) > SCHEMA_VERSION:
            from ..errors import PlanInputError

            raise PlanInputError(
                f"plan schema {data['schema']} is newer than this jupyter-dist understands ({SCHEMA_VERSION}); "
                "upgrade jupyter-dist"
            )
        return cls(
            model=ModelSpec.from_dict(data["model"]),
            hardware=Hardware.from_dict(data["hardware"]),
            training=TrainingShape.from_dict(data["training"]),
            assumptions=Assumptions(**data["assumptions"]),
            candidates=tuple(Candidate.from_dict(c) for c in data["candidates"]),
            recommended=data.get("recommended"),
            reasons=tuple(data.get("reasons", ())),
            warnings=tuple(data.get("warnings", ())),
            requested_strategy=data.get("requested_strategy"),
            tp_layout=TpLayoutTable.from_dict(data["tp_layout"]) if data.get("tp_layout") else None,
            tp_layout_for=data.get("tp_layout_for"),
        )

    # ---- display --------------------------------------------------------------------------------------------
    def _header(self) -> str:
        hw = self.hardware
        t = self.training
        attention = ("attention: PyTorch SDPA on CPU" if hw.unit == "process"
                     else f"flash-attention {'on' if t.flash_attention else 'off'}")  # fmt: skip
        compiled, fused = t.speed_options(hw.accelerator.vendor)  # what the step time assumes (perf.py)
        attention += f", blocks {'compiled' if compiled else 'eager'}, {'fused' if fused else 'foreach'} optimizer"
        return (
            f"{self.model.name}: {fmt_count(self.model.params)} params ({self.model.params:,}) on "
            f"{hw.nodes} x {hw.gpus_per_node} {hw.accelerator.label} ({fmt_gib(hw.accelerator.memory_bytes)} each); "
            f"micro-batch {t.micro_batch}, seq {t.seq_len}, {t.precision.value}, {t.optimizer.value}, "
            f"checkpointing {t.checkpointing_name}, {attention}"
        )

    def table_rows(self, limit: int | None = None) -> list[list[str]]:
        """Rows of the candidate table (memory in GiB), recommended first."""
        rows = []
        for c in self.candidates[: limit or len(self.candidates)]:
            mem = c.memory
            rows.append([
                ("* " if c.name == self.recommended else "  ") + c.name,
                f"{mem.params / GiB:.1f}", f"{mem.grads / GiB:.1f}", f"{mem.optimizer / GiB:.1f}",
                f"{mem.activations / GiB:.1f}", f"{mem.overhead / GiB:.1f}",
                f"{mem.total / GiB:.1f}" + (REHEARSED_MARK if "rehearsal_correction" in mem.detail else ""),
                self._fit_word(c), f"{c.time.step_time_s:.3g}", f"{c.time.tokens_per_s:,.0f}",
                f"{100 * c.time.mfu:.0f}%",
            ])  # fmt: skip
        return rows

    def _fit_word(self, c: Candidate) -> str:
        if not c.fits:
            return "NO"
        return "yes" if c.memory.headroom >= self.assumptions.min_headroom else "tight"

    _COLUMNS = ["candidate", "params", "grads", "optim", "activ", "overhead", "total", "fits", "step s", "tok/s",
                "MFU"]  # fmt: skip

    def to_text(self, limit: int | None = 12) -> str:
        """Plain-text report: header, per-GPU memory table (GiB), recommendation, reasons, warnings."""
        rows = self.table_rows(limit)
        widths = [max(len(r[i]) for r in [self._COLUMNS, *rows]) for i in range(len(self._COLUMNS))]
        line = _row(self._COLUMNS, widths)
        out = [
            self._header(),
            "",
            f"Per-{self.hardware.unit} memory in GiB (1 GiB = 2^30 bytes); fits: yes, tight (under "
            f"{100 * self.assumptions.min_headroom:.0f}% headroom) or NO:",
            line,
            "-" * len(line),
        ]
        for r in rows:
            out.append(_row(r, widths))
        if limit and len(self.candidates) > limit:
            out.append(f"... {len(self.candidates) - limit} more candidates (all of them with --json / to_dict())")
        if any(r[6].endswith(REHEARSED_MARK) for r in rows):
            out.append(_REHEARSED_NOTE)
        out.append("")
        best = self.best
        out.append(f"Recommended: {best.label} ({best.name})" if best else "Recommended: nothing fits")
        out += [f"  - {r}" for r in self.reasons]
        if best is not None:
            out.append(f"Per-{self.hardware.unit} peak of {best.name}, GiB:")
            cpu = self.hardware.unit == "process"
            out += [f"  {_CPU_LABELS.get(label, label) if cpu else label:<45} {value / GiB:8.2f}"
                    for label, value in best.memory.rows()]  # fmt: skip
        if self.tp_layout is not None:
            out += self.tp_layout.to_text(self.tp_layout_for or "")
        if self.warnings:
            out.append("Warnings:")
            out += [f"  ! {w}" for w in self.warnings]
        return "\n".join(out)

    def to_html(self, limit: int | None = 12) -> str:
        """HTML report for notebooks."""
        e = html.escape
        head = "".join(f"<th>{e(c)}</th>" for c in self._COLUMNS)
        body = []
        for r in self.table_rows(limit):
            style = ' style="font-weight:bold;background:#e8f5e9"' if r[0].startswith("*") else ""
            cells = "".join(
                f'<td style="text-align:{"left" if i == 0 else "right"}">{e(v.lstrip("* ").strip())}</td>'
                for i, v in enumerate(r)
            )
            body.append(f"<tr{style}>{cells}</tr>")
        best = self.best
        rec = f"<b>Recommended: {e(best.label)}</b> (<code>{e(best.name)}</code>)" if best else "<b>Nothing fits</b>"
        marked = any(r[6].endswith(REHEARSED_MARK) for r in self.table_rows(limit))
        note = f"<p><small>{e(_REHEARSED_NOTE)}</small></p>" if marked else ""
        reasons = "".join(f"<li>{e(r)}</li>" for r in self.reasons)
        warns = "".join(f'<li style="color:#b26a00">{e(w)}</li>' for w in self.warnings)
        return (
            f'<div class="jupyter-dist-plan"><p>{e(self._header())}</p>'
            f"<p>Per-{self.hardware.unit} memory in GiB</p><table><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>{note}"
            f"<p>{rec}</p><ul>{reasons}</ul>"
            + (self.tp_layout.to_html(self.tp_layout_for or "") if self.tp_layout is not None else "")
            + (f"<p>Warnings</p><ul>{warns}</ul>" if warns else "") + "</div>"
        )

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": self.to_text(), "text/html": self.to_html()}

    def __repr__(self) -> str:
        return (
            f"Plan(model={self.model.name!r}, world_size={self.world_size}, recommended={self.recommended!r}, "
            f"candidates={len(self.candidates)})"
        )
