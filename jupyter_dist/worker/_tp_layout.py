"""A tensor-parallel layout derived from a model's own structure (``jd.suggest_tp_plan``), in the user's names.

One forward on the meta device (``torch.func.functional_call`` with meta copies of the parameters, so nothing is
allocated) records which ``nn.Linear`` and ``nn.Embedding`` run, in which order, on which tensors, and the shapes
``scaled_dot_product_attention`` sees. In the first of the repeated blocks, Linears that read the same tensor form a
column-wise group (q, k, v; gate, up; a fused qkv; an MLP ``fc``) and the next Linear that reads something else
closes it row-wise (the Megatron-LM pairing, Shoeybi et al. 2019); the block's pattern (``blocks.*.attn.qkv``)
names every block. A lone column-wise Linear whose output is ``k`` times the row-wise input (3: a fused qkv, 2: a
fused gate-up) is split per part: its weight becomes a DTensor with ``_StridedShard(0, split_factor=k)`` -- rank
``r`` holds the ``r``-th slice of each of q, k and v, heads whole -- the placement FSDP2 uses for its own
right-to-left sharding, so ``full_tensor()``, state dicts and DCP checkpoints see the weight in its usual order (its
bias stays whole on every tp rank, which FSDP2 can shard in an order it can name).

Whether the branch's own code (``view``, ``split``, ``reshape``) runs on the local heads is asked of a second meta
forward of the branch module with each column-wise output narrowed to ``1/tp`` of its width: code that infers the
head count (``view(b, s, -1, head_dim)``) passes and gets PyTorch's plain styles (local tensors); code that uses the
whole width (nanoGPT's ``split(self.n_embd)``, ``view(B, T, C)``) gets DTensors with global shapes instead, with the
two operations DTensor cannot keep sharded -- the split of a fused output into its parts, and the attention kernel
-- done on the local heads (:class:`HeadLocalOps`). Embeddings, a positional embedding, the head and (with
sequence parallelism) the norms and the branch boundaries follow torchtitan's ``parallelize_llama``.

One piece: the styles it proposes and the derivation that chooses them are read together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._env import WorkerError

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["TpLayout", "suggest_tp_plan", "describe_style", "fused_placement_fn"]

_HEAD_ATTRS = ("n_heads", "n_head", "num_heads", "num_attention_heads", "nheads")
_KV_ATTRS = ("n_kv_heads", "num_key_value_heads", "n_kv_head", "num_kv_heads")


# ------------------------------------------------------------------------------------------------------- styles
def _fused_colwise(parts: int, *, use_local_output: bool, input_layouts: Any = None) -> Any:
    from torch import nn
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.placement_types import _StridedShard

    class FusedColwiseParallel(ColwiseParallel):
        """``ColwiseParallel`` of a Linear whose output packs ``parts`` equal projections (q, k, v; gate, up)."""

        def __init__(self) -> None:
            super().__init__(input_layouts=input_layouts or Replicate(), use_local_output=use_local_output)
            self.parts = parts

        def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
            # the bias stays whole on every tp rank (DTensor slices it to the output's strided columns, and its
            # gradient is gathered back): a 1-D _StridedShard has no dimension left for FSDP2 to shard in an
            # expressible order (FSDP2's contiguous chunk of [q_r, k_r, v_r] is no stride of the whole)
            for pname, param in list(module.named_parameters(recurse=False)):
                placement = _StridedShard(0, split_factor=self.parts) if param.ndim > 1 else Replicate()
                dt = distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank)
                module.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))

        @staticmethod
        def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: Any, outputs: Any,
                               device_mesh: Any) -> Any:  # fmt: skip
            return outputs.to_local() if use_local_output else outputs  # each rank: its part of every projection

        def __repr__(self) -> str:
            return f"FusedColwiseParallel(parts={self.parts}, use_local_output={self.use_local_output})"

    return FusedColwiseParallel()


class HeadLocalOps:
    """Factory of a ``ParallelStyle`` running a branch module's forward under :func:`_head_local_mode`.

    With it, a module written for whole widths takes DTensors (global shapes, heads sharded) through its views and
    transposes; splitting a fused ``_StridedShard`` output into its parts and ``scaled_dot_product_attention`` run on
    each rank's local heads. ``inner`` (a ``PrepareModuleInput`` under sequence parallelism) is applied first.
    """

    @staticmethod
    def make(inner: Any = None) -> Any:
        from torch.distributed.tensor.parallel.style import ParallelStyle

        class HeadLocal(ParallelStyle):
            def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
                if inner is not None:
                    module = inner._apply(module, device_mesh)
                forward = module.forward

                def local_forward(*args: Any, **kwargs: Any) -> Any:
                    try:
                        with _head_local_mode():
                            return forward(*args, **kwargs)
                    except Exception as exc:
                        if type(exc).__name__ == "OutOfMemoryError":  # not the DTensor path's doing
                            raise
                        raise WorkerError(_dtensor_failure(module, exc)) from exc

                module.forward = local_forward  # type: ignore[method-assign]
                return module

            def __repr__(self) -> str:
                return "HeadLocalOps()" + (f" + {describe_style(inner)}" if inner is not None else "")

        return HeadLocal()


def _dtensor_failure(module: Any, exc: BaseException) -> str:
    """The one line raised when a branch module's forward fails on DTensors (``HeadLocalOps``).

    What ran how, the error's first line, and the two ways out.
    """
    kind = type(module).__name__
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return (
        f"jd.wrap's derived tp layout runs {kind}'s forward on DTensors (its code uses whole widths, e.g. "
        f"split(n_embd) or view(B, T, n_head, ...)) and it failed there ({type(exc).__name__}: {first}); "
        "write its splits and views with the local sizes (chunk(3, dim=-1), view(B, T, -1, head_dim), "
        "reshape(B, T, -1)) so it runs on plain local tensors, or pass jd.wrap(model, opt, tp_plan=...)"
    )


def _head_local_mode() -> Any:
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_flatten, tree_unflatten

    def replicated(args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        """Plain tensors meeting a DTensor, as replicated DTensors; ``None`` where the call mixes none.

        A causal-mask buffer, rotary tables, a mask built in the forward: the same tensor on every rank, so a
        replicated DTensor (and saved as one for the backward).
        """
        leaves, spec = tree_flatten((args, kwargs))
        mesh = next((x.device_mesh for x in leaves if isinstance(x, DTensor)), None)
        if mesh is None or not any(type(x) is not DTensor and isinstance(x, torch.Tensor) and x.numel() > 1
                                   for x in leaves):  # fmt: skip
            return None
        rep = [Replicate()] * mesh.ndim
        leaves = [DTensor.from_local(x, mesh, rep, run_check=False)
                  if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.numel() > 1 else x
                  for x in leaves]  # fmt: skip
        return tree_unflatten(leaves, spec)  # type: ignore[no-any-return]

    splits = (torch.Tensor.split, torch.split, torch.Tensor.chunk, torch.chunk)

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention and isinstance(args[0], DTensor):
                q = args[0]
                local = [a.to_local() if isinstance(a, DTensor) else a for a in args]
                kw = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in kwargs.items()}
                out = func(*local, **kw)
                return DTensor.from_local(out, q.device_mesh, q.placements, run_check=False)
            if func in splits and args and isinstance(args[0], DTensor):
                t = args[0]
                p = t.placements[0] if len(t.placements) == 1 else None
                dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
                if isinstance(p, _StridedShard) and dim % t.ndim == p.dim % t.ndim:
                    n = int(p.split_factor)
                    want = args[1] if len(args) > 1 else kwargs.get("split_size_or_sections", kwargs.get("chunks"))
                    whole = t.shape[dim] // n
                    if want in (n, whole) and (func in splits[2:]) == (want == n):
                        pieces = t.to_local().chunk(n, dim=dim)
                        return tuple(DTensor.from_local(x, t.device_mesh, (Shard(dim % t.ndim),), run_check=False)
                                     for x in pieces)  # fmt: skip
            mixed = replicated(args, kwargs)
            if mixed is not None:
                args, kwargs = mixed
            return func(*args, **kwargs)

    return Mode()


def fused_placement_fn(dp_size: int) -> Any:
    """``shard_placement_fn`` for ``fully_shard``: a fused projection's weight sharded by its input features.

    FSDP2 shards a tensor-parallel weight's dim 0 right-to-left with its own ``_StridedShard``; on top of the
    fused layout's ``_StridedShard`` that order is not expressible, so the fused weights are sharded on dim 1
    (a fused bias is whole on the tp ranks, so FSDP2 shards it on dim 0 as any other).
    """
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    def fn(param: Any) -> Any:
        if isinstance(param, DTensor) and any(isinstance(p, _StridedShard) for p in param.placements):
            if param.shape[1] % dp_size:
                raise WorkerError(
                    f"jd.wrap: the fused projection's {param.shape[1]} input features do not split over "
                    f"{dp_size} data-parallel ranks; use a dp degree that divides {param.shape[1]}"
                )
            return Shard(1)
        return None

    return fn


def describe_style(style: Any) -> str:
    """A ``ParallelStyle`` as one comparable line, defaults spelled out (``ColwiseParallel(in=R, out=S(-1))``)."""
    name = type(style).__name__

    def lay(x: Any) -> str:
        if x is None:
            return "-"
        if isinstance(x, (tuple, list)):
            return "(" + ", ".join(lay(v) for v in x) + ")"
        return str(x)

    if hasattr(style, "parts") or name in ("ColwiseParallel", "RowwiseParallel"):
        out = f"{name}(in={lay(style.input_layouts)}, out={lay(style.output_layouts)}"
        return out + f"{'' if style.use_local_output else ', dtensor'})"
    if name == "SequenceParallel":
        return "SequenceParallel()"
    if name == "PrepareModuleInput":
        a, b = getattr(style, "input_layouts", None), getattr(style, "desired_input_layouts", None)
        kw = getattr(style, "input_kwarg_layouts", None) or {}
        dk = getattr(style, "desired_input_kwarg_layouts", None) or {}
        extra = "".join(f", {k}: {lay(v)}->{lay(dk.get(k))}" for k, v in kw.items())
        return f"PrepareModuleInput({lay(a)}->{lay(b)}{extra})"
    if name == "PrepareModuleOutput":
        return f"PrepareModuleOutput({lay(style.output_layouts)}->{lay(style.desired_output_layouts)})"
    return repr(style)


# ------------------------------------------------------------------------------------------------------- result
@dataclass
class TpLayout:
    """A proposed tensor-parallel layout: ``plan`` for ``jd.wrap(tp_plan=...)`` and why each entry is what it is.

    Prints as a table of (module pattern, style, why). ``reason`` is one line saying why no layout could be derived
    (``plan`` is then empty and ``ok`` false).
    """

    model: str
    """The model's class name."""
    tp: int | None
    """The degree the layout was checked against (``None``: structure only)."""
    sequence_parallel: bool
    """Whether the layout splits the residual stream along the sequence."""
    plan: dict[str, Any] = field(default_factory=dict)
    """Module name pattern -> ``ParallelStyle`` (``parallelize_module``'s plan)."""
    why: dict[str, str] = field(default_factory=dict)
    """Module name pattern -> the reason for its style."""
    reason: str | None = None
    """Why no layout was derived (one line), else ``None``."""
    notes: list[str] = field(default_factory=list)
    """What the layout leaves whole, and why (e.g. a tied embedding)."""

    @property
    def ok(self) -> bool:
        """Whether a layout was derived."""
        return self.reason is None

    def rows(self) -> list[tuple[str, str, str]]:
        """(pattern, style, why) per entry."""
        return [(k, describe_style(v), self.why.get(k, "")) for k, v in self.plan.items()]

    def raise_if_unusable(self) -> None:
        """Raise the one-line ``WorkerError`` when no layout was derived."""
        if self.reason is not None:
            raise WorkerError(f"jd.suggest_tp_plan: no layout for {self.reason}; pass jd.wrap(model, opt, tp_plan=...)")

    def __str__(self) -> str:
        head = f"tensor-parallel layout for {self.model}" + (f" (tp={self.tp})" if self.tp else "")
        head += " with sequence parallelism" * self.sequence_parallel
        if self.reason is not None:
            return f"{head}: none derived: {self.reason}"
        rows = [("module", "style", "why"), *self.rows()]
        w0, w1 = (max(len(r[i]) for r in rows) for i in (0, 1))
        lines = [head] + [f"  {a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])

    def __repr__(self) -> str:
        return str(self)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        import html

        if self.reason is not None:
            body = f"<p>{html.escape(str(self))}</p>"
        else:
            cells = "".join(
                f"<tr><td><code>{html.escape(a)}</code></td><td><code>{html.escape(b)}</code></td>"
                f"<td>{html.escape(c)}</td></tr>"
                for a, b, c in self.rows()
            )
            notes = "".join(f"<p>{html.escape(n)}</p>" for n in self.notes)
            body = (f"<p>{html.escape(str(self).splitlines()[0])}</p><table><tr><th>module</th><th>style</th>"
                    f"<th>why</th></tr>{cells}</table>{notes}")  # fmt: skip
        return {"text/plain": str(self), "text/html": body}


# ------------------------------------------------------------------------------------------------ the derivation
@dataclass
class _Call:
    name: str
    module: Any
    inputs: tuple[int, ...]
    output: int
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]


@dataclass
class _Trace:
    linears: list[_Call] = field(default_factory=list)
    embeddings: list[_Call] = field(default_factory=list)
    calls: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=dict)
    sdpa: list[tuple[int, int]] = field(default_factory=list)
    model_input: int = 0
    last_output: Any = None


def _meta_state(model: torch.nn.Module) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        state[name] = t if t.is_meta else t.detach().to("meta")
    return state


def _trace(model: torch.nn.Module, tokens: Any, probe: Any = None) -> _Trace:
    """One forward on the meta device with hooks recording Linears, Embeddings, module inputs and attention."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.overrides import TorchFunctionMode

    tr = _Trace(model_input=id(tokens))
    handles = []

    def tensor_ids(args: tuple[Any, ...]) -> tuple[int, ...]:
        return tuple(id(a) for a in args if isinstance(a, torch.Tensor))

    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)):

            def hook(m: Any, args: Any, out: Any, name: str = name) -> None:
                call = _Call(name, m, tensor_ids(args), id(out), tuple(args[0].shape), tuple(out.shape))
                (tr.linears if isinstance(m, nn.Linear) else tr.embeddings).append(call)

            handles.append(mod.register_forward_hook(hook))

        def pre(m: Any, args: Any, kwargs: Any, name: str = name) -> None:
            tr.calls.setdefault(name, (args, kwargs))

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))

    class Attn(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is F.scaled_dot_product_attention and len(args) >= 2 and args[0].ndim == 4:
                tr.sdpa.append((int(args[0].shape[1]), int(args[1].shape[1])))
            return func(*args, **(kwargs or {}))

    try:  # tensors the forward makes without a device (a causal mask) are made on the meta device too
        with torch.device("meta"), Attn():
            tr.last_output = torch.func.functional_call(model, _meta_state(model), (tokens,))
    finally:
        for h in handles:
            h.remove()
    return tr


def _attr(module: Any, names: tuple[str, ...]) -> int | None:
    for obj in (module, getattr(module, "config", None)):
        for n in names:
            v = getattr(obj, n, None)
            if isinstance(v, int) and v > 0:
                return v
    return None


def _probe_local(model: torch.nn.Module, parent: str, members: list[_Call], row: _Call, tp: int, args: Any,
                 kwargs: Any) -> bool:  # fmt: skip
    """Whether the branch module runs on local heads: its columns' outputs narrowed to 1/tp, on the meta device."""
    import torch

    mod = model.get_submodule(parent)

    class Reached(Exception):
        pass

    def narrow(m: Any, a: Any, out: Any) -> Any:
        return out.narrow(-1, 0, out.shape[-1] // tp)

    def arrive(m: Any, a: Any) -> None:  # the row-wise projection gets 1/tp of its inputs: the code ran locally
        if a and a[0].shape[-1] * tp == m.in_features:
            raise Reached
        raise ValueError("not local")

    handles = [c.module.register_forward_hook(narrow) for c in members]
    handles.append(row.module.register_forward_pre_hook(arrive))
    state = {k: v for k, v in _meta_state(model).items() if k.startswith(parent + ".")}
    local = {k[len(parent) + 1 :]: v for k, v in state.items()}
    meta_args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
    meta_kwargs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    for k in ("past_key_values", "past_key_value"):  # a Hugging Face cache already holds the traced keys
        if k in meta_kwargs:
            meta_kwargs[k] = None
    try:
        with torch.device("meta"):
            torch.func.functional_call(mod, local, meta_args, meta_kwargs)
        return False
    except Reached:
        return True
    except Exception:  # noqa: BLE001 - any failure of the user's code on local widths means: not local-ready
        return False
    finally:
        for h in handles:
            h.remove()


def _common_parent(names: list[str]) -> str:
    parts = [n.split(".")[:-1] for n in names]
    out: list[str] = []
    for tokens in zip(*parts, strict=False):
        if len(set(tokens)) != 1:
            break
        out.append(tokens[0])
    return ".".join(out)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, min(n, 64) + 1) if n % d == 0)


def suggest_tp_plan(model: torch.nn.Module, tp: int | None = None, *, sequence_parallel: bool = False,
                    seq_len: int = 8) -> TpLayout:  # fmt: skip
    """Propose a tensor-parallel layout for ``model`` from its structure, in its own module names.

    ``tp``: check the degree divides what it splits (heads, widths, vocabulary); ``None`` checks structure only.
    ``sequence_parallel``: also split the residual stream along the sequence (``+sp``). The model is run once on
    the meta device with ``(2, seq_len)`` token ids. Never raises for a model it cannot lay out: the result's
    ``reason`` says why in one line (``raise_if_unusable()`` raises it).
    """
    import torch
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    from ._strategy import find_blocks

    kind = type(model).__name__
    out = TpLayout(model=kind, tp=tp, sequence_parallel=sequence_parallel)

    def fail(reason: str) -> TpLayout:
        out.plan, out.why, out.reason = {}, {}, f"{kind}: {reason}"
        return out

    names = {id(m): n for n, m in model.named_modules()}
    blocks = find_blocks(model)
    if not blocks:
        return fail("found no repeated blocks (an nn.ModuleList or nn.ModuleDict of one block class) to lay out")
    first = names[id(blocks[0])]
    container = first.rsplit(".", 1)[0] if "." in first else ""
    pattern_prefix = f"{container}.*" if container else "*"
    tokens = torch.zeros(2, seq_len, dtype=torch.long, device="meta")
    try:
        tr = _trace(model, tokens)
    except Exception as e:  # noqa: BLE001 - the user's forward; the reason names it
        return fail(f"its forward did not run on the meta device with (2, {seq_len}) token ids "
                    f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")  # fmt: skip

    def pat(name: str) -> str:
        return pattern_prefix + name[len(first) :]

    inside = [c for c in tr.linears if c.name.startswith(first + ".")]
    if not inside:
        return fail(f"the blocks ({first}, ...) hold no nn.Linear to split")
    seen: set[str] = set()
    calls = []
    for c in inside:  # a Linear called twice (weight sharing) keeps its first call
        if c.name not in seen:
            seen.add(c.name)
            calls.append(c)
    pairs: list[tuple[list[_Call], _Call]] = []
    group: list[_Call] = []
    for c in calls:
        if group and c.inputs[:1] == group[0].inputs[:1]:
            group.append(c)
        elif group:
            pairs.append((group, c))
            group = []
        else:
            group = [c]
    if group:
        return fail(f"could not tell how {', '.join(pat(c.name) for c in group)} is used (no row-wise projection "
                    "after it in the block)")  # fmt: skip

    plan: dict[str, Any] = {}
    why: dict[str, str] = {}
    seq = Shard(1) if sequence_parallel else Replicate()
    heads = kv_heads = None
    for members, row in pairs:
        row_in = row.module.in_features
        parent = _common_parent([m.name for m in members] + [row.name])
        parent_mod = model.get_submodule(parent) if parent else model
        fused = 1
        if len(members) == 1 and members[0].module.out_features != row_in:
            width = members[0].module.out_features
            if width % row_in or width // row_in not in (2, 3):
                return fail(
                    f"{pat(members[0].name)} ({width} outputs) feeds {pat(row.name)} ({row_in} inputs): a packed "
                    "projection of unequal parts (e.g. grouped kv heads fused with q) cannot be split per head; "
                    "split it into one Linear per projection"
                )
            fused = width // row_in
        is_attn = fused == 3 or len(members) == 3
        if is_attn:
            h = _attr(parent_mod, _HEAD_ATTRS) or _attr(model, _HEAD_ATTRS) or (tr.sdpa[0][0] if tr.sdpa else None)
            kvh = _attr(parent_mod, _KV_ATTRS) or _attr(model, _KV_ATTRS) or (tr.sdpa[0][1] if tr.sdpa else None)
            if h is None:
                return fail(f"could not find the attention heads of {pat(parent) if parent else 'the block'} (no "
                            "scaled_dot_product_attention call, no n_heads attribute)")  # fmt: skip
            heads, kv_heads = h, kvh or h
            if tp:
                for label, v in (("attention heads", heads), ("kv heads", kv_heads)):
                    if v % tp:
                        return fail(f"tp={tp} does not divide the {v} {label} of {pat(parent)}; use a tp degree "
                                    f"among {_divisors(v)}")  # fmt: skip
        if tp:
            for m in members:
                w = m.module.out_features // fused
                if w % tp:
                    return fail(f"tp={tp} does not divide the {w} output features of {pat(m.name)}; use a tp "
                                f"degree among {_divisors(w)}")  # fmt: skip
        if not parent or parent == first:
            if sequence_parallel:
                return fail(f"{pat(row.name)} sits directly in the block, so sequence parallelism has no module "
                            "boundary to gather the sequence at; run tp without +sp")  # fmt: skip
        args, kwargs = tr.calls.get(parent, ((), {}))
        local = _probe_local(model, parent, members, row, tp or 2, args, kwargs) if parent else True
        what = "attention" if is_attn else "MLP"
        for m in members:
            if fused > 1:
                plan[pat(m.name)] = _fused_colwise(fused, use_local_output=local)
                why[pat(m.name)] = (f"{what}: packs {fused} projections; each rank takes its slice of each "
                                    "(whole heads)" if is_attn else f"{what}: packs {fused} projections, "
                                    "each split by columns")  # fmt: skip
            else:
                plan[pat(m.name)] = ColwiseParallel(use_local_output=local)
                why[pat(m.name)] = f"{what}: reads the block's stream; split by output features" + (
                    " (heads)" if is_attn else ""
                )
        plan[pat(row.name)] = RowwiseParallel(output_layouts=seq)
        why[pat(row.name)] = f"{what}: output projection; split by input features, partial sums " + (
            "reduce-scattered along the sequence" if sequence_parallel else "all-reduced"
        )
        if not local:
            why[pat(row.name)] += "; the branch's code uses whole widths, so it runs on DTensors"
        inner = None
        if sequence_parallel:
            if args:
                n = len(args)
                inner = PrepareModuleInput(input_layouts=(Shard(1),) + (None,) * (n - 1),
                                           desired_input_layouts=(Replicate(),) + (None,) * (n - 1))  # fmt: skip
            elif "hidden_states" in kwargs:
                inner = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                           desired_input_kwarg_layouts={"hidden_states": Replicate()})  # fmt: skip
            else:
                return fail(f"{pat(parent)} takes no positional or hidden_states input to gather along the sequence")
        if not local:
            plan[pat(parent)] = HeadLocalOps.make(inner)
            why[pat(parent)] = "splits its packed output and attends on the local heads" + (
                "; gathers the sequence first" if inner is not None else ""
            )
        elif inner is not None:
            plan[pat(parent)] = inner
            why[pat(parent)] = "gathers the sequence-split stream before the column-wise projections"
    used = {c.name for c in calls}
    stray = [c.name for c in inside if c.name not in used]
    if stray:
        return fail(f"could not place {pat(stray[0])} in an attention or MLP pair")

    # embeddings and the head
    tok = next((e for e in tr.embeddings if e.inputs[:1] == (tr.model_input,)), None)
    vocab = tok.module.num_embeddings if tok is not None else None
    outside_lin = [c for c in tr.linears if not any(c.name.startswith(names[id(b)] + ".") for b in blocks)]
    head = outside_lin[-1] if outside_lin and vocab and outside_lin[-1].module.out_features == vocab else None
    tied = tok is not None and head is not None and head.module.weight is tok.module.weight
    split_vocab = not tied and vocab is not None and (not tp or vocab % tp == 0)
    if tok is not None:
        if split_vocab:
            plan[tok.name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
            why[tok.name] = "token embedding: split by vocabulary rows, looked-up rows all-reduced" + (
                " and split along the sequence" if sequence_parallel else ""
            )
        elif sequence_parallel:
            plan[tok.name] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
            why[tok.name] = "token embedding, kept whole: its output split along the sequence"
        if tied:
            out.notes.append(
                f"{tok.name} and {head.name if head else ''} share one weight: both kept whole "
                "(splitting them by vocabulary would untie them); untie them to split the vocabulary"
            )
        elif not split_vocab:
            out.notes.append(f"tp={tp} does not divide the vocabulary ({vocab}): {tok.name} kept whole")
    for e in tr.embeddings:
        if e is tok or e.name.startswith(first + ".") or e.name in plan:
            continue
        if e.inputs[:1] == (tr.model_input,):
            continue
        if sequence_parallel:  # a positional embedding of arange(seq): its rows for this rank's positions
            dim = len(e.out_shape) - 2
            plan[e.name] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(dim))
            why[e.name] = "positional embedding, kept whole: its output split along the sequence"
    if head is not None:
        if split_vocab:
            plan[head.name] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
            why[head.name] = "output head: split by vocabulary columns, logits gathered" + (
                " (the sequence gathered first)" if sequence_parallel else ""
            )
        elif sequence_parallel:
            plan[head.name] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            why[head.name] = "output head, kept whole: the sequence gathered first"
    elif outside_lin and sequence_parallel:
        return fail(f"{outside_lin[-1].name} runs after the blocks and is not a vocabulary head; run tp without +sp")
    if sequence_parallel:
        block_ids = {id(b) for b in blocks}
        for name, mod in model.named_modules():
            if "norm" not in type(mod).__name__.lower() and not isinstance(mod, nn.LayerNorm):
                continue
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            if name.startswith(first + ".") and parent == first:
                plan[pat(name)] = SequenceParallel(use_local_output=True)
                why[pat(name)] = "norm on the sequence-split stream"
            elif not any(name.startswith(names[i] + ".") for i in map(id, blocks)) and id(mod) not in block_ids:
                plan[name] = SequenceParallel(use_local_output=True)
                why[name] = "norm on the sequence-split stream"
    out.plan, out.why = _order(plan, model), why
    return out


def _order(plan: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """Entries in the model's module order, a pattern at its first match (``*`` standing for block 0's index)."""
    import fnmatch

    order = [n for n, _ in model.named_modules()]

    def key(k: str) -> int:
        return next((i for i, n in enumerate(order) if fnmatch.fnmatchcase(n, k)), len(order))

    return {k: plan[k] for k in sorted(plan, key=key)}
