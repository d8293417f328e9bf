"""The recurrent mixers' CUDA kernels against moetrain's torch paths, on a GPU (skipped unless a
CUDA device and the packages of ``pip install 'moetrain[kernels]'`` are present): causal-conv1d
against :func:`short_conv`, fla's ``chunk_gated_delta_rule`` / ``chunk_kda`` against
:func:`gated_delta_rule`, mamba-ssm's ``mamba_chunk_scan_combined`` against :func:`ssd_scan`,
each with packed documents and with an initial state, values and gradients (the state's
included), in fp32 and bf16; and each mixer's forward choosing the kernels on CUDA. The
tolerances are relative to the largest value: fp32 allows the kernels' TF32 products, bf16 its
rounding of the inputs; each test's negative control (the documents dropped) must miss by far
more."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from moetrain.model.delta_rule import gated_delta_rule
from moetrain.model.delta_rule_cuda import gated_delta_rule_fla
from moetrain.model.recurrent_kernels import load_package, use_recurrent_kernels
from moetrain.model.short_conv import short_conv
from moetrain.model.short_conv_cuda import short_conv_cuda
from moetrain.model.ssd_cuda import ssd_scan_cuda
from moetrain.model.ssd_scan import ssd_scan

PACKAGES = ("fla", "causal_conv1d", "mamba_ssm")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or any(importlib.util.find_spec(p) is None for p in PACKAGES),
    reason="needs a CUDA device and fla, causal-conv1d, mamba-ssm (moetrain[kernels])",
)
TOL = {torch.float32: 5e-3, torch.bfloat16: 5e-2}
DTYPES = (torch.float32, torch.bfloat16)
DEV = "cuda"
WIDE = {  # head dims the kernels' tiles take (16 and more)
    "gated_deltanet": {"model.linear_key_head_dim": 64, "model.linear_value_head_dim": 64},
    "kda": {"model.linear_head_dim": 64},
    "mamba2": {"model.mamba_head_dim": 32, "model.mamba_state_dim": 16},
}
WIDE["mamba2"]["model.mamba_chunk_size"] = 64


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _docs(b: int, s: int) -> torch.Tensor:
    """Row 0: documents of 70, 131 and the rest; row 1 one document."""
    ids = torch.zeros(b, s, dtype=torch.long, device=DEV)
    ids[0, 70:] = 1
    ids[0, 201:] = 2
    ids[1:] = 7
    return ids


def _compare(fn_kernel, fn_torch, inputs: dict, dtype: torch.dtype, grads: list[str]) -> None:
    """Run both on copies of ``inputs``; the first output and (when given) the final state,
    and the gradients of ``grads`` through a random weighting, within the dtype's tolerance."""
    runs = []
    for fn in (fn_kernel, fn_torch):
        leaves = {k: v.detach().clone().requires_grad_(k in grads) for k, v in inputs.items()}
        out, state = fn(**leaves)
        w = torch.randn(out.shape, device=DEV, generator=torch.Generator(DEV).manual_seed(5))
        loss = (out.float() * w).sum() + (0 if state is None else state.float().sum())
        loss.backward()
        runs.append((out, state, [leaves[k].grad for k in grads]))
    (out_k, st_k, g_k), (out_t, st_t, g_t) = runs
    tol = TOL[dtype]
    assert _rel(out_k, out_t) <= tol
    if st_t is not None:
        assert _rel(st_k, st_t) <= tol
    for name, a, b in zip(grads, g_k, g_t, strict=True):
        assert _rel(a, b) <= 2 * tol, name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["documents", "state"])
def test_causal_conv1d_equals_short_conv(dtype: torch.dtype, mode: str) -> None:
    gen = torch.Generator(DEV).manual_seed(0)
    b, s, ch, w = 2, 300, 64, 4
    inputs = {
        "x": torch.randn(b, s, ch, device=DEV, generator=gen).to(dtype),
        "weight": torch.randn(ch, w, device=DEV, generator=gen).to(dtype) * 0.5,
        "bias": torch.randn(ch, device=DEV, generator=gen).to(dtype),
    }
    extra = {}
    if mode == "documents":
        extra["doc_ids"] = _docs(b, s)
    else:
        inputs["initial_state"] = torch.randn(b, w - 1, ch, device=DEV, generator=gen).to(dtype)
        extra["output_final_state"] = True
    grads = [k for k in inputs]

    def call(fn):
        return lambda **kw: fn(kw.pop("x"), kw.pop("weight"), kw.pop("bias"), **kw, **extra)

    _compare(call(short_conv_cuda), call(short_conv), inputs, dtype, grads)
    if mode == "documents":  # negative control: the documents dropped
        y_doc, _ = short_conv_cuda(inputs["x"], inputs["weight"], inputs["bias"], **extra)
        y_row, _ = short_conv_cuda(inputs["x"], inputs["weight"], inputs["bias"])
        assert _rel(y_row, y_doc) > 4 * TOL[dtype]


def _rule_inputs(dtype, per_channel: bool, hk: int, hv: int, state: bool) -> dict:
    gen = torch.Generator(DEV).manual_seed(1)
    b, s, k, v = 2, 300, 64, 64
    g_shape = (b, s, hv, k) if per_channel else (b, s, hv)
    inputs = {
        "q": torch.randn(b, s, hk, k, device=DEV, generator=gen).to(dtype),
        "k": torch.randn(b, s, hk, k, device=DEV, generator=gen).to(dtype),
        "v": torch.randn(b, s, hv, v, device=DEV, generator=gen).to(dtype),
        # log decays per step in (-0.5, 0) (memory long enough for the documents to matter),
        # beta in (0, 1): fp32, as the mixers give them
        "g": -torch.rand(g_shape, device=DEV, generator=gen) * 0.5,
        "beta": torch.rand(b, s, hv, device=DEV, generator=gen),
    }
    if state:
        inputs["initial_state"] = torch.randn(b, hv, k, v, device=DEV, generator=gen) * 0.1
    return inputs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["documents", "state"])
@pytest.mark.parametrize("kind", ["gated_deltanet", "kda"])
def test_fla_equals_gated_delta_rule(dtype: torch.dtype, mode: str, kind: str) -> None:
    """Grouped value heads (Gated DeltaNet: 2 query/key heads, 4 value heads) or equal heads
    (KDA), L2 norm inside the kernel, documents or an initial state."""
    hk, hv = (2, 4) if kind == "gated_deltanet" else (4, 4)
    inputs = _rule_inputs(dtype, kind == "kda", hk, hv, mode == "state")
    extra = {"qk_l2norm": True}
    if mode == "documents":
        extra["doc_ids"] = _docs(2, 300)
    else:
        extra["output_final_state"] = True

    def torch_rule(**kw):
        return gated_delta_rule(**kw, **extra, chunk_size=64)

    _compare(lambda **kw: gated_delta_rule_fla(**kw, **extra), torch_rule, inputs, dtype, [*inputs])
    if mode == "documents":
        o_doc, _ = gated_delta_rule_fla(**inputs, **extra)
        o_row, _ = gated_delta_rule_fla(**inputs, qk_l2norm=True)
        assert _rel(o_row, o_doc) > 4 * TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["documents", "state"])
def test_mamba_equals_ssd_scan(dtype: torch.dtype, mode: str) -> None:
    """4 heads reading 2 groups, dt after softplus and limits (ours), the D skip, chunks of 64
    over 300 tokens; documents or an initial state."""
    gen = torch.Generator(DEV).manual_seed(2)
    b, s, h, p, g, n = 2, 300, 4, 32, 2, 16
    inputs = {
        "x": torch.randn(b, s, h, p, device=DEV, generator=gen).to(dtype),
        "dt": torch.rand(b, s, h, device=DEV, generator=gen) * 0.1 + 1e-3,
        "A": -torch.rand(h, device=DEV, generator=gen) * 4 - 0.5,
        "B": torch.randn(b, s, g, n, device=DEV, generator=gen).to(dtype),
        "C": torch.randn(b, s, g, n, device=DEV, generator=gen).to(dtype),
        "D": torch.rand(h, device=DEV, generator=gen) + 0.5,
    }
    extra = {"chunk_size": 64}
    if mode == "documents":
        extra["doc_ids"] = _docs(b, s)
    else:
        inputs["initial_state"] = torch.randn(b, h, p, n, device=DEV, generator=gen) * 0.1
        extra["output_final_state"] = True
    kernel = lambda **kw: ssd_scan_cuda(**kw, **extra)  # noqa: E731
    _compare(kernel, lambda **kw: ssd_scan(**kw, **extra), inputs, dtype, [*inputs])
    if mode == "documents":
        y_doc, _ = kernel(**inputs)
        y_row, _ = ssd_scan_cuda(**inputs, chunk_size=64)
        assert _rel(y_row, y_doc) > 4 * TOL[dtype]


@pytest.mark.parametrize("kind", ["gated_deltanet", "kda", "mamba2"])
def test_mixers_choose_the_kernels_on_cuda(kind: str) -> None:
    """Each mixer on CUDA runs the kernels and records it; in bf16 (weights and activations,
    packed documents) the kernel path is about as far from the fp32 torch path as the bf16
    torch path is (at most twice, or the bf16 tolerance)."""
    from tests.unit.test_recurrent_kernels import _inputs, _mixer

    for name in PACKAGES:
        assert load_package(name)[1] is None, load_package(name)[1]
    mixer = _mixer(kind, overrides=WIDE[kind]).to(DEV)
    x = torch.randn(2, 300, 32, device=DEV)
    docs = _docs(2, 300)
    use_recurrent_kernels("torch")
    try:
        ref = mixer(x, _inputs(300, docs))
        mixer.to(torch.bfloat16)
        torch_bf16 = mixer(x.bfloat16(), _inputs(300, docs))
    finally:
        use_recurrent_kernels("auto")
    mixer.kernel_choice.first = None
    kernel_bf16 = mixer(x.bfloat16(), _inputs(300, docs))
    assert mixer.kernel_choice.first == mixer.kernel_choice.kernels
    bound = max(2 * _rel(torch_bf16, ref), TOL[torch.bfloat16])
    assert _rel(kernel_bf16, ref) <= bound
