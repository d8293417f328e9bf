"""Gemma 4's MoE text model (Gemma4ForCausalLM, ``gemma4_text``; released as the
``Gemma4ForConditionalGeneration`` wrapper, 26B-A4B): sliding-window and global layers
(``layer_types``; released five to one, the last layer global), per-head query/key RMSNorm
before RoPE and a weightless one on the values (``model.qk_norm``, ``model.value_norm``),
attention scaled by 1 (``model.attention_scale``), the global layers' own head dim, key/value
heads, keys as values and proportional RoPE of their own theta (``model.global_*``), sandwich
norms, a GeGLU dense MLP beside GeGLU experts in every layer with their own norms
(``model.ffn_activation`` / ``moe.activation: geglu``, ``moe.dense_branch``), a softmax
router scoring a weightless RMSNorm of the residual stream times a learned scale, its top-k
weights renormalised and times a learned per-expert scale (``moe.router_input_norm``,
``moe.expert_scale``), a learned scalar on each layer's output (``model.layer_scalar``), the
embeddings times sqrt(hidden_size) (``model.embedding_multiplier``) and the final logits
soft-capped (``model.final_logit_softcap``). Its files hold each layer's experts fused
(``experts.gate_up_proj`` (E, 2F, D) = [gate; up], ``experts.down_proj`` (E, D, F)) beside
the layer's ``router.{proj,scale,per_expert_scale}`` and ``mlp``.

Not held: per-layer input embeddings (``hidden_size_per_layer_input``, the small Gemma 4
models'), key/value sharing across layers (``num_kv_shared_layers``), bidirectional attention
(``use_bidirectional_attention: all``; ``vision`` is causal over text and imported so), the
dense models (``enable_moe_block: false``). The wrapper's vision and audio towers are not
taken."""

from __future__ import annotations

import math
from typing import Any

from moetrain.config import Config, ConfigError, ModelConfig, MoEConfig
from moetrain.config.layer_plan import FULL, SLIDING, layer_types
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.holds import free, only, refused_when
from moetrain.convert.families.layout import Fused, Layout, Wrapper

NAME = "Gemma4ForCausalLM"
ACTIVATION = "gelu_pytorch_tanh"


def _embed_scale(model: ModelConfig) -> float:
    """The embeddings' scale: sqrt(hidden_size), as transformers computes it."""
    return model.d_model**0.5


def _layer_types_held(model: ModelConfig, _: Any) -> bool:
    """Whether transformers would keep the layer types (it forces the last layer global)."""
    return layer_types(model)[-1] != FULL


HOLDS = {
    **free(
        "model.sliding_window",
        "model.final_logit_softcap",
        "model.global_head_dim",
        "model.global_k_eq_v",
        "model.global_rope_theta",
        "model.global_rope_proportion",
    ),
    "model.layer_types": refused_when(
        _layer_types_held, "{name}'s last layer is global: must end with full_attention"
    ),
    "model.global_n_kv_heads": refused_when(
        lambda m, _: not m.global_k_eq_v and m.global_n_kv_heads not in (None, m.n_kv_heads),
        "{name} gives the global layers key/value heads of their own with keys as values "
        "only (attention_k_eq_v): must be null or model.n_kv_heads without "
        "model.global_k_eq_v",
    ),
    "model.embedding_multiplier": refused_when(
        lambda m, _: not math.isclose(m.embedding_multiplier, _embed_scale(m), rel_tol=1e-12),
        "{name} scales the embeddings by sqrt(d_model); must be model.d_model ** 0.5",
    ),
    "model.rope_scaling": only("none"),
    "model.attention_scale": only(1.0, why="{name} scales attention logits by 1; must be 1.0"),
    "model.block_norms": only("sandwich"),
    "model.qk_norm": only(True),
    "model.value_norm": only(True),
    "model.ffn_activation": only("geglu"),
    "model.layer_scalar": only(True),
    "moe.activation": only("geglu"),
    "moe.renormalize": only(True),
    "moe.router_input_norm": only(True),
    "moe.expert_scale": only(True),
    "moe.dense_branch": only(True),
}
LAYOUT = Layout(moe_block="", router="router.proj", experts=Fused())
WRAPPER = Wrapper(
    architecture="Gemma4ForConditionalGeneration",
    model_type="gemma4",
    config_key="text_config",
    tensors={"model.language_model.": "model."},
    left_out=(
        "model.vision_tower.",
        "model.embed_vision.",
        "model.audio_tower.",
        "model.embed_audio.",
    ),
    what="the vision and audio towers",
)


def _rope_parameters(model: ModelConfig) -> dict[str, dict[str, Any]]:
    """transformers' per-layer-type ``rope_parameters``: the sliding layers' plain RoPE, the
    global layers' own theta, proportional where ``model.global_rope_proportion`` is set."""
    full = {"rope_type": "default", "rope_theta": model.global_rope_theta or model.rope_theta}
    if model.global_rope_proportion is not None:
        full.update(rope_type="proportional", partial_rotary_factor=model.global_rope_proportion)
    return {SLIDING: {"rope_type": "default", "rope_theta": model.rope_theta}, FULL: full}


def to_hf(cfg: Config) -> dict[str, Any]:
    model, moe = cfg.model, cfg.moe
    return dict(
        vocab_size=model.vocab_size,
        hidden_size=model.d_model,
        intermediate_size=model.dense_hidden,
        num_hidden_layers=model.n_layers,
        num_attention_heads=model.n_heads,
        num_key_value_heads=model.n_kv_heads,
        head_dim=model.attention_head_dim,
        global_head_dim=model.global_head_dim or model.attention_head_dim,
        num_global_key_value_heads=model.global_n_kv_heads,
        attention_k_eq_v=model.global_k_eq_v,
        hidden_activation=ACTIVATION,
        max_position_embeddings=model.max_seq_len,
        initializer_range=model.init_std,
        rms_norm_eps=model.norm_eps,
        tie_word_embeddings=model.tie_embeddings,
        rope_parameters=_rope_parameters(model),
        attention_bias=False,
        sliding_window=model.sliding_window or model.max_seq_len,
        layer_types=hf_config.layer_types(model),
        final_logit_softcapping=model.final_logit_softcap,
        enable_moe_block=True,
        num_experts=moe.num_experts,
        top_k_experts=moe.top_k,
        moe_intermediate_size=moe.expert_hidden,
        hidden_size_per_layer_input=0,
        num_kv_shared_layers=0,
    )


def _refuse_unheld(hf: Any) -> None:
    """ConfigError naming the first field of ``hf`` whose setting moetrain does not compute."""

    def get(name: str, default: Any = None) -> Any:
        return getattr(hf, name, default)

    hf_config.refuse_attention_dropout(hf)
    hf_config.refuse_attention_bias(hf)
    refusals = (
        ("enable_moe_block", not get("enable_moe_block"), "only the MoE models are imported"),
        (
            "hidden_size_per_layer_input",
            bool(get("hidden_size_per_layer_input")),
            "per-layer input embeddings are not held",
        ),
        (
            "num_kv_shared_layers",
            bool(get("num_kv_shared_layers")),
            "keys and values shared across layers are not held",
        ),
        (
            "use_bidirectional_attention",
            get("use_bidirectional_attention") == "all",
            "moetrain attention is causal",
        ),
        ("hidden_activation", get("hidden_activation") != ACTIVATION, f"must be {ACTIVATION}"),
    )
    for key, refused, why in refusals:
        if refused:
            raise ConfigError(f"{key}: {NAME}: {why}; got {get(key)!r}")


class _LayerView(hf_config.WithRope):
    """A Gemma 4 config seen as its sliding layers' (their head dim and key/value heads,
    which transformers refuses to read from the whole config; the first layer's without
    one) with their ``rope_parameters``."""

    def __getattr__(self, name: str) -> Any:
        if name in ("head_dim", "num_key_value_heads"):
            types = list(self._hf.layer_types)
            first = types.index(SLIDING) if SLIDING in types else 0
            return getattr(self._hf.per_layer_config[first], name)
        return super().__getattr__(name)


def from_hf(hf: Any) -> Config:
    _refuse_unheld(hf)
    rope = hf.rope_parameters
    sliding = rope.get(SLIDING) or {"rope_type": "default", "rope_theta": 10000.0}
    if sliding.get("rope_type", "default") != "default":
        raise ConfigError(f"rope_parameters.{SLIDING}: must be default RoPE; got {sliding}")
    model = hf_config.model_from_hf(_LayerView(hf, sliding))
    moe = MoEConfig(top_k=hf.top_k_experts, aux_loss_coef=0.0, z_loss_coef=0.0)
    hf_config.windows_from_hf(hf, model)
    types = list(hf.layer_types)
    full = rope.get(FULL, {})
    kind = full.get("rope_type", "default")
    if kind not in ("default", "proportional"):
        raise ConfigError(f"rope_parameters.{FULL}: default or proportional RoPE; got {full}")
    if FULL in types:
        own = hf.per_layer_config[types.index(FULL)]
        model.global_head_dim = own.head_dim if own.head_dim != model.head_dim else None
        model.global_k_eq_v = bool(hf.attention_k_eq_v)
        kv = own.num_key_value_heads
        model.global_n_kv_heads = kv if kv != model.n_kv_heads else None
        theta = float(full.get("rope_theta", model.rope_theta))
        model.global_rope_theta = theta if theta != model.rope_theta else None
        if kind == "proportional":
            model.global_rope_proportion = float(full.get("partial_rotary_factor", 1.0))
    model.qk_norm = model.value_norm = model.layer_scalar = True
    model.attention_scale, model.block_norms = 1.0, "sandwich"
    model.ffn_activation, moe.activation = "geglu", "geglu"
    model.embedding_multiplier = _embed_scale(model)
    cap = getattr(hf, "final_logit_softcapping", None)
    model.final_logit_softcap = float(cap) if cap else None
    moe.num_experts, moe.expert_hidden = hf.num_experts, hf.moe_intermediate_size
    moe.renormalize = moe.router_input_norm = moe.expert_scale = moe.dense_branch = True
    return hf_config.finish(model, moe)


FAMILY = Family("gemma4_text", NAME, from_hf, to_hf, holds=HOLDS, layout=LAYOUT, wrapper=WRAPPER)
