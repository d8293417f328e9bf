"""Weight and config mapping between moetrain's Transformer and Hugging Face MoE models.

Formats and the settings each one needs: :mod:`moetrain.convert.formats`. The Hugging Face side
uses each family's per-expert key layout (Mixtral ``block_sparse_moe.experts.M.w1.weight``; the
others ``mlp.experts.M.gate_proj.weight``), which transformers v4 loads as is and v5 fuses at load
time. :func:`from_hf_state_dict` also accepts v5's fused in-memory layout
(``mlp.experts.gate_up_proj`` (E, 2F, D) / ``down_proj`` (E, D, F), ``mlp.gate.weight``).
Expert weights: moetrain ``w13`` (E, D, 2F) = ``[w1 | w3]`` and ``w2`` (E, F, D); HF stores
``w1`` (gate), ``w3`` (up) and ``w2`` (down) per expert, transposed (``nn.Linear`` layout
(out, in)).

Mapping works on any part of a state dict (the converter streams the dense weights, then one
layer of experts at a time).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

from moetrain.config import Config, ConfigError, ModelConfig, MoEConfig
from moetrain.convert.formats import check_format, hf_config
from moetrain.model.moe.experts import pack_w13, unpack_w13

_ATTN = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
_MLP = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERTS = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(w13|w2)$")


def _moe_prefix(fmt: str) -> str:
    return "block_sparse_moe" if fmt == "mixtral" else "mlp"


def in_memory_name(fmt: str, key: str) -> str:
    """transformers v5's in-memory name of the HF key ``key`` (files saved with fused experts
    use it): Mixtral's ``block_sparse_moe`` is ``mlp`` there."""
    return key.replace(".block_sparse_moe.", ".mlp.") if fmt == "mixtral" else key


def expert_key(fmt: str, layer: int, expert: int, name: str) -> str:
    """HF per-expert key of moetrain's ``w1``/``w3``/``w2`` of one expert."""
    hf_name = name if fmt == "mixtral" else _MLP[name]
    return f"model.layers.{layer}.{_moe_prefix(fmt)}.experts.{expert}.{hf_name}.weight"


def dense_key_map(cfg: Config, fmt: str) -> dict[str, str]:
    """moetrain key -> HF key for every non-expert weight (and the GLM expert bias)."""
    model, moe = cfg.model, cfg.moe
    out = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not model.tie_embeddings:
        out["lm_head.weight"] = "lm_head.weight"
    for i in range(model.n_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        out[src + "attn_norm.weight"] = dst + "input_layernorm.weight"
        out[src + "ffn_norm.weight"] = dst + "post_attention_layernorm.weight"
        for ours, theirs in _ATTN.items():
            out[f"{src}attn.{ours}.weight"] = f"{dst}self_attn.{theirs}.weight"
            if model.qkv_bias and ours != "wo":
                out[f"{src}attn.{ours}.bias"] = f"{dst}self_attn.{theirs}.bias"
        if model.qk_norm:
            out[src + "attn.q_norm.weight"] = dst + "self_attn.q_norm.weight"
            out[src + "attn.k_norm.weight"] = dst + "self_attn.k_norm.weight"
        if not moe.is_moe_layer(i):
            for ours, theirs in _MLP.items():
                out[f"{src}ffn.{ours}.weight"] = f"{dst}mlp.{theirs}.weight"
            continue
        moe_dst = f"{dst}{_moe_prefix(fmt)}."
        out[src + "ffn.router.gate.weight"] = moe_dst + "gate.weight"
        if fmt == "glm4_moe":
            out[src + "ffn.router.expert_bias"] = moe_dst + "gate.e_score_correction_bias"
        shared = "shared_experts" if fmt == "glm4_moe" else "shared_expert"
        if moe.num_shared_experts > 0:
            for ours, theirs in _MLP.items():
                out[f"{src}ffn.shared_expert.{ours}.weight"] = f"{moe_dst}{shared}.{theirs}.weight"
        if moe.shared_expert_gate:
            out[src + "ffn.shared_gate.weight"] = moe_dst + "shared_expert_gate.weight"
    return out


def _zero_attention_biases(cfg: Config, fmt: str, key: str) -> dict[str, torch.Tensor]:
    """Qwen2-MoE's q/k/v biases, written as zeros next to their projection weights."""
    m = re.match(r"^layers\.(\d+)\.attn\.(w[qkv])\.weight$", key)
    if fmt != "qwen2_moe" or cfg.model.qkv_bias or not m:
        return {}
    head_dim = cfg.model.attention_head_dim
    heads = cfg.model.n_heads if m.group(2) == "wq" else cfg.model.n_kv_heads
    hf = f"model.layers.{m.group(1)}.self_attn.{_ATTN[m.group(2)]}.bias"
    return {hf: torch.zeros(heads * head_dim)}


def to_hf_state_dict(
    state_dict: dict[str, torch.Tensor], cfg: Config, fmt: str
) -> dict[str, torch.Tensor]:
    """A moetrain state dict, or any part of one, -> HF keys of ``fmt`` (contiguous tensors).

    Raises ConfigError for a setting or a tensor (non-zero expert bias) ``fmt`` cannot hold.
    """
    check_format(fmt, cfg.model, cfg.moe)
    keys = dense_key_map(cfg, fmt)
    out: dict[str, torch.Tensor] = {}
    for key, t in state_dict.items():
        m = _EXPERTS.match(key)
        if m:
            layer = int(m.group(1))
            if m.group(2) == "w13":
                parts = dict(zip(("w1", "w3"), unpack_w13(t), strict=True))
            else:
                parts = {"w2": t}
            for name, w in parts.items():
                for e in range(w.shape[0]):
                    out[expert_key(fmt, layer, e, name)] = w[e].t()
        elif key in keys:
            out[keys[key]] = t
            out.update(_zero_attention_biases(cfg, fmt, key))
        elif key.endswith("ffn.router.expert_bias"):
            if bool(t.ne(0).any()):
                raise ConfigError(
                    f"{key}: non-zero expert bias cannot be represented in {fmt} (it changes "
                    "which experts are selected)"
                )
        elif not (cfg.model.tie_embeddings and key == "lm_head.weight"):
            raise ConfigError(f"{key}: no {fmt} equivalent for this tensor")
    return {k: v.detach().contiguous() for k, v in out.items()}


def from_hf_state_dict(
    hf_state_dict: dict[str, torch.Tensor],
    cfg: Config,
    fmt: str,
    expert_layers: Iterable[int] | None = None,
    dense: bool = True,
) -> dict[str, torch.Tensor]:
    """HF state dict of ``fmt`` (per-expert or v5 fused layout) -> moetrain state dict.

    ``expert_layers``: the MoE layers whose experts to map (default all); ``dense``: whether to
    map the non-expert weights. Streaming readers pass one layer at a time.
    """
    check_format(fmt, cfg.model, cfg.moe)
    sd, moe = hf_state_dict, cfg.moe
    if fmt == "mixtral":  # the router under its v5 in-memory name (in_memory_name)
        sd = {k.replace(".mlp.gate.", ".block_sparse_moe.gate."): v for k, v in sd.items()}

    def get(key: str) -> torch.Tensor:
        if key not in sd:
            raise KeyError(f"{fmt} state dict has no {key!r}")
        return sd[key]

    out: dict[str, torch.Tensor] = {}
    if dense:
        out = {ours: get(theirs) for ours, theirs in dense_key_map(cfg, fmt).items()}
        if cfg.model.tie_embeddings:
            out["lm_head.weight"] = out["embed.weight"]
        mapped = set(dense_key_map(cfg, fmt).values())
        for key, t in sd.items():
            bias = re.search(r"self_attn\.[qkvo]_proj\.bias$", key)
            if bias and key not in mapped and bool(t.ne(0).any()):
                raise ConfigError(f"{key}: non-zero attention bias; moetrain attention has none")
        for i in range(cfg.model.n_layers):
            if moe.is_moe_layer(i):
                bias = f"layers.{i}.ffn.router.expert_bias"
                out[bias] = out[bias].float() if bias in out else torch.zeros(moe.num_experts)
    layers = range(cfg.model.n_layers) if expert_layers is None else expert_layers
    for i in layers:
        if not moe.is_moe_layer(i):
            continue
        dst, fused = f"layers.{i}.ffn.experts.", f"model.layers.{i}.mlp.experts."
        if fused + "gate_up_proj" in sd:  # transformers v5 fused layout
            f = moe.expert_hidden
            gate_up = get(fused + "gate_up_proj")  # (E, 2F, D)
            out[dst + "w13"] = pack_w13(gate_up[:, :f].mT, gate_up[:, f:].mT)
            out[dst + "w2"] = get(fused + "down_proj").transpose(1, 2)
        else:
            w1, w3, w2 = (
                torch.stack([get(expert_key(fmt, i, e, n)).t() for e in range(moe.num_experts)])
                for n in ("w1", "w3", "w2")
            )
            out[dst + "w13"], out[dst + "w2"] = pack_w13(w1, w3), w2
    return {k: v.detach().contiguous() for k, v in out.items()}


# ----------------------------------------------------------------------------- Mixtral API


def check_mixtral_compatible(model: ModelConfig, moe: MoEConfig) -> None:
    """Raise ConfigError naming the first setting Mixtral cannot represent."""
    check_format("mixtral", model, moe)


def mixtral_config(cfg: Config, **extra: Any):  # noqa: ANN201
    """The ``transformers.MixtralConfig`` equivalent to moetrain's model."""
    return hf_config(cfg, "mixtral", **extra)


def to_mixtral_state_dict(
    state_dict: dict[str, torch.Tensor], cfg: Config
) -> dict[str, torch.Tensor]:
    """moetrain state dict -> Mixtral per-expert keys (contiguous tensors, safetensors-ready)."""
    return to_hf_state_dict(state_dict, cfg, "mixtral")


def from_mixtral_state_dict(
    hf_state_dict: dict[str, torch.Tensor], cfg: Config
) -> dict[str, torch.Tensor]:
    """Mixtral state dict (per-expert or v5 fused layout) -> moetrain state dict."""
    return from_hf_state_dict(hf_state_dict, cfg, "mixtral")
