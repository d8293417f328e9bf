"""The short causal depthwise convolution (model/short_conv.py): transformers' Qwen3-Next torch
path (prefill and the decode update), packed documents against each document alone
(values, gradients, the final state), prefill then decode against the whole sequence."""

from __future__ import annotations

import pytest
import torch

from moetrain.model.document_starts import document_starts
from moetrain.model.short_conv import short_conv

B, S, CH, W = 2, 11, 6, 4
LENGTHS = [[3, 1, 7], [5, 6]]  # a document shorter than the kernel's reach


def _inputs(w=W, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, CH, generator=gen, dtype=dtype)
    weight = torch.randn(CH, w, generator=gen, dtype=dtype)
    bias = torch.randn(CH, generator=gen, dtype=dtype)
    state = torch.randn(B, w - 1, CH, generator=gen, dtype=dtype)
    return [t.requires_grad_() for t in (x, weight, bias, state)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to fp64 rounding (the packed-documents control shows what it catches)."""
    return torch.allclose(a, b, rtol=1e-13, atol=1e-13)


def _ids(lengths_per_row=LENGTHS) -> torch.Tensor:
    return torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths_per_row]
    )


@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_transformers_qwen3_next_conv(with_bias) -> None:
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        causal_conv1d_fn,
        causal_conv1d_update,
    )

    x, weight, bias, _ = (t.detach() for t in _inputs())
    bias = bias if with_bias else None
    y, state = short_conv(x, weight, bias, output_final_state=True)
    ref = causal_conv1d_fn(x.transpose(1, 2), weight, bias, activation="silu").transpose(1, 2)
    assert _same(y, ref)
    hf_state = state.transpose(1, 2).contiguous()  # transformers' (B, Ch, W - 1)
    for t in range(3):
        xt = torch.randn(B, 1, CH, dtype=x.dtype)
        ref = causal_conv1d_update(xt.transpose(1, 2), hf_state, weight, bias, activation="silu")
        y, state = short_conv(xt, weight, bias, initial_state=state, output_final_state=True)
        assert _same(y, ref.transpose(1, 2)), f"decode step {t}"
        assert _same(state, hf_state.transpose(1, 2)), f"decode state {t}"


def _per_document(x, weight, bias, state, lengths_per_row, activation="silu"):
    """Each document alone (the row's state feeding its first); outputs and final states."""
    ys, states = [], []
    for r, lengths in enumerate(lengths_per_row):
        a, row = 0, []
        for n, length in enumerate(lengths):
            init = state[r : r + 1] if n == 0 else None
            y, st = short_conv(
                x[r : r + 1, a : a + length], weight, bias, activation=activation,
                initial_state=init, output_final_state=True,
            )  # fmt: skip
            row.append(y)
            a += length
        ys.append(torch.cat(row, 1))
        states.append(st)
    return torch.cat(ys), torch.cat(states)


def _assert_packed_equals_separate(conv, lengths_per_row=LENGTHS, w=W, activation="silu"):
    ins = _inputs(w)
    x, weight, bias, state = ins
    y, st = conv(x, weight, bias, activation=activation, initial_state=state,
                 output_final_state=True, doc_ids=_ids(lengths_per_row))  # fmt: skip
    wy, ws = torch.randn_like(y), torch.randn_like(st)
    packed = torch.autograd.grad((y * wy).sum() + (st * ws).sum(), ins)
    y_sep, st_sep = _per_document(x, weight, bias, state, lengths_per_row, activation)
    separate = torch.autograd.grad((y_sep * wy).sum() + (st_sep * ws).sum(), ins)
    names = ["y", "state", "dx", "dweight", "dbias", "dstate"]
    got, ref = [y, st, *packed], [y_sep, st_sep, *separate]
    for name, a, b in zip(names, got, ref, strict=True):
        assert _same(a, b), f"{name} differs"


@pytest.mark.parametrize("w", [1, 2, 4, 6])
@pytest.mark.parametrize("activation", ["silu", None])
def test_packed_documents_equal_each_document_alone(w, activation) -> None:
    _assert_packed_equals_separate(short_conv, w=w, activation=activation)


def test_a_window_that_sees_the_previous_document_fails_the_packed_test() -> None:
    """The control: the plain convolution over the packed row."""

    def leaky(x, weight, bias, *, doc_ids, **kw):
        return short_conv(x, weight, bias, **kw)

    with pytest.raises(AssertionError):
        _assert_packed_equals_separate(leaky)


def test_prefill_then_decode_equals_the_whole_sequence() -> None:
    x, weight, bias, state = (t.detach() for t in _inputs())
    whole, end = short_conv(x, weight, bias, initial_state=state, output_final_state=True)
    y, st = short_conv(x[:, :5], weight, bias, initial_state=state, output_final_state=True)
    steps = [y]
    for t in range(5, S):
        yt, st = short_conv(
            x[:, t : t + 1], weight, bias, initial_state=st, output_final_state=True
        )
        steps.append(yt)
    assert _same(torch.cat(steps, 1), whole)
    assert _same(st, end)


def test_cu_seqlens_equal_doc_ids() -> None:
    x, weight, bias, _ = (t.detach() for t in _inputs())
    cu = torch.tensor([0, 3, 4, 11])
    a = short_conv(x[:1], weight, bias, cu_seqlens=cu, output_final_state=True)
    b = short_conv(x[:1], weight, bias, doc_ids=_ids(LENGTHS[:1]), output_final_state=True)
    assert all(_same(s, t) for s, t in zip(a, b, strict=True))
    assert document_starts(None, cu, 1, S).nonzero()[:, 1].tolist() == [3, 4]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"x": torch.zeros(B, S)}, "x must be"),
        ({"weight": torch.zeros(CH + 1, W)}, "weight must be"),
        ({"weight": torch.zeros(CH, 0)}, "W >= 1"),
        ({"bias": torch.zeros(CH + 1)}, "bias must be"),
        ({"activation": "gelu"}, "activation must be"),
        ({"initial_state": torch.zeros(B, W, CH)}, "initial_state must be"),
        ({"doc_ids": torch.zeros(B, S + 1)}, "doc_ids has shape"),
        ({"cu_seqlens": torch.tensor([0, 4, 3, S])}, "cu_seqlens must be"),
    ],
)
def test_bad_inputs_are_refused_by_name(kwargs, message) -> None:
    args = {"x": torch.zeros(B, S, CH), "weight": torch.zeros(CH, W)} | kwargs
    with pytest.raises(ValueError, match=message):
        short_conv(**args)
