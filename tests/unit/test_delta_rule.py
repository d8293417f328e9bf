"""The gated delta rule (model/delta_rule.py): the chunked form against the token-by-token
recurrence in fp64 (values and the gradients of q, k, v, g, beta and the initial state), per
head and per key channel, at chunk sizes that do and do not divide S; packed documents against
the documents run one by one; transformers' Qwen3-Next and Kimi Linear rules; the bf16 policy;
decoding and continuing from a state. Each tolerance comes with a control it must catch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moetrain.model.delta_rule import gated_delta_rule, gated_delta_rule_recurrent

B, S, HK, H, K, V = 2, 37, 2, 4, 6, 5


def make_inputs(s=S, per_channel=False, dtype=torch.float64, seed=0, beta_max=1.0, decay=1.0):
    """q, k (unit norm), v, g (log decay in [-decay, 0]), beta in (0, beta_max), initial state."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = rand(B, s, HK, K), F.normalize(rand(B, s, HK, K), dim=-1)
    g_shape = (B, s, H, K) if per_channel else (B, s, H)
    g = -decay * torch.rand(*g_shape, generator=gen, dtype=torch.float64)
    beta = beta_max * torch.rand(B, s, H, generator=gen, dtype=torch.float64)
    ins = [q, k, rand(B, s, H, V), g, beta, rand(B, H, K, V)]
    return [t.to(dtype).requires_grad_() for t in ins]


def outputs_and_grads(rule, ins, **kw):
    """[o, final state, dq, dk, dv, dg, dbeta, dh0] for a fixed random linear loss."""
    q, k, v, g, beta, h0 = ins
    o, state = rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(1)  # weights exact in bf16, so every dtype sees them
    wo = torch.randn(o.shape, generator=gen).bfloat16().to(o.dtype)
    ws = torch.randn(state.shape, generator=gen).bfloat16().to(state.dtype)
    loss = (o * wo).sum() + (state * ws).sum()
    return [o.detach(), state.detach(), *torch.autograd.grad(loss, ins)]


NAMES = ["o", "final state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]


def assert_close(got, ref, rel: float, names=NAMES) -> None:
    """Each tensor's largest difference within ``rel`` of its largest entry."""
    for name, a, b in zip(names, got, ref, strict=True):
        err = (a.double() - b.double()).abs().max().item()
        scale = b.double().abs().max().item()
        assert err <= rel * scale, f"{name}: max difference {err:.3g} > {rel:g} x {scale:.3g}"


FP64 = 1e-12  # observed <= 2e-15 (fp64 rounding); the control below shows 1e-9 is caught
FP32 = 2e-5  # fp32 against a reference computed in another order or in fp64: observed <= 8e-6


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
@pytest.mark.parametrize(("s", "chunk"), [(37, 8), (37, 5), (37, 64), (32, 8), (32, 32), (48, 16)])
def test_chunked_equals_the_recurrence_in_fp64(per_channel, s, chunk) -> None:
    ins = make_inputs(s, per_channel, beta_max=2.0 if chunk == 5 else 1.0)
    ref = outputs_and_grads(gated_delta_rule_recurrent, ins)
    assert_close(outputs_and_grads(gated_delta_rule, ins, chunk_size=chunk), ref, FP64)


def test_fp64_tolerance_catches_a_1e9_error() -> None:
    ins = make_inputs()
    ref = outputs_and_grads(gated_delta_rule_recurrent, ins)
    q, k, v, g, beta, h0 = ins
    bent = [q, k, v, g, beta * (1 + 1e-9), h0]
    with pytest.raises(AssertionError):
        assert_close(outputs_and_grads(gated_delta_rule, bent, chunk_size=8), ref, FP64)


def test_large_decays_stay_finite_and_exact() -> None:
    """Decays of up to e^-60 a step (per channel: the chunk's products never take a positive
    exponent) in fp32 against the fp64 recurrence; a decay 1e-3 off fails the comparison."""
    for per_channel in (False, True):
        ins = make_inputs(per_channel=per_channel, decay=60.0)
        ref = outputs_and_grads(gated_delta_rule_recurrent, ins)
        ins32 = [t.detach().float().requires_grad_() for t in ins]
        got = outputs_and_grads(gated_delta_rule, ins32, chunk_size=16)
        assert all(torch.isfinite(t).all() for t in got)
        assert_close(got, ref, FP32)
        q, k, v, g, beta, h0 = ins32
        bent = [q, k, v, (g * (1 + 1e-3)).detach().requires_grad_(), beta, h0]
        with pytest.raises(AssertionError):
            assert_close(outputs_and_grads(gated_delta_rule, bent, chunk_size=16), ref, FP32)


# --- packed documents ---------------------------------------------------------------------

DOCS = [[10, 3, 1, 15, 8], [16, 21], [37]]  # starts mid-chunk, at a chunk edge, length 1


def doc_ids_of(lengths_per_row) -> torch.Tensor:
    return torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths_per_row]
    )


def assert_packed_equals_separate(rule, rel: float, **kw) -> None:
    """Rows packed with DOCS equal each document run alone (the row's initial state feeding
    only its first document; its final state the last one's), values and gradients."""
    rows = len(DOCS)
    ins = make_inputs()
    ins = [torch.cat([t, t[:1]]).detach().requires_grad_() for t in ins]  # B = 3
    q, k, v, g, beta, h0 = ins
    ids = doc_ids_of(DOCS)
    o, state = rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, doc_ids=ids, **kw)
    wo, ws = torch.randn_like(o), torch.randn_like(state)
    packed = [o, state, *torch.autograd.grad((o * wo).sum() + (state * ws).sum(), ins)]
    sep_o, sep_state, grads = torch.zeros_like(o), torch.zeros_like(state), []
    loss = 0.0
    for r in range(rows):
        a = 0
        for n, length in enumerate(DOCS[r]):
            sl = slice(a, a + length)
            part = [t[r : r + 1, sl] for t in (q, k, v, g, beta)]
            init = h0[r : r + 1] if n == 0 else None
            od, sd = gated_delta_rule_recurrent(*part, initial_state=init, output_final_state=True)
            sep_o[r : r + 1, sl] = od.detach()
            loss = loss + (od * wo[r : r + 1, sl]).sum()
            a += length
        sep_state[r] = sd[0].detach()
        loss = loss + (sd * ws[r : r + 1]).sum()
    grads = torch.autograd.grad(loss, ins)
    assert_close(packed, [sep_o, sep_state, *grads], rel)


@pytest.mark.parametrize("chunk", [8, 5, 64])
def test_packed_documents_equal_each_document_alone(chunk) -> None:
    assert_packed_equals_separate(gated_delta_rule, FP64, chunk_size=chunk)
    assert_packed_equals_separate(gated_delta_rule_recurrent, FP64)


def test_cu_seqlens_equal_doc_ids() -> None:
    q, k, v, g, beta, h0 = make_inputs()
    one = [t[:1] for t in (q, k, v, g, beta, h0)]
    cu = torch.tensor([0, 10, 13, 14, 29, 37])
    ids = doc_ids_of([[10, 3, 1, 15, 8]])
    for rule in (gated_delta_rule, gated_delta_rule_recurrent):
        a = rule(*one[:5], initial_state=one[5], output_final_state=True, cu_seqlens=cu)
        b = rule(*one[:5], initial_state=one[5], output_final_state=True, doc_ids=ids)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_state_leaking_1e3_across_documents_fails_the_packed_test() -> None:
    """The control: the state multiplied by 1e-3 at a document start instead of cut."""

    def leaky(q, k, v, g, beta, *, doc_ids, **kw):
        starts = torch.zeros_like(doc_ids, dtype=torch.bool)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        g = torch.where(starts[:, :, None], math.log(1e-3), g)
        return gated_delta_rule(q, k, v, g, beta, chunk_size=8, **kw)

    with pytest.raises(AssertionError):
        assert_packed_equals_separate(leaky, FP64)


# --- transformers' rules -------------------------------------------------------------------


def _hf_layout(ins):
    return [t.detach().float() for t in ins]


def test_equals_transformers_qwen3_next_rules() -> None:
    """Qwen3-Next's torch paths (fp32, q/k normalized in the kernel, grouped heads repeated
    per key head) against ours; the control repeats the heads the other way (tiled)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, g, beta, h0 = _hf_layout(make_inputs(s=70))
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_chunk = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, **kw)
    ref_rec = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    ours = dict(initial_state=h0, output_final_state=True, qk_l2norm=True)
    for got in (
        gated_delta_rule(q, k, v, g, beta, chunk_size=16, **ours),
        gated_delta_rule_recurrent(q, k, v, g, beta, **ours),
    ):
        for ref in (ref_chunk, ref_rec):
            assert_close(got, ref, FP32, names=["o", "final state"])
    tiled = [t.repeat(1, 1, H // HK, 1) for t in (q, k)]
    wrong = gated_delta_rule(*tiled, v, g, beta, chunk_size=16, **ours)
    with pytest.raises(AssertionError):
        assert_close(wrong, ref_chunk, FP32, names=["o", "final state"])


def test_per_channel_decay_equals_transformers_kimi_delta_attention() -> None:
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    q, k, v, g, beta, h0 = make_inputs(s=70, per_channel=True)
    q, k = (t.repeat_interleave(H // HK, 2) for t in (q, k))  # Kimi has no grouped heads
    q, k, v, g, beta, h0 = _hf_layout([q, k, v, g, beta, h0])
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref = hf.chunk_kimi_delta_attention(q, k, v, g, beta, **kw)
    ref_rec = hf.recurrent_kimi_delta_attention(q, k, v, g, beta, **kw)
    ours = dict(initial_state=h0, output_final_state=True, qk_l2norm=True)
    for got in (
        gated_delta_rule(q, k, v, g, beta, chunk_size=32, **ours),
        gated_delta_rule_recurrent(q, k, v, g, beta, **ours),
    ):
        assert_close(got, ref, FP32, names=["o", "final state"])
        assert_close(got, ref_rec, FP32, names=["o", "final state"])


# --- numerics policy, decoding, bad input --------------------------------------------------


def _bf16_state_recurrence(q, k, v, g, beta, *, initial_state, output_final_state):
    """The control: the recurrence with its state rounded to bf16 after every token."""
    rep = H // HK
    q, k = (t.float().repeat_interleave(rep, 2) for t in (q, k))
    q = q * q.shape[-1] ** -0.5
    state, out = initial_state.to(torch.bfloat16), []
    for t in range(q.shape[1]):
        s32 = state.float() * g[:, t].float().exp()[..., None, None]
        kt = k[:, t].unsqueeze(-1)
        delta = beta[:, t].float()[..., None] * (v[:, t].float() - (s32 * kt).sum(-2))
        s32 = s32 + kt * delta.unsqueeze(-2)
        out.append((s32 * q[:, t].unsqueeze(-1)).sum(-2))
        state = s32.to(torch.bfloat16)
    return torch.stack(out, 1).to(torch.bfloat16), state.float()


def test_bf16_inputs_keep_decays_gates_and_state_in_fp32() -> None:
    """bf16 inputs against fp32 inputs of the same values: the computation is the same fp32
    one, so each output and gradient differs only by its final rounding to bf16, at most
    2^-8 of its value. A state kept in bf16 breaks that bound."""
    ins = make_inputs(s=64, dtype=torch.bfloat16)
    ins[5] = ins[5].detach().float().requires_grad_()  # the state is fp32 whatever the inputs
    ref_ins = [t.detach().float().requires_grad_() for t in ins]
    bound = 2.0**-8

    def check(got, ref, names=NAMES):
        for name, a, b in zip(names, got, ref, strict=True):
            excess = (a.float() - b).abs() - bound * b.abs()
            assert excess.max().item() <= 1e-30, f"{name}: off by more than 2^-8 of the value"

    for kw in ({"chunk_size": 16}, {}):
        rule = gated_delta_rule if kw else gated_delta_rule_recurrent
        got = outputs_and_grads(rule, ins, **kw)
        assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
        check(got, outputs_and_grads(rule, ref_ins, **kw))
    q, k, v, g, beta, h0 = ins
    o, state = _bf16_state_recurrence(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    ref = gated_delta_rule_recurrent(
        *ref_ins[:5], initial_state=ref_ins[5], output_final_state=True
    )
    with pytest.raises(AssertionError):
        check([o, state], [t.detach() for t in ref], names=["o", "final state"])


def test_prefill_then_decode_equals_the_whole_sequence() -> None:
    """The chunked prefill's final state, then one recurrent step per token (the decode path),
    give the outputs and state of the whole sequence; a chunked run continued from the first
    half's state (a later slice of the row) equals it too, gradients through the state."""
    ins = make_inputs()
    q, k, v, g, beta, h0 = ins
    o, state = gated_delta_rule_recurrent(
        q, k, v, g, beta, initial_state=h0, output_final_state=True
    )
    n = 29
    got, st = gated_delta_rule(
        *(t[:, :n] for t in (q, k, v, g, beta)),
        initial_state=h0,
        output_final_state=True,
        chunk_size=8,
    )
    steps = [got]
    for t in range(n, S):
        ot, st = gated_delta_rule_recurrent(
            *(x[:, t : t + 1] for x in (q, k, v, g, beta)),
            initial_state=st,
            output_final_state=True,
        )
        steps.append(ot)
    assert_close([torch.cat(steps, 1), st], [o, state], FP64, names=["o", "state"])

    def halves(q, k, v, g, beta, *, initial_state, output_final_state, **kw):
        first, mid = gated_delta_rule(
            *(t[:, :n] for t in (q, k, v, g, beta)),
            initial_state=initial_state,
            output_final_state=True,
            **kw,
        )
        second, end = gated_delta_rule(
            *(t[:, n:] for t in (q, k, v, g, beta)),
            initial_state=mid,
            output_final_state=True,
            **kw,
        )
        return torch.cat([first, second], 1), end

    ref = outputs_and_grads(gated_delta_rule_recurrent, ins)
    assert_close(outputs_and_grads(halves, ins, chunk_size=8), ref, FP64)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(k=a["k"][..., :-1]), "q and k must be"),
        (lambda a: a.update(v=a["v"][:, :, :3]), "multiple of Hk"),
        (lambda a: a.update(g=a["g"][..., :1]), "g (log decay)"),
        (lambda a: a.update(beta=a["beta"][:, :-1]), "beta must be"),
        (lambda a: a.update(initial_state=a["initial_state"][:1]), "initial_state must be"),
        (lambda a: a.update(doc_ids=torch.zeros(B, S + 1)), "doc_ids has shape"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 5, S])), "cu_seqlens must be"),
    ],
)
def test_bad_inputs_are_refused_by_name(change, message) -> None:
    q, k, v, g, beta, h0 = (t.detach() for t in make_inputs())
    args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)
    change(args)
    for rule in (gated_delta_rule, gated_delta_rule_recurrent):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            rule(**args)
