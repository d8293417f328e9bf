"""NVIDIA Nemotron 3 and Nemotron-H (NemotronHForCausalLM; NVIDIA-Nemotron-3-Nano-30B-A3B, the
latent-MoE Super and Ultra): every decoder layer is one pre-norm sublayer, as its
``hybrid_override_pattern`` (transformers' ``layers_block_type``) says: ``M`` a Mamba-2 layer
(``model.linear_attention: mamba2``), ``*`` grouped-query attention without positional
encoding (``model.nope_layers`` every attention layer), ``E`` an MoE layer, ``-`` a dense MLP.
moetrain holds each as a block of its mixer alone (``moe.layer_ffns`` ``none``) or of its FFN
alone (``model.layer_types`` ``none``). The MLPs are squared ReLU, not gated
(``model.ffn_activation`` and ``moe.activation`` ``relu2``); the router is DeepSeek-V3's
(sigmoid scores, the selection bias ``e_score_correction_bias``, groups scored by their two
best experts, ``norm_topk_prob``, ``routed_scaling_factor``); one shared expert of
``moe_shared_expert_intermediate_size`` always; ``moe_latent_size`` a latent MoE
(``moe.latent_dim``).

Files: ``backbone.embeddings``, ``backbone.layers.<i>.norm`` and ``.mixer.*`` (the Mamba-2
layer's ``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``;
attention's ``q/k/v/o_proj``; the MoE's ``gate``, ``gate.e_score_correction_bias``,
``experts.<e>.{up,down}_proj``, ``shared_experts.{up,down}_proj``, ``fc1/fc2_latent_proj``;
the MLP's ``up/down_proj``), ``backbone.norm_f``, ``lm_head``; transformers v5 holds them under
``model.`` with the experts stacked.
"""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError, ModelConfig, MoEConfig
from moetrain.config.layer_plan import FULL, LINEAR, NO_MIXER, layer_types
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.deepseek_v3 import SIGMOID_GROUPS
from moetrain.convert.families.granitemoehybrid import mamba_from_hf
from moetrain.convert.families.holds import (
    ANY,
    SHARED_EXPERTS_ALWAYS,
    free,
    only,
    refused_when,
)
from moetrain.convert.families.layout import Fused, Layout, PerExpert

NAME = "NemotronHForCausalLM"
MAMBA, ATTENTION, MOE, MLP = "linear_attention", "full_attention", "moe", "mlp"
# each block kind: transformers' layers_block_type -> (moetrain's layer type, its FFN)
BLOCKS = {
    MAMBA: (LINEAR, "none"),
    ATTENTION: (FULL, "none"),
    MOE: (NO_MIXER, "moe"),
    MLP: (NO_MIXER, "dense"),
}
PATTERN = {"M": MAMBA, "*": ATTENTION, "E": MOE, "-": MLP}  # hybrid_override_pattern's


def _blocks(model: ModelConfig, moe: MoEConfig) -> list[str | None]:
    """Each layer's block kind (None: one this class has no kind for)."""
    kinds = {v: k for k, v in BLOCKS.items()}
    return [kinds.get((t, moe.ffn_kind(i))) for i, t in enumerate(layer_types(model))]


def _attention_layers(model: ModelConfig) -> list[int]:
    return [i for i, t in enumerate(layer_types(model)) if t == FULL]


HOLDS = {
    **SIGMOID_GROUPS,
    **free("moe.route_scale", "moe.shared_expert_hidden", "moe.latent_dim"),
    "model.layer_types": refused_when(
        lambda m, moe: None in _blocks(m, moe),
        "{name}'s layers are each one sublayer: Mamba-2 or attention without an FFN "
        "(moe.layer_ffns none), or an MoE or dense FFN alone (layer type none)",
    ),
    "model.linear_attention": only(
        "mamba2",
        applies=lambda m, _: LINEAR in layer_types(m),
        why="{name} has Mamba-2 in its linear layers; must be mamba2",
    ),
    "model.nope_layers": refused_when(
        lambda m, _: m.nope_layers != (_attention_layers(m) or None),
        "{name}'s attention has no positional encoding; must list every full_attention layer",
    ),
    "model.rope_scaling": only(
        "none", why="{name}'s attention has no positional encoding; must be none"
    ),
    "model.tie_embeddings": only(False, why="{name} has its own LM head; must be false"),
    "model.ffn_activation": only("relu2"),
    "moe.activation": only("relu2"),
    "moe.num_shared_experts": SHARED_EXPERTS_ALWAYS,
    "moe.layer_ffns": ANY,
}
LAYOUT = Layout(
    base="backbone.",
    embed="embeddings",
    final_norm="backbone.norm_f",
    moe_block="mixer",
    dense_block="mixer",
    shared_expert="shared_experts",
    selection_bias="gate.e_score_correction_bias",
    experts=PerExpert({"w3": "up_proj", "w2": "down_proj"}),
    renames={
        "input_layernorm": "norm",
        "post_attention_layernorm": "norm",
        "self_attn": "mixer",
        "mamba": "mixer",
    },
    in_memory={"backbone.": "model."},
    in_memory_experts=Fused("experts.up_proj", "experts.down_proj"),
)


def to_hf(cfg: Config) -> dict[str, Any]:
    model, moe = cfg.model, cfg.moe
    kinds = {v: k for k, v in BLOCKS.items()}
    blocks = [kinds[(t, moe.ffn_kind(i))] for i, t in enumerate(layer_types(model))]
    mamba = {}
    if LINEAR in layer_types(model):
        high = model.mamba_dt_max
        mamba = dict(
            mamba_num_heads=model.mamba_num_heads,
            mamba_head_dim=model.mamba_head_dim,
            n_groups=model.mamba_n_groups,
            ssm_state_size=model.mamba_state_dim,
            conv_kernel=model.mamba_conv_kernel,
            use_conv_bias=model.mamba_conv_bias,
            chunk_size=model.mamba_chunk_size,
            use_bias=model.mamba_proj_bias,
            time_step_limit=[model.mamba_dt_min, float("inf") if high is None else high],
        )
    return dict(
        vocab_size=model.vocab_size,
        hidden_size=model.d_model,
        layers_block_type=blocks,
        num_attention_heads=model.n_heads,
        num_key_value_heads=model.n_kv_heads,
        head_dim=model.attention_head_dim,
        max_position_embeddings=model.max_seq_len,
        layer_norm_epsilon=model.norm_eps,
        tie_word_embeddings=False,
        initializer_range=model.init_std,
        intermediate_size=model.dense_hidden,
        mlp_hidden_act="relu2",
        mlp_bias=False,
        attention_bias=False,
        n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        moe_intermediate_size=moe.expert_hidden,
        n_shared_experts=1,
        moe_shared_expert_intermediate_size=moe.shared_hidden,
        moe_latent_size=moe.latent_dim,
        routed_scaling_factor=moe.route_scale,
        n_group=moe.n_group,
        topk_group=moe.topk_group,
        norm_topk_prob=moe.renormalize,
        **mamba,
    )


def _refuse(hf: Any) -> None:
    """The fields of ``hf`` whose settings moetrain does not compute."""
    for key, held in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if getattr(hf, key, held) != held:
            raise ConfigError(f"{key}: {NAME} computes {held} here; got {getattr(hf, key)!r}")
    if getattr(hf, "mlp_bias", False):
        raise ConfigError("mlp_bias: moetrain's MLPs and latent projections have no biases")
    if getattr(hf, "tie_word_embeddings", False):
        raise ConfigError(f"tie_word_embeddings: {NAME} has its own LM head; got true")


def from_hf(hf: Any) -> Config:
    _refuse(hf)
    blocks = list(getattr(hf, "layers_block_type", None) or [])
    if not blocks or any(b not in BLOCKS for b in blocks):
        raise ConfigError(
            f"layers_block_type: {NAME} needs one of {', '.join(BLOCKS)} per layer "
            f"(hybrid_override_pattern {''.join(PATTERN)}); got {blocks}"
        )
    heads = hf.num_attention_heads
    model = ModelConfig(
        vocab_size=hf.vocab_size,
        d_model=hf.hidden_size,
        n_layers=len(blocks),
        n_heads=heads,
        n_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        max_seq_len=hf.max_position_embeddings,
        norm_eps=float(hf.layer_norm_epsilon),
        init_std=float(getattr(hf, "initializer_range", 0.02)),
        dense_hidden=hf.intermediate_size,
        ffn_activation="relu2",
        layer_types=[BLOCKS[b][0] for b in blocks],
    )
    model.nope_layers = _attention_layers(model) or None
    if MAMBA in blocks:
        mamba_from_hf(_MambaFields(hf), model, NAME)
    moe = hf_config.moe_from_hf(hf)
    moe.layer_ffns = [BLOCKS[b][1] for b in blocks]
    moe.num_experts = hf_config.hf_number(hf, "n_routed_experts", NAME, integer=True, positive=True)
    moe.expert_hidden = hf.moe_intermediate_size
    moe.score_func, moe.activation = "sigmoid", "relu2"
    moe.renormalize = bool(getattr(hf, "norm_topk_prob", True))
    moe.route_scale = float(getattr(hf, "routed_scaling_factor", 1.0))
    moe.n_group, moe.topk_group = int(hf.n_group or 1), int(hf.topk_group or 1)
    moe.num_shared_experts = 1  # (its class always builds one)
    moe.shared_expert_hidden = hf.moe_shared_expert_intermediate_size
    moe.latent_dim = getattr(hf, "moe_latent_size", None)
    return hf_config.finish(model, moe)


class _MambaFields:
    """A NemotronHConfig read under Granite 4.0-H's Mamba-2 field names."""

    NAMES = {
        "mamba_n_heads": "mamba_num_heads",
        "mamba_d_head": "mamba_head_dim",
        "mamba_n_groups": "n_groups",
        "mamba_d_state": "ssm_state_size",
        "mamba_d_conv": "conv_kernel",
        "mamba_chunk_size": "chunk_size",
        "mamba_conv_bias": "use_conv_bias",
        "mamba_proj_bias": "use_bias",
    }

    def __init__(self, hf: Any) -> None:
        self._hf = hf

    def __getattr__(self, name: str) -> Any:
        return getattr(self._hf, self.NAMES.get(name, name))


FAMILY = Family("nemotron_h", NAME, from_hf, to_hf, holds=HOLDS, layout=LAYOUT)
