"""What a model family is, and the pieces its adapter module is made of.

A :class:`Family` (one module per family in this package, listed in its registry) says what
the family cannot represent (``problems``: the moetrain settings its transformers class has no
equivalent for), how a moetrain config becomes its transformers config (``to_hf``) and back
(``from_hf``), and how its weights are named (:class:`WeightNames`). The checks below are the
rules several families share (the config fields' reading and writing they share is
:mod:`~moetrain.convert.families.hf_config`); they import neither torch nor transformers, so the
registry is cheap to read (the command line builds ``--format`` from it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from moetrain.config import Config, ModelConfig, MoEConfig

Check = tuple[bool, str, str]  # (the setting is unrepresentable, dotted setting, why)
SWIGLU = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # moetrain -> Llama


@dataclass(frozen=True)
class WeightNames:
    """The Hugging Face names in which families differ; everything else is Llama's
    (``model.embed_tokens``, ``model.layers.<i>.self_attn.{q,k,v,o}_proj``, its
    ``input_layernorm`` / ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``,
    ``model.norm``, ``lm_head``)."""

    moe_block: str = "mlp"  # the MoE block of a decoder layer (transformers v5 names it mlp)
    expert: Mapping[str, str] = field(default_factory=lambda: dict(SWIGLU))  # an expert's
    shared_expert: str = "shared_expert"
    shared_gate: str = "shared_expert_gate"
    expert_bias: str | None = None  # the router's selection bias, under the MoE block
    qkv_bias_always: bool = False  # q/k/v biases always present (zeros when the model has none)
    # a gated shared expert always present (of hidden size 0, zeros, when the model has none)
    shared_expert_always: bool = False
    # transformers v5's in-memory name of that bias where it differs from the files' (ERNIE's
    # gate.moe_statics...), and whether it is stored as one row (1, E) instead of (E,)
    expert_bias_v5: str | None = None
    expert_bias_row: bool = False
    router: str = "gate"  # the router's module under the MoE block (Granite's router.layer)
    # transformers v5's in-memory names of the MoE block and its router (Granite keeps
    # block_sparse_moe and calls the router router)
    v5_block: str = "mlp"
    v5_router: str = "gate"
    # the files hold each layer's experts fused under the MoE block, as these two modules'
    # weights, gate_up (E, 2F, D) = [gate; up] and down (E, D, F) (Granite's input_linear,
    # output_linear); None: one tensor per expert and projection
    fused_experts: tuple[str, str] | None = None
    # the shared expert as two modules of the decoder layer (not the MoE block), gate_up
    # (2S, D) = [gate; up] and down (D, S) (Granite-MoE-Shared's shared_mlp.input_linear,
    # shared_mlp.output_linear); None: its gate_proj / up_proj / down_proj under the MoE block
    shared_fused: tuple[str, str] | None = None
    # the files hold each layer's experts stacked in moetrain's (in, out) orientation under
    # the MoE block (files and transformers v5 alike): experts.gate_up_proj (E, D, 2F) and
    # experts.down_proj (E, F, D); "concatenated": gate_up = [gate | up] (Llama 4),
    # "interleaved": gate and up interleaved, gate the even columns, with
    # experts.gate_up_proj_bias (E, 2F) likewise and experts.down_proj_bias (E, D) (gpt-oss);
    # None: another layout (above)
    stacked_experts: str | None = None
    # the module of a dense layer's FFN (Llama 4's feed_forward)
    dense_block: str = "mlp"


@dataclass(frozen=True)
class Wrapper:
    """A Hugging Face class that holds a family's model inside a larger one (Llama 4's released
    ``Llama4ForConditionalGeneration``: the text model beside a vision tower). Importing such a
    directory takes the family's model and leaves the rest, saying so."""

    architecture: str  # config.json's ``architectures``
    model_type: str
    config_key: str  # the family's own config inside config.json (``text_config``)
    prefix: str  # the family's tensor names start with it there (``language_model.``)
    left_out: tuple[str, ...]  # the name prefixes of the tensors that are not taken
    what: str  # what is not taken, in words (``the vision tower``)


# config.json's count of the multi-token-prediction layers stored after the decoder layers
MTP_CONFIG_KEYS = ("num_nextn_predict_layers", "num_mtp_layers")


def declared_mtp_layers(hf: dict[str, Any]) -> int:
    """How many multi-token-prediction layers a ``config.json`` says its files hold."""
    return max(int(hf.get(key) or 0) for key in MTP_CONFIG_KEYS)


@dataclass(frozen=True)
class Family:
    """One Hugging Face model family. ``problems`` and ``to_hf`` are None for a dense family
    (a source that is upcycled, never an export target)."""

    name: str  # transformers' model_type, and the --format name
    architecture: str  # the transformers class (config.json's ``architectures``)
    from_hf: Callable[[Any], Config]  # a transformers config object -> moetrain Config
    problems: Callable[[ModelConfig, MoEConfig], list[tuple[str, str]]] | None = None
    to_hf: Callable[[Config], dict[str, Any]] | None = None  # -> transformers config kwargs
    names: WeightNames = WeightNames()
    attention: str = "gqa"  # moetrain's model.attention of the family (a mixer kind's name)
    partial_rotary: bool = False  # its attention can rotate part of each head (GLM)
    # its files hold multi-token-prediction layers after the decoder layers, counted by
    # config.json's num_nextn_predict_layers (DeepSeek-V3's layout; transformers ignores them)
    mtp: bool = False
    # its attention rotates adjacent pairs (ERNIE); None: either, as its config says (DeepSeek)
    rope_interleave: bool | None = False
    # its renormalisation divides by max(sum, a minimum) (ERNIE's moe_norm_min =
    # moe.renormalize_min); the others divide by the plain sum (moe.renormalize_min must be 0)
    renormalize_min: bool = False
    # its model has Granite's muP-style scalars (model.embedding_multiplier,
    # residual_multiplier, attention_scale, logits_scaling); the others refuse non-defaults
    multipliers: bool = False
    # what of gpt-oss's model the family has (the others refuse each by key): a bias on the
    # attention output projection (model.o_bias), attention sinks and sliding windows
    # (model.attention_sinks, model.sliding_window / layer_types), router and expert biases
    # (moe.router_bias, moe.expert_biases), the clamped SwiGLU (moe.activation)
    o_bias: bool = False
    sinks_and_windows: bool = False
    biased_experts: bool = False
    clamped_swiglu: bool = False
    # what its transformers class has beyond Llama's (each refused by key elsewhere): a bias
    # on the LM head (model.lm_head_bias), its norm kind (model.norm) and its router's rule
    # (moe.router_type)
    lm_head_bias: bool = False
    norm: str = "rmsnorm"
    router_type: str = "topk"
    # what of Llama 4's model the family has (the others refuse each by key): NoPE layers and
    # their query temperature (model.nope_layers, model.attn_temperature_floor), chunked
    # attention (model.attention_chunk_size), the weightless query/key norm after RoPE
    # (model.qk_norm_after_rope) and routing weights on the experts' inputs
    # (moe.score_on_input)
    nope_layers: bool = False
    chunked_attention: bool = False
    qk_norm_after_rope: bool = False
    score_on_input: bool = False
    # a larger class whose directories hold this family's model (imported, never exported)
    wrapper: Wrapper | None = None

    # config.json's ``architectures`` where the released files name the class otherwise than
    # transformers does (Phi-3.5-MoE's PhiMoEForCausalLM, the name vLLM registers): exports
    # write it; transformers' Auto classes go by model_type and load either
    released_architecture: str | None = None

    @property
    def config_architecture(self) -> str:
        """The class name an export writes in ``config.json``'s ``architectures``."""
        return self.released_architecture or self.architecture

    @property
    def dense(self) -> bool:
        """A dense family: imported and upcycled, not exported."""
        return self.problems is None


def found(checks: list[Check]) -> list[tuple[str, str]]:
    """The ``(setting, why)`` of every failed check, in order."""
    return [(key, why) for bad, key, why in checks if bad]


def dropless(moe: MoEConfig, name: str) -> Check:
    return (
        moe.capacity_factor != 0.0,
        "moe.capacity_factor",
        f"{name} is dropless; must be 0 (tokens over capacity would be dropped only here)",
    )


def no_qkv_bias(model: ModelConfig, name: str) -> Check:
    return (model.qkv_bias, "model.qkv_bias", f"{name} has no q/k/v biases")


def no_o_bias(model: ModelConfig, name: str) -> Check:
    return (model.o_bias, "model.o_bias", f"{name} has no output-projection bias")


def all_or_no_attention_biases(model: ModelConfig, name: str) -> Check:
    """The check of a family whose ``attention_bias`` puts biases on all four attention
    projections or on none."""
    return (
        model.o_bias != model.qkv_bias,
        "model.o_bias",
        f"{name}'s attention_bias puts biases on all four projections or none; must equal "
        f"model.qkv_bias={model.qkv_bias}",
    )


def extras(fam: Family, model: ModelConfig, moe: MoEConfig) -> list[Check]:
    """The refusals of the pieces ``fam`` does not have (its ``o_bias``, ``sinks_and_windows``,
    ``biased_experts``, ``clamped_swiglu``, ``lm_head_bias``) or has otherwise (``norm``,
    ``router_type``)."""
    name = fam.architecture
    checks = [] if fam.o_bias else [no_o_bias(model, name)]
    checks += [
        (model.norm != fam.norm, "model.norm", f"{name}'s norms are {fam.norm}"),
        (
            model.lm_head_bias and not fam.lm_head_bias,
            "model.lm_head_bias",
            f"{name} has no LM-head bias; must be false",
        ),
        (
            moe.router_type != fam.router_type,
            "moe.router_type",
            f"{name} routes with {fam.router_type}",
        ),
    ]
    if not fam.sinks_and_windows:
        checks += [
            (model.attention_sinks, "model.attention_sinks", f"{name} has no attention sinks"),
            (
                model.sliding_window is not None,
                "model.sliding_window",
                f"{name} attends to the whole context; must be null",
            ),
        ]
    if not fam.biased_experts:
        checks += [
            (moe.router_bias, "moe.router_bias", f"{name}'s router has no bias"),
            (moe.expert_biases, "moe.expert_biases", f"{name}'s experts have no biases"),
        ]
    if not fam.clamped_swiglu:
        checks.append(
            (moe.activation != "swiglu", "moe.activation", f"{name}'s experts are SwiGLU")
        )
    return checks + llama4_extras(fam, model, moe)


def llama4_extras(fam: Family, model: ModelConfig, moe: MoEConfig) -> list[Check]:
    """The refusals of Llama 4's pieces that ``fam`` does not have."""
    name, checks = fam.architecture, []
    if not fam.nope_layers:
        checks += [
            (
                bool(model.nope_layers),
                "model.nope_layers",
                f"{name} rotates every layer's queries and keys; must be null",
            ),
            (
                model.attn_temperature_floor is not None,
                "model.attn_temperature_floor",
                f"{name} has no query temperature; must be null",
            ),
        ]
    if not fam.chunked_attention:
        checks.append(
            (
                model.attention_chunk_size is not None,
                "model.attention_chunk_size",
                f"{name} has no chunked attention; must be null",
            )
        )
    if not fam.qk_norm_after_rope:
        checks.append(
            (
                model.qk_norm_after_rope,
                "model.qk_norm_after_rope",
                f"{name} has no query/key norm after RoPE; must be false",
            )
        )
    if not fam.score_on_input:
        checks.append(
            (
                moe.score_on_input,
                "moe.score_on_input",
                f"{name} weights the experts' outputs; must be false",
            )
        )
    return checks


def no_qk_norm(model: ModelConfig, name: str) -> Check:
    return (model.qk_norm, "model.qk_norm", f"{name} has no query/key norm; must be false")


def per_head_norm(model: ModelConfig, name: str) -> Check:
    return (
        model.qk_norm and model.qk_norm_scope != "head",
        "model.qk_norm_scope",
        f"{name} normalises each head's query/key; must be head",
    )


def plain_attention(
    model: ModelConfig, name: str, partial: bool = False, interleave: bool | None = False
) -> list[Check]:
    """Rotary embeddings in the first half / second half layout, or in adjacent pairs where
    ``interleave`` (either where None; plain or scaled: transformers computes every rope_type
    for every family), over whole heads unless ``partial``."""
    pairs = (
        f"{name} rotates adjacent pairs; must be true"
        if interleave
        else f"{name} rotates half-split heads"
    )
    return [
        (
            interleave is not None and model.rope_interleave != interleave,
            "model.rope_interleave",
            pairs,
        ),
        (
            not partial and model.partial_rotary_factor != 1.0,
            "model.partial_rotary_factor",
            f"{name} rotates whole heads; must be 1",
        ),
    ]


MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "logits_scaling")


def no_multipliers(model: ModelConfig, name: str) -> list[Check]:
    """No muP-style scalars: the embeddings, the residual branches and the logits unscaled,
    attention's softmax scale 1 / sqrt(head_dim) (Granite-MoE's are the exception)."""
    return [
        *(
            (getattr(model, key) != 1.0, f"model.{key}", f"{name} has none; must be 1.0")
            for key in MULTIPLIERS
        ),
        (
            model.attention_scale is not None,
            "model.attention_scale",
            f"{name} scales attention by 1 / sqrt(head_dim); must be null",
        ),
    ]


def every_layer_moe(moe: MoEConfig, name: str) -> list[Check]:
    return [
        (moe.first_k_dense != 0, "moe.first_k_dense", f"{name} has MoE in every layer"),
        (moe.moe_every != 1, "moe.moe_every", f"{name} has MoE in every layer; must be 1"),
    ]


def no_shared_experts(moe: MoEConfig, name: str) -> Check:
    return (moe.num_shared_experts != 0, "moe.num_shared_experts", f"{name} has none")


def softmax_router(moe: MoEConfig, name: str) -> list[Check]:
    """Softmax over all experts, then top-k; no route scale, expert bias or expert groups."""
    return [
        (moe.score_func != "softmax", "moe.score_func", f"{name} routes with softmax"),
        (
            moe.topk_before_score,
            "moe.topk_before_score",
            f"{name} takes softmax over all experts, then top-k; must be false",
        ),
        (moe.route_scale != 1.0, "moe.route_scale", f"{name} has no route scale; must be 1.0"),
        (
            moe.bias_update_rate != 0.0,
            "moe.bias_update_rate",
            f"{name} has no expert bias (aux-loss-free balancing); must be 0",
        ),
        (moe.n_group != 1, "moe.n_group", f"{name} routes without expert groups; must be 1"),
    ]


def dropless_softmax(model: ModelConfig, moe: MoEConfig, name: str) -> list[Check]:
    """Dropless softmax routing (:func:`softmax_router`) and no q/k/v biases: where Mixtral,
    Qwen3-MoE and OLMoE start."""
    return [dropless(moe, name), no_qkv_bias(model, name), *softmax_router(moe, name)]
