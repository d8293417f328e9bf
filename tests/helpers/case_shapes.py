"""Settings fragments that several of ``tests.helpers.convert_cases.CASES`` share (and tests
that build the same attention outside a case)."""

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
