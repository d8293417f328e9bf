"""The short causal depthwise convolution (:func:`moetrain.model.short_conv.short_conv`'s
contract) on causal-conv1d's CUDA kernel, ``causal_conv1d_fn``, for the recurrent mixers'
kernel paths (:mod:`moetrain.model.recurrent_kernels`).

causal-conv1d takes x (B, Ch, S), weight (Ch, W), a bias, ``seq_idx`` (B, S) int32 (a position
sees only earlier positions of its own sequence: our document restart), ``initial_states``
(B, Ch, W - 1) and returns the last W - 1 inputs as ``final_states``. ``seq_idx`` and the
states need the channel-last layout (stride 1 along Ch: our (B, S, Ch) tensors transposed,
which is free) with Ch a multiple of 8, and exclude each other; W is 2 to 4. A call outside
that runs the torch path (:func:`conv_unsupported` says why).
"""

from __future__ import annotations

import torch

from moetrain.model.recurrent_kernels import load_package, sequence_index

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def conv_unsupported(
    x: torch.Tensor,
    width: int,
    doc_ids: torch.Tensor | None,
    with_state: bool,
) -> str | None:
    """Why causal-conv1d cannot run this call of x (B, S, Ch) with a kernel of ``width``
    (None: it can); ``with_state``: an initial state is given or the final one is wanted."""
    b, s, ch = x.shape
    if x.dtype not in DTYPES:
        return f"causal-conv1d takes fp32/bf16/fp16 activations, not {x.dtype}"
    if not 2 <= width <= 4:
        return f"causal-conv1d takes a kernel width of 2 to 4, not {width}"
    if ch % 8:
        return f"causal-conv1d takes a multiple of 8 channels, not {ch}"
    if doc_ids is not None and with_state:
        return "causal-conv1d takes documents or a state, not both"
    if with_state and s < width - 1:
        return f"a state with fewer tokens ({s}) than the kernel width - 1 ({width - 1})"
    return None


def short_conv_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    doc_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`~moetrain.model.short_conv.short_conv` (same arguments and results: y (B, S, Ch),
    the state (B, W - 1, Ch) with ``output_final_state``) through ``causal_conv1d_fn``; for
    calls :func:`conv_unsupported` accepts."""
    module, why = load_package("causal_conv1d")
    if module is None:
        raise RuntimeError(why)
    x_BCS = x.contiguous().transpose(1, 2)  # channel-last: stride 1 along Ch
    seq_idx = None if doc_ids is None else sequence_index(doc_ids)
    init = None
    if initial_state is not None:  # (B, W - 1, Ch) -> (B, Ch, W - 1), channel-last
        init = initial_state.to(x.dtype).contiguous().transpose(1, 2)
    out = module.causal_conv1d_fn(
        x_BCS,
        weight.contiguous(),
        bias,
        seq_idx=seq_idx,
        initial_states=init,
        return_final_states=output_final_state,
        activation=activation,
    )
    if not output_final_state:
        return out.transpose(1, 2), None
    y, last = out
    return y.transpose(1, 2), last.transpose(1, 2).contiguous()
