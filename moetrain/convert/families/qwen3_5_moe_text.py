"""Qwen3.5 / Qwen3.6 MoE, the text model (Qwen3_5MoeForCausalLM, ``model_type``
qwen3_5_moe_text; the language model of Qwen3.5-35B-A3B, -122B-A10B, -397B-A17B and Qwen3.6):
Qwen3-Next's hybrid layers (:mod:`.qwen3_next`) with Gated DeltaNet's four projections unfused
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``: moetrain's own), every layer MoE,
the top-k weights always renormalised, one shared expert behind a sigmoid gate, vocabulary
248320 as released.

RoPE: the released ``rope_parameters`` carry multimodal RoPE (``mrope_section``,
``mrope_interleaved``): the rotary frequencies split in three sections rotated by a temporal,
a height and a width position. For text the three positions are the token's position, so
every section rotates by it and the result is plain RoPE (partial, ``partial_rotary_factor``)
exactly: moetrain computes that, and an export writes the released keys back.

The released checkpoints are ``Qwen3_5MoeForConditionalGeneration`` directories
(``text_config``; the text model's tensors under ``model.language_model.``, ``lm_head`` and the
multi-token-prediction module ``mtp.*`` beside a vision tower ``model.visual.*``): importing
one takes the text model (and ``mtp.*``, ``mtp_num_hidden_layers`` of them) and says that the
vision tower is not taken.
"""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ModelConfig
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.holds import only
from moetrain.convert.families.layout import Layout, Wrapper
from moetrain.convert.families.qwen3_next import HYBRID, MTP, hybrid_from_hf, hybrid_hf

NAME = "Qwen3_5MoeForCausalLM"
HOLDS = {
    **HYBRID,
    "moe.num_shared_experts": only(
        0, 1, why="{name} has at most one shared expert (behind its gate); must be 0 or 1"
    ),
    "moe.shared_expert_gate": only(True, applies=lambda _, moe: moe.num_shared_experts > 0),
    "moe.renormalize": only(True),
}


def mrope_section(model: ModelConfig) -> list[int]:
    """The three sections of the rotary frequencies (``rope_dim / 2``) in the released
    proportions (11, 11, 10 of 32); any split computes the same for text."""
    half = model.rope_dim // 2
    first = half * 11 // 32
    return [first, first, half - 2 * first]


def qwen3_5_hf(cfg: Config) -> dict[str, Any]:
    """The transformers fields every Qwen3.5 text model has (MoE or dense)."""
    model = cfg.model
    fields = dict(hf_config.hf_common(cfg), **hybrid_hf(model))
    fields.pop("num_experts_per_tok")
    fields.pop("router_aux_loss_coef")
    fields["rope_parameters"].update(mrope_section=mrope_section(model), mrope_interleaved=True)
    fields["mtp_num_hidden_layers"] = model.mtp_depth
    return fields


def to_hf(cfg: Config) -> dict[str, Any]:
    moe = cfg.moe
    return dict(
        qwen3_5_hf(cfg),
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        moe_intermediate_size=moe.expert_hidden,
        shared_expert_intermediate_size=moe.shared_hidden if moe.num_shared_experts else 0,
        router_aux_loss_coef=moe.aux_loss_coef,
    )


def from_hf(hf: Any) -> Config:
    model, moe = hf_config.model_from_hf(hf), hf_config.moe_from_hf(hf)
    hybrid_from_hf(hf, model, NAME)
    moe.num_experts, moe.expert_hidden = hf.num_experts, hf.moe_intermediate_size
    model.dense_hidden = moe.expert_hidden  # (no dense layer: the experts' size, as Mixtral's)
    moe.renormalize = True
    shared = hf.shared_expert_intermediate_size  # 0: none
    moe.num_shared_experts, moe.shared_expert_gate = int(shared > 0), shared > 0
    moe.shared_expert_hidden = shared or None
    return hf_config.finish(model, moe)


# the released directories: the text model beside a vision tower
WRAPPER_TENSORS = {"model.language_model.": "model.", "lm_head.": "lm_head.", "mtp.": "mtp."}
FAMILY = Family(
    "qwen3_5_moe_text",
    NAME,
    from_hf,
    to_hf,
    holds=HOLDS,
    layout=Layout(shared_expert_always=True, mtp=MTP),
    wrapper=Wrapper(
        architecture="Qwen3_5MoeForConditionalGeneration",
        model_type="qwen3_5_moe",
        config_key="text_config",
        tensors=WRAPPER_TENSORS,
        left_out=("model.visual.",),
        what="the vision tower",
    ),
)
