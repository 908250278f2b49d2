"""A user's module's activations measured, not assumed (issue 31).

The planner's per-block figure for a module whose family the layout table does not list (``ModelSpec.activations_of``:
one block run alone at four small sizes under ``saved_tensors_hooks``, fitted and scaled) must equal what autograd
saves in block 0 of the whole model at the planned micro-batch and sequence, counted independently here (the model's
own forward, every storage packed while block 0 runs, once, less the parameters and the block's input), to the byte,
on CPU in fp32 and bf16-true: a GPT-2-style module (LayerNorm, GELU MLP, learned positions, fused QKV, biases) and a
Hugging Face Gemma-2 model (extra norms, attention-logit soft-capping, eager attention).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

from jupyter_dist.plan import ModelSpec, TrainingShape  # noqa: E402
from jupyter_dist.plan.memory import activation_bytes_per_layer  # noqa: E402
from jupyter_dist.plan.parallel import ParallelDims  # noqa: E402
from jupyter_dist.plan.training import Checkpointing  # noqa: E402


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)  # fused qkv, with bias
        self.c_proj = nn.Linear(d, d)
        self.n_head = n_head

    def forward(self, x: Any) -> Any:
        b, s, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (t.view(b, s, self.n_head, d // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, s, d))


class GPT2Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_head)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x: Any) -> Any:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, vocab: int = 97, positions: int = 256, d: int = 64, n_head: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(positions, d)
        self.h = nn.ModuleList(GPT2Block(d, n_head) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: Any) -> Any:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _gemma2() -> Any:
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, attn_implementation="eager",
    )  # fmt: skip
    return transformers.Gemma2ForCausalLM(config)


def saved_in_first_block(model: Any, b: int, s: int, dtype: Any) -> int:
    """What autograd saves while block 0 of ``model`` runs in the model's own forward (storages once)."""
    from torch.autograd.graph import saved_tensors_hooks

    from jupyter_dist.worker._strategy import find_blocks

    model = model.to(dtype).train()
    block = find_blocks(model)[0]
    held = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held |= {t.untyped_storage().data_ptr() for t in model.buffers()}
    inside = [False]
    seen: dict[int, int] = {}

    def pre(_m: Any, args: Any, kwargs: Any) -> None:
        for t in list(args) + list(kwargs.values()):
            for x in t if isinstance(t, tuple) else (t,):
                if isinstance(x, torch.Tensor):
                    held.add(x.untyped_storage().data_ptr())
        inside[0] = True

    def post(*_: Any) -> None:
        inside[0] = False

    def pack(t: Any) -> Any:
        key = t.untyped_storage().data_ptr()
        if inside[0] and key and key not in held and key not in seen:
            seen[key] = int(t.untyped_storage().nbytes())
        return t

    h1 = block.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = block.register_forward_hook(post)
    try:
        with saved_tensors_hooks(pack, lambda t: t):
            out = model(torch.randint(0, 64, (b, s)))
    finally:
        h1.remove()
        h2.remove()
    del out
    return sum(seen.values())


MODELS = {"gpt2-style": GPT2, "gemma2": _gemma2}
DTYPES = {"fp32": torch.float32, "bf16-true": torch.bfloat16}


@pytest.mark.parametrize("precision", list(DTYPES))
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize(("b", "s"), [(2, 64), (3, 40)])
def test_planned_activations_equal_autograd_saved_bytes(name: str, precision: str, b: int, s: int) -> None:
    torch.manual_seed(0)
    model = MODELS[name]()
    spec = ModelSpec.from_module(model)
    assert spec.activations_of is not None
    training = TrainingShape(micro_batch=b, seq_len=s, precision=precision, checkpointing="none")
    planned = activation_bytes_per_layer(spec, training, ParallelDims(dp=1))
    measured = saved_in_first_block(model, b, s, DTYPES[precision])
    assert planned == measured, (name, precision, b, s, planned, measured)


def test_checkpointing_of_a_measured_block() -> None:
    spec = ModelSpec.from_module(GPT2)
    dims = ParallelDims(dp=1)
    none = activation_bytes_per_layer(spec, TrainingShape(micro_batch=2, seq_len=64, precision="fp32"), dims,
                                      recompute=Checkpointing.NONE)  # fmt: skip
    full = activation_bytes_per_layer(spec, TrainingShape(micro_batch=2, seq_len=64, precision="fp32"), dims,
                                      recompute=Checkpointing.FULL)  # fmt: skip
    assert full == 4 * 2 * 64 * 64  # the block input
    layer = TrainingShape(micro_batch=2, seq_len=64, precision="fp32", checkpointing="layer:2")
    assert activation_bytes_per_layer(spec, layer, dims) == (none + full) / 2


def test_listed_families_keep_the_layout_table() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    spec = ModelSpec.from_module(transformers.LlamaForCausalLM(config))
    assert spec.activations_of is None
