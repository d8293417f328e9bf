"""GLM-5 (GlmMoeDsaForCausalLM): DeepSeek-V3.2's architecture (:mod:`.deepseek_v32`) with the
indexer's RoPE in adjacent pairs (``model.index_rope_interleave``) and the indexer placement
per layer (``indexer_types``, ``model.indexer_types``: "full" layers run their own indexer,
"shared" ones attend to the keys the last earlier full layer selected; as released every layer
is full). Its MoE is DeepSeek-V3's; its files name the weights and the multi-token-prediction
layers as DeepSeek-V3's."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.deepseek_v3 import LAYOUT
from moetrain.convert.families.deepseek_v32 import HOLDS as V32_HOLDS
from moetrain.convert.families.deepseek_v32 import dsa_from_hf, dsa_hf
from moetrain.convert.families.holds import ANY, only

NAME = "GlmMoeDsaForCausalLM"
HOLDS = {
    **V32_HOLDS,
    "model.index_rope_interleave": only(True),
    "model.indexer_types": ANY,
}


def to_hf(cfg: Config) -> dict[str, Any]:
    fields = dsa_hf(cfg)
    types = cfg.model.indexer_types
    return fields if types is None else dict(fields, indexer_types=list(types))


def from_hf(hf: Any) -> Config:
    model, moe = dsa_from_hf(hf, NAME)
    model.index_rope_interleave = True
    types = list(getattr(hf, "indexer_types", None) or [])
    model.indexer_types = types if "shared" in types else None
    return hf_config.finish(model, moe)


FAMILY = Family("glm_moe_dsa", NAME, from_hf, to_hf, holds=HOLDS, layout=LAYOUT)
