"""Multi-head latent attention's keys and rules (``model.attention: mla``; DeepSeek-V2/V3):
keys and values from a compressed latent, a rotary key shared by all heads; with
``model.index_topk``, DeepSeek sparse attention (DSA; DeepSeek-V3.2, GLM-5): a lightning
indexer per layer picks the ``index_topk`` keys each query attends to. Its module is
:mod:`moetrain.model.mixers.mla`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from moetrain.config.checks import require
from moetrain.config.mixers.base import MixerKind
from moetrain.config.ranges import FUNCTION, POSITIVE_INT, at_least

if TYPE_CHECKING:
    from moetrain.config.layer_plan import MixerSpec
    from moetrain.config.model import ModelConfig


@dataclass
class MLAKeys:
    """Latent attention's own ``model`` keys (required with it, except q_lora_rank)."""

    # rank of the low-rank query path (q = up(norm(down(x)))); None = one full query projection
    q_lora_rank: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # the KV latent's size
    kv_lora_rank: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # per-head query / key dims without RoPE
    qk_nope_head_dim: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # the rotary part of each query head and of the one key shared by all heads (even)
    qk_rope_head_dim: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # the dims of a value head (required here); with grouped-query attention too, where a
    # value head and each head's output into wo may be narrower than the query/key heads
    # (MiMo-V2-Flash's 128 beside 192; None: head_dim)
    v_head_dim: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # DeepSeek sparse attention (DSA): each query attends to the index_topk earlier keys of its
    # document that the layer's lightning indexer scores highest (all of them while they are
    # fewer); None = dense latent attention. Needs q_lora_rank (the indexer reads the query
    # latent)
    index_topk: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # the indexer's heads and their dims (the first qk_rope_head_dim of each rotated)
    index_n_heads: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    index_head_dim: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # the indexer's RoPE in adjacent pairs (GLM-5) instead of half-split (DeepSeek-V3.2)
    index_rope_interleave: bool = field(default=False, metadata=FUNCTION)
    # per decoder layer, "full" (the layer runs its own indexer) or "shared" (it attends to the
    # keys the last earlier full layer selected; GLM-MoE-DSA's indexer_types); None = all full
    indexer_types: list[str] | None = field(default=None, metadata=FUNCTION)
    # the training stage (DeepSeek-V3.2's recipe): "dense_warmup" attends densely and trains
    # only the indexers (every other parameter frozen) on the KL divergence from the main
    # attention's distribution (summed over heads, normalised) to theirs; "sparse" attends to
    # the selected keys and trains everything, the indexers on the KL over the selected keys
    # with their inputs detached from the main model
    index_stage: Literal["sparse", "dense_warmup"] = "sparse"
    # the indexers' KL weight in the training loss (each indexer's KL times this is added;
    # 0 = the indexers do not train)
    index_loss_weight: float = field(default=1.0, metadata=at_least(0, "0 = off"))
    # the indexers' top-k recall against dense attention (a training metric) is measured on
    # the last index_recall_queries positions of every row; 0 = not measured
    index_recall_queries: int = field(default=16, metadata=at_least(0, "0 = off"))
    # a sigmoid gate on each head's output, one value per head from its own projection g_proj
    # (D -> H), applied before the output projection (Ling 3.0's); not with index_topk
    mla_head_gate: bool = field(default=False, metadata=FUNCTION)
    # LongCat-Flash's LoRA scales: every query times sqrt(d_model / q_lora_rank) and the
    # normalised KV latent times sqrt(d_model / kv_lora_rank) (its keys and values both, and
    # what the cache holds); needs q_lora_rank
    mla_lora_scale: bool = field(default=False, metadata=FUNCTION)


FULL_INDEXER, SHARED_INDEXER = "full", "shared"  # model.indexer_types' entries
DSA_KEYS = (
    "index_topk",
    "index_n_heads",
    "index_head_dim",
    "index_rope_interleave",
    "indexer_types",
    "index_stage",
    "index_loss_weight",
    "index_recall_queries",
)


# the per-layer options of the layer plan latent attention does not have: key, whether a spec
# asks for it
_NO_LOCAL = (
    ("model.sliding_window", lambda s: s.window is not None),
    ("model.attention_chunk_size", lambda s: s.chunk is not None),
    ("model.attn_temperature_floor", lambda s: s.temperature is not None),
)


class MLA(MixerKind):
    """Multi-head latent attention."""

    name = "mla"
    keys = (
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        *DSA_KEYS,
        "mla_head_gate",
        "mla_lora_scale",
    )

    @classmethod
    def validate(cls, model: ModelConfig, specs: list[MixerSpec]) -> None:
        for key, asks in _NO_LOCAL:
            require(
                not any(asks(s) for s in specs),
                key,
                "only applies with model.attention=gqa (latent attention layers attend to "
                "the full context)",
            )
        require(
            model.index_topk is None or all(s.rope for s in specs),
            "model.nope_layers",
            "latent attention layers without RoPE cannot use sparse attention "
            "(model.index_topk): the indexer's keys are rotated",
        )
        for key in cls.keys[1:5]:
            require(
                getattr(model, key) is not None,
                f"model.{key}",
                "must be set with model.attention=mla",
            )
        require(
            model.qk_rope_head_dim % 2 == 0,
            "model.qk_rope_head_dim",
            f"must be even for rotary embeddings; got {model.qk_rope_head_dim}",
        )
        require(
            model.n_kv_heads == model.n_heads,
            "model.n_kv_heads",
            f"must equal model.n_heads={model.n_heads} with model.attention=mla (every head has "
            f"its own keys and values, from the shared latent); got {model.n_kv_heads}",
        )
        require(
            not (model.mla_head_gate and model.index_topk is not None),
            "model.mla_head_gate",
            "does not apply with sparse attention (model.index_topk) yet",
        )
        require(
            not model.mla_lora_scale or model.q_lora_rank is not None,
            "model.mla_lora_scale",
            "needs model.q_lora_rank (the query's scale is d_model / q_lora_rank)",
        )
        _validate_dsa(model)

    @classmethod
    def head_dim(cls, model: ModelConfig) -> int:
        """A query / key head's dims: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return (model.qk_nope_head_dim or 0) + (model.qk_rope_head_dim or 0)

    @classmethod
    def rope_dim(cls, model: ModelConfig) -> int:
        return model.qk_rope_head_dim or 0

    @classmethod
    def sp_heads(cls, model: ModelConfig) -> tuple[tuple[str, int], ...]:
        """The query heads, which dense latent attention (and sparse attention's dense
        warm-up) splits over the ranks. Sparse attention's sparse stage splits the queries
        instead, every head of them over the whole rows' keys (``model/sparse_latent.py``)."""
        return (("model.n_heads", model.n_heads),)


def _validate_dsa(model: ModelConfig) -> None:
    """Sparse attention's keys: all at their defaults without ``model.index_topk``."""
    if model.index_topk is None:
        defaults = {f.name: f.default for f in dataclasses.fields(model)}
        for key in DSA_KEYS[1:]:
            require(
                getattr(model, key) == defaults[key],
                f"model.{key}",
                "only applies with model.index_topk (sparse attention)",
            )
        return
    require(
        model.q_lora_rank is not None,
        "model.q_lora_rank",
        "must be set with model.index_topk (the indexer reads the query latent)",
    )
    for key in ("index_n_heads", "index_head_dim"):
        require(
            getattr(model, key) is not None, f"model.{key}", "must be set with model.index_topk"
        )
    require(
        model.index_head_dim >= model.qk_rope_head_dim,
        "model.index_head_dim",
        f"must be at least model.qk_rope_head_dim={model.qk_rope_head_dim} (the indexer "
        f"rotates that many of its dims); got {model.index_head_dim}",
    )
    types = model.indexer_types
    if types is None:
        return
    require(
        isinstance(types, list)
        and len(types) == model.n_layers
        and set(types) <= {FULL_INDEXER, SHARED_INDEXER},
        "model.indexer_types",
        f"must list model.n_layers={model.n_layers} entries, each {FULL_INDEXER} or "
        f"{SHARED_INDEXER}; got {types!r}",
    )
    require(
        types[0] == FULL_INDEXER,
        "model.indexer_types",
        f"the first layer must be {FULL_INDEXER} (a shared layer takes the keys an earlier "
        f"full layer selected); got {types[0]!r}",
    )


def index_source(model: ModelConfig, layer: int) -> int:
    """The layer whose indexer selects the keys of decoder layer ``layer`` under sparse
    attention: itself, or for a shared layer the last earlier full one (a multi-token-
    prediction block has its own)."""
    types = model.indexer_types
    if not isinstance(types, list) or layer >= min(model.n_layers, len(types)):
        return layer  # (an unusable list is refused by name: MLA.validate)
    return max((i for i in range(layer + 1) if types[i] == FULL_INDEXER), default=layer)
