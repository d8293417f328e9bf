"""What a family declares about its weight files: how they name and shape moetrain's tensors
where they differ from Llama's (:class:`Layout`), and the larger directories that hold its model
(:class:`Wrapper`). Pure data: :mod:`moetrain.convert.weight_map` reads it (the one mapper that
export, import and ``checkpoint.init_from`` share); imports neither torch nor transformers.

Llama's names, which every family has unless its layout says otherwise:
``model.embed_tokens``, ``model.norm``, ``lm_head``; per decoder layer ``model.layers.<i>.``
``input_layernorm``, ``post_attention_layernorm``, the token mixer's weights (named by
:data:`moetrain.convert.mixer_names.MIXER_NAMES`, by what the model's parameter names say), a
dense layer's ``mlp.{gate,up,down}_proj``, an MoE layer's ``mlp.gate`` (router),
``mlp.experts.<e>.{gate,up,down}_proj`` and ``mlp.shared_expert.{gate,up,down}_proj`` with
``mlp.shared_expert_gate``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

SWIGLU = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # moetrain -> Llama
NOT_GATED = {"w1": "up_proj", "w2": "down_proj"}  # a squared-ReLU MLP's (model.ffn_activation)


@dataclass(frozen=True)
class PerExpert:
    """An MoE layer's experts one tensor per expert and projection,
    ``<moe block>.experts.<e>.<name>.weight`` in ``nn.Linear``'s (out, in) orientation;
    ``names``: moetrain's w1 (gate), w3 (up), w2 (down) -> the files' projection names (experts
    that are not gated, ``moe.activation: relu2``: w3, the up projection, and w2)."""

    names: Mapping[str, str] = field(default_factory=lambda: dict(SWIGLU))


@dataclass(frozen=True)
class Fused:
    """An MoE layer's experts as two tensors in ``nn.Linear``'s orientation under the MoE block:
    ``gate_up`` (E, 2F, D) = [gate; up] (not gated: (E, F, D), the up projection) and ``down``
    (E, D, F) (Granite's
    ``input_linear.weight`` / ``output_linear.weight``; transformers v5 holds every per-expert
    family's experts so in memory: :data:`V5_FUSED`)."""

    gate_up: str = "experts.gate_up_proj"
    down: str = "experts.down_proj"


@dataclass(frozen=True)
class Stacked:
    """An MoE layer's experts as moetrain holds them, under the MoE block: ``gate_up``
    (E, D, 2F), ``down`` (E, F, D), and with ``moe.expert_biases`` ``<gate_up>_bias`` (E, 2F) and
    ``<down>_bias`` (E, D); gate and up ``[gate | up]`` (Llama 4), or ``interleaved``, gate the
    even columns (gpt-oss). Files and transformers v5's memory alike."""

    interleaved: bool = False
    gate_up: str = "experts.gate_up_proj"
    down: str = "experts.down_proj"


V5_FUSED = Fused()


@dataclass(frozen=True)
class MtpNames:
    """Where the files hold multi-token-prediction module ``k`` (moetrain's block
    ``n_layers + k - 1``). DeepSeek-V3's released layout (the defaults): the decoder layer
    ``model.layers.<n_layers + k - 1>.`` with the block's usual names, the module's own weights
    (its norms of the next token's embedding and of the hidden state, their projection, the
    norm before the head) in that layer too, and copies of the shared embedding and head, which
    inference engines read there (an import reads the originals). Qwen3-Next's: the block under
    ``mtp.layers.<k - 1>.``, its own weights under ``mtp.`` and no copies. Names relative to
    ``block`` / ``own``, templates of ``{layer}`` (n_layers + k - 1) and ``{depth}`` (k - 1)."""

    enorm: str = "enorm"
    hnorm: str = "hnorm"
    eh_proj: str = "eh_proj"
    head_norm: str = "shared_head.norm"
    embed_copy: str | None = "embed_tokens.weight"
    head_copy: str | None = "shared_head.head.weight"
    block: str = "model.layers.{layer}."
    own: str | None = None  # None: the block's prefix
    # modules a config.json that declares none holds (Qwen3-Next's has no key; vLLM reads one)
    undeclared: int = 0

    def block_prefix(self, n_layers: int, layer: int) -> str:
        """The name prefix of block ``layer``'s decoder layer."""
        return self.block.format(layer=layer, depth=layer - n_layers)

    def own_prefix(self, n_layers: int, layer: int) -> str:
        """The name prefix of block ``layer``'s own weights (norms, projection)."""
        return (self.own or self.block).format(layer=layer, depth=layer - n_layers)


@dataclass(frozen=True)
class Layout:
    """A family's names where they differ from Llama's (the module docstring), each relative to
    a decoder layer (``model.layers.<i>.``) or to its MoE block.

    ``in_memory``: transformers v5's in-memory module names where they differ from the files'
    (the embedding, the MoE block, the dense block, the router, the selection bias: file
    name -> memory name); a source saved
    from memory uses them, with a per-expert or fused family's experts as :data:`V5_FUSED`.
    """

    # the decoder's prefix and its embedding under it (Nemotron-H's backbone., embeddings)
    base: str = "model."
    embed: str = "embed_tokens"
    lm_head: str = "lm_head"  # the LM head's module (DeepSeek-V4's files: head)
    moe_block: str = "mlp"  # the MoE block of a decoder layer ("": the layer itself)
    router: str = "gate"  # the router's module, under the block
    experts: PerExpert | Fused | Stacked = field(default_factory=PerExpert)
    # the router's selection bias (moetrain's aux-loss-free expert_bias), under the block; None:
    # the files have none (a model's must then be zero); stored as one row (1, E) where row
    selection_bias: str | None = None
    selection_bias_row: bool = False
    shared_expert: str = "shared_expert"  # under the block: {gate,up,down}_proj
    shared_gate: str = "shared_expert_gate"  # under the block
    # a latent MoE's projections into and out of the latent (moe.latent_dim), under the block
    latent: tuple[str, str] = ("fc1_latent_proj", "fc2_latent_proj")
    # the shared expert as two tensors of the decoder layer, gate_up (2S, D) = [gate; up] and
    # down (D, S) (Granite-MoE-Shared's shared_mlp.input_linear / output_linear); None: above
    shared_fused: tuple[str, str] | None = None
    dense_block: str = "mlp"  # a dense layer's FFN
    # the files always hold q/k/v biases and a gated shared expert (zeros, and a shared expert
    # of hidden size 0, when the model has none: Qwen2-MoE)
    qkv_bias_always: bool = False
    shared_expert_always: bool = False
    mtp: MtpNames | None = None  # None: the files hold no multi-token-prediction modules
    # a block's module names where the files name them otherwise than Llama's (and the rules
    # above), e.g. Hunyuan's ``{"self_attn.q_norm": "self_attn.query_layernorm"}``
    renames: Mapping[str, str] = field(default_factory=dict)
    # a sandwich block's norms (model.block_norms: sandwich): its mixer's output norm, its
    # FFN's input norm (Llama's post_attention_layernorm in a pre-norm block) and its FFN's
    # output norm; Gemma's names unless the family says otherwise
    sandwich_norms: tuple[str, str, str] = (
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    )
    # Gemma 4's pieces, relative to a decoder layer: moe.dense_branch's norms (the dense
    # output's, the experts' input's and output's; its dense FFN is dense_block's), the
    # router's scalars (moe.router_input_norm's input scale, moe.expert_scale's) and the
    # layer's output scalar (model.layer_scalar)
    branch_norms: tuple[str, str, str] = (
        "post_feedforward_layernorm_1",
        "pre_feedforward_layernorm_2",
        "post_feedforward_layernorm_2",
    )
    router_scalars: tuple[str, str] = ("router.scale", "router.per_expert_scale")
    layer_scalar: str = "layer_scalar"
    # the attention output gate (model.attention_output_gate) as a projection of its own, its
    # heads in order (Trinity's ``self_attn.gate_proj``); None: in ``q_proj``, each head's
    # query followed by its gate (Qwen3-Next's)
    attention_gate: str | None = None
    # Gated DeltaNet's projections fused per query/key head, ``linear_attn.in_proj_qkvz`` and
    # ``linear_attn.in_proj_ba`` (Qwen3-Next's files); False: Qwen3.5's four projections
    linear_fused: bool = False
    # Gated DeltaNet's in_proj_qkv and its convolution as three each, ``linear_attn.{q,k,v}_
    # proj`` and ``linear_attn.{q,k,v}_conv1d`` (Olmo-Hybrid's files; its other names by
    # ``renames``)
    linear_qkv_apart: bool = False
    # a block's names that differ by its mixer's kind (``spec.kind``: mla, kda, ...), before
    # ``renames`` (Ling 3.0's latent attention output ``attention.dense`` beside its KDA
    # layers' ``attention.o_proj``)
    mixer_renames: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # the names transformers' ``save_pretrained`` writes where they differ from the released
    # files' (its conversion mapping run backwards: Ling 3.0's KDA ``attention.dense``), read
    # where a source holds them, over ``renames``
    saved_renames: Mapping[str, str] = field(default_factory=dict)
    in_memory: Mapping[str, str] = field(default_factory=dict)
    # transformers v5's in-memory experts where they are not :data:`V5_FUSED` (Nemotron-H's
    # experts.up_proj / down_proj, not gated)
    in_memory_experts: Fused | None = None
    # hyper-connections (model.hc_streams): the model's collapse before the final norm (under
    # ``base``), its tensors fn, base, scale; a block's mixers' and FFN's are ``attn_hc.<t>`` /
    # ``ffn_hc.<t>`` unless ``renames`` says otherwise; hash routing's token -> experts table
    # (moe.hash_layers), under the router
    hyper_head: tuple[str, str, str] = ("hc_head.hc_fn", "hc_head.hc_base", "hc_head.hc_scale")
    hash_table: str = "tid2eid"
    # the final norm's module (LFM2's ``model.embedding_norm``, Nemotron-H's
    # ``backbone.norm_f``)
    final_norm: str = "model.norm"
    # a block's 1-D tensors the files store as (1, 1, n, 1) (Kimi Linear's ``self_attn.A_log``)
    columns: tuple[str, ...] = ()
    # a block's tensors transformers v5 holds in memory under other module names (the files'
    # name -> memory's: Kimi Linear's forget gate) and joined along their first dim (memory's
    # name -> the files' names: its q, k, v convolutions); ``joined``: this layout holds them
    # joined (set by ``weight_map.in_memory``)
    in_memory_renames: Mapping[str, str] = field(default_factory=dict)
    in_memory_joined: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    joined: bool = False
    # decoder layers that hold several moetrain blocks (LongCat-Flash's two sublayers): block
    # i lies in decoder layer i // len(sublayers), its names (after the rules above) renamed
    # by sublayers[i % len(sublayers)]; empty: one block per decoder layer
    sublayers: tuple[Mapping[str, str], ...] = ()
    # the files hold multi-token-prediction layers (``model.mtp.*``) whatever config.json
    # declares, which transformers' class ignores: an import leaves them unread
    # (LongCat-Flash's)
    mtp_unread: bool = False
    # the whole layout transformers' ``save_pretrained`` writes where it differs from the
    # released files' beyond a block's names (DeepSeek-V4's: ``model.`` before the decoder's
    # names, ``model.embed_tokens``, ``model.hc_head.hc_fn``), read where a source holds it
    saved: Layout | None = None


@dataclass(frozen=True)
class Wrapper:
    """A Hugging Face class that holds a family's model inside a larger one (Llama 4's released
    ``Llama4ForConditionalGeneration``: the text model beside a vision tower). Importing such a
    directory takes the family's model and leaves the rest, saying so."""

    architecture: str  # config.json's ``architectures``
    model_type: str
    config_key: str  # the family's own config inside config.json (``text_config``)
    # the tensors of the family's model: a stored name prefix -> the family's own
    # (``{"language_model.": ""}``: ``language_model.model.norm.weight`` is ``model.norm.weight``)
    tensors: Mapping[str, str]
    left_out: tuple[str, ...]  # the name prefixes of the tensors that are not taken
    what: str  # what is not taken, in words (``the vision tower``)
