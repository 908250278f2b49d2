"""Rehearse ranks of a plan on this machine, one process each: the real shards and activations of a big job's ranks.

:func:`rehearse` takes a :class:`~jupyter_dist.plan.plan.Plan`, one of its candidates (the recommended one by
default), the model (the reference model of the plan's shape, a ``package.module:factory``, a Hugging Face
``config.json``, or a class or factory from the notebook) and the ranks to rehearse (by default those the planner
finds worst: the first rank of the first and of the last pipeline stage). Each rank runs in a process of its own
(``python -m jupyter_dist.worker._rehearse``) with a fake process group of the plan's world size: the worker's own
``jd.wrap`` and ``jd.train_step`` for that rank's coordinates, only its shards materialised, a few real steps, the
memory and the collectives measured (:mod:`jupyter_dist.worker._rehearse` says how, and what a lone rank stands in
for). The launch contract is the one ``%%dist_train --plan`` hands the workers
(:func:`~.prepare.launch_contract`), for the plan's whole world.

The :class:`Rehearsal` it returns shows, per rank and part, the plan's figure beside the rehearsed one. On a CPU the
step times say nothing about a GPU's: the numbers are for memory. With consent (``Rehearsal.save_calibration()``,
``--save``; never by itself) the rehearsed peak calibrates that candidate's memory in later plans of the same shape
on the same hardware (:attr:`~jupyter_dist.plan.calibration.Calibration.memory_by_candidate`); a rehearsal on
another device than the plan's (a CPU rehearsal of an H100 plan) is refused in one line.
"""

from __future__ import annotations

import html
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import JupyterDistError

__all__ = ["RankRehearsal", "Rehearsal", "default_ranks", "model_source", "rehearse"]

COMM_KINDS = {"pp": "pipeline", "tp": "tensor_parallel", "cp": "context_parallel", "ep": "expert_parallel"}
"""A collective's mesh dimension -> the planner's ``comm_bytes`` kind (every other dimension: ``data_parallel``)."""

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "NODE_RANK")  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class RankRehearsal:
    """What one rank held and did in its rehearsal (bytes, seconds), or why it could not run."""

    rank: int
    """Global rank in the plan's world."""
    coordinates: dict[str, int] = field(default_factory=dict)
    """This rank's index along each mesh dimension (``{"pp": 1, "dp_shard": 0, "tp": 1}``)."""
    params: int = 0
    """Parameter bytes the rank holds (a DTensor's local shard)."""
    grads: int = 0
    """Gradient bytes right before the optimizer step drops them."""
    optimizer: int = 0
    """Optimizer-state bytes (DeepSpeed's fp32 master partition included)."""
    peak: int = 0
    """Tracked allocations at the measured step's peak (PyTorch's ``MemTracker``)."""
    activation_peak: int = 0
    """Activations and temporaries at their own peak during the step."""
    parts: dict[str, int] = field(default_factory=dict)
    """MemTracker's categories at the peak (``Parameter``, ``Gradient``, ``Optstate``, ``Activation``, ``Temp``...)."""
    cuda_peak: int | None = None
    """On a GPU: the CUDA allocator's peak during the step (``max_memory_allocated``)."""
    step_time_s: float = 0.0
    """Wall time of a step on this machine's device, without communication (the fake group's cost nothing)."""
    collectives: tuple[dict[str, Any], ...] = ()
    """Each collective of the measured step: ``{op, dims, count, bytes, wire_bytes}``."""
    mesh: str = ""
    """The mesh the worker built (``"pp=2 x dp_shard=2 x tp=2"``)."""
    device: str = "cpu"
    """Where it ran."""
    error: str = ""
    """Why it failed, one line (``""`` when it ran)."""
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """The worker's whole result."""

    @property
    def ok(self) -> bool:
        """Whether the rank was rehearsed."""
        return not self.error

    @property
    def model_states(self) -> int:
        """Parameters + gradients + optimizer states."""
        return self.params + self.grads + self.optimizer

    @property
    def measured_peak(self) -> int:
        """The figure to set against a plan: the CUDA allocator's on a GPU, the tracked allocations elsewhere."""
        return self.cuda_peak if self.cuda_peak is not None else self.peak

    def comm_bytes(self) -> dict[str, int]:
        """Bytes a ring sends per rank for one step, by the planner's kinds (``data_parallel``, ``pipeline``...)."""
        out: dict[str, int] = {}
        for c in self.collectives:
            dims = str(c.get("dims", ""))
            kind = next((v for k, v in COMM_KINDS.items() if dims == k), "data_parallel")
            if dims in ("self", "other") or dims.startswith("group of"):
                kind = "other"
            out[kind] = out.get(kind, 0) + int(c.get("wire_bytes", 0))
        return out

    @classmethod
    def from_result(cls, rank: int, data: Mapping[str, Any]) -> RankRehearsal:
        """From the worker's JSON result."""
        if data.get("error"):
            return cls(rank=rank, error=str(data["error"]), raw=dict(data))
        return cls(
            rank=rank, coordinates=dict(data.get("coordinates", {})), params=int(data["params"]),
            grads=int(data["grads"]), optimizer=int(data["optimizer"]), peak=int(data["peak"]),
            activation_peak=int(data.get("activation_peak", 0)), parts=dict(data.get("parts", {})),
            cuda_peak=data.get("cuda_peak"), step_time_s=float(data.get("step_time_s", 0.0)),
            collectives=tuple(data.get("collectives", ())), mesh=str(data.get("mesh", "")),
            device=str(data.get("device", "cpu")), raw=dict(data),
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class Rehearsal:
    """Ranks of one plan candidate rehearsed on this machine, beside the plan's figures; displays itself."""

    candidate: str
    """The candidate rehearsed (``"fsdp2+tp8"``)."""
    world_size: int
    """Ranks in the plan's job."""
    ranks: tuple[RankRehearsal, ...]
    """Each rehearsed rank, in the order asked."""
    plan: Any = None
    """The plan (``None`` for a rehearsal of a launch contract alone)."""
    notes: tuple[str, ...] = ()
    """What the reader should know: the device, what was stood in for, ranks added."""
    calibration_path: str = field(default="", compare=False)
    """Where :meth:`save_calibration` saved the calibration (``""``: not saved)."""

    @property
    def predicted(self) -> Any:
        """The plan's :class:`~jupyter_dist.plan.plan.Candidate` for :attr:`candidate` (``None`` without a plan)."""
        if self.plan is None:
            return None
        try:
            return self.plan.candidate(self.candidate)
        except KeyError:
            return None

    @property
    def ok(self) -> bool:
        """Whether every rank ran."""
        return all(r.ok for r in self.ranks)

    def rank(self, rank: int) -> RankRehearsal:
        """The rehearsal of ``rank``."""
        for r in self.ranks:
            if r.rank == rank:
                return r
        raise KeyError(f"rank {rank} was not rehearsed; rehearsed: {', '.join(str(r.rank) for r in self.ranks)}")

    # ---- calibration (launch/measure.py) -------------------------------------------------------------------
    def calibration_problem(self) -> str | None:
        """Why this rehearsal cannot calibrate its plan, one line; ``None`` when it can."""
        from .measure import rehearsal_problem

        return rehearsal_problem(self.plan, self.predicted, self.ranks)

    def memory_correction(self) -> int:
        """The worst rehearsed rank's step peak minus the plan's (without the calibration it carried), bytes."""
        from .measure import rehearsal_correction

        return rehearsal_correction(self.predicted, self.ranks)

    def calibration(self) -> Any:
        """The plan hardware's calibration with this candidate's memory as rehearsed (not saved).

        A tune's fit and other candidates' entries are kept; refused in one line (``PlanInputError``) where
        :meth:`calibration_problem` says why.
        """
        from .measure import rehearsal_calibration

        return rehearsal_calibration(self.plan, self.candidate, self.predicted, self.ranks)

    def save_calibration(self) -> str:
        """Save :meth:`calibration` for the plan's hardware; returns the file (later plans of this shape use it)."""
        path = str(self.calibration().save())
        object.__setattr__(self, "calibration_path", path)  # frozen: the one field saving fills in
        return path

    def table(self) -> tuple[list[str], list[list[str]]]:
        """Header and rows (MiB, seconds): each part, the plan's figure, each rank's."""
        mib = 2**20
        cand = self.predicted
        ok = [r for r in self.ranks if r.ok]
        header = ["", "plan (worst rank)"] + [f"rank {r.rank}" for r in ok]

        def fmt(v: float | None, spec: str = ",.2f") -> str:
            return "-" if v is None else format(v, spec)

        mem = cand.memory if cand is not None else None
        planned = None
        if mem is not None:  # the plan's peak as an allocator counts it: no CUDA context, no allocator reserve
            from .measure import planned_peak

            planned = planned_peak(mem, "cuda")
        rows: list[list[str]] = []
        for label, plan_v, get in (
            ("parameters (MiB)", mem and mem.params, lambda r: r.params),
            ("gradients (MiB)", mem and mem.grads, lambda r: r.grads),
            ("optimizer states (MiB)", mem and mem.optimizer, lambda r: r.optimizer),
            ("activations at the peak (MiB)", mem and mem.activations, lambda r: r.parts.get("Activation", 0)),
            ("rest of the peak: gathered, unsharded, temporary (MiB)",
             planned - mem.model_states - mem.activations if mem is not None and planned is not None else None,
             lambda r: r.peak - r.model_states - r.parts.get("Activation", 0)),
        ):  # fmt: skip
            rows.append([label, fmt(plan_v / mib if plan_v is not None else None)] + [fmt(get(r) / mib) for r in ok])
        rows.append(["step peak (MiB)", fmt(planned / mib if planned is not None else None)]
                    + [fmt(r.measured_peak / mib) for r in ok])  # fmt: skip
        if planned:
            rows.append(["  rehearsed / planned", ""] + [fmt(r.measured_peak / planned, ".2f") for r in ok])
        step = None
        if cand is not None:  # the plan's step less its exposed communication (the fake group's costs nothing)
            from .measure import COMM_PARTS

            step = cand.time.step_time_s - sum(cand.time.breakdown.get(k, 0.0) for k in COMM_PARTS)
        rows.append(["step time, no communication (s)", fmt(step, ".4g")] + [fmt(r.step_time_s, ".4g") for r in ok])
        planned_comm = dict(cand.time.comm_bytes) if cand is not None else {}
        kinds = sorted(set(planned_comm) | {k for r in ok for k in r.comm_bytes()})
        for kind in kinds:
            p = planned_comm.get(kind)
            rows.append([f"{kind.replace('_', ' ')} sent per step (MiB)", fmt(p / mib if p is not None else None)]
                        + [fmt(r.comm_bytes().get(kind, 0) / mib) for r in ok])  # fmt: skip
        rows.append(["coordinates", ""] + [" ".join(f"{k}{v}" for k, v in r.coordinates.items()) for r in ok])
        return header, rows

    def to_text(self) -> str:
        """Plain text: the table, failed ranks, notes."""
        header, rows = self.table()
        widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
        lines = [f"Rehearsal of {self.candidate} ({self.world_size} ranks)"]
        for row in [header, *rows]:  # the first column to the left, the figures to the right
            cells = zip(row, widths, strict=True)
            lines.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(cells)))
        for r in self.ranks:
            if not r.ok:
                lines.append(f"rank {r.rank}: could not be rehearsed: {r.error}")
        lines += [f"- {n}" for n in self.notes]
        lines += [f"- {n}" for n in self._calibration_lines()]
        return "\n".join(lines)

    def _calibration_lines(self) -> list[str]:
        """Where the calibration went, or how to save it (nothing where this rehearsal cannot calibrate)."""
        if self.calibration_path:
            return [f"calibration saved to {self.calibration_path}: later plans of this shape on this hardware plan "
                    f"{self.candidate}'s peak as rehearsed"]  # fmt: skip
        if self.calibration_problem() is None:
            return [f"not saved as a calibration: --save, or .save_calibration(), makes later plans of this shape "
                    f"plan {self.candidate}'s peak as rehearsed"]  # fmt: skip
        return []

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        header, rows = self.table()
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for row in rows)
        extra = "".join(f"<li>rank {r.rank}: could not be rehearsed: {html.escape(r.error)}</li>"
                        for r in self.ranks if not r.ok)  # fmt: skip
        extra += "".join(f"<li>{html.escape(n)}</li>" for n in (*self.notes, *self._calibration_lines()))
        text = (f"<b>Rehearsal of {html.escape(self.candidate)} ({self.world_size} ranks)</b>"
                f"<table><tr>{head}</tr>{body}</table><ul>{extra}</ul>")  # fmt: skip
        return {"text/plain": self.to_text(), "text/html": text}

    def __repr__(self) -> str:
        return f"Rehearsal({self.candidate!r}, ranks={[r.rank for r in self.ranks]})"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the candidate, world size, notes and each rank's whole result."""
        return {"candidate": self.candidate, "world_size": self.world_size, "notes": list(self.notes),
                "ranks": [{"rank": r.rank, **r.raw} for r in self.ranks],
                "calibration_path": self.calibration_path or None}  # fmt: skip


# ------------------------------------------------------------------------------------------------------- the model
def model_source(model: Any, plan: Any = None, *, workdir: Path | None = None) -> dict[str, Any]:
    """What the rehearsal process builds: a spec's ``model`` (:func:`jupyter_dist.worker._rehearse.build_model`).

    ``None``: the reference model of the plan's shape (refused, in one line, where the plan's model is not one the
    reference model reproduces); ``"package.module:factory"``; a Hugging Face ``config.json`` (its path, its folder,
    or the dict); a class or factory (importable ones by name, a notebook's pickled with cloudpickle into
    ``workdir``).
    """
    if model is None:
        if plan is None:
            raise JupyterDistError("rehearse: give the model (model=..., --module, a Hugging Face config) or a plan")
        return _reference(plan.model)
    if isinstance(model, Mapping):
        data = dict(model)
        if "model_type" not in data:
            raise JupyterDistError("rehearse: a model given as a dict must be a Hugging Face config (with model_type)")
        return {"kind": "hf", "config": data}
    if isinstance(model, (str, os.PathLike)):
        text = os.fspath(model)
        path = Path(text).expanduser()
        if path.is_dir() and (path / "config.json").is_file():
            path = path / "config.json"
        if path.is_file():
            from ..plan.model import read_hf_config

            data = read_hf_config(str(path))
            if not isinstance(data, dict) or "model_type" not in data:
                raise JupyterDistError(f"rehearse: {path} is not a Hugging Face config.json (no model_type)")
            return {"kind": "hf", "config": data}
        if ":" in text and os.sep not in text.split(":", 1)[0]:
            return {"kind": "import", "target": text, "path": os.getcwd()}
        raise JupyterDistError(f"rehearse: model {text!r} is neither 'package.module:factory' nor a config.json")
    if callable(model):
        module = getattr(model, "__module__", None)
        qual = getattr(model, "__qualname__", "")
        if module and module != "__main__" and "<" not in qual:
            return {"kind": "import", "target": f"{module}:{qual}", "path": os.getcwd()}
        try:
            import cloudpickle
        except ImportError:
            raise JupyterDistError(
                f"rehearse: {qual or model!r} is defined in the notebook; pickling it needs cloudpickle "
                "(pip install cloudpickle), or give it as 'package.module:factory'"
            ) from None
        where = Path(workdir or tempfile.mkdtemp(prefix="jd-rehearse-")) / "model.pkl"
        where.write_bytes(cloudpickle.dumps(model))
        return {"kind": "pickle", "file": str(where)}
    raise JupyterDistError(f"rehearse: model must be a class, a factory, 'package.module:factory', a config.json or "
                           f"None (the plan's reference model), got {type(model).__name__}")  # fmt: skip


def _reference(spec: Any) -> dict[str, Any]:
    """The reference model of a :class:`~jupyter_dist.plan.model.ModelSpec`'s shape, or one line why it is not one."""
    why = []
    if spec.source in ("module", "params") or spec.dims_assumed:
        why.append("it was measured from a module or a bare count (give that module as model=)")
    if spec.norm != "rmsnorm" or not spec.gated_mlp:
        why.append(f"{spec.norm} and {'gated' if spec.gated_mlp else 'plain'} MLP (the reference is RMSNorm + SwiGLU)")
    for name in ("qkv_bias", "out_bias", "mlp_bias", "qk_norm", "tied_embeddings", "dropout"):
        if getattr(spec, name):
            why.append(name.replace("_", " "))
    if spec.max_positions:
        why.append("learned positions")
    if spec.head_dim and spec.head_dim * spec.heads != spec.hidden:
        why.append(f"head_dim {spec.head_dim} x {spec.heads} heads != hidden {spec.hidden}")
    if why:
        raise JupyterDistError(
            f"rehearse: the plan's model {spec.name!r} is not one the reference model reproduces ({'; '.join(why)}); "
            "give the model itself (model=MyModel, --module pkg.mod:Factory) or its Hugging Face config"
        )
    config: dict[str, Any] = {
        "vocab_size": spec.vocab, "dim": spec.hidden, "n_layers": spec.layers, "n_heads": spec.heads,
        "n_kv_heads": spec.kv_heads or None, "ffn_dim": spec.d_ffn,
    }  # fmt: skip
    if spec.experts > 1:
        config.update(n_experts=spec.experts, top_k=spec.top_k)
    return {"kind": "reference", "config": config, "name": spec.name}


# --------------------------------------------------------------------------------------------------------- the ranks
def default_ranks(world_size: int, pp: int) -> list[int]:
    """The ranks the planner finds worst.

    Rank 0 (the first pipeline stage, expert and tp rank 0), and with a pipeline the first rank of the last stage
    (the head and the loss).
    """
    ranks = [0]
    if pp > 1:
        ranks.append((pp - 1) * (world_size // pp))
    return ranks


def _first_stage_twin(rank: int, world_size: int, pp: int) -> int:
    """The rank of the first pipeline stage with the same coordinates as ``rank`` along every other dimension."""
    return rank % (world_size // pp)


def rehearse(
    plan: Any, candidate: str | None = None, *, model: Any = None, ranks: Sequence[int] | None = None,
    steps: int = 3, device: str = "auto", timeout: float | None = 1800, workdir: str | os.PathLike[str] | None = None,
    python: str | None = None, on_rank: Callable[[RankRehearsal], None] | None = None,
) -> Rehearsal:  # fmt: skip
    """Rehearse ``ranks`` of ``plan``'s ``candidate`` on this machine, each in a process of its own.

    Parameters
    ----------
    plan
        A :class:`~jupyter_dist.plan.plan.Plan`: its world, micro-batch, sequence, precision, checkpointing,
        accumulation and optimizer are what runs.
    candidate
        A candidate name the plan printed (``"fsdp2+tp8"``); default the recommended one.
    model
        See :func:`model_source`; default the reference model of the plan's shape.
    ranks
        Global ranks; default :func:`default_ranks`.
    steps
        Optimizer steps per rank (>= 3: one warms up, one is measured, the rest are timed).
    device
        ``"auto"`` (this machine's GPU when there is one, else the CPU), ``"cuda"`` or ``"cpu"``.
    timeout
        Seconds one rank may take.
    workdir
        Where the specs, results and logs go (a temporary folder by default).
    python
        The interpreter of the rank processes (default this one).
    on_rank
        Called with each rank's result as it arrives.

    Nothing is saved: ``result.save_calibration()`` (``--save``) makes later plans use the rehearsed peak.
    """
    if plan is None or not hasattr(plan, "candidates"):
        raise JupyterDistError(f"rehearse: give a Plan (from %dist_plan or jupyter_dist.plan.plan), got {plan!r}")
    if candidate is None:
        if plan.recommended is None:
            raise JupyterDistError(
                "rehearse: the plan recommends nothing (no candidate fits); name one to rehearse: "
                + ", ".join(c.name for c in plan.candidates[:8])
            )
        candidate = plan.recommended
    if candidate not in {c.name for c in plan.candidates}:
        raise JupyterDistError(f"rehearse: the plan has no candidate {candidate!r}; it has "
                               + ", ".join(c.name for c in plan.candidates[:12]))  # fmt: skip
    if steps < 3:
        raise JupyterDistError(f"rehearse: steps={steps}; at least 3 (one warms up, one is measured, one is timed)")
    from .prepare import launch_contract

    hw = plan.hardware
    choice, contract = launch_contract(candidate, plan, nproc=hw.gpus_per_node, nodes=hw.nodes)
    world = contract.world_size
    problem = _refusal(contract, plan)
    if problem:
        raise JupyterDistError(f"rehearse: {candidate} cannot be rehearsed: {problem}")
    asked = list(ranks) if ranks is not None else default_ranks(world, contract.pp)
    for r in asked:
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < world:
            raise JupyterDistError(f"rehearse: rank {r!r} is not in the plan's world of {world} ranks (0..{world - 1})")
    notes: list[str] = []
    order = list(dict.fromkeys(asked))
    if contract.pp > 1:  # a first-stage rank goes first: the later stages need the boundary it sends
        first = [r for r in order if r < world // contract.pp]
        if not first:
            twin = _first_stage_twin(order[0], world, contract.pp)
            notes.append(f"rank {twin} (the first pipeline stage) was rehearsed too: the later stages take their "
                         "inputs' shapes from what it sends")  # fmt: skip
            first = [twin]
            order = [twin, *order]
        order = first[:1] + [r for r in order if r != first[0]]
    where = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="jd-rehearse-"))
    where.mkdir(parents=True, exist_ok=True)
    source = model_source(model, plan, workdir=where)
    from ..worker._rehearse import ENV_FIELDS

    env_fields = {k: getattr(contract, k) for k in ENV_FIELDS if k != "ds_config"}
    if contract.family == "deepspeed":
        from ..render.common import RenderOptions
        from ..render.deepspeed import render_deepspeed_json

        (where / "ds_config.json").write_text(render_deepspeed_json(plan, RenderOptions(candidate=contract.strategy)))
        env_fields["ds_config"] = str(where / "ds_config.json")
    base = {
        "env": env_fields, "world_size": world, "local_world_size": hw.gpus_per_node, "model": source,
        "micro_batch": plan.training.micro_batch, "seq_len": plan.training.seq_len,
        "optimizer": plan.training.optimizer.value, "steps": steps, "device": device,
    }  # fmt: skip
    boundary = where / "boundary.pkl"
    results: dict[int, RankRehearsal] = {}
    for r in order:
        spec = {**base, "rank": r}
        if contract.pp > 1:
            spec["boundary_out" if r < world // contract.pp else "boundary"] = str(boundary)
        if contract.pp > 1 and r != order[0] and not results[order[0]].ok:
            results[r] = RankRehearsal(rank=r, error=f"its stage takes its inputs' shapes from what the first stage "
                                                     f"sends, and rank {order[0]} could not be rehearsed")  # fmt: skip
        else:
            results[r] = _run_rank(spec, where, timeout=timeout, python=python)
        if on_rank is not None:
            on_rank(results[r])
    ran = next((x for x in results.values() if x.ok), None)
    gpu = plan.hardware.accelerator
    if ran is not None and ran.device == "cpu" and getattr(gpu, "vendor", "cpu") != "cpu":
        notes.append(f"rehearsed on this machine's CPU, not on a {gpu.label}: the bytes hold, the step times do not")
    elif ran is not None and ran.device == "cuda":
        name = str(ran.raw.get("device_name", "this machine's GPU"))
        same = gpu.name.split("-")[0].lower() in name.lower().replace(" ", "")
        notes.append(f"rehearsed on {name}" + (" (the plan's GPU): step times hold no communication" if same else
                     f", not on the plan's {gpu.label}: the bytes hold, the step times are this GPU's"))  # fmt: skip
    notes.append("collectives return at once (a fake process group): their buffers are real, their values are not")
    if contract.ep > 1:
        notes.append("expert ranks receive the tokens of a balanced router (each source routes as this rank does)")
    if choice.note:
        notes.append(choice.note)
    return Rehearsal(candidate=candidate, world_size=world, ranks=tuple(results[r] for r in order), plan=plan,
                     notes=tuple(notes))  # fmt: skip


def _refusal(contract: Any, plan: Any) -> str | None:
    """Why this launch contract cannot be rehearsed here, one line; ``None`` when it can."""
    if plan.training.optimizer.value not in ("adamw", "sgd"):
        return f"the optimizer {plan.training.optimizer.value} needs bitsandbytes' kernels; plan with adamw or sgd"
    if contract.family == "deepspeed":
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            return "DeepSpeed is not installed here (pip install 'jupyter_dist[deepspeed]')"
    if contract.pp > 1:
        try:
            from torch.distributed.pipelining import stage

            stage.PipelineStage._recv_meta  # noqa: B018 - the metadata protocol the stand-in answers
        except (ImportError, AttributeError):
            return "pipeline stages need torch >= 2.13's stage metadata protocol to be rehearsed alone"
    return None


def _run_rank(spec: dict[str, Any], where: Path, *, timeout: float | None, python: str | None) -> RankRehearsal:
    rank = int(spec["rank"])
    spec_path, out_path, log_path = (where / f"rank{rank}.{x}" for x in ("spec.json", "result.json", "log"))
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCH_VARS and not k.startswith(("JD_", "TORCHELASTIC_", "PET_"))}  # fmt: skip
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    argv = [python or sys.executable, "-m", "jupyter_dist.worker._rehearse", str(spec_path), str(out_path)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=where, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            import signal

            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return RankRehearsal(rank=rank, error=f"did not finish within {timeout:.0f} s (log: {log_path})")
        except BaseException:
            import signal

            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    if not out_path.is_file():  # killed before it could write its result
        code = proc.returncode
        if code in (-9, 137):
            why = "killed (SIGKILL; out of memory?)"
        elif code < 0:
            import signal

            why = f"killed by {signal.Signals(-code).name}"
        else:
            lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()
                     and "Warning" not in ln and not ln.startswith(" ")]  # fmt: skip
            why = f"exit {code}: {lines[-1] if lines else 'no output'}"
        return RankRehearsal(rank=rank, error=f"{why} (log: {log_path})")
    data = json.loads(out_path.read_text())
    return RankRehearsal.from_result(rank, data)
