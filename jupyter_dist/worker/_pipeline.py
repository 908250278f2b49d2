"""Pipeline parallelism inside a worker, with ``torch.distributed.pipelining``.

The model is cut at block boundaries into ``pp x virtual`` stages (balanced by cost: the first stage also runs the
embedding, the last the norm and head; :func:`jupyter_dist.plan.pipeline.stage_bounds`). Each rank keeps only its
stages' parts: the rest of the model is dropped before anything is allocated. A stage is a *shallow view* of that
pruned model -- the same class, sharing the same submodules, with the parts it does not run set to ``None`` and only
its blocks in the block dict -- so the model's own ``forward`` runs it, and the pruned model keeps the whole model's
parameter names for checkpoints (resume under another pipeline split, or none). The stages go to ``PipelineStage``
on the mesh's ``pp`` dimension and a GPipe, 1F1B or interleaved-1F1B schedule runs them over micro-batches
(:func:`jupyter_dist.worker.train_step`).

A model can be pipelined when its blocks sit in an ``nn.ModuleDict`` keyed by their index and its ``forward`` skips
parts that are ``None`` (:class:`jupyter_dist.models.Transformer` does), when it is a Hugging Face decoder-only
causal LM of a type in :data:`HF_PIPELINE_TYPES`, or when it is an ordinary model whose forward is a plain loop over
an ``nn.ModuleList`` or ``nn.Sequential`` of blocks (a nanoGPT); other models get one line saying so.

An ordinary model (:data:`LOOP_NEEDS`): its block list becomes a :func:`_blocks_class` dict keyed by the blocks'
indices (the whole model's parameter names again), and one forward on the meta device (or a 2-token one, RNG state
kept, on a materialised model) checks that the forward is a plain loop -- each block called once, in order, on the
previous block's output, then the parts after the blocks one after another, the last one's output returned -- and
records those parts' order. The first stage runs the model's own forward (whatever it does before the blocks) and
stops after its last block; the other stages run their blocks in a loop, the last one then the recorded parts.

For a Hugging Face model the ``ModuleList`` of decoder layers becomes a dict keyed by the same indices (same
parameter names); a stage views the causal LM and its base model (shallow copies along the way to the layers), takes
token ids (first stage) or hidden states as ``inputs_embeds``, computes rotary angles and the causal mask from its
own input as the whole model does, and on every stage but the last runs ``nn.Identity`` for the final norm and head.

A mixture-of-experts model (:class:`jupyter_dist.models.MoETransformer`) adds its load-balancing loss, the mean over
all its MoE layers, to the loss. Its layers sit on every stage, so the stages carry it: each stage sends on, with its
hidden states, the sum of the balance losses of the layers it ran so far (one scalar), and on the last stage
``model.aux_loss()`` returns that sum over the whole model's layer count. The loss function, unchanged, adds it; the
schedule's backward sends the scalar's gradient back with the hidden states' and each layer's router gets the same
gradient as in one process.

One piece: the three kinds of model share the cut (:func:`prune`), the stage views (``_view``, ``_shallow``) and the
schedule; the seam, should it grow, is the ordinary model's check and stage forward (``check_loop`` to
``_loop_view``), which would move to a module of its own that imports the views from here.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from ._env import WorkerEnv, WorkerError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["Pipeline", "StagePlan", "prune", "aux_layers", "loop_blocks", "pipeline_problem", "PIPELINE_NEEDS",
           "LOOP_NEEDS", "HF_PIPELINE_TYPES"]  # fmt: skip

_log = logging.getLogger("jupyter_dist.worker")

PIPELINE_NEEDS = (
    "jd.wrap: pipeline parallelism (pp{pp}) needs a model whose blocks sit in an nn.ModuleList or nn.Sequential "
    "(its forward a plain loop over them), in an nn.ModuleDict keyed by index (its forward skipping parts set to "
    "None, like jupyter_dist.models.Transformer), or a Hugging Face decoder-only causal LM ({hf}); {kind} {why}"
)

LOOP_NEEDS = (
    "jd.wrap: pipeline parallelism (pp{pp}) cuts {kind}'s forward at its blocks, but {why}; the forward must run the "
    "parts before the blocks, then x = block(x) for each block of its {container} in order, then the parts after "
    "them one after another on the previous output (x = self.ln_f(x); return self.lm_head(x))"
)
"""What an ordinary model's forward must look like to be cut into stages (checked by one forward)."""

HF_PIPELINE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
"""Hugging Face ``model_type``s whose forward runs a stage as it is: ``inputs_embeds`` go into the decoder layers
unchanged (no scaling, as Gemma's forward applies), the layers are sliced with ``self.layers[: num_hidden_layers]``
and per-layer attention types read ``config.layer_types`` by position."""


def _needs(model: torch.nn.Module, pp: int, why: str) -> WorkerError:
    return WorkerError(PIPELINE_NEEDS.format(pp=pp, kind=type(model).__name__, why=why,
                                             hf=", ".join(HF_PIPELINE_TYPES)))  # fmt: skip


def _is_hf(model: torch.nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__)


def _get(model: torch.nn.Module, path: str) -> Any:
    """The submodule at dotted ``path``, or ``None`` where a part on the way is missing or ``None``."""
    module: Any = model
    for part in path.split(".") if path else []:
        module = module._modules.get(part) if module is not None else None
    return module


def _set(model: torch.nn.Module, path: str, value: Any) -> None:
    parent, _, name = path.rpartition(".")
    _get(model, parent)._modules[name] = value


@functools.cache
def _layers_class() -> type:
    import torch.nn as nn

    class PipelineLayers(nn.ModuleDict):
        """A Hugging Face model's decoder layers keyed by their index in the whole model (``"0"``, ``"1"``, ...).

        Replaces the model's ``ModuleList`` so a rank that keeps layers 2-3 still names them ``model.layers.2`` (the
        whole model's parameter names: checkpoints and ``pretrained=`` loading mean the same under any split). A
        slice gives the layers held, in order, as the model's forward asks for them (``self.layers[: n]``).
        """

        def __getitem__(self, key: Any) -> Any:
            if isinstance(key, slice):
                return list(self.values())[key]
            return super().__getitem__(key)

    return PipelineLayers


def _block_container(model: torch.nn.Module, pp: int, *,
                     replace: bool = True) -> tuple[str, Any, list[str] | None]:  # fmt: skip
    """The dotted path and the ``ModuleDict`` of the model's blocks, and an ordinary model's parts after them.

    A direct child of a model whose forward skips ``None`` parts; a Hugging Face causal LM's ``ModuleList`` of
    decoder layers (``model.layers``) is replaced in place by :func:`_layers_class` (same names); an ordinary
    model's ``ModuleList`` or ``Sequential``, once :func:`check_loop` passed, by :func:`_blocks_class` (same names;
    a model that is an ``nn.Sequential`` keeps itself). The third item is ``None`` but for an ordinary model.
    ``replace=False`` only checks (the model is left as it is).
    """
    import torch.nn as nn

    from ._strategy import find_blocks

    blocks = find_blocks(model)
    if _is_hf(model):
        if not blocks:
            raise _needs(model, pp, "has no repeated blocks")
        kind = getattr(getattr(model, "config", None), "model_type", None)
        if kind not in HF_PIPELINE_TYPES:
            raise _needs(model, pp, f"is a Hugging Face model of type {kind!r}, not proven to run stage by stage")
        if getattr(model.config, "tie_word_embeddings", False):
            raise WorkerError(
                f"jd.wrap: pipeline parallelism (pp{pp}) puts the embedding on the first stage and the head on the "
                f"last, but {type(model).__name__} ties them (one tensor); build it with tie_word_embeddings=False"
            )
        for path, child in model.named_modules():
            if isinstance(child, nn.ModuleList) and any(c is blocks[0] for c in child):
                layers = _layers_class()({str(i): c for i, c in enumerate(child)})
                if replace:
                    _set(model, path, layers)
                return path, layers, None
            if isinstance(child, nn.ModuleDict) and any(c is blocks[0] for c in child.values()):
                return path, child, None
        raise _needs(model, pp, "keeps its decoder layers where they cannot be found")
    for name, child in model.named_children():
        if blocks and isinstance(child, nn.ModuleDict) and any(c is blocks[0] for c in child.values()):
            return name, child, None
    found = loop_blocks(model)
    if found is None:
        raise _needs(model, pp, "has no nn.ModuleList or nn.Sequential of blocks")
    path, container = found
    post = check_loop(model, path, pp)
    if not path:  # the model is the nn.Sequential: its own forward is the loop, its children the blocks
        return path, container, post
    layers = _blocks_class()(dict(container._modules))
    if replace:
        _set(model, path, layers)
    return path, layers, post


def pipeline_problem(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot be cut into pipeline stages (what ``jd.wrap`` would say, one line), or ``None``.

    The checks :func:`prune` makes, without changing the model (the planner asks this of a measured module).
    """
    try:
        _, blocks, _ = _block_container(model, 2, replace=False)
    except WorkerError as e:
        return str(e).removeprefix("jd.wrap: ")
    keys = list(blocks._modules)
    if keys != [str(i) for i in range(len(keys))]:
        return str(_needs(model, 2, f"names its blocks {keys[:3]}")).removeprefix("jd.wrap: ")
    return None


# ------------------------------------------------------------------------------ ordinary models (a plain loop)
class _StageDone(BaseException):
    """Raised by the first stage's last block: the stage's output, carried out of the model's own forward."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output


class _Cut:
    """The first stage's last block as the model's forward sees it: it runs the block, then ends the stage."""

    def __init__(self, block: Any) -> None:
        self.block = block

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise _StageDone(self.block(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.block, name)


@functools.cache
def _blocks_class() -> type:
    import torch.nn as nn

    class PipelineBlocks(nn.ModuleDict):
        """An ordinary model's blocks keyed by their index in the whole model (``"0"``, ``"1"``, ...).

        Replaces its ``nn.ModuleList`` or ``nn.Sequential`` so a rank that keeps blocks 2-3 still names them
        ``blocks.2`` (the whole model's parameter names); iterated, indexed by position, sliced and called like the
        list or sequence it replaces. On the first stage (``cut``) its last block ends the stage after it runs.
        """

        cut = False

        def __iter__(self) -> Any:  # modules, as a ModuleList's (a ModuleDict's own iterates keys)
            held = list(self._modules.values())
            for i, block in enumerate(held):
                yield _Cut(block) if self.cut and i == len(held) - 1 else block

        def __getitem__(self, key: Any) -> Any:
            if isinstance(key, str):
                return self._modules[key]
            return list(self)[key]

        def forward(self, x: Any) -> Any:
            for block in self:
                x = block(x)
            return x

    return PipelineBlocks


def loop_blocks(model: torch.nn.Module) -> tuple[str, Any] | None:
    """``(dotted path, container)`` of an ordinary model's blocks, or ``None`` where it has none.

    The model itself when it is an ``nn.Sequential`` (path ``""``); else the ``nn.ModuleList`` of one class or the
    ``nn.Sequential`` with two or more children that holds the most parameters.
    """
    import torch.nn as nn

    if isinstance(model, nn.Sequential):
        return ("", model) if len(model) > 1 else None
    best: tuple[str, Any] | None = None
    best_key = (0, 0)
    for path, module in model.named_modules():
        if not path or not isinstance(module, nn.ModuleList | nn.Sequential):
            continue
        children = list(module._modules.values())
        if len(children) < 2 or (isinstance(module, nn.ModuleList) and len({type(c) for c in children}) != 1):
            continue
        key = (sum(p.numel() for p in module.parameters()), len(children))
        if key > best_key:
            best, best_key = (path, module), key
    return best


def _sides(model: torch.nn.Module, container: str) -> tuple[list[str], list[str]]:
    """Every child off the way to the blocks, before them and after them, as dotted paths.

    With or without parameters; the ones after in the order of the way back up (the innermost first).
    """
    before: list[str] = []
    after: list[str] = []
    parts = container.split(".")
    module: Any = model
    levels: list[list[str]] = []
    for depth, name in enumerate(parts):
        prefix = ".".join(parts[:depth])
        names = list(module._modules)
        i = names.index(name)
        before += [f"{prefix}.{n}" if prefix else n for n in names[:i]]
        levels.append([f"{prefix}.{n}" if prefix else n for n in names[i + 1 :]])
        module = module._modules[name]
    for level in reversed(levels):
        after += level
    return before, after


def _example_input(model: torch.nn.Module) -> Any:
    """A 2-token input for ``model``'s first module that takes one (an embedding, a linear map, a norm), or None."""
    import torch
    import torch.nn as nn

    for m in model.modules():
        weight = getattr(m, "weight", None)
        if not isinstance(weight, torch.Tensor):
            continue
        if isinstance(m, nn.Embedding):
            return torch.zeros(1, 2, dtype=torch.long, device=weight.device)
        if isinstance(m, nn.Linear):
            return torch.zeros(1, 2, m.in_features, dtype=weight.dtype, device=weight.device)
        if isinstance(m, nn.LayerNorm):
            return torch.zeros(1, 2, *m.normalized_shape, dtype=weight.dtype, device=weight.device)
        return None
    return None


def check_loop(model: torch.nn.Module, container: str, pp: int) -> list[str]:
    """The parts after the blocks, in the order the forward runs them; raises where the forward is not a plain loop.

    One forward of a 2-token input (on the meta device for a model built there; else under ``no_grad`` with the
    random state restored), every block and every part off the way to them hooked (see :data:`LOOP_NEEDS`).
    """
    import torch

    where = container or "nn.Sequential"
    kind = type(model).__name__

    def refuse(why: str) -> WorkerError:
        return WorkerError(LOOP_NEEDS.format(pp=pp, kind=kind, why=why, container=where))

    if not container:
        return []
    blocks = _get(model, container)
    before, after = _sides(model, container)
    shared = {id(p) for path in before for p in _get(model, path).parameters()} & {
        id(p) for path in after for p in _get(model, path).parameters()}  # fmt: skip
    if shared:
        raise WorkerError(
            f"jd.wrap: pipeline parallelism (pp{pp}) puts the parts before the blocks on the first stage and those "
            f"after them on the last, but {kind} shares {len(shared)} tensor(s) between them (tied embedding and "
            "head); untie them (give the head its own weight)"
        )
    example = _example_input(model)
    if example is None:
        raise refuse("its first part takes no input jd.wrap can make to check that (an embedding, a linear map "
                     "or a norm first)")  # fmt: skip
    calls: list[tuple[str, str, tuple[Any, ...], dict[str, Any], Any]] = []
    handles = []

    def hook(kind_: str, name: str) -> Any:
        def record(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            calls.append((kind_, name, args, kwargs, out))

        return record

    keys = list(blocks._modules)
    for key in keys:
        handles.append(blocks._modules[key].register_forward_hook(hook("block", key), with_kwargs=True))
    for path in before:
        handles.append(_get(model, path).register_forward_hook(hook("before", path), with_kwargs=True))
    for path in after:
        handles.append(_get(model, path).register_forward_hook(hook("after", path), with_kwargs=True))
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            out = model(example)
    except Exception as e:  # noqa: BLE001 -- any failure of the user's forward is the reason given
        first_line = (str(e).strip().splitlines() or [""])[0][:200]
        raise refuse(f"one forward of a {tuple(example.shape)} {example.dtype} input to check that failed "
                     f"({type(e).__name__}: {first_line})") from None  # fmt: skip
    finally:
        for h in handles:
            h.remove()
    order = [name for k, name, *_ in calls if k == "block"]
    if order != keys:
        shown = ", ".join(order[:6]) + (", ..." if len(order) > 6 else "")
        raise refuse(f"it calls its blocks in the order [{shown}], not each once from 0 to {keys[-1]}")
    at = [i for i, c in enumerate(calls) if c[0] == "block"]
    start, end = at[0], at[-1]
    if any(c[0] != "block" for c in calls[start:end]):
        odd = next(c for c in calls[start:end] if c[0] != "block")
        raise refuse(f"it calls {odd[1]} between its blocks")
    previous = None
    for i in at:
        _, name, args, kwargs, output = calls[i]
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
            raise refuse(f"block {name} is called with {len(args)} argument(s) and {sorted(kwargs)} keywords")
        if previous is not None and args[0] is not previous[1]:
            raise refuse(f"block {name} is not called on block {previous[0]}'s output")
        if not isinstance(output, torch.Tensor):
            raise refuse(f"block {name} returns a {type(output).__name__}, not a tensor")
        previous = (name, output)
    post: list[str] = []
    assert previous is not None
    for kind_, name, args, kwargs, output in calls[end + 1 :]:
        if kind_ != "after":
            raise refuse(f"it calls {name} after its blocks")
        if len(args) != 1 or kwargs or args[0] is not previous[1]:
            raise refuse(f"{name} is not called on the previous part's output alone")
        post.append(name)
        previous = (name, output)
    if out is not previous[1]:
        last = post[-1] if post else f"block {keys[-1]}"
        raise refuse(f"it returns a {type(out).__name__} that is not {last}'s output")
    return post


def _edge_parts(model: torch.nn.Module, container: str) -> tuple[list[str], list[str]]:
    """Parts before the blocks (run by the first stage) and after them (run by the last), as dotted paths.

    The children with parameters of each module on the way to the blocks, before or after that way; parts without
    parameters (a rotary embedding's frequency table) run on every stage.
    """
    first: list[str] = []
    last: list[str] = []
    if not container:  # an nn.Sequential model: nothing but blocks
        return first, last
    parts = container.split(".")
    module: Any = model
    for depth, name in enumerate(parts):
        prefix = ".".join(parts[:depth])
        names = [n for n, _ in module.named_children()]
        i = names.index(name)
        for j, n in enumerate(names):
            child = module._modules[n]
            if j == i or child is None or not any(True for _ in child.parameters()):
                continue
            (first if j < i else last).append(f"{prefix}.{n}" if prefix else n)
        module = module._modules[name]
    return first, last


def _extras(model: torch.nn.Module, container: str, first: list[str], last: list[str]) -> tuple[float, float]:
    """What the embedding and the head cost, in blocks (matmul FLOPs ~ parameters; a lookup costs ~nothing)."""
    import torch.nn as nn

    blocks = list(_get(model, container)._modules.values())
    per_block = max(1, sum(p.numel() for p in blocks[0].parameters()))

    def flops_params(paths: list[str]) -> int:
        total = 0
        for path in paths:
            mod = _get(model, path)
            if mod is None or isinstance(mod, nn.Embedding):
                continue
            total += sum(p.numel() for p in mod.parameters())
        return total

    return flops_params(first) / per_block, flops_params(last) / per_block


def _shallow(module: torch.nn.Module) -> torch.nn.Module:
    """A module of ``module``'s class sharing its submodules and parameters, with its own tables and no hooks."""
    view = module.__class__.__new__(module.__class__)
    view.__dict__.update(module.__dict__)
    for key, value in module.__dict__.items():  # own module tables and hook tables; the submodules stay shared
        if isinstance(value, dict):
            view.__dict__[key] = type(value)(value) if "hook" not in key else type(value)()
    view.__dict__.pop("forward", None)  # the class's forward, not the root's refusal
    return view


def _view(root: torch.nn.Module, container: str, keys: list[str], run_first: bool, run_last: bool,
          first: list[str], last: list[str], hf: bool) -> torch.nn.Module:  # fmt: skip
    """A module of ``root``'s class sharing its submodules, running only ``keys`` (and the edges it owns).

    The modules on the way to the blocks are shallow copies (a Hugging Face causal LM and its base model), so the
    view changes what they hold without changing ``root``. Parts this stage does not run are ``None`` (the
    reference model's forward skips them; a Hugging Face model is given ``inputs_embeds``, so it skips its
    embedding), or, for a Hugging Face model's parts after the blocks (its forward always runs the final norm and
    head), ``nn.Identity``. A Hugging Face base model's view gets a copy of its config that counts the stage's
    layers (``num_hidden_layers``, ``layer_types``).
    """
    import copy

    import torch.nn as nn

    view = _shallow(root)
    parts = container.split(".")
    parent = view
    for name in parts[:-1]:
        child = _shallow(parent._modules[name])
        parent._modules[name] = child
        parent = child
    full = _get(root, container)
    layers = type(full)({k: full[k] for k in keys})
    parent._modules[parts[-1]] = layers
    config = getattr(parent, "config", None)
    if hf and config is not None:
        config = copy.copy(config)
        config.num_hidden_layers = len(keys)
        if isinstance(getattr(config, "layer_types", None), list | tuple):
            config.layer_types = [config.layer_types[int(k)] for k in keys]
        parent.__dict__["config"] = config
    for path in first:
        if not run_first:
            _set(view, path, None)
    for path in last:
        if not run_last:
            _set(view, path, nn.Identity() if hf else None)
    return view


def _loop_view(root: torch.nn.Module, container: str, keys: list[str], run_first: bool, run_last: bool,
               first: list[str], last: list[str], post: list[str]) -> torch.nn.Module:  # fmt: skip
    """A stage of an ordinary model (see :func:`check_loop`): a view of ``root`` whose forward runs the stage.

    The first stage runs the model's own forward, which stops after the stage's last block; the others run their
    blocks one after another, and the last one then the parts after the blocks in the forward's order (``post``).
    An ``nn.Sequential`` model's stage is the sequence of its blocks.
    """
    if not container:
        view = _shallow(root)
        view.__dict__["_modules"] = {k: root._modules[k] for k in keys}
        return view
    view = _view(root, container, keys, run_first, run_last, first, last, False)
    model_forward = type(root).forward

    def forward_first(*args: Any, **kwargs: Any) -> Any:
        try:
            return model_forward(view, *args, **kwargs)
        except _StageDone as done:
            return done.output

    def forward_rest(x: Any) -> Any:
        for block in _get(view, container)._modules.values():
            x = block(x)
        for path in post if run_last else ():
            x = _get(view, path)(x)
        return x

    if run_first:
        _get(view, container).cut = not run_last
    view.forward = forward_first if run_first else forward_rest  # type: ignore[method-assign]
    return view


def _hf_stage_hooks(view: torch.nn.Module, first: bool) -> None:
    """A Hugging Face stage takes token ids (first stage) or hidden states, and returns a tensor.

    Hidden states go in as ``inputs_embeds``; no key/value cache; out comes the output's ``logits`` (the hidden
    states on every stage but the last, whose head is ``nn.Identity``).
    """

    def pre(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        kwargs = {**kwargs, "use_cache": False}
        if first or not args:
            return args, kwargs
        return tuple(args[1:]), {**kwargs, "inputs_embeds": args[0]}

    def post(_m: Any, _args: Any, out: Any) -> Any:
        return out.logits if hasattr(out, "logits") else out[0]

    view.register_forward_pre_hook(pre, with_kwargs=True)
    view.register_forward_hook(post)


def aux_layers(module: torch.nn.Module) -> list[Any]:
    """The mixture-of-experts layers (each keeps its last forward's load-balancing loss in ``.aux``) in ``module``."""
    from ..models.moe import MoE

    return [m for m in module.modules() if isinstance(m, MoE)]


class StagePlan:
    """Which stages and layers this rank keeps (from :func:`prune`)."""

    def __init__(self, container: str, first: list[str], last: list[str], bounds: list[tuple[int, int]],
                 mine: list[int], *, hf: bool = False, post: list[str] | None = None) -> None:  # fmt: skip
        self.container, self.first, self.last, self.bounds, self.mine = container, first, last, bounds, mine
        self.hf = hf
        """A Hugging Face causal LM: its stages take ``inputs_embeds`` and return their output's ``logits``."""
        self.post = post
        """An ordinary model (a plain loop over its blocks): the parts after the blocks, in the forward's order;
        ``None`` for a model whose forward skips ``None`` parts and for a Hugging Face model."""

    def views(self, model: torch.nn.Module) -> list[tuple[int, Any]]:
        """``[(stage index, stage view)]`` of the pruned ``model`` (after its blocks were wrapped or sharded)."""
        n = len(self.bounds)
        out = []
        for i in self.mine:
            keys = [str(j) for j in range(*self.bounds[i])]
            if self.post is not None:
                out.append((i, _loop_view(model, self.container, keys, i == 0, i == n - 1, self.first, self.last,
                                          self.post)))  # fmt: skip
                continue
            view = _view(model, self.container, keys, i == 0, i == n - 1, self.first, self.last, self.hf)
            if self.hf:
                _hf_stage_hooks(view, i == 0)
            out.append((i, view))
        return out


def prune(model: torch.nn.Module, *, pp: int, pp_rank: int, virtual: int) -> StagePlan:
    """Drop, in place, every part of ``model`` this rank's stages do not run.

    Stage ``i`` of ``pp * virtual`` is held by pp rank ``i % pp`` (the looped placement interleaved 1F1B expects).
    """
    from ..plan.pipeline import stage_bounds

    container, blocks, post = _block_container(model, pp)
    first, last = _edge_parts(model, container)
    if _is_hf(model):  # its forward skips only the embedding (given inputs_embeds): nothing else may come first
        embedding = model.get_input_embeddings()
        others = [p for p in first if _get(model, p) is not embedding]
        if others:
            raise _needs(model, pp, f"runs {others} before its decoder layers")
    keys = list(blocks._modules)
    if keys != [str(i) for i in range(len(keys))]:
        raise _needs(model, pp, f"names its blocks {keys[:3]}")
    n_stages = pp * virtual
    extra_first, extra_last = _extras(model, container, first, last)
    bounds = stage_bounds(len(keys), n_stages, first_extra=extra_first, last_extra=extra_last)
    mine = [i for i in range(n_stages) if i % pp == pp_rank]
    kept = {k for i in mine for k in keys[bounds[i][0] : bounds[i][1]]}
    for k in keys:
        if k not in kept:
            del blocks._modules[k]  # dropped before anything is allocated: a rank holds only its stages
    if 0 not in mine:
        for path in first:
            _set(model, path, None)
    if n_stages - 1 not in mine:
        for path in last:
            _set(model, path, None)
    _log.info("jd.wrap: pipeline stages %s of %d on this rank, layers %s", mine, n_stages,
              [bounds[i] for i in mine])  # fmt: skip
    return StagePlan(container, first, last, bounds, mine, hf=_is_hf(model), post=post)


class Pipeline:
    """The pipeline stages of a rank and the schedule that runs them (built on the first :meth:`step`)."""

    def __init__(self, env: WorkerEnv, stages: list[tuple[int, Any]], pp_group: Any, device: torch.device, *,
                 model: torch.nn.Module | None = None, container: str = "layers",
                 aux_total: int = 0) -> None:  # fmt: skip
        from torch.distributed.pipelining import PipelineStage

        self.env = env
        self._aux: dict[str, Any] = {}
        if aux_total and model is not None:  # before PipelineStage: its shape inference runs the stages' forwards
            self._carry_aux(model, stages, container, aux_total)
        self.n_stages = env.pp * env.stages_per_rank
        self.stages = [
            PipelineStage(view, index, self.n_stages, device, group=pp_group) for index, view in stages
        ]  # fmt: skip
        self.pp_group = pp_group
        self.microbatches = env.microbatches or self.n_stages
        self.layers = {index: list(_get(view, container)._modules) for index, view in stages}
        """This rank's stage indices and the blocks (by global index) each runs."""
        self._schedule: Any = None
        self._loss_fn: Any = None

    def _carry_aux(self, model: torch.nn.Module, stages: list[tuple[int, Any]], container: str, total: int) -> None:
        """Each stage passes on ``(hidden, balance-loss sum so far)``; the last one's sum is ``model.aux_loss()``."""
        import torch

        n_stages = self.env.pp * self.env.stages_per_rank
        for index, view in stages:
            layers = aux_layers(_get(view, container))
            first, last = index == 0, index == n_stages - 1

            def pre(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any], first: bool = first) -> Any:
                if first:
                    return None
                *rest, carried = args
                self._aux["carried"] = carried
                return tuple(rest), kwargs

            def post(_m: Any, _args: Any, out: Any, first: bool = first, last: bool = last,
                     layers: list[Any] = layers) -> Any:  # fmt: skip
                local = [m.aux.float() for m in layers if m.aux is not None]
                carried = torch.zeros((), device=out.device) if first else self._aux.pop("carried")
                running = carried + torch.stack(local).sum() if local else carried
                if last:
                    self._aux["loss"] = running / total
                    return out
                return out, running

            view.register_forward_pre_hook(pre, with_kwargs=True)
            view.register_forward_hook(post)

        def aux_loss() -> torch.Tensor:
            if "loss" not in self._aux:
                raise WorkerError(
                    "model.aux_loss() under pipeline parallelism is the last stage's: call it in the loss_fn given "
                    "to jd.train_step"
                )
            return self._aux["loss"]

        model.aux_loss = aux_loss  # type: ignore[method-assign]

    @property
    def is_first(self) -> bool:
        """Whether this rank runs the first stage (it takes the inputs)."""
        return any(s.is_first for s in self.stages)

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (it takes the targets and computes the loss)."""
        return any(s.is_last for s in self.stages)

    def schedule(self, loss_fn: Any) -> Any:
        """The schedule for ``loss_fn`` (rebuilt if another loss function is given)."""
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        if self._schedule is None or loss_fn is not self._loss_fn:
            kind = self.env.pp_schedule
            if kind == "interleaved-1f1b":
                self._schedule = ScheduleInterleaved1F1B(self.stages, self.microbatches, loss_fn=loss_fn)
            else:
                if len(self.stages) != 1:
                    raise WorkerError(f"JD_PP_SCHEDULE={kind} runs one stage per rank; set JD_PP_VIRTUAL=1")
                if kind == "1f1b" and self.microbatches < self.n_stages:
                    raise WorkerError(
                        f"1F1B needs at least as many micro-batches as stages: {self.microbatches} < "
                        f"{self.n_stages}; raise the gradient accumulation (JD_MICROBATCHES) or use gpipe"
                    )
                cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
                self._schedule = cls(self.stages[0], self.microbatches, loss_fn=loss_fn)
            self._loss_fn = loss_fn
        return self._schedule

    def step(self, inputs: Any, targets: Any, loss_fn: Any) -> torch.Tensor:
        """Forward and backward of one batch over the micro-batches; the mean loss, on every rank of the pipeline."""
        import torch
        import torch.distributed as dist

        for batch in (inputs, targets):  # every rank checks what it was given, before any stage communicates
            if batch is not None and batch.shape[0] % self.microbatches:
                raise WorkerError(
                    f"jd.train_step: a batch of {batch.shape[0]} does not split into {self.microbatches} "
                    "micro-batches (the plan's gradient accumulation); use a multiple"
                )
        if (self.is_first and inputs is None) or (self.is_last and targets is None):
            raise WorkerError("jd.train_step: the first pipeline stage needs the inputs and the last the targets")
        schedule = self.schedule(loss_fn)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first else ()
        schedule.step(*args, target=targets if self.is_last else None, losses=losses)
        device = self.stages[0].device
        loss = torch.stack([x.detach().float() for x in losses]).mean() if losses else torch.zeros((), device=device)
        # the loss lives on the last stage: send it to the others of this pipeline (one scalar) for jd.log
        last_global = dist.get_global_rank(self.pp_group, self.env.pp - 1 if self.env.stages_per_rank == 1 else
                                           (self.n_stages - 1) % self.env.pp)  # fmt: skip
        dist.broadcast(loss, src=last_global, group=self.pp_group)
        return loss
