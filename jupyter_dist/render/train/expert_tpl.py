"""Templates: expert parallelism (a mixture-of-experts demo model, experts split over ``ep``, all-to-all).

As the workers run it (:mod:`jupyter_dist.worker._expert`, :mod:`jupyter_dist.models.moe`): the experts' weights are
grouped 3-D parameters ``(experts, ...)``, split along dim 0 over the ``ep`` ranks, which are borrowed from the
data-parallel shard ranks (``dp_shard`` regrouped as ``(efsdp, ep)``, ep innermost); tokens travel to their
experts' ranks and back with two all-to-alls; FSDP2 shards each rank's experts over ``efsdp`` and divides their
gradients by the data-parallel size, so they are the same mean the dense parameters get.
"""

from __future__ import annotations

__all__ = ["MOE", "EXPERT_PARALLEL"]

MOE = '''
class GroupedExperts(nn.Module):
    """SwiGLU MLPs as three 3-D parameters, expert index first (what expert parallelism splits along dim 0).

    forward(x, counts) takes tokens sorted by expert and how many go to each expert this module holds (under expert
    parallelism: this rank's), and returns each token's output in the same order.
    """

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) * dim**-0.5)
        self.w3 = nn.Parameter(torch.randn(experts, dim, hidden) * dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) * hidden**-0.5)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each expert's MLP on its contiguous run of tokens."""
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            xe = x[start : start + n]
            outs.append((F.silu(xe @ w1[e]) * (xe @ w3[e])) @ w2[e])
            start += n
        return torch.cat(outs) if outs else x[:0]


class MoE(nn.Module):
    """A top-k mixture of experts (Mixtral's routing): each token goes to its top_k most probable experts.

    Their outputs are summed with the chosen probabilities renormalised to 1. REPLACE for real training: add a
    load-balancing loss (e.g. Switch Transformer's) to the loss; the demo trains without one.
    """

    def __init__(self, dim: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = GroupedExperts(experts, dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route each token, run the experts on the tokens sorted by expert, combine with the routing weights."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        order = torch.argsort(chosen.flatten(), stable=True)  # routing slots by expert, in token order within one
        counts = torch.bincount(chosen.flatten(), minlength=self.experts.num_experts)
        out = self.experts(tokens[order // self.top_k], counts)
        out = out[torch.argsort(order)].view(-1, self.top_k, shape[-1])  # back to (token, slot) order
        return (out * weights.unsqueeze(-1).to(out.dtype)).sum(1).view(shape)
'''

EXPERT_PARALLEL = '''
class ExpertParallel(ParallelStyle):
    """Split grouped experts along dim 0 over the ep ranks; send each token to its expert's rank and back.

    Each ep rank keeps EXPERTS / EP experts (ep rank 0's initial weights). Before the experts run, two all-to-alls
    over the ep group: the counts (how many tokens each rank sends to each of this rank's experts), then the tokens,
    regrouped by local expert; after them, the inverse regrouping and the return all-to-all restore the caller's
    order. all_to_all_single_autograd's backward is the reverse all-to-all, so gradients flow back to the tokens.
    """

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for key, param in list(module.named_parameters(recurse=False)):
            split = distribute_tensor(param.data, mesh, [Shard(0)], src_data_rank=0)
            module.register_parameter(key, nn.Parameter(split, requires_grad=param.requires_grad))

    @staticmethod
    def _dispatch(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
        x, counts = inputs[0], inputs[1]
        ep, group = mesh.size(), mesh.get_group()
        local = counts.numel() // ep
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)  # [source rank, local expert] token counts
        received = received.view(ep, local)
        send, recv = counts.view(ep, local).sum(1).tolist(), received.sum(1).tolist()
        y = all_to_all_single_autograd(x, recv, send, group)
        # y holds source 0's tokens for local experts 0..L-1, then source 1's, ...: regroup them by local expert
        flat = received.flatten()
        starts = (torch.cumsum(flat, 0) - flat).view(ep, local)
        perm = torch.cat([
            torch.arange(int(starts[s, e]), int(starts[s, e] + received[s, e])) for e in range(local) for s in range(ep)
        ] or [torch.zeros(0, dtype=torch.long)]).to(x.device)
        module.routing = (perm, send, recv)  # for the combine
        return y[perm], received.sum(0)

    @staticmethod
    def _combine(module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        perm, send, recv = module.routing
        return all_to_all_single_autograd(out[torch.argsort(perm)], send, recv, mesh.get_group())

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._dispatch, self._combine)


@functools.cache
def expert_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """(efsdp, ep): the <<shard_what>> regrouped, ep innermost (an expert group's ranks are neighbours).

    Expert parallelism borrows its ranks from data parallelism: every ep rank still reads its own batch.
    """
    shard = <<shard_mesh>>
    if shard.size() % EP:
        raise SystemExit(f"expert parallelism: EP = {EP} must divide the {shard.size()} <<shard_what>>")
    return shard._unflatten(0, (shard.size() // EP, EP), ("efsdp", "ep"))
'''
