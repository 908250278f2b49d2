"""Code that exists both as a model and as a generated-script template stays the same code.

The generated ``train.py`` must be self-contained, so the mixture-of-experts demo model is a template
(``render/train/expert_tpl.py``: ``MOE``) beside the project's reference model (``models/moe.py``): this runs both on
the same weights and tokens and compares what they compute. (Pieces shared between templates, checkpoint discovery
and the grad-norm reduction, are one constant each: ``loop_tpl.LATEST_CHECKPOINT``, ``parallel_tpl.SQUARES_PER_MESH``
and ``parallel_tpl.CLIP_BY_TOTAL``.)
"""

from __future__ import annotations

from typing import Any

import pytest

from jupyter_dist.render.train import expert_tpl, loop_tpl, parallel_tpl, pipeline_tpl
from jupyter_dist.render.train.text import fill


def _template_moe(dim: int, experts: int, top_k: int) -> Any:
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.tensor import DTensor

    ns = {"torch": torch, "nn": nn, "F": F, "DTensor": DTensor, "__name__": "train_tpl"}
    exec(compile("from __future__ import annotations\n" + fill(expert_tpl.MOE), "expert_tpl.MOE", "exec"), ns)
    return ns["MoE"](dim, experts, top_k)


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_generated_moe_routes_and_computes_as_the_reference_model(top_k: int) -> None:
    torch = pytest.importorskip("torch")
    from jupyter_dist.models.moe import GroupedExperts, MoE, MoETransformerConfig

    dim, experts = 16, 4
    torch.manual_seed(0)
    generated = _template_moe(dim, experts, top_k)
    reference = MoE(MoETransformerConfig(dim=dim, n_heads=2, n_layers=1, vocab_size=32, n_experts=experts,
                                         top_k=top_k))  # fmt: skip
    reference.experts = GroupedExperts(experts, dim, 2 * dim)  # the template's expert width
    reference.load_state_dict(generated.state_dict())  # same names, same shapes: router.weight, experts.w1/w2/w3
    x = torch.randn(3, 5, dim)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = generated(xa), reference(xb)
    assert ya.shape == x.shape
    torch.testing.assert_close(ya, yb, rtol=0, atol=0)
    ya.square().sum().backward()
    yb.square().sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=0, atol=0)
    for (name, pa), (_, pb) in zip(generated.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=0, atol=0, msg=name)


def test_shared_template_pieces_appear_once_in_each_template() -> None:
    """Each shared piece is in both templates that use it, and nowhere typed out again."""
    uses = {
        loop_tpl.LATEST_CHECKPOINT: (loop_tpl.CHECKPOINT_DCP, pipeline_tpl.CHECKPOINT_PIPELINE),
        parallel_tpl.SQUARES_PER_MESH: (parallel_tpl.CLIP_MESHES, pipeline_tpl.CLIP_PIPELINE),
        parallel_tpl.CLIP_BY_TOTAL: (parallel_tpl.CLIP_MESHES, pipeline_tpl.CLIP_PIPELINE),
    }
    for piece, templates in uses.items():
        for template in templates:
            assert template.count(piece) == 1
