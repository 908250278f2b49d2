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
parts that are ``None`` (:class:`jupyter_dist.models.Transformer` does), or when it is a Hugging Face decoder-only
causal LM of a type in :data:`HF_PIPELINE_TYPES`; other models get one line saying so. For a Hugging Face model the
``ModuleList`` of decoder layers becomes a dict keyed by the same indices (same parameter names); a stage views the
causal LM and its base model (shallow copies along the way to the layers), takes token ids (first stage) or hidden
states as ``inputs_embeds``, computes rotary angles and the causal mask from its own input as the whole model does,
and on every stage but the last runs ``nn.Identity`` for the final norm and head.

A mixture-of-experts model (:class:`jupyter_dist.models.MoETransformer`) adds its load-balancing loss, the mean over
all its MoE layers, to the loss. Its layers sit on every stage, so the stages carry it: each stage sends on, with its
hidden states, the sum of the balance losses of the layers it ran so far (one scalar), and on the last stage
``model.aux_loss()`` returns that sum over the whole model's layer count. The loss function, unchanged, adds it; the
schedule's backward sends the scalar's gradient back with the hidden states' and each layer's router gets the same
gradient as in one process.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from ._env import WorkerEnv, WorkerError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["Pipeline", "StagePlan", "prune", "aux_layers", "PIPELINE_NEEDS", "HF_PIPELINE_TYPES"]

_log = logging.getLogger("jupyter_dist.worker")

PIPELINE_NEEDS = (
    "jd.wrap: pipeline parallelism (pp{pp}) needs a model whose blocks sit in an nn.ModuleDict keyed by index and "
    "whose forward skips parts set to None, like jupyter_dist.models.Transformer, or a Hugging Face decoder-only "
    "causal LM ({hf}); {kind} {why}"
)

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


def _block_container(model: torch.nn.Module, pp: int) -> tuple[str, Any]:
    """The dotted path and the ``ModuleDict`` of the model's blocks.

    A direct child of a model whose forward skips ``None`` parts; a Hugging Face causal LM's ``ModuleList`` of
    decoder layers (``model.layers``) is replaced in place by :func:`_layers_class` (same names).
    """
    import torch.nn as nn

    from ._strategy import find_blocks

    blocks = find_blocks(model)
    if not blocks:
        raise _needs(model, pp, "has no repeated blocks")
    if _is_hf(model):
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
                _set(model, path, layers)
                return path, layers
            if isinstance(child, nn.ModuleDict) and any(c is blocks[0] for c in child.values()):
                return path, child
        raise _needs(model, pp, "keeps its decoder layers where they cannot be found")
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleDict) and any(c is blocks[0] for c in child.values()):
            return name, child
    raise _needs(model, pp, "keeps its blocks in a ModuleList")


def _edge_parts(model: torch.nn.Module, container: str) -> tuple[list[str], list[str]]:
    """Parts before the blocks (run by the first stage) and after them (run by the last), as dotted paths.

    The children with parameters of each module on the way to the blocks, before or after that way; parts without
    parameters (a rotary embedding's frequency table) run on every stage.
    """
    first: list[str] = []
    last: list[str] = []
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

    blocks = list(_get(model, container).values())
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
                 mine: list[int], *, hf: bool = False) -> None:  # fmt: skip
        self.container, self.first, self.last, self.bounds, self.mine = container, first, last, bounds, mine
        self.hf = hf
        """A Hugging Face causal LM: its stages take ``inputs_embeds`` and return their output's ``logits``."""

    def views(self, model: torch.nn.Module) -> list[tuple[int, Any]]:
        """``[(stage index, stage view)]`` of the pruned ``model`` (after its blocks were wrapped or sharded)."""
        n = len(self.bounds)
        out = []
        for i in self.mine:
            view = _view(model, self.container, [str(j) for j in range(*self.bounds[i])], i == 0, i == n - 1,
                         self.first, self.last, self.hf)  # fmt: skip
            if self.hf:
                _hf_stage_hooks(view, i == 0)
            out.append((i, view))
        return out


def prune(model: torch.nn.Module, *, pp: int, pp_rank: int, virtual: int) -> StagePlan:
    """Drop, in place, every part of ``model`` this rank's stages do not run.

    Stage ``i`` of ``pp * virtual`` is held by pp rank ``i % pp`` (the looped placement interleaved 1F1B expects).
    """
    from ..plan.pipeline import stage_bounds

    container, blocks = _block_container(model, pp)
    first, last = _edge_parts(model, container)
    if _is_hf(model):  # its forward skips only the embedding (given inputs_embeds): nothing else may come first
        embedding = model.get_input_embeddings()
        others = [p for p in first if _get(model, p) is not embedding]
        if others:
            raise _needs(model, pp, f"runs {others} before its decoder layers")
    keys = list(blocks.keys())
    if keys != [str(i) for i in range(len(keys))]:
        raise _needs(model, pp, f"names its blocks {keys[:3]}")
    n_stages = pp * virtual
    extra_first, extra_last = _extras(model, container, first, last)
    bounds = stage_bounds(len(keys), n_stages, first_extra=extra_first, last_extra=extra_last)
    mine = [i for i in range(n_stages) if i % pp == pp_rank]
    kept = {k for i in mine for k in keys[bounds[i][0] : bounds[i][1]]}
    for k in keys:
        if k not in kept:
            del blocks[k]  # dropped before anything is allocated: a rank holds only its stages
    if 0 not in mine:
        for path in first:
            _set(model, path, None)
    if n_stages - 1 not in mine:
        for path in last:
            _set(model, path, None)
    _log.info("jd.wrap: pipeline stages %s of %d on this rank, layers %s", mine, n_stages,
              [bounds[i] for i in mine])  # fmt: skip
    return StagePlan(container, first, last, bounds, mine, hf=_is_hf(model))


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
        self.layers = {index: list(_get(view, container).keys()) for index, view in stages}
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
