"""Manifold-constrained hyper-connections (``model.hc_streams``) against a written-out reference
and transformers' DeepSeek-V4 modules (values and gradients), and in the model: the streams'
parameters counted, initialised and trained, the plain residual untouched at one stream."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import ConfigError
from moetrain.model.hyper_connection_ops import mixing_matrix
from moetrain.model.hyper_connections import HyperConnection, HyperHead
from moetrain.model.transformer import Transformer
from moetrain.model_numbers import model_numbers
from tests.helpers.configs import tiny_config
from tests.helpers.random_constants import randomise_constants

B, S, N, D, ITERS, EPS, NORM_EPS = 2, 5, 4, 8, 20, 1e-6, 1e-6


def make(seed: int = 0) -> HyperConnection:
    torch.manual_seed(seed)
    hc = HyperConnection(D, N, ITERS, EPS, NORM_EPS)
    hc.reset_parameters(0.5)
    randomise_constants(hc, seed=seed)  # base, scale: no constant left
    return hc


def reference(streams, y, fn, base, scale, iters):  # noqa: ANN001, ANN201
    """mHC written out token by token in float64: the coefficients of the RMS-normalised
    concatenation, sigmoid pre / 2 sigmoid post, Sinkhorn-Knopp on softmax(comb) + eps, then
    the branch on the collapse and the mixed streams."""
    streams, y = streams.double(), y.double()
    fn, base, scale = fn.double(), base.double(), scale.double()
    out, collapsed = torch.empty_like(streams), torch.empty(B, S, D, dtype=torch.float64)
    for b in range(B):
        for s in range(S):
            x = streams[b, s].reshape(-1)
            x = x / torch.sqrt((x * x).mean() + NORM_EPS)
            c = fn @ x
            pre = 1 / (1 + torch.exp(-(c[:N] * scale[0] + base[:N]))) + EPS
            post = 2 / (1 + torch.exp(-(c[N : 2 * N] * scale[1] + base[N : 2 * N])))
            logits = (c[2 * N :] * scale[2] + base[2 * N :]).reshape(N, N)
            m = torch.exp(logits - logits.max(1, keepdim=True).values)
            m = m / m.sum(1, keepdim=True) + EPS
            m = m / (m.sum(0) + EPS)
            for _ in range(iters - 1):
                m = m / (m.sum(1, keepdim=True) + EPS)
                m = m / (m.sum(0) + EPS)
            collapsed[b, s] = (pre[:, None] * streams[b, s]).sum(0)
            for k in range(N):
                carried = sum(m[j, k] * streams[b, s, j] for j in range(N))
                out[b, s, k] = carried + post[k] * y[b, s]
    return collapsed, out


def test_matches_written_out_reference_values_and_gradients() -> None:
    hc = make()
    torch.manual_seed(1)
    streams = torch.randn(B, S, N, D, requires_grad=True)
    y = torch.randn(B, S, D, requires_grad=True)
    collapsed, state = hc(streams)
    out = hc.mix(streams, y * collapsed.tanh(), state)  # a branch that reads the collapse
    leaves = [
        t.detach().clone().requires_grad_(True) for t in (streams, y, hc.fn, hc.base, hc.scale)
    ]
    ref_in, _ = reference(*leaves[:2], *leaves[2:], ITERS)
    _, ref_out = reference(leaves[0], leaves[1].double() * ref_in.tanh(), *leaves[2:], ITERS)
    torch.testing.assert_close(collapsed, ref_in.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, ref_out.float(), rtol=1e-5, atol=1e-6)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (ref_out * g.double()).sum().backward()
    ours = [streams.grad, y.grad, hc.fn.grad, hc.base.grad, hc.scale.grad]
    for got, leaf in zip(ours, leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad.float(), rtol=1e-4, atol=1e-6)
    # negative controls: the mixing matrix untransposed, or one Sinkhorn iteration fewer,
    # miss the tolerance
    post, comb = state
    wrong = post.unsqueeze(-1) * (y * collapsed.tanh()).unsqueeze(-2) + comb @ streams
    assert not torch.allclose(wrong, ref_out.float(), rtol=1e-5, atol=1e-6)
    _, short = reference(*[t.detach() for t in leaves[:2]], *[t.detach() for t in leaves[2:]], 2)
    _, full = reference(*[t.detach() for t in leaves[:2]], *[t.detach() for t in leaves[2:]], 3)
    assert not torch.allclose(short.float(), full.float(), rtol=1e-5, atol=1e-6)


def test_mixing_matrix_hands_the_mix_one_contiguous_matrix_per_token() -> None:
    """The mix's batched (N, N) products read it per token: strided matrices make torch's CPU
    batched matmul copy each token's on its own (1.2-1.8x the mix's time)."""
    comb = mixing_matrix(torch.randn(B * S, N, N), ITERS, EPS)
    assert comb.shape == (B * S, N, N) and comb.is_contiguous()
    torch.testing.assert_close(comb.sum(-2), torch.ones(B * S, N))  # columns, normalised last


def test_matches_transformers_modules() -> None:
    """DeepseekV4HyperConnection / DeepseekV4HyperHead and the decoder layer's mixing rule, on
    the same (randomised) parameters."""
    v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from transformers import DeepseekV4Config

    cfg = DeepseekV4Config(
        hidden_size=D, hc_mult=N, hc_sinkhorn_iters=ITERS, hc_eps=EPS, rms_norm_eps=NORM_EPS,
        num_hidden_layers=1,
    )  # fmt: skip
    ours, theirs = make(3), v4.DeepseekV4HyperConnection(cfg)
    theirs.load_state_dict({"fn": ours.fn, "base": ours.base, "scale": ours.scale})
    torch.manual_seed(4)
    streams, y = torch.randn(B, S, N, D), torch.randn(B, S, D)
    collapsed, state = ours(streams)
    post, comb, hf_collapsed = theirs(streams)
    # atol 1e-6, a few fp32 ulps of the O(1) entries: the RMS factor rounds once after the
    # product with fn (theirs: per entry of the normalised copy) and the sums run in the
    # batched products' order (at most 1.4e-6 apart over 20 seeds)
    torch.testing.assert_close(collapsed, hf_collapsed, rtol=1e-6, atol=1e-6)
    want = post.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
    torch.testing.assert_close(ours.mix(streams, y, state), want, rtol=1e-6, atol=1e-6)

    torch.manual_seed(5)
    head, hf_head = HyperHead(D, N, EPS, NORM_EPS), v4.DeepseekV4HyperHead(cfg)
    head.reset_parameters(0.5)
    randomise_constants(head, seed=5)
    hf_head.load_state_dict({"hc_fn": head.fn, "hc_base": head.base, "hc_scale": head.scale})
    torch.testing.assert_close(head(streams), hf_head(streams), rtol=1e-6, atol=1e-6)


def test_in_the_model() -> None:
    """Parameters where CONTRACTS says, counted by model_numbers, initialised as transformers
    does, trained; hc_streams=1 builds the plain model (same parameters, same output)."""
    cfg = tiny_config(model__hc_streams=N)
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe)
    names = dict(model.named_parameters())
    assert names["layers.1.attn_hc.fn"].shape == ((2 + N) * N, N * cfg.model.d_model)
    assert names["layers.0.ffn_hc.scale"].tolist() == [1.0, 1.0, 1.0]
    assert names["hc_head.base"].abs().sum() == 0
    assert model_numbers(cfg).total_params == sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, cfg.model.vocab_size, (2, 8))
    out = model(ids, labels_BS=ids)
    out.loss.backward()
    for name in ("layers.0.attn_hc.fn", "layers.1.ffn_hc.base", "hc_head.fn", "hc_head.scale"):
        assert names[name].grad.abs().sum() > 0, name
    plain_cfg = tiny_config()
    torch.manual_seed(0)
    plain = Transformer(plain_cfg.model, plain_cfg.moe)
    assert not any("hc" in n for n, _ in plain.named_parameters())
    assert model_numbers(plain_cfg).total_params == sum(p.numel() for p in plain.parameters())


def test_refused_with_multi_token_prediction() -> None:
    with pytest.raises(ConfigError, match=r"model\.hc_streams"):
        tiny_config(model__hc_streams=2, model__mtp_depth=1)
    with pytest.raises(ConfigError, match=r"model\.hc_streams"):
        tiny_config(model__hc_streams=0)


def test_bf16_keeps_the_table_and_mixes_in_fp32() -> None:
    """Cast to bf16 (as the bf16 engine casts the model): the hash table stays int64, the
    streams stay bf16 and the coefficients are computed in fp32."""
    cfg = tiny_config(model__hc_streams=N, moe__hash_layers=[0], moe__score_func="sqrtsoftplus")
    torch.manual_seed(0)
    low = Transformer(cfg.model, cfg.moe).to(torch.bfloat16)
    assert low.layers[0].ffn.router.token_experts.dtype == torch.int64
    x = torch.randn(1, 4, N, cfg.model.d_model, dtype=torch.bfloat16)
    h, (post, comb) = low.layers[0].attn_hc(x)
    assert h.dtype == torch.bfloat16 and post.dtype == comb.dtype == torch.float32
    mixed = low.layers[0].attn_hc.mix(x, h, (post, comb))
    assert mixed.dtype == torch.bfloat16
    assert low.hc_head(mixed).dtype == torch.bfloat16


@pytest.mark.long
def test_bf16_model_is_close_to_fp32() -> None:
    cfg = tiny_config(model__hc_streams=N, moe__hash_layers=[0], moe__score_func="sqrtsoftplus")
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe)
    ids = torch.randint(0, cfg.model.vocab_size, (1, 4))
    want = model(ids).logits
    got = model.to(torch.bfloat16)(ids).logits
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.1, atol=0.05)
