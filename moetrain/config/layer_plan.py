"""The layer plan: which token mixer (with its per-layer options) and which FFN each block of the
model has, computed here and nowhere else (torch-free).

The mixer of decoder layer i comes from its layer type (``model.layer_types``, transformers'
names; unset, from ``model.full_attention_interval``, ``model.sliding_window`` or
``model.attention_chunk_size``): :data:`LAYER_TYPES` says which key names the kind of mixer
of such a layer (``model.attention`` for the attention types) and which options it takes;
``model.nope_layers`` and the query temperature are options of the layer too. Its FFN (dense,
MoE or none) is :meth:`moetrain.config.MoEConfig.ffn_kind`'s. Multi-token-prediction blocks
(``layers.<n_layers + k - 1>``) have full attention of ``model.attention``'s kind and the FFN
the MoE section places there.

Every reader (the model's blocks, ``model_numbers``, ``moetrain plan``, the converters) takes
its layers from :func:`layer_plan` (or ``Config.layer_plan()``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from moetrain.config.checks import require
from moetrain.config.mixers import MIXER_KINDS, mixer_kind
from moetrain.config.mixers.gqa import has_global_rope
from moetrain.config.mixers.mla import index_source
from moetrain.config.ranges import FUNCTION, POSITIVE_INT, above

if TYPE_CHECKING:
    from moetrain.config.model import ModelConfig
    from moetrain.config.moe import MoEConfig

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
LINEAR = "linear_attention"  # a recurrent layer, of model.linear_attention's kind
# DeepSeek-V4's compressed layers (a window and compressed entries), of a kind that compresses
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
NO_MIXER = "none"  # a block without a mixer: its FFN alone (Nemotron-H's MLP and MoE layers)
FFNKind = Literal["dense", "moe", "none"]


@dataclass(frozen=True)
class LayerType:
    """An entry of ``model.layer_types``: the ``model`` key that names its mixer's kind (None:
    no mixer), and whether the layer takes ``model.sliding_window`` / its chunks."""

    kind_key: str | None
    window: bool = False
    chunk: bool = False
    compress: str | None = None  # "csa" / "hca": the compressed entries it adds


LAYER_TYPES = {
    FULL: LayerType("attention"),
    SLIDING: LayerType("attention", window=True),
    CHUNKED: LayerType("attention", chunk=True),
    LINEAR: LayerType("linear_attention"),
    NO_MIXER: LayerType(None),
    CSA: LayerType("attention", window=True, compress="csa"),
    HCA: LayerType("attention", window=True, compress="hca"),
}


@dataclass(frozen=True)
class MixerSpec:
    """One layer's token mixer: its kind and per-layer options."""

    kind: str  # a name of moetrain.config.mixers.MIXER_KINDS
    window: int | None = None  # a sliding window (the last `window` positions, itself included)
    chunk: int | None = None  # chunked attention: positions of the same chunk of this size
    rope: bool = True  # False: a NoPE layer
    temperature: tuple[int, float] | None = None  # (floor, scale) of the query temperature
    # sparse attention (model.index_topk): the layer whose indexer selects this layer's keys
    # (None: dense), and whether that is this layer's own
    index_from: int | None = None
    indexer: bool = False
    # Gemma 4's global layers (a full_attention layer with model.global_* set): its own head
    # dim and key/value heads (None: the model's), keys as values, its own RoPE tables
    head_dim: int | None = None
    kv_heads: int | None = None
    k_eq_v: bool = False
    own_rope: bool = False
    # DeepSeek-V4's compressed layers: "csa" (compressed sparse) or "hca" (heavily compressed)
    compress: str | None = None


@dataclass(frozen=True)
class LayerSpec:
    """One block of the model: its index, mixer (None: none) and FFN kind."""

    index: int
    mixer: MixerSpec | None
    ffn: FFNKind
    mtp: bool = False  # a multi-token-prediction block


@dataclass
class LayerPlanKeys:
    """The ``model`` keys of the layer plan (besides ``model.attention``)."""

    # each decoder layer's type (n_layers entries): "full_attention", "sliding_attention"
    # (with sliding_window), "chunked_attention" (with attention_chunk_size), all three of
    # model.attention's kind, "compressed_sparse_attention" / "heavily_compressed_attention"
    # (DeepSeek-V4's, of a kind that compresses, with sliding_window), "linear_attention"
    # (model.linear_attention's kind) or "none" (no mixer: the block is its FFN alone). None: every
    # layer sliding with sliding_window set, chunked with attention_chunk_size set, the
    # pattern of full_attention_interval with it set, else every layer full (window and chunks
    # both set: required). Multi-token-prediction blocks attend to the full context
    layer_types: list[str] | None = field(default=None, metadata=FUNCTION)
    # Qwen3-Next's full_attention_interval k: layer i is full_attention where (i + 1) % k == 0
    # and linear_attention elsewhere (at most n_layers: the pattern's full layer is in the model)
    full_attention_interval: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # the token mixer kind of the linear_attention layers (moetrain.config.mixers):
    # "gated_deltanet" (Qwen3-Next's and Qwen3.5's Gated DeltaNet; config/mixers/gated_deltanet.py)
    # "kda" (Kimi Linear's Kimi Delta Attention; config/mixers/kda.py) or "mamba2" (Granite 4.0-H's
    # Mamba-2; config/mixers/mamba2.py); "gated_conv" (LFM2's gated short convolution;
    # config/mixers/gated_conv.py)
    linear_attention: str = field(default="gated_deltanet", metadata=FUNCTION)
    # sliding-window attention: a query of a "sliding_attention" layer sees the last
    # sliding_window positions, itself included (transformers' rule); less than max_seq_len
    sliding_window: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # chunked local attention (Llama 4's attention_chunk_size): a query of a
    # "chunked_attention" layer at position i sees the positions j <= i with j // C == i // C
    # (positions in the row, from 0); less than max_seq_len
    attention_chunk_size: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # the decoder layers without rotary embeddings (NoPE; Llama 4's no_rope_layers zeros):
    # distinct indices in increasing order; None = every layer has RoPE
    nope_layers: list[int] | None = field(default=None, metadata=FUNCTION)
    # attention temperature tuning on the NoPE layers (Llama 4's attn_temperature_tuning,
    # floor_scale, attn_scale): the query at position p (in the row) is multiplied by
    # log1p(floor((p + 1) / attn_temperature_floor)) * attn_temperature_scale + 1; both set
    # or both None (off)
    attn_temperature_floor: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    attn_temperature_scale: float | None = field(default=None, metadata=above(0) | FUNCTION)


def layer_types(model: ModelConfig) -> list[str]:
    """Each decoder layer's type (see :class:`LayerPlanKeys`)."""
    n = model.n_layers
    if model.layer_types is not None:
        return list(model.layer_types)
    k = model.full_attention_interval
    if k is not None:
        return [FULL if (i + 1) % k == 0 else LINEAR for i in range(n)]
    if model.sliding_window is not None:
        return [SLIDING] * n
    if model.attention_chunk_size is not None:
        return [CHUNKED] * n
    return [FULL] * n


def mixer_spec(model: ModelConfig, layer: int, types: list[str] | None = None) -> MixerSpec | None:
    """Block ``layer``'s mixer (None: the block has none); ``types``: :func:`layer_types`,
    when the caller has them."""
    sparse = model.index_topk is not None
    source = index_source(model, layer) if sparse else None
    index = dict(index_from=source, indexer=source == layer)
    if layer >= model.n_layers:  # a multi-token-prediction block
        return MixerSpec(model.attention, **index)
    entry = LAYER_TYPES[(types or layer_types(model))[layer]]
    if entry.kind_key is None:
        return None
    rope = layer not in (model.nope_layers or ())
    floor, scale = model.attn_temperature_floor, model.attn_temperature_scale
    return MixerSpec(
        kind=getattr(model, entry.kind_key),
        window=model.sliding_window if entry.window else None,
        chunk=model.attention_chunk_size if entry.chunk else None,
        rope=rope,
        compress=entry.compress,
        temperature=None if rope or floor is None or scale is None else (floor, scale),
        **(index if entry.kind_key == LAYER_TYPES[FULL].kind_key else {}),
        **(_global_layer(model) if (types or layer_types(model))[layer] == FULL else {}),
    )


def _global_layer(model: ModelConfig) -> dict[str, object]:
    """A full_attention layer's own shape (Gemma 4's global layers; ``model.global_*``,
    grouped-query attention's keys: at their defaults under any other kind)."""
    return dict(
        head_dim=model.global_head_dim,
        kv_heads=model.global_n_kv_heads,
        k_eq_v=model.global_k_eq_v,
        own_rope=has_global_rope(model),
    )


def layer_plan(model: ModelConfig, moe: MoEConfig) -> tuple[LayerSpec, ...]:
    """Every block of the model (``model.n_blocks``: the decoder layers, then the
    multi-token-prediction blocks), in order."""
    types = layer_types(model)
    return tuple(
        LayerSpec(i, mixer_spec(model, i, types), moe.ffn_kind(i), mtp=i >= model.n_layers)
        for i in range(model.n_blocks)
    )


def validate_layer_plan(model: ModelConfig) -> None:
    """The ``model`` side of the plan: the layer types and their options, then every mixer
    kind's rules over the layers that use it (a kind no layer uses: its keys unset)."""
    _validate_types(model)
    _validate_nope(model)
    types = layer_types(model)
    used: dict[str, list[MixerSpec]] = {}
    for i in range(model.n_blocks):
        spec = mixer_spec(model, i, types)
        if spec is not None:
            key = _kind_key(types, i)
            kind = mixer_kind(spec.kind, key)
            require(
                kind.selected_by == key,
                key,
                f"{spec.kind} is a kind of {kind.selected_by}, not of {key}",
            )
            if spec.compress is not None:
                require(
                    kind.compresses,
                    "model.layer_types",
                    f"layer {i} is {types[i]}: needs model.attention of a kind that compresses "
                    f"({', '.join(k for k, c in MIXER_KINDS.items() if c.compresses)}); "
                    f"got {spec.kind}",
                )
            used.setdefault(spec.kind, []).append(spec)
    shared = {key for name in used for key in MIXER_KINDS[name].keys}
    for name, kind in MIXER_KINDS.items():
        if name in used:
            kind.validate(model, used[name])
        else:
            kind.refuse_own_keys(model, shared)


def _kind_key(types: list[str], layer: int) -> str:
    """The dotted key that names block ``layer``'s mixer kind."""
    entry = LAYER_TYPES[types[layer]] if layer < len(types) else LAYER_TYPES[FULL]
    return f"model.{entry.kind_key}"


def _validate_types(model: ModelConfig) -> None:
    types, k = model.layer_types, model.full_attention_interval
    require(
        types is None or k is None,
        "model.full_attention_interval",
        "and model.layer_types say the same thing: set one of them",
    )
    if types is not None:
        require(
            isinstance(types, list) and len(types) == model.n_layers,
            "model.layer_types",
            f"must list model.n_layers={model.n_layers} layer kinds; got {types!r}",
        )
        unknown = sorted({t for t in types if t not in LAYER_TYPES}, key=str)
        require(not unknown, "model.layer_types", f"knows {', '.join(LAYER_TYPES)}; got {unknown}")
    if k is not None:
        require(
            k <= model.n_layers,
            "model.full_attention_interval",
            f"the pattern is longer than the model: layer k - 1 is its first full-attention "
            f"layer, and there are model.n_layers={model.n_layers}; got {k}",
        )
    resolved = layer_types(model)
    require(
        not any(t in LAYER_TYPES and LAYER_TYPES[t].window for t in resolved)
        or model.sliding_window is not None,
        "model.sliding_window",
        "must be set where model.layer_types has sliding_attention layers (or compressed ones)",
    )
    require(
        CHUNKED not in resolved or model.attention_chunk_size is not None,
        "model.attention_chunk_size",
        "must be set where model.layer_types has chunked_attention layers",
    )
    require(
        types is not None or model.sliding_window is None or model.attention_chunk_size is None,
        "model.layer_types",
        "must say which layers are sliding and which chunked where both "
        "model.sliding_window and model.attention_chunk_size are set",
    )
    for key in ("sliding_window", "attention_chunk_size"):
        size = getattr(model, key)
        require(
            size is None or size < model.max_seq_len,
            f"model.{key}",
            f"must be less than model.max_seq_len={model.max_seq_len} (one as long as "
            f"the context is full attention: leave it unset); got {size}",
        )


def _validate_nope(model: ModelConfig) -> None:
    """NoPE layers and their query temperature."""
    nope = model.nope_layers
    if nope is not None:
        require(
            isinstance(nope, list)
            and all(isinstance(i, int) and 0 <= i < model.n_layers for i in nope)
            and nope == sorted(set(nope)),
            "model.nope_layers",
            f"must list distinct layer indices 0..{model.n_layers - 1} in increasing "
            f"order; got {nope!r}",
        )
    floor, scale = model.attn_temperature_floor, model.attn_temperature_scale
    require(
        (floor is None) == (scale is None),
        "model.attn_temperature_floor",
        "and model.attn_temperature_scale are set together (both null: no temperature)",
    )
    require(
        floor is None or bool(nope),
        "model.attn_temperature_floor",
        "scales the queries of the NoPE layers: model.nope_layers must list some",
    )
