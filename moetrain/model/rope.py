"""Rotary position embeddings (RoPE): the frequency tables, YaRN and llama3 scaling, and the
rotation.

Shape legend: S sequence, R rotary dims (a head's dims that are rotated), B batch, H heads.

Tables are ``cos_SR``/``sin_SR`` with ``cat(freqs, freqs)`` columns, in fp32. The rotation uses
the "rotate half" layout (first half / second half of the rotary dims), as Llama in Hugging
Face transformers does. ``interleaved=True`` takes transformers' ``rope_interleave`` convention
(DeepSeek's released weights): the rotary dims come in adjacent pairs ``(x0, x1), (x2, x3), ...``;
they are gathered into ``[x0, x2, ... | x1, x3, ...]`` and rotated as above, which is what
transformers computes (its result is laid out the same way).

YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension"), as transformers 5.25's
``_compute_yarn_parameters`` computes it: each frequency is blended between the original one
(extrapolation) and the one divided by ``factor`` (interpolation) by a linear ramp over the dims
between the correction dims of ``beta_fast`` and ``beta_slow`` rotations within the original
context (floored / ceiled unless ``model.rope_truncate`` is false), and cos/sin are multiplied by the attention factor
``m(factor, mscale) / m(factor, mscale_all_dim)`` when both are set, else ``m(factor, 1)``,
with ``m(s, a) = 0.1 * a * ln(s) + 1`` (1 for ``s <= 1``). Multi-head latent attention also
multiplies its softmax scale by ``m(factor, mscale_all_dim) ** 2`` (:func:`softmax_mscale`),
as DeepSeek's models do; grouped-query attention does not, as transformers' Llama does not.

Llama 3.1's scaling (``rope_scaling: llama3``, transformers' ``_compute_llama3_parameters``):
frequencies whose wavelength exceeds ``original / low_freq_factor`` are divided by ``factor``,
those shorter than ``original / high_freq_factor`` kept, and those between blended linearly in
``original / wavelength``; cos and sin are not rescaled.

LongRoPE (``rope_scaling: longrope``, Phi-3's; transformers' ``_compute_longrope_parameters``):
each inverse frequency is divided by its own factor, ``1 / (factor_i * theta ** (2i / dim))``,
and cos/sin are multiplied by the attention factor (``model.rope_attention_factor``; unset,
``sqrt(1 + ln(s) / ln(original))`` with ``s = max_seq_len / original``, 1 for ``s <= 1``).
transformers picks the short factors while the sequence (its largest position + 1) stays within
``original_max_position_embeddings`` and the long ones, for every position, beyond
(``ModelConfig.longrope_long``; ``model.rope_long_regime: short`` keeps the short ones, as
transformers 5.25's Phi-3.5-MoE class does): ``rope_tables(..., long=True)`` is the long
factors' table.
"""

from __future__ import annotations

import math

import torch

from moetrain.config import ModelConfig
from moetrain.config.model import YARN_BETA_FAST, YARN_BETA_SLOW


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(scale) + 1`` (1 when ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(rotations: float, dim: int, theta: float, original_len: int) -> float:
    """The rotary dim whose wavelength fits ``rotations`` times into ``original_len``."""
    return dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_inv_freq(
    dim: int,
    theta: float,
    factor: float,
    original_len: int,
    beta_fast: float = YARN_BETA_FAST,
    beta_slow: float = YARN_BETA_SLOW,
    truncate: bool = True,
) -> torch.Tensor:
    """YaRN's ``(dim // 2,)`` inverse frequencies (fp32); ``truncate``: the correction dims
    floored / ceiled to whole dims (transformers' default), else kept fractional (gpt-oss)."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    low = _correction_dim(beta_fast, dim, theta, original_len)
    high = _correction_dim(beta_slow, dim, theta, original_len)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (a single-dim ramp, as transformers avoids the division by zero)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 = original frequency (high-frequency dims), 0 = interpolated
    return interpolation * (1 - keep) + extrapolation * keep


def llama3_inv_freq(
    dim: int, theta: float, factor: float, original_len: int, low: float, high: float
) -> torch.Tensor:
    """Llama 3.1's ``(dim // 2,)`` inverse frequencies (fp32): wavelengths longer than
    ``original_len / low`` divided by ``factor``, shorter than ``original_len / high`` kept,
    and in between blended by ``(original_len / wavelength - low) / (high - low)``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    wavelen = 2 * math.pi / inv_freq
    smooth = ((original_len / wavelen - low) / (high - low)).clamp(0, 1)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def longrope_inv_freq(dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    """LongRoPE's ``(dim // 2,)`` inverse frequencies (fp32): ``1 / (factor_i * theta **
    (2i / dim))``."""
    ext = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def rope_tables(
    dim: int, max_seq_len: int, theta: float, cfg: ModelConfig | None = None, long: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos_SR, sin_SR)`` in fp32 for positions ``0 .. max_seq_len - 1`` of ``dim`` rotary
    dims; with ``cfg``, the frequencies (and YaRN's attention factor) of
    ``cfg.rope_scaling`` (``cfg``'s other keys are not read); ``long``: LongRoPE's long
    factors instead of its short ones."""
    factor = 1.0
    if cfg is not None and cfg.rope_scaling == "llama3":
        inv_freq = llama3_inv_freq(
            dim,
            theta,
            cfg.rope_factor,
            cfg.rope_original_max_seq_len,
            cfg.rope_low_freq_factor,
            cfg.rope_high_freq_factor,
        )
    elif cfg is not None and cfg.rope_scaling == "yarn":
        inv_freq = yarn_inv_freq(
            dim,
            theta,
            cfg.rope_factor,
            cfg.rope_original_max_seq_len,
            *cfg.yarn_betas,
            truncate=cfg.rope_truncate is not False,
        )
        factor = yarn_attention_factor(cfg)
    elif cfg is not None and cfg.rope_scaling == "longrope":
        factors = cfg.rope_long_factor if long else cfg.rope_short_factor
        inv_freq = longrope_inv_freq(dim, theta, factors)
        factor = cfg.longrope_attention_factor
    else:
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    if factor == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * factor, emb.sin() * factor


def model_rope_tables(
    cfg: ModelConfig, positions: int | None = None, long: bool = False, local: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's RoPE tables: ``cfg.rope_dim`` dims, the first ``positions`` positions
    (default ``cfg.max_seq_len``: the context), scaled as ``cfg.rope_scaling`` says (``long``:
    with LongRoPE's long factors; ``local``: of the sliding layers' ``model.sliding_rope_theta``
    instead of ``rope_theta``). A position's row does not depend on how many are built."""
    n = cfg.max_seq_len if positions is None else positions
    theta = cfg.sliding_rope_theta if local else cfg.rope_theta
    return rope_tables(cfg.rope_dim, n, theta, cfg, long)


def yarn_attention_factor(cfg: ModelConfig) -> float:
    """The factor YaRN multiplies cos and sin by (1 without YaRN)."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    f, m, m_all = cfg.rope_factor, cfg.rope_mscale, cfg.rope_mscale_all_dim
    if m and m_all:
        return yarn_mscale(f, m) / yarn_mscale(f, m_all)
    return yarn_mscale(f)


def softmax_mscale(cfg: ModelConfig) -> float:
    """What multi-head latent attention multiplies its softmax scale by: YaRN's
    ``m(factor, mscale_all_dim) ** 2`` with ``rope_mscale_all_dim`` set, else 1."""
    if cfg.rope_scaling != "yarn" or not cfg.rope_mscale_all_dim:
        return 1.0
    return yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(
    x_BHSR: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotate queries or keys laid out (B, heads, S, Hd) by the first S rows of the tables;
    with tables narrower than the head (``model.partial_rotary_factor``), only its first R dims;
    ``interleaved``: the rotary dims come in adjacent pairs (see the module docstring)."""
    s, r = x_BHSR.shape[-2], cos_SR.shape[-1]
    if r < x_BHSR.shape[-1]:  # partial rotary: the first r dims turn, the others pass
        turned = apply_rope(x_BHSR[..., :r], cos_SR, sin_SR, interleaved)
        return torch.cat((turned, x_BHSR[..., r:]), dim=-1)
    cos, sin = cos_SR[:s].to(x_BHSR.dtype), sin_SR[:s].to(x_BHSR.dtype)
    if interleaved:
        x_BHSR = torch.cat((x_BHSR[..., 0::2], x_BHSR[..., 1::2]), dim=-1)
    return x_BHSR * cos + _rotate_half(x_BHSR) * sin
