"""Grouped-query attention with rotary position embeddings (RoPE).

Shape legend: B batch, S sequence, D d_model, H query heads, G key/value heads, Hd head dim.
RoPE (``model/rope.py``) uses the "rotate half" layout (first half / second half of each head),
as Llama and Mixtral in Hugging Face transformers do, so q/k projection weights map across
unchanged; ``model.rope_interleave`` takes adjacent pairs instead.

Kernels: causal attention without a mask passes grouped K/V (``enable_gqa``), which flash
attention takes. A mask (document masking, or several new tokens against a KV cache) rules out
flash attention, and memory-efficient attention takes grouped K/V only on recent torch builds.
So on a GPU, when torch's own selector would run the math kernel for the grouped masked call
(whose (B, H, S, S) scores do not fit at training sizes), K/V are expanded to the H query heads
first (same values), which memory-efficient attention takes everywhere. CPU kernels take grouped
K/V with a mask, so CPU runs are unchanged. Packed documents never build a mask: every
document is attended causally on its own (:mod:`moetrain.model.doc_attention`); the dense
:func:`document_mask` stays as the definition that path is tested against. Each :class:`Attention` records
the kernel torch picked on its first call (``sdpa_kernel``); :func:`attention_report`
summarises them for the log (multi-head latent attention, ``model/mla.py``, records its own).

A layer with a sliding window (``model.sliding_window`` / ``model.layer_types``), chunked
attention (``model.attention_chunk_size``) or attention sinks (``model.attention_sinks``) attends
through :mod:`moetrain.model.local_attention` instead (no S x S tensor either, packed documents
and the KV cache included); the others run the paths above unchanged.

Llama 4's pieces, per layer: a NoPE layer (``model.nope_layers``) skips RoPE; a RoPE layer with
``model.qk_norm_after_rope`` normalises each query and key head after RoPE (a weightless
RMSNorm, eps ``model.norm_eps``, in fp32 and back to the input dtype); a NoPE layer with
``model.attn_temperature_floor`` multiplies each query at position p by
``log1p(floor((p + 1) / floor)) * scale + 1`` (:func:`temperature`). p is the position in the
row, as RoPE's (a KV cache's queries continue at ``cache.pos``; packed documents do not restart
it), which is transformers' position for one sequence without padding.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.config import ModelConfig
from moetrain.model.cpu_matmul import Linear
from moetrain.model.doc_attention import Documents, document_attention
from moetrain.model.head_exchange import HeadExchange, exchange_to_heads, exchange_to_sequence
from moetrain.model.layers import RMSNorm
from moetrain.model.local_attention import cached_attention, chunked_attention, local_attention
from moetrain.model.logit_max import observe_logits
from moetrain.model.rope import apply_rope, rope_tables

__all__ = [
    "Attention",
    "KVCache",
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


class KVCache:
    """Keys and values of every layer for incremental decoding (inference only).

    ``k``, ``v``: (n_layers, B, G, max_len, Hd); ``pos``: tokens cached so far (the position of
    the next token). ``Transformer.forward(..., cache=c)`` attends over the cache, appends the
    new keys/values and advances ``pos``.
    """

    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.pos = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def append(
        self, layer: int, k_BGsHd: torch.Tensor, v_BGsHd: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``s`` new positions at ``pos`` for ``layer``; return all keys/values so far."""
        end = self.pos + k_BGsHd.shape[2]
        self.k[layer, :, :, self.pos : end] = k_BGsHd
        self.v[layer, :, :, self.pos : end] = v_BGsHd
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token takes, all layers: keys and values of every K/V head."""
        n_layers, _, g, _, hd = self.k.shape
        return 2 * n_layers * g * hd * self.k.element_size()

    def causal_mask(self, s: int) -> torch.Tensor | None:
        """(1, 1, s, pos + s) boolean mask for ``s`` new queries (None when s == 1)."""
        return cache_causal_mask(self.pos, s, self.k.device)


def cache_causal_mask(pos: int, s: int, device: torch.device) -> torch.Tensor | None:
    """(1, 1, s, pos + s) boolean mask for ``s`` new queries after ``pos`` cached positions
    (None when s == 1: one query may attend to every position)."""
    if s == 1:
        return None
    q = torch.arange(pos, pos + s, device=device)
    kv = torch.arange(pos + s, device=device)
    return (kv[None, :] <= q[:, None])[None, None]


class Attention(nn.Module):
    """Causal grouped-query attention through ``F.scaled_dot_product_attention``; block
    ``layer``'s window is ``cfg.attention_window(layer)``."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.attention_head_dim
        d, hd = cfg.d_model, self.head_dim
        self.wq = Linear(d, self.n_heads * hd, bias=cfg.qkv_bias)
        self.wk = Linear(d, self.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.wv = Linear(d, self.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.wo = Linear(self.n_heads * hd, d, bias=cfg.o_bias)
        self.window = cfg.attention_window(layer)  # None: full causal attention
        self.chunk = cfg.attention_chunk(layer)  # None: not chunked
        self.rope = cfg.has_rope(layer)  # False: a NoPE layer
        # the weightless post-RoPE norm's eps (model.qk_norm_after_rope, RoPE layers), or None
        self.post_rope_eps = cfg.norm_eps if cfg.qk_norm_after_rope and self.rope else None
        self.temperature = cfg.attn_temperature(layer)  # (floor, scale) on NoPE layers, or None
        # the sink logit of each query head (model.attention_sinks); None without sinks
        self.sinks = nn.Parameter(torch.empty(self.n_heads)) if cfg.attention_sinks else None
        # per head: normalise each (Hd,) head vector; per projection (OLMoE): the whole
        # (heads * Hd,) projection, before it is split into heads
        self.qk_norm_per_head = cfg.qk_norm_scope == "head"
        q_dim, k_dim = (
            (hd, hd) if self.qk_norm_per_head else (self.n_heads * hd, self.n_kv_heads * hd)
        )
        self.q_norm = RMSNorm(q_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.rope_interleave = cfg.rope_interleave
        self.scale = cfg.attention_scale  # the softmax scale; None = 1 / sqrt(head_dim)
        self.sdpa_kernel: str | None = None  # what the first call ran (see module docstring)
        # sequence parallelism: set from outside (model/head_exchange.py); None = one device
        self.head_exchange: HeadExchange | None = None

    def forward(
        self,
        x_BSD: torch.Tensor,
        cos_SHd: torch.Tensor,
        sin_SHd: torch.Tensor,
        mask_B1SS: torch.Tensor | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        """Attend causally, or within ``mask_B1SS`` (boolean, True = may attend) when given.

        With ``cache``, ``cos``/``sin`` start at ``cache.pos``; keys and values are appended to
        layer ``layer`` of the cache and the queries attend to every cached position.
        """
        b, s, _ = x_BSD.shape
        q, k = self.wq(x_BSD), self.wk(x_BSD)
        norm = self.q_norm is not None and self.k_norm is not None
        if norm and not self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, s, self.n_heads, self.head_dim)
        k = k.view(b, s, self.n_kv_heads, self.head_dim)
        v = self.wv(x_BSD).view(b, s, self.n_kv_heads, self.head_dim)
        if norm and self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q_BHSHd, k_BGSHd = q.transpose(1, 2), k.transpose(1, 2)
        if self.rope:
            q_BHSHd = apply_rope(q_BHSHd, cos_SHd, sin_SHd, self.rope_interleave)
            k_BGSHd = apply_rope(k_BGSHd, cos_SHd, sin_SHd, self.rope_interleave)
        if self.post_rope_eps is not None:
            eps = self.post_rope_eps
            q_BHSHd, k_BGSHd = unit_rms(q_BHSHd, eps), unit_rms(k_BGSHd, eps)
        v_BGSHd = v.transpose(1, 2)
        gqa = self.n_kv_heads != self.n_heads
        ex = self.head_exchange
        if ex is not None:  # sequence parallel: whole sequences, this rank's heads
            if cache is not None:
                raise ValueError("a KV cache runs on one device, without a head exchange")
            q_BHSHd, k_BGSHd, v_BGSHd = exchange_to_heads(ex, q_BHSHd, k_BGSHd, v_BGSHd)
            gqa = k_BGSHd.shape[1] != q_BHSHd.shape[1]
        if self.temperature is not None:  # whole rows here: positions from 0 (or the cache's)
            floor, scale = self.temperature
            start = cache.pos if cache is not None else 0
            t_S = temperature(start, q_BHSHd.shape[2], floor, scale, q_BHSHd.device)
            q_BHSHd = (q_BHSHd * t_S[:, None]).to(q_BHSHd.dtype)  # (in fp32, as transformers)
        if cache is None:  # the per-head largest logit, when tracked (model/logit_max.py)
            scale = self.scale if self.scale is not None else self.head_dim**-0.5
            observe_logits(self, q_BHSHd, k_BGSHd, scale, mask_B1SS, self.window, self.chunk)
        if self.window is not None or self.chunk is not None or self.sinks is not None:
            out_BHSHd = self._local(q_BHSHd, k_BGSHd, v_BGSHd, mask_B1SS, cache, layer, gqa)
            if ex is not None:
                return self.wo(exchange_to_sequence(ex, out_BHSHd).reshape(b, s, -1))
            return self.wo(out_BHSHd.transpose(1, 2).reshape(b, s, -1))
        if isinstance(mask_B1SS, Documents):  # packed documents: causal within each one
            if self.sdpa_kernel is None:
                self.sdpa_kernel = record_kernel(
                    q_BHSHd,
                    k_BGSHd,
                    v_BGSHd,
                    None,
                    True,
                    gqa,
                    "documents, no S x S mask",
                    self.scale,
                )
            out_BHSHd = document_attention(
                q_BHSHd, k_BGSHd, v_BGSHd, mask_B1SS, gqa, scale=self.scale
            )
            if ex is not None:
                return self.wo(exchange_to_sequence(ex, out_BHSHd).reshape(b, s, -1))
            return self.wo(out_BHSHd.transpose(1, 2).reshape(b, s, -1))
        causal = mask_B1SS is None
        if cache is not None:
            k_BGSHd, v_BGSHd = cache.append(layer, k_BGSHd, v_BGSHd)
            mask_B1SS, causal = cache.causal_mask(s), False
        note = "causal" if causal else "mask"
        if gqa and mask_B1SS is not None:
            grouped = sdpa_kernel_name(
                q_BHSHd, k_BGSHd, v_BGSHd, mask_B1SS, causal, True, self.scale
            )
            if expand_kv_for_mask(q_BHSHd.device.type, grouped):  # off the math kernel
                rep = self.n_heads // self.n_kv_heads
                k_BGSHd = k_BGSHd.repeat_interleave(rep, dim=1)
                v_BGSHd = v_BGSHd.repeat_interleave(rep, dim=1)
                gqa, note = False, f"mask, K/V expanded to {self.n_heads} heads"
        if self.sdpa_kernel is None:
            self.sdpa_kernel = record_kernel(
                q_BHSHd, k_BGSHd, v_BGSHd, mask_B1SS, causal, gqa, note, self.scale
            )
        out_BHSHd = F.scaled_dot_product_attention(
            q_BHSHd,
            k_BGSHd,
            v_BGSHd,
            attn_mask=mask_B1SS,
            is_causal=causal,
            enable_gqa=gqa,
            scale=self.scale,
        )
        if ex is not None:
            return self.wo(exchange_to_sequence(ex, out_BHSHd).reshape(b, s, -1))
        return self.wo(out_BHSHd.transpose(1, 2).reshape(b, s, -1))

    def qk_clip_scales(self, gamma_H: torch.Tensor) -> dict[str, torch.Tensor]:
        """Row multipliers of the query and key projections (weights, and biases with
        ``model.qkv_bias``) by which head h's logits scale by ``gamma_H[h]`` (QK-clip): a key
        head serves H / G query heads, so its rows take the square root of the smallest gamma
        among them and each query head's rows the rest of its own."""
        gamma_GR = gamma_H.view(self.n_kv_heads, -1)
        key_G = gamma_GR.amin(dim=1).sqrt()
        query = (gamma_GR / key_G[:, None]).reshape(-1).repeat_interleave(self.head_dim)
        key = key_G.repeat_interleave(self.head_dim)
        kinds = ("weight", "bias") if self.wq.bias is not None else ("weight",)
        return {f"{w}.{kind}": rows for w, rows in (("wq", query), ("wk", key)) for kind in kinds}

    def _local(
        self,
        q_BHSHd: torch.Tensor,
        k_BGSHd: torch.Tensor,
        v_BGSHd: torch.Tensor,
        mask: torch.Tensor | Documents | None,
        cache: KVCache | None,
        layer: int,
        gqa: bool,
    ) -> torch.Tensor:
        """Attention with this layer's window or chunks and / or sinks
        (:mod:`local_attention`)."""
        sinks_H = self.sinks
        ex = self.head_exchange
        if sinks_H is not None and ex is not None:  # this rank's heads
            h = q_BHSHd.shape[1]
            sinks_H = sinks_H[ex.rank * h : (ex.rank + 1) * h]
        window, chunk = self.window, self.chunk
        note = ", ".join(
            ([f"window {window}"] if window is not None else [])
            + ([f"chunks of {chunk}"] if chunk is not None else [])
            + (["sinks"] if sinks_H is not None else [])
        )
        if self.sdpa_kernel is None:
            self.sdpa_kernel = record_kernel(
                q_BHSHd, k_BGSHd, v_BGSHd, None, True, gqa, note, self.scale
            )
        args = (window, sinks_H, gqa, self.scale)
        if isinstance(mask, Documents):  # (a chunked layer's: cut at the chunks, chunk_segments)
            return document_attention(q_BHSHd, k_BGSHd, v_BGSHd, mask, gqa, self.scale, *args[:2])
        if mask is not None:
            raise ValueError("a layer with a window, chunks or sinks takes no explicit mask")
        if cache is not None:
            k_BGSHd, v_BGSHd = cache.append(layer, k_BGSHd, v_BGSHd)
            return cached_attention(q_BHSHd, k_BGSHd, v_BGSHd, *args, chunk=chunk)
        if chunk is not None:
            return chunked_attention(q_BHSHd, k_BGSHd, v_BGSHd, chunk, sinks_H, gqa, self.scale)
        return local_attention(q_BHSHd, k_BGSHd, v_BGSHd, *args)


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
