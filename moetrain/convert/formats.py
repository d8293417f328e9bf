"""Hugging Face model families a moetrain model converts to, and the settings each one needs.

A format is accepted only when its transformers class computes the same function as moetrain's
``Transformer`` (checked against transformers 5.24's modeling code); otherwise conversion is
refused with a ConfigError that names the moetrain setting that has no equivalent.

- ``mixtral`` (MixtralForCausalLM): softmax over all experts, top-k, renormalised; no shared
  experts, no query/key norm, MoE in every layer.
- ``qwen2_moe`` (Qwen2MoeForCausalLM): softmax top-k (``norm_topk_prob`` = renormalise), one
  shared expert behind a sigmoid gate, any dense/MoE placement (``mlp_only_layers``), no qk norm.
  Its q/k/v projections carry biases (``model.qkv_bias``; written as zeros without it).
- ``qwen3_moe`` (Qwen3MoeForCausalLM): as qwen2_moe but per-head query/key RMSNorm and no
  shared expert.
- ``olmoe`` (OlmoeForCausalLM): softmax top-k (``norm_topk_prob`` = renormalise), no shared
  experts, MoE in every layer, and RMSNorm over the whole query / key projection (all heads
  together: ``model.qk_norm`` with ``model.qk_norm_scope: projection``), which OLMoE always has;
  its head size is ``hidden_size / num_attention_heads``; ``clip_qkv`` must be unset.
- ``glm4_moe`` (Glm4MoeForCausalLM): sigmoid scores, selection shifted by
  ``e_score_correction_bias`` (moetrain's aux-loss-free ``expert_bias``), weights from the
  unbiased scores, optional renormalisation, ``routed_scaling_factor`` = ``moe.route_scale``,
  ungated shared experts, the first ``first_k_dense_replace`` layers dense, group-limited
  routing ``n_group`` / ``topk_group`` = ``moe.n_group`` / ``moe.topk_group`` (a group scored by
  its two best biased scores, the other groups' experts excluded), full rotary
  (``partial_rotary_factor = 1``), no attention bias.

Only GLM-4-MoE has expert groups: the other formats need ``moe.n_group = 1``.
"""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError, ModelConfig, MoEConfig

FORMATS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe")
ARCHITECTURES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
}
MODEL_TYPES = {v: k for k, v in ARCHITECTURES.items()}
# "auto" tries these in order
AUTO_ORDER = ("mixtral", "qwen3_moe", "qwen2_moe", "glm4_moe", "olmoe")


def _common(moe: MoEConfig, name: str) -> list[tuple[bool, str, str]]:
    return [
        (
            moe.capacity_factor != 0.0,
            "moe.capacity_factor",
            f"{name} is dropless; must be 0 (tokens over capacity would be dropped only here)",
        ),
    ]


def _softmax_router(moe: MoEConfig, name: str) -> list[tuple[bool, str, str]]:
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


def _per_head_norm(model: ModelConfig, name: str) -> tuple[bool, str, str]:
    return (
        model.qk_norm and model.qk_norm_scope != "head",
        "model.qk_norm_scope",
        f"{name} normalises each head's query/key; must be head",
    )


def problems(fmt: str, model: ModelConfig, moe: MoEConfig) -> list[tuple[str, str]]:
    """``(dotted setting, why)`` for every setting ``fmt`` cannot represent (empty = exact)."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format: unknown format {fmt!r}; choose auto or one of {FORMATS}")
    name = ARCHITECTURES[fmt]
    checks = _common(moe, name)
    if fmt != "qwen2_moe":
        checks.append((model.qkv_bias, "model.qkv_bias", f"{name} has no q/k/v biases"))
    if fmt == "mixtral":
        checks += _softmax_router(moe, name) + [
            (model.qk_norm, "model.qk_norm", f"{name} has no query/key norm; must be false"),
            (moe.first_k_dense != 0, "moe.first_k_dense", f"{name} has MoE in every layer"),
            (moe.moe_every != 1, "moe.moe_every", f"{name} has MoE in every layer; must be 1"),
            (not moe.renormalize, "moe.renormalize", f"{name} renormalises the top-k weights"),
            (moe.num_shared_experts != 0, "moe.num_shared_experts", f"{name} has none"),
        ]
    elif fmt == "qwen2_moe":
        checks += _softmax_router(moe, name) + [
            (model.qk_norm, "model.qk_norm", f"{name} has no query/key norm; must be false"),
            (
                moe.num_shared_experts == 0,
                "moe.num_shared_experts",
                f"{name} always has a gated shared expert; must be >= 1",
            ),
            (
                moe.num_shared_experts > 0 and not moe.shared_expert_gate,
                "moe.shared_expert_gate",
                f"{name} gates its shared expert with a sigmoid; must be true",
            ),
        ]
    elif fmt == "qwen3_moe":
        checks += _softmax_router(moe, name) + [
            (not model.qk_norm, "model.qk_norm", f"{name} always has per-head q/k norm"),
            _per_head_norm(model, name),
            (moe.num_shared_experts != 0, "moe.num_shared_experts", f"{name} has none"),
        ]
    elif fmt == "olmoe":
        checks += _softmax_router(moe, name) + [
            (
                not model.qk_norm or model.qk_norm_scope != "projection",
                "model.qk_norm_scope" if model.qk_norm else "model.qk_norm",
                f"{name} always normalises the whole query/key projection (all heads together): "
                "needs model.qk_norm=true and model.qk_norm_scope=projection",
            ),
            (
                model.attention_head_dim * model.n_heads != model.d_model,
                "model.head_dim",
                f"{name}'s head size is hidden_size / num_attention_heads "
                f"= {model.d_model // model.n_heads}",
            ),
            (moe.first_k_dense != 0, "moe.first_k_dense", f"{name} has MoE in every layer"),
            (moe.moe_every != 1, "moe.moe_every", f"{name} has MoE in every layer; must be 1"),
            (moe.num_shared_experts != 0, "moe.num_shared_experts", f"{name} has none"),
        ]
    elif fmt == "glm4_moe":
        checks += [
            (moe.score_func != "sigmoid", "moe.score_func", f"{name} routes with sigmoid"),
            _per_head_norm(model, name),
            (
                moe.moe_every != 1,
                "moe.moe_every",
                f"{name} has MoE in every layer after first_k_dense_replace; must be 1",
            ),
            (moe.num_experts < 2, "moe.num_experts", f"{name}'s group scoring needs >= 2"),
            (
                moe.n_group > 1 and moe.num_experts // moe.n_group < 2,
                "moe.n_group",
                f"{name} scores a group by its two best experts: groups need >= 2 experts",
            ),
            (
                moe.num_shared_experts == 0,
                "moe.num_shared_experts",
                f"{name} always has shared experts; must be >= 1",
            ),
            (moe.shared_expert_gate, "moe.shared_expert_gate", f"{name} does not gate them"),
            (
                moe.num_shared_experts > 0
                and moe.shared_hidden != moe.num_shared_experts * moe.expert_hidden,
                "moe.shared_expert_hidden",
                f"{name} sizes shared experts as n_shared_experts x moe_intermediate_size; "
                "must be null or num_shared_experts * expert_hidden",
            ),
        ]
    return [(key, why) for bad, key, why in checks if bad]


def check_format(fmt: str, model: ModelConfig, moe: MoEConfig) -> None:
    """Raise ConfigError naming the first setting ``fmt`` cannot represent."""
    found = problems(fmt, model, moe)
    if found:
        key, why = found[0]
        raise ConfigError(f"{key}: cannot convert to {ARCHITECTURES[fmt]}: {why}")


def choose_format(cfg: Config, fmt: str = "auto") -> str:
    """``fmt`` itself when it fits the model, or the first fitting format for ``auto``."""
    if fmt != "auto":
        check_format(fmt, cfg.model, cfg.moe)
        return fmt
    reasons = []
    for cand in AUTO_ORDER:
        found = problems(cand, cfg.model, cfg.moe)
        if not found:
            return cand
        reasons.append(f"{ARCHITECTURES[cand]}: {found[0][0]} ({found[0][1]})")
    raise ConfigError("no Hugging Face class computes this model's function: " + "; ".join(reasons))


def hf_config(cfg: Config, fmt: str, **extra: Any):  # noqa: ANN201 (a transformers config)
    """The transformers config of ``fmt`` equivalent to ``cfg`` (``extra`` passes through,
    e.g. token ids). Raises ConfigError when ``fmt`` cannot represent the model."""
    import transformers

    model, moe = cfg.model, cfg.moe
    check_format(fmt, model, moe)
    head_dim = model.attention_head_dim
    common: dict[str, Any] = dict(
        vocab_size=model.vocab_size,
        hidden_size=model.d_model,
        num_hidden_layers=model.n_layers,
        num_attention_heads=model.n_heads,
        num_key_value_heads=model.n_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=model.max_seq_len,
        rms_norm_eps=model.norm_eps,
        tie_word_embeddings=model.tie_embeddings,
        num_experts_per_tok=moe.top_k,
        router_aux_loss_coef=moe.aux_loss_coef,
        initializer_range=model.init_std,
        rope_parameters={"rope_type": "default", "rope_theta": model.rope_theta},
    )
    dense = [i for i in range(model.n_layers) if not moe.is_moe_layer(i)]
    if fmt == "mixtral":
        return transformers.MixtralConfig(
            **common,
            intermediate_size=moe.expert_hidden,
            num_local_experts=moe.num_experts,
            router_jitter_noise=moe.jitter,
            sliding_window=None,
            **extra,
        )
    if fmt in ("qwen2_moe", "qwen3_moe"):
        cls = transformers.Qwen2MoeConfig if fmt == "qwen2_moe" else transformers.Qwen3MoeConfig
        kw: dict[str, Any] = dict(
            intermediate_size=model.dense_hidden,
            moe_intermediate_size=moe.expert_hidden,
            num_experts=moe.num_experts,
            norm_topk_prob=moe.renormalize,
            decoder_sparse_step=1,
            mlp_only_layers=dense,
            use_sliding_window=False,
        )
        if fmt == "qwen2_moe":
            kw.update(shared_expert_intermediate_size=moe.shared_hidden, qkv_bias=True)
        else:
            kw.update(attention_bias=False)
        return cls(**common, **kw, **extra)
    if fmt == "olmoe":
        del common["head_dim"]  # OLMoE derives it: hidden_size / num_attention_heads
        return transformers.OlmoeConfig(
            **common,
            intermediate_size=moe.expert_hidden,
            num_experts=moe.num_experts,
            norm_topk_prob=moe.renormalize,
            clip_qkv=None,
            attention_bias=False,
            **extra,
        )
    # glm4_moe
    common["rope_parameters"] = dict(common["rope_parameters"], partial_rotary_factor=1.0)
    return transformers.Glm4MoeConfig(
        **common,
        intermediate_size=model.dense_hidden,
        moe_intermediate_size=moe.expert_hidden,
        n_routed_experts=moe.num_experts,
        n_shared_experts=moe.num_shared_experts,
        routed_scaling_factor=moe.route_scale,
        n_group=moe.n_group,
        topk_group=moe.topk_group,
        first_k_dense_replace=moe.first_k_dense,
        norm_topk_prob=moe.renormalize,
        use_qk_norm=model.qk_norm,
        attention_bias=False,
        num_mtp_layers=0,
        **extra,
    )


def transformers_config(hf_dict: dict[str, Any], model_type: str) -> Any:
    """The transformers config object of a ``config.json`` dict (attribute aliases resolved)."""
    import transformers

    fields = {k: v for k, v in hf_dict.items() if k != "model_type"}
    return transformers.AutoConfig.for_model(model_type, **fields)


def model_config_from_hf(hf: Any) -> ModelConfig:
    """The transformer shape of a transformers config object (any Llama-like family); raises
    ConfigError naming the field moetrain cannot represent."""

    def get(name: str, default: Any = None) -> Any:
        return getattr(hf, name, default)

    rope = get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"rope_parameters: only plain RoPE imports; got {rope}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("rope_parameters.partial_rotary_factor: moetrain rotates full heads")
    if get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"hidden_act: moetrain experts are SwiGLU (silu); got {get('hidden_act')}"
        )
    heads = hf.num_attention_heads
    return ModelConfig(
        vocab_size=hf.vocab_size,
        d_model=hf.hidden_size,
        n_layers=hf.num_hidden_layers,
        n_heads=heads,
        n_kv_heads=get("num_key_value_heads") or heads,
        head_dim=get("head_dim") or hf.hidden_size // heads,
        max_seq_len=hf.max_position_embeddings,
        rope_theta=float(rope.get("rope_theta", get("rope_theta", 10000.0))),
        norm_eps=float(hf.rms_norm_eps),
        tie_embeddings=bool(get("tie_word_embeddings", False)),
        init_std=float(get("initializer_range", 0.02)),
        dense_hidden=hf.intermediate_size,
    )


def config_from_hf(hf_dict: dict[str, Any]) -> Config:
    """A moetrain Config equivalent to a Hugging Face ``config.json`` (as a dict).

    Raises ConfigError naming the Hugging Face field that moetrain cannot represent.
    """
    arch = (hf_dict.get("architectures") or [None])[0]
    fmt = MODEL_TYPES.get(arch) or hf_dict.get("model_type")
    if fmt not in FORMATS:
        raise ConfigError(
            f"architectures: {arch!r} (model_type {hf_dict.get('model_type')!r}) cannot be "
            f"imported; supported: {[ARCHITECTURES[f] for f in AUTO_ORDER]}"
        )
    hf = transformers_config(hf_dict, fmt)

    def get(name: str, default: Any = None) -> Any:
        return getattr(hf, name, default)

    model = model_config_from_hf(hf)
    n_layers = model.n_layers
    moe = MoEConfig(top_k=hf.num_experts_per_tok, aux_loss_coef=0.0, z_loss_coef=0.0)
    if fmt == "mixtral":
        if get("sliding_window"):
            raise ConfigError("sliding_window: moetrain attends to the whole context")
        moe.num_experts, moe.expert_hidden = hf.num_local_experts, hf.intermediate_size
    elif fmt in ("qwen2_moe", "qwen3_moe"):
        if get("use_sliding_window"):
            raise ConfigError("use_sliding_window: moetrain attends to the whole context")
        moe.num_experts, moe.expert_hidden = hf.num_experts, hf.moe_intermediate_size
        moe.renormalize = bool(get("norm_topk_prob", False))
        moe_layers = [
            i
            for i in range(n_layers)
            if i not in (get("mlp_only_layers") or [])
            and (i + 1) % get("decoder_sparse_step", 1) == 0
        ]
        moe.first_k_dense, moe.moe_every = _placement(moe_layers, n_layers)
        if fmt == "qwen2_moe":
            model.qkv_bias = True
            moe.num_shared_experts, moe.shared_expert_gate = 1, True
            moe.shared_expert_hidden = hf.shared_expert_intermediate_size
        else:
            model.qk_norm = True
            if get("attention_bias"):
                raise ConfigError("attention_bias: moetrain attention has no biases")
    elif fmt == "olmoe":
        if get("clip_qkv") is not None:
            raise ConfigError(f"clip_qkv: moetrain does not clip q/k/v; got {get('clip_qkv')}")
        if get("attention_bias"):
            raise ConfigError("attention_bias: moetrain attention has no biases")
        model.head_dim = None  # hidden_size / num_attention_heads, as OLMoE computes it
        model.qk_norm, model.qk_norm_scope = True, "projection"
        moe.num_experts, moe.expert_hidden = hf.num_experts, hf.intermediate_size
        moe.renormalize = bool(get("norm_topk_prob", False))
    else:  # glm4_moe
        moe.n_group, moe.topk_group = int(get("n_group", 1)), int(get("topk_group", 1))
        if get("attention_bias"):
            raise ConfigError("attention_bias: moetrain attention has no biases")
        moe.num_experts, moe.expert_hidden = hf.n_routed_experts, hf.moe_intermediate_size
        moe.score_func, moe.renormalize = "sigmoid", bool(get("norm_topk_prob", True))
        moe.route_scale = float(get("routed_scaling_factor", 1.0))
        moe.num_shared_experts = hf.n_shared_experts
        moe.first_k_dense = hf.first_k_dense_replace
        model.qk_norm = bool(get("use_qk_norm", False))
    cfg = Config(model=model, moe=moe)
    cfg.data.seq_len = min(cfg.data.seq_len, model.max_seq_len)
    cfg.validate()
    return cfg


def _placement(moe_layers: list[int], n_layers: int) -> tuple[int, int]:
    """``(first_k_dense, moe_every)`` reproducing exactly ``moe_layers``, or ConfigError."""
    for first in range(n_layers + 1):
        for every in range(1, n_layers + 1):
            moe = MoEConfig(first_k_dense=first, moe_every=every)
            if moe.moe_layers(n_layers) == moe_layers:
                return first, every
    raise ConfigError(
        f"mlp_only_layers/decoder_sparse_step: MoE layers {moe_layers} are not expressible as "
        "moe.first_k_dense + moe.moe_every"
    )
