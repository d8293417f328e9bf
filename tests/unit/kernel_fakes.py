"""Stand-ins for the recurrent mixers' CUDA kernel packages, written from their documented APIs
(fla-core 0.6's ``chunk_gated_delta_rule`` / ``chunk_kda``, causal-conv1d's
``causal_conv1d_fn`` with its layout checks, mamba-ssm 2.2's ``mamba_chunk_scan_combined``) as
plain torch, so that the CPU tests run moetrain's calls into them: the argument mapping (head
layouts, channel-last strides, ``cu_seqlens`` / ``seq_idx``, states' layouts) is what they
check, not the kernels. Each computes per sequence with an independent loop."""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F

from moetrain.model.delta_rule import gated_delta_rule_recurrent
from moetrain.model.ssd_scan import ssd_recurrent


def causal_conv1d_fn(
    x,
    weight,
    bias=None,
    seq_idx=None,
    initial_states=None,
    return_final_states=False,
    final_states_out=None,
    activation=None,
):
    """causal-conv1d's contract: x (B, D, L), weight (D, W), seq_idx (B, L) int32,
    initial_states (B, D, W - 1), the CUDA extension's checks on layouts asserted."""
    b, dim, length = x.shape
    w = weight.shape[1]
    assert activation in (None, "silu", "swish") and 2 <= w <= 4
    assert x.stride(2) == 1 or x.stride(1) == 1
    channel_last = x.stride(1) == 1 and x.stride(2) > 1
    if channel_last:
        assert dim % 8 == 0 and x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0
    if bias is not None:
        assert bias.dtype == weight.dtype and bias.shape == (dim,)
    if seq_idx is not None:
        assert channel_last and initial_states is None and not return_final_states
        assert seq_idx.dtype == torch.int32 and seq_idx.is_contiguous()
        assert seq_idx.shape == (b, length)
    if return_final_states:
        assert x.stride(1) == 1, "Only channel-last layout support returning final_states_out"
    if initial_states is None:
        initial_states = x.new_zeros(b, dim, w - 1)
    assert initial_states.shape == (b, dim, w - 1)
    full = torch.cat([initial_states, x], dim=-1)
    last = full[..., length:].clone()  # the last W - 1 inputs, the initial ones included
    full, weight = full.float(), weight.float()  # the kernel sums in fp32
    out = full.new_zeros(b, dim, length)
    if bias is not None:
        out = out + bias.float()[None, :, None]
    t = torch.arange(length)
    for j in range(w):  # tap j reads position t - (W - 1) + j
        tap = weight[None, :, j, None] * full[..., j : j + length]
        if seq_idx is not None:
            src = t - (w - 1) + j
            same = seq_idx[:, src.clamp(min=0)] == seq_idx
            tap = tap * (same & (src >= 0))[:, None, :]
        out = out + tap
    out = F.silu(out) if activation else out
    y = torch.empty_like(x).copy_(out)  # the kernel writes in x's dtype and layout
    return (y, last) if return_final_states else y


def _per_sequence(q, k, v, g, beta, scale, initial_state, output_final_state, l2, cu_seqlens):
    """fla's contract: rows of B, or the sequences of ``cu_seqlens`` in one row (B = 1), each
    with its own initial state; value head i reads query/key head i // (HV // H)."""
    if l2:
        q, k = _l2(q), _l2(k)
    if cu_seqlens is None:
        bounds = None
        n = q.shape[0]
    else:
        assert q.shape[0] == 1 and cu_seqlens.dtype == torch.int64
        bounds = cu_seqlens.tolist()
        n = len(bounds) - 1
    if initial_state is not None:
        assert initial_state.dtype == torch.float32 and initial_state.shape[0] == n
    outs, states = [], []
    for i in range(n):
        if bounds is None:
            sl = (slice(i, i + 1), slice(None))
        else:
            sl = (slice(0, 1), slice(bounds[i], bounds[i + 1]))
        o, st = gated_delta_rule_recurrent(
            q[sl],
            k[sl],
            v[sl],
            g[sl],
            beta[sl],
            scale=scale,
            initial_state=None if initial_state is None else initial_state[i : i + 1],
            output_final_state=True,
        )
        outs.append(o)
        states.append(st)
    o = torch.cat(outs, dim=0 if bounds is None else 1)
    return o.to(q.dtype), torch.cat(states) if output_final_state else None


def _l2(x):
    x32 = x.float()
    return (x32 * torch.rsqrt((x32 * x32).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    **kwargs,
):
    assert g.shape == v.shape[:3] and beta.shape == v.shape[:3] and q.shape == k.shape
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    args = (scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    return _per_sequence(q, k, v, g, beta, *args)


def chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    **kwargs,
):
    assert g.shape == (*v.shape[:3], k.shape[-1]) and beta.shape == v.shape[:3]
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    args = (scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    return _per_sequence(q, k, v, g, beta, *args)


def mamba_chunk_scan_combined(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    seq_idx=None,
    cu_seqlens=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
    return_varlen_states=False,
):
    """mamba-ssm's contract: the state restarts where ``seq_idx`` changes, ``initial_states``
    feed the positions numbered 0; out in x's dtype."""
    assert z is None and not return_varlen_states
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit != (0.0, float("inf")):
        dt = dt.clamp(*dt_limit)
    if seq_idx is not None:
        assert seq_idx.dtype == torch.int32 and seq_idx.shape == x.shape[:2]
    y, state = ssd_recurrent(
        x, dt, A, B, C, D, initial_state=initial_states, output_final_state=True, doc_ids=seq_idx
    )
    y = y.to(x.dtype)
    return (y, state) if return_final_states else y


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def install(monkeypatch, versions: dict[str, str] | None = None) -> None:
    """Put the stand-ins in ``sys.modules`` (``versions``: their ``__version__``s) for one
    test, and forget the packages moetrain imported before."""
    from moetrain.model import recurrent_kernels

    v = {"fla": "0.6.0", "causal_conv1d": "1.5.0", "mamba_ssm": "2.2.4", **(versions or {})}
    modules = {
        "fla": _module("fla", __version__=v["fla"]),
        "fla.ops": _module("fla.ops"),
        "fla.ops.gated_delta_rule": _module(
            "fla.ops.gated_delta_rule", chunk_gated_delta_rule=chunk_gated_delta_rule
        ),
        "fla.ops.kda": _module("fla.ops.kda", chunk_kda=chunk_kda),
        "causal_conv1d": _module(
            "causal_conv1d", __version__=v["causal_conv1d"], causal_conv1d_fn=causal_conv1d_fn
        ),
        "mamba_ssm": _module("mamba_ssm", __version__=v["mamba_ssm"]),
        "mamba_ssm.ops": _module("mamba_ssm.ops"),
        "mamba_ssm.ops.triton": _module("mamba_ssm.ops.triton"),
        "mamba_ssm.ops.triton.ssd_combined": _module(
            "mamba_ssm.ops.triton.ssd_combined",
            mamba_chunk_scan_combined=mamba_chunk_scan_combined,
        ),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(recurrent_kernels, "_imported", {})
