"""Expert parallelism inside a worker: experts split over an ``ep`` mesh dimension, tokens moved by all-to-all.

The ``ep`` ranks are borrowed from the data-parallel ranks (the planner's and torchtitan's convention): the
``dp_shard x cp`` ranks that shard the dense model states are unflattened into ``(efsdp, ep)`` (``ep`` innermost,
so an expert group is ranks that sit close together) on the same root mesh. Each expert-parallel rank owns
``n_experts / ep`` experts (the grouped ``(n_experts, ...)`` parameters become DTensors ``Shard(0)`` on ``ep``);
FSDP2 then shards those local experts over ``efsdp`` (``dp_shard x cp / ep`` ranks; 2-D with ``dp_replicate`` for
HSDP), while the dense parameters stay sharded over all the data-parallel ranks.

The forward of an experts module takes ``(tokens sorted by expert, count per expert)`` (the protocol of
:class:`jupyter_dist.models.moe.GroupedExperts`); :class:`ExpertParallel` wraps it in two all-to-alls over the
``ep`` group (the same structure as torchtitan's ``ExpertParallel``, read, not copied): the counts first (how many
tokens each rank receives for each of its experts), then the tokens themselves with
``all_to_all_single_autograd`` (its backward is the reverse all-to-all, so gradients flow back to the routers and
the tokens' origin), regrouped by local expert; after the experts, the inverse regrouping and the return
all-to-all restore the caller's order.

Each expert's gradient is the sum over the tokens of the ``ep`` ranks that sent it tokens, reduce-scattered over
``efsdp``: together every data-parallel rank's tokens, so FSDP divides it by the data-parallel size (not its own
``efsdp`` size) to make it the same mean the dense parameters get.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import TYPE_CHECKING, Any

from ._env import WorkerEnv, WorkerError

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch.distributed.device_mesh import DeviceMesh

Mesh = Any
"""``_parallel.Mesh`` (not imported: ``_parallel`` imports this module, and the package has no import circles)."""

__all__ = ["ExpertParallel", "add_expert_mesh", "apply_expert_parallel", "find_experts", "shard_experts"]

_log = logging.getLogger("jupyter_dist.worker")


def find_experts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The grouped-experts modules: a ``num_experts`` attribute and only 3-D ``(num_experts, ...)`` parameters."""
    out = []
    for name, m in model.named_modules():
        n = getattr(m, "num_experts", None)
        ps = list(m.parameters(recurse=False))
        if isinstance(n, int) and n > 1 and ps and all(p.dim() == 3 and p.shape[0] == n for p in ps):
            out.append((name, m))
    return out


def add_expert_mesh(mesh: Mesh, env: WorkerEnv, *, family: str) -> Mesh:
    """The run's mesh with its ``(efsdp, ep)`` expert mesh, carved from ``dp_shard x cp`` on the same root."""
    ep, shard, cp = env.ep, mesh.sizes["dp_shard"], mesh.sizes["cp"]
    if family != "fsdp2":
        raise WorkerError(
            f"jd.wrap: expert parallelism (ep{ep}) composes with fsdp2 only, not JD_STRATEGY={env.strategy}; run "
            f"the fsdp2+ep{ep} candidate"
        )
    if (shard * cp) % ep:
        raise WorkerError(
            f"jd.wrap: ep={ep} must divide the data-parallel shard ranks dp_shard x cp = {shard} x {cp} = "
            f"{shard * cp} it borrows from; use an ep degree among "
            f"{', '.join(str(d) for d in range(2, shard * cp + 1) if shard * cp % d == 0) or 'none (1 rank)'}"
        )
    root = mesh.mesh
    source = root["dp_shard"] if cp == 1 else root["dp_shard", "cp"]._flatten("dp_shard_cp")
    expert = source._unflatten(0, (shard * cp // ep, ep), ("efsdp", "ep"))
    return dataclasses.replace(mesh, expert=expert)


def _expert_fsdp_mesh(mesh: Mesh) -> DeviceMesh:
    """What FSDP2 shards experts over: ``efsdp``, with ``dp_replicate`` outside it for HSDP."""
    from torch.distributed.device_mesh import DeviceMesh

    assert mesh.expert is not None
    if mesh.sizes["dp_replicate"] > 1:
        return DeviceMesh._concatenate([mesh.mesh["dp_replicate"], mesh.expert["efsdp"]])
    return mesh.expert["efsdp"]


class _Dispatch:
    """What one forward's dispatch leaves for its combine."""

    def __init__(self, perm: torch.Tensor, send: list[int], recv: list[int]) -> None:
        self.perm, self.send, self.recv = perm, send, recv
        """The regrouping by local expert of the received tokens; the all-to-all split sizes out and back."""
        self.routed: tuple[torch.Tensor, torch.Tensor, int] | None = None
        """Routed protocol: the slots' order by expert, the routing weights, top-k."""
        self.swapped: dict[str, torch.Tensor] = {}
        """Routed protocol: the DTensor parameters swapped for their local shards during the forward."""
        self.num_experts = 0


def _routed(module: torch.nn.Module) -> bool:
    """Whether the experts take ``(hidden_states, top_k_index, top_k_weights)``, not ``(sorted tokens, counts)``.

    The first is transformers 5's grouped experts (``MixtralExperts``, ``Qwen3MoeExperts``, ...).
    """
    import inspect

    try:
        return "top_k_index" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtin forwards
        return False


def _exchange(x: torch.Tensor, counts: torch.Tensor, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor, _Dispatch]:
    """Send tokens sorted by global expert to the ranks owning the experts; regroup what arrives by local expert."""
    import torch
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    ep = mesh.size()
    local = counts.numel() // ep
    group = mesh.get_group()
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # [source rank, local expert] counts
    received = received.view(ep, local)
    send = counts.view(ep, local).sum(1).tolist()
    recv = received.sum(1).tolist()
    y = all_to_all_single_autograd(x, recv, send, group)
    # y holds source 0's tokens for local experts 0..L-1, then source 1's, ...: regroup by expert
    flat = received.flatten()
    starts = (torch.cumsum(flat, 0) - flat).view(ep, local)
    perm = torch.cat([
        torch.arange(int(starts[s, e]), int(starts[s, e] + received[s, e]))
        for e in range(local) for s in range(ep)
    ] or [torch.zeros(0, dtype=torch.long)]).to(x.device)  # fmt: skip
    return y[perm], received.sum(0), _Dispatch(perm, send, recv)


@functools.cache
def _make_style() -> Any:
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class ExpertParallel(ParallelStyle):
        """Split a grouped-experts module's parameters along dim 0 over the mesh; dispatch and combine tokens.

        Parameters of a real model come from ep rank 0 (``src_data_rank=0``: every rank starts from the same
        experts); a meta model's are left to be materialised. Two input protocols: ``(tokens sorted by expert,
        count per expert)`` (the project's ``GroupedExperts``), and ``(hidden_states, top_k_index, top_k_weights)``
        (transformers 5's grouped experts), whose forward then runs unchanged on the tokens this rank received,
        each with its one local expert and weight 1, the routing weights being applied after the combine.
        """

        def __init__(self, *, on_meta: bool = False) -> None:
            super().__init__()
            self.on_meta = on_meta

        def _partition(self, name: str, module: torch.nn.Module, mesh: DeviceMesh) -> None:
            import torch
            from torch.distributed.tensor import Shard, distribute_tensor

            for pname, p in list(module.named_parameters(recurse=False)):
                dt = distribute_tensor(p.data, mesh, [Shard(0)], src_data_rank=None if self.on_meta else 0)
                module.register_parameter(pname, torch.nn.Parameter(dt, requires_grad=p.requires_grad))

        @staticmethod
        def _dispatch(module: torch.nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            import torch

            if not _routed(module):
                x, counts, d = _exchange(inputs[0], inputs[1], mesh)
                module._jd_dispatch = d  # type: ignore[assignment]
                return (x, counts, *inputs[2:])
            from torch.distributed.tensor import DTensor

            hidden, index, weights = inputs[0], inputs[1], inputs[2]
            n_experts = int(module.num_experts)
            top_k = index.shape[-1]
            flat = index.flatten()
            order = torch.argsort(flat, stable=True)
            x, counts, d = _exchange(hidden[order // top_k], torch.bincount(flat, minlength=n_experts), mesh)
            d.routed, d.num_experts = (order, weights, top_k), n_experts
            local = n_experts // mesh.size()
            idx = torch.repeat_interleave(torch.arange(local, device=x.device), counts).unsqueeze(1)
            ones = torch.ones(idx.shape, dtype=weights.dtype, device=x.device)
            # the experts' forward indexes its parameters by local expert: give it the local shards (as
            # transformers' own _use_local_dtensor_params does) and the local count, restored by the combine
            d.swapped = {n: p for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
            module._parameters.update({n: p.to_local() for n, p in d.swapped.items()})  # type: ignore[misc]
            module.num_experts = local
            module._jd_dispatch = d  # type: ignore[assignment]
            return (x, idx, ones, *inputs[3:])

        @staticmethod
        def _combine(module: torch.nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
            import torch
            from torch.distributed._functional_collectives import all_to_all_single_autograd

            d: _Dispatch = module._jd_dispatch  # type: ignore[assignment]
            back = out[torch.argsort(d.perm)]  # source-major order again
            # not waited here: the waited tensor is a view, which FSDP2 warns about as an output of the module;
            # the caller's first use waits
            result = all_to_all_single_autograd(back, d.send, d.recv, mesh.get_group())
            if d.routed is None:
                return result
            module._parameters.update(d.swapped)  # type: ignore[arg-type]
            module.num_experts = d.num_experts
            d.swapped = {}
            order, weights, top_k = d.routed
            slots = result[torch.argsort(order)].view(-1, top_k, result.shape[-1])  # (token, slot) order
            return (slots * weights.unsqueeze(-1).to(slots.dtype)).sum(1)

        def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
            from torch.distributed.tensor import distribute_module

            return distribute_module(module, device_mesh, self._partition, self._dispatch, self._combine)

        def __repr__(self) -> str:
            return "ExpertParallel(Shard(0), all-to-all dispatch and combine)"

    return ExpertParallel


def ExpertParallel(*, on_meta: bool = False) -> Any:  # noqa: N802 - a factory standing in for the class
    """A ``ParallelStyle`` that splits grouped experts along dim 0 and moves tokens with all-to-all."""
    return _make_style()(on_meta=on_meta)


def apply_expert_parallel(model: torch.nn.Module, mesh: Mesh, *, on_meta: bool) -> int:
    """Split every grouped-experts module of ``model`` over the ``ep`` mesh; returns how many were split."""
    from torch.distributed.tensor.parallel import parallelize_module

    assert mesh.expert is not None
    ep = mesh.expert["ep"].size()
    experts = find_experts(model)
    kind = type(model).__name__
    if not experts:
        raise WorkerError(
            f"jd.wrap: expert parallelism (ep{ep}) needs a mixture-of-experts model with grouped experts (a module "
            f"with num_experts and (num_experts, ...) parameters, like jupyter_dist.models.MoETransformer); {kind} "
            "has none; run without ep (JD_EP=1)"
        )
    for name, m in experts:
        if m.num_experts % ep:
            raise WorkerError(
                f"jd.wrap: ep={ep} does not divide the {m.num_experts} experts of {name} in {kind}; use an ep degree "
                f"among {', '.join(str(d) for d in range(2, m.num_experts + 1) if m.num_experts % d == 0)}"
            )
    parallelize_module(model, mesh.expert["ep"], {name: ExpertParallel(on_meta=on_meta) for name, _ in experts})
    _log.info("jd.wrap: expert parallelism ep%d over %d experts modules (%s)", ep, len(experts), mesh.describe())
    return len(experts)


def shard_experts(model: torch.nn.Module, mesh: Mesh, mp: Any, *, reshard_after_forward: bool = True) -> None:
    """FSDP2 over the expert mesh for each experts module (before the blocks', which then skip their parameters)."""
    from torch.distributed.fsdp import fully_shard

    dp = mesh.sizes["dp_replicate"] * mesh.sizes["dp_shard"]
    emesh = _expert_fsdp_mesh(mesh)
    assert mesh.expert is not None
    efsdp = mesh.expert["efsdp"].size()
    for _, m in find_experts(model):
        fully_shard(m, mesh=emesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        m.set_gradient_divide_factor(float(dp))  # type: ignore[operator]
        if efsdp > 1:
            # a custom factor is a PREMUL_SUM reduce-scatter, which gloo lacks: sum, then divide. Not with one
            # efsdp rank: there FSDP2 (torch 2.13, foreach_reduce) divides in its single-rank copy and again after,
            # a gradient half too small (caught by tests/test_expert_parallel.py's ep2 on 2 processes)
            m.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    _log.info("jd.wrap: experts sharded over %s, gradients divided by the %d data-parallel ranks", emesh, dp)
