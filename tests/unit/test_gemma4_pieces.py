"""Gemma 4's model pieces as options of the single-device model, each against a written-out
reference (values and gradients) with a negative control: final-logit soft-capping, GeGLU,
the router's scalars, the dense branch beside the experts with the layer scalar, the global
layers' attention (own head dim and key/value heads, keys as values, value norm, proportional
RoPE)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetrain.config import ConfigError, ModelConfig
from moetrain.model import Transformer
from moetrain.model.loss import chunked_cross_entropy
from tests.helpers.configs import tiny_config


def build(seed: int = 0, **kw) -> Transformer:
    """The tiny model with 50 tokens; ``kw``: ModelConfig or MoEConfig fields."""
    section = {k: "model" if k in ModelConfig.__dataclass_fields__ else "moe" for k in kw}
    cfg = tiny_config(model__vocab_size=50, **{f"{section[k]}.{k}": v for k, v in kw.items()})
    torch.manual_seed(seed)
    return Transformer(cfg.model, cfg.moe).eval()


def written_out_capped_ce(logits: torch.Tensor, labels: torch.Tensor, cap: float) -> torch.Tensor:
    """The cross-entropy of ``cap * tanh(logits / cap)``, spelled out (log-sum-exp)."""
    z = cap * torch.tanh(logits.float() / cap)
    keep = labels != -100
    z, labels = z[keep], labels[keep]
    return (torch.logsumexp(z, -1) - z.gather(1, labels[:, None])[:, 0]).mean()


@pytest.mark.parametrize("cap", [None, 0.7])
def test_chunked_loss_soft_caps_values_and_gradients(cap: float | None) -> None:
    """The chunked head loss with a cap equals the written-out capped cross-entropy, loss and
    gradients wrt h and W (the cap's derivative in the stored gradient)."""
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(11, 8, generator=g) * 2).requires_grad_()
    w = torch.randn(13, 8, generator=g).requires_grad_()
    labels = torch.randint(0, 13, (11,), generator=g)
    labels[3] = -100
    got = chunked_cross_entropy(h, w, labels, 4, cap=cap)
    ref_h, ref_w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    logits = ref_h @ ref_w.T
    want = (
        written_out_capped_ce(logits, labels, cap)
        if cap is not None
        else F.cross_entropy(logits, labels, ignore_index=-100)
    )
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    got.backward()
    want.backward()
    torch.testing.assert_close(h.grad, ref_h.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w.grad, ref_w.grad, atol=1e-6, rtol=1e-5)
    if cap is not None:  # negative control: the uncapped loss is far from it
        plain = chunked_cross_entropy(h.detach(), w.detach(), labels, 4)
        assert (plain - got).abs() > 0.1


def test_model_soft_caps_logits_loss_and_gradients() -> None:
    """model.final_logit_softcap: the logits are the uncapped model's through cap * tanh(./cap)
    (after logits_scaling); the chunked and the full-logits loss equal the written-out capped
    cross-entropy, with the same gradients (the MTP head's loss too)."""
    kw = dict(init_std=0.5, logits_scaling=2.0, mtp_depth=1)
    capped = build(**kw, final_logit_softcap=1.5, loss_chunk_tokens=5)
    full = build(**kw, final_logit_softcap=1.5, loss_chunk_tokens=0)
    plain = build(**kw)
    full.load_state_dict(capped.state_dict())
    plain.load_state_dict(capped.state_dict())
    ids = torch.randint(0, 50, (2, 9))
    labels = ids.roll(-1, 1)
    labels[0, :2] = -100
    with torch.no_grad():
        raw = plain(ids).logits
        torch.testing.assert_close(capped(ids).logits, 1.5 * torch.tanh(raw / 1.5))
        assert (raw.abs().max() > 1.5) and (capped(ids).logits.abs().max() < 1.5)
    a = capped(ids, labels_BS=labels, return_logits=False)
    b = full(ids, labels_BS=labels)
    assert a.logits is None
    want = written_out_capped_ce(raw.flatten(0, 1), labels.flatten(), 1.5)
    torch.testing.assert_close(b.ce_loss, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a.loss, b.loss, atol=1e-6, rtol=1e-6)
    a.loss.backward()
    b.loss.backward()
    for (name, p), q in zip(capped.named_parameters(), full.parameters(), strict=True):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)
    uncapped = plain(ids, labels_BS=labels, return_logits=False)
    assert (uncapped.loss - a.loss).abs() > 1e-2  # negative control


def test_soft_cap_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"model\.final_logit_softcap"):
        build(final_logit_softcap=0.0)


def written_out_geglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """gelu with the tanh approximation, spelled out, times b."""
    c = (2 / torch.pi) ** 0.5
    return 0.5 * a * (1 + torch.tanh(c * (a + 0.044715 * a**3))) * b


def test_geglu_dense_ffn_and_experts_against_written_out() -> None:
    """model.ffn_activation / moe.activation geglu: the dense layer's FFN and each routed
    expert compute w2(gelu_tanh(w1 x) * w3 x) (times the routing weight), values and
    gradients, on the loop and the grouped-GEMM paths; SwiGLU's output is far from it."""
    model = build(ffn_activation="geglu", activation="geglu", first_k_dense=1, init_std=0.3)
    swiglu = build(first_k_dense=1, init_std=0.3)
    swiglu.load_state_dict(model.state_dict())
    x = torch.randn(2, 5, model.cfg.d_model, requires_grad=True)
    dense = model.layers[0].ffn
    got = dense(x)
    x_ref = x.detach().clone().requires_grad_()
    want = written_out_geglu(x_ref @ dense.w1.weight.T, x_ref @ dense.w3.weight.T)
    want = want @ dense.w2.weight.T
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    got.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    assert (swiglu.layers[0].ffn(x) - got).abs().max() > 1e-2

    experts = model.layers[1].ffn.experts
    n = 7
    rows = torch.randn(n, model.cfg.d_model)
    counts = torch.zeros(experts.num_local_experts, dtype=torch.long)
    counts[0], counts[2] = 3, 4
    weights = torch.rand(n)
    for grouped in (False, True):
        experts.use_grouped_mm = grouped
        r = rows.clone().requires_grad_()
        y = experts(r, counts, weights)
        r_ref = rows.clone().requires_grad_()
        parts, start = [], 0
        for e, c in enumerate(counts.tolist()):
            seg = r_ref[start : start + c]
            w13 = experts.w13[e].detach()
            a, b = (seg @ w13).chunk(2, -1)
            parts.append(
                written_out_geglu(a, b) @ experts.w2[e].detach() * weights[start : start + c, None]
            )
            start += c
        y_ref = torch.cat(parts)
        torch.testing.assert_close(y, y_ref, atol=1e-6, rtol=1e-5)
        y.square().sum().backward()
        y_ref.square().sum().backward()
        torch.testing.assert_close(r.grad, r_ref.grad, atol=1e-5, rtol=1e-5)
    assert (swiglu.layers[1].ffn.experts(rows, counts, weights) - y).abs().max() > 1e-2


def test_router_scalars_against_written_out_values_and_gradients() -> None:
    """moe.router_input_norm and moe.expert_scale: the gate scores rms(x) * input_scale *
    D^-0.5, the softmax top-k weights are renormalised and multiplied by the chosen experts'
    scales (Gemma 4's router), values and gradients of the input, both scales and the gate;
    without them the weights differ (negative control)."""
    from moetrain.config import MoEConfig
    from moetrain.model.moe.router import Router

    d, e, k, eps = 16, 8, 3, 1e-6
    cfg = MoEConfig(num_experts=e, top_k=k, router_input_norm=True, expert_scale=True)
    router = Router(cfg, d, eps).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.gate.weight.normal_(0, 1, generator=g)
        router.input_scale.uniform_(0.5, 2.0, generator=g)
        router.expert_scale.uniform_(0.5, 2.0, generator=g)
    x = torch.randn(10, d, generator=g) * 3
    xr = x.clone().requires_grad_()
    out = router(xr)
    scale = router.input_scale.detach().clone().requires_grad_()
    per_expert = router.expert_scale.detach().clone().requires_grad_()
    gate = router.gate.weight.detach().clone().requires_grad_()
    x_ref = x.clone().requires_grad_()
    normed = x_ref / torch.sqrt(x_ref.square().mean(-1, keepdim=True) + eps)
    probs = torch.softmax((normed * scale * d**-0.5) @ gate.T, -1)
    top = probs.topk(k, -1)
    want = top.values / top.values.sum(-1, keepdim=True) * per_expert[top.indices]
    assert torch.equal(out.ids_TK, top.indices)
    torch.testing.assert_close(out.weights_TK, want, atol=1e-6, rtol=1e-6)
    probe = torch.randn(10, k, generator=g)
    (out.weights_TK * probe).sum().backward()
    (want * probe).sum().backward()
    for got, ref in [
        (xr.grad, x_ref.grad),
        (router.input_scale.grad, scale.grad),
        (router.expert_scale.grad, per_expert.grad),
        (router.gate.weight.grad, gate.grad),
    ]:
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
    plain = Router(MoEConfig(num_experts=e, top_k=k), d).eval()
    plain.gate.load_state_dict(router.gate.state_dict())
    assert (plain(x).weights_TK - out.weights_TK).abs().max() > 1e-2


def test_router_scalars_start_at_one_in_the_model() -> None:
    """The model initialises both router scalars to ones (as transformers)."""
    model = build(router_input_norm=True, expert_scale=True)
    router = model.layers[0].ffn.router
    assert torch.equal(router.input_scale, torch.ones_like(router.input_scale))
    assert torch.equal(router.expert_scale, torch.ones_like(router.expert_scale))


GEMMA_BLOCK = dict(
    block_norms="sandwich",
    dense_branch=True,
    layer_scalar=True,
    router_input_norm=True,
    expert_scale=True,
    ffn_activation="geglu",
    activation="geglu",
    init_std=0.3,
)


def randomise_constants(model: Transformer, seed: int = 1) -> None:
    """Every parameter initialised to a constant (norm weights, router scalars, layer
    scalars) drawn at random, so that a misplaced one shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5, generator=g)


def written_out_moe(block, x_BSD: torch.Tensor) -> torch.Tensor:
    """The MoE branch token by token: the router's choice on the residual stream x, each
    chosen expert's GeGLU on moe_norm(x) times its weight."""
    moe = block.ffn
    r = moe.router(x_BSD.flatten(0, 1))
    h_TD = block.moe_norm(x_BSD).flatten(0, 1)
    out = torch.zeros_like(h_TD)
    for t in range(h_TD.shape[0]):
        for e, w in zip(r.ids_TK[t].tolist(), r.weights_TK[t], strict=True):
            a, b = (h_TD[t] @ moe.experts.w13[e]).chunk(2, -1)
            out[t] = out[t] + written_out_geglu(a, b) @ moe.experts.w2[e] * w
    return out.view_as(x_BSD)


def test_dense_branch_block_against_written_out_values_and_gradients() -> None:
    """moe.dense_branch with sandwich norms and model.layer_scalar: an MoE block computes
    (x1 + ffn_post_norm(dense_post_norm(dense(ffn_norm(x1))) + moe_post_norm(moe(x1))))
    * layer_scalar with x1 = x + attn_post_norm(attn(attn_norm(x))), the router scoring x1
    (Gemma 4's decoder layer), values and every parameter's gradient; routing on the
    experts' normed input instead changes it (negative control)."""
    import copy

    model = build(**GEMMA_BLOCK)
    randomise_constants(model)
    block = model.layers[0]
    assert block.is_moe and block.dense is not None
    ref = copy.deepcopy(block)
    x = torch.randn(2, 5, model.cfg.d_model)
    inputs = model_inputs(model, 5)
    got, _ = block(x, inputs)
    x1 = x + ref.attn_post_norm(ref.attn(ref.attn_norm(x), inputs))
    dense = ref.dense_post_norm(ref.dense(ref.ffn_norm(x1)))
    want = x1 + ref.ffn_post_norm(dense + ref.moe_post_norm(written_out_moe(ref, x1)))
    want = want * ref.layer_scalar
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    probe = torch.randn_like(got)
    (got * probe).sum().backward()
    (want * probe).sum().backward()
    params = dict(ref.named_parameters())
    for name, p in block.named_parameters():
        assert p.grad is not None and params[name].grad is not None, name
        torch.testing.assert_close(p.grad, params[name].grad, atol=1e-5, rtol=1e-4, msg=name)
    with torch.no_grad():  # negative control: the router scoring the experts' normed input
        wrong = ref.moe_norm(x1)
        y, _ = ref.ffn(wrong)
        other = (x1 + ref.ffn_post_norm(dense + ref.moe_post_norm(y))) * ref.layer_scalar
        assert (other - got).abs().max() > 1e-3


def model_inputs(model: Transformer, s: int):
    """The mixers' inputs of a plain causal forward of ``s`` positions."""
    from moetrain.model.mixers import MixerInputs

    return MixerInputs(model.rope_cos[:s], model.rope_sin[:s], None, None, 0)


def test_dense_branch_needs_sandwich_norms() -> None:
    with pytest.raises(ConfigError, match=r"moe\.dense_branch"):
        build(dense_branch=True)


def test_model_numbers_count_the_gemma_pieces() -> None:
    """model_numbers counts the dense branch, its norms, the router and layer scalars as the
    built model holds them."""
    from moetrain.model_numbers import model_numbers

    kw = {
        f"model.{k}" if k in ModelConfig.__dataclass_fields__ else f"moe.{k}": v
        for k, v in GEMMA_BLOCK.items()
    }
    cfg = tiny_config(**kw)
    model = Transformer(cfg.model, cfg.moe)
    assert model_numbers(cfg).total_params == sum(p.numel() for p in model.parameters())


GLOBAL_LAYER = dict(
    qk_norm=True,
    value_norm=True,
    attention_scale=1.0,
    sliding_window=3,
    layer_types=["sliding_attention", "full_attention"],
    global_head_dim=16,
    global_n_kv_heads=1,
    global_k_eq_v=True,
    global_rope_theta=1e5,
    global_rope_proportion=0.25,
    init_std=0.3,
)


def written_out_global_attention(attn, x: torch.Tensor, rotated: int, theta: float, eps: float):
    """Gemma 4's global layer spelled out: per-head RMSNorm'd queries and keys (weights),
    the values the key projection's output through a weightless RMSNorm, proportional RoPE
    (pairs (i, i + Hd/2) rotated by pos * theta^(-2i/Hd) for i < ``rotated``, the rest kept),
    logits scaled by 1, causal softmax, the one key/value head shared by every query head."""
    b, s, _ = x.shape
    h, hd = attn.n_heads, attn.head_dim

    def rms(t, w=None):
        t = t / torch.sqrt(t.square().mean(-1, keepdim=True) + eps)
        return t if w is None else t * w

    q = rms((x @ attn.wq.weight.T).view(b, s, h, hd), attn.q_norm.weight)
    k_raw = (x @ attn.wk.weight.T).view(b, s, 1, hd)
    k, v = rms(k_raw, attn.k_norm.weight), rms(k_raw)

    def rotate(t):
        out, half = t.clone(), hd // 2
        for pos in range(s):
            for i in range(rotated):
                ang = torch.tensor(pos * theta ** (-2 * i / hd))
                a, c = t[:, pos, :, i], t[:, pos, :, i + half]
                out[:, pos, :, i] = a * ang.cos() - c * ang.sin()
                out[:, pos, :, i + half] = a * ang.sin() + c * ang.cos()
        return out

    q, k = rotate(q), rotate(k)
    scores = torch.einsum("bqhd,bkd->bhqk", q, k[:, :, 0])
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,bkd->bqhd", probs, v[:, :, 0]).reshape(b, s, h * hd)
    return out @ attn.wo.weight.T


def test_global_layer_attention_against_written_out_values_and_gradients() -> None:
    """model.global_*: the full_attention layer has its own head dim (16, the sliding ones 8)
    and one key/value head, keys as values (no wv; a weightless value norm), proportional RoPE
    of its own theta (2 of 8 pairs rotated), logits scaled by 1: values and gradients of the
    input and every weight; rotating every pair instead changes it (negative control)."""
    import copy

    model = build(**GLOBAL_LAYER)
    randomise_constants(model)
    sliding, attn = model.layers[0].attn, model.layers[1].attn
    assert (sliding.head_dim, sliding.n_kv_heads, attn.head_dim, attn.n_kv_heads) == (8, 2, 16, 1)
    assert attn.wv is None and sliding.wv is not None
    ref = copy.deepcopy(attn)
    s = 7
    x = torch.randn(2, s, model.cfg.d_model, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    from moetrain.model.mixers import MixerInputs

    inputs = model._global_inputs(MixerInputs(model.rope_cos[:s], model.rope_sin[:s]), 0, s)
    got = attn(x, inputs)
    eps = model.cfg.norm_eps
    want = written_out_global_attention(ref, x_ref, 2, 1e5, eps)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    probe = torch.randn_like(got)
    (got * probe).sum().backward()
    (want * probe).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-4)
    params = dict(ref.named_parameters())
    for name, p in attn.named_parameters():
        torch.testing.assert_close(p.grad, params[name].grad, atol=1e-5, rtol=1e-4, msg=name)
    with torch.no_grad():  # negative control: every pair rotated (plain RoPE of the layer)
        plain = written_out_global_attention(ref, x_ref, 8, 1e5, eps)
        assert (plain - got).abs().max() > 1e-3


def test_global_keys_refused_where_they_cannot_hold() -> None:
    """The global layers' keys by key: a head count that does not divide the query heads, an
    odd head dim, RoPE scaling beside the global layers' own RoPE."""
    with pytest.raises(ConfigError, match=r"model\.global_n_kv_heads"):
        build(**{**GLOBAL_LAYER, "global_n_kv_heads": 3})
    with pytest.raises(ConfigError, match=r"model\.global_head_dim"):
        build(**{**GLOBAL_LAYER, "global_head_dim": 15})
    with pytest.raises(ConfigError, match=r"model\.global_head_dim"):
        yarn = dict(rope_scaling="yarn", rope_factor=2.0, rope_original_max_seq_len=16)
        build(**{**GLOBAL_LAYER, **yarn})
