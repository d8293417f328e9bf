"""The tiny moetrain models that each Hugging Face format represents exactly (``CASES``), and
what the conversion tests build from them: the model with non-trivial weights, its export loaded
in transformers, generation compared step by step."""

from __future__ import annotations

import dataclasses

import torch
from safetensors.torch import save_file

from moetrain.config import Config, ModelConfig
from moetrain.convert.formats import hf_config
from moetrain.convert.hf import to_hf_state_dict
from moetrain.model import Transformer
from moetrain.model import param_names as pn
from tests.helpers.configs import tiny_config
from tests.helpers.hf_flags import DSA, GLM_INDEXER_TYPES, PHIMOE_ROPE
from tests.helpers.random_constants import randomise_constants

# multi-head latent attention at the tiny shape (every head its own keys and values)
MLA_SHAPE = dict(
    attention="mla",
    head_dim=None,
    n_kv_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
)


# Llama 4's attention: chunks of 6 on the RoPE layers, the last layer NoPE with its query
# temperature, the post-RoPE query/key norm
LLAMA4_MODEL = dict(
    rope_interleave=True,
    attention_chunk_size=6,
    layer_types=["chunked_attention"] * 2 + ["full_attention"],
    nope_layers=[2],
    qk_norm_after_rope=True,
    attn_temperature_floor=4,
    attn_temperature_scale=0.5,
)


# Qwen3-Next's hybrid attention: layers 0, 1 Gated DeltaNet, layer 2 gated attention with
# zero-centred q/k norms, a quarter of each head rotated
QWEN_HYBRID_MODEL = dict(
    full_attention_interval=3,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    qk_norm=True,
    attention_output_gate=True,
    zero_centered_norm=True,
    partial_rotary_factor=0.25,
)
QWEN_SHARED = dict(num_shared_experts=1, shared_expert_gate=True, shared_expert_hidden=40)

# moetrain settings that each format represents exactly (and that auto picks).
CASES = {
    "mixtral": dict(model={}, moe={}),
    "qwen2_moe": dict(
        model=dict(qkv_bias=True),
        moe=dict(
            first_k_dense=1,
            moe_every=2,
            num_shared_experts=1,
            shared_expert_gate=True,
            shared_expert_hidden=40,
            renormalize=False,
        ),
    ),
    "qwen3_moe": dict(model=dict(qk_norm=True), moe=dict(first_k_dense=1)),
    "glm4_moe": dict(
        model=dict(qk_norm=True, qkv_bias=True, partial_rotary_factor=0.5),
        moe=dict(
            score_func="sigmoid",
            first_k_dense=1,
            num_shared_experts=2,
            route_scale=2.5,
            bias_update_rate=1e-3,
        ),
    ),
    "dots1": dict(  # dots.llm1's flags, a window and expert groups binding
        model=dict(
            qk_norm=True,
            sliding_window=6,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
        ),
        moe=dict(
            score_func="sigmoid",
            first_k_dense=1,
            num_shared_experts=2,
            route_scale=2.5,
            n_group=2,
            topk_group=1,
            bias_update_rate=1e-3,
        ),
    ),
    "olmoe": dict(
        model=dict(qk_norm=True, qk_norm_scope="projection", head_dim=None),
        moe=dict(renormalize=False),
    ),
    "minimax_m2": dict(  # MiniMax-M2's flags
        model=dict(qk_norm=True, qk_norm_scope="projection", partial_rotary_factor=0.5),
        moe=dict(score_func="sigmoid", bias_update_rate=1e-3),
    ),
    "afmoe": dict(  # Trinity's flags, a window binding (hf_models.py: layer 2 global, NoPE)
        model=dict(
            qk_norm=True,
            attention_output_gate=True,
            block_norms="sandwich",
            sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            nope_layers=[2],
            embedding_multiplier=32**0.5,
        ),
        moe=dict(
            score_func="sigmoid",
            first_k_dense=1,
            num_shared_experts=1,
            route_scale=2.5,
            bias_update_rate=1e-3,
        ),
    ),
    "lfm2_moe": dict(  # LFM2-8B-A1B's flags and pattern (hf_models.py)
        model=dict(
            qk_norm=True,
            tie_embeddings=True,
            head_dim=None,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_attention="gated_conv",
        ),
        moe=dict(
            score_func="sigmoid",
            renormalize_eps=1e-6,
            first_k_dense=1,
            route_scale=2.5,
            bias_update_rate=1e-3,
        ),
    ),
    "hunyuan_v1_moe": dict(  # Hunyuan-A13B's flags (NTK-alpha: folded into rope_theta)
        model=dict(qk_norm=True, qk_norm_position="after_rope", tie_embeddings=True),
        moe=dict(num_shared_experts=1),
    ),
    "deepseek_v3": dict(
        model=dict(
            **MLA_SHAPE,
            q_lora_rank=12,
            rope_interleave=True,
            rope_scaling="yarn",
            rope_factor=4.0,
            rope_original_max_seq_len=16,
            rope_mscale=1.0,
            rope_mscale_all_dim=0.8,
        ),
        moe=dict(
            num_experts=8,
            score_func="sigmoid",
            first_k_dense=1,
            num_shared_experts=1,
            n_group=4,
            topk_group=2,
            route_scale=2.5,
            bias_update_rate=1e-3,
        ),
    ),
    "kimi_linear": dict(  # Kimi Linear's (hf_flags.KIMI_LINEAR_ATTENTION)
        model=dict(
            **MLA_SHAPE,
            q_lora_rank=12,
            layer_types=["linear_attention"] * 2 + ["full_attention"],
            linear_attention="kda",
            linear_num_heads=2,
            linear_head_dim=8,
            linear_conv_kernel_dim=3,
            nope_layers=[2],
        ),
        moe=dict(
            num_experts=8,
            score_func="sigmoid",
            first_k_dense=1,
            num_shared_experts=1,
            n_group=4,
            topk_group=2,
            route_scale=2.5,
            bias_update_rate=1e-3,
        ),
    ),
    "bailing_hybrid": dict(  # Ling 3.0's (hf_flags.LING_HYBRID)
        model=dict(
            **MLA_SHAPE,
            q_lora_rank=12,
            layer_types=["linear_attention"] * 2 + ["full_attention"],
            linear_attention="kda",
            linear_num_heads=4,
            linear_head_dim=8,
            linear_conv_kernel_dim=3,
            kda_full_rank_gates=True,
            kda_gate_lower_bound=-5.0,
            mla_head_gate=True,
            rope_interleave=True,
        ),
        moe=dict(
            num_experts=8,
            score_func="sigmoid",
            first_k_dense=1,
            num_shared_experts=1,
            n_group=4,
            topk_group=2,
            route_scale=2.5,
            bias_update_rate=1e-3,
        ),
    ),
    "deepseek_v32": dict(  # DeepSeek-V3.2's flags (hf_flags.DSA)
        model=dict(
            **MLA_SHAPE,
            **DSA,
            q_lora_rank=12,
            rope_interleave=True,
            rope_scaling="yarn",
            rope_factor=4.0,
            rope_original_max_seq_len=16,
            rope_mscale=1.0,
            rope_mscale_all_dim=0.8,
        ),
        moe=dict(
            num_experts=8,
            score_func="sigmoid",
            first_k_dense=1,
            num_shared_experts=1,
            n_group=4,
            topk_group=2,
            route_scale=2.5,
            bias_update_rate=1e-3,
        ),
    ),
    "glm_moe_dsa": dict(  # GLM-5's flags, one shared-indexer layer
        model=dict(
            **MLA_SHAPE,
            **DSA,
            q_lora_rank=12,
            rope_interleave=True,
            index_rope_interleave=True,
            indexer_types=GLM_INDEXER_TYPES,
        ),
        moe=dict(
            num_experts=8,
            score_func="sigmoid",
            first_k_dense=1,
            num_shared_experts=1,
            route_scale=2.5,
            bias_update_rate=1e-3,
        ),
    ),
    "deepseek_v2": dict(
        model=dict(**MLA_SHAPE, rope_interleave=True),
        moe=dict(
            num_experts=8,
            first_k_dense=1,
            num_shared_experts=2,
            n_group=4,
            topk_group=2,
            group_score="max",
            renormalize=False,
            route_scale=1.5,
        ),
    ),
    "ernie4_5_moe": dict(  # ERNIE-4.5-21B-A3B's flags
        model=dict(rope_interleave=True, tie_embeddings=True),
        moe=dict(
            first_k_dense=1,
            num_shared_experts=2,
            bias_update_rate=1e-3,
            renormalize_min=1e-12,
        ),
    ),
    "granitemoe": dict(  # granite-3.0-1b-a400m's flags (tests/helpers/hf_models.py)
        model=dict(
            tie_embeddings=True,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_scale=0.015625,
            logits_scaling=6.0,
        ),
        moe=dict(topk_before_score=True),
    ),
    "granitemoeshared": dict(  # the same, with one ungated shared expert
        model=dict(
            tie_embeddings=True,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_scale=0.015625,
            logits_scaling=6.0,
        ),
        moe=dict(topk_before_score=True, num_shared_experts=1, shared_expert_hidden=40),
    ),
    "nemotron_h": dict(  # Nemotron 3's blocks and flags (tests/helpers/hf_flags.py), latent MoE
        model=dict(
            n_layers=5,
            rope_theta=10000.0,  # (no RoPE: the default, which its files do not store)
            init_std=0.1,  # (squared-ReLU experts of 0.02 weights barely move the logits)
            layer_types=["linear_attention", "none", "full_attention", "none", "none"],
            nope_layers=[2],
            ffn_activation="relu2",
            linear_attention="mamba2",
            mamba_num_heads=4,
            mamba_head_dim=8,
            mamba_n_groups=2,
            mamba_state_dim=8,
            mamba_chunk_size=8,
        ),
        moe=dict(
            layer_ffns=["none", "moe", "none", "moe", "dense"],
            score_func="sigmoid",
            activation="relu2",
            num_shared_experts=1,
            shared_expert_hidden=40,
            route_scale=2.5,
            n_group=2,
            topk_group=1,
            latent_dim=16,
        ),
    ),
    "granitemoehybrid": dict(  # Granite 4.0-H's (tests/helpers/hf_models.py), Mamba-2 chunks of 8
        model=dict(
            tie_embeddings=True,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_scale=0.015625,
            logits_scaling=6.0,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_attention="mamba2",
            mamba_num_heads=4,
            mamba_head_dim=16,
            mamba_n_groups=2,
            mamba_state_dim=8,
            mamba_chunk_size=8,
        ),
        moe=dict(topk_before_score=True, num_shared_experts=1, shared_expert_hidden=40),
    ),
    "gpt_oss": dict(  # gpt-oss-20b's flags (tests/helpers/hf_models.py), the window binding
        model=dict(
            qkv_bias=True,
            o_bias=True,
            attention_sinks=True,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_scaling="yarn",
            rope_factor=32.0,
            rope_original_max_seq_len=4096,
            rope_beta_fast=32.0,
            rope_beta_slow=1.0,
            rope_truncate=False,
        ),
        moe=dict(
            topk_before_score=True,
            router_bias=True,
            expert_biases=True,
            activation="clamped_swiglu",
            swiglu_alpha=1.702,
            swiglu_limit=7.0,
        ),
    ),
    "phimoe": dict(  # Phi-3.5-MoE-instruct's flags (tests/helpers/hf_models.py)
        model=dict(
            norm="layernorm",
            qkv_bias=True,
            o_bias=True,
            lm_head_bias=True,
            max_seq_len=131072,
            rope_scaling="longrope",
            rope_original_max_seq_len=4096,
            rope_short_factor=PHIMOE_ROPE["short_factor"] * 2,
            rope_long_factor=PHIMOE_ROPE["long_factor"] * 2,
            rope_attention_factor=PHIMOE_ROPE["short_mscale"],
            rope_long_regime="short",
        ),
        moe=dict(router_type="sparsemixer", renormalize=False),
    ),
    "qwen3_5_moe_text": dict(model=QWEN_HYBRID_MODEL, moe=dict(QWEN_SHARED, renormalize=True)),
    "qwen3_next": dict(  # (a dense first layer and no renormalisation: Qwen3.5 holds neither)
        model=QWEN_HYBRID_MODEL, moe=dict(QWEN_SHARED, first_k_dense=1, renormalize=False)
    ),
    "gemma4_text": dict(  # Gemma 4's pieces (hf_flags.GEMMA4_FLAGS), the window binding
        model=dict(
            qk_norm=True,
            value_norm=True,
            attention_scale=1.0,
            block_norms="sandwich",
            sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            global_head_dim=32,
            global_n_kv_heads=1,
            global_k_eq_v=True,
            global_rope_theta=100000.0,
            global_rope_proportion=0.25,
            ffn_activation="geglu",
            layer_scalar=True,
            embedding_multiplier=32**0.5,
            final_logit_softcap=3.0,
            tie_embeddings=True,
        ),
        moe=dict(
            activation="geglu",
            router_input_norm=True,
            expert_scale=True,
            dense_branch=True,
        ),
    ),
    "mimo_v2_flash": dict(  # MiMo-V2-Flash's flags (hf_flags.MIMO_V2_FLASH_FLAGS)
        model=dict(
            head_dim=12,
            v_head_dim=8,
            n_kv_heads=1,
            sliding_n_kv_heads=2,
            attention_sinks=True,
            attention_sinks_layers="sliding",
            sliding_window=6,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            sliding_rope_theta=500.0,
            partial_rotary_factor=0.334,
            attention_value_scale=0.707,
        ),
        moe=dict(score_func="sigmoid", first_k_dense=1, route_scale=2.5, bias_update_rate=1e-3),
    ),
    "longcat_flash": dict(  # LongCat-Flash's flags (hf_flags.LONGCAT_FLASH_FLAGS)
        model=dict(
            **MLA_SHAPE,
            n_layers=4,
            dense_hidden=40,
            q_lora_rank=12,
            rope_interleave=True,
            mla_lora_scale=True,
        ),
        moe=dict(
            num_experts=4,
            zero_experts=2,
            top_k=3,
            renormalize=False,
            route_scale=6.0,
            shortcut=True,
            layer_ffns=["moe", "dense"] * 2,
            bias_update_rate=1e-3,
        ),
    ),
    "llama4_text": dict(  # Llama 4's pieces, each binding in 19 tokens (hf_flags.LLAMA4_FLAGS)
        model=LLAMA4_MODEL,
        moe=dict(
            score_func="sigmoid",
            topk_before_score=True,
            renormalize=False,
            score_on_input=True,
            num_shared_experts=1,
            moe_every=2,
        ),
    ),
}


# moetrain settings of the muP-style scalars, at a non-default value (only Granite has them)
MULTIPLIERS = {
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
    "attention_scale": 0.015625,
    "logits_scaling": 6.0,
}


def tiny_cfg(fmt: str, extra: dict | None = None) -> Config:
    """The tiny model with 3 layers and what format ``fmt`` represents (and ``extra``)."""
    return tiny_config(
        {
            "model.vocab_size": 96,
            "model.n_layers": 3,
            "model.head_dim": 16,
            "model.rope_theta": 5000.0,
            "model.norm_eps": 1e-6,
            "moe.expert_hidden": 24,
        },
        {f"model.{k}": v for k, v in CASES[fmt]["model"].items()},
        {f"moe.{k}": v for k, v in CASES[fmt]["moe"].items()},
        extra or {},
    )


def stored_model(cfg: Config) -> ModelConfig:
    """``cfg.model`` as a format's config stores it: without a dense layer, the formats that
    have none store no ``model.dense_hidden`` (an import takes the experts' size)."""
    if any(not cfg.moe.is_moe_layer(i) for i in range(cfg.model.n_layers)):
        return cfg.model
    if cfg.moe.dense_branch:  # (the dense FFN beside the experts: Gemma 4's)
        return cfg.model
    return dataclasses.replace(cfg.model, dense_hidden=cfg.moe.expert_hidden)


def model_for(cfg: Config) -> Transformer:
    """The model of ``cfg`` with random weights and no tensor left constant (norms, biases,
    sinks; the selection bias where the model moves one, ``moe.bias_update_rate`` > 0, as the
    families that store one hold), so that a swapped or dropped tensor shows."""
    torch.manual_seed(0)
    m = Transformer(cfg.model, cfg.moe).eval()
    no_bias = cfg.moe.bias_update_rate == 0
    randomise_constants(m, keep=lambda name: no_bias and pn.is_expert_bias(name))
    return m


def load_hf(cfg: Config, model: Transformer, fmt: str, path):
    """``model`` exported as ``fmt`` into ``path`` and loaded by transformers (nothing missing or
    unexpected)."""
    import transformers

    hf_config(cfg, fmt).save_pretrained(path)
    save_file(to_hf_state_dict(model.state_dict(), cfg, fmt), str(path / "model.safetensors"))
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    return hf.eval()


def sharpened(model: Transformer, factor: float = 8.0) -> Transformer:
    """``model`` with its query and key projections ``factor`` times larger: attention scores
    that matter (at init they are near zero, and the softmax scale would hardly show)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".wq.weight", ".wk.weight")):
                p.mul_(factor)
    return model


def generation_matches(model: Transformer, hf, new_tokens: int) -> None:  # noqa: ANN001
    """From a 7-token prompt, ``model``'s greedy tokens are ``hf``'s, and its logits through
    the KV cache (the prompt, then one token at a time) are ``hf``'s at every position."""
    from moetrain.generate import generate_ids

    prompt = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(2))
    hf.generation_config.eos_token_id = None
    ref = hf.generate(prompt, do_sample=False, max_new_tokens=new_tokens)
    got = generate_ids(model, prompt[0].tolist(), new_tokens, temperature=0.0)
    assert got == ref[0, 7:].tolist()
    n = 7 + new_tokens - 1
    with torch.no_grad():
        cache, steps = model.new_cache(1, n + 1), []
        steps.append(model(ref[:, :7], cache=cache).logits)
        for i in range(7, n):
            steps.append(model(ref[:, i : i + 1], cache=cache).logits)
        torch.testing.assert_close(
            torch.cat(steps, 1), hf(input_ids=ref[:, :n]).logits, atol=1e-5, rtol=1e-5
        )
