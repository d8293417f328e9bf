"""DeepSeek-V4's attention (``model/compressed_attention.py``) against transformers'
``DeepseekV4Attention`` for each layer kind (sliding window; heavily compressed; compressed
sparse with its indexer), values and gradients, on the same random weights (no constant left)."""

from __future__ import annotations

import pytest
import torch

from moetrain.model import compressed_attention, compressed_kernel
from moetrain.model.compressed_attention import (
    CompressedAttention,
    CompressedAttentionShape,
    pair_rope_rows,
    rotate_pairs,
    unit_rms,
)

v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

D, H, K, R, QL, G, OL, WIN, S = 32, 4, 16, 8, 12, 2, 6, 5, 21
RATES = {"csa": 4, "hca": 8}
HF_KIND = {
    "sliding": "sliding_attention",
    "csa": "compressed_sparse_attention",
    "hca": "heavily_compressed_attention",
}
THETA = {"sliding": 10000.0, "csa": 160000.0, "hca": 160000.0}
# ours -> transformers' (relative to the attention module)
NAMES = {
    "wq_a.weight": "q_a_proj.weight",
    "q_norm.weight": "q_a_norm.weight",
    "wq_b.weight": "q_b_proj.weight",
    "wkv.weight": "kv_proj.weight",
    "kv_norm.weight": "kv_norm.weight",
    "wo_a": "o_a_proj.weight",
    "wo.weight": "o_b_proj.weight",
    "sinks": "sinks",
    "compressor.wkv.weight": "compressor.kv_proj.weight",
    "compressor.wgate.weight": "compressor.gate_proj.weight",
    "compressor.position_bias": "compressor.position_bias",
    "compressor.kv_norm.weight": "compressor.kv_norm.weight",
    "indexer.compressor.wkv.weight": "compressor.indexer.kv_proj.weight",
    "indexer.compressor.wgate.weight": "compressor.indexer.gate_proj.weight",
    "indexer.compressor.position_bias": "compressor.indexer.position_bias",
    "indexer.compressor.kv_norm.weight": "compressor.indexer.kv_norm.weight",
    "indexer.wq_b.weight": "compressor.indexer.q_b_proj.weight",
    "indexer.weights_proj.weight": "compressor.indexer.scorer.weights_proj.weight",
}


def hf_config(topk: int):  # noqa: ANN201
    from transformers import DeepseekV4Config

    cfg = DeepseekV4Config(
        vocab_size=50, hidden_size=D, num_attention_heads=H, head_dim=K,
        partial_rotary_factor=R / K, q_lora_rank=QL, o_groups=G, o_lora_rank=OL,
        sliding_window=WIN, compress_rates={
            "compressed_sparse_attention": RATES["csa"],
            "heavily_compressed_attention": RATES["hca"],
        },
        index_n_heads=3, index_head_dim=8, index_topk=topk, num_hidden_layers=3,
        layer_types=list(HF_KIND.values()), rope_theta=THETA["sliding"],
        compress_rope_theta=THETA["csa"],
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return cfg


def build(kind: str, topk: int) -> tuple[CompressedAttention, torch.nn.Module, object]:
    cfg = hf_config(topk)
    theirs = v4.DeepseekV4Attention(cfg, list(HF_KIND).index(kind))
    shape = CompressedAttentionShape(
        D, H, K, R, QL, G, OL, WIN, kind, RATES.get(kind, 4), 3, 8, topk, cfg.rms_norm_eps
    )
    ours = CompressedAttention(shape)
    gen = torch.Generator().manual_seed(list(HF_KIND).index(kind))
    hf_params = dict(theirs.named_parameters())
    assert set(hf_params) == {NAMES[n] for n, _ in ours.named_parameters()}
    with torch.no_grad():
        for name, p in ours.named_parameters():
            value = torch.randn(p.shape, generator=gen) * 0.3
            if name.endswith("norm.weight"):
                value = 1 + value
            p.copy_(value)
            hf_params[NAMES[name]].copy_(value)
    return ours, theirs, cfg


@pytest.mark.parametrize(
    ("kind", "topk", "block"), [("sliding", 2, 4), ("hca", 2, 4), ("csa", 2, 64), ("csa", 9, 4)]
)
def test_matches_transformers_values_and_gradients(
    kind: str, topk: int, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(block: queries per block of the attention and the indexer; 4 splits the 21 positions
    into 6 blocks, the last one short)"""
    from transformers.masking_utils import create_sliding_window_causal_mask

    monkeypatch.setattr(compressed_kernel, "BLOCK", block)
    monkeypatch.setattr(compressed_attention, "INDEX_SCORES", 1)  # (the indexer's blocks too)

    ours, theirs, cfg = build(kind, topk)
    torch.manual_seed(7)
    x = torch.randn(2, S, D, requires_grad=True)
    x_hf = x.detach().clone().requires_grad_(True)
    cos, sin = pair_rope_rows(S, R, THETA[kind])
    position_ids = torch.arange(S)[None]
    rotary = v4.DeepseekV4RotaryEmbedding(cfg)
    embeddings = {t: rotary(x_hf, position_ids, layer_type=t) for t in ("main", "compress")}
    torch.testing.assert_close(embeddings[theirs.rope_layer_type][0][0], cos)
    mask = create_sliding_window_causal_mask(cfg, x_hf, None, None, position_ids)
    want, _ = theirs(x_hf, embeddings, position_ids, mask)
    got = ours(x, cos, sin)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(got)
    (got * g).sum().backward()
    (want * g).sum().backward()
    torch.testing.assert_close(x.grad, x_hf.grad, rtol=1e-4, atol=1e-6)
    hf_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        theirs_grad = hf_params[NAMES[name]].grad
        if name.startswith("indexer."):  # (the selection carries no gradient, in either)
            assert p.grad is None and theirs_grad is None
            continue
        # (atol relative to the gradient's scale: the attention's written backward sums in
        # another order than autograd through transformers' eager softmax)
        scale = theirs_grad.abs().max().item()
        torch.testing.assert_close(p.grad, theirs_grad, rtol=1e-4, atol=1e-6 * scale, msg=name)


def test_negative_controls() -> None:
    """The tolerance catches a wider window, a selection that keeps too few entries and a
    compressor without the overlapping series."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    ours, theirs, cfg = build("csa", 9)
    x = torch.randn(2, S, D)
    cos, sin = pair_rope_rows(S, R, THETA["csa"])
    position_ids = torch.arange(S)[None]
    rotary = v4.DeepseekV4RotaryEmbedding(cfg)
    embeddings = {t: rotary(x, position_ids, layer_type=t) for t in ("main", "compress")}
    mask = create_sliding_window_causal_mask(cfg, x, None, None, position_ids)
    with torch.no_grad():
        want, _ = theirs(x, embeddings, position_ids, mask)
        wider = CompressedAttention(
            CompressedAttentionShape(**{**vars(ours.shape), "window": WIN + 1})
        )
        wider.load_state_dict(ours.state_dict())
        assert not torch.allclose(wider(x, cos, sin), want, rtol=1e-5, atol=1e-6)
        ours.indexer.topk = 2  # (this case keeps all of them)
        assert not torch.allclose(ours(x, cos, sin), want, rtol=1e-5, atol=1e-6)
        ours.indexer.topk = 9
        torch.testing.assert_close(ours(x, cos, sin), want, rtol=1e-5, atol=1e-6)
        ours.compressor.overlap = False
        ours.compressor.wkv.weight.data = ours.compressor.wkv.weight[K:]
        ours.compressor.wgate.weight.data = ours.compressor.wgate.weight[K:]
        ours.compressor.position_bias.data = ours.compressor.position_bias[:, K:]
        assert not torch.allclose(ours(x, cos, sin), want, rtol=1e-5, atol=1e-6)


def test_rotate_pairs_turns_adjacent_pairs_of_the_trailing_slice() -> None:
    x = torch.tensor([[5.0, 1.0, 0.0, 0.0, 1.0]])  # nope channel 5, pairs (1, 0), (0, 1)
    cos, sin = torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 0.0]])  # 90 degrees, 0 degrees
    torch.testing.assert_close(rotate_pairs(x, cos, sin), torch.tensor([[5.0, 0.0, 1.0, 0.0, 1.0]]))


@pytest.mark.parametrize("yarn", [False, True], ids=["default", "yarn"])
def test_rope_rows_match_transformers(yarn: bool) -> None:
    """The compressed layers' RoPE rows (YaRN with attention factor 1, as DeepSeek-V4 forces)
    and the sliding layers' plain ones, against DeepseekV4RotaryEmbedding."""
    from transformers import DeepseekV4Config

    scaling = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 8}
    cfg = DeepseekV4Config(
        hidden_size=D, num_attention_heads=H, head_dim=K, partial_rotary_factor=R / K,
        num_hidden_layers=1, rope_parameters=scaling if yarn else None,
        compress_rope_theta=THETA["csa"],
    )  # fmt: skip
    rotary = v4.DeepseekV4RotaryEmbedding(cfg)
    x, position_ids = torch.zeros(1, S, D), torch.arange(S)[None]
    yarn_args = (16.0, 8, 32.0, 1.0) if yarn else None
    cos, sin = pair_rope_rows(S, R, THETA["csa"], yarn_args)
    want_cos, want_sin = rotary(x, position_ids, layer_type="compress")
    torch.testing.assert_close(cos, want_cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, want_sin[0], rtol=1e-6, atol=1e-6)
    cos, sin = pair_rope_rows(S, R, THETA["sliding"])
    want_cos, want_sin = rotary(x, position_ids, layer_type="main")
    torch.testing.assert_close(cos, want_cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, want_sin[0], rtol=1e-6, atol=1e-6)
    if yarn:  # negative control: the unscaled frequencies are another table
        plain_cos, _ = pair_rope_rows(S, R, THETA["csa"])
        assert not torch.allclose(plain_cos, want_cos[0], rtol=1e-6, atol=1e-6)


def test_unit_rms_backward_is_the_formulas_gradient() -> None:
    """The written backward against autograd through the fp64 formula (a wrong sign or a
    missing mean term would be far off)."""
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(2)) * 4
    g = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(3))
    x32, x64 = x.clone().requires_grad_(True), x.double().requires_grad_(True)
    y = unit_rms(x32, 1e-6)
    want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6)
    y.backward(g)
    want.backward(g.double())
    torch.testing.assert_close(x32.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)
