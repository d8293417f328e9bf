"""The attention kernels' helpers every attention mixer shares (the mixers themselves are
:mod:`moetrain.model.mixers`): which kernel ``F.scaled_dot_product_attention`` picks and the
record of it, the dense document mask (the definition the masked paths are tested against), a
KV cache's causal mask, a weightless RMSNorm and Llama 4's query temperature.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from moetrain.model.rope import apply_rope, rope_tables

__all__ = [
    "apply_rope",
    "attention_report",
    "document_mask",
    "rope_tables",
    "temperature",
    "unit_rms",
]


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """A weightless RMSNorm over the last dim: ``x * rsqrt(mean(x^2) + eps)`` computed in fp32
    (or wider) and cast back to x's dtype (transformers' ``Llama4TextWeightlessRMSNorm``)."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def temperature(start: int, s: int, floor: int, scale: float, device: torch.device) -> torch.Tensor:
    """(s,) fp32 query multipliers of positions ``start .. start + s - 1``:
    ``log1p(floor((p + 1) / floor)) * scale + 1`` (Llama 4's attention temperature tuning)."""
    pos = torch.arange(start, start + s, device=device, dtype=torch.float32)
    return torch.log1p(torch.floor((pos + 1.0) / floor)) * scale + 1.0


def document_mask(doc_ids_BS: torch.Tensor, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """Block-causal mask (B, 1, S, S): boolean, True where query may attend to key; or, with a
    floating ``dtype``, additive (0 there, -inf elsewhere), as SDPA converts a boolean one."""
    s = doc_ids_BS.shape[1]
    causal_SS = torch.ones(s, s, dtype=torch.bool, device=doc_ids_BS.device).tril()
    same_BSS = doc_ids_BS[:, :, None] == doc_ids_BS[:, None, :]
    allowed_B1SS = (same_BSS & causal_SS)[:, None]
    if dtype == torch.bool:
        return allowed_B1SS
    out = torch.zeros(allowed_B1SS.shape, dtype=dtype, device=doc_ids_BS.device)
    return out.masked_fill_(~allowed_B1SS, float("-inf"))


def expand_kv_for_mask(device_type: str, grouped_kernel: str) -> bool:
    """Whether a masked call with grouped K/V should get K/V expanded to the query heads: on a
    GPU where torch would run ``grouped_kernel`` (its choice for the grouped call) = the math
    kernel, or cannot say which."""
    return device_type != "cpu" and grouped_kernel in ("math", "unknown")


def sdpa_kernel_name(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    enable_gqa: bool,
    scale: float | None = None,
) -> str:
    """The kernel ``F.scaled_dot_product_attention`` picks for these arguments on their device
    (``flash_attention``, ``efficient_attention``, ``cudnn_attention``, ``math``, ...), asked
    from torch's own selector; ``unknown`` where this torch cannot say."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return "unknown"
    try:
        from torch.nn.attention import SDPBackend

        index = choose(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=0.0,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return SDPBackend(index).name.lower()
    except (TypeError, ValueError, RuntimeError, ImportError):
        return "unknown"


def attention_report(model: nn.Module) -> str | None:
    """One line on the attention kernels the model's layers used on their first call (None
    before any call), e.g. ``efficient_attention (mask, K/V expanded to 16 heads)``."""
    seen = [k for m in model.modules() if (k := getattr(m, "sdpa_kernel", None))]
    return ", ".join(dict.fromkeys(seen)) if seen else None


def cache_causal_mask(pos: int, s: int, device: torch.device) -> torch.Tensor | None:
    """(1, 1, s, pos + s) boolean mask for ``s`` new queries after ``pos`` cached positions
    (None when s == 1: one query may attend to every position)."""
    if s == 1:
        return None
    q = torch.arange(pos, pos + s, device=device)
    kv = torch.arange(pos + s, device=device)
    return (kv[None, :] <= q[:, None])[None, None]


def record_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    gqa: bool,
    note: str,
    scale: float | None = None,
) -> str:
    """``"<kernel> (<note>)"`` for an attention module's ``sdpa_kernel`` record; warns when a
    GPU call runs the math kernel."""
    name = sdpa_kernel_name(q, k, v, mask, causal, gqa, scale)
    if name == "math" and q.is_cuda:
        warnings.warn(
            f"attention runs torch's math kernel on {q.device} ({note}, {q.dtype}, head dim "
            f"{q.shape[-1]}): it keeps (B, H, S, S) scores; check the dtype (bf16/fp16) and "
            "the head dim (a multiple of 8, at most 256)",
            stacklevel=3,
        )
    return f"{name} ({note})"
