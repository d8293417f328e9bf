"""Olmo-Hybrid (OlmoHybridForCausalLM; allenai's Olmo-Hybrid-7B), dense, a source of upcycling:
Gated DeltaNet layers (``linear_attention`` in ``layer_types``; released three to every fourth
attention layer) with negative eigenvalues (``linear_allow_neg_eigval``: beta in (0, 2),
``model.linear_allow_neg_eigval``) and an output norm of eps 1e-5 whatever ``rms_norm_eps``
says (``model.linear_norm_eps``), pre-norm; attention layers with RMSNorm over the whole
query / key projection (``model.qk_norm_scope: projection``), without RoPE where the config's
``rope_theta`` is null (as released: ``model.nope_layers``, every attention layer), post-norm
(``model.attention_block_norms: post``: each branch's output normalised before its residual
add, no norm before it); a dense SwiGLU FFN in every layer. Upcycled into experts that each
start as the dense FFN, the MoE model computes the dense model exactly (``checkpoint.init_from``).

Files (as transformers writes them and reads the release): Gated DeltaNet's q, k, v projections
and convolutions apart (``linear_attn.{q,k,v}_proj``, ``{q,k,v}_conv1d``), its gate
``g_proj``, ``a_proj``, ``b_proj``, ``o_norm``, ``o_proj``; a block's first norm
``attention_layer_norm``, its second ``feedforward_layer_norm`` (the attention layers' output
norm of the attention, ``post_feedforward_layernorm`` the FFN's).
"""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, MoEConfig
from moetrain.config.layer_plan import FULL, layer_types
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.layout import Layout
from moetrain.convert.families.qwen3_next import hybrid_from_hf

NAME = "OlmoHybridForCausalLM"
OUTPUT_NORM_EPS = 1e-5  # its Gated DeltaNet output norm's, fixed in its class
LAYOUT = Layout(
    linear_qkv_apart=True,
    renames={
        "input_layernorm": "attention_layer_norm",
        "post_attention_layernorm": "feedforward_layer_norm",
        "linear_attn.in_proj_z": "linear_attn.g_proj",
        "linear_attn.in_proj_b": "linear_attn.b_proj",
        "linear_attn.in_proj_a": "linear_attn.a_proj",
        "linear_attn.norm": "linear_attn.o_norm",
        "linear_attn.out_proj": "linear_attn.o_proj",
    },
)


def from_hf(hf: Any) -> Config:
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    nope = rope.get("rope_theta") is None  # (its class then builds no rotary embedding)
    if nope:
        hf = hf_config.WithRope(hf, {"rope_type": "default", "rope_theta": 10000.0})
    hf_config.refuse_attention_bias(hf)
    model = hf_config.model_from_hf(hf)
    hybrid_from_hf(hf, model, NAME)  # the layer types and Gated DeltaNet's shape
    model.attention_output_gate = model.zero_centered_norm = False
    model.qk_norm, model.qk_norm_scope = True, "projection"
    model.linear_allow_neg_eigval = bool(getattr(hf, "linear_allow_neg_eigval", True))
    model.linear_norm_eps = OUTPUT_NORM_EPS
    model.attention_block_norms = "post"
    full = [i for i, t in enumerate(layer_types(model)) if t == FULL]
    model.nope_layers = full if nope else None
    moe = MoEConfig(first_k_dense=model.n_layers, aux_loss_coef=0.0, z_loss_coef=0.0)
    return hf_config.finish(model, moe)


FAMILY = Family("olmo_hybrid", NAME, from_hf, layout=LAYOUT)
