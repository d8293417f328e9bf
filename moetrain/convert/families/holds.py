"""What a family's transformers class can hold, as data, and the one check that refuses the rest.

Every moetrain setting that some family cannot represent has a :class:`Rule` in
:data:`BASELINE`: what a family holds of it unless it declares otherwise (Llama's attention,
Mixtral's router: the values most families take). A family declares only where it differs
(``Family.holds``: setting -> :class:`Rule`), from the vocabulary below. :func:`refusals`, the
one check, goes through the settings in :data:`BASELINE`'s order (the order users should fix
them in) and names each one the family cannot hold, with why. Imports neither torch nor
transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from moetrain.config import ModelConfig, MoEConfig
from moetrain.config.layer_plan import LINEAR, layer_plan, layer_types

Test = Callable[[ModelConfig, MoEConfig], bool]


@dataclass(frozen=True)
class Rule:
    """What a family holds of one setting: the values it takes (``values``; None: any), where
    ``applies`` (default: always), or a relation to other settings that ``refuses`` names
    (true: this config cannot convert). ``why``: a format string (``{name}`` the family's
    class, ``{model}`` / ``{moe}`` the config's sections); default from :data:`PHRASES`."""

    values: tuple[Any, ...] | None = None
    applies: Test | None = None
    refuses: Test | None = None
    why: str | None = None

    def refused(self, key: str, model: ModelConfig, moe: MoEConfig) -> bool:
        """Whether a family with this rule cannot hold ``key``'s value in this config."""
        if self.applies is not None and not self.applies(model, moe):
            return False
        if self.refuses is not None:
            return self.refuses(model, moe)
        return self.values is not None and setting(key, model, moe) not in self.values

    def can_hold(self, value: Any) -> bool:
        """Whether some config with this setting at ``value`` converts (a relation to other
        settings, or a rule that applies only with some of them, can be met)."""
        return self.values is None or value in self.values or self.applies is not None

    def reason(self, key: str, name: str, model: ModelConfig, moe: MoEConfig) -> str:
        """Why family ``name`` cannot hold ``key`` in this config."""
        if self.why is not None:
            return self.why.format(name=name, model=model, moe=moe)
        held = " or ".join(spell(v) for v in self.values or ())
        phrase = PHRASES.get(key, {}).get(self.values[0]) if len(self.values or ()) == 1 else None
        return f"{name} {phrase or 'holds no other value'}; must be {held}"


def setting(key: str, model: ModelConfig, moe: MoEConfig) -> Any:
    """The value of a dotted ``model.*`` / ``moe.*`` setting."""
    section, name = key.split(".")
    return getattr(model if section == "model" else moe, name)


def spell(value: Any) -> str:
    """A value as the config file spells it (true, null, 0.5, sigmoid)."""
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


ANY = Rule()


def only(*values: Any, applies: Test | None = None, why: str | None = None) -> Rule:
    """A family that holds the setting at these values only (where ``applies``)."""
    return Rule(values=values, applies=applies, why=why)


def refused_when(test: Test, why: str) -> Rule:
    """A family that cannot hold the setting where ``test`` is true of the config."""
    return Rule(refuses=test, why=why)


def free(*keys: str) -> dict[str, Rule]:
    """Settings a family holds at any value."""
    return dict.fromkeys(keys, ANY)


# latent attention in place of the baseline's grouped-query attention (its value heads' width
# is one of its own dims)
LATENT_ATTENTION: dict[str, Rule] = {
    "model.attention": only("mla", why="{name} has latent attention; must be mla"),
    "model.v_head_dim": ANY,
}


# --- the relations several families share -------------------------------------------------

# transformers' attention_bias: biases on all four attention projections or none
ATTENTION_BIAS = {
    "model.qkv_bias": ANY,
    "model.o_bias": refused_when(
        lambda m, _: m.o_bias != m.qkv_bias,
        "{name}'s attention_bias puts biases on all four projections or none; must equal "
        "model.qkv_bias={model.qkv_bias}",
    ),
}
SHARED_EXPERTS_ALWAYS = refused_when(
    lambda _, moe: moe.num_shared_experts == 0,
    "{name} always has shared experts; must be >= 1",
)
# shared experts sized as their count times the experts' size (n_shared_experts x
# moe_intermediate_size)
SHARED_SIZED_BY_COUNT = refused_when(
    lambda _, moe: (
        moe.num_shared_experts > 0
        and moe.shared_hidden != moe.num_shared_experts * moe.expert_hidden
    ),
    "{name} sizes shared experts as their count x the experts' size; must be null or "
    "num_shared_experts * expert_hidden",
)
# group-limited routing that scores a group by its two best experts
GROUPS_OF_TWO = {
    "moe.n_group": refused_when(
        lambda _, moe: moe.n_group > 1 and moe.num_experts // moe.n_group < 2,
        "{name} scores a group by its two best experts: groups need >= 2 experts",
    ),
    "moe.group_score": only("top2_sum", applies=lambda _, moe: moe.n_group > 1),
}


def _no_nope_layers(model: ModelConfig, _: MoEConfig) -> bool:
    return bool(model.nope_layers)


def _block_without_mixer(model: ModelConfig, moe: MoEConfig) -> bool:
    return any(layer.mixer is None for layer in layer_plan(model, moe))


def _linear_layers(model: ModelConfig, _: MoEConfig) -> bool:
    return LINEAR in layer_types(model)


# --- what a family holds unless it declares otherwise, in the order refusals are named -----

BASELINE: dict[str, Rule] = {
    # attention, then the pieces only some families have
    "model.attention": only("gqa", why="{name} has grouped-query attention; must be gqa"),
    "model.index_topk": only(None),
    "model.index_rope_interleave": only(False, applies=lambda m, _: m.index_topk is not None),
    "model.indexer_types": only(None),
    "model.layer_types": refused_when(
        _block_without_mixer, "{name} has attention in every layer; no layer type none"
    ),
    "model.linear_attention": refused_when(
        _linear_layers, "{name} has attention in every layer; no linear_attention layers"
    ),
    "model.mamba_head_dim": ANY,  # (its families' size rule)
    "model.kda_full_rank_gates": only(False),
    "model.kda_gate_lower_bound": only(None),
    "model.linear_num_heads": ANY,  # (Ling 3.0's: the attention's heads)
    "model.mla_head_gate": only(False),
    "model.mla_lora_scale": only(False),
    "model.full_attention_interval": only(None),
    "model.linear_allow_neg_eigval": only(False),
    "model.linear_norm_eps": only(None),
    "model.rope_interleave": only(False),
    "model.partial_rotary_factor": only(1.0),
    "model.rope_scaling": ANY,
    "model.rope_long_regime": only(
        None,
        "long",
        applies=lambda m, _: m.rope_scaling == "longrope",
        why="{name} takes LongRoPE's long factors past the original context; must be null or long",
    ),
    "model.embedding_multiplier": only(1.0),
    "model.residual_multiplier": only(1.0),
    "model.logits_scaling": only(1.0),
    "model.final_logit_softcap": only(None),
    "model.hc_streams": only(1),
    "model.hc_sinkhorn_iters": ANY,  # (with hyper-connections only)
    "model.hc_eps": ANY,
    "model.layer_scalar": only(False),
    "model.value_norm": only(False),
    "model.global_head_dim": only(None),
    "model.global_n_kv_heads": only(None),
    "model.global_k_eq_v": only(False),
    "model.global_rope_theta": only(None),
    "model.global_rope_proportion": only(None),
    "model.attention_scale": only(None),
    "model.mtp_depth": only(0),
    "model.o_bias": only(False),
    "model.norm": only("rmsnorm"),
    "model.block_norms": only("pre"),
    "model.attention_block_norms": only(None),
    "model.lm_head_bias": only(False),
    "model.tie_embeddings": ANY,
    "model.attention_sinks": only(False),
    "model.attention_sinks_layers": only("all", applies=lambda m, _: m.attention_sinks),
    "model.sliding_window": only(None),
    "model.sliding_n_kv_heads": only(None),
    "model.sliding_rope_theta": only(None),
    "model.v_head_dim": only(None),
    "model.attention_value_scale": only(1.0),
    "model.nope_layers": refused_when(
        _no_nope_layers, "{name} rotates every layer's queries and keys; must be null"
    ),
    "model.attn_temperature_floor": only(None),
    "model.attention_chunk_size": only(None),
    "model.qk_norm_after_rope": only(False),
    "model.attention_output_gate": only(False),
    "model.zero_centered_norm": only(False),
    "model.head_dim": ANY,
    "model.qkv_bias": only(False),
    "model.qk_norm": only(False),
    "model.qk_norm_scope": only("head", applies=lambda m, _: m.qk_norm),
    "model.qk_norm_position": only("before_rope", applies=lambda m, _: m.qk_norm),
    # routing
    "moe.capacity_factor": only(0.0),
    "moe.router_type": only("topk"),
    "moe.score_func": only("softmax"),
    "moe.hash_layers": only(None),
    "moe.topk_before_score": only(False),
    "moe.renormalize": ANY,
    "moe.renormalize_min": only(0.0),
    "moe.renormalize_eps": only(0.0),
    "moe.score_on_input": only(False),
    "moe.route_scale": only(1.0),
    "moe.bias_update_rate": only(0.0),
    "moe.num_experts": ANY,
    "moe.n_group": only(1),
    "moe.group_score": ANY,
    "moe.router_bias": only(False),
    "moe.router_input_norm": only(False),
    "moe.expert_scale": only(False),
    "moe.dense_branch": only(False),
    "moe.zero_experts": only(0),
    "moe.shortcut": only(False),
    # experts and their placement
    "moe.expert_biases": only(False),
    "moe.activation": only("swiglu"),
    "moe.swiglu_up_offset": only(1.0, applies=lambda _, moe: moe.activation == "clamped_swiglu"),
    "moe.latent_dim": only(None),
    "model.ffn_activation": only("swiglu"),
    "moe.num_shared_experts": only(0),
    "moe.shared_expert_gate": only(False),
    "moe.shared_expert_hidden": ANY,
    "moe.first_k_dense": only(0),
    "moe.moe_every": only(1),
    "moe.layer_ffns": only(
        None, why="{name} places its FFNs by moe.first_k_dense and moe.moe_every; must be null"
    ),
}

# what a family computes when it holds only one value of a setting (the default ``why``)
PHRASES: dict[str, Mapping[Any, str]] = {
    "model.full_attention_interval": {None: "has no layer pattern by interval"},
    "model.attention_output_gate": {
        False: "has no attention output gate",
        True: "always gates its attention output",
    },
    "model.linear_allow_neg_eigval": {False: "writes its Gated DeltaNet state with beta in (0, 1)"},
    "model.linear_norm_eps": {None: "takes its Gated DeltaNet output norm's eps from rms_norm_eps"},
    "model.zero_centered_norm": {
        False: "has RMSNorm weights that scale directly",
        True: "has zero-centred RMSNorm weights (1 + w)",
    },
    "model.kda_full_rank_gates": {False: "has Kimi Delta Attention's low-rank gates"},
    "model.kda_gate_lower_bound": {None: "has Kimi Delta Attention's unbounded forget gate"},
    "model.mla_head_gate": {False: "has no per-head gate on its latent attention"},
    "model.mla_lora_scale": {
        False: "does not scale its latent attention's query and KV latent",
        True: "scales its latent attention's query and KV latent by their LoRA ranks",
    },
    "model.index_topk": {None: "has no sparse attention"},
    "model.index_rope_interleave": {
        False: "rotates its indexer's heads half-split",
        True: "rotates its indexer's heads in adjacent pairs",
    },
    "model.indexer_types": {None: "has an indexer in every layer"},
    "model.rope_interleave": {False: "rotates half-split heads", True: "rotates adjacent pairs"},
    "model.rope_scaling": {"none": "has no RoPE scaling"},
    "model.partial_rotary_factor": {1.0: "rotates whole heads"},
    "model.qkv_bias": {False: "has no q/k/v biases"},
    "model.o_bias": {False: "has no output-projection bias"},
    "model.qk_norm": {False: "has no query/key norm", True: "always normalises queries and keys"},
    "model.qk_norm_scope": {"head": "normalises each head's query/key"},
    "model.qk_norm_position": {
        "before_rope": "normalises queries and keys before RoPE",
        "after_rope": "normalises queries and keys after RoPE",
    },
    "model.norm": {"rmsnorm": "has RMSNorm", "layernorm": "has LayerNorm"},
    "model.block_norms": {
        "pre": "normalises each block's branch inputs only",
        "sandwich": "normalises each block's branch inputs and outputs (sandwich norms)",
    },
    "model.attention_block_norms": {None: "places every layer's norms alike"},
    "model.lm_head_bias": {False: "has no LM-head bias"},
    "model.attention_sinks": {False: "has no attention sinks", True: "has a sink per head"},
    "model.attention_sinks_layers": {
        "all": "has sinks in every layer or none",
        "sliding": "has sinks in its sliding-window layers only",
    },
    "model.sliding_window": {None: "attends to the whole context"},
    "model.sliding_n_kv_heads": {None: "has as many key/value heads in every layer"},
    "model.sliding_rope_theta": {None: "has one RoPE theta for every layer"},
    "model.v_head_dim": {None: "has value heads as wide as its query/key heads"},
    "model.attention_value_scale": {1.0: "does not scale the attention values"},
    "model.attn_temperature_floor": {None: "has no query temperature"},
    "model.attention_chunk_size": {None: "has no chunked attention"},
    "model.qk_norm_after_rope": {False: "has no query/key norm after RoPE"},
    "model.embedding_multiplier": {1.0: "does not scale the embeddings"},
    "model.residual_multiplier": {1.0: "does not scale the residual branches"},
    "model.logits_scaling": {1.0: "does not scale the logits"},
    "model.final_logit_softcap": {None: "does not soft-cap its logits"},
    "model.hc_streams": {1: "has a plain residual (no hyper-connections)"},
    "model.layer_scalar": {
        False: "has no per-layer output scalar",
        True: "scales every layer's output by a learned scalar",
    },
    "model.value_norm": {False: "has no value norm", True: "normalises each value head"},
    "model.global_head_dim": {None: "gives its global layers the model's head dim"},
    "model.global_n_kv_heads": {None: "gives its global layers the model's key/value heads"},
    "model.global_k_eq_v": {False: "has a value projection in every layer"},
    "model.global_rope_theta": {None: "rotates every layer with one RoPE theta"},
    "model.global_rope_proportion": {None: "has no proportional RoPE"},
    "model.attention_scale": {None: "scales attention by 1 / sqrt(head_dim)"},
    "model.mtp_depth": {
        0: "files hold no multi-token-prediction layers (convert --drop-mtp exports the model "
        "without them: they do not change its function)"
    },
    "moe.capacity_factor": {0.0: "is dropless (tokens over capacity would be dropped only here)"},
    "moe.router_type": {"topk": "routes top-k", "sparsemixer": "routes with sparsemixer"},
    "moe.score_func": {
        "softmax": "routes with softmax",
        "sigmoid": "routes with sigmoid",
        "sqrtsoftplus": "routes with sqrt(softplus)",
    },
    "moe.hash_layers": {None: "routes every MoE layer by its scores (no token-id hash routing)"},
    "moe.topk_before_score": {
        False: "scores all experts, then takes top-k",
        True: "takes top-k on the router logits, then scores the k",
    },
    "moe.renormalize": {
        True: "always renormalises the top-k weights",
        False: "does not renormalise the top-k weights",
    },
    "moe.renormalize_min": {0.0: "renormalises by the plain sum of the top-k weights"},
    "moe.renormalize_eps": {0.0: "renormalises by the plain sum of the top-k weights"},
    "moe.score_on_input": {
        False: "weights the experts' outputs",
        True: "scales each expert's input by its weight",
    },
    "moe.route_scale": {1.0: "has no route scale"},
    "moe.bias_update_rate": {0.0: "has no selection bias (aux-loss-free balancing)"},
    "moe.n_group": {1: "routes without expert groups"},
    "moe.group_score": {
        "top2_sum": "scores a group by the sum of its two best experts",
        "max": "scores a group by its best expert",
    },
    "moe.router_bias": {False: "has no router bias", True: "has a router bias"},
    "moe.router_input_norm": {
        False: "scores the router's input as it is",
        True: "scores a scaled RMSNorm of the router's input",
    },
    "moe.expert_scale": {
        False: "has no per-expert scale on the routing weights",
        True: "scales each expert's routing weight",
    },
    "moe.dense_branch": {
        False: "has no dense FFN beside its experts",
        True: "runs a dense FFN beside the experts of every layer",
    },
    "moe.zero_experts": {0: "has no zero-computation experts"},
    "moe.shortcut": {
        False: "has no shortcut-connected MoE",
        True: "joins each MoE's output to the stream one sublayer later (shortcut MoE)",
    },
    "moe.expert_biases": {False: "has no expert biases", True: "has expert biases"},
    "moe.activation": {
        "swiglu": "has SwiGLU experts",
        "clamped_swiglu": "clamps its SwiGLU",
        "geglu": "has GeGLU experts",
        "relu2": "has squared-ReLU experts, not gated",
    },
    "moe.swiglu_up_offset": {
        1.0: "adds 1 to its clamped up projection",
        0.0: "multiplies silu of the clamped gate by the clamped up projection",
    },
    "moe.latent_dim": {None: "computes its experts in hidden_size (no latent MoE)"},
    "model.ffn_activation": {
        "swiglu": "has SwiGLU dense FFNs and shared experts",
        "geglu": "has GeGLU dense FFNs",
        "relu2": "has squared-ReLU dense FFNs and shared experts, not gated",
        "clamped_swiglu": "clamps the SwiGLU of its dense FFNs and shared experts",
    },
    "moe.num_shared_experts": {0: "has no shared experts"},
    "moe.shared_expert_gate": {
        False: "does not gate its shared experts",
        True: "gates its shared expert with a sigmoid",
    },
    "moe.first_k_dense": {0: "has MoE in every layer"},
    "moe.moe_every": {1: "has MoE in every layer after its dense first layers"},
}


def refusals(
    name: str, rules: Mapping[str, Rule], model: ModelConfig, moe: MoEConfig
) -> list[tuple[str, str]]:
    """``(dotted setting, why)`` for every setting that ``rules`` (a family's, :data:`BASELINE`
    with its own over it) cannot hold, in their order; ``name``: the family's class."""
    return [
        (key, rule.reason(key, name, model, moe))
        for key, rule in rules.items()
        if rule.refused(key, model, moe)
    ]
