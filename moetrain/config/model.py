"""The transformer's section of the config (``model``); its MoE layers' (``moe``) is
:mod:`moetrain.config.moe`.

The keys of each token mixer kind are declared with the kind (:mod:`moetrain.config.mixers`),
those of the layer plan with it (:mod:`moetrain.config.layer_plan`); :class:`ModelConfig`
inherits them, so every key is a flat ``model.<key>``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from moetrain.config.checks import require
from moetrain.config.layer_plan import (
    CHUNKED,
    FULL,
    LAYER_TYPES,
    SLIDING,
    LayerPlanKeys,
    layer_types,
    mixer_spec,
    validate_layer_plan,
)
from moetrain.config.mixers import (
    CompressedKeys,
    GatedConvKeys,
    GatedDeltaNetKeys,
    GQAKeys,
    KDAKeys,
    Mamba2Keys,
    MLAKeys,
    mixer_kind,
)
from moetrain.config.ranges import FUNCTION, POSITIVE_INT, above, at_least

__all__ = ["CHUNKED", "FULL", "FUNCTION", "LAYER_TYPES", "POSITIVE_INT", "SLIDING", "ModelConfig"]

YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0  # YaRN's ramp where model.rope_beta_* are unset


@dataclass
class ModelShape:
    """The transformer's shape and its attention kind (the first keys of ``model``)."""

    vocab_size: int = field(default=8192, metadata=POSITIVE_INT | FUNCTION)
    d_model: int = field(default=256, metadata=POSITIVE_INT | FUNCTION)
    n_layers: int = field(default=4, metadata=POSITIVE_INT | FUNCTION)
    n_heads: int = field(default=4, metadata=POSITIVE_INT | FUNCTION)
    n_kv_heads: int = field(default=2, metadata=POSITIVE_INT | FUNCTION)
    # hidden size of dense (non-MoE) FFN layers
    dense_hidden: int = field(default=1024, metadata=POSITIVE_INT | FUNCTION)
    # the MLP of the dense FFN layers, the dense branch and the shared experts: "swiglu"
    # w2(silu(w1 x) * w3 x), "geglu" w2(gelu_tanh(w1 x) * w3 x) (Gemma's gelu_pytorch_tanh), or
    # "relu2" w2(relu(w1 x)^2), not gated (Nemotron-H's; w1 its up projection), or
    # "clamped_swiglu", the experts' clamped SwiGLU with moe.swiglu_alpha / _limit /
    # _up_offset (DeepSeek-V4's shared experts). The routed experts' is moe.activation
    ffn_activation: Literal["swiglu", "geglu", "relu2", "clamped_swiglu"] = field(
        default="swiglu", metadata=FUNCTION
    )
    # RoPE table size and HF max_position_embeddings
    max_seq_len: int = field(default=2048, metadata=POSITIVE_INT)
    rope_theta: float = field(default=10000.0, metadata=above(0) | FUNCTION)
    norm_eps: float = field(default=1e-5, metadata=above(0) | FUNCTION)
    # the token mixer kind of the attention layers (moetrain.config.mixers): "gqa"
    # (grouped-query attention; its keys: config/mixers/gqa.py) or "mla" (DeepSeek's
    # multi-head latent attention: keys and values from a compressed latent, a head-shared
    # rotary key; config/mixers/mla.py)
    attention: str = field(default="gqa", metadata=FUNCTION)


@dataclass
class ModelConfig(
    LayerPlanKeys,
    CompressedKeys,
    GatedConvKeys,
    KDAKeys,
    GatedDeltaNetKeys,
    Mamba2Keys,
    MLAKeys,
    GQAKeys,
    ModelShape,
):
    """Transformer shape: the keys above, then each mixer kind's and the layer plan's, then
    these."""

    # a bias on the LM head (Phi-3.5-MoE's lm_head_bias; with tie_embeddings only the weight is
    # shared, the bias is the head's own)
    lm_head_bias: bool = field(default=False, metadata=FUNCTION)
    # the kind of every block norm, the final norm and the MTP modules' norms: "rmsnorm" or
    # "layernorm" (mean and variance, a weight and a bias; Phi-3.5-MoE); eps is norm_eps. The
    # query/key norms and MLA's latent norms stay RMSNorm
    norm: Literal["rmsnorm", "layernorm"] = field(default="rmsnorm", metadata=FUNCTION)
    # where a block normalises: "pre" (the mixer's and the FFN's inputs), "sandwich" (also
    # each branch's output, before its residual add: layers.<i>.attn_post_norm and
    # ffn_post_norm, of model.norm's kind; Trinity's, Gemma's) or "post" (each branch's output
    # only: OLMo-2's, Olmo-Hybrid's attention layers)
    block_norms: Literal["pre", "sandwich", "post"] = field(default="pre", metadata=FUNCTION)
    # the attention layers' placement where it differs from model.block_norms' (the other
    # layers keep that: Olmo-Hybrid's post-norm attention beside pre-norm Gated DeltaNet
    # layers); null: model.block_norms everywhere
    attention_block_norms: Literal["pre", "sandwich", "post"] | None = field(
        default=None, metadata=FUNCTION
    )
    # RMSNorm weights held as an offset from 1, the norm computing x / rms(x) * (1 + w) in fp32
    # (Qwen3-Next's and Qwen3.5's zero-centred norm; zeros at initialisation): the block, final
    # and MTP norms and the query/key norms (not latent attention's nor Gated DeltaNet's
    # output norm)
    zero_centered_norm: bool = field(default=False, metadata=FUNCTION)
    tie_embeddings: bool = field(default=False, metadata=FUNCTION)
    init_std: float = field(default=0.02, metadata=above(0))
    # training loss: cross-entropy over chunks of this many tokens, never the full fp32 logits;
    # 0 = plain full-logits cross-entropy
    loss_chunk_tokens: int = field(default=1024, metadata=at_least(0, "0 = full logits"))
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
    # required) while the sequence (its last position + 1) stays within
    # rope_original_max_seq_len, by its long factor (required, same length) in a longer one,
    # every position of it; cos/sin are multiplied by rope_attention_factor (null:
    # transformers' default sqrt(1 + ln(s) / ln(original)) with s = max_seq_len / original, 1
    # when s <= 1)
    rope_short_factor: list[float] | None = field(default=None, metadata=FUNCTION)
    rope_long_factor: list[float] | None = field(default=None, metadata=FUNCTION)
    rope_attention_factor: float | None = field(default=None, metadata=above(0) | FUNCTION)
    # longrope: the factors of a sequence longer than rope_original_max_seq_len: "long" (null
    # alike: transformers' LongRoPE) or "short" (the short ones kept: transformers 5.25's
    # Phi-3.5-MoE class, which recomputes its frequencies without the sequence length)
    rope_long_regime: Literal["long", "short"] | None = field(default=None, metadata=FUNCTION)
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
    # the logits are the head's output divided by logits_scaling (the loss's too)
    logits_scaling: float = field(default=1.0, metadata=above(0) | FUNCTION)
    # a learned scalar per block, layers.<i>.layer_scalar (1,) (ones at initialisation),
    # multiplying the block's output after its residual adds (Gemma 4's layer_scalar)
    layer_scalar: bool = field(default=False, metadata=FUNCTION)
    # final-logit soft-capping (Gemma's final_logit_softcapping): the logits, after
    # logits_scaling, become cap * tanh(logits / cap) (the loss's too); null: uncapped
    final_logit_softcap: float | None = field(default=None, metadata=above(0) | FUNCTION)
    # manifold-constrained hyper-connections (mHC, DeepSeek-V4's hc_mult): the residual is this
    # many parallel streams, mixed around every branch by layers.<i>.{attn_hc,ffn_hc} and
    # collapsed by hc_head before the final norm (model/hyper_connections.py); 1 = the plain
    # residual. hc_sinkhorn_iters: Sinkhorn-Knopp iterations of the streams' mixing matrix;
    # hc_eps: the floor added to its coefficients
    hc_streams: int = field(default=1, metadata=at_least(1, "1 = the plain residual") | FUNCTION)
    hc_sinkhorn_iters: int = field(default=20, metadata=at_least(1) | FUNCTION)
    hc_eps: float = field(default=1e-6, metadata=above(0) | FUNCTION)

    @property
    def n_blocks(self) -> int:
        """Transformer blocks the model holds: the ``n_layers`` decoder layers, then one per
        multi-token-prediction module (``layers.<n_layers + k - 1>``)."""
        return self.n_layers + self.mtp_depth

    def attention_window(self, layer: int) -> int | None:
        """The sliding window of block ``layer``'s attention, None for full attention."""
        spec = mixer_spec(self, layer)
        return spec.window if spec is not None else None

    def attention_chunk(self, layer: int) -> int | None:
        """The chunk size of block ``layer``'s chunked attention, None for other attention."""
        spec = mixer_spec(self, layer)
        return spec.chunk if spec is not None else None

    def norm_placement(self, layer: int) -> str:
        """Block ``layer``'s norms: ``model.attention_block_norms`` on an attention layer (a
        multi-token-prediction block's too) where set, else ``model.block_norms``."""
        own = self.attention_block_norms
        if own is None:
            return self.block_norms
        attention = LAYER_TYPES[FULL].kind_key  # (the key naming the attention layers)
        if layer >= self.n_layers or LAYER_TYPES[layer_types(self)[layer]].kind_key == attention:
            return own
        return self.block_norms

    def has_rope(self, layer: int) -> bool:
        """Whether block ``layer`` rotates its queries and keys (multi-token-prediction blocks
        always do)."""
        spec = mixer_spec(self, layer)
        return spec is not None and spec.rope

    def attn_temperature(self, layer: int) -> tuple[int, float] | None:
        """``(floor, scale)`` of block ``layer``'s query temperature (its NoPE layers with
        ``attn_temperature_floor`` set), else None."""
        spec = mixer_spec(self, layer)
        return spec.temperature if spec is not None else None

    def mtp_weight(self, step: int) -> float:
        """The MTP loss weight of optimizer step ``step`` (1-based)."""
        final_step = self.mtp_loss_weight_final_step
        if final_step is not None and step >= final_step:
            return self.mtp_loss_weight_final
        return self.mtp_loss_weight

    @property
    def attention_head_dim(self) -> int:
        """The dims of a query / key head of the attention layers (``model.attention``'s kind):
        grouped-query attention's ``head_dim`` (or ``d_model // n_heads``), latent attention's
        ``qk_nope_head_dim + qk_rope_head_dim``."""
        return mixer_kind(self.attention).head_dim(self)

    @property
    def rope_dim(self) -> int:
        """How many dims of a query / key head RoPE rotates (the attention kind's)."""
        return mixer_kind(self.attention).rope_dim(self)

    @property
    def yarn_betas(self) -> tuple[float, float]:
        """YaRN's ``(beta_fast, beta_slow)``, 32 and 1 where unset."""
        fast, slow = self.rope_beta_fast, self.rope_beta_slow
        return (YARN_BETA_FAST if fast is None else fast, YARN_BETA_SLOW if slow is None else slow)

    def validate(self) -> None:
        mixer_kind(self.attention)
        require(
            not self.zero_centered_norm or self.norm == "rmsnorm",
            "model.zero_centered_norm",
            "applies to RMSNorm; must be false with model.norm=layernorm",
        )
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
        require(
            self.hc_streams == 1 or self.mtp_depth == 0,
            "model.hc_streams",
            "hyper-connections do not reach the multi-token-prediction blocks yet: set "
            "model.mtp_depth=0 or model.hc_streams=1",
        )
        validate_layer_plan(self)

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

    def longrope_long(self, seq_len: int) -> bool:
        """Whether a sequence of ``seq_len`` positions (its last position + 1) takes LongRoPE's
        long factors (``model.rope_long_regime``)."""
        return (
            self.rope_scaling == "longrope"
            and self.rope_long_regime != "short"
            and seq_len > self.rope_original_max_seq_len
        )


# each RoPE-scaling key -> the scalings it applies to; the keys each scaling requires
_SCALING_KEYS = {
    "rope_factor": ("yarn", "llama3"),
    "rope_original_max_seq_len": ("yarn", "llama3", "longrope"),
    "rope_short_factor": ("longrope",),
    "rope_long_factor": ("longrope",),
    "rope_attention_factor": ("longrope",),
    "rope_long_regime": ("longrope",),
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
