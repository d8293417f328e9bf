"""Gated DeltaNet's and Kimi Delta Attention's kernel path: the short convolution on
causal-conv1d (:mod:`moetrain.model.short_conv_cuda`) and the gated delta rule on fla's chunked
kernels, ``chunk_gated_delta_rule`` (a decay per head) and ``chunk_kda`` (per key channel), with
:func:`moetrain.model.delta_rule.gated_delta_rule`'s contract.

Our conventions against fla's (fla-core 0.6's documented API, read from its source):

- heads: q, k (B, S, Hk, K), v (B, S, H, V), value head h reads query/key head h // (H / Hk):
  fla's grouped value heads (``i_h // (HV // H)``), the same;
- q and k L2-normalised as ``x / sqrt(sum(x^2) + 1e-6)``: fla's ``use_qk_l2norm_in_kernel``
  (eps 1e-6, inside the square root), so the kernel's gradient goes through the norm;
- ``scale`` K ** -0.5, ``g`` the log decay (fp32; per head (B, S, H) or per key channel
  (B, S, H, K)), ``beta`` the write strength after its sigmoid (and x 2 with negative
  eigenvalues), both passed as we compute them (fla returns their gradients in their dtypes);
- the state (B, H, K, V) fp32, the key dim first (``state_v_first=False``); fla takes it as
  ``initial_state`` and returns the final one in fp32;
- packed documents: fla's ``cu_seqlens`` over one flattened row (B = 1): every row start and
  every document start is a sequence's start. Our calls with documents carry no state (the
  convolution cannot take both), so no per-sequence initial states are needed.

What fla does not take runs the torch path (:func:`rule_unsupported` says why): key head dims
over 256, dtypes other than fp32/bf16/fp16, documents together with a state. The one-token
decode step always runs the torch recurrence (a few small products per token).
"""

from __future__ import annotations

import torch

from moetrain.model.document_starts import document_starts
from moetrain.model.recurrent_kernels import load_package
from moetrain.model.short_conv_cuda import DTYPES, conv_unsupported

MAX_KEY_DIM = 256  # fla's chunked kernels' largest key head dim


def rule_unsupported(
    qkv: torch.Tensor, width: int, key_dim: int, docs: torch.Tensor | None, with_state: bool
) -> str | None:
    """Why the kernel path cannot run a convolution-and-rule call on ``qkv`` (B, S, Ch) with a
    convolution of ``width`` and key heads of ``key_dim`` (None: it can). (A one-token decode
    step never asks: it runs the torch recurrence.)"""
    if qkv.dtype not in DTYPES:
        return f"fla takes fp32/bf16/fp16 activations, not {qkv.dtype}"
    if key_dim > MAX_KEY_DIM:
        return f"fla takes key head dims up to {MAX_KEY_DIM}, not {key_dim}"
    return conv_unsupported(qkv, width, docs, with_state)


def cu_seqlens_of(doc_ids: torch.Tensor) -> torch.Tensor:
    """(N + 1,) int64 offsets of the N sequences of the (B, S) rows of ``doc_ids`` flattened
    into one: every row start and every document start begins one."""
    b, s = doc_ids.shape
    begins = document_starts(doc_ids, None, b, s)
    begins[:, 0] = True
    offsets = begins.reshape(-1).nonzero().squeeze(1)
    end = torch.tensor([b * s], dtype=offsets.dtype, device=offsets.device)
    return torch.cat([offsets, end]).to(torch.int64)


def gated_delta_rule_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    doc_ids: torch.Tensor | None = None,
    qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`~moetrain.model.delta_rule.gated_delta_rule` (scale K ** -0.5; same shapes and
    results) through fla's ``chunk_gated_delta_rule`` (g (B, S, H)) or ``chunk_kda``
    (g (B, S, H, K)); documents without a state (the module docstring)."""
    fla, why = load_package("fla")
    if fla is None:
        raise RuntimeError(why)
    if g.dim() == 4:
        from fla.ops.kda import chunk_kda as kernel
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as kernel
    if doc_ids is not None and (initial_state is not None or output_final_state):
        raise ValueError("the fla path takes documents or a state, not both")
    b, s = v.shape[:2]
    args: dict = {}
    if doc_ids is not None:  # one flattened row, a sequence per document
        q, k, v, g, beta = (t.reshape(1, b * s, *t.shape[2:]) for t in (q, k, v, g, beta))
        args["cu_seqlens"] = cu_seqlens_of(doc_ids)
    if initial_state is not None:
        args["initial_state"] = initial_state.float().contiguous()
    o, state = kernel(
        q,
        k,
        v,
        g,
        beta,
        scale=q.shape[-1] ** -0.5,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=qk_l2norm,
        **args,
    )
    return o.reshape(b, s, *o.shape[2:]), state if output_final_state else None
