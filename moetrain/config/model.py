"""The transformer's section of the config (``model``); its MoE layers' (``moe``) is
:mod:`moetrain.config.moe`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from moetrain.config.checks import require
from moetrain.config.ranges import above, at_least, between

POSITIVE_INT = above(0, "a positive integer")
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0  # YaRN's ramp where model.rope_beta_* are unset
# Field metadata: the field defines the function the model computes (a checkpoint.init_from
# source decides it, a config may not contradict it).
FUNCTION = {"function": True}


@dataclass
class ModelConfig:
    """Dense transformer shape."""

    vocab_size: int = field(default=8192, metadata=POSITIVE_INT | FUNCTION)
    d_model: int = field(default=256, metadata=POSITIVE_INT | FUNCTION)
    n_layers: int = field(default=4, metadata=POSITIVE_INT | FUNCTION)
    n_heads: int = field(default=4, metadata=POSITIVE_INT | FUNCTION)
    n_kv_heads: int = field(default=2, metadata=POSITIVE_INT | FUNCTION)
    # default d_model // n_heads
    head_dim: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # SwiGLU hidden size of dense (non-MoE) FFN layers
    dense_hidden: int = field(default=1024, metadata=POSITIVE_INT | FUNCTION)
    # RoPE table size and HF max_position_embeddings
    max_seq_len: int = field(default=2048, metadata=POSITIVE_INT)
    rope_theta: float = field(default=10000.0, metadata=above(0) | FUNCTION)
    norm_eps: float = field(default=1e-5, metadata=above(0) | FUNCTION)
    # RMSNorm on queries and keys (Qwen3-MoE, GLM-4-MoE, OLMoE)
    qk_norm: bool = field(default=False, metadata=FUNCTION)
    # what that norm normalises: "head" (each head's vector; Qwen3-MoE, GLM-4-MoE) or
    # "projection" (the whole query / key projection, all heads together; OLMoE)
    qk_norm_scope: Literal["head", "projection"] = field(default="head", metadata=FUNCTION)
    # biases on the query / key / value projections (Qwen2, Qwen2-MoE)
    qkv_bias: bool = field(default=False, metadata=FUNCTION)
    # a bias on attention's output projection (gpt-oss, Phi-3.5-MoE)
    o_bias: bool = field(default=False, metadata=FUNCTION)
    # attention sinks (gpt-oss): a learned logit per query head, layers.<i>.attn.sinks (H,),
    # added to every softmax's denominator (a key column that carries no value)
    attention_sinks: bool = field(default=False, metadata=FUNCTION)
    # sliding-window attention: a query of a "sliding_attention" layer sees the last
    # sliding_window positions, itself included (transformers' rule); less than max_seq_len
    sliding_window: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # each decoder layer's attention kind, "full_attention", "sliding_attention" or
    # "chunked_attention" (n_layers entries); None = every layer sliding with sliding_window
    # set, chunked with attention_chunk_size set, else every layer full (both set: required).
    # Multi-token-prediction blocks attend to the full context
    layer_types: list[str] | None = field(default=None, metadata=FUNCTION)
    # a bias on the LM head (Phi-3.5-MoE's lm_head_bias; with tie_embeddings only the weight is
    # shared, the bias is the head's own)
    lm_head_bias: bool = field(default=False, metadata=FUNCTION)
    # the kind of every block norm, the final norm and the MTP modules' norms: "rmsnorm" or
    # "layernorm" (mean and variance, a weight and a bias; Phi-3.5-MoE); eps is norm_eps. The
    # query/key norms and MLA's latent norms stay RMSNorm
    norm: Literal["rmsnorm", "layernorm"] = field(default="rmsnorm", metadata=FUNCTION)
    tie_embeddings: bool = field(default=False, metadata=FUNCTION)
    init_std: float = field(default=0.02, metadata=above(0))
    # training loss: cross-entropy over chunks of this many tokens, never the full fp32 logits;
    # 0 = plain full-logits cross-entropy
    loss_chunk_tokens: int = field(default=1024, metadata=at_least(0, "0 = full logits"))
    # attention kind: "gqa" (grouped-query attention) or "mla" (DeepSeek's multi-head latent
    # attention: keys and values from a compressed latent, a head-shared rotary key)
    attention: Literal["gqa", "mla"] = field(default="gqa", metadata=FUNCTION)
    # MLA only (required with attention=mla except q_lora_rank, refused otherwise):
    # rank of the low-rank query path (q = up(norm(down(x)))); None = one full query projection
    q_lora_rank: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    kv_lora_rank: int | None = field(
        default=None, metadata=POSITIVE_INT | FUNCTION
    )  # the KV latent's size
    qk_nope_head_dim: int | None = field(
        default=None, metadata=POSITIVE_INT | FUNCTION
    )  # per-head, no RoPE
    # the rotary part of each query head and of the one key shared by all heads (even)
    qk_rope_head_dim: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    v_head_dim: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # grouped-query attention: the fraction of each head's dims RoPE rotates (its first
    # head_dim * factor dims, even; GLM-4.5's 0.5); the others carry no position
    partial_rotary_factor: float = field(
        default=1.0, metadata=between(0, 1, low_open=True) | FUNCTION
    )
    # RoPE dims come in adjacent pairs (transformers' rope_interleave; DeepSeek's weights)
    # instead of first half / second half; any attention kind
    rope_interleave: bool = field(default=False, metadata=FUNCTION)
    # RoPE scaling, any attention kind: "none", "yarn", "llama3" (Llama 3.1's) or "longrope"
    # (Phi-3's LongRoPE; the rope_* keys below apply to the scaling they name)
    rope_scaling: Literal["none", "yarn", "llama3", "longrope"] = field(
        default="none", metadata=FUNCTION
    )
    # YaRN and llama3: context extension factor (required); YaRN, llama3 and longrope: the
    # pretraining context it extends (required)
    rope_factor: float | None = field(default=None, metadata=at_least(1) | FUNCTION)
    rope_original_max_seq_len: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # longrope: each rotary frequency is divided by its short factor (rope_dim / 2 of them,
    # required), and cos/sin are multiplied by rope_attention_factor (null: transformers'
    # default sqrt(1 + ln(s) / ln(original)) with s = max_seq_len / original, 1 when s <= 1).
    # moetrain computes positions below rope_original_max_seq_len only (the short factors);
    # the long factors (required, same length) are the model's beyond it, kept for export
    rope_short_factor: list[float] | None = field(default=None, metadata=FUNCTION)
    rope_long_factor: list[float] | None = field(default=None, metadata=FUNCTION)
    rope_attention_factor: float | None = field(default=None, metadata=above(0) | FUNCTION)
    # YaRN's ramp: dims rotating more than beta_fast times in the original context keep their
    # frequency, fewer than beta_slow times are interpolated (unset: 32 and 1)
    rope_beta_fast: float | None = field(default=None, metadata=above(0) | FUNCTION)
    rope_beta_slow: float | None = field(default=None, metadata=above(0) | FUNCTION)
    # YaRN's mscale / mscale_all_dim (unset: as transformers without the key; rope.py)
    rope_mscale: float | None = field(default=None, metadata=above(0) | FUNCTION)
    rope_mscale_all_dim: float | None = field(default=None, metadata=above(0) | FUNCTION)
    # YaRN: whether the ramp's correction dims are floored / ceiled to whole dims (unset: true,
    # transformers' default; gpt-oss: false)
    rope_truncate: bool | None = field(default=None, metadata=FUNCTION)
    # llama3: wavelengths longer than original / low_freq_factor are divided by the factor,
    # shorter than original / high_freq_factor kept, blended between (both required)
    rope_low_freq_factor: float | None = field(default=None, metadata=above(0) | FUNCTION)
    rope_high_freq_factor: float | None = field(default=None, metadata=above(0) | FUNCTION)
    # multi-token prediction (DeepSeek-V3): D sequential modules after the last layer, module k
    # predicting the token k + 1 ahead through one more block (layer n_layers + k - 1) and the
    # shared embedding and head; 0 = off (an imported model's MTP layers are then not read)
    mtp_depth: int = field(default=0, metadata=at_least(0, "0 = off"))
    # the MTP loss weight lambda (the mean over depths is scaled by it), from step 1; and, with
    # mtp_loss_weight_final_step, the weight from that step on (DeepSeek-V3: 0.3, then 0.1)
    mtp_loss_weight: float = field(default=0.3, metadata=at_least(0))
    mtp_loss_weight_final: float | None = field(default=None, metadata=at_least(0))
    mtp_loss_weight_final_step: int | None = field(default=None, metadata=POSITIVE_INT)
    # muP-style scalars (Granite-MoE's embedding_multiplier, residual_multiplier,
    # attention_multiplier, logits_scaling; 1.0 / None compute exactly the plain model):
    # the token embeddings are multiplied by embedding_multiplier; each block's attention and
    # FFN outputs by residual_multiplier before their residual add
    embedding_multiplier: float = field(default=1.0, metadata=above(0) | FUNCTION)
    residual_multiplier: float = field(default=1.0, metadata=above(0) | FUNCTION)
    # grouped-query attention's softmax scale; None = 1 / sqrt(head_dim)
    attention_scale: float | None = field(default=None, metadata=above(0) | FUNCTION)
    # the logits are the head's output divided by logits_scaling (the loss's too)
    logits_scaling: float = field(default=1.0, metadata=above(0) | FUNCTION)
    # chunked local attention (Llama 4's attention_chunk_size): a query of a
    # "chunked_attention" layer at position i sees the positions j <= i with j // C == i // C
    # (positions in the row, from 0); less than max_seq_len
    attention_chunk_size: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # the decoder layers without rotary embeddings (NoPE; Llama 4's no_rope_layers zeros):
    # distinct indices in increasing order; None = every layer has RoPE
    nope_layers: list[int] | None = field(default=None, metadata=FUNCTION)
    # a weightless RMSNorm (eps norm_eps) over each query and key head after RoPE, on the layers
    # with RoPE only (Llama 4's use_qk_norm)
    qk_norm_after_rope: bool = field(default=False, metadata=FUNCTION)
    # attention temperature tuning on the NoPE layers (Llama 4's attn_temperature_tuning,
    # floor_scale, attn_scale): the query at position p (in the row) is multiplied by
    # log1p(floor((p + 1) / attn_temperature_floor)) * attn_temperature_scale + 1; both set
    # or both None (off)
    attn_temperature_floor: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    attn_temperature_scale: float | None = field(default=None, metadata=above(0) | FUNCTION)

    @property
    def n_blocks(self) -> int:
        """Transformer blocks the model holds: the ``n_layers`` decoder layers, then one per
        multi-token-prediction module (``layers.<n_layers + k - 1>``)."""
        return self.n_layers + self.mtp_depth

    def attention_window(self, layer: int) -> int | None:
        """The sliding window of block ``layer``'s attention, None for full attention."""
        if self.sliding_window is None or layer >= self.n_layers:
            return None
        if self.layer_types is None or self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    def attention_chunk(self, layer: int) -> int | None:
        """The chunk size of block ``layer``'s chunked attention, None for other attention."""
        if self.attention_chunk_size is None or layer >= self.n_layers:
            return None
        if self.layer_types is None or self.layer_types[layer] == CHUNKED:
            return self.attention_chunk_size
        return None

    def has_rope(self, layer: int) -> bool:
        """Whether block ``layer`` rotates its queries and keys (multi-token-prediction blocks
        always do)."""
        return layer >= self.n_layers or layer not in (self.nope_layers or ())

    def attn_temperature(self, layer: int) -> tuple[int, float] | None:
        """``(floor, scale)`` of block ``layer``'s query temperature (its NoPE layers with
        ``attn_temperature_floor`` set), else None."""
        floor, scale = self.attn_temperature_floor, self.attn_temperature_scale
        if floor is None or scale is None or self.has_rope(layer):
            return None
        return floor, scale

    def mtp_weight(self, step: int) -> float:
        """The MTP loss weight of optimizer step ``step`` (1-based)."""
        final_step = self.mtp_loss_weight_final_step
        if final_step is not None and step >= final_step:
            return self.mtp_loss_weight_final
        return self.mtp_loss_weight

    @property
    def attention_head_dim(self) -> int:
        """Grouped-query attention's ``head_dim``, or ``d_model // n_heads`` when it is not set;
        with MLA, a query / key head's dims (``qk_nope_head_dim + qk_rope_head_dim``)."""
        if self.attention == "mla":
            return (self.qk_nope_head_dim or 0) + (self.qk_rope_head_dim or 0)
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def rope_dim(self) -> int:
        """How many dims of a query / key head RoPE rotates."""
        if self.attention == "mla":
            return self.qk_rope_head_dim or 0
        return int(self.attention_head_dim * self.partial_rotary_factor)

    @property
    def yarn_betas(self) -> tuple[float, float]:
        """YaRN's ``(beta_fast, beta_slow)``, 32 and 1 where unset."""
        fast, slow = self.rope_beta_fast, self.rope_beta_slow
        return (YARN_BETA_FAST if fast is None else fast, YARN_BETA_SLOW if slow is None else slow)

    def validate(self) -> None:
        self._validate_rope_scaling()
        require(
            (self.mtp_loss_weight_final is None) == (self.mtp_loss_weight_final_step is None),
            "model.mtp_loss_weight_final",
            "and model.mtp_loss_weight_final_step are set together (the weight from that step)",
        )
        require(
            self.mtp_loss_weight_final is None or self.mtp_depth > 0,
            "model.mtp_loss_weight_final",
            "weights the multi-token-prediction loss: set model.mtp_depth > 0, or leave it and "
            "model.mtp_loss_weight_final_step unset",
        )
        self._validate_windows()
        self._validate_nope()
        self._validate_gqa_only()
        if self.attention == "mla":
            self._validate_mla()
            return
        for key in _MLA_KEYS:
            require(
                getattr(self, key) is None,
                f"model.{key}",
                "only applies with model.attention=mla",
            )
        if self.head_dim is None:
            require(
                self.d_model % self.n_heads == 0,
                "model.n_heads",
                f"must divide model.d_model={self.d_model} (or set model.head_dim); "
                f"got {self.n_heads}",
            )
        require(
            self.attention_head_dim % 2 == 0,
            "model.head_dim",
            f"must be even for rotary embeddings; got {self.attention_head_dim}",
        )
        require(
            self.rope_dim > 0 and self.rope_dim % 2 == 0,
            "model.partial_rotary_factor",
            f"must rotate an even number of dims, at least 2, of the {self.attention_head_dim} "
            f"of a head; {self.partial_rotary_factor:g} rotates {self.rope_dim}",
        )
        require(
            self.n_heads % self.n_kv_heads == 0,
            "model.n_kv_heads",
            f"must divide model.n_heads={self.n_heads}; got {self.n_kv_heads}",
        )

    def _validate_windows(self) -> None:
        types = self.layer_types
        if types is not None:
            require(
                isinstance(types, list) and len(types) == self.n_layers,
                "model.layer_types",
                f"must list model.n_layers={self.n_layers} layer kinds; got {types!r}",
            )
            unknown = sorted({t for t in types if t not in LAYER_TYPES}, key=str)
            require(
                not unknown,
                "model.layer_types",
                f"knows {', '.join(LAYER_TYPES)}; got {unknown}",
            )
            require(
                SLIDING not in types or self.sliding_window is not None,
                "model.sliding_window",
                "must be set where model.layer_types has sliding_attention layers",
            )
            require(
                CHUNKED not in types or self.attention_chunk_size is not None,
                "model.attention_chunk_size",
                "must be set where model.layer_types has chunked_attention layers",
            )
        require(
            types is not None or self.sliding_window is None or self.attention_chunk_size is None,
            "model.layer_types",
            "must say which layers are sliding and which chunked where both "
            "model.sliding_window and model.attention_chunk_size are set",
        )
        for key in ("sliding_window", "attention_chunk_size"):
            size = getattr(self, key)
            require(
                size is None or size < self.max_seq_len,
                f"model.{key}",
                f"must be less than model.max_seq_len={self.max_seq_len} (one as long as "
                f"the context is full attention: leave it unset); got {size}",
            )

    def _validate_gqa_only(self) -> None:
        """The attention options that grouped-query attention has and latent attention not."""
        gqa_only = {
            "sliding_window": self.sliding_window is not None,
            "attention_chunk_size": self.attention_chunk_size is not None,
            "attention_sinks": self.attention_sinks,
            "nope_layers": bool(self.nope_layers),
            "qk_norm_after_rope": self.qk_norm_after_rope,
            "attn_temperature_floor": self.attn_temperature_floor is not None,
        }
        for key, is_set in gqa_only.items():
            require(
                not (is_set and self.attention == "mla"),
                f"model.{key}",
                "only applies with model.attention=gqa",
            )

    def _validate_nope(self) -> None:
        """NoPE layers and their query temperature."""
        nope = self.nope_layers
        if nope is not None:
            require(
                isinstance(nope, list)
                and all(isinstance(i, int) and 0 <= i < self.n_layers for i in nope)
                and nope == sorted(set(nope)),
                "model.nope_layers",
                f"must list distinct layer indices 0..{self.n_layers - 1} in increasing "
                f"order; got {nope!r}",
            )
        floor, scale = self.attn_temperature_floor, self.attn_temperature_scale
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

    def _validate_mla(self) -> None:
        for key in _MLA_KEYS[1:]:
            require(
                getattr(self, key) is not None,
                f"model.{key}",
                "must be set with model.attention=mla",
            )
        require(
            self.qk_rope_head_dim % 2 == 0,
            "model.qk_rope_head_dim",
            f"must be even for rotary embeddings; got {self.qk_rope_head_dim}",
        )
        require(
            self.n_kv_heads == self.n_heads,
            "model.n_kv_heads",
            f"must equal model.n_heads={self.n_heads} with model.attention=mla (every head has "
            f"its own keys and values, from the shared latent); got {self.n_kv_heads}",
        )
        unused = {"head_dim": self.head_dim is not None, "qk_norm": self.qk_norm}
        unused["partial_rotary_factor"] = self.partial_rotary_factor != 1.0
        unused["qkv_bias"] = self.qkv_bias
        unused["o_bias"] = self.o_bias
        unused["attention_scale"] = self.attention_scale is not None  # (MLA's own scale)
        for key, is_set in unused.items():
            require(not is_set, f"model.{key}", "does not apply with model.attention=mla")

    def _validate_rope_scaling(self) -> None:
        scaling = self.rope_scaling
        for key, applies in _SCALING_KEYS.items():
            require(
                scaling in applies or getattr(self, key) is None,
                f"model.{key}",
                f"only applies with model.rope_scaling={' or '.join(applies)}",
            )
        for key in _REQUIRED_KEYS.get(scaling, ()):
            require(
                getattr(self, key) is not None,
                f"model.{key}",
                f"must be set with model.rope_scaling={scaling}",
            )
        if scaling == "longrope":
            self._validate_longrope()
        if scaling == "llama3":
            low, high = self.rope_low_freq_factor, self.rope_high_freq_factor
            require(
                high >= low,
                "model.rope_high_freq_factor",
                f"must be at least model.rope_low_freq_factor={low:g} (equal: no blend, "
                f"Llama 4's); got {high:g}",
            )
        if scaling != "yarn":
            return
        fast, slow = self.yarn_betas
        require(  # equal: one ramp step, as transformers computes it (Kimi K2's 1.0 and 1.0)
            fast >= slow,
            "model.rope_beta_fast",
            f"must be at least model.rope_beta_slow={slow:g} (unset: 32 and 1); got {fast:g}",
        )

    def _validate_longrope(self) -> None:
        for key in ("rope_short_factor", "rope_long_factor"):
            factors = getattr(self, key)
            require(
                len(factors) == self.rope_dim // 2
                and all(math.isfinite(f) and f > 0 for f in factors),
                f"model.{key}",
                f"must hold rope_dim / 2 = {self.rope_dim // 2} positive finite factors; got "
                f"{factors}",
            )

    @property
    def longrope_attention_factor(self) -> float:
        """What LongRoPE multiplies cos and sin by: ``rope_attention_factor``, or unset
        ``sqrt(1 + ln(s) / ln(original))`` with ``s = max_seq_len / original`` (1 for s <= 1),
        transformers' default."""
        if self.rope_attention_factor is not None:
            return self.rope_attention_factor
        original = self.rope_original_max_seq_len
        scale = self.max_seq_len / original
        return 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original))

    @property
    def rope_positions(self) -> int:
        """How many positions the model computes: ``max_seq_len``, or with LongRoPE at most
        ``rope_original_max_seq_len`` (the short factors' range)."""
        if self.rope_scaling == "longrope":
            return min(self.max_seq_len, self.rope_original_max_seq_len)
        return self.max_seq_len


SLIDING, FULL, CHUNKED = "sliding_attention", "full_attention", "chunked_attention"
LAYER_TYPES = (FULL, SLIDING, CHUNKED)  # model.layer_types' entries
_MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# each RoPE-scaling key -> the scalings it applies to; the keys each scaling requires
_SCALING_KEYS = {
    "rope_factor": ("yarn", "llama3"),
    "rope_original_max_seq_len": ("yarn", "llama3", "longrope"),
    "rope_short_factor": ("longrope",),
    "rope_long_factor": ("longrope",),
    "rope_attention_factor": ("longrope",),
    "rope_beta_fast": ("yarn",),
    "rope_beta_slow": ("yarn",),
    "rope_mscale": ("yarn",),
    "rope_mscale_all_dim": ("yarn",),
    "rope_truncate": ("yarn",),
    "rope_low_freq_factor": ("llama3",),
    "rope_high_freq_factor": ("llama3",),
}
_REQUIRED_KEYS = {
    "longrope": ("rope_original_max_seq_len", "rope_short_factor", "rope_long_factor"),
    "yarn": ("rope_factor", "rope_original_max_seq_len"),
    "llama3": (
        "rope_factor",
        "rope_original_max_seq_len",
        "rope_low_freq_factor",
        "rope_high_freq_factor",
    ),
}
