"""A whole DeepSeek-V4 decoder layer from moetrain's pieces, against transformers'
``DeepseekV4DecoderLayer`` on the same random weights (no constant left): hyper-connections
around the attention (sliding, or compressed sparse) and the MoE (hash-routed, or top-k of
sqrt(softplus) scores with the selection bias; clamped SwiGLU experts and shared expert).
Values and gradients. The weight names here are the ones a DeepSeek-V4 adapter maps."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import MoEConfig
from moetrain.model.compressed_attention import (
    CompressedAttention,
    CompressedAttentionShape,
    pair_rope_rows,
)
from moetrain.model.hyper_connections import HyperConnection
from moetrain.model.layers import RMSNorm
from moetrain.model.moe.layer import MoELayer
from tests.unit.test_compressed_attention import NAMES as ATTN_NAMES

v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

V, D, H, K, R, N, E, TOP, F, LIMIT, S = 40, 32, 4, 16, 8, 2, 8, 2, 12, 0.5, 13
KINDS = ("sliding", "csa")
THETA = {"sliding": 10000.0, "csa": 160000.0}


def hf_layer(index: int):  # noqa: ANN201
    from transformers import DeepseekV4Config

    cfg = DeepseekV4Config(
        vocab_size=V, hidden_size=D, num_attention_heads=H, head_dim=K, partial_rotary_factor=R / K,
        q_lora_rank=12, o_groups=2, o_lora_rank=6, sliding_window=5,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        index_n_heads=3, index_head_dim=8, index_topk=2, num_hidden_layers=2,
        layer_types=["sliding_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe"], hc_mult=N, hc_sinkhorn_iters=7,
        n_routed_experts=E, num_experts_per_tok=TOP, moe_intermediate_size=F, n_shared_experts=1,
        routed_scaling_factor=1.5, swiglu_limit=LIMIT, compress_rope_theta=THETA["csa"],
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return v4.DeepseekV4DecoderLayer(cfg, index), cfg


def our_layer(index: int, cfg) -> torch.nn.ModuleDict:  # noqa: ANN001
    kind = KINDS[index]
    eps = cfg.rms_norm_eps
    shape = CompressedAttentionShape(D, H, K, R, 12, 2, 6, 5, kind, 4, 3, 8, 2, eps)
    moe = MoEConfig(
        num_experts=E, top_k=TOP, expert_hidden=F, score_func="sqrtsoftplus",
        hash_layers=[0], route_scale=1.5, num_shared_experts=1, shared_expert_hidden=F,
        activation="clamped_swiglu", swiglu_alpha=1.0, swiglu_limit=LIMIT, swiglu_up_offset=0.0,
    )  # fmt: skip
    return torch.nn.ModuleDict(
        {
            "attn_hc": HyperConnection(D, N, 7, cfg.hc_eps, eps),
            "attn_norm": RMSNorm(D, eps),
            "attn": CompressedAttention(shape),
            "ffn_hc": HyperConnection(D, N, 7, cfg.hc_eps, eps),
            "ffn_norm": RMSNorm(D, eps),
            "ffn": MoELayer(moe, D, layer=index, vocab_size=V, shared_activation="clamped_swiglu"),
        }
    )


def names(index: int) -> dict[str, str]:
    """ours -> transformers' (in the decoder layer); the experts' stacks transposed."""
    out = {f"attn.{k}": f"self_attn.{v}" for k, v in ATTN_NAMES.items()}
    for hc in ("attn_hc", "ffn_hc"):
        out.update({f"{hc}.{p}": f"{hc}.{p}" for p in ("fn", "base", "scale")})
    out.update(
        {
            "attn_norm.weight": "input_layernorm.weight",
            "ffn_norm.weight": "post_attention_layernorm.weight",
            "ffn.router.gate.weight": "mlp.gate.weight",
            "ffn.experts.w13": "mlp.experts.gate_up_proj",
            "ffn.experts.w2": "mlp.experts.down_proj",
            "ffn.shared_expert.w1.weight": "mlp.shared_experts.gate_proj.weight",
            "ffn.shared_expert.w3.weight": "mlp.shared_experts.up_proj.weight",
            "ffn.shared_expert.w2.weight": "mlp.shared_experts.down_proj.weight",
        }
    )
    if index == 0:
        out["ffn.router.token_experts"] = "mlp.gate.tid2eid"
    else:
        out["ffn.router.expert_bias"] = "mlp.gate.e_score_correction_bias"
    return out


def forward(ours: torch.nn.ModuleDict, x, ids, cos, sin, attn_grad=None):  # noqa: ANN001, ANN201
    """The block's order as moetrain's Block runs it with hyper-connections; ``attn_grad``
    (the negative controls): a hook that changes the gradient of the attention's output."""
    h, state = ours["attn_hc"](x)
    y = ours["attn"](ours["attn_norm"](h), cos, sin)
    if attn_grad is not None:
        y.register_hook(attn_grad)
    x = ours["attn_hc"].mix(x, y, state)
    h, state = ours["ffn_hc"](x)
    y, _ = ours["ffn"](ours["ffn_norm"](h), token_ids_BS=ids)
    return ours["ffn_hc"].mix(x, y, state)


@pytest.mark.parametrize(
    "index", [0, pytest.param(1, marks=pytest.mark.long)], ids=["sliding-hash", "csa-topk"]
)
def test_decoder_layer_matches_transformers(index: int) -> None:
    assert gradients_off(index) == []


# The negative controls: gradient-only bugs in one piece (the attention's written backward),
# whose parameter gradients the comparison at ``atol 1e-6 x`` the gradient's largest value must
# catch: every gradient through the attention off by 5e-4 (a rescaling a backward forgot, at
# 5x the rtol), and (-m long) one query's gradient lost (one position's row of the output's
# gradient zeroed: a block of the written backward skipped). The input's gradient (compared
# first, at a fixed atol) is left out: the parameters' own tolerance is what is shown.
BUGS = {
    "rescaled": lambda g: g * (1 + 5e-4),
    "one-query": lambda g: g.index_fill(1, torch.tensor([S // 2]), 0.0),
}


@pytest.mark.parametrize("bug", ["rescaled", pytest.param("one-query", marks=pytest.mark.long)])
def test_the_gradient_tolerance_catches_a_backward_bug(bug: str) -> None:
    off = gradients_off(0, attn_grad=BUGS[bug], check_input=False)
    # the attention's projections and the hyper-connection that reads its output
    assert {"attn.wq_a.weight", "attn.wo.weight", "attn_hc.fn"} <= set(off), off


def gradients_off(index: int, attn_grad=None, check_input: bool = True) -> list[str]:  # noqa: ANN001
    """Layer ``index``'s values and the input's gradient against transformers' (asserted; the
    input's with ``check_input``), and the names of the parameters whose gradients are not
    within the tolerance (``attn_grad``: :func:`forward`'s)."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    theirs, cfg = hf_layer(index)
    theirs.mlp.experts.num_experts = E
    ours = our_layer(index, cfg)
    gen = torch.Generator().manual_seed(index)
    hf = dict(theirs.named_parameters()) | dict(theirs.named_buffers())
    mine = dict(ours.named_parameters()) | dict(ours.named_buffers())
    table = {k: v for k, v in names(index).items() if k in mine}
    assert {n for n in hf if "rotary_emb" not in n} == set(table.values())
    # (a hash-routed layer's selection bias is unused: transformers' hash router has none)
    unmapped = {"ffn.router.step_counts_E"} | ({"ffn.router.expert_bias"} if index == 0 else set())
    assert set(mine) - unmapped == set(table)
    with torch.no_grad():
        for name, theirs_name in table.items():
            t = mine[name]
            if t.dtype == torch.int64:  # the hash table: k distinct experts per token id
                t.copy_(torch.rand(V, E, generator=gen).topk(TOP, -1).indices)
            else:
                t.copy_(torch.randn(t.shape, generator=gen) * 0.3 + name.endswith("norm.weight"))
            value = t.transpose(1, 2) if name.startswith("ffn.experts.") else t
            hf[theirs_name].copy_(value)
    torch.manual_seed(3)
    x = torch.randn(2, S, N, D, requires_grad=True)
    x_hf = x.detach().clone().requires_grad_(True)
    ids = torch.randint(0, V, (2, S))
    position_ids = torch.arange(S)[None]
    rotary = v4.DeepseekV4RotaryEmbedding(cfg)
    embeddings = {t: rotary(x_hf, position_ids, layer_type=t) for t in ("main", "compress")}
    mask = create_sliding_window_causal_mask(cfg, x_hf[:, :, 0], None, None, position_ids)
    want = theirs(
        x_hf, input_ids=ids, position_embeddings=embeddings, position_ids=position_ids,
        attention_mask=mask,
    )  # fmt: skip
    cos, sin = pair_rope_rows(S, R, THETA[KINDS[index]])
    got = forward(ours, x, ids, cos, sin, attn_grad)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(got)
    (got * g).sum().backward()
    (want * g).sum().backward()
    if check_input:
        # atol relative to the gradient's scale: its largest entries reach ~16, where one fp32
        # ulp is 1.9e-6 (the streams' written-out products sum in another order than autograd's)
        scale = float(x_hf.grad.abs().max())
        torch.testing.assert_close(x.grad, x_hf.grad, rtol=1e-4, atol=1e-6 * scale)
    off = []
    for name, p in ours.named_parameters():
        theirs_grad = hf[table[name]].grad
        if p.grad is None or name.startswith("attn.indexer."):
            assert theirs_grad is None or not theirs_grad.any(), name
            continue
        grad = theirs_grad.transpose(1, 2) if name.startswith("ffn.experts.") else theirs_grad
        # (atol relative to the gradient's scale: the attention's written backward sums in
        # another order than autograd through transformers' eager softmax)
        scale = grad.abs().max().item()
        if not torch.allclose(p.grad, grad, rtol=1e-4, atol=1e-6 * scale):
            off.append(name)
    return off
