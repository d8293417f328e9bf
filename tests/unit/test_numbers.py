"""Derived numbers (print-config, MFU, planner) agree with the model that is actually built."""

import pytest

from moetrain.config import load_config
from moetrain.model.transformer import Transformer
from moetrain.model_numbers import model_numbers
from tests.helpers.configs import tiny_config


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model.tie_embeddings=true", "moe.first_k_dense=1", "moe.moe_every=2"],
        ["moe.num_shared_experts=2", "moe.shared_expert_gate=true", "model.qk_norm=true"],
        ["model.head_dim=16", "model.n_kv_heads=1", "moe.top_k=1"],
        ["model.mtp_depth=2", "moe.first_k_dense=1"],
        ["model.norm=layernorm", "model.o_bias=true", "model.lm_head_bias=true"],
        ["model.norm=layernorm", "model.mtp_depth=2", "model.lm_head_bias=true"],
        ["model.tie_embeddings=true", "model.lm_head_bias=true", "model.qkv_bias=true"],
    ],
)
def test_parameter_counts_match_the_model(overrides):
    cfg = load_config(
        None, ["model.vocab_size=512", "model.d_model=64", "model.n_layers=4"] + overrides
    )
    model = Transformer(cfg.model, cfg.moe)
    n = model_numbers(cfg)
    assert n.total_params == sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert n.expert_params == expert
    e = cfg.moe
    unused_experts = n.num_moe_layers * (e.num_experts - e.top_k) * 3 * 64 * e.expert_hidden
    assert n.active_params == n.total_params - unused_experts
    layer = {name: name.split(".")[1] for name, _ in model.named_parameters()}
    mtp = sum(p.numel() for name, p in model.named_parameters() if layer[name] in ("4", "5"))
    assert n.mtp_params == mtp


def test_flops_per_token_by_hand():
    shape = (
        "model.vocab_size=1000",
        "model.d_model=64",
        "model.dense_hidden=128",
        "moe.expert_hidden=32",
        "moe.first_k_dense=1",
        "data.seq_len=100",
        "model.max_seq_len=100",
    )
    cfg = tiny_config(*shape)
    attn = 64 * 64 * 2 + 64 * 32 * 2  # q, o: 64x64; k, v: 64x32 (2 kv heads x 16)
    dense = 3 * 64 * 128
    moe_active = 64 * 4 + 2 * 3 * 64 * 32
    matmul = 2 * attn + dense + moe_active + 1000 * 64
    expected = 6 * matmul + 12 * 2 * 4 * 16 * 100
    assert model_numbers(cfg).flops_per_token == expected
    # one MTP module: one more (MoE) block, eh_proj (2D -> D), its LM-head matmul, its attention
    mtp = tiny_config(*shape, model__mtp_depth=1)
    extra = 6 * (attn + moe_active + 2 * 64 * 64 + 1000 * 64) + 12 * 1 * 4 * 16 * 100
    assert model_numbers(mtp).flops_per_token == expected + extra
