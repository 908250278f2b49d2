"""``jupyter_dist.plan(...)`` takes a model as ``measure_module`` documents it, and asks for heads it cannot read.

Issue 31: a class, an instance or a zero-argument callable (``lambda: GPT(cfg)`` was refused with "cannot plan for
a function"); a factory that fails is refused in one line; heads the structure does not state are asked for
(``heads=``), never guessed (a width guess planned 32 heads for a 16-head model of width 2048).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import jupyter_dist  # noqa: E402
from jupyter_dist.errors import PlanInputError  # noqa: E402
from jupyter_dist.plan import ModelSpec  # noqa: E402
from jupyter_dist.plan.planner import module_spec  # noqa: E402


@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 512
    n_layer: int = 2
    n_head: int = 16
    n_embd: int = 2048


class Attention(nn.Module):
    """nanoGPT's attention, reading its heads from ``self.config`` (``keeps_heads``: also as ``self.n_head``)."""

    def __init__(self, cfg: GPTConfig, keeps_config: bool = True) -> None:
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        if keeps_config:
            self.config = cfg
        else:  # the heads live in a closure: nothing in the module tree says 16
            self.split = lambda t: t.view(*t.shape[:-1], cfg.n_head, -1)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, keeps_config: bool) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg, keeps_config)
        w = cfg.n_embd
        self.mlp = nn.Sequential(nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, w))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig | None = None, keeps_config: bool = True) -> None:
        super().__init__()
        cfg = cfg or GPTConfig()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg, keeps_config) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight


def _gpt() -> GPT:
    return GPT(GPTConfig())


@pytest.mark.parametrize("make", [lambda: _gpt, lambda: GPT, lambda: _gpt(), lambda: (lambda: GPT(GPTConfig()))],
                         ids=["function", "class", "instance", "lambda"])  # fmt: skip
def test_plan_takes_an_instance_a_class_or_a_callable_building_one(make: Any) -> None:
    got = jupyter_dist.plan(make(), "h100-80gb")
    spec = got.model
    assert spec.source == "module" and spec.heads == 16 and not spec.dims_assumed  # not 2048 // 64 = 32
    assert spec.params == sum(p.numel() for p in _gpt().parameters())


def test_heads_the_structure_does_not_state_are_asked_for_not_guessed() -> None:
    def build() -> GPT:
        return GPT(GPTConfig(), keeps_config=False)

    asked = r"cannot find the attention heads of GPT \(width 2048\): pass heads=N"
    with pytest.raises(PlanInputError, match=asked) as e:
        jupyter_dist.plan(build)
    assert "\n" not in str(e.value)
    assert jupyter_dist.plan(build, heads=16).model.heads == 16
    assert module_spec(build, heads=16).heads == 16
    with pytest.raises(PlanInputError, match=r"heads=24 does not divide the width of GPT \(2048\)"):
        module_spec(build, heads=24)
    with pytest.raises(PlanInputError, match=r"heads must be a positive integer"):
        module_spec(build, heads=0)
    with pytest.raises(PlanInputError, match=r"cannot find the attention heads"):
        ModelSpec.from_module(build)
    with pytest.raises(PlanInputError, match=r"heads= is for a module"):
        jupyter_dist.plan("llama-3-8b", heads=16)


def test_a_factory_that_fails_says_so_in_one_line() -> None:
    def broken() -> GPT:
        raise ValueError("no such\nconfig file")

    with pytest.raises(PlanInputError) as e:
        jupyter_dist.plan(broken)
    assert str(e.value) == (
        "building the model with test_a_factory_that_fails_says_so_in_one_line.<locals>.broken() on the meta "
        "device failed: ValueError: no such config file"
    )


def test_cli_module_takes_heads(tmp_path: Any, monkeypatch: Any) -> None:
    from jupyter_dist.cli import build_parser
    from jupyter_dist.cli.flags import plan_from_args

    (tmp_path / "nohead_model.py").write_text(
        "from tests.test_plan_module_input import GPT, GPTConfig\n"
        "def build():\n    return GPT(GPTConfig(), keeps_config=False)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    args = build_parser().parse_args(["plan", "--module", "nohead_model:build", "--heads", "16"])
    got = plan_from_args(args)
    assert got.model.heads == 16 and got.model.source == "module"
