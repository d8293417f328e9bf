"""dots.llm1 (Dots1ForCausalLM; rednote-hilab's dots.llm1.base / .inst): Qwen3's attention
(per-head query/key RMSNorm always, ``model.qk_norm``; ``attention_bias`` on all four
projections or none; sliding-window layers where ``layer_types`` has them, ``max_window_layers``
placing them) over DeepSeek-V3's MoE: sigmoid scores shifted by the selection bias
``e_score_correction_bias`` (moetrain's aux-loss-free ``expert_bias``), weights from the
unbiased scores, optional renormalisation, ``routed_scaling_factor`` (``moe.route_scale``;
released 2.5), group-limited routing by each group's two best, ungated shared experts sized
``n_shared_experts`` x ``moe_intermediate_size`` (released: two), the first
``first_k_dense_replace`` layers dense. Its files name the MoE weights as DeepSeek-V3's."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.deepseek_v3 import (
    DEEPSEEK_MOE,
    SIGMOID_GROUPS,
    deepseek_moe_from_hf,
    deepseek_moe_hf,
)
from moetrain.convert.families.holds import ATTENTION_BIAS, free, only
from moetrain.convert.families.layout import Layout

NAME = "Dots1ForCausalLM"
HOLDS = {
    **ATTENTION_BIAS,
    **free("model.sliding_window"),
    "model.qk_norm": only(True),
    **SIGMOID_GROUPS,
    **DEEPSEEK_MOE,
}
LAYOUT = Layout(shared_expert="shared_experts", selection_bias="gate.e_score_correction_bias")


def to_hf(cfg: Config) -> dict[str, Any]:
    model, moe = cfg.model, cfg.moe
    return dict(
        hf_config.hf_common(cfg),
        **deepseek_moe_hf(cfg),
        norm_topk_prob=moe.renormalize,
        attention_bias=model.qkv_bias,
        sliding_window=model.sliding_window,
        layer_types=hf_config.layer_types(model),
        # DeepSeek-V3's routing keys: read by serving engines (vLLM), not by transformers' class
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        moe_layer_freq=1,
    )


def from_hf(hf: Any) -> Config:
    def get(name: str, default: Any) -> Any:
        return getattr(hf, name, default)

    hf_config.refuse_attention_dropout(hf)
    model, moe = hf_config.model_from_hf(hf), hf_config.moe_from_hf(hf)
    hf_config.refuse_partial_rotary(model, NAME)
    hf_config.windows_from_hf(hf, model)
    model.qk_norm = True
    model.qkv_bias = model.o_bias = bool(get("attention_bias", False))
    deepseek_moe_from_hf(hf, moe, model.n_layers)
    moe.score_func, moe.renormalize = "sigmoid", bool(get("norm_topk_prob", False))
    return hf_config.finish(model, moe)


FAMILY = Family("dots1", NAME, from_hf, to_hf, holds=HOLDS, layout=LAYOUT)
