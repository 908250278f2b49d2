"""Model specifications: presets, explicit dimensions, Hugging Face ``config.json``, bare counts, real modules.

A :class:`ModelSpec` knows a decoder-only transformer's shape well enough to count its parameters exactly (the
presets reproduce the published counts to the parameter) and to feed the activation-memory and FLOP formulas.
Nothing here imports torch at module level; :meth:`ModelSpec.from_module` imports it lazily to build a model on
the meta device.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..errors import PlanInputError, UnknownModelError
from .units import close_match_hint, parse_count

__all__ = ["ModelSpec", "PRESETS", "get_preset", "preset_names", "read_hf_config"]


MAX_HF_CONFIG_BYTES = 4 << 20
"""Largest ``config.json`` read (real ones are a few KiB); a bigger file is refused before it is loaded."""
MAX_DIM = 2**31 - 1
"""Largest value of a model dimension (layers, hidden, heads, vocab, ...): an int32, far beyond any real model."""
MAX_PARAMS = 10**15
"""Largest parameter count (a quadrillion: a thousand times the largest models trained)."""


def _short(value: Any) -> str:
    """``repr`` of a bad value, cut to one readable line."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def read_hf_config(path: str) -> Any:
    """Parse a ``config.json`` defensively.

    A regular file only (not a FIFO, ``/dev/zero`` or a folder), at most :data:`MAX_HF_CONFIG_BYTES`, UTF-8, no
    pathological nesting or numbers.
    """
    import stat

    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise PlanInputError(
            f"Hugging Face config not found: {path}; give a config.json, the folder holding it, or a dict"
        ) from None
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise PlanInputError(f"cannot read Hugging Face config {path!r}: {why}") from None
    if not stat.S_ISREG(st.st_mode):
        raise PlanInputError(f"{path} is not a regular file (a folder, device, pipe or socket); give a config.json")
    if st.st_size > MAX_HF_CONFIG_BYTES:
        raise PlanInputError(
            f"{path} has {st.st_size:,} bytes; a Hugging Face config.json is at most {MAX_HF_CONFIG_BYTES >> 20} MiB"
        )
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a file swapped for a FIFO never blocks
        with os.fdopen(fd, "rb") as fh:
            raw = fh.read(MAX_HF_CONFIG_BYTES + 1)
    except OSError as exc:
        raise PlanInputError(f"cannot read Hugging Face config {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_HF_CONFIG_BYTES:
        raise PlanInputError(f"{path} is larger than {MAX_HF_CONFIG_BYTES >> 20} MiB; not a Hugging Face config.json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise PlanInputError(f"{path} is not valid JSON: it is not UTF-8 text") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanInputError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    except RecursionError:
        raise PlanInputError(f"{path} is not a Hugging Face config: its JSON is nested too deeply") from None
    except ValueError:  # an integer of more than 4300 digits
        raise PlanInputError(
            f"{path} is not a Hugging Face config: it holds a number with thousands of digits"
        ) from None


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Shape of a decoder-only transformer (dense or mixture-of-experts)."""

    name: str = "custom"
    """Display name."""
    layers: int
    """Number of transformer blocks."""
    hidden: int
    """Model (residual stream) width."""
    heads: int
    """Attention (query) heads."""
    kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 means equal to ``heads``."""
    head_dim: int = 0
    """Width of one head; 0 means ``hidden // heads``."""
    ffn: int = 0
    """Hidden width of the MLP (per expert for MoE); 0 means ``4 * hidden``."""
    vocab: int
    """Vocabulary size."""
    tied_embeddings: bool = False
    """Input embedding and output projection share one matrix."""
    gated_mlp: bool = True
    """Gated MLP (SwiGLU: gate, up and down projections) rather than two projections with GeLU."""
    experts: int = 1
    """Experts per MoE layer; 1 for a dense model."""
    top_k: int = 1
    """Experts each token is routed to (MoE)."""
    norm: str = "rmsnorm"
    """``"rmsnorm"`` (weight only) or ``"layernorm"`` (weight and bias)."""
    qkv_bias: bool = False
    """Query/key/value projections have biases."""
    out_bias: bool = False
    """Attention output projection has a bias."""
    mlp_bias: bool = False
    """MLP projections have biases."""
    qk_norm: bool = False
    """Queries and keys are RMS-normalised per head before the rotary embedding (Qwen3, Qwen3-MoE)."""
    max_positions: int = 0
    """Rows of a learned absolute position embedding (GPT-2); 0 for rotary or none."""
    dropout: bool = False
    """Dropout is active in training (stores masks, per Korthikanti et al. 2022)."""
    params_override: int = 0
    """Measured parameter count that wins over the count from dimensions (bare counts, real modules)."""
    largest_module_override: int = 0
    """Measured parameters of the largest single module (DeepSpeed's ``largest_layer_params``)."""
    dims_assumed: bool = False
    """The dimensions were guessed from a bare count; activation figures are estimates."""
    source: str = "dims"
    """Where the spec came from: ``preset``, ``dims``, ``hf-config``, ``params`` or ``module``."""
    needs: tuple[tuple[str, str], ...] = ()
    """What a measured module cannot run, as ``(dim, reason)`` pairs (``("pp", "...")``, ``("tp", "...")``):
    candidates with that dim above 1 are listed as needing it and never recommended."""
    tp_layout_of: Any = field(default=None, compare=False, repr=False)
    """A measured module's derived tensor-parallel layout, asked lazily: ``tp_layout_of(tp, sp)`` gives a
    :class:`~jupyter_dist.plan.plan.TpLayoutTable` (``None`` where the module carries its own layout). Holds the
    module; not compared, not serialised (the plan keeps the table it asked for)."""
    activations_of: Any = field(default=None, compare=False, repr=False)
    """A measured module's activations, asked lazily: ``activations_of(micro_batch, seq_len, bytes_per_element)``
    gives the bytes one block saves for backward (``_module.block_activations``: autograd's saved tensors of a tiny
    real forward, fitted over sizes and scaled). ``None`` where the planner's layout table describes the model.
    Holds the module; not compared, not serialised."""

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "vocab", "experts", "top_k"):
            value = getattr(self, f)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanInputError(f"model {f} must be a positive integer, got {_short(value)}")
            if value > MAX_DIM:
                raise PlanInputError(f"model {f} must be at most {MAX_DIM}, got {_short(value)}")
        for f in ("kv_heads", "head_dim", "ffn", "max_positions", "params_override", "largest_module_override"):
            value = getattr(self, f)
            top = MAX_DIM if f in ("kv_heads", "head_dim", "ffn", "max_positions") else MAX_PARAMS
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PlanInputError(f"model {f} must be a non-negative integer, got {_short(value)}")
            if value > top:
                raise PlanInputError(f"model {f} must be at most {top}, got {_short(value)}")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise PlanInputError(f"model norm must be 'rmsnorm' or 'layernorm', got {self.norm!r}")
        if not self.head_dim and self.hidden % self.heads:
            raise PlanInputError(
                f"hidden ({self.hidden}) is not divisible by heads ({self.heads}); give head_dim explicitly"
            )
        if self.n_kv_heads > self.heads or self.heads % self.n_kv_heads:
            raise PlanInputError(
                f"kv_heads ({self.n_kv_heads}) must divide heads ({self.heads}); e.g. 8 for grouped-query attention"
            )
        if self.top_k > self.experts:
            raise PlanInputError(f"top_k ({self.top_k}) cannot exceed experts ({self.experts})")

    # ---- derived shape -------------------------------------------------------------------------------------
    @property
    def n_kv_heads(self) -> int:
        """Key/value heads, resolved."""
        return self.kv_heads or self.heads

    @property
    def d_head(self) -> int:
        """Head width, resolved."""
        return self.head_dim or self.hidden // self.heads

    @property
    def d_ffn(self) -> int:
        """MLP width, resolved."""
        return self.ffn or 4 * self.hidden

    @property
    def q_dim(self) -> int:
        """Total query width (heads x head_dim)."""
        return self.heads * self.d_head

    @property
    def kv_dim(self) -> int:
        """Total key (or value) width (kv_heads x head_dim)."""
        return self.n_kv_heads * self.d_head

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are mixtures of experts."""
        return self.experts > 1

    # ---- parameter counts (exact for the architectures described) -----------------------------------------
    @property
    def attention_params(self) -> int:
        """Parameters of one attention block: q, k, v, o projections and their biases."""
        h = self.hidden
        n = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.qkv_bias:
            n += self.q_dim + 2 * self.kv_dim
        if self.out_bias:
            n += h
        return n

    @property
    def expert_params(self) -> int:
        """Parameters of one MLP (one expert for MoE)."""
        h, f = self.hidden, self.d_ffn
        if self.gated_mlp:
            return 3 * h * f + (2 * f + h if self.mlp_bias else 0)
        return 2 * h * f + (f + h if self.mlp_bias else 0)

    @property
    def norm_params(self) -> int:
        """Parameters of one normalisation layer."""
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    @property
    def router_params(self) -> int:
        """Parameters of one MoE router (a bias-free linear layer to the experts)."""
        return self.hidden * self.experts if self.is_moe else 0

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer block."""
        qk = 2 * self.d_head if self.qk_norm else 0  # one weight of head_dim for the queries, one for the keys
        moe = self.experts * self.expert_params + self.router_params
        return self.attention_params + moe + 2 * self.norm_params + qk

    @property
    def embedding_params(self) -> int:
        """Input token embedding plus learned position embedding."""
        return self.vocab * self.hidden + self.max_positions * self.hidden

    @property
    def lm_head_params(self) -> int:
        """Output projection parameters that are not shared with the input embedding."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    @property
    def params_from_dims(self) -> int:
        """Parameter count implied by the dimensions."""
        return (
            self.embedding_params
            + self.layers * self.layer_params
            + self.norm_params  # final norm
            + self.lm_head_params
        )

    @property
    def params(self) -> int:
        """Total trainable parameters (a measured count wins over the dimensions)."""
        return self.params_override or self.params_from_dims

    @property
    def total_expert_params(self) -> int:
        """Parameters that live in experts (sharded by expert parallelism)."""
        if not self.is_moe:
            return 0
        return round(self.layers * self.experts * self.expert_params * self._scale)

    @property
    def active_params(self) -> int:
        """Parameters a token passes through (MoE: only its top-k experts)."""
        if not self.is_moe:
            return self.params
        inactive = self.layers * (self.experts - self.top_k) * self.expert_params
        return self.params - round(inactive * self._scale)

    @property
    def matmul_params(self) -> int:
        """Parameters used in matrix multiplies per token: active block weights plus the output projection.

        The input embedding is a lookup (no FLOPs); the logits matmul uses ``vocab x hidden`` whether or not it
        is tied. This is ``N`` in the ``6 N`` training-FLOPs rule (Kaplan et al. 2020, PaLM appendix B).
        """
        per_layer = self.attention_params + self.top_k * self.expert_params + self.router_params
        return round((self.layers * per_layer + self.vocab * self.hidden) * self._scale)

    @property
    def largest_module_params(self) -> int:
        """Parameters of the largest single module (embedding, a projection), as DeepSpeed's estimator uses."""
        if self.largest_module_override:
            return self.largest_module_override
        h = self.hidden
        return max(self.vocab * h, h * self.d_ffn, h * self.q_dim, self.experts * h if self.is_moe else 0)

    @property
    def _scale(self) -> float:
        """Ratio of the measured count to the count from dimensions (1.0 when not measured)."""
        return self.params / self.params_from_dims if self.params_override else 1.0

    # ---- constructors -------------------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str) -> ModelSpec:
        """A catalog model, e.g. ``"llama-2-7b"`` (see :func:`preset_names`)."""
        return get_preset(name)

    @classmethod
    def from_params(cls, count: int | float | str, *, name: str | None = None) -> ModelSpec:
        """A bare parameter count; the shape is guessed (Llama-style, depth-to-width as in Kaplan et al.).

        Kaplan et al. 2020 (Scaling Laws, Fig. 5) find performance flat over a wide range of aspect ratios; we
        take ``hidden ~= 128 * layers`` (GPT-3's 175B has 12288 / 96 = 128) and ``N ~= 12 * layers * hidden**2``.
        """
        n = parse_count(count, what="params")
        layers = max(1, round((n / (12 * 128**2)) ** (1 / 3)))
        # widths in multiples of 1024 (128 below 1B) so heads of 128 divide by the usual TP degrees
        step = 1024 if n >= 1e9 else 128
        hidden = max(128, int(round(math.sqrt(n / (12 * layers)) / step)) * step)
        heads = max(1, hidden // 128)
        default_name = f"{n / 1e9:.3g}B params" if n >= 1e9 else f"{n / 1e6:.3g}M params"
        return cls(
            name=name or default_name,
            layers=layers, hidden=hidden, heads=heads, ffn=4 * hidden, gated_mlp=False, vocab=32000,
            params_override=n, dims_assumed=True, source="params",
        )  # fmt: skip

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> ModelSpec:
        """Read a Hugging Face ``config.json`` (a path, a directory holding one, or the parsed dict); no network."""
        if isinstance(config, (str, os.PathLike)):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            data = read_hf_config(path)
        elif isinstance(config, Mapping):
            data = dict(config)
        else:
            raise PlanInputError(
                f"expected a config.json path, a folder holding one, or a dict, got {type(config).__name__}"
            )
        if not isinstance(data, dict):
            raise PlanInputError("a Hugging Face config must be a JSON object")
        return _spec_from_hf(data)

    @classmethod
    def from_module(cls, module: Any, *args: Any, name: str | None = None, **kwargs: Any) -> ModelSpec:
        """Measure a real ``torch.nn.Module`` (or a class / factory building one) without allocating weights.

        A class or factory is called under ``torch.device("meta")`` with ``args``/``kwargs``, so a 70B model
        costs no memory. Shared (tied) parameters are counted once. The shape used for activation estimates
        comes from the module's Hugging Face ``config`` when it has one, else from its structure: the list of
        identical blocks holding the most parameters gives the layers, the token embedding and the linear layers
        give the widths, head / key-value head / top-k attributes (``n_heads``, ``num_key_value_heads``, ``top_k``)
        and a list of identical MLPs inside a block (the experts) give the rest. A model with blocks whose heads
        none of these state is refused in one line naming ``heads=`` (``jupyter_dist.plan(model, heads=N)``,
        ``--heads N``), never guessed; the keywords here go to the factory.
        """
        from ._module import measure_module

        spec: ModelSpec = measure_module(cls, module, args, kwargs, name=name)
        return spec

    def to_dict(self) -> dict[str, Any]:
        """Return the dimensions plus derived counts (``params`` etc.), JSON-ready."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)
                                if f.name not in ("tp_layout_of", "activations_of")}
        out["needs"] = [list(n) for n in self.needs]  # JSON's form: a record read back compares equal
        out.update(params=self.params, active_params=self.active_params, params_from_dims=self.params_from_dims)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        """Inverse of :meth:`to_dict` (derived keys are ignored)."""
        names = {f.name for f in fields(cls)} - {"tp_layout_of", "activations_of"}
        kw = {k: v for k, v in data.items() if k in names}
        if "needs" in kw:  # JSON gives lists
            kw["needs"] = tuple((str(d), str(why)) for d, why in kw["needs"])
        return cls(**kw)

    def with_(self, **changes: Any) -> ModelSpec:
        """Return a copy with some fields changed (validated again)."""
        return replace(self, **changes)


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face configs
# ---------------------------------------------------------------------------------------------------------------
# GPT-2-style families: learned absolute positions, LayerNorm with bias, biased linears, tied embeddings.
# Other families are read Llama-style; bloom (ALiBi), falcon and gptj (rotary, no biases) and opt (position
# offset of 2) are not modelled exactly and can be off by their biases and position tables.
_GPT2_LIKE = {"gpt2", "gpt_bigcode"}


def _first(data: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if data.get(k) is not None:
            return data[k]
    return default


def _hf_int(data: Mapping[str, Any], field: str, *keys: str, default: int | None = None) -> int:
    """Read an integer dimension stored under the first present key; name the field and keys on failure."""
    raw = _first(data, *keys)
    if raw is None:
        if default is not None:
            return default
        raise PlanInputError(f"Hugging Face config has no {field}: expected one of the keys {', '.join(keys)}")
    key = next(k for k in keys if data.get(k) is not None)
    if isinstance(raw, bool) or not (isinstance(raw, int) or (isinstance(raw, float) and raw.is_integer())):
        raise PlanInputError(f"Hugging Face config {key} ({field}) must be an integer, got {raw!r}")
    return int(raw)


def _hf_rate(data: dict[str, Any], key: str) -> float:
    """A dropout rate from a config (0 when absent); a clear error when it is not a number."""
    value = data.get(key) or 0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanInputError(f"Hugging Face config {key} must be a number between 0 and 1, got {_short(value)}")
    return float(value)


_QK_NORM = ("qwen3", "qwen3_moe")
"""Hugging Face model types whose attention RMS-normalises each query and key head (``q_norm``/``k_norm`` of
``head_dim``). Olmo2 normalises the whole projection and Gemma3 adds more norms around each block: not these."""


def _spec_from_hf(data: dict[str, Any]) -> ModelSpec:
    if isinstance(data.get("text_config"), dict):  # multimodal wrappers keep the language model here
        data = {**data["text_config"], "model_type": data["text_config"].get("model_type", data.get("model_type"))}
    mtype = str(data.get("model_type", "")).lower()
    layers = _hf_int(data, "layers", "num_hidden_layers", "n_layer", "num_layers")
    hidden = _hf_int(data, "hidden", "hidden_size", "n_embd", "d_model")
    heads = _hf_int(data, "heads", "num_attention_heads", "n_head", "num_heads")
    vocab = _hf_int(data, "vocab", "vocab_size")
    gpt2_like = mtype in _GPT2_LIKE or "n_embd" in data
    kv_heads = _hf_int(data, "kv_heads", "num_key_value_heads", "num_kv_heads", default=0)
    if data.get("multi_query") is True:
        kv_heads = 1
    ffn = _hf_int(data, "ffn", "intermediate_size", "n_inner", "ffn_dim", default=0)
    experts = _hf_int(data, "experts", "num_local_experts", "num_experts", "n_routed_experts", default=1) or 1
    top_k = _hf_int(data, "top_k", "num_experts_per_tok", "top_k", "moe_topk", default=1) if experts > 1 else 1
    if experts > 1 and data.get("moe_intermediate_size"):
        ffn = _hf_int(data, "ffn", "moe_intermediate_size")
    act = str(_first(data, "hidden_act", "activation_function", default="")).lower()
    gated = not gpt2_like and (act in ("silu", "swiglu", "swish", "gelu_pytorch_tanh", "geglu") or not act)
    if gpt2_like:
        qkv_bias = out_bias = mlp_bias = True
    else:
        attn_bias = bool(data.get("attention_bias", False))
        qkv_bias = attn_bias or mtype in ("qwen2", "qwen2_moe")
        out_bias = attn_bias
        mlp_bias = bool(data.get("mlp_bias", False))
    dropout_keys = ("attn_pdrop", "resid_pdrop", "embd_pdrop", "attention_dropout", "hidden_dropout", "dropout")
    dropout = any(_hf_rate(data, k) > 0 for k in dropout_keys)
    tied = bool(data.get("tie_word_embeddings", gpt2_like))
    head_dim = _hf_int(data, "head_dim", "head_dim", default=0)
    if head_dim and head_dim * heads == hidden:
        head_dim = 0
    name = str(_first(data, "_name_or_path", "name", default="") or mtype or "hf-model")
    return ModelSpec(
        name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads if kv_heads != heads else 0,
        head_dim=head_dim, ffn=ffn, vocab=vocab, tied_embeddings=tied, gated_mlp=gated, experts=experts,
        top_k=top_k, norm="layernorm" if gpt2_like else "rmsnorm", qkv_bias=qkv_bias, out_bias=out_bias,
        mlp_bias=mlp_bias, qk_norm=mtype in _QK_NORM, max_positions=_hf_int(data, "max_positions", "n_positions",
        "max_position_embeddings", default=0) if gpt2_like else 0, dropout=dropout, source="hf-config",
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Presets. Dimensions are those of each model's published config.json; the counts they give are the published
# ones (Hugging Face model cards / safetensors metadata), checked in tests/test_model.py.
# ---------------------------------------------------------------------------------------------------------------
def _gpt2(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(
        name=name, layers=layers, hidden=hidden, heads=heads, vocab=50257, tied_embeddings=True,
        gated_mlp=False, norm="layernorm", qkv_bias=True, out_bias=True, mlp_bias=True, max_positions=1024,
        dropout=True, source="preset",
    )  # fmt: skip


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, **kw: Any) -> ModelSpec:
    return ModelSpec(
        name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv if kv != heads else 0, ffn=ffn,
        vocab=vocab, source="preset", **kw,
    )  # fmt: skip


PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _gpt2("gpt2", 12, 768, 12),  # 124,439,808
        _gpt2("gpt2-medium", 24, 1024, 16),  # 354,823,168
        _gpt2("gpt2-large", 36, 1280, 20),  # 774,030,080
        _gpt2("gpt2-xl", 48, 1600, 25),  # 1,557,611,200
        _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000),  # 6,738,415,616
        _llama("llama-2-13b", 40, 5120, 40, 40, 13824, 32000),  # 13,015,864,320
        _llama("llama-2-70b", 80, 8192, 64, 8, 28672, 32000),  # 68,976,648,192
        _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256),  # 8,030,261,248
        _llama("llama-3-70b", 80, 8192, 64, 8, 28672, 128256),  # 70,553,706,496
        _llama("llama-3.1-405b", 126, 16384, 128, 8, 53248, 128256),  # 405,853,388,800
        _llama("llama-3.2-1b", 16, 2048, 32, 8, 8192, 128256, tied_embeddings=True),  # 1,235,814,400
        _llama("mistral-7b", 32, 4096, 32, 8, 14336, 32000),  # 7,241,732,096
        _llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, experts=8, top_k=2),  # 46,702,792,704
    )
}
_PRESET_ALIASES = {
    "gpt-2": "gpt2", "gpt2-small": "gpt2", "llama2-7b": "llama-2-7b", "llama2-13b": "llama-2-13b",
    "llama2-70b": "llama-2-70b", "llama3-8b": "llama-3-8b", "llama3-70b": "llama-3-70b",
    "llama-3.1-8b": "llama-3-8b", "llama-3.1-70b": "llama-3-70b", "llama3.1-405b": "llama-3.1-405b",
    "mixtral": "mixtral-8x7b",
}  # fmt: skip


def preset_names() -> list[str]:
    """Names of the model presets."""
    return list(PRESETS)


def get_preset(name: str) -> ModelSpec:
    """Look a preset up by name (case-insensitive, a few common aliases)."""
    key = name.strip().lower().replace("_", "-")
    key = _PRESET_ALIASES.get(key, key)
    if key not in PRESETS:
        raise UnknownModelError(
            f"unknown model {name!r}{close_match_hint(key, list(PRESETS))}; valid presets: {', '.join(PRESETS)} "
            "(or give --params, --layers/--hidden/..., or --hf-config)"
        )
    return PRESETS[key]
