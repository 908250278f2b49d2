"""The model-spec layer against published figures: presets, Hugging Face configs, bare counts, real modules.

Every count asserted here is a published one, not one this package computed; where the source rounds (Mixtral's
"12.9B active"), the exact value is derived in a comment and the rounded figure is checked as well.
"""

from __future__ import annotations

import json
import math
import resource
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from jupyter_dist.errors import PlanInputError, UnknownModelError
from jupyter_dist.plan.model import PRESETS, ModelSpec, get_preset, preset_names

# ---------------------------------------------------------------------------------------------------------------
# Published parameter counts
# ---------------------------------------------------------------------------------------------------------------
# Llama, Mistral, Mixtral: the "total" of the safetensors metadata of the official Hugging Face repository (the
# "Model size ... params" line of the model card page): meta-llama/Llama-2-7b-hf, meta-llama/Llama-2-13b-hf,
# meta-llama/Llama-2-70b-hf, meta-llama/Meta-Llama-3-8B, meta-llama/Meta-Llama-3-70B, meta-llama/Llama-3.1-405B,
# meta-llama/Llama-3.2-1B, mistralai/Mistral-7B-v0.1, mistralai/Mixtral-8x7B-v0.1.
# GPT-2: transformers' GPT2LMHeadModel.from_pretrained("openai-community/gpt2*").num_parameters(), the figure the
# community quotes for "GPT-2 124M" (nanoGPT, llm.c). The Hub's safetensors totals for these repositories (137M,
# 380M, 812M, 1.61B) are larger by exactly layers x 1024 x 1024: they also store each block's non-trainable causal
# mask buffer attn.bias. The GPT-2 paper's Table 2 (117M, 345M, 762M, 1542M) miscounts and is not used.
PUBLISHED: dict[str, int] = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
    "llama-3.2-1b": 1_235_814_400,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
}
# Qwen/Qwen2-0.5B: safetensors total on the Hugging Face model card (494M; the Qwen2 technical report says 0.49B).
QWEN2_0_5B_PARAMS = 494_032_768
# Mixtral active parameters per token: "46.7B total parameters but only uses 12.9B parameters per token" (Mistral AI,
# "Mixtral of experts", mistral.ai/news/mixtral-of-experts, Dec 2023; Jiang et al. 2024, arXiv:2401.04088, rounds to
# 13B). Exactly: 46,702,792,704 - 32 layers x 6 unrouted experts x 3 x 4096 x 14336 = 12,879,925,248.
MIXTRAL_ACTIVE = 12_879_925_248
# The weights of Llama-2-7B in fp32, which a model built off the meta device would take.
LLAMA_2_7B_FP32_BYTES = 4 * PUBLISHED["llama-2-7b"]


@pytest.mark.parametrize(("name", "published"), PUBLISHED.items(), ids=list(PUBLISHED))
def test_preset_parameter_count_is_the_published_one(name: str, published: int) -> None:
    spec = get_preset(name)
    assert spec.params == published
    assert spec.params_from_dims == published  # no override: the dimensions alone give the count
    assert spec.source == "preset" and not spec.dims_assumed


def test_every_preset_has_a_published_count() -> None:
    assert sorted(preset_names()) == sorted(PUBLISHED)


def test_mixtral_active_params_are_the_published_12_9b() -> None:
    spec = get_preset("mixtral-8x7b")
    assert spec.active_params == MIXTRAL_ACTIVE
    assert round(spec.active_params / 1e9, 1) == 12.9
    assert round(spec.params / 1e9, 1) == 46.7
    assert spec.total_expert_params == 32 * 8 * 3 * 4096 * 14336


@pytest.mark.parametrize("name", [n for n in PUBLISHED if n != "mixtral-8x7b"])
def test_dense_models_use_every_parameter(name: str) -> None:
    spec = get_preset(name)
    assert spec.active_params == spec.params
    assert spec.total_expert_params == 0


@pytest.mark.parametrize(
    ("alias", "name"),
    [("GPT-2", "gpt2"), ("Llama2-7B", "llama-2-7b"), ("llama_3_8b".replace("_", "-"), "llama-3-8b"),
     ("mixtral", "mixtral-8x7b"), ("  Llama-3.1-70B ", "llama-3-70b"), ("MISTRAL_7B", "mistral-7b")],
)  # fmt: skip
def test_preset_lookup_is_case_insensitive_with_aliases(alias: str, name: str) -> None:
    assert ModelSpec.from_preset(alias) is PRESETS[name]


@pytest.mark.parametrize(
    ("typo", "hint"), [("llama-2-7", "llama-2-7b"), ("gpt2-xxl", "gpt2-xl"), ("mistral", "mistral-7b")]
)
def test_unknown_preset_says_did_you_mean(typo: str, hint: str) -> None:
    with pytest.raises(UnknownModelError, match=rf"unknown model '{typo}' \(did you mean '{hint}'\?\)") as info:
        get_preset(typo)
    assert isinstance(info.value, PlanInputError)
    assert "valid presets: gpt2, " in str(info.value)


def test_unknown_preset_without_a_close_match_lists_the_choices() -> None:
    with pytest.raises(UnknownModelError, match="valid presets: .*mixtral-8x7b") as info:
        get_preset("bert-base-uncased")
    assert "did you mean" not in str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face config.json, written out as published in each repository (no network in tests)
# ---------------------------------------------------------------------------------------------------------------
# openai-community/gpt2 config.json (no tie_word_embeddings key: GPT-2 always ties lm_head to wte)
GPT2_CONFIG: dict[str, Any] = {
    "activation_function": "gelu_new",
    "architectures": ["GPT2LMHeadModel"],
    "attn_pdrop": 0.1,
    "bos_token_id": 50256,
    "embd_pdrop": 0.1,
    "eos_token_id": 50256,
    "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2",
    "n_ctx": 1024,
    "n_embd": 768,
    "n_head": 12,
    "n_layer": 12,
    "n_positions": 1024,
    "resid_pdrop": 0.1,
    "summary_activation": None,
    "summary_first_dropout": 0.1,
    "summary_proj_to_labels": True,
    "summary_type": "cls_index",
    "summary_use_proj": True,
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
    "vocab_size": 50257,
}
# meta-llama/Llama-2-7b-hf config.json
LLAMA_2_7B_CONFIG: dict[str, Any] = {
    "_name_or_path": "meta-llama/Llama-2-7b-hf",
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 4096,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.31.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}
# meta-llama/Meta-Llama-3-8B config.json
LLAMA_3_8B_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
# mistralai/Mixtral-8x7B-v0.1 config.json
MIXTRAL_CONFIG: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}
# Qwen/Qwen2-0.5B config.json: tied embeddings, and Qwen2 always has q/k/v biases (no key says so)
QWEN2_0_5B_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 131072,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# (config, published count, fields the spec must have)
HF_CASES: dict[str, tuple[dict[str, Any], int, dict[str, Any]]] = {
    "gpt2": (GPT2_CONFIG, PUBLISHED["gpt2"], dict(
        layers=12, hidden=768, heads=12, kv_heads=0, ffn=0, vocab=50257, tied_embeddings=True, gated_mlp=False,
        norm="layernorm", qkv_bias=True, out_bias=True, mlp_bias=True, max_positions=1024, dropout=True)),
    "llama-2-7b": (LLAMA_2_7B_CONFIG, PUBLISHED["llama-2-7b"], dict(
        name="meta-llama/Llama-2-7b-hf", layers=32, hidden=4096, heads=32, kv_heads=0, ffn=11008, vocab=32000,
        tied_embeddings=False, gated_mlp=True, norm="rmsnorm", qkv_bias=False, max_positions=0)),
    "llama-3-8b": (LLAMA_3_8B_CONFIG, PUBLISHED["llama-3-8b"], dict(
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, tied_embeddings=False,
        gated_mlp=True, qkv_bias=False, experts=1, dropout=False)),
    "mixtral-8x7b": (MIXTRAL_CONFIG, PUBLISHED["mixtral-8x7b"], dict(
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000, experts=8, top_k=2,
        tied_embeddings=False)),
    "qwen2-0.5b": (QWEN2_0_5B_CONFIG, QWEN2_0_5B_PARAMS, dict(
        layers=24, hidden=896, heads=14, kv_heads=2, ffn=4864, vocab=151936, tied_embeddings=True,
        qkv_bias=True, out_bias=False, gated_mlp=True, max_positions=0)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_config_dict_gives_the_published_count(case: str) -> None:
    config, published, expected = HF_CASES[case]
    spec = ModelSpec.from_hf_config(config)
    assert spec.params == published
    assert spec.source == "hf-config" and not spec.dims_assumed and not spec.params_override
    assert {k: getattr(spec, k) for k in expected} == expected


@pytest.mark.parametrize("case", ["gpt2", "llama-2-7b", "llama-3-8b", "mixtral-8x7b"])
def test_hf_config_has_the_dimensions_of_the_preset(case: str) -> None:
    spec = ModelSpec.from_hf_config(HF_CASES[case][0])
    preset = get_preset(case)
    # every dimension, bias and dropout flag agrees; only the display name and the source differ
    assert spec.with_(name=preset.name, source="preset") == preset


@pytest.mark.parametrize(
    ("model_type", "qk_norm"), [("qwen3", True), ("qwen3_moe", True), ("qwen2", False), ("llama", False)]
)
def test_per_head_query_key_norms_are_counted_as_the_module_has_them(model_type: str, qk_norm: bool) -> None:
    """Qwen3's ``q_norm``/``k_norm`` (one ``head_dim`` weight each per layer): the spec's count equals the real
    module's, built from the same config on the meta device (Qwen3-1.7B's shape, 4 layers; an MoE variant)."""
    transformers = pytest.importorskip("transformers")
    config = {"model_type": model_type, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 4,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
              "hidden_act": "silu", "tie_word_embeddings": True, "attention_bias": False}  # fmt: skip
    if model_type == "qwen3_moe":
        config.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=768, decoder_sparse_step=1,
                      mlp_only_layers=[])  # fmt: skip
    spec = ModelSpec.from_hf_config(config)
    assert spec.qk_norm is qk_norm
    hf = transformers.CONFIG_MAPPING[model_type](**{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        module = transformers.AutoModelForCausalLM.from_config(hf)
    assert spec.params == sum(p.numel() for p in module.parameters())


def test_mixtral_from_hf_config_has_the_published_active_params() -> None:
    assert ModelSpec.from_hf_config(MIXTRAL_CONFIG).active_params == MIXTRAL_ACTIVE


def test_hf_config_is_not_mutated() -> None:
    config = json.loads(json.dumps(LLAMA_3_8B_CONFIG))
    ModelSpec.from_hf_config(config)
    assert config == LLAMA_3_8B_CONFIG


@pytest.mark.parametrize("case", list(HF_CASES))
@pytest.mark.parametrize("form", ["file-str", "file-path", "folder-str", "folder-path"])
def test_hf_config_from_a_file_or_a_folder_holding_config_json(case: str, form: str, tmp_path: Path) -> None:
    config, published, _ = HF_CASES[case]
    (tmp_path / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    target = tmp_path / "config.json" if form.startswith("file") else tmp_path
    arg: str | Path = str(target) if form.endswith("str") else target
    spec = ModelSpec.from_hf_config(arg)
    assert spec.params == published
    assert spec == ModelSpec.from_hf_config(config)


def test_hf_config_of_a_multimodal_wrapper_reads_text_config() -> None:
    wrapped = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
               "vision_config": {"hidden_size": 1024}, "text_config": LLAMA_2_7B_CONFIG}  # fmt: skip
    assert ModelSpec.from_hf_config(wrapped).params == PUBLISHED["llama-2-7b"]


# ---- errors ---------------------------------------------------------------------------------------------------
def _without(config: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k != key}


@pytest.mark.parametrize(
    ("config", "match"),
    [
        pytest.param(
            _without(LLAMA_2_7B_CONFIG, "num_hidden_layers"),
            r"has no layers: expected one of the keys num_hidden_layers",
            id="no-layers",
        ),
        pytest.param(
            _without(LLAMA_2_7B_CONFIG, "hidden_size"),
            r"has no hidden: expected one of the keys hidden_size, n_embd",
            id="no-hidden",
        ),
        pytest.param(
            _without(LLAMA_2_7B_CONFIG, "num_attention_heads"),
            r"has no heads: .*num_attention_heads, n_head",
            id="no-heads",
        ),
        pytest.param(
            _without(LLAMA_2_7B_CONFIG, "vocab_size"),
            r"has no vocab: expected one of the keys vocab_size",
            id="no-vocab",
        ),
        pytest.param(
            _without(GPT2_CONFIG, "n_layer"),
            r"has no layers: expected one of the keys num_hidden_layers, n_layer",
            id="gpt2-no-n_layer",
        ),
        pytest.param({**LLAMA_2_7B_CONFIG, "num_hidden_layers": None}, r"has no layers", id="layers-null"),
        pytest.param({}, r"has no layers", id="empty"),
        pytest.param(
            {**LLAMA_2_7B_CONFIG, "num_hidden_layers": "thirty-two"},
            r"num_hidden_layers \(layers\) must be an integer",
            id="layers-str",
        ),
        pytest.param(
            {**LLAMA_2_7B_CONFIG, "hidden_size": 4096.5},
            r"hidden_size \(hidden\) must be an integer, got 4096.5",
            id="hidden-float",
        ),
        pytest.param(
            {**LLAMA_2_7B_CONFIG, "intermediate_size": [11008]},
            r"intermediate_size \(ffn\) must be an integer",
            id="ffn-list",
        ),
        pytest.param(
            {**LLAMA_2_7B_CONFIG, "vocab_size": True}, r"vocab_size \(vocab\) must be an integer", id="vocab-bool"
        ),
        pytest.param(
            {**LLAMA_2_7B_CONFIG, "num_hidden_layers": 0},
            r"model layers must be a positive integer, got 0",
            id="layers-0",
        ),
        pytest.param(
            {**LLAMA_2_7B_CONFIG, "hidden_size": -4096},
            r"model hidden must be a positive integer, got -4096",
            id="hidden-negative",
        ),
        pytest.param(
            {**LLAMA_2_7B_CONFIG, "vocab_size": 0}, r"model vocab must be a positive integer, got 0", id="vocab-0"
        ),
        pytest.param(
            {**LLAMA_2_7B_CONFIG, "intermediate_size": -1},
            r"model ffn must be a non-negative integer, got -1",
            id="ffn-negative",
        ),
        pytest.param(
            {**LLAMA_2_7B_CONFIG, "num_attention_heads": 30},
            r"hidden \(4096\) is not divisible by heads \(30\)",
            id="heads-not-dividing-hidden",
        ),
        pytest.param(
            {**LLAMA_3_8B_CONFIG, "num_key_value_heads": 6},
            r"kv_heads \(6\) must divide heads \(32\)",
            id="kv-not-dividing-heads",
        ),
        pytest.param(
            {**LLAMA_3_8B_CONFIG, "num_key_value_heads": 64},
            r"kv_heads \(64\) must divide heads \(32\)",
            id="kv-above-heads",
        ),
        pytest.param(
            {**MIXTRAL_CONFIG, "num_experts_per_tok": 9},
            r"top_k \(9\) cannot exceed experts \(8\)",
            id="top_k-above-experts",
        ),
        pytest.param(
            {**MIXTRAL_CONFIG, "num_experts_per_tok": 0}, r"model top_k must be a positive integer, got 0", id="top_k-0"
        ),
    ],
)
def test_bad_hf_config_names_the_field(config: dict[str, Any], match: str) -> None:
    with pytest.raises(PlanInputError, match=match):
        ModelSpec.from_hf_config(config)


def test_hf_config_file_with_bad_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"hidden_size": 4096,\n "num_hidden_layers": }', encoding="utf-8")
    with pytest.raises(PlanInputError, match=r"config.json is not valid JSON: Expecting value at line 2"):
        ModelSpec.from_hf_config(path)


def test_hf_config_file_that_is_not_text(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(PlanInputError, match=r"config.json is not valid JSON"):
        ModelSpec.from_hf_config(path)


def test_hf_config_file_that_is_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("[4096, 32]", encoding="utf-8")
    with pytest.raises(PlanInputError, match=r"must be a JSON object"):
        ModelSpec.from_hf_config(path)


@pytest.mark.parametrize("where", ["file", "folder"])
def test_hf_config_missing_file(where: str, tmp_path: Path) -> None:
    target = tmp_path / "nope.json" if where == "file" else tmp_path  # an empty folder: no config.json in it
    with pytest.raises(PlanInputError, match=r"Hugging Face config not found: .*(nope|config)\.json"):
        ModelSpec.from_hf_config(target)


@pytest.mark.parametrize("bad", [42, None, ["hidden_size", 4096]])
def test_hf_config_of_the_wrong_type(bad: Any) -> None:
    with pytest.raises(PlanInputError, match=r"expected a config.json path, a folder holding one, or a dict"):
        ModelSpec.from_hf_config(bad)


# ---- direct construction errors -------------------------------------------------------------------------------
DIMS: dict[str, Any] = dict(layers=2, hidden=64, heads=4, vocab=100)


@pytest.mark.parametrize("field", ["layers", "hidden", "heads", "vocab", "experts", "top_k"])
@pytest.mark.parametrize("value", [0, -1, 2.0, True, "8"])
def test_non_positive_or_non_integer_dims_are_rejected(field: str, value: Any) -> None:
    with pytest.raises(PlanInputError, match=rf"model {field} must be a positive integer, got {value!r}"):
        ModelSpec(**{**DIMS, field: value})


@pytest.mark.parametrize("field", ["kv_heads", "head_dim", "ffn", "max_positions", "params_override"])
def test_negative_optional_dims_are_rejected(field: str) -> None:
    with pytest.raises(PlanInputError, match=rf"model {field} must be a non-negative integer, got -1"):
        ModelSpec(**{**DIMS, field: -1})


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(hidden=100, heads=3), r"hidden \(100\) is not divisible by heads \(3\); give head_dim"),
        (dict(heads=4, kv_heads=3), r"kv_heads \(3\) must divide heads \(4\)"),
        (dict(heads=4, kv_heads=8), r"kv_heads \(8\) must divide heads \(4\)"),
        (dict(experts=2, top_k=3), r"top_k \(3\) cannot exceed experts \(2\)"),
        (dict(top_k=2), r"top_k \(2\) cannot exceed experts \(1\)"),
        (dict(norm="batchnorm"), r"model norm must be 'rmsnorm' or 'layernorm', got 'batchnorm'"),
    ],
)
def test_inconsistent_dims_are_rejected(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(PlanInputError, match=match):
        ModelSpec(**{**DIMS, **changes})
    with pytest.raises(PlanInputError, match=match):  # and again when changed on a valid spec
        ModelSpec(**DIMS).with_(**changes)


def test_explicit_head_dim_lifts_the_divisibility_rule() -> None:
    spec = ModelSpec(layers=2, hidden=100, heads=3, head_dim=32, vocab=10)
    assert (spec.q_dim, spec.kv_dim) == (96, 96)


# ---------------------------------------------------------------------------------------------------------------
# Real modules: a faithful Llama (RMSNorm, rotary GQA attention, SwiGLU or top-k MoE) and a faithful GPT-2
# ---------------------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotary(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding in the Hugging Face rotate-half layout; x is (batch, heads, seq, head_dim)."""
    d, t = x.shape[-1], x.shape[-2]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angles = torch.outer(torch.arange(t, dtype=torch.float32, device=x.device), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, hidden // n_heads
        self.q_proj = nn.Linear(hidden, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotary(q), rotary(k)
        group = self.n_heads // self.n_kv_heads  # grouped-query attention: each k/v head serves `group` q heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Mixtral's block-sparse MLP: a bias-free router picks top_k of the SwiGLU experts per token."""

    def __init__(self, hidden: int, ffn: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(hidden, ffn) for _ in range(n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.gate(x).topk(self.top_k, dim=-1)
        weights = weights.softmax(dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            w = (weights * (chosen == e)).sum(dim=-1, keepdim=True)
            out = out + w * expert(x)  # dense for brevity: the unrouted experts get weight 0
        return out


class LlamaBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden)
        self.self_attn = LlamaAttention(hidden, heads, kv_heads)
        self.post_attention_layernorm = RMSNorm(hidden)
        self.mlp: nn.Module = SwiGLU(hidden, ffn) if experts == 1 else SparseMoE(hidden, ffn, experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
                 experts: int = 1, top_k: int = 1) -> None:  # fmt: skip
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(LlamaBlock(hidden, heads, kv_heads, ffn, experts, top_k) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)  # untied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.norm(x))


class GPT2Attention(nn.Module):
    def __init__(self, hidden: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(hidden, 3 * hidden)  # fused q, k, v with biases
        self.c_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for y in self.c_attn(x).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class GPT2MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(hidden, 4 * hidden)
        self.c_proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, hidden: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = GPT2Attention(hidden, n_head)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = GPT2MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, *, vocab: int = 50257, n_positions: int = 1024, hidden: int, layers: int, n_head: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(n_positions, hidden)  # learned absolute positions
        self.h = nn.ModuleList(GPT2Block(hidden, n_head) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one matrix, two modules

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# The published shapes (config.json of each repository) as constructor arguments
LLAMA_SHAPES: dict[str, dict[str, int]] = {
    "llama-2-7b": dict(vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=32, ffn=11008),
    "llama-3-8b": dict(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336),
    "mixtral-8x7b": dict(vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, experts=8, top_k=2),
}
GPT2_SHAPES: dict[str, dict[str, int]] = {
    "gpt2": dict(hidden=768, layers=12, n_head=12),
    "gpt2-medium": dict(hidden=1024, layers=24, n_head=16),
    "gpt2-large": dict(hidden=1280, layers=36, n_head=20),
    "gpt2-xl": dict(hidden=1600, layers=48, n_head=25),
}


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def test_llama_2_7b_from_a_factory_is_measured_on_meta_without_memory() -> None:
    built: list[nn.Module] = []

    def factory() -> nn.Module:
        model = Llama(**LLAMA_SHAPES["llama-2-7b"])
        built.append(model)
        return model

    rss_before, t0 = _peak_rss_bytes(), time.perf_counter()
    spec = ModelSpec.from_module(factory)
    elapsed, grown = time.perf_counter() - t0, _peak_rss_bytes() - rss_before

    assert spec.params == PUBLISHED["llama-2-7b"]
    assert all(p.is_meta for p in built[0].parameters())  # the factory ran under torch.device("meta")
    assert grown < LLAMA_2_7B_FP32_BYTES / 50, f"peak RSS grew by {grown / 2**30:.2f} GiB"  # < 0.54 GB of 27 GB
    assert elapsed < 10
    assert (spec.layers, spec.hidden, spec.vocab) == (32, 4096, 32000)
    assert (spec.heads, spec.n_kv_heads, spec.d_ffn, spec.gated_mlp) == (32, 32, 11008, True)
    assert spec.largest_module_params == 32000 * 4096  # embed_tokens and lm_head, DeepSpeed's largest layer
    assert spec.source == "module" and spec.name == "Llama" and not spec.dims_assumed
    # the inferred shape is the published one, so the dimensions alone also give the published count
    assert spec.params_from_dims == PUBLISHED["llama-2-7b"]


@pytest.mark.parametrize("name", list(LLAMA_SHAPES))
def test_llama_class_with_kwargs_is_measured_exactly(name: str) -> None:
    spec = ModelSpec.from_module(Llama, name=name, **LLAMA_SHAPES[name])
    assert spec.params == PUBLISHED[name]
    assert spec.name == name
    shape = LLAMA_SHAPES[name]
    assert (spec.layers, spec.hidden, spec.vocab, spec.heads) == (shape["layers"], shape["hidden"], shape["vocab"], 32)
    assert (spec.n_kv_heads, spec.d_ffn, spec.tied_embeddings) == (shape["kv_heads"], shape["ffn"], False)
    assert (spec.experts, spec.top_k) == (shape.get("experts", 1), shape.get("top_k", 1))
    assert spec.params_from_dims == PUBLISHED[name]


def test_mixtral_module_has_the_published_active_params() -> None:
    spec = ModelSpec.from_module(Llama, **LLAMA_SHAPES["mixtral-8x7b"])
    assert spec.params == PUBLISHED["mixtral-8x7b"]
    assert spec.active_params == MIXTRAL_ACTIVE


@pytest.mark.parametrize("name", list(GPT2_SHAPES))
def test_gpt2_tied_weights_are_counted_once(name: str) -> None:
    built: list[nn.Module] = []

    def factory() -> nn.Module:
        built.append(GPT2(**GPT2_SHAPES[name]))
        return built[-1]

    spec = ModelSpec.from_module(factory)
    assert spec.params == PUBLISHED[name]
    model = built[0]
    hidden = GPT2_SHAPES[name]["hidden"]
    # the shared matrix appears twice when duplicates are not removed: counting it twice would add vocab x hidden
    twice = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert twice == PUBLISHED[name] + 50257 * hidden
    assert (spec.layers, spec.hidden, spec.vocab, spec.heads) == (
        GPT2_SHAPES[name]["layers"], hidden, 50257, GPT2_SHAPES[name]["n_head"])  # fmt: skip
    assert (spec.d_ffn, spec.gated_mlp, spec.tied_embeddings, spec.norm) == (4 * hidden, False, True, "layernorm")


def test_instance_built_on_meta_stays_on_meta() -> None:
    with torch.device("meta"):
        model = GPT2(**GPT2_SHAPES["gpt2"])
    spec = ModelSpec.from_module(model)
    assert spec.params == PUBLISHED["gpt2"]
    assert spec.name == "GPT2"
    assert all(p.is_meta for p in model.parameters())


# Small real models on the CPU: the measured count must equal the formula of ModelSpec for the same dimensions.
TINY: dict[str, tuple[nn.Module, ModelSpec]] = {}


def _tiny(case: str) -> tuple[nn.Module, ModelSpec]:
    if case not in TINY:
        torch.manual_seed(0)
        if case == "llama-mha":
            model: nn.Module = Llama(vocab=97, hidden=64, layers=3, heads=4, kv_heads=4, ffn=172)
            dims = ModelSpec(layers=3, hidden=64, heads=4, ffn=172, vocab=97)
        elif case == "llama-gqa":
            model = Llama(vocab=97, hidden=64, layers=2, heads=8, kv_heads=2, ffn=160)
            dims = ModelSpec(layers=2, hidden=64, heads=8, kv_heads=2, ffn=160, vocab=97)
        elif case == "moe-more-experts-than-layers":
            model = Llama(vocab=97, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, experts=6, top_k=2)
            dims = ModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, ffn=48, vocab=97, experts=6, top_k=2)
        else:
            model = GPT2(vocab=97, n_positions=16, hidden=48, layers=2, n_head=4)
            dims = ModelSpec(
                layers=2, hidden=48, heads=4, vocab=97, tied_embeddings=True, gated_mlp=False, norm="layernorm",
                qkv_bias=True, out_bias=True, mlp_bias=True, max_positions=16,
            )  # fmt: skip
        TINY[case] = (model, dims)
    return TINY[case]


TINY_CASES = ["llama-mha", "llama-gqa", "moe-more-experts-than-layers", "gpt2"]


@pytest.mark.parametrize("case", TINY_CASES)
def test_real_cpu_module_count_matches_the_formula(case: str) -> None:
    model, dims = _tiny(case)
    spec = ModelSpec.from_module(model)
    assert spec.params == sum(p.numel() for p in model.parameters()) == dims.params
    assert all(p.device.type == "cpu" for p in model.parameters())  # measured in place, not moved
    assert (spec.layers, spec.hidden, spec.vocab, spec.heads) == (dims.layers, dims.hidden, dims.vocab, dims.heads)
    assert (spec.n_kv_heads, spec.experts, spec.top_k) == (dims.n_kv_heads, dims.experts, dims.top_k)
    assert spec.active_params == dims.active_params


@pytest.mark.parametrize("case", TINY_CASES)
def test_the_test_models_really_run(case: str) -> None:
    model, _ = _tiny(case)
    ids = torch.randint(0, 97, (2, 7))
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (2, 7, 97) and bool(torch.isfinite(logits).all())
    with torch.no_grad():  # causal: the logits of a prefix do not depend on what follows it
        assert torch.allclose(model(ids[:, :4]), logits[:, :4], atol=1e-5)


# The GPT of Karpathy's "Let's build GPT" lecture (karpathy/ng-video-lecture gpt.py): blocks in an nn.Sequential, each
# attention a ModuleList of per-head modules, a character vocabulary (65) smaller than the position table (256).
# The script prints "10.788929 M parameters".
class LectureHead(nn.Module):
    def __init__(self, n_embd: int, head_size: int) -> None:
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)


class LectureMultiHead(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.heads = nn.ModuleList(LectureHead(n_embd, n_embd // n_head) for _ in range(n_head))
        self.proj = nn.Linear(n_embd, n_embd)


class LectureBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.sa = LectureMultiHead(n_embd, n_head)
        self.ffwd = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.ReLU(), nn.Linear(4 * n_embd, n_embd))
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)


class LectureGPT(nn.Module):
    def __init__(self, vocab: int = 65, block_size: int = 256, n_embd: int = 384, n_head: int = 6, n_layer: int = 6):
        super().__init__()
        self.token_embedding_table = nn.Embedding(vocab, n_embd)
        self.position_embedding_table = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[LectureBlock(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab)


def test_blocks_in_a_sequential_with_lists_of_heads_and_a_small_vocabulary() -> None:
    spec = ModelSpec.from_module(LectureGPT)
    assert spec.params == 10_788_929
    # not the 6-entry list of heads, not the 256-row position table
    assert (spec.layers, spec.hidden, spec.vocab, spec.d_ffn) == (6, 384, 65, 1536)
    assert (spec.experts, spec.tied_embeddings, spec.norm, spec.gated_mlp) == (1, False, "layernorm", False)
    # no attribute names the number of heads: the list of 6 per-head modules (384 -> 64 each) does (issue 31)
    assert spec.heads == 6 and not spec.dims_assumed


class _FakeHFConfig:
    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def to_dict(self) -> dict[str, Any]:
        return dict(self._data)


def test_module_with_a_hugging_face_config_takes_its_shape_from_the_config() -> None:
    model, _ = _tiny("llama-gqa")
    model.config = _FakeHFConfig(QWEN2_0_5B_CONFIG)  # type: ignore[assignment]
    try:
        spec = ModelSpec.from_module(model)
    finally:
        del model.config
    assert spec.params == sum(p.numel() for p in model.parameters())  # measured count wins
    assert (spec.layers, spec.hidden, spec.heads, spec.n_kv_heads) == (24, 896, 14, 2)  # shape from the config
    assert spec.source == "module"


def test_module_whose_config_is_not_a_transformer_config_falls_back_to_its_structure() -> None:
    model, dims = _tiny("llama-gqa")
    model.config = _FakeHFConfig({"lr": 3e-4, "epochs": 2})  # type: ignore[assignment]
    try:
        spec = ModelSpec.from_module(model)
    finally:
        del model.config
    assert spec.params == dims.params
    assert (spec.layers, spec.hidden, spec.vocab) == (dims.layers, dims.hidden, dims.vocab)


@pytest.mark.parametrize("bad", [42, "llama-2-7b", None, [nn.Linear(2, 2)]], ids=["int", "str", "None", "list"])
def test_from_module_rejects_what_is_not_a_module(bad: Any) -> None:
    with pytest.raises(PlanInputError, match=r"expected an nn.Module or a callable building one, got"):
        ModelSpec.from_module(bad)


def test_from_module_rejects_a_factory_that_returns_no_module() -> None:
    with pytest.raises(PlanInputError, match=r"returned dict, not a torch.nn.Module"):
        ModelSpec.from_module(lambda: {"weight": torch.zeros(2)})


def test_from_module_rejects_a_module_without_parameters() -> None:
    with pytest.raises(PlanInputError, match=r"ReLU has no trainable parameters"):
        ModelSpec.from_module(nn.ReLU())


def test_module_without_blocks_or_embeddings_is_marked_assumed() -> None:
    spec = ModelSpec.from_module(nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)))
    assert spec.params == 256 * 1024 + 1024 + 1024 * 256 + 256
    assert spec.dims_assumed and spec.hidden == 256


# ---------------------------------------------------------------------------------------------------------------
# Bare counts
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("count", "exact"),
    [("7B", 7_000_000_000), (7.5e9, 7_500_000_000), ("124M", 124_000_000), ("6738415616", 6_738_415_616),
     (6_738_415_616, 6_738_415_616), ("1.5b", 1_500_000_000), (" 70 B ", 70_000_000_000), ("405e9", 405 * 10**9)],
)  # fmt: skip
def test_from_params_keeps_the_exact_count(count: Any, exact: int) -> None:
    spec = ModelSpec.from_params(count)
    assert spec.params == exact
    assert spec.params_override == exact
    assert spec.active_params == exact  # dense
    assert spec.dims_assumed and spec.source == "params"
    # the guessed shape is sane: within a factor of two of the count (only activation estimates use it)
    assert 0.5 < spec.params_from_dims / exact < 2
    assert spec.hidden % 128 == 0 and spec.hidden == spec.heads * spec.d_head


def test_from_params_names() -> None:
    assert ModelSpec.from_params("7B").name == "7B params"
    assert ModelSpec.from_params("124M").name == "124M params"
    assert ModelSpec.from_params("7B", name="my-7b").name == "my-7b"


@pytest.mark.parametrize("bad", ["seven", "0", "-1", "", "7 billion", "1e", 0, -5, 0.4, True, math.nan, math.inf])
def test_from_params_rejects_what_is_not_a_positive_count(bad: Any) -> None:
    with pytest.raises(PlanInputError, match=r"^params "):
        ModelSpec.from_params(bad)


# ---------------------------------------------------------------------------------------------------------------
# to_dict / from_dict
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", preset_names())
def test_preset_round_trips_through_json(name: str) -> None:
    spec = get_preset(name)
    data = json.loads(json.dumps(spec.to_dict()))
    assert data["params"] == PUBLISHED[name]
    assert data["active_params"] == (MIXTRAL_ACTIVE if name == "mixtral-8x7b" else PUBLISHED[name])
    assert ModelSpec.from_dict(data) == spec


@pytest.mark.parametrize(
    "make",
    [lambda: ModelSpec.from_params("7B"), lambda: ModelSpec.from_hf_config(QWEN2_0_5B_CONFIG),
     lambda: ModelSpec.from_module(GPT2, hidden=48, layers=2, n_head=4, vocab=97, n_positions=16)],
    ids=["params", "hf-config", "module"],
)  # fmt: skip
def test_measured_and_guessed_specs_round_trip(make: Any) -> None:
    spec = make()
    back = ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert back == spec and back.params == spec.params and back.dims_assumed == spec.dims_assumed


def test_from_dict_validates() -> None:
    data = {**get_preset("llama-3-8b").to_dict(), "kv_heads": 5}
    with pytest.raises(PlanInputError, match=r"kv_heads \(5\) must divide heads \(32\)"):
        ModelSpec.from_dict(data)
