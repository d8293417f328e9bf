"""The transformers config fields several families read and write in the same way: the
Llama-like shape and its RoPE scaling, the MoE section an import starts from, checked numbers,
the refusals of attention features moetrain lacks, MoE placement, a dense family's config.
Imports neither torch nor transformers (see :mod:`~moetrain.convert.families.base`)."""

from __future__ import annotations

import math
from typing import Any

from moetrain.config import Config, ConfigError, ModelConfig, MoEConfig
from moetrain.config.model import FULL, SLIDING


def hf_common(cfg: Config) -> dict[str, Any]:
    """The transformers config fields every MoE family shares (Llama's, plus top-k)."""
    model, moe = cfg.model, cfg.moe
    return dict(
        vocab_size=model.vocab_size,
        hidden_size=model.d_model,
        num_hidden_layers=model.n_layers,
        num_attention_heads=model.n_heads,
        num_key_value_heads=model.n_kv_heads,
        head_dim=model.attention_head_dim,
        max_position_embeddings=model.max_seq_len,
        rms_norm_eps=model.norm_eps,
        tie_word_embeddings=model.tie_embeddings,
        num_experts_per_tok=moe.top_k,
        router_aux_loss_coef=moe.aux_loss_coef,
        initializer_range=model.init_std,
        rope_parameters=rope_parameters(model),
    )


def dense_layers(cfg: Config) -> list[int]:
    """The layers ``cfg`` makes dense (Qwen-MoE's ``mlp_only_layers``)."""
    return [i for i in range(cfg.model.n_layers) if not cfg.moe.is_moe_layer(i)]


class WithRope:
    """A transformers config seen with other ``rope_parameters`` (Hunyuan's NTK-alpha folded
    into a plain ``rope_theta``; a NoPE model's placeholder)."""

    def __init__(self, hf: Any, rope: dict[str, Any]) -> None:
        self._hf, self.rope_parameters = hf, rope

    def __getattr__(self, name: str) -> Any:
        return getattr(self._hf, name)


def model_from_hf(hf: Any) -> ModelConfig:
    """The transformer shape of a transformers config object (any Llama-like family), its RoPE
    scaling included (:func:`rope_scaling_from_hf`); raises ConfigError naming the field
    moetrain cannot represent."""

    def get(name: str, default: Any = None) -> Any:
        return getattr(hf, name, default)

    rope = get("rope_parameters") or {}
    scaling = rope_scaling_from_hf(rope, hf.max_position_embeddings)
    partial = float(rope.get("partial_rotary_factor", get("partial_rotary_factor", 1.0)))
    if get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"hidden_act: moetrain experts are SwiGLU (silu); got {get('hidden_act')}"
        )
    heads = hf.num_attention_heads
    # (a class without dense layers may have no intermediate_size: Qwen3.5-MoE's)
    dense = {"dense_hidden": hf.intermediate_size} if get("intermediate_size") else {}
    return ModelConfig(
        vocab_size=hf.vocab_size,
        d_model=hf.hidden_size,
        n_layers=hf.num_hidden_layers,
        n_heads=heads,
        n_kv_heads=get("num_key_value_heads") or heads,
        head_dim=get("head_dim") or hf.hidden_size // heads,
        max_seq_len=hf.max_position_embeddings,
        rope_theta=float(rope.get("rope_theta", get("rope_theta", 10000.0))),
        norm_eps=float(hf.rms_norm_eps),
        tie_embeddings=bool(get("tie_word_embeddings", False)),
        init_std=float(get("initializer_range", 0.02)),
        partial_rotary_factor=partial,
        **dense,
        **scaling,
    )


# moetrain's RoPE-scaling keys -> transformers' rope_parameters keys, per rope_type
_SCALING = {
    "yarn": {
        "rope_factor": "factor",
        "rope_original_max_seq_len": "original_max_position_embeddings",
        "rope_beta_fast": "beta_fast",
        "rope_beta_slow": "beta_slow",
        "rope_mscale": "mscale",
        "rope_mscale_all_dim": "mscale_all_dim",
        "rope_truncate": "truncate",
    },
    "llama3": {
        "rope_factor": "factor",
        "rope_original_max_seq_len": "original_max_position_embeddings",
        "rope_low_freq_factor": "low_freq_factor",
        "rope_high_freq_factor": "high_freq_factor",
    },
    "longrope": {
        "rope_original_max_seq_len": "original_max_position_embeddings",
        "rope_short_factor": "short_factor",
        "rope_long_factor": "long_factor",
        "rope_attention_factor": "attention_factor",
    },
}


def rope_scaling_from_hf(rope: dict[str, Any], max_positions: int) -> dict[str, Any]:
    """The ModelConfig fields of a ``rope_parameters`` dict: {} for plain RoPE, YaRN's or
    llama3's keys; raises ConfigError for a rope_type or a setting moetrain does not compute."""
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return {}
    if kind not in _SCALING:
        raise ConfigError(
            "rope_parameters.rope_type: moetrain computes default, yarn, llama3 and longrope; "
            f"got {kind!r}"
        )
    if kind == "longrope":
        return longrope_from_hf(rope)
    if kind == "llama3":
        return {"rope_scaling": "llama3", **{k: rope.get(v) for k, v in _SCALING[kind].items()}}
    if rope.get("attention_factor") is not None:
        raise ConfigError("rope_parameters.attention_factor: moetrain derives it from mscale")
    if rope.get("original_max_position_embeddings") is None:
        raise ConfigError("rope_parameters.original_max_position_embeddings: YaRN needs it")
    fields = {ours: rope.get(theirs) for ours, theirs in _SCALING["yarn"].items()}
    if fields["rope_factor"] is None:  # transformers' rule: the ratio of the two contexts
        fields["rope_factor"] = max_positions / fields["rope_original_max_seq_len"]
    return {"rope_scaling": "yarn", **fields}


def longrope_from_hf(rope: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a LongRoPE ``rope_parameters`` dict (transformers'
    ``_compute_longrope_parameters``): a ``factor`` other than the contexts' ratio only sets the
    default attention factor, which is then made explicit."""
    fields = {ours: rope.get(theirs) for ours, theirs in _SCALING["longrope"].items()}
    for ours, theirs in _SCALING["longrope"].items():
        if fields[ours] is None and ours != "rope_attention_factor":
            raise ConfigError(f"rope_parameters.{theirs}: LongRoPE needs it")
    factor, original = rope.get("factor"), fields["rope_original_max_seq_len"]
    if fields["rope_attention_factor"] is None and factor is not None:
        scale = float(factor)
        fields["rope_attention_factor"] = (
            1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original))
        )
    fields["rope_short_factor"] = [float(f) for f in fields["rope_short_factor"]]
    fields["rope_long_factor"] = [float(f) for f in fields["rope_long_factor"]]
    return {"rope_scaling": "longrope", **fields}


def rope_parameters(model: ModelConfig) -> dict[str, Any]:
    """transformers' ``rope_parameters`` of ``model`` (plain, YaRN, llama3 or LongRoPE)."""
    kind = "default" if model.rope_scaling == "none" else model.rope_scaling
    out = {"rope_type": kind, "rope_theta": model.rope_theta}
    if model.partial_rotary_factor != 1.0:
        out["partial_rotary_factor"] = model.partial_rotary_factor
    for ours, theirs in _SCALING.get(model.rope_scaling, {}).items():
        if getattr(model, ours) is not None:
            out[theirs] = getattr(model, ours)
    return out


def layer_types(model: ModelConfig) -> list[str]:
    """transformers' ``layer_types`` of ``model``: sliding-window or full attention per layer."""
    return [SLIDING if model.attention_window(i) else FULL for i in range(model.n_layers)]


def windows_from_hf(hf: Any, model: ModelConfig) -> None:
    """Set ``model``'s sliding-window layers from transformers' ``layer_types`` and
    ``sliding_window`` (none sliding: the whole context everywhere); ConfigError naming
    ``layer_types`` for a layer type moetrain does not compute."""
    types = list(getattr(hf, "layer_types", None) or [FULL] * model.n_layers)
    unknown = sorted(set(types) - {FULL, SLIDING})
    if unknown:
        raise ConfigError(f"layer_types: moetrain computes {FULL} and {SLIDING}; got {unknown}")
    if SLIDING in types:
        model.sliding_window, model.layer_types = hf.sliding_window, types


def moe_from_hf(hf: Any) -> MoEConfig:
    """The MoE section an imported model starts from: its top-k, no balancing losses."""
    return MoEConfig(top_k=hf.num_experts_per_tok, aux_loss_coef=0.0, z_loss_coef=0.0)


def local_experts_hf(cfg: Config, **fields: Any) -> dict[str, Any]:
    """:func:`hf_common` with Mixtral's expert keys (``num_local_experts`` experts of
    ``intermediate_size``), then ``fields`` (which may override any of them)."""
    experts = dict(intermediate_size=cfg.moe.expert_hidden, num_local_experts=cfg.moe.num_experts)
    return {**hf_common(cfg), **experts, **fields}


def local_experts_from_hf(hf: Any) -> tuple[ModelConfig, MoEConfig]:
    """The model and MoE sections of a source with Mixtral's expert keys, before its own."""
    model, moe = model_from_hf(hf), moe_from_hf(hf)
    moe.num_experts, moe.expert_hidden = hf.num_local_experts, hf.intermediate_size
    return model, moe


def hf_number(
    hf: Any,
    key: str,
    name: str,
    default: Any = None,
    *,
    integer: bool = False,
    minimum: float = 0,
    positive: bool = False,
) -> Any:
    """``hf.<key>`` (``default`` where unset) checked as a number (an integer with
    ``integer``) of at least ``minimum`` (above 0 with ``positive``); ConfigError naming the key
    and the family ``name`` otherwise."""
    value = getattr(hf, key, default)
    kind = int if integer else int | float
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if ok and (value <= 0 if positive else value < minimum):
        ok = False
    if not ok:
        what = "an integer" if integer else "a number"
        bound = "> 0" if positive else f">= {minimum:g}"
        raise ConfigError(f"{key}: {name} needs {what} {bound}; got {value!r}")
    return value


def refuse_partial_rotary(model: ModelConfig, name: str) -> None:
    """ConfigError unless ``model`` (read from ``name``'s config) rotates whole heads."""
    if model.partial_rotary_factor != 1.0:
        raise ConfigError(
            f"rope_parameters.partial_rotary_factor: {name} rotates whole heads; got "
            f"{model.partial_rotary_factor:g}"
        )


def refuse_attention_dropout(hf: Any) -> None:
    if getattr(hf, "attention_dropout", 0.0):
        raise ConfigError(
            f"attention_dropout: moetrain attention has none; got {hf.attention_dropout}"
        )


def refuse_attention_bias(hf: Any) -> None:
    if getattr(hf, "attention_bias", False):
        raise ConfigError("attention_bias: moetrain attention has no biases")


def finish(model: ModelConfig, moe: MoEConfig) -> Config:
    """The validated Config of an imported model (``data.seq_len`` capped at the positions it
    computes)."""
    cfg = Config(model=model, moe=moe)
    cfg.data.seq_len = min(cfg.data.seq_len, model.max_seq_len)
    cfg.validate()
    return cfg


def placement(
    moe_layers: list[int], n_layers: int, fields: str = "mlp_only_layers/decoder_sparse_step"
) -> tuple[int, int]:
    """``(first_k_dense, moe_every)`` reproducing exactly ``moe_layers``, or ConfigError naming
    the Hugging Face ``fields`` that placed them."""
    for first in range(n_layers + 1):
        for every in range(1, n_layers + 1):
            moe = MoEConfig(first_k_dense=first, moe_every=every)
            if moe.moe_layers(n_layers) == moe_layers:
                return first, every
    raise ConfigError(
        f"{fields}: MoE layers {moe_layers} are not expressible as "
        "moe.first_k_dense + moe.moe_every"
    )


def dense_from_hf(
    hf: Any, *, qkv_bias: bool = False, qk_norm: bool = False, windowed: bool = False
) -> Config:
    """The moetrain config of a dense family's model: every layer dense, its FFN the SwiGLU of
    ``intermediate_size``. ``qkv_bias`` / ``qk_norm``: what the family always has;
    ``windowed``: whether its sliding window applies unless ``use_sliding_window`` says not.
    Plain RoPE only, no MLP or attention-output biases, no window shorter than the context."""
    model = model_from_hf(hf)
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(hf, flag, False):
            raise ConfigError(f"{flag}: moetrain attention and FFNs have no such biases")
    window = getattr(hf, "sliding_window", None)
    applies = getattr(hf, "use_sliding_window", windowed) and window is not None
    if applies and window < model.max_seq_len:
        raise ConfigError(
            f"sliding_window: {window} < max_position_embeddings={model.max_seq_len}; "
            "moetrain attends to the whole context"
        )
    model.qkv_bias, model.qk_norm = qkv_bias, qk_norm
    return finish(
        model, MoEConfig(first_k_dense=model.n_layers, aux_loss_coef=0.0, z_loss_coef=0.0)
    )
