"""Every supported Hugging Face format loads in transformers and gives moetrain's logits; the
settings no format represents are refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from moetrain.config import Config, ConfigError, ModelConfig, MoEConfig
from moetrain.config.model import FULL
from moetrain.convert.families import FORMATS, family
from moetrain.convert.formats import choose_format, config_from_hf, hf_config
from moetrain.convert.hf import from_hf_state_dict, to_hf_state_dict
from moetrain.model import Transformer
from tests.helpers.configs import tiny_config
from tests.helpers.hf_models import PHIMOE_ROPE

transformers = pytest.importorskip("transformers")

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
    "olmoe": dict(
        model=dict(qk_norm=True, qk_norm_scope="projection", head_dim=None),
        moe=dict(renormalize=False),
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
        ),
        moe=dict(router_type="sparsemixer", renormalize=False),
    ),
    "llama4_text": dict(  # Llama 4's pieces, each binding in 19 tokens (hf_models.LLAMA4_FLAGS)
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


def model_for(cfg: Config) -> Transformer:
    torch.manual_seed(0)
    m = Transformer(cfg.model, cfg.moe).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a swapped tensor would show
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            if name.endswith((".bias", "_bias", ".sinks")):
                p.uniform_(-0.5, 0.5)
        if cfg.moe.bias_update_rate > 0:
            for layer in m.moe_layers():
                layer.router.expert_bias.uniform_(-0.3, 0.3)
    return m


def load_hf(cfg: Config, model: Transformer, fmt: str, path):
    hf_config(cfg, fmt).save_pretrained(path)
    save_file(to_hf_state_dict(model.state_dict(), cfg, fmt), str(path / "model.safetensors"))
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    return hf.eval()


def test_every_registered_format_has_a_case() -> None:
    assert set(CASES) == set(FORMATS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_format_logits_match_and_round_trip(tmp_path, fmt: str) -> None:
    cfg = tiny_cfg(fmt)
    assert choose_format(cfg) == fmt
    model = model_for(cfg)
    hf = load_hf(cfg, model, fmt, tmp_path)
    assert type(hf).__name__ == family(fmt).architecture
    ids = torch.randint(0, 96, (2, 19))
    with torch.no_grad():
        ref, got = hf(input_ids=ids).logits, model(ids).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert ref.abs().max() > 1e-2
    # HF config -> moetrain config, and both HF layouts (per-expert file, v5 fused) -> moetrain
    back_cfg = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    no_dense = fmt in (
        "mixtral",
        "olmoe",
        "granitemoe",
        "granitemoeshared",
        "gpt_oss",
        "phimoe",
    )
    unused = {"dense_hidden": back_cfg.model.dense_hidden} if no_dense else {}
    assert back_cfg.model == dataclasses.replace(cfg.model, **unused)  # no dense FFN layer
    for key in (
        "num_experts",
        "top_k",
        "expert_hidden",
        "score_func",
        "renormalize",
        "route_scale",
        "num_shared_experts",
        "shared_expert_gate",
    ):
        assert getattr(back_cfg.moe, key) == getattr(cfg.moe, key), key
    layers = range(cfg.model.n_layers)
    assert [back_cfg.moe.is_moe_layer(i) for i in layers] == [
        cfg.moe.is_moe_layer(i) for i in layers
    ]
    sd = model.state_dict()
    for layout in (to_hf_state_dict(sd, cfg, fmt), hf.state_dict()):
        back = from_hf_state_dict(layout, cfg, fmt)
        assert set(back) == set(sd)
        for k in sd:
            torch.testing.assert_close(back[k], sd[k], atol=0, rtol=0, msg=k)


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
        ("mixtral", dict(embedding_multiplier=12.0), {}, "model.embedding_multiplier"),
        ("qwen3_moe", dict(residual_multiplier=0.22), {}, "model.residual_multiplier"),
        ("olmoe", dict(attention_scale=0.015625), {}, "model.attention_scale"),
        (
            "ernie4_5_moe",
            dict(rope_interleave=True, logits_scaling=6.0),
            {},
            "model.logits_scaling",
        ),
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


def test_glm4_group_limited_routing_matches_transformers(tmp_path) -> None:
    """GLM-4.5-style n_group / topk_group: the same logits as transformers' Glm4Moe (with a
    non-zero correction bias), the groups round-trip, and they change this input's routing."""
    cfg = tiny_cfg("glm4_moe", {"moe.num_experts": 8, "moe.n_group": 4, "moe.topk_group": 2})
    assert choose_format(cfg) == "glm4_moe"
    model = model_for(cfg)
    hf = load_hf(cfg, model, "glm4_moe", tmp_path)
    assert (hf.config.n_group, hf.config.topk_group) == (4, 2)
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = hf(input_ids=ids).logits, model(ids).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    back = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert (back.moe.n_group, back.moe.topk_group) == (4, 2)
    ungrouped = dataclasses.replace(cfg.moe, n_group=1, topk_group=1)
    plain = Transformer(cfg.model, ungrouped).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(plain(ids).logits, got, atol=1e-4)


def test_qwen2_moe_without_a_shared_expert_matches_transformers(tmp_path) -> None:
    """q/k/v biases and no shared expert (an upcycled Qwen2): Qwen2-MoE with a shared expert
    of hidden size 0 (empty tensors, a zero gate), which transformers loads with nothing
    missing and computes as none; read back as no shared expert."""
    no_shared = {"moe.num_shared_experts": 0, "moe.shared_expert_hidden": None}
    cfg = tiny_cfg("qwen2_moe", {**no_shared, "moe.shared_expert_gate": False})
    assert choose_format(cfg) == "qwen2_moe"
    model = model_for(cfg)
    hf = load_hf(cfg, model, "qwen2_moe", tmp_path)
    assert hf.config.shared_expert_intermediate_size == 0
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids).logits, hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5
        )
    back = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert (back.moe.num_shared_experts, back.moe.shared_expert_gate) == (0, False)
    sd = model.state_dict()
    back_sd = from_hf_state_dict(hf.state_dict(), back, "qwen2_moe")
    assert set(back_sd) == set(sd)


def test_auto_refuses_a_model_no_format_represents() -> None:
    # softmax routing + ungated shared expert: only GLM has ungated shared experts (sigmoid)
    cfg = Config(moe=MoEConfig(num_shared_experts=1))
    with pytest.raises(ConfigError, match="no Hugging Face class") as e:
        choose_format(cfg)
    assert "moe.num_shared_experts" in str(e.value) and "moe.score_func" in str(e.value)
    with pytest.raises(ConfigError, match="unknown format"):
        choose_format(cfg, "llama4")


def test_softmax_with_nonzero_bias_tensor_is_refused() -> None:
    cfg = tiny_cfg("mixtral")
    sd = model_for(cfg).state_dict()
    sd["layers.1.ffn.router.expert_bias"] = torch.full((4,), 0.5)
    with pytest.raises(ConfigError, match=r"layers\.1\.ffn\.router\.expert_bias"):
        to_hf_state_dict(sd, cfg, "mixtral")


@pytest.mark.parametrize(
    "setting, value",
    [("model__attention", "mla"), ("model__rope_interleave", True)],
)
def test_grouped_query_families_refuse_latent_attention_by_key(setting: str, value: object) -> None:
    """An MLA or interleaved-RoPE model: every grouped-query family names the setting (moetrain
    convert stopped on a bare KeyError once)."""
    from moetrain.convert.formats import problems
    from tests.helpers.configs import tiny_config

    extra = {}
    if value == "mla":
        extra = {f"model__{k}": v for k, v in MLA_SHAPE.items() if k != "attention"}
    cfg = tiny_config(**{setting: value}, **extra)
    for fmt in FORMATS:
        if setting == "model__rope_interleave" and family(fmt).rope_interleave:
            continue  # (ERNIE rotates adjacent pairs: it refuses false instead)
        if family(fmt).attention == "gqa":
            assert setting.replace("__", ".") in [k for k, _ in problems(fmt, cfg.model, cfg.moe)]


@pytest.mark.parametrize("setting", list(MULTIPLIERS))
def test_families_without_multipliers_refuse_them_by_key(setting: str) -> None:
    """A muP-style scalar at a non-default value: every family but Granite-MoE names it (MLA
    families: the embedding, residual and logits scalars; MLA refuses model.attention_scale)."""
    from moetrain.convert.formats import problems

    for fmt in FORMATS:
        fam = family(fmt)
        mla = fam.attention == "mla"
        if fam.multipliers or (mla and setting == "attention_scale"):
            continue
        shape = {f"model.{k}": v for k, v in MLA_SHAPE.items()} if mla else {}
        cfg = tiny_config(shape, {f"model.{setting}": MULTIPLIERS[setting]})
        assert f"model.{setting}" in [k for k, _ in problems(fmt, cfg.model, cfg.moe)], fmt
    # and the Granite case itself has all four, exactly
    assert not problems("granitemoe", tiny_cfg("granitemoe").model, tiny_cfg("granitemoe").moe)


def test_latent_attention_refuses_an_attention_scale() -> None:
    """MLA has its own softmax scale (1 / sqrt(qk head dim) times YaRN's mscale)."""
    with pytest.raises(ConfigError, match=r"model\.attention_scale"):
        tiny_config({f"model.{k}": v for k, v in MLA_SHAPE.items()}, model__attention_scale=0.1)


def sharpened(model: Transformer, factor: float = 8.0) -> Transformer:
    """``model`` with its query and key projections ``factor`` times larger: attention scores
    that matter (at init they are near zero, and the softmax scale would hardly show)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".wq.weight", ".wk.weight")):
                p.mul_(factor)
    return model


def test_granite_multipliers_change_the_logits_and_match_transformers(tmp_path) -> None:
    """Each of Granite's four scalars changes this model's logits (so the parity test above
    checks them all), and at other values they still match transformers'."""
    cfg = tiny_cfg("granitemoe")
    model = sharpened(model_for(cfg))
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(ids).logits
        for key in MULTIPLIERS:
            plain = Transformer(
                dataclasses.replace(cfg.model, **{key: None if key == "attention_scale" else 1.0}),
                cfg.moe,
            ).eval()
            plain.load_state_dict(model.state_dict())
            assert (plain(ids).logits - got).abs().max() > 1e-4, key
    other = tiny_cfg(
        "granitemoe",
        {
            "model.embedding_multiplier": 3.0,
            "model.residual_multiplier": 0.5,
            "model.attention_scale": 0.3,
            "model.logits_scaling": 0.5,
            "model.tie_embeddings": False,
        },
    )
    model = sharpened(model_for(other))
    hf = load_hf(other, model, "granitemoe", tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids).logits, hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5
        )
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["attention_multiplier"], saved["logits_scaling"]) == (0.3, 0.5)
    assert config_from_hf(saved).model == dataclasses.replace(
        other.model, dense_hidden=config_from_hf(saved).model.dense_hidden
    )
    # no attention scale: transformers gets 1 / sqrt(head_dim)
    default = dataclasses.replace(
        other, model=dataclasses.replace(other.model, attention_scale=None)
    )
    assert hf_config(default, "granitemoe").attention_multiplier == 16**-0.5


@pytest.mark.parametrize("fmt", ["granitemoe", "granitemoeshared"])
def test_granite_attention_biases_match_transformers_and_round_trip(tmp_path, fmt) -> None:
    """``attention_bias``: biases on q/k/v/o (nonzero, so each shows in the logits) give
    transformers' logits, and the config reads back with them."""
    cfg = tiny_cfg(fmt, {"model.qkv_bias": True, "model.o_bias": True})
    model = sharpened(model_for(cfg))
    hf = load_hf(cfg, model, fmt, tmp_path)
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids).logits, hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5
        )
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["attention_bias"] is True
    back = config_from_hf(saved).model
    assert (back.qkv_bias, back.o_bias) == (True, True)


def test_granite_shared_expert_matches_transformers_and_round_trips(tmp_path) -> None:
    """GraniteMoeShared: the shared expert (two of moetrain's merged, 2 x 24) is its
    shared_mlp, read back as one of 48; without one it is GraniteMoe's model, which auto
    picks."""
    cfg = tiny_cfg(
        "granitemoeshared", {"moe.shared_expert_hidden": None, "moe.num_shared_experts": 2}
    )
    assert choose_format(cfg) == "granitemoeshared"
    model = model_for(cfg)
    with torch.no_grad():  # a shared expert that shows in the logits of the tiny model
        for name, p in model.named_parameters():
            if ".shared_expert." in name:
                p.mul_(4.0)
    hf = load_hf(cfg, model, "granitemoeshared", tmp_path)
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(ids).logits
        torch.testing.assert_close(got, hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
        plain = Transformer(cfg.model, dataclasses.replace(cfg.moe, num_shared_experts=0)).eval()
        plain.load_state_dict(model.state_dict(), strict=False)
        assert (plain(ids).logits - got).abs().max() > 1e-4
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["shared_intermediate_size"] == 48
    back = config_from_hf(saved).moe
    assert (back.num_shared_experts, back.shared_hidden, back.shared_expert_gate) == (1, 48, False)
    none = tiny_cfg(
        "granitemoeshared", {"moe.num_shared_experts": 0, "moe.shared_expert_hidden": None}
    )
    assert choose_format(none) == "granitemoe"
    assert hf_config(none, "granitemoeshared").shared_intermediate_size == 0
    with pytest.raises(ConfigError, match="shared_intermediate_size"):
        config_from_hf(
            {**saved, "architectures": ["GraniteMoeForCausalLM"], "model_type": "granitemoe"}
        )


def test_granite_released_config_imports() -> None:
    """granite-3.0-1b-a400m's config.json as released (legacy rope_theta, dropout, bf16):
    its routing, scalars and head."""
    from tests.helpers.hf_models import GRANITE_RELEASED_CONFIG

    cfg = config_from_hf(GRANITE_RELEASED_CONFIG)
    m, moe = cfg.model, cfg.moe
    assert (m.embedding_multiplier, m.residual_multiplier) == (12.0, 0.22)
    assert (m.attention_scale, m.logits_scaling, m.tie_embeddings) == (0.015625, 6.0, True)
    assert (m.head_dim, m.rope_theta, m.norm_eps, m.qkv_bias) == (8, 10000.0, 1e-6, False)
    assert (moe.score_func, moe.topk_before_score, moe.num_shared_experts) == ("softmax", True, 0)
    assert (moe.num_experts, moe.top_k, moe.expert_hidden) == (4, 2, 24)
    assert moe.moe_layers(3) == [0, 1, 2]
    assert choose_format(cfg) == "granitemoe"


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"embedding_multiplier": 0.0}, "embedding_multiplier"),
        ({"logits_scaling": None}, "logits_scaling"),
        ({"attention_multiplier": -1.0}, "attention_multiplier"),
        ({"residual_multiplier": None}, "residual_multiplier"),
        (
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.5,
                }
            },
            "partial_rotary_factor",
        ),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ],
)
def test_granite_configs_moetrain_cannot_compute_are_refused(changes, key) -> None:
    from tests.helpers.hf_models import GRANITE_RELEASED_CONFIG

    d = {
        k: v
        for k, v in GRANITE_RELEASED_CONFIG.items()
        if "rope" not in k or "rope_parameters" not in changes
    }
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_hf({**d, **changes})


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
    from tests.helpers.configs import tiny_config

    model = {}
    if model_kw:
        model = {f"model.{k}": v for k, v in MLA_SHAPE.items()}
        model["model.rope_interleave"] = model_kw == "mla+interleave"
    cfg = tiny_config(model, {"moe.num_experts": 8}, {f"moe.{k}": v for k, v in moe_kw.items()})
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        choose_format(cfg, fmt)


def _deepseek_dict(family_name: str, **changes) -> dict:
    from tests.helpers.hf_models import hf_config as tiny_hf_config

    d = tiny_hf_config(family_name).to_dict()
    d["architectures"] = [family(family_name).architecture]
    return {**d, **changes}


def test_deepseek_v3_config_imports_mla_yarn_and_routing() -> None:
    cfg = config_from_hf(_deepseek_dict("deepseek_v3"))
    m, moe = cfg.model, cfg.moe
    assert (m.attention, m.q_lora_rank, m.kv_lora_rank, m.v_head_dim) == ("mla", 12, 16, 12)
    assert (m.qk_nope_head_dim, m.qk_rope_head_dim, m.rope_interleave) == (8, 8, True)
    assert (m.rope_scaling, m.rope_factor, m.rope_original_max_seq_len) == ("yarn", 4.0, 16)
    assert (m.rope_beta_fast, m.rope_beta_slow, m.rope_mscale_all_dim) == (24.0, 2.0, 0.8)
    assert (moe.score_func, moe.n_group, moe.topk_group, moe.group_score) == (
        "sigmoid",
        4,
        2,
        "top2_sum",
    )
    assert (moe.route_scale, moe.num_shared_experts, moe.first_k_dense) == (2.5, 1, 1)
    v2 = config_from_hf(_deepseek_dict("deepseek_v2")).moe
    assert (v2.score_func, v2.renormalize, v2.group_score, v2.n_group) == (
        "softmax",
        False,
        "max",
        4,
    )
    greedy = config_from_hf(_deepseek_dict("deepseek_v2", topk_method="greedy")).moe
    assert (greedy.n_group, greedy.topk_group) == (1, 1)


@pytest.mark.parametrize(
    "family_name, changes, key",
    [
        ("deepseek_v3", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method"),
        ("deepseek_v3", {"attention_bias": True}, "attention_bias"),
        ("deepseek_v3", {"yarn_attention_factor": 2.0}, "rope_parameters.attention_factor"),
    ],
)
def test_deepseek_configs_moetrain_cannot_compute_are_refused(family_name, changes, key) -> None:
    d = _deepseek_dict(family_name)
    for name in ("attention_factor", "truncate"):
        if f"yarn_{name}" in changes:
            d["rope_parameters"] = {**d["rope_parameters"], name: changes.pop(f"yarn_{name}")}
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_hf({**d, **changes})


SCALED_ROPE = {
    "yarn": {
        "model.rope_scaling": "yarn",
        "model.rope_factor": 4.0,
        "model.rope_original_max_seq_len": 16,
        "model.rope_beta_fast": 24.0,
    },
    "llama3": {
        "model.rope_scaling": "llama3",
        "model.rope_factor": 8.0,
        "model.rope_original_max_seq_len": 16,
        "model.rope_low_freq_factor": 1.0,
        "model.rope_high_freq_factor": 4.0,
    },
    "longrope": {  # (moetrain computes the short factors, within the original context)
        "model.rope_scaling": "longrope",
        "model.rope_original_max_seq_len": 64,
        "model.rope_short_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0],
        "model.rope_long_factor": [2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0],
        "model.rope_attention_factor": 1.3,
    },
}
# the rope types of each grouped-query family (Phi-3.5-MoE multiplies any scaled RoPE by its
# short_mscale: plain and LongRoPE only)
SCALED_CASES = [
    (fmt, scaling)
    for fmt in FORMATS
    if family(fmt).attention == "gqa"
    for scaling in SCALED_ROPE
    if fmt != "phimoe" or scaling == "longrope"
]

# Granite's released attention scale (1/64) leaves the tiny random model's attention nearly
# uniform, where positions hardly show: a sharper one, so that the scaling changes the logits
SHARP_ATTENTION = dict.fromkeys(("granitemoe", "granitemoeshared"), {"model.attention_scale": 16.0})


@pytest.mark.parametrize(("fmt", "scaling"), SCALED_CASES)
def test_scaled_rope_matches_transformers_and_round_trips(tmp_path, fmt: str, scaling) -> None:
    """YaRN, Llama 3.1's and LongRoPE's RoPE scaling in every grouped-query family:
    transformers' logits (the scaling changes them), and the rope_parameters come back as they
    went."""
    sharp = SHARP_ATTENTION.get(fmt, {})
    keys = dict(SCALED_ROPE[scaling])
    pairs = tiny_cfg(fmt).model.rope_dim // 2
    for key in ("model.rope_short_factor", "model.rope_long_factor"):  # (rope_dim / 2 each)
        if key in keys:
            keys[key] = keys[key][:pairs]
    off = {}  # the scaling replaces the case's own (gpt-oss's YaRN)
    yarn_only = ("rope_beta_fast", "rope_beta_slow", "rope_truncate")
    if scaling != "yarn":
        yarn_only += ("rope_factor",) if "model.rope_factor" not in keys else ()
        off = {f"model.{k}": None for k in yarn_only if k in CASES[fmt]["model"]}
    cfg = tiny_cfg(fmt, {**keys, **sharp, **off})
    model = model_for(cfg)
    hf = load_hf(cfg, model, fmt, tmp_path)
    assert hf.config.rope_parameters["rope_type"] == scaling
    ids = torch.randint(0, 96, (2, 60), generator=torch.Generator().manual_seed(0))
    unscaled = {}  # the case's own scaling (gpt-oss's YaRN) off too
    if "rope_scaling" in CASES[fmt]["model"]:
        own = [k for k in CASES[fmt]["model"] if k.startswith("rope_") and k != "rope_scaling"]
        unscaled = {f"model.{k}": None for k in own}
        unscaled["model.rope_scaling"] = "none"
    plain = Transformer(tiny_cfg(fmt, {**sharp, **unscaled}).model, cfg.moe).eval()
    plain.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        ref, got = hf(input_ids=ids).logits, model(ids).logits
        assert (plain(ids).logits - got).abs().max() > 1e-4  # well above the tolerance below
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    back = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert back.model == cfg.model or fmt in (
        "mixtral",
        "olmoe",
        "granitemoe",
        "granitemoeshared",
        "gpt_oss",
        "phimoe",
    )  # (no dense FFN)
    for key in SCALED_ROPE[scaling]:
        name = key.removeprefix("model.")
        assert getattr(back.model, name) == getattr(cfg.model, name), key


def test_unknown_rope_type_is_refused_by_name() -> None:
    d = hf_config(tiny_cfg("mixtral"), "mixtral").to_dict()
    d["architectures"] = ["MixtralForCausalLM"]
    d["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ConfigError, match=r"rope_parameters\.rope_type: .*'dynamic'"):
        config_from_hf(d)


def _ernie(extra: dict, tmp_path) -> tuple[Config, Transformer, torch.Tensor, torch.Tensor]:
    """The tiny ERNIE model with ``extra``, its logits in moetrain and in transformers."""
    cfg = tiny_cfg("ernie4_5_moe", extra)
    assert choose_format(cfg) == "ernie4_5_moe"
    model = model_for(cfg)
    hf = load_hf(cfg, model, "ernie4_5_moe", tmp_path)
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, ref = model(ids).logits, hf(input_ids=ids).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    return cfg, model, ids, got


def test_ernie_norm_min_where_it_binds_matches_transformers(tmp_path) -> None:
    """moe.renormalize_min is ERNIE's moe_norm_min: at 0.9, above many tokens' top-2 sums of 4
    experts, transformers' logits, not those of the plain sum; it round-trips."""
    cfg, model, ids, got = _ernie({"moe.renormalize_min": 0.9}, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["moe_norm_min"] == 0.9
    assert config_from_hf(
        json.loads((tmp_path / "config.json").read_text())
    ).moe == dataclasses.replace(cfg.moe, aux_loss_coef=0.0, z_loss_coef=0.0, bias_update_rate=0.0)
    plain = Transformer(cfg.model, dataclasses.replace(cfg.moe, renormalize_min=0.0)).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (plain(ids).logits - got).abs().max() > 1e-3


def test_ernie_moe_layer_interval_matches_transformers(tmp_path) -> None:
    """Every second layer MoE (moe.moe_every=2 from layer 0: ERNIE's moe_layer_interval=2) and
    untied embeddings: transformers' logits, and the same layers come back."""
    extra = {"model.n_layers": 4, "model.tie_embeddings": False, "moe.first_k_dense": 0}
    cfg, *_ = _ernie({**extra, "moe.moe_every": 2}, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["moe_layer_start_index"], saved["moe_layer_interval"]) == (0, 2)
    back = config_from_hf(saved)
    assert back.moe.moe_layers(4) == cfg.moe.moe_layers(4) == [1, 3]
    assert back.model == cfg.model


def test_ernie_released_config_imports() -> None:
    """ERNIE-4.5-21B-A3B's config.json as released (legacy rope_theta, no end index, keys
    transformers does not read): its routing, placement, RoPE and head."""
    from tests.helpers.hf_models import ERNIE_RELEASED_CONFIG

    cfg = config_from_hf(ERNIE_RELEASED_CONFIG)
    m, moe = cfg.model, cfg.moe
    assert (m.rope_theta, m.rope_interleave, m.tie_embeddings, m.qkv_bias) == (
        500000.0,
        True,
        True,
        False,
    )
    assert (m.head_dim, m.dense_hidden, m.norm_eps, m.rope_scaling) == (8, 40, 1e-5, "none")
    assert (moe.score_func, moe.renormalize, moe.renormalize_min) == ("softmax", True, 1e-12)
    assert (moe.num_experts, moe.top_k, moe.expert_hidden) == (4, 2, 24)
    assert (moe.num_shared_experts, moe.shared_hidden, moe.shared_expert_gate) == (2, 48, False)
    assert moe.moe_layers(3) == [1, 2]
    # start 1, every second layer: ERNIE counts (layer + 1) from 0 -> layers 1 and 3
    every2 = config_from_hf(
        {**ERNIE_RELEASED_CONFIG, "num_hidden_layers": 4, "moe_layer_interval": 2}
    )
    assert every2.moe.moe_layers(4) == [1, 3]


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"use_bias": True}, "use_bias"),
        ({"num_hidden_layers": 4, "moe_layer_end_index": 2}, "moe_layer_start_index"),
        ({"moe_norm_min": None}, "moe_norm_min"),
        (
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.5,
                }
            },
            "partial_rotary_factor",
        ),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ],
)
def test_ernie_configs_moetrain_cannot_compute_are_refused(changes, key) -> None:
    from tests.helpers.hf_models import ERNIE_RELEASED_CONFIG

    d = {
        k: v
        for k, v in ERNIE_RELEASED_CONFIG.items()
        if "rope" not in k or "rope_parameters" not in changes
    }
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_hf({**d, **changes})


def test_gpt_oss_released_config_imports() -> None:
    """gpt-oss-20b's config.json as released (legacy rope keys): every piece of its model."""
    from tests.helpers.hf_models import GPT_OSS_RELEASED_CONFIG

    cfg = config_from_hf(GPT_OSS_RELEASED_CONFIG)
    m, moe = cfg.model, cfg.moe
    assert (m.qkv_bias, m.o_bias, m.attention_sinks, m.sliding_window) == (True, True, True, 6)
    assert [m.attention_window(i) for i in range(3)] == [6, None, 6]
    assert (m.rope_scaling, m.rope_factor, m.rope_original_max_seq_len) == ("yarn", 32.0, 4096)
    assert (m.rope_beta_fast, m.rope_beta_slow, m.rope_truncate, m.rope_theta) == (
        32.0,
        1.0,
        False,
        150000.0,
    )
    assert (moe.topk_before_score, moe.router_bias, moe.expert_biases) == (True, True, True)
    assert (moe.activation, moe.swiglu_alpha, moe.swiglu_limit) == ("clamped_swiglu", 1.702, 7.0)
    assert (moe.num_experts, moe.top_k, moe.expert_hidden) == (4, 2, 24)
    assert choose_format(cfg) == "gpt_oss"


PHIMOE_PIECES = {
    "model.o_bias": {"model.o_bias": True},
    "model.lm_head_bias": {"model.lm_head_bias": True},
    "model.norm": {"model.norm": "layernorm"},
    "moe.router_type": {"moe.router_type": "sparsemixer", "moe.renormalize": False},
}


@pytest.mark.parametrize("setting", list(PHIMOE_PIECES))
def test_families_without_phimoes_pieces_refuse_them_by_key(setting: str) -> None:
    """An attention-output bias, an LM-head bias, LayerNorm or sparsemixer: every family but
    Phi-3.5-MoE names the setting (latent attention refuses model.o_bias itself)."""
    from moetrain.convert.formats import problems

    for fmt in FORMATS:
        mla = family(fmt).attention == "mla"
        if fmt == "phimoe" or (mla and setting == "model.o_bias"):
            continue
        shape = {f"model.{k}": v for k, v in MLA_SHAPE.items()} if mla else {}
        cfg = tiny_config(shape, PHIMOE_PIECES[setting])
        assert setting in [k for k, _ in problems(fmt, cfg.model, cfg.moe)], fmt


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"model.norm": "rmsnorm"}, "model.norm"),
        ({"moe.router_type": "topk", "moe.renormalize": True}, "moe.router_type"),
        ({"model.o_bias": False}, "model.o_bias"),
        ({"moe.num_shared_experts": 1}, "moe.num_shared_experts"),
        ({"moe.route_scale": 2.0}, "moe.route_scale"),
        ({"moe.capacity_factor": 1.0}, "moe.capacity_factor"),
    ],
)
def test_phimoe_refuses_what_its_class_does_not_compute_by_key(changes, key) -> None:
    cfg = tiny_cfg("phimoe", changes)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        choose_format(cfg, "phimoe")


def phimoe_released(**changes) -> dict:
    """Phi-3.5-MoE-instruct's config.json (its legacy rope_scaling and top-level rope_theta) at
    the tiny sizes, with ``changes``."""
    from tests.helpers.hf_models import PHIMOE_FLAGS, PHIMOE_ROPE

    rope = {k: v for k, v in PHIMOE_ROPE.items() if k not in ("rope_type", "rope_theta")}
    d = {
        "architectures": ["PhimoeForCausalLM"],
        "model_type": "phimoe",
        **{k: v for k, v in PHIMOE_FLAGS.items() if k != "rope_parameters"},
        "rope_scaling": {**rope, "type": "longrope"},
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 4096,
        "hidden_size": 32,
        "intermediate_size": 24,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 3,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 320,
        "rms_norm_eps": 1e-05,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "torch_dtype": "bfloat16",
    }
    return {**d, **changes}


def test_phimoe_released_config_imports() -> None:
    """Phi-3.5-MoE-instruct's flags: LayerNorm, all attention biases, a head bias, sparsemixer
    at its eps, LongRoPE with its mscale as the attention factor over the original 4096
    positions (sliding_window 131072 spans the whole context)."""
    cfg = config_from_hf(phimoe_released())
    m, moe = cfg.model, cfg.moe
    assert (m.norm, m.qkv_bias, m.o_bias, m.lm_head_bias) == ("layernorm", True, True, True)
    assert (m.rope_scaling, m.rope_original_max_seq_len, m.rope_positions) == (
        "longrope",
        4096,
        4096,
    )
    assert m.rope_attention_factor == 1.243163121016122 and len(m.rope_short_factor) == 4
    assert (moe.router_type, moe.router_jitter_eps, moe.renormalize) == ("sparsemixer", 0.01, False)
    assert choose_format(cfg) == "phimoe"
    hf = hf_config(cfg, "phimoe")
    assert (
        hf.rope_parameters["short_mscale"] == hf.rope_parameters["long_mscale"] == 1.243163121016122
    )
    assert (hf.attention_bias, hf.lm_head_bias, hf.router_jitter_noise) == (True, True, 0.01)


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"attention_dropout": 0.1}, "attention_dropout"),
        (
            {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
            "layer_types",
        ),
        ({"sliding_window": 64}, "model.sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config"),
    ],
)
def test_gpt_oss_configs_moetrain_cannot_compute_are_refused(changes, key) -> None:
    from tests.helpers.hf_models import GPT_OSS_RELEASED_CONFIG

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_hf({**GPT_OSS_RELEASED_CONFIG, **changes})


GPT_OSS_PIECES = {
    "model.o_bias": True,
    "model.attention_sinks": True,
    "model.sliding_window": 6,
    "moe.router_bias": True,
    "moe.expert_biases": True,
    "moe.activation": "clamped_swiglu",
}


@pytest.mark.parametrize("setting", list(GPT_OSS_PIECES))
def test_families_without_gpt_oss_pieces_refuse_them_by_key(setting: str) -> None:
    extra = {setting: GPT_OSS_PIECES[setting]}
    if setting == "moe.activation":
        extra |= {"moe.swiglu_alpha": 1.702, "moe.swiglu_limit": 7.0}
    for fmt in FORMATS:
        if fmt == "gpt_oss" or (setting == "model.o_bias" and family(fmt).o_bias):
            continue  # (Phi-3.5-MoE has an output-projection bias too)
        with pytest.raises(ConfigError, match=setting.replace(".", r"\.")):
            choose_format(tiny_cfg(fmt, extra), fmt)  # (latent attention: refused at validation)


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


def test_gpt_oss_clamps_and_sinks_where_they_bind_match_transformers(tmp_path) -> None:
    """A limit the tiny model's activations cross and large sinks: transformers' logits, and
    both change them (so the parity above is not blind to them)."""
    cfg = tiny_cfg("gpt_oss", {"moe.swiglu_limit": 0.05, "moe.swiglu_alpha": 3.0})
    model = model_for(cfg)
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.sinks.uniform_(1.0, 3.0)
    hf = load_hf(cfg, model, "gpt_oss", tmp_path)
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = hf(input_ids=ids).logits, model(ids).logits
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        loose = dataclasses.replace(cfg.moe, swiglu_limit=100.0)
        unclamped = Transformer(cfg.model, loose).eval()
        unclamped.load_state_dict(model.state_dict())
        assert (unclamped(ids).logits - got).abs().max() > 1e-3
        no_sinks = dataclasses.replace(cfg.model, attention_sinks=False)
        plain = Transformer(no_sinks, cfg.moe).eval()
        plain.load_state_dict(model.state_dict(), strict=False)
        assert (plain(ids).logits - got).abs().max() > 1e-3


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"num_experts_per_tok": 4}, "num_experts_per_tok"),
        ({"sliding_window": 2048}, "sliding_window"),
        (
            {"rope_scaling": {**phimoe_released()["rope_scaling"], "long_mscale": 1.5}},
            "rope_parameters.long_mscale",
        ),
        (
            {
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 4096,
                    "short_mscale": 1.0,
                    "long_mscale": 1.0,
                }
            },
            "rope_parameters.rope_type",
        ),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_phimoe_configs_moetrain_cannot_compute_are_refused(changes, key) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_hf(phimoe_released(**changes))


def test_phimoe_generation_matches_transformers(tmp_path) -> None:
    """Generation with the KV cache (one LongRoPE table, the short factors) gives
    transformers' greedy tokens and its logits at every step."""
    cfg = tiny_cfg("phimoe")
    model = model_for(cfg)
    generation_matches(model, load_hf(cfg, model, "phimoe", tmp_path), 12)


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


# Llama 4's pieces, off one at a time (the tiny case has them all binding in 19 tokens)
LLAMA4_OFF = {
    "chunks": {"model.attention_chunk_size": None, "model.layer_types": None},
    "nope": {
        "model.nope_layers": None,
        "model.attn_temperature_floor": None,
        "model.attn_temperature_scale": None,
    },
    "temperature": {"model.attn_temperature_floor": None, "model.attn_temperature_scale": None},
    "qk_norm": {"model.qk_norm_after_rope": False},
    "score_on_input": {"moe.score_on_input": False},
}


def test_llama4_pieces_each_bind_in_the_parity_case() -> None:
    """Each of Llama 4's pieces changes the tiny case's logits, so the parity test above
    (transformers' logits, 1e-5) checks every one of them."""
    cfg = tiny_cfg("llama4_text")
    model = model_for(cfg)
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(ids).logits
        for name, off in LLAMA4_OFF.items():
            other = tiny_cfg("llama4_text", off)
            plain = Transformer(other.model, other.moe).eval()
            plain.load_state_dict(model.state_dict())
            assert (plain(ids).logits - got).abs().max() > 1e-4, name  # (parity: 1e-5)


@pytest.mark.parametrize(
    "fmt_case",
    [
        "bias",
        pytest.param("tied", marks=pytest.mark.long),
        pytest.param("top1", marks=pytest.mark.long),
    ],
)
def test_llama4_variants_match_transformers_and_round_trip(tmp_path, fmt_case: str) -> None:
    """attention_bias (q/k/v/o biases), tied embeddings, top-1 routing with an explicit MoE
    placement past a dense first layer: transformers' logits, and the config comes back."""
    extra = {
        "bias": {"model.qkv_bias": True, "model.o_bias": True},
        "tied": {"model.tie_embeddings": True, "moe.moe_every": 1},
        "top1": {"moe.top_k": 1, "moe.first_k_dense": 1, "moe.moe_every": 1},
    }[fmt_case]
    cfg = tiny_cfg("llama4_text", extra)
    assert choose_format(cfg) == "llama4_text"
    model = sharpened(model_for(cfg))
    hf = load_hf(cfg, model, "llama4_text", tmp_path)
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids).logits, hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5
        )
    back = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert back.model == cfg.model
    assert back.moe.moe_layers(3) == cfg.moe.moe_layers(3)
    assert (back.moe.top_k, back.moe.score_on_input) == (cfg.moe.top_k, True)


def test_llama4_generation_matches_transformers(tmp_path) -> None:
    """Generation with the KV cache across chunk boundaries (chunks of 6; transformers keeps
    a chunk's worth of keys per chunked layer) with the NoPE layer's temperature at the cache's
    positions: transformers' greedy tokens and its logits at every step."""
    cfg = tiny_cfg("llama4_text")
    model = sharpened(model_for(cfg))
    generation_matches(model, load_hf(cfg, model, "llama4_text", tmp_path), 16)


def _llama4_released(name: str = "Llama-4-Scout-17B-16E", **changes) -> dict:
    from pathlib import Path

    path = Path(__file__).parents[1] / "fixtures" / "released_configs" / "llama4_text"
    return {**json.loads((path / f"{name}.json").read_text()), **changes}


def test_llama4_released_configs_import() -> None:
    """Scout's and Maverick's config.json flags (tests/fixtures/released_configs/llama4_text):
    every piece of their models."""
    scout = config_from_hf(_llama4_released())
    m, moe = scout.model, scout.moe
    assert (m.rope_interleave, m.qk_norm_after_rope, m.nope_layers) == (True, True, [3])
    assert (m.attention_chunk_size, m.layer_types) == (32, ["chunked_attention"] * 3 + [FULL])
    assert (m.attn_temperature_floor, m.attn_temperature_scale) == (32, 0.1)
    assert (m.rope_scaling, m.rope_factor, m.rope_original_max_seq_len) == ("llama3", 16.0, 16)
    assert (m.rope_low_freq_factor, m.rope_high_freq_factor, m.rope_theta) == (1.0, 1.0, 5e5)
    assert (m.head_dim, m.n_heads, m.n_kv_heads, m.dense_hidden) == (16, 5, 1, 64)
    assert (moe.score_func, moe.topk_before_score, moe.renormalize) == ("sigmoid", True, False)
    assert (moe.score_on_input, moe.num_shared_experts, moe.shared_hidden) == (True, 1, 32)
    assert (moe.num_experts, moe.top_k, moe.moe_layers(4)) == (4, 1, [0, 1, 2, 3])
    assert choose_format(scout) == "llama4_text"
    maverick = config_from_hf(_llama4_released("Llama-4-Maverick-17B-128E"))
    assert (maverick.model.qk_norm_after_rope, maverick.model.rope_scaling) == (False, "none")
    assert (maverick.moe.num_experts, maverick.moe.moe_layers(4)) == (8, [1, 3])
    assert (maverick.moe.first_k_dense, maverick.moe.moe_every) == (0, 2)
    # a chunk as long as the context is full attention; temperature tuning off, or no NoPE
    # layer, is none
    whole = config_from_hf(_llama4_released(attention_chunk_size=2048)).model
    assert (whole.attention_chunk_size, whole.layer_types) == (None, None)
    off = config_from_hf(_llama4_released(attn_temperature_tuning=False)).model
    assert (off.attn_temperature_floor, off.nope_layers) == (None, [3])
    all_rope = config_from_hf(_llama4_released(no_rope_layers=[1, 1, 1, 1])).model
    assert (all_rope.nope_layers, all_rope.attn_temperature_floor) == (None, None)


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"no_rope_layers": [1, 2, 1, 1]}, "no_rope_layers"),
        ({"no_rope_layers": [1, 0], "layer_types": ["full_attention"] * 4}, "no_rope_layers"),
        ({"layer_types": ["sliding_attention"] * 4}, "layer_types"),
        (
            {"layer_types": ["chunked_attention"] * 4, "attention_chunk_size": None},
            "attention_chunk_size",
        ),
        ({"moe_layers": [0, 2, 3]}, "moe_layers/interleave_moe_layer_step"),
        ({"moe_layers": [1, 5]}, "moe_layers"),
        ({"floor_scale": 0}, "floor_scale"),
        ({"attn_scale": -0.1}, "attn_scale"),
        (
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            "rope_parameters.rope_type",
        ),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"quantization_config": {"quant_method": "fbgemm_fp8"}}, "quantization_config"),
    ],
)
def test_llama4_configs_moetrain_cannot_compute_are_refused(changes, key) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_hf(_llama4_released(**changes))


LLAMA4_PIECES = {
    "model.nope_layers": {"model.nope_layers": [1]},
    "model.attention_chunk_size": {"model.attention_chunk_size": 6},
    "model.qk_norm_after_rope": {"model.qk_norm_after_rope": True},
    "model.attn_temperature_floor": {
        "model.nope_layers": [1],
        "model.attn_temperature_floor": 4,
        "model.attn_temperature_scale": 0.1,
    },
    "moe.score_on_input": {"moe.score_on_input": True},
}


@pytest.mark.parametrize("setting", list(LLAMA4_PIECES))
def test_families_without_llama4s_pieces_refuse_them_by_key(setting: str) -> None:
    """NoPE layers and their temperature, chunked attention, the post-RoPE norm and the
    weights on the experts' inputs: every family but Llama 4 names the setting (latent
    attention refuses the attention ones itself: test_attention_options.py)."""
    from moetrain.convert.formats import problems

    for fmt in FORMATS:
        mla = family(fmt).attention == "mla"
        if fmt == "llama4_text" or (mla and setting.startswith("model.")):
            continue
        shape = {f"model.{k}": v for k, v in MLA_SHAPE.items()} if mla else {}
        cfg = tiny_config(shape, LLAMA4_PIECES[setting])
        assert setting in [k for k, _ in problems(fmt, cfg.model, cfg.moe)], fmt


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
