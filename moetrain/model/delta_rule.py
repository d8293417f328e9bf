"""The gated delta rule (Gated DeltaNet, Qwen3-Next / Qwen3.5; Kimi Delta Attention's per-channel
decay): a chunked form for training and the token-by-token recurrence (the reference, and the
decode step).

Shape legend: B batch, S sequence, Hk query/key heads, H value heads (a multiple of Hk: value
head h reads query/key head h // (H / Hk), as Qwen3-Next repeats them), K key head dim, V value
head dim.

Per head and token t, with a state S (K, V) (zero, or ``initial_state``, before the row):

    S <- exp(g_t) * S                      (per head; per key channel: diag(exp(g_t)) S)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T (scale * q_t)

``g`` is a log decay (<= 0), ``beta`` the write strength ((0, 1) for Qwen3-Next, (0, 2) for
Olmo-Hybrid's negative eigenvalues: any value works). Packed documents: the state restarts
from zero at every document start (a position whose id differs from the one before, or an
offset in ``cu_seqlens``), so a packed row computes exactly what its documents compute one by
one; ``initial_state`` feeds the row's first document (which may continue one begun before the
row: generation, a sequence-parallel slice), and the final state is the row's last document's.

Numerics: whatever the inputs' dtype, decays, gates and the state are fp32 (fp64 for fp64
inputs); the output is in ``v``'s dtype, the final state in fp32 (fp64), each gradient in its
input's dtype.
"""

from __future__ import annotations

import torch

from moetrain.model.delta_rule_chunked import ChunkedGatedDelta
from moetrain.model.document_starts import document_starts


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, in fp32 (fp64 for fp64), as Qwen3-Next and
    fla normalize queries and keys."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _check(q, k, v, g, beta, initial_state) -> None:
    """Shapes and dtypes, each refusal naming the tensor and what is allowed."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(
            f"q and k must be (B, S, Hk, K) and equal; got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    b, s, hk, dk = q.shape
    if s < 1:
        raise ValueError(f"q, k, v must hold at least one position; got S = {s}")
    if v.dim() != 4 or v.shape[:2] != (b, s) or v.shape[2] % hk:
        raise ValueError(
            f"v must be (B, S, H, V) with H a multiple of Hk = {hk}; got "
            f"{tuple(v.shape)} for q {tuple(q.shape)}"
        )
    h = v.shape[2]
    if tuple(beta.shape) != (b, s, h):
        raise ValueError(f"beta must be (B, S, H) = {(b, s, h)}; got {tuple(beta.shape)}")
    if tuple(g.shape) not in ((b, s, h), (b, s, h, dk)):
        raise ValueError(
            f"g (log decay) must be (B, S, H) = {(b, s, h)} (per head) or "
            f"(B, S, H, K) = {(b, s, h, dk)} (per key channel); got {tuple(g.shape)}"
        )
    state = (b, h, dk, v.shape[3])
    if initial_state is not None and tuple(initial_state.shape) != state:
        raise ValueError(
            f"initial_state must be (B, H, K, V) = {state}; got {tuple(initial_state.shape)}"
        )
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor; got {x.dtype}")


def _inputs(q, k, v, g, beta, initial_state, doc_ids, cu_seqlens, scale, qk_l2norm):
    _check(q, k, v, g, beta, initial_state)
    starts = document_starts(doc_ids, cu_seqlens, q.shape[0], q.shape[1])
    if qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    return q, k, starts, q.shape[-1] ** -0.5 if scale is None else scale


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    doc_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    qk_l2norm: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule in chunks of ``chunk_size`` (for training and prefill): memory linear
    in S, equal to :func:`gated_delta_rule_recurrent` up to rounding, values and gradients.

    q, k (B, S, Hk, K); v (B, S, H, V); g (B, S, H) or (B, S, H, K); beta (B, S, H);
    ``scale`` defaults to K ** -0.5; ``initial_state`` (B, H, K, V); ``doc_ids`` (B, S) or
    ``cu_seqlens`` (D + 1,) restart the state at every document; ``qk_l2norm`` normalizes q and
    k first. Returns o (B, S, H, V) and, with ``output_final_state``, the state (B, H, K, V).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    q, k, starts, scale = _inputs(
        q, k, v, g, beta, initial_state, doc_ids, cu_seqlens, scale, qk_l2norm
    )
    o, state = ChunkedGatedDelta.apply(q, k, v, g, beta, initial_state, starts, chunk_size, scale)
    return o, state if output_final_state else None


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    doc_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule token by token: the definition (the module docstring), and the
    decode step (S = 1 with the cached state). Arguments and results as
    :func:`gated_delta_rule`; gradients through autograd."""
    q, k, starts, scale = _inputs(
        q, k, v, g, beta, initial_state, doc_ids, cu_seqlens, scale, qk_l2norm
    )
    dt = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
    rep = v.shape[2] // k.shape[2]
    q = q.to(dt).repeat_interleave(rep, 2) * scale
    k = k.to(dt).repeat_interleave(rep, 2)
    decay = g.to(dt).exp()
    decay = decay.unsqueeze(-1) if g.dim() == 3 else decay  # (B, S, H, K or 1)
    if starts is not None:
        decay = decay * (~starts)[:, :, None, None]
    beta = beta.to(dt).unsqueeze(-1)
    out_dtype, v = v.dtype, v.to(dt)
    b, s, h, dv = v.shape
    state = q.new_zeros(b, h, k.shape[-1], dv) if initial_state is None else initial_state.to(dt)
    out = []
    for t in range(s):
        state = state * decay[:, t].unsqueeze(-1)
        kt = k[:, t].unsqueeze(-1)  # (B, H, K, 1)
        delta = beta[:, t] * (v[:, t] - (state * kt).sum(-2))
        state = state + kt * delta.unsqueeze(-2)
        out.append((state * q[:, t].unsqueeze(-1)).sum(-2))
    return torch.stack(out, 1).to(out_dtype), state if output_final_state else None
