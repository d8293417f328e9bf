"""MiniMax-M2 (MiniMaxM2ForCausalLM; MiniMax-M2, M2.1): RMSNorm over the whole query / key
projection (all heads together: ``model.qk_norm`` with ``model.qk_norm_scope: projection``),
rotary over the first ``rotary_dim`` dims of each head (``model.partial_rotary_factor``;
released 64 of 128), a sigmoid router whose top-k is chosen on the scores shifted by the
selection bias ``e_score_correction_bias`` (moetrain's aux-loss-free ``expert_bias``), weights
from the unbiased scores, always renormalised; no shared experts, MoE in every layer. Its files
name the MoE block as Mixtral's (``block_sparse_moe.gate``, ``block_sparse_moe.experts.<e>.
{w1,w3,w2}``) with the selection bias under the block; transformers v5 holds them under
``mlp``."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.holds import ANY, free, only
from moetrain.convert.families.layout import Layout, PerExpert

NAME = "MiniMaxM2ForCausalLM"
_WHOLE = (
    "{name} always normalises the whole query/key projection (all heads together): needs "
    "model.qk_norm=true and model.qk_norm_scope=projection"
)
HOLDS = {
    **free("model.partial_rotary_factor"),
    "model.qk_norm": only(True, why=_WHOLE),
    "model.qk_norm_scope": only("projection", why=_WHOLE),
    "moe.score_func": only("sigmoid"),
    "moe.renormalize": only(True),
    "moe.bias_update_rate": ANY,
}
LAYOUT = Layout(
    moe_block="block_sparse_moe",
    experts=PerExpert({"w1": "w1", "w3": "w3", "w2": "w2"}),
    selection_bias="e_score_correction_bias",
    in_memory={"block_sparse_moe": "mlp"},
)


def to_hf(cfg: Config) -> dict[str, Any]:
    model, moe = cfg.model, cfg.moe
    return hf_config.local_experts_hf(
        cfg,
        router_jitter_noise=moe.jitter,
        # as released: read by serving engines (vLLM), not by transformers' class
        rotary_dim=model.rope_dim,
        use_qk_norm=True,
        qk_norm_type="per_layer",
        scoring_func="sigmoid",
        use_routing_bias=True,
    )


def from_hf(hf: Any) -> Config:
    def get(name: str, default: Any) -> Any:
        return getattr(hf, name, default)

    hf_config.refuse_attention_dropout(hf)
    if not get("use_qk_norm", True) or get("qk_norm_type", "per_layer") != "per_layer":
        raise ConfigError(
            f"use_qk_norm / qk_norm_type: {NAME} normalises the whole query/key projection "
            f"(true / per_layer); got {get('use_qk_norm', True)} / {get('qk_norm_type', None)}"
        )
    if get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"scoring_func: {NAME} routes with sigmoid; got {hf.scoring_func}")
    if get("shared_intermediate_size", 0):
        raise ConfigError(
            f"shared_intermediate_size: {NAME}'s class has no shared experts; got "
            f"{hf.shared_intermediate_size}"
        )
    model, moe = hf_config.local_experts_from_hf(hf)
    model.qk_norm, model.qk_norm_scope = True, "projection"
    moe.score_func, moe.renormalize = "sigmoid", True
    return hf_config.finish(model, moe)


FAMILY = Family("minimax_m2", NAME, from_hf, to_hf, holds=HOLDS, layout=LAYOUT)
