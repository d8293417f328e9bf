"""Transformer: causality, attention against a hand-written reference, document mask, init,
MoE placement, losses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moetrain.config import Config, ModelConfig, MoEConfig
from moetrain.config.layer_plan import MixerSpec
from moetrain.model import Transformer
from moetrain.model.attention import rope_tables
from moetrain.model.layers import SwiGLU
from moetrain.model.mixers import MixerInputs
from moetrain.model.mixers.gqa import Attention
from moetrain.model.moe.layer import MoELayer
from moetrain.model.rope import apply_rope
from moetrain.model_numbers import model_numbers
from tests.helpers.configs import tiny_config


def tiny(**kw) -> tuple[ModelConfig, MoEConfig]:
    """The tiny model with 50 tokens; ``kw``: ModelConfig or MoEConfig fields."""
    section = {k: "model" if k in ModelConfig.__dataclass_fields__ else "moe" for k in kw}
    cfg = tiny_config(model__vocab_size=50, **{f"{section[k]}.{k}": v for k, v in kw.items()})
    return cfg.model, cfg.moe


def build(seed: int = 0, **kw) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(*tiny(**kw)).eval()


def reference_attention(attn: Attention, x_BSD: torch.Tensor, theta: float) -> torch.Tensor:
    """Plain multi-head attention: kv heads repeated, explicit RoPE rotation of pairs
    (i, i + Hd/2), explicit causal softmax."""
    b, s, _ = x_BSD.shape
    h, g, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = (x_BSD @ attn.wq.weight.T).view(b, s, h, hd)
    k = (x_BSD @ attn.wk.weight.T).view(b, s, g, hd).repeat_interleave(h // g, dim=2)
    v = (x_BSD @ attn.wv.weight.T).view(b, s, g, hd).repeat_interleave(h // g, dim=2)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        half = hd // 2
        out = torch.empty_like(t)
        for pos in range(s):
            for i in range(half):
                ang = pos * theta ** (-2 * i / hd)
                a, c = t[:, pos, :, i], t[:, pos, :, i + half]
                out[:, pos, :, i] = a * math.cos(ang) - c * math.sin(ang)
                out[:, pos, :, i + half] = a * math.sin(ang) + c * math.cos(ang)
        return out

    q, k = rotate(q), rotate(k)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, h * hd)
    return out @ attn.wo.weight.T


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_attention_matches_plain_multi_head_reference(n_kv_heads: int) -> None:
    cfg, _ = tiny(n_kv_heads=n_kv_heads, rope_theta=500.0)
    torch.manual_seed(0)
    attn = Attention(cfg, MixerSpec("gqa"))
    x = torch.randn(2, 7, cfg.d_model)
    cos, sin = rope_tables(attn.head_dim, cfg.max_seq_len, cfg.rope_theta)
    torch.testing.assert_close(
        attn(x, MixerInputs(cos, sin)), reference_attention(attn, x, 500.0), atol=1e-5, rtol=1e-5
    )


def test_gqa_with_all_kv_heads_is_multi_head_attention() -> None:
    # kv heads = heads is standard multi-head attention (torch's nn.MultiheadAttention)
    cfg, _ = tiny(n_kv_heads=4)
    torch.manual_seed(0)
    attn = Attention(cfg, MixerSpec("gqa"))
    x = torch.randn(1, 5, cfg.d_model)
    cos, sin = rope_tables(attn.head_dim, cfg.max_seq_len, cfg.rope_theta)
    cos.fill_(1.0)  # no rotation: compare against nn.MultiheadAttention
    sin.fill_(0.0)
    mha = torch.nn.MultiheadAttention(cfg.d_model, cfg.n_heads, bias=False, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([attn.wq.weight, attn.wk.weight, attn.wv.weight]))
        mha.out_proj.weight.copy_(attn.wo.weight)
    mask = torch.ones(5, 5, dtype=torch.bool).triu(1)
    ref, _ = mha(x, x, x, attn_mask=mask, need_weights=False)
    torch.testing.assert_close(attn(x, MixerInputs(cos, sin)), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_causality(qk_norm: bool) -> None:
    model = build(qk_norm=qk_norm, num_shared_experts=1, first_k_dense=1, n_layers=3)
    ids = torch.randint(0, 50, (2, 12))
    changed = ids.clone()
    changed[:, 8:] = (changed[:, 8:] + 7) % 50
    a, b = model(ids).logits, model(changed).logits
    # bitwise equality is too strict: expert groups change size, so matmul blocking differs
    torch.testing.assert_close(a[:, :8], b[:, :8], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_document_mask_equals_separate_documents() -> None:
    model = build()
    ids = torch.randint(0, 50, (1, 10))
    doc_ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2, 2, 2]])
    packed = model(ids, doc_ids_BS=doc_ids).logits
    # RoPE is relative, so each document alone (from position 0) gives the same logits
    for start, end in [(0, 4), (4, 7), (7, 10)]:
        alone = model(ids[:, start:end]).logits
        torch.testing.assert_close(packed[:, start:end], alone, atol=1e-5, rtol=1e-5)
    # and changing document 0 never changes the others
    other = ids.clone()
    other[:, :4] = (other[:, :4] + 3) % 50
    torch.testing.assert_close(model(other, doc_ids_BS=doc_ids).logits[:, 4:], packed[:, 4:])
    assert not torch.allclose(model(ids).logits[:, 4:], packed[:, 4:])  # mask does something


def test_moe_placement_and_parameter_count() -> None:
    model = build(n_layers=6, first_k_dense=1, moe_every=2, num_shared_experts=1)
    kinds = [isinstance(b.ffn, MoELayer) for b in model.layers]
    assert kinds == [model.moe_cfg.is_moe_layer(i) for i in range(6)]
    assert kinds == [False, False, True, False, True, False]
    assert all(
        isinstance(b.ffn, SwiGLU) for b, moe in zip(model.layers, kinds, strict=True) if not moe
    )
    cfg = Config(model=model.cfg, moe=model.moe_cfg)
    assert sum(p.numel() for p in model.parameters()) == model_numbers(cfg).total_params
    assert len(model(torch.randint(0, 50, (1, 4))).moe) == 2


def test_parameter_names_follow_the_contract() -> None:
    names = set(dict(build(num_shared_experts=1, shared_expert_gate=True).state_dict()))
    for n in [
        "embed.weight",
        "layers.0.attn_norm.weight",
        "layers.0.attn.wq.weight",
        "layers.0.attn.wo.weight",
        "layers.0.ffn_norm.weight",
        "layers.1.ffn.router.gate.weight",
        "layers.1.ffn.router.expert_bias",
        "layers.1.ffn.experts.w13",
        "layers.1.ffn.experts.w2",
        "layers.1.ffn.shared_expert.w1.weight",
        "layers.1.ffn.shared_gate.weight",
        "norm.weight",
        "lm_head.weight",
    ]:
        assert n in names, n
    m = build()
    assert m.layers[0].ffn.experts.w13.shape == (4, 32, 2 * 16)
    assert m.layers[0].ffn.experts.w2.shape == (4, 16, 32)


def test_tied_embeddings_share_one_tensor() -> None:
    model = build(tie_embeddings=True)
    assert model.lm_head.weight is model.embed.weight
    untied = build()
    assert untied.lm_head.weight is not untied.embed.weight
    n_tied = sum(p.numel() for p in model.parameters())
    assert n_tied == sum(p.numel() for p in untied.parameters()) - 50 * 32


def test_initialisation_scales_output_projections() -> None:
    torch.manual_seed(0)
    model = Transformer(*tiny(d_model=256, n_heads=4, expert_hidden=256, n_layers=8, init_std=0.02))
    out_std = 0.02 / math.sqrt(16)
    layer = model.layers[0]
    assert layer.attn.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert layer.attn.wo.weight.std().item() == pytest.approx(out_std, rel=0.05)
    assert layer.ffn.experts.w13.std().item() == pytest.approx(0.02, rel=0.05)
    assert layer.ffn.experts.w2.std().item() == pytest.approx(out_std, rel=0.05)
    assert torch.all(layer.attn_norm.weight == 1)


def test_losses_ignore_minus_100_and_add_scaled_moe_losses() -> None:
    model = build(aux_loss_coef=0.5, z_loss_coef=0.25)
    ids = torch.randint(0, 50, (2, 6))
    labels = ids.clone()
    labels[:, :3] = -100
    out = model(ids, labels_BS=labels)
    ce = F.cross_entropy(out.logits[:, 3:].reshape(-1, 50), labels[:, 3:].reshape(-1))
    torch.testing.assert_close(out.ce_loss, ce)
    moe = sum(0.5 * s.aux_loss + 0.25 * s.z_loss for s in out.moe)
    torch.testing.assert_close(out.moe_loss, moe)
    torch.testing.assert_close(out.loss, ce + moe)
    assert model(ids).loss is None


def test_too_long_sequence_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        build()(torch.zeros(1, 65, dtype=torch.long))


def test_bf16_forward_backward_runs_with_fp32_routing() -> None:
    model = build(num_shared_experts=1).to(torch.bfloat16)
    ids = torch.randint(0, 50, (2, 8))
    out = model(ids, labels_BS=ids)
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    router = model.layers[0].ffn.router
    assert router(torch.randn(4, 32, dtype=torch.bfloat16)).weights_TK.dtype == torch.float32


def test_multipliers_equal_a_hand_written_forward() -> None:
    """Granite's muP-style scalars (model.embedding_multiplier, residual_multiplier,
    attention_scale, logits_scaling): the model equals the plain forward written out with
    them (the embeddings scaled, each branch scaled before its residual add, the softmax scale
    given, the head's output divided)."""
    scalars = dict(
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_scale=0.3,
        logits_scaling=6.0,
        init_std=0.1,
    )
    model = build(**scalars, num_shared_experts=1, first_k_dense=1)
    plain = build(init_std=0.1, num_shared_experts=1, first_k_dense=1)
    plain.load_state_dict(model.state_dict())
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        got = model(ids).logits
        x = plain.embed(ids) * 12.0
        cos, sin = plain.rope_cos[:7], plain.rope_sin[:7]
        for block in plain.layers:
            attn = block.attn
            h = block.attn_norm(x)
            b, s, _ = h.shape
            q = attn.wq(h).view(b, s, attn.n_heads, -1).transpose(1, 2)
            k = attn.wk(h).view(b, s, attn.n_kv_heads, -1).transpose(1, 2)
            v = attn.wv(h).view(b, s, attn.n_kv_heads, -1).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            rep = attn.n_heads // attn.n_kv_heads
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            scores = (q @ k.transpose(-1, -2)) * 0.3  # not 1 / sqrt(head_dim)
            causal = torch.ones(s, s, dtype=torch.bool).tril()
            probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            a = attn.wo((probs @ v).transpose(1, 2).reshape(b, s, -1))
            x = x + 0.22 * a
            y = block.ffn(block.ffn_norm(x))
            x = x + 0.22 * (y[0] if block.is_moe else y)
        want = plain.lm_head(plain.norm(x)) / 6.0
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (plain(ids).logits - got).abs().max() > 1e-3


def test_default_multipliers_are_the_plain_model_bit_for_bit() -> None:
    """1.0 and a null attention scale compute exactly today's model (no op is added)."""
    model = build(init_std=0.1)
    explicit = build(
        init_std=0.1, embedding_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0
    )
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, explicit(ids).logits)


@pytest.mark.parametrize("mtp_depth", [0, 1])
def test_chunked_loss_applies_the_logits_scaling(mtp_depth: int) -> None:
    """The trainer's chunked cross-entropy (no logits; the hidden state divided by
    model.logits_scaling) equals the cross-entropy of logits / logits_scaling, loss and
    gradients (the multi-token-prediction head's too)."""
    kw = dict(logits_scaling=6.0, embedding_multiplier=3.0, init_std=0.1, mtp_depth=mtp_depth)
    chunked, full = build(**kw, loss_chunk_tokens=5), build(**kw, loss_chunk_tokens=0)
    full.load_state_dict(chunked.state_dict())
    ids = torch.randint(0, 50, (2, 9))
    labels = ids.clone()
    labels[0, :2] = -100
    a = chunked(ids, labels_BS=labels, return_logits=False)
    b = full(ids, labels_BS=labels)
    assert a.logits is None
    logits = full(ids).logits
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(b.ce_loss, ce)
    torch.testing.assert_close(a.ce_loss, b.ce_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a.loss, b.loss, atol=1e-6, rtol=1e-6)
    a.loss.backward()
    b.loss.backward()
    for (name, p), q in zip(chunked.named_parameters(), full.parameters(), strict=True):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)
    plain = build(**{**kw, "logits_scaling": 1.0}, loss_chunk_tokens=5)
    plain.load_state_dict(chunked.state_dict())
    assert (plain(ids, labels_BS=labels, return_logits=False).ce_loss - a.ce_loss).abs() > 1e-3


@pytest.mark.parametrize(
    "key, value",
    [
        ("embedding_multiplier", 0.0),
        ("residual_multiplier", -1.0),
        ("attention_scale", 0.0),
        ("logits_scaling", 0.0),
    ],
)
def test_multipliers_must_be_positive(key: str, value: float) -> None:
    from moetrain.config import ConfigError

    with pytest.raises(ConfigError, match=rf"model\.{key}"):
        tiny(**{key: value})
