"""Qwen3.5 dense, the text model (Qwen3_5ForCausalLM, ``model_type`` qwen3_5_text; the language
model of Qwen3.5-27B and the smaller dense releases), a source of upcycling: Qwen3-Next's hybrid
layers as Qwen3.5-MoE has them (:mod:`.qwen3_5_moe_text`: the four Gated DeltaNet projections,
multimodal RoPE that is plain RoPE on text), a dense SwiGLU FFN in every layer
(``intermediate_size``). Upcycled into experts that each start as the dense FFN, the MoE model
computes the dense model exactly (``checkpoint.init_from``).

The released checkpoints are ``Qwen3_5ForConditionalGeneration`` directories, read as
Qwen3.5-MoE's: the text model under ``model.language_model.``, the vision tower not taken.
"""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, MoEConfig
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.layout import Layout, Wrapper
from moetrain.convert.families.qwen3_5_moe_text import WRAPPER_TENSORS
from moetrain.convert.families.qwen3_next import MTP, hybrid_from_hf

NAME = "Qwen3_5ForCausalLM"


def from_hf(hf: Any) -> Config:
    model = hf_config.model_from_hf(hf)
    hybrid_from_hf(hf, model, NAME)
    moe = MoEConfig(first_k_dense=model.n_layers, aux_loss_coef=0.0, z_loss_coef=0.0)
    return hf_config.finish(model, moe)


FAMILY = Family(
    "qwen3_5_text",
    NAME,
    from_hf,
    layout=Layout(mtp=MTP),
    wrapper=Wrapper(
        architecture="Qwen3_5ForConditionalGeneration",
        model_type="qwen3_5",
        config_key="text_config",
        tensors=WRAPPER_TENSORS,
        left_out=("model.visual.",),
        what="the vision tower",
    ),
)
