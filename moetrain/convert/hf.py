"""Weight and config mapping between moetrain's Transformer and HF ``MixtralForCausalLM``.

Hugging Face side uses Mixtral's original per-expert key layout
(``model.layers.N.block_sparse_moe.experts.M.w1.weight``), which transformers v4 loads as is and
v5 fuses at load time. ``from_mixtral_state_dict`` also accepts v5's fused in-memory layout
(``model.layers.N.mlp.experts.gate_up_proj`` / ``down_proj``, ``mlp.gate.weight``).
Expert weights: moetrain ``w1``/``w3`` (E, D, F) and ``w2`` (E, F, D) are stored transposed
per expert in HF (``nn.Linear`` layout (out, in)).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moetrain.config import Config, ConfigError, ModelConfig, MoEConfig

if TYPE_CHECKING:
    from transformers import MixtralConfig

_ATTN = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}


def check_mixtral_compatible(model: ModelConfig, moe: MoEConfig) -> None:
    """Raise ConfigError naming the first setting Mixtral cannot represent."""
    problems = [
        (model.qk_norm, "model.qk_norm", "Mixtral has no query/key norm; must be false"),
        (moe.first_k_dense != 0, "moe.first_k_dense", "Mixtral has MoE in every layer; must be 0"),
        (moe.moe_every != 1, "moe.moe_every", "Mixtral has MoE in every layer; must be 1"),
        (moe.score_func != "softmax", "moe.score_func", "Mixtral routes with softmax"),
        (
            moe.topk_before_score,
            "moe.topk_before_score",
            "Mixtral takes softmax over all experts, then top-k; must be false",
        ),
        (not moe.renormalize, "moe.renormalize", "Mixtral renormalises the top-k; must be true"),
        (moe.route_scale != 1.0, "moe.route_scale", "Mixtral has no route scale; must be 1.0"),
        (moe.num_shared_experts != 0, "moe.num_shared_experts", "Mixtral has no shared experts"),
        (
            moe.bias_update_rate != 0.0,
            "moe.bias_update_rate",
            "Mixtral has no expert bias (aux-loss-free balancing); must be 0",
        ),
        (
            moe.capacity_factor != 0.0,
            "moe.capacity_factor",
            "Mixtral is dropless at inference; must be 0",
        ),
    ]
    for bad, key, why in problems:
        if bad:
            raise ConfigError(f"{key}: cannot convert to Mixtral: {why}")


def mixtral_config(cfg: Config, **extra: object) -> MixtralConfig:
    """The ``transformers.MixtralConfig`` equivalent to moetrain's model (``extra`` passes
    through, e.g. bos/eos token ids). Raises ConfigError for settings Mixtral lacks."""
    from transformers import MixtralConfig

    model, moe = cfg.model, cfg.moe
    check_mixtral_compatible(model, moe)
    head_dim = model.head_dim or model.d_model // model.n_heads
    return MixtralConfig(
        vocab_size=model.vocab_size,
        hidden_size=model.d_model,
        intermediate_size=moe.expert_hidden,
        num_hidden_layers=model.n_layers,
        num_attention_heads=model.n_heads,
        num_key_value_heads=model.n_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=model.max_seq_len,
        rms_norm_eps=model.norm_eps,
        tie_word_embeddings=model.tie_embeddings,
        num_local_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        router_jitter_noise=moe.jitter,
        router_aux_loss_coef=moe.aux_loss_coef,
        initializer_range=model.init_std,
        sliding_window=None,
        rope_theta=model.rope_theta,  # transformers v4
        rope_parameters={"rope_type": "default", "rope_theta": model.rope_theta},  # v5
        **extra,
    )


def to_mixtral_state_dict(
    state_dict: dict[str, torch.Tensor], cfg: Config
) -> dict[str, torch.Tensor]:
    """moetrain state dict -> Mixtral per-expert keys (contiguous tensors, safetensors-ready)."""
    model, moe = cfg.model, cfg.moe
    check_mixtral_compatible(model, moe)
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": state_dict["embed.weight"]}
    for i in range(model.n_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = state_dict[src + "attn_norm.weight"]
        out[dst + "post_attention_layernorm.weight"] = state_dict[src + "ffn_norm.weight"]
        for ours, theirs in _ATTN.items():
            out[f"{dst}self_attn.{theirs}.weight"] = state_dict[f"{src}attn.{ours}.weight"]
        bias = state_dict.get(src + "ffn.router.expert_bias")
        if bias is not None and bool(bias.ne(0).any()):
            raise ConfigError(
                f"{src}ffn.router.expert_bias: non-zero expert bias cannot be represented in "
                "Mixtral (it changes which experts are selected)"
            )
        moe_dst = dst + "block_sparse_moe."
        out[moe_dst + "gate.weight"] = state_dict[src + "ffn.router.gate.weight"]
        w1, w3, w2 = (state_dict[f"{src}ffn.experts.{n}"] for n in ("w1", "w3", "w2"))
        for e in range(moe.num_experts):
            out[f"{moe_dst}experts.{e}.w1.weight"] = w1[e].t()
            out[f"{moe_dst}experts.{e}.w3.weight"] = w3[e].t()
            out[f"{moe_dst}experts.{e}.w2.weight"] = w2[e].t()
    out["model.norm.weight"] = state_dict["norm.weight"]
    if not model.tie_embeddings:
        out["lm_head.weight"] = state_dict["lm_head.weight"]
    return {k: v.detach().contiguous() for k, v in out.items()}


def from_mixtral_state_dict(
    hf_state_dict: dict[str, torch.Tensor], cfg: Config
) -> dict[str, torch.Tensor]:
    """Mixtral state dict (per-expert or v5 fused layout) -> moetrain state dict."""
    model, moe = cfg.model, cfg.moe
    check_mixtral_compatible(model, moe)
    sd = hf_state_dict

    def get(key: str) -> torch.Tensor:
        if key not in sd:
            raise KeyError(f"Mixtral state dict has no {key!r}")
        return sd[key]

    out: dict[str, torch.Tensor] = {"embed.weight": get("model.embed_tokens.weight")}
    for i in range(model.n_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        out[dst + "attn_norm.weight"] = get(src + "input_layernorm.weight")
        out[dst + "ffn_norm.weight"] = get(src + "post_attention_layernorm.weight")
        for ours, theirs in _ATTN.items():
            out[f"{dst}attn.{ours}.weight"] = get(f"{src}self_attn.{theirs}.weight")
        if src + "mlp.experts.gate_up_proj" in sd:  # transformers v5 fused layout
            f = moe.expert_hidden
            gate_up = get(src + "mlp.experts.gate_up_proj")  # (E, 2F, D)
            out[dst + "ffn.router.gate.weight"] = get(src + "mlp.gate.weight")
            out[dst + "ffn.experts.w1"] = gate_up[:, :f].transpose(1, 2)
            out[dst + "ffn.experts.w3"] = gate_up[:, f:].transpose(1, 2)
            out[dst + "ffn.experts.w2"] = get(src + "mlp.experts.down_proj").transpose(1, 2)
        else:
            moe_src = src + "block_sparse_moe."
            out[dst + "ffn.router.gate.weight"] = get(moe_src + "gate.weight")
            for name in ("w1", "w3", "w2"):
                out[f"{dst}ffn.experts.{name}"] = torch.stack(
                    [get(f"{moe_src}experts.{e}.{name}.weight").t() for e in range(moe.num_experts)]
                )
        out[dst + "ffn.router.expert_bias"] = torch.zeros(moe.num_experts)
    out["norm.weight"] = get("model.norm.weight")
    out["lm_head.weight"] = out["embed.weight"] if model.tie_embeddings else get("lm_head.weight")
    return {k: v.detach().contiguous() for k, v in out.items()}
