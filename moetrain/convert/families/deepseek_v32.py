"""DeepSeek-V3.2 (DeepseekV32ForCausalLM; V3.2-Exp too): DeepSeek-V3 with DeepSeek sparse
attention in every layer (``model.index_topk``: a lightning indexer per layer, ``index_topk``
``index_n_heads`` ``index_head_dim``; its RoPE half-split), latent attention always with the
query LoRA and its RoPE in adjacent pairs (the class has no ``rope_interleave`` field). The
rest, MoE and multi-token-prediction layers included, as :mod:`.deepseek_v3`."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError, ModelConfig, MoEConfig
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.deepseek_v3 import HOLDS as V3_HOLDS
from moetrain.convert.families.deepseek_v3 import LAYOUT, mla_from_hf, mla_hf
from moetrain.convert.families.holds import only, refused_when

NAME = "DeepseekV32ForCausalLM"
# every layer sparse, the main RoPE in adjacent pairs
SPARSE_ATTENTION = {
    "model.rope_interleave": only(True),
    "model.index_topk": refused_when(
        lambda m, _: m.index_topk is None,
        "{name} has sparse attention in every layer (an indexer each); must be set",
    ),
}
HOLDS = {**V3_HOLDS, **SPARSE_ATTENTION}


def dsa_hf(cfg: Config) -> dict[str, Any]:
    """The transformers fields both sparse-attention families share."""
    model, moe = cfg.model, cfg.moe
    return dict(
        mla_hf(cfg),
        # as released (DeepSeek-V3's routing keys, read by serving engines)
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=moe.renormalize,
        num_nextn_predict_layers=model.mtp_depth,
        index_topk=model.index_topk,
        index_n_heads=model.index_n_heads,
        index_head_dim=model.index_head_dim,
    )


def dsa_from_hf(hf: Any, name: str) -> tuple[ModelConfig, MoEConfig]:
    """The model and MoE sections of a sparse-attention family's transformers config ``hf``
    (class ``name``); the caller sets what differs (the indexer's RoPE, its layers)."""
    model, moe = mla_from_hf(hf)
    if getattr(hf, "scoring_func", "sigmoid") not in (None, "sigmoid"):
        raise ConfigError(f"scoring_func: {name} routes with sigmoid; got {hf.scoring_func}")
    if hf.q_lora_rank is None:
        raise ConfigError(f"q_lora_rank: {name}'s attention has the query LoRA; got null")
    mlp = getattr(hf, "mlp_layer_types", None)
    if mlp is not None and mlp != [
        "dense" if i < moe.first_k_dense else "sparse" for i in range(model.n_layers)
    ]:
        raise ConfigError(
            f"mlp_layer_types: moetrain places the MoE layers after first_k_dense_replace="
            f"{moe.first_k_dense} dense ones; got {mlp}"
        )
    model.rope_interleave = True
    model.index_topk = hf_config.hf_number(hf, "index_topk", name, integer=True, positive=True)
    model.index_n_heads = hf_config.hf_number(
        hf, "index_n_heads", name, integer=True, positive=True
    )
    model.index_head_dim = hf_config.hf_number(
        hf, "index_head_dim", name, integer=True, positive=True
    )
    moe.score_func, moe.renormalize = "sigmoid", bool(getattr(hf, "norm_topk_prob", True))
    return model, moe


def from_hf(hf: Any) -> Config:
    return hf_config.finish(*dsa_from_hf(hf, NAME))


FAMILY = Family("deepseek_v32", NAME, from_hf, dsa_hf, holds=HOLDS, layout=LAYOUT)
