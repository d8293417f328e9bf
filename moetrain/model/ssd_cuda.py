"""Mamba-2's kernel path: the short convolution on causal-conv1d
(:mod:`moetrain.model.short_conv_cuda`) and the chunked scan on mamba-ssm's Triton kernel,
``mamba_chunk_scan_combined``, with :func:`moetrain.model.ssd_scan.ssd_scan`'s contract.

Our conventions against mamba-ssm's (2.2's documented API, read from its source):

- x (B, S, H, P), dt (B, S, H), A (H,), B and C (B, S, G, N), head h reads group h // (H / G):
  mamba-ssm's ``nheads_ngroups_ratio``, the same;
- dt is passed as we compute it, after ``softplus(dt + dt_bias)`` and the clamp to
  ``(mamba_dt_min, mamba_dt_max)`` in fp32 (so ``dt_bias=None``, ``dt_softplus=False``, no
  ``dt_limit``): the step and its limits stay ours and autograd takes their gradients;
- ``D`` (H,) the skip ``+ D x``, inside the kernel; the gate z is not passed (the gated norm
  stays ours);
- the state (B, H, P, N) fp32: ``initial_states`` in, ``return_final_states`` out;
- packed documents: ``seq_idx`` (B, S) int32, each row's documents numbered from 0. mamba-ssm
  resets the state where ``seq_idx`` changes and feeds ``initial_states`` to the positions
  numbered 0 (the row's first document), as our scan does.

The output comes in x's dtype (ours: fp32); the gated norm computes in fp32 either way. The
one-token decode step always runs the torch recurrence, and a call the convolution kernel does
not take (:func:`~moetrain.model.short_conv_cuda.conv_unsupported`) the torch path.
"""

from __future__ import annotations

import torch

from moetrain.model.recurrent_kernels import load_package, sequence_index


def ssd_scan_cuda(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    *,
    chunk_size: int = 256,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    doc_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`~moetrain.model.ssd_scan.ssd_scan` (same arguments and results, y in x's dtype)
    through ``mamba_chunk_scan_combined`` (the module docstring)."""
    module, why = load_package("mamba_ssm")
    if module is None:
        raise RuntimeError(why)
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    out = mamba_chunk_scan_combined(
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=D,
        initial_states=None if initial_state is None else initial_state.float().contiguous(),
        seq_idx=None if doc_ids is None else sequence_index(doc_ids),
        return_final_states=output_final_state,
    )
    if not output_final_state:
        return out, None
    y, state = out
    return y, state.float()
