"""Masked grouped-query attention: where torch would run the math kernel (a GPU whose
memory-efficient kernel lacks grouped K/V), K/V are expanded to the query heads, with the same
outputs and gradients as the grouped call; the document mask is additive and shared; the kernel
torch picks is recorded once per layer and reported."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from moetrain.config import ModelConfig, MoEConfig
from moetrain.config.layer_plan import MixerSpec
from moetrain.model import Transformer
from moetrain.model.attention import (
    apply_rope,
    attention_report,
    document_mask,
    expand_kv_for_mask,
    rope_tables,
    sdpa_kernel_name,
)
from moetrain.model.mixers import MixerInputs, gqa
from moetrain.model.mixers.gqa import Attention


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, dense_hidden=48)
    return ModelConfig(**{**base, "max_seq_len": 64, **kw})


def grouped_reference(attn: Attention, x, cos, sin, mask) -> torch.Tensor:  # noqa: ANN001
    """The attention as it was: grouped K/V and the mask in one SDPA call (``enable_gqa``)."""
    b, s, _ = x.shape
    q = attn.wq(x).view(b, s, attn.n_heads, attn.head_dim)
    k = attn.wk(x).view(b, s, attn.n_kv_heads, attn.head_dim)
    v = attn.wv(x).view(b, s, attn.n_kv_heads, attn.head_dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
    out = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), attn_mask=mask, enable_gqa=True)
    return attn.wo(out.transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("float_mask", [False, True], ids=["bool_mask", "additive_mask"])
@pytest.mark.parametrize("n_kv_heads,qk_norm", [(2, False), (1, True)])
def test_masked_gqa_equals_the_grouped_call(
    n_kv_heads: int, qk_norm: bool, float_mask: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Expanded K/V (forced here: CPU kernels take grouped K/V) against the grouped call with a
    boolean mask, the call as it was before."""
    monkeypatch.setattr(gqa, "expand_kv_for_mask", lambda *a: True)
    cfg = _cfg(n_kv_heads=n_kv_heads, qk_norm=qk_norm)
    torch.manual_seed(0)
    attn = Attention(cfg, MixerSpec("gqa"))
    cos, sin = rope_tables(attn.head_dim, cfg.max_seq_len, cfg.rope_theta)
    doc_ids = torch.tensor([[0] * 5 + [1] * 6 + [2] * 2, [0] * 13])
    mask = document_mask(doc_ids, torch.float32 if float_mask else torch.bool)
    x = torch.randn(2, 13, cfg.d_model, requires_grad=True)
    grad = torch.randn(2, 13, cfg.d_model)
    results = []
    for fn in (
        lambda: attn(x, MixerInputs(cos, sin, mask)),
        lambda: grouped_reference(attn, x, cos, sin, document_mask(doc_ids)),
    ):
        attn.zero_grad()
        x.grad = None
        y = fn()
        y.backward(grad)
        results.append((y.detach(), x.grad.clone(), [p.grad.clone() for p in attn.parameters()]))
    assert attn.sdpa_kernel.endswith(f"(mask, K/V expanded to {cfg.n_heads} heads)")
    (y, gx, gp), (y_ref, gx_ref, gp_ref) = results
    assert torch.equal(y, y_ref)
    torch.testing.assert_close(gx, gx_ref, atol=1e-6, rtol=1e-6)
    for a, b in zip(gp, gp_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_additive_document_mask_is_what_sdpa_makes_of_the_boolean_one() -> None:
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    allowed = document_mask(doc_ids)
    for dtype in (torch.float32, torch.bfloat16):
        additive = document_mask(doc_ids, dtype)
        assert additive.dtype == dtype and additive.shape == allowed.shape == (2, 1, 6, 6)
        assert torch.equal(additive, torch.where(allowed, 0.0, float("-inf")).to(dtype))
    torch.manual_seed(0)
    attn = Attention(_cfg(), MixerSpec("gqa"))
    cos, sin = rope_tables(attn.head_dim, 64, 10000.0)
    x = torch.randn(2, 6, 32)
    assert torch.equal(
        attn(x, MixerInputs(cos, sin, allowed)),
        attn(x, MixerInputs(cos, sin, document_mask(doc_ids, x.dtype))),
    )


@pytest.mark.parametrize(
    "device,kernel,expand",
    [
        ("cuda", "math", True),
        ("cuda", "unknown", True),
        ("cuda", "efficient_attention", False),  # a torch whose kernel takes grouped K/V
        ("cuda", "cudnn_attention", False),
        ("cpu", "math", False),
        ("cpu", "flash_attention", False),
    ],
)
def test_when_kv_are_expanded(device: str, kernel: str, expand: bool) -> None:
    assert expand_kv_for_mask(device, kernel) is expand


def test_only_a_masked_call_consults_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    asked, calls = [], []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):  # noqa: ANN001, ANN202
        calls.append((k.shape[1], v.shape[1], kw.get("attn_mask") is not None, kw["enable_gqa"]))
        return real(q, k, v, **kw)

    def policy(device: str, kernel: str) -> bool:
        asked.append((device, kernel))
        return True  # as on a GPU whose torch would run the math kernel

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(gqa, "expand_kv_for_mask", policy)
    torch.manual_seed(0)
    model = Transformer(_cfg(n_layers=1), MoEConfig(num_experts=4, top_k=2, expert_hidden=16))
    ids = torch.randint(0, 50, (1, 6))
    model(ids)  # causal: grouped K/V, flash attention takes them
    model(ids, doc_ids_BS=torch.tensor([[0, 0, 0, 1, 1, 1]]))  # documents: causal, no mask
    cache = model.new_cache(1, 16)
    model(ids, cache=cache)  # prefill against the cache: a mask
    model(ids[:, :1], cache=cache)  # one new token: no mask
    grouped, expanded = (2, 2, False, True), (4, 4, True, False)
    assert calls == [grouped, grouped, expanded, grouped]
    assert asked == [("cpu", sdpa_kernel_name(*_grouped_masked_call()))]


def _grouped_masked_call() -> tuple:
    q, kv = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    return q, kv, kv, torch.zeros(1, 1, 6, 6), False, True


def test_kernel_recorded_on_the_first_call_and_reported() -> None:
    torch.manual_seed(0)
    model = Transformer(_cfg(), MoEConfig(num_experts=4, top_k=2, expert_hidden=16))
    assert attention_report(model) is None
    model(torch.randint(0, 50, (1, 6)), doc_ids_BS=torch.tensor([[0, 0, 1, 1, 1, 1]]))
    first = model.layers[0].attn.sdpa_kernel
    name, _, note = first.partition(" ")
    assert name in {n.lower() for n in SDPBackend.__members__} - {"error", "math"}
    assert note == "(documents, no S x S mask)"  # packed documents: causal calls, no mask
    model(torch.randint(0, 50, (1, 6)))  # a later call (causal) does not change the record
    assert attention_report(model) == first


def test_kernel_name_from_torchs_selector(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(1, 4, 8, 16)
    kv = torch.randn(1, 2, 8, 16)
    assert sdpa_kernel_name(q, kv, kv, None, True, True) == "flash_attention"
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *a, **k: 0)
    assert sdpa_kernel_name(q, kv, kv, None, True, True) == "math"

    def old_signature(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False):  # noqa: ANN001, ANN202
        return 2

    monkeypatch.setattr(torch, "_fused_sdp_choice", old_signature)
    assert sdpa_kernel_name(q, kv, kv, None, True, True) == "unknown"
    monkeypatch.delattr(torch, "_fused_sdp_choice")
    assert sdpa_kernel_name(q, kv, kv, None, True, True) == "unknown"
