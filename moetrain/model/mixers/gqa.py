"""Grouped-query attention with rotary position embeddings (RoPE), the ``gqa`` token mixer.

Shape legend: B batch, S sequence, D d_model, H query heads, G key/value heads, Hd head dim.
RoPE (``model/rope.py``) uses the "rotate half" layout (first half / second half of each head),
as Llama and Mixtral in Hugging Face transformers do, so q/k projection weights map across
unchanged; ``model.rope_interleave`` takes adjacent pairs instead. Its keys and rules are
:mod:`moetrain.config.mixers.gqa`'s.

Kernels: causal attention without a mask passes grouped K/V (``enable_gqa``), which flash
attention takes. A mask (document masking, or several new tokens against a KV cache) rules out
flash attention, and memory-efficient attention takes grouped K/V only on recent torch builds.
So on a GPU, when torch's own selector would run the math kernel for the grouped masked call
(whose (B, H, S, S) scores do not fit at training sizes), K/V are expanded to the H query heads
first (same values), which memory-efficient attention takes everywhere. CPU kernels take grouped
K/V with a mask, so CPU runs are unchanged. Packed documents never build a mask: every
document is attended causally on its own (:mod:`moetrain.model.doc_attention`). Each layer
records the kernel torch picked on its first call (``sdpa_kernel``,
:func:`moetrain.model.attention.attention_report`).

A layer with a sliding window or chunks (its :class:`~moetrain.config.layer_plan.MixerSpec`)
or attention sinks (``model.attention_sinks``) attends through
:mod:`moetrain.model.local_attention` instead (no S x S tensor either, packed documents and
the KV cache included); the others run the paths above unchanged.

Qwen3-Next's output gate (``model.attention_output_gate``): ``wq`` gives each head's query
followed by as many gate values (transformers' ``q_proj`` of twice the size, per head
``[query | gate]``), and every head's attention output is multiplied by the sigmoid of its gate
before ``wo`` (under sequence parallelism after the exchange back: the gate stays local).

MiMo-V2-Flash's pieces: value heads of ``model.v_head_dim`` (the output into ``wo`` as wide),
the values multiplied by ``model.attention_value_scale``, and on a sliding layer
``model.sliding_n_kv_heads`` key/value heads, sinks only there (``model.attention_sinks_layers:
sliding``) and the tables of ``model.sliding_rope_theta`` (``MixerInputs.local_rope``).

``model.qk_norm_position: after_rope`` applies the learned per-head query/key norms to the
rotated heads instead (Hunyuan-A13B).

Llama 4's pieces, per layer: a NoPE layer (``spec.rope`` False) skips RoPE; a RoPE layer with
``model.qk_norm_after_rope`` normalises each query and key head after RoPE (a weightless
RMSNorm, eps ``model.norm_eps``, in fp32 and back to the input dtype); a NoPE layer with a
temperature multiplies each query at position p by ``log1p(floor((p + 1) / floor)) * scale +
1`` (:func:`moetrain.model.attention.temperature`). p is the position in the row, as RoPE's
(a KV cache's queries continue at ``inputs.pos``; packed documents do not restart it), which is
transformers' position for one sequence without padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.config import ModelConfig
from moetrain.config.layer_plan import MixerSpec
from moetrain.config.mixers.gqa import GQA
from moetrain.model.attention import (
    cache_causal_mask,
    expand_kv_for_mask,
    record_kernel,
    sdpa_kernel_name,
    temperature,
    unit_rms,
)
from moetrain.model.cpu_matmul import Linear
from moetrain.model.doc_attention import Documents, document_attention
from moetrain.model.head_exchange import exchange_to_heads, exchange_to_sequence, kv_repeats
from moetrain.model.layers import RMSNorm, norm_offset
from moetrain.model.local_attention import cached_attention, chunked_attention, local_attention
from moetrain.model.logit_max import observe_logits
from moetrain.model.mixers.base import MixerInputs, TokenMixer
from moetrain.model.rope import apply_rope


class KVCache:
    """One layer's keys and values for incremental decoding (inference only): ``k``, ``v``
    (B, G, max_len, Hd)."""

    def __init__(
        self,
        batch: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        v_head_dim: int | None = None,
    ) -> None:
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        v_shape = shape[:-1] + (v_head_dim or head_dim,)
        self.v = torch.zeros(v_shape, dtype=dtype, device=device)

    def append(
        self, pos: int, k_BGsHd: torch.Tensor, v_BGsHd: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``s`` new positions at ``pos``; return all keys/values so far."""
        end = pos + k_BGsHd.shape[2]
        self.k[:, :, pos:end] = k_BGsHd
        self.v[:, :, pos:end] = v_BGsHd
        return self.k[:, :, :end], self.v[:, :, :end]

    bytes_per_sequence = 0  # (no fixed part)

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of every K/V head."""
        _, g, _, hd = self.k.shape
        return g * (hd + self.v.shape[-1]) * self.k.element_size()


class Attention(TokenMixer):
    """Causal grouped-query attention through ``F.scaled_dot_product_attention``, with the
    per-layer options of its ``spec`` (window, chunks, NoPE, temperature)."""

    kind = "gqa"
    query_key_logits = True

    def __init__(self, cfg: ModelConfig, spec: MixerSpec) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = GQA.kv_heads(cfg, spec)
        self.head_dim = cfg.attention_head_dim
        self.v_head_dim = GQA.v_dim(cfg)
        self.value_scale = cfg.attention_value_scale
        d, hd, vd = cfg.d_model, self.head_dim, self.v_head_dim
        # with an output gate, each head's query followed by its gate (Qwen3-Next's q_proj)
        self.output_gate = cfg.attention_output_gate
        q_out = self.n_heads * hd * (2 if self.output_gate else 1)
        self.wq = Linear(d, q_out, bias=cfg.qkv_bias)
        self.wk = Linear(d, self.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.wv = Linear(d, self.n_kv_heads * vd, bias=cfg.qkv_bias)
        self.wo = Linear(self.n_heads * vd, d, bias=cfg.o_bias)
        # the sliding layers' own RoPE tables (model.sliding_rope_theta): MixerInputs.local_rope
        self.local_rope = spec.window is not None and cfg.sliding_rope_theta is not None
        self.window = spec.window  # None: full causal attention
        self.chunk = spec.chunk  # None: not chunked
        self.rope = spec.rope  # False: a NoPE layer
        # the weightless post-RoPE norm's eps (model.qk_norm_after_rope, RoPE layers), or None
        self.post_rope_eps = cfg.norm_eps if cfg.qk_norm_after_rope and self.rope else None
        self.temperature = spec.temperature  # (floor, scale) on NoPE layers, or None
        # the sink logit of each query head (model.attention_sinks); None without sinks
        sinks = GQA.has_sinks(cfg, spec)
        self.sinks = nn.Parameter(torch.empty(self.n_heads)) if sinks else None
        # per head: normalise each (Hd,) head vector; per projection (OLMoE): the whole
        # (heads * Hd,) projection, before it is split into heads
        self.qk_norm_per_head = cfg.qk_norm_scope == "head"
        self.qk_norm_after_rope = cfg.qk_norm_position == "after_rope"  # (per head)
        q_dim, k_dim = (
            (hd, hd) if self.qk_norm_per_head else (self.n_heads * hd, self.n_kv_heads * hd)
        )
        offset = norm_offset(cfg)
        self.q_norm = RMSNorm(q_dim, cfg.norm_eps, offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_dim, cfg.norm_eps, offset) if cfg.qk_norm else None
        self.rope_interleave = cfg.rope_interleave
        self.scale = cfg.attention_scale  # the softmax scale; None = 1 / sqrt(head_dim)
        self.sdpa_kernel: str | None = None  # what the first call ran (see module docstring)

    def forward(
        self, x_BSD: torch.Tensor, inputs: MixerInputs, state: KVCache | None = None
    ) -> torch.Tensor:
        """Attend causally, within ``inputs.mask`` when given, and with this layer's window,
        chunks and sinks. With ``state`` the keys and values are appended to it at
        ``inputs.pos`` and the queries attend to every cached position."""
        cos_SHd, sin_SHd, mask_B1SS = inputs.cos, inputs.sin, inputs.mask
        if self.local_rope:
            cos_SHd, sin_SHd = inputs.local_rope
        b, s, _ = x_BSD.shape
        q, k = self.wq(x_BSD), self.wk(x_BSD)
        gate = None
        if self.output_gate:  # per head [query | gate]
            q, gate = q.view(b, s, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(b, s, -1), gate.reshape(b, s, -1)
        norm = self.q_norm is not None and self.k_norm is not None
        if norm and not self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(b, s, self.n_heads, self.head_dim)
        k = k.view(b, s, self.n_kv_heads, self.head_dim)
        v = self.wv(x_BSD).view(b, s, self.n_kv_heads, self.v_head_dim)
        if self.value_scale != 1.0:
            v = v * self.value_scale
        if norm and self.qk_norm_per_head and not self.qk_norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        q_BHSHd, k_BGSHd = q.transpose(1, 2), k.transpose(1, 2)
        if self.rope:
            q_BHSHd = apply_rope(q_BHSHd, cos_SHd, sin_SHd, self.rope_interleave)
            k_BGSHd = apply_rope(k_BGSHd, cos_SHd, sin_SHd, self.rope_interleave)
        if norm and self.qk_norm_after_rope:
            q_BHSHd, k_BGSHd = self.q_norm(q_BHSHd), self.k_norm(k_BGSHd)
        if self.post_rope_eps is not None:
            eps = self.post_rope_eps
            q_BHSHd, k_BGSHd = unit_rms(q_BHSHd, eps), unit_rms(k_BGSHd, eps)
        v_BGSHd = v.transpose(1, 2)
        gqa = self.n_kv_heads != self.n_heads
        ex = self.head_exchange
        if ex is not None:  # sequence parallel: whole sequences, this rank's heads
            if state is not None:
                raise ValueError("a KV cache runs on one device, without a head exchange")
            q_BHSHd, k_BGSHd, v_BGSHd = exchange_to_heads(ex, q_BHSHd, k_BGSHd, v_BGSHd)
            gqa = k_BGSHd.shape[1] != q_BHSHd.shape[1]
        if self.temperature is not None:  # whole rows here: positions from 0 (or the cache's)
            floor, scale = self.temperature
            t_S = temperature(inputs.pos, q_BHSHd.shape[2], floor, scale, q_BHSHd.device)
            q_BHSHd = (q_BHSHd * t_S[:, None]).to(q_BHSHd.dtype)  # (in fp32, as transformers)
        if state is None:  # the per-head largest logit, when tracked (model/logit_max.py)
            scale = self.scale if self.scale is not None else self.head_dim**-0.5
            observe_logits(self, q_BHSHd, k_BGSHd, scale, mask_B1SS, self.window, self.chunk)
        if self.window is not None or self.chunk is not None or self.sinks is not None:
            if self.chunk is not None and isinstance(mask_B1SS, Documents):
                mask_B1SS = inputs.chunk_documents(self.chunk)  # documents cut at the chunks
            out_BHSHd = self._local(q_BHSHd, k_BGSHd, v_BGSHd, mask_B1SS, state, inputs.pos, gqa)
            return self._output(out_BHSHd, b, s, gate)
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
            return self._output(out_BHSHd, b, s, gate)
        causal = mask_B1SS is None
        if state is not None:
            k_BGSHd, v_BGSHd = state.append(inputs.pos, k_BGSHd, v_BGSHd)
            mask_B1SS, causal = cache_causal_mask(inputs.pos, s, k_BGSHd.device), False
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
        return self._output(out_BHSHd, b, s, gate)

    def qk_clip_scales(self, gamma_H: torch.Tensor) -> dict[str, torch.Tensor]:
        """Row multipliers of the query and key projections (weights, and biases with
        ``model.qkv_bias``) by which head h's logits scale by ``gamma_H[h]`` (QK-clip): a key
        head serves H / G query heads, so its rows take the square root of the smallest gamma
        among them and each query head's rows the rest of its own. With an output gate (each
        head's query rows followed by its gate's in ``wq``) the gate's rows keep 1."""
        gamma_GR = gamma_H.view(self.n_kv_heads, -1)
        key_G = gamma_GR.amin(dim=1).sqrt()
        query_H = (gamma_GR / key_G[:, None]).reshape(-1)
        if self.output_gate:  # per head [query | gate]
            query_H = torch.stack([query_H, torch.ones_like(query_H)], dim=1).reshape(-1)
        query = query_H.repeat_interleave(self.head_dim)
        key = key_G.repeat_interleave(self.head_dim)
        kinds = ("weight", "bias") if self.wq.bias is not None else ("weight",)
        return {f"{w}.{kind}": rows for w, rows in (("wq", query), ("wk", key)) for kind in kinds}

    def _output(
        self, out_BHSHd: torch.Tensor, b: int, s: int, gate_BSQ: torch.Tensor | None
    ) -> torch.Tensor:
        """The output projection of every head's output, in sequence order (under sequence
        parallelism first exchanged back to this rank's positions and every head), each
        multiplied by the sigmoid of its gate first with ``model.attention_output_gate``."""
        ex = self.head_exchange
        if ex is not None:
            out_BSQ = exchange_to_sequence(ex, out_BHSHd).reshape(b, s, -1)
        else:
            out_BSQ = out_BHSHd.transpose(1, 2).reshape(b, s, -1)
        if gate_BSQ is not None:
            out_BSQ = out_BSQ * torch.sigmoid(gate_BSQ)
        return self.wo(out_BSQ)

    def _local(
        self,
        q_BHSHd: torch.Tensor,
        k_BGSHd: torch.Tensor,
        v_BGSHd: torch.Tensor,
        mask: torch.Tensor | Documents | None,
        state: KVCache | None,
        pos: int,
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
        if state is not None:
            k_BGSHd, v_BGSHd = state.append(pos, k_BGSHd, v_BGSHd)
            return cached_attention(q_BHSHd, k_BGSHd, v_BGSHd, *args, chunk=chunk)
        if chunk is not None:
            return chunked_attention(q_BHSHd, k_BGSHd, v_BGSHd, chunk, sinks_H, gqa, self.scale)
        return local_attention(q_BHSHd, k_BGSHd, v_BGSHd, *args)

    def new_state(
        self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> KVCache:
        return KVCache(
            batch, self.n_kv_heads, self.head_dim, max_len, dtype, device, self.v_head_dim
        )

    def init_own_parameters(self) -> None:
        if self.sinks is not None:
            nn.init.zeros_(self.sinks)

    # counts (the protocol's; checked against the built module and saved-tensor hooks)

    @classmethod
    def param_shapes(cls, cfg: ModelConfig, spec: MixerSpec) -> dict[str, tuple[int, ...]]:
        h, g, hd = cfg.n_heads, GQA.kv_heads(cfg, spec), cfg.attention_head_dim
        out: dict[str, tuple[int, ...]] = {"sinks": (h,)} if GQA.has_sinks(cfg, spec) else {}
        for name, (n_in, n_out) in cls.matrices(cfg, spec).items():
            out[f"{name}.weight"] = (n_out, n_in)
            if cfg.o_bias if name == "wo" else cfg.qkv_bias:
                out[f"{name}.bias"] = (n_out,)
        if cfg.qk_norm:
            per_head = cfg.qk_norm_scope == "head"
            out["q_norm.weight"] = (hd,) if per_head else (h * hd,)
            out["k_norm.weight"] = (hd,) if per_head else (g * hd,)
        return out

    @classmethod
    def matrices(cls, cfg: ModelConfig, spec: MixerSpec) -> dict[str, tuple[int, int]]:
        d, h, hd, vd = cfg.d_model, cfg.n_heads, cfg.attention_head_dim, GQA.v_dim(cfg)
        g = GQA.kv_heads(cfg, spec)
        q = h * hd * (2 if cfg.attention_output_gate else 1)
        return {"wq": (d, q), "wk": (d, g * hd), "wv": (d, g * vd), "wo": (h * vd, d)}

    @classmethod
    def mixing_flops_per_token(cls, cfg: ModelConfig, spec: MixerSpec, seq_len: int) -> float:
        """Scores and values over the whole sequence, ``6 H (Hd + Vd) seq_len`` (Vd the value
        head's dims; the causal mask, a window or chunks not discounted)."""
        return 6 * cfg.n_heads * (cfg.attention_head_dim + GQA.v_dim(cfg)) * seq_len

    @classmethod
    def saved_bytes_per_token(
        cls, cfg: ModelConfig, spec: MixerSpec, act_bytes: int, sp: int
    ) -> int:
        """The projections' input ``aD``, the RoPE'd q ``aHq``, k and v ``2aHkv``, the SDPA
        (flash kernel) output ``aHq`` (also wo's input) and its logsumexp ``4H``; with
        ``model.qk_norm`` the norms' inputs ``a(Hq + Hkv)`` and an fp32 rsqrt per head (or per
        projection); with ``model.attention_output_gate`` the gate's sigmoid and the gated
        output ``2aHq``. Under sequence parallelism (``sp`` > 1) also the output exchanged back to
        sequence order ``aHq`` and the extra copies of the key/value heads repeated to split
        over ``sp`` ranks ``2aHkv(r - 1)`` (r = :func:`moetrain.model.head_exchange.
        kv_repeats`). Windows, chunks and sinks (``model/local_attention.py``) save what
        their paths save; not modelled."""
        a, h, g = act_bytes, cfg.n_heads, GQA.kv_heads(cfg, spec)
        hq, hkv = h * cfg.attention_head_dim, g * cfg.attention_head_dim
        # the value heads and the output (narrower with model.v_head_dim)
        vq, vkv = h * GQA.v_dim(cfg), g * GQA.v_dim(cfg)
        saved = a * cfg.d_model + a * (hq + vq) + a * (hkv + vkv) + 4 * h
        if sp > 1:
            saved += a * vq + a * (hkv + vkv) * (kv_repeats(g, sp) - 1)
        if cfg.qk_norm:
            rows = h + g if cfg.qk_norm_scope == "head" else 2
            saved += a * (hq + hkv) + 4 * rows
        if cfg.attention_output_gate:  # the gate's sigmoid and the gated output (wo's input)
            saved += 2 * a * hq
        return saved

    @classmethod
    def cache_bytes_per_token(cls, cfg: ModelConfig, spec: MixerSpec, dtype_bytes: int) -> int:
        g = GQA.kv_heads(cfg, spec)
        return g * (cfg.attention_head_dim + GQA.v_dim(cfg)) * dtype_bytes

    @classmethod
    def exchange_bytes_per_token(
        cls, cfg: ModelConfig, spec: MixerSpec, act_bytes: int, sp: int
    ) -> float:
        """q, k and v out (key/value heads repeated where ``sp`` does not divide them), the
        output back; ``(sp - 1) / sp`` of each leaves the GPU."""
        if sp == 1:
            return 0.0
        g, hd, vd = GQA.kv_heads(cfg, spec), cfg.attention_head_dim, GQA.v_dim(cfg)
        reps = kv_repeats(g, sp)
        dims = hd * (cfg.n_heads + g * reps) + vd * (cfg.n_heads + g * reps)
        return act_bytes * dims * (sp - 1) / sp
