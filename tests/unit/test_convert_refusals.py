"""The moetrain settings a format cannot represent are refused, naming the setting: by an
explicit format, by auto, and what each family's class does not compute."""

from __future__ import annotations

import pytest

from moetrain.config import Config, ConfigError, ModelConfig, MoEConfig
from moetrain.convert.formats import choose_format
from tests.helpers.case_shapes import MLA_SHAPE
from tests.helpers.configs import tiny_config
from tests.helpers.convert_models import tiny_cfg

transformers = pytest.importorskip("transformers")

# Granite 4.0-H's layers: a Mamba-2 layer (4 heads of 16, state 8, as wide as the model), an
# attention layer
GRANITE_HYBRID = dict(
    d_model=64,
    n_layers=2,
    layer_types=["linear_attention", "full_attention"],
    linear_attention="mamba2",
    mamba_num_heads=4,
    mamba_head_dim=16,
    mamba_state_dim=8,
)


# Trinity's model (ModelConfig's 4 layers: three sliding, one global without RoPE) and MoE
TRINITY = dict(
    qk_norm=True,
    attention_output_gate=True,
    block_norms="sandwich",
    sliding_window=6,
    layer_types=["sliding_attention"] * 3 + ["full_attention"],
    nope_layers=[3],
    embedding_multiplier=256**0.5,
)
TRINITY_MOE = dict(score_func="sigmoid", num_shared_experts=1, route_scale=2.5)
LFM2 = dict(
    qk_norm=True,
    layer_types=["linear_attention", "full_attention"] * 2,
    linear_attention="gated_conv",
)
LFM2_MOE = dict(score_func="sigmoid", renormalize_eps=1e-6)


@pytest.mark.parametrize(
    ("fmt", "model_kw", "moe_kw", "key"),
    [
        ("olmoe", {}, {}, "model.qk_norm"),
        ("olmoe", dict(qk_norm=True), {}, "model.qk_norm_scope"),
        (
            "olmoe",
            dict(qk_norm=True, qk_norm_scope="projection"),
            dict(num_shared_experts=1),
            "moe.num_shared_experts",
        ),
        (
            "olmoe",
            dict(qk_norm=True, qk_norm_scope="projection", head_dim=16),
            {},
            "model.head_dim",
        ),
        ("qwen3_moe", dict(qk_norm=True, qk_norm_scope="projection"), {}, "model.qk_norm_scope"),
        ("mixtral", dict(qkv_bias=True), {}, "model.qkv_bias"),
        ("mixtral", dict(partial_rotary_factor=0.5), {}, "model.partial_rotary_factor"),
        ("qwen2_moe", {}, dict(num_shared_experts=1), "moe.shared_expert_gate"),
        ("qwen3_moe", {}, {}, "model.qk_norm"),
        ("qwen3_moe", dict(qk_norm=True), dict(bias_update_rate=0.1), "moe.bias_update_rate"),
        ("glm4_moe", {}, dict(num_shared_experts=1), "moe.score_func"),
        (
            "glm4_moe",
            {},
            dict(score_func="sigmoid", num_shared_experts=1, shared_expert_gate=True),
            "moe.shared_expert_gate",
        ),
        (
            "glm4_moe",
            {},
            dict(score_func="sigmoid", num_shared_experts=1, moe_every=2),
            "moe.moe_every",
        ),
        (
            "glm4_moe",
            {},
            dict(score_func="sigmoid", num_shared_experts=1, shared_expert_hidden=7),
            "moe.shared_expert_hidden",
        ),
        ("mixtral", {}, dict(capacity_factor=1.0), "moe.capacity_factor"),
        ("mixtral", {}, dict(renormalize_min=1e-12), "moe.renormalize_min"),
        (
            "glm4_moe",
            {},
            dict(score_func="sigmoid", num_shared_experts=1, renormalize_min=1e-12),
            "moe.renormalize_min",
        ),
        ("ernie4_5_moe", {}, {}, "model.rope_interleave"),
        ("ernie4_5_moe", dict(rope_interleave=True, qkv_bias=True), {}, "model.qkv_bias"),
        ("ernie4_5_moe", dict(rope_interleave=True, qk_norm=True), {}, "model.qk_norm"),
        (
            "ernie4_5_moe",
            dict(rope_interleave=True, partial_rotary_factor=0.5),
            {},
            "model.partial_rotary_factor",
        ),
        (
            "ernie4_5_moe",
            dict(rope_interleave=True),
            dict(capacity_factor=1.0),
            "moe.capacity_factor",
        ),
        ("ernie4_5_moe", dict(rope_interleave=True), dict(score_func="sigmoid"), "moe.score_func"),
        (
            "ernie4_5_moe",
            dict(rope_interleave=True),
            dict(topk_before_score=True),
            "moe.topk_before_score",
        ),
        ("ernie4_5_moe", dict(rope_interleave=True), dict(renormalize=False), "moe.renormalize"),
        ("ernie4_5_moe", dict(rope_interleave=True), dict(route_scale=2.0), "moe.route_scale"),
        (
            "ernie4_5_moe",
            dict(rope_interleave=True),
            dict(n_group=2, topk_group=1),
            "moe.n_group",
        ),
        (
            "ernie4_5_moe",
            dict(rope_interleave=True),
            dict(num_shared_experts=1, shared_expert_gate=True),
            "moe.shared_expert_gate",
        ),
        (
            "ernie4_5_moe",
            dict(rope_interleave=True),
            dict(num_shared_experts=1, shared_expert_hidden=7),
            "moe.shared_expert_hidden",
        ),
        (
            "ernie4_5_moe",
            dict(rope_interleave=True),
            dict(first_k_dense=1, moe_every=2),
            "moe.moe_every",
        ),
        ("mixtral", {}, dict(n_group=2), "moe.n_group"),
        ("granitemoe", {}, {}, "moe.topk_before_score"),
        ("granitemoe", dict(qkv_bias=True), dict(topk_before_score=True), "model.o_bias"),
        ("granitemoe", dict(qk_norm=True), dict(topk_before_score=True), "model.qk_norm"),
        (
            "granitemoe",
            dict(rope_interleave=True),
            dict(topk_before_score=True),
            "model.rope_interleave",
        ),
        (
            "granitemoe",
            dict(partial_rotary_factor=0.5),
            dict(topk_before_score=True),
            "model.partial_rotary_factor",
        ),
        (
            "granitemoe",
            {},
            dict(topk_before_score=True, num_shared_experts=1),
            "moe.num_shared_experts",
        ),
        ("granitemoe", {}, dict(topk_before_score=True, first_k_dense=1), "moe.first_k_dense"),
        ("granitemoe", {}, dict(topk_before_score=True, moe_every=2), "moe.moe_every"),
        (
            "granitemoe",
            {},
            dict(topk_before_score=True, capacity_factor=1.0),
            "moe.capacity_factor",
        ),
        ("granitemoe", {}, dict(topk_before_score=True, route_scale=2.0), "moe.route_scale"),
        ("granitemoe", {}, dict(topk_before_score=True, n_group=2), "moe.n_group"),
        (
            "granitemoe",
            {},
            dict(topk_before_score=True, renormalize_min=0.0, bias_update_rate=0.1),
            "moe.bias_update_rate",
        ),
        ("granitemoe", dict(mtp_depth=1), dict(topk_before_score=True), "model.mtp_depth"),
        (
            "granitemoeshared",
            {},
            dict(topk_before_score=True, num_shared_experts=1, shared_expert_gate=True),
            "moe.shared_expert_gate",
        ),
        ("granitemoeshared", {}, {}, "moe.topk_before_score"),
        (
            "granitemoehybrid",
            dict(GRANITE_HYBRID, nope_layers=[0]),
            dict(topk_before_score=True, num_shared_experts=1),
            "model.nope_layers",
        ),
        (
            "granitemoehybrid",
            dict(GRANITE_HYBRID, mamba_head_dim=12),
            dict(topk_before_score=True, num_shared_experts=1),
            "model.mamba_head_dim",
        ),
        (
            "granitemoehybrid",
            GRANITE_HYBRID,
            dict(topk_before_score=True),
            "moe.num_shared_experts",
        ),
        (
            "granitemoehybrid",
            dict(n_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=8),
            dict(topk_before_score=True, num_shared_experts=1),
            "model.layer_types",
        ),
        ("mixtral", dict(embedding_multiplier=12.0), {}, "model.embedding_multiplier"),
        ("qwen3_moe", dict(residual_multiplier=0.22), {}, "model.residual_multiplier"),
        ("olmoe", dict(attention_scale=0.015625), {}, "model.attention_scale"),
        (
            "ernie4_5_moe",
            dict(rope_interleave=True, logits_scaling=6.0),
            {},
            "model.logits_scaling",
        ),
        ("mixtral", dict(final_logit_softcap=30.0), {}, "model.final_logit_softcap"),
        ("mixtral", dict(ffn_activation="geglu"), {}, "model.ffn_activation"),
        ("mixtral", {}, dict(activation="geglu"), "moe.activation"),
        ("mixtral", {}, dict(router_input_norm=True), "moe.router_input_norm"),
        ("mixtral", {}, dict(expert_scale=True), "moe.expert_scale"),
        ("mixtral", dict(layer_scalar=True), {}, "model.layer_scalar"),
        ("afmoe", TRINITY, dict(TRINITY_MOE, dense_branch=True), "moe.dense_branch"),
        ("qwen2_moe", {}, dict(n_group=4, topk_group=2), "moe.n_group"),
        (
            "glm4_moe",
            {},
            dict(score_func="sigmoid", num_shared_experts=1, n_group=8, topk_group=2),
            "moe.n_group",
        ),
        (
            "glm4_moe",
            {},
            dict(score_func="sigmoid", num_shared_experts=1, topk_before_score=True),
            "moe.topk_before_score",
        ),
        ("llama4_text", {}, {}, "model.rope_interleave"),
        ("llama4_text", dict(rope_interleave=True), {}, "moe.score_func"),
        (
            "llama4_text",
            dict(rope_interleave=True),
            dict(score_func="sigmoid", renormalize=False, num_shared_experts=1),
            "moe.topk_before_score",
        ),
        (
            "llama4_text",
            dict(rope_interleave=True),
            dict(score_func="sigmoid", topk_before_score=True, num_shared_experts=1),
            "moe.renormalize",
        ),
        (
            "llama4_text",
            dict(rope_interleave=True),
            dict(
                score_func="sigmoid",
                topk_before_score=True,
                renormalize=False,
                num_shared_experts=1,
            ),
            "moe.score_on_input",
        ),
        (
            "llama4_text",
            dict(rope_interleave=True),
            dict(
                score_func="sigmoid", topk_before_score=True, renormalize=False, score_on_input=True
            ),
            "moe.num_shared_experts",
        ),
        ("dots1", {}, {}, "model.qk_norm"),
        ("dots1", dict(qk_norm=True, qkv_bias=True), {}, "model.o_bias"),
        ("dots1", dict(qk_norm=True, partial_rotary_factor=0.5), {}, "model.partial_rotary_factor"),
        ("dots1", dict(qk_norm=True, qk_norm_scope="projection"), {}, "model.qk_norm_scope"),
        (
            "dots1",
            dict(qk_norm=True),
            dict(score_func="sigmoid", num_shared_experts=2, shared_expert_gate=True),
            "moe.shared_expert_gate",
        ),
        ("minimax_m2", dict(qk_norm=True), {}, "model.qk_norm_scope"),
        ("minimax_m2", dict(qk_norm=True, qk_norm_scope="projection"), {}, "moe.score_func"),
        (
            "minimax_m2",
            dict(qk_norm=True, qk_norm_scope="projection"),
            dict(score_func="sigmoid", num_shared_experts=1),
            "moe.num_shared_experts",
        ),
        (
            "minimax_m2",
            dict(qk_norm=True, qk_norm_scope="projection"),
            dict(score_func="sigmoid", route_scale=2.0),
            "moe.route_scale",
        ),
        ("hunyuan_v1_moe", dict(qk_norm=True), {}, "model.qk_norm_position"),
        (
            "qwen3_moe",
            dict(qk_norm=True, qk_norm_position="after_rope"),
            {},
            "model.qk_norm_position",
        ),
        (
            "hunyuan_v1_moe",
            dict(qk_norm=True, qk_norm_position="after_rope"),
            {},
            "moe.num_shared_experts",
        ),
        (
            "hunyuan_v1_moe",
            dict(qk_norm=True, qk_norm_position="after_rope"),
            dict(num_shared_experts=1, shared_expert_hidden=40),
            "moe.shared_expert_hidden",
        ),
        (
            "hunyuan_v1_moe",
            dict(qk_norm=True, qk_norm_position="after_rope"),
            dict(num_shared_experts=1, shared_expert_gate=True),
            "moe.shared_expert_gate",
        ),
        ("afmoe", dict(TRINITY, block_norms="pre"), TRINITY_MOE, "model.block_norms"),
        ("qwen3_moe", dict(qk_norm=True, block_norms="sandwich"), {}, "model.block_norms"),
        ("afmoe", dict(TRINITY, attention_output_gate=False), TRINITY_MOE, "output_gate"),
        ("afmoe", dict(TRINITY, nope_layers=[2]), TRINITY_MOE, "model.nope_layers"),
        ("afmoe", dict(TRINITY, nope_layers=None), TRINITY_MOE, "model.nope_layers"),
        ("afmoe", dict(TRINITY, embedding_multiplier=2.0), TRINITY_MOE, "embedding_multiplier"),
        ("afmoe", TRINITY, dict(TRINITY_MOE, renormalize=False), "moe.renormalize"),
        ("afmoe", TRINITY, dict(TRINITY_MOE, num_shared_experts=0), "moe.num_shared_experts"),
        ("afmoe", dict(TRINITY, qkv_bias=True), TRINITY_MOE, "model.qkv_bias"),
        ("afmoe", dict(TRINITY, attention_block_norms="post"), TRINITY_MOE, "block_norms"),
        ("lfm2_moe", LFM2, dict(LFM2_MOE, renormalize_eps=0.0), "moe.renormalize_eps"),
        ("lfm2_moe", LFM2, dict(LFM2_MOE, score_func="softmax"), "moe.score_func"),
        ("lfm2_moe", dict(LFM2, qk_norm=False), LFM2_MOE, "model.qk_norm"),
        ("lfm2_moe", dict(LFM2, head_dim=32), LFM2_MOE, "model.head_dim"),
        ("lfm2_moe", LFM2, dict(LFM2_MOE, num_shared_experts=1), "moe.num_shared_experts"),
        ("lfm2_moe", dict(LFM2, sliding_window=8), LFM2_MOE, "model.sliding_window"),
        (
            "lfm2_moe",
            dict(LFM2, linear_attention="mamba2", mamba_num_heads=4, mamba_head_dim=64),
            LFM2_MOE,
            "model.linear_attention",
        ),
        ("qwen3_next", LFM2, LFM2_MOE, "model.linear_attention"),
        ("mixtral", {}, dict(renormalize_eps=1e-6), "moe.renormalize_eps"),
        ("mixtral", dict(block_norms="post"), {}, "model.block_norms"),
        (  # the long factors past the original context: every LongRoPE family but Phi-3.5-MoE
            "mixtral",
            dict(
                rope_scaling="longrope",
                rope_original_max_seq_len=64,
                rope_short_factor=[1.0] * 32,
                rope_long_factor=[2.0] * 32,
                rope_long_regime="short",
            ),
            {},
            "model.rope_long_regime",
        ),
        ("mixtral", dict(attention_chunk_size=6), {}, "model.attention_chunk_size"),
        ("qwen3_moe", dict(qk_norm=True, nope_layers=[1]), {}, "model.nope_layers"),
        ("olmoe", dict(qk_norm_after_rope=True), {}, "model.qk_norm_after_rope"),
        ("granitemoe", {}, dict(topk_before_score=True, score_on_input=True), "moe.score_on_input"),
    ],
)
def test_explicit_format_refused_naming_the_setting(fmt, model_kw, moe_kw, key) -> None:
    cfg = Config(model=ModelConfig(**model_kw), moe=MoEConfig(**moe_kw))
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        choose_format(cfg, fmt)


def test_auto_refuses_a_model_no_format_represents() -> None:
    # softmax routing + ungated shared expert: only GLM has ungated shared experts (sigmoid)
    cfg = Config(moe=MoEConfig(num_shared_experts=1))
    with pytest.raises(ConfigError, match="no Hugging Face class") as e:
        choose_format(cfg)
    assert "moe.num_shared_experts" in str(e.value) and "moe.score_func" in str(e.value)
    with pytest.raises(ConfigError, match="unknown format"):
        choose_format(cfg, "llama4")


@pytest.mark.parametrize(
    ("fmt", "model_kw", "moe_kw", "key"),
    [
        ("deepseek_v3", {}, {}, "model.attention"),
        ("deepseek_v3", "mla", dict(num_shared_experts=1), "moe.score_func"),
        (
            "deepseek_v3",
            "mla",
            dict(score_func="sigmoid", num_shared_experts=1, n_group=2, group_score="max"),
            "moe.group_score",
        ),
        ("deepseek_v3", "mla", dict(score_func="sigmoid"), "moe.num_shared_experts"),
        ("deepseek_v2", "mla", dict(num_shared_experts=1), "model.rope_interleave"),
        ("deepseek_v2", "mla+interleave", dict(num_shared_experts=1), "moe.renormalize"),
        (
            "deepseek_v2",
            "mla+interleave",
            dict(num_shared_experts=1, renormalize=False, n_group=2),
            "moe.group_score",
        ),
        (
            "deepseek_v2",
            "mla+interleave",
            dict(num_shared_experts=1, renormalize=False, bias_update_rate=0.1),
            "moe.bias_update_rate",
        ),
    ],
)
def test_deepseek_formats_refuse_naming_the_setting(fmt, model_kw, moe_kw, key) -> None:

    model = {}
    if model_kw:
        model = {f"model.{k}": v for k, v in MLA_SHAPE.items()}
        model["model.rope_interleave"] = model_kw == "mla+interleave"
    cfg = tiny_config(model, {"moe.num_experts": 8}, {f"moe.{k}": v for k, v in moe_kw.items()})
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        choose_format(cfg, fmt)


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"model.norm": "rmsnorm"}, "model.norm"),
        ({"moe.router_type": "topk", "moe.renormalize": True}, "moe.router_type"),
        ({"model.o_bias": False}, "model.o_bias"),
        ({"moe.num_shared_experts": 1}, "moe.num_shared_experts"),
        ({"moe.route_scale": 2.0}, "moe.route_scale"),
        ({"moe.capacity_factor": 1.0}, "moe.capacity_factor"),
        ({"model.rope_long_regime": "long"}, "model.rope_long_regime"),
        ({"model.rope_long_regime": None}, "model.rope_long_regime"),
    ],
)
def test_phimoe_refuses_what_its_class_does_not_compute_by_key(changes, key) -> None:
    cfg = tiny_cfg("phimoe", changes)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        choose_format(cfg, "phimoe")


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"model.o_bias": False}, "model.o_bias"),
        ({"model.attention_sinks": False}, "model.attention_sinks"),
        ({"moe.router_bias": False}, "moe.router_bias"),
        ({"moe.expert_biases": False}, "moe.expert_biases"),
        ({"moe.topk_before_score": False}, "moe.topk_before_score"),
        (
            {"moe.activation": "swiglu", "moe.swiglu_alpha": None, "moe.swiglu_limit": None},
            "moe.activation",
        ),
    ],
)
def test_gpt_oss_refuses_what_its_class_lacks_by_key(extra, key) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        choose_format(tiny_cfg("gpt_oss", extra), "gpt_oss")


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"moe.score_on_input": False}, "moe.score_on_input"),
        ({"moe.topk_before_score": False}, "moe.topk_before_score"),
        ({"moe.renormalize": True}, "moe.renormalize"),
        ({"moe.score_func": "softmax"}, "moe.score_func"),
        ({"moe.num_shared_experts": 0}, "moe.num_shared_experts"),
        ({"moe.shared_expert_gate": True}, "moe.shared_expert_gate"),
        ({"moe.shared_expert_hidden": 7}, "moe.shared_expert_hidden"),
        ({"moe.route_scale": 2.0}, "moe.route_scale"),
        ({"moe.bias_update_rate": 0.1}, "moe.bias_update_rate"),
        ({"moe.capacity_factor": 1.0}, "moe.capacity_factor"),
        ({"moe.n_group": 2}, "moe.n_group"),
        ({"model.rope_interleave": False}, "model.rope_interleave"),
        ({"model.qk_norm": True}, "model.qk_norm"),
        ({"model.qkv_bias": True}, "model.o_bias"),
        ({"model.attention_sinks": True}, "model.attention_sinks"),
        (
            {"model.sliding_window": 6, "model.layer_types": ["sliding_attention"] * 3},
            "model.sliding_window",
        ),
        ({"model.partial_rotary_factor": 0.5}, "model.partial_rotary_factor"),
        ({"model.mtp_depth": 1}, "model.mtp_depth"),
    ],
)
def test_llama4_refuses_what_its_class_does_not_compute_by_key(changes, key) -> None:
    cfg = tiny_cfg("llama4_text", changes)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        choose_format(cfg, "llama4_text")
