"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434; DeepSeek-V3), the ``mla``
token mixer (its keys and rules: :mod:`moetrain.config.mixers.mla`).

Shape legend: B batch, S sequence (new tokens), T key positions (cached + new), D d_model,
H heads, Q q_lora_rank, C kv_lora_rank (the KV latent), N qk_nope_head_dim, R qk_rope_head_dim,
Vd v_head_dim.

Per token: ``wkv_a`` maps x to ``[latent_C | k_rope_R]``; the latent is RMS-normalised
(``kv_norm``) and ``wkv_b`` expands it into every head's non-rotary key ``N`` and value ``Vd``;
``k_rope`` is one rotary key shared by all heads (a NoPE layer, ``model.nope_layers``, rotates
neither it nor the queries' rope part: Kimi Linear's latent attention). Queries come from ``wq`` (D -> H(N+R)), or,
with ``model.q_lora_rank``, from the low-rank path ``wq_b(q_norm(wq_a(x)))``. A head's query and
key are ``[nope_N | rope_R]``; the softmax scale is ``(N + R) ** -0.5`` times YaRN's
``softmax_mscale`` (``model/rope.py``). The latent norms use eps 1e-6 whatever
``model.norm_eps`` is, as DeepSeek's reference code and transformers do. With
``model.mla_lora_scale`` (LongCat-Flash) every query is multiplied by
``sqrt(D / Q)`` and the normalised latent by ``sqrt(D / C)`` (so its keys, values and cache).

Training attends through ``F.scaled_dot_product_attention`` like grouped-query attention, with
the same document mask (unequal q/k and v head dims are zero-padded to equal ones where torch
would otherwise fall back to its math kernel, as on CPU), so masks, the chunked loss, activation checkpointing (a whole block is
recomputed), bf16 and expert parallelism (the FFN's business) are unchanged. Generation caches
the normalised latent and the rotated rope key (:class:`LatentCache`, ``C + R`` values per token
and layer) and expands the cached latent through ``wkv_b`` on every call.

Parameter names follow DeepSeek's reference code: ``wq`` or ``wq_a``/``q_norm``/``wq_b``,
``wkv_a``, ``kv_norm``, ``wkv_b``, ``wo``; transformers calls them ``q_proj`` or
``q_a_proj``/``q_a_layernorm``/``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
``kv_b_proj``, ``o_proj`` (same shapes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.config import ModelConfig
from moetrain.config.layer_plan import MixerSpec
from moetrain.model.attention import cache_causal_mask, record_kernel, sdpa_kernel_name
from moetrain.model.cpu_matmul import Linear
from moetrain.model.doc_attention import Documents, document_attention
from moetrain.model.head_exchange import exchange_to_heads, exchange_to_sequence
from moetrain.model.indexer import LightningIndexer
from moetrain.model.layers import RMSNorm
from moetrain.model.logit_max import observe_logits
from moetrain.model.mixers.base import MixerInputs, TokenMixer
from moetrain.model.rope import apply_rope, softmax_mscale
from moetrain.model.sparse_attention import sparse_latent_attention
from moetrain.model.sparse_latent import (
    Absorbed,
    report_loss,
    row_queries,
    run_indexer,
    selection,
    sparse_exchange_bytes,
    sparse_index_loss,
    sparse_mixing_flops,
    sparse_saved_bytes,
    warmup_index_loss,
    whole_keys,
)

LATENT_NORM_EPS = 1e-6


class LatentCache:
    """One layer's generation cache of latent attention: the normalised KV latent ``latent``
    (B, max_len, C) and the rotated rope key ``k_rope`` (B, max_len, R) of every token, and
    under sparse attention its indexer's rotated key ``index_k`` (B, max_len, Di) (Di 0 for a
    layer without an indexer of its own)."""

    def __init__(
        self,
        batch: int,
        kv_lora_rank: int,
        rope_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        index_dim: int = 0,
    ) -> None:
        self.latent = torch.zeros(batch, max_len, kv_lora_rank, dtype=dtype, device=device)
        self.k_rope = torch.zeros(batch, max_len, rope_dim, dtype=dtype, device=device)
        self.index_k = torch.zeros(batch, max_len, index_dim, dtype=dtype, device=device)

    bytes_per_sequence = 0  # (no fixed part)

    @property
    def bytes_per_token(self) -> int:
        """``C + R`` values, and ``Di`` for an indexer's keys."""
        values = self.latent.shape[2] + self.k_rope.shape[2] + self.index_k.shape[2]
        return values * self.latent.element_size()

    def append_index(self, pos: int, index_k_BsD: torch.Tensor) -> torch.Tensor:
        """Store the indexer's keys of ``s`` new positions at ``pos``; return all so far."""
        end = pos + index_k_BsD.shape[1]
        self.index_k[:, pos:end] = index_k_BsD
        return self.index_k[:, :end]

    def append(
        self, pos: int, latent_BsC: torch.Tensor, k_rope_BsR: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``s`` new positions at ``pos``; return all of them so far."""
        end = pos + latent_BsC.shape[1]
        self.latent[:, pos:end] = latent_BsC
        self.k_rope[:, pos:end] = k_rope_BsR
        return self.latent[:, :end], self.k_rope[:, :end]


class MLAttention(TokenMixer):
    """Causal multi-head latent attention (see the module docstring)."""

    kind = "mla"
    query_key_logits = True

    def __init__(self, cfg: ModelConfig, spec: MixerSpec) -> None:
        super().__init__()
        d, h = cfg.d_model, cfg.n_heads
        self.n_heads = h
        self.nope_dim, self.rope_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim, self.kv_rank = cfg.v_head_dim, cfg.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        self.q_lora_rank = cfg.q_lora_rank
        if cfg.q_lora_rank is None:
            self.wq = Linear(d, h * qk_dim, bias=False)
        else:
            self.wq_a = Linear(d, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = Linear(cfg.q_lora_rank, h * qk_dim, bias=False)
        self.wkv_a = Linear(d, self.kv_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.wkv_b = Linear(self.kv_rank, h * (self.nope_dim + self.v_dim), bias=False)
        self.wo = Linear(h * self.v_dim, d, bias=False)
        # Ling 3.0's per-head output gate (model.mla_head_gate)
        self.g_proj = Linear(d, h, bias=False) if cfg.mla_head_gate else None
        self.scale = qk_dim**-0.5 * softmax_mscale(cfg)
        self.q_lora_scale = self.kv_lora_scale = None  # model.mla_lora_scale
        if cfg.mla_lora_scale:
            self.q_lora_scale = (d / cfg.q_lora_rank) ** 0.5
            self.kv_lora_scale = (d / self.kv_rank) ** 0.5
        self.rope_interleave = cfg.rope_interleave
        self.rope = spec.rope  # False: a NoPE layer (Kimi Linear's)
        self.sdpa_kernel: str | None = None  # what the first call ran (as ``Attention``)
        # sparse attention (model/sparse_latent.py): the layer whose selection it attends to
        self.index_from, self.index_topk = spec.index_from, cfg.index_topk
        self.sparse = spec.index_from is not None and cfg.index_stage == "sparse"
        self.index_weight, self.recall_queries = cfg.index_loss_weight, cfg.index_recall_queries
        self.warmup = spec.indexer and cfg.index_stage == "dense_warmup"
        self.indexer = LightningIndexer(cfg) if spec.indexer else None

    def queries(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every head's query (B, S, H(N+R)), before RoPE, and with ``q_lora_rank`` the
        normalised query latent (B, S, Q) it came from."""
        if self.q_lora_rank is None:
            return self.wq(x_BSD), None
        q_latent_BSQ = self.q_norm(self.wq_a(x_BSD))
        q_BSX = self.wq_b(q_latent_BSQ)
        if self.q_lora_scale is not None:
            q_BSX = q_BSX * self.q_lora_scale
        return q_BSX, q_latent_BSQ

    def trains_alone(self) -> list[nn.Module]:
        """In the dense warm-up, its indexer trains and nothing else of the model does."""
        return [self.indexer] if self.warmup else []

    def _trains_indexer(self) -> bool:
        return (
            self.indexer is not None
            and self.index_weight > 0
            and self.training
            and torch.is_grad_enabled()
        )

    def qk_clip_scales(self, gamma_H: torch.Tensor) -> dict[str, torch.Tensor]:
        """Row multipliers by which head h's logits scale by ``gamma_H[h]`` (QK-clip, as Kimi K2
        applies it to MLA): the head's non-rotary query and key rows (``wq`` or ``wq_b``;
        ``wkv_b``'s key part) by its square root, its rotary query rows by gamma; the values and
        the rotary key, shared by every head, unscaled."""
        h, root = self.n_heads, gamma_H.sqrt()
        query = torch.cat(
            [root[:, None].expand(h, self.nope_dim), gamma_H[:, None].expand(h, self.rope_dim)],
            dim=1,
        )
        key = torch.cat([root[:, None].expand(h, self.nope_dim), root.new_ones(h, self.v_dim)], 1)
        wq = "wq" if self.q_lora_rank is None else "wq_b"
        return {f"{wq}.weight": query.reshape(-1), "wkv_b.weight": key.reshape(-1)}

    def forward(
        self, x_BSD: torch.Tensor, inputs: MixerInputs, state: LatentCache | None = None
    ) -> torch.Tensor:
        """Attend causally, or within ``inputs.mask`` (documents, or a boolean or additive
        mask) when given. With ``state`` the latent and rope key are appended to it at
        ``inputs.pos`` and the queries attend to every cached position."""
        cos_SR, sin_SR, mask_B1SS = inputs.cos, inputs.sin, inputs.mask
        b, s, _ = x_BSD.shape
        # q and k are assembled (B, S, H, .) in memory, seen as (B, H, S, .): SDPA's output
        # takes q's layout, so wo's input below is a view, not a copy (as grouped-query)
        q_BSHK, q_latent_BSQ = self.queries(x_BSD)
        q_BSHK = q_BSHK.view(b, s, self.n_heads, -1)
        q_nope_BSHN, q_rope_BSHR = q_BSHK.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rope_BHSR = q_rope_BSHR.transpose(1, 2)
        latent_BSC, k_rope_BSR = self.wkv_a(x_BSD).split([self.kv_rank, self.rope_dim], dim=-1)
        latent_BSC = self.kv_norm(latent_BSC)
        if self.kv_lora_scale is not None:
            latent_BSC = latent_BSC * self.kv_lora_scale
        if self.rope:  # (a NoPE layer keeps the shared key and the queries' part unrotated)
            q_rope_BHSR = apply_rope(q_rope_BHSR, cos_SR, sin_SR, self.rope_interleave)
            k_rope_BSR = apply_rope(k_rope_BSR[:, None], cos_SR, sin_SR, self.rope_interleave)
            k_rope_BSR = k_rope_BSR[:, 0]
        causal, ex = mask_B1SS is None, self.head_exchange
        if state is not None and ex is not None:
            raise ValueError("a latent cache runs on one device, without a head exchange")
        if state is not None:
            latent_BSC, k_rope_BSR = state.append(inputs.pos, latent_BSC, k_rope_BSR)
            mask_B1SS, causal = cache_causal_mask(inputs.pos, s, latent_BSC.device), False
        if self.index_from is not None:
            q_rope_BSHR = q_rope_BHSR.transpose(1, 2)
            absorbed = Absorbed.of(
                q_nope_BSHN, q_rope_BSHR, latent_BSC, k_rope_BSR, self.wkv_b.weight
            )
            dsa = (x_BSD, q_latent_BSQ, absorbed, inputs, state)
            if self.sparse:
                return self.wo(self._sparse(*dsa).reshape(b, s, -1))
            if self._trains_indexer():
                self._warmup_loss(*dsa)
        t = latent_BSC.shape[1]  # key positions (cached + new)
        kv_BTHX = self.wkv_b(latent_BSC).view(b, t, self.n_heads, -1)
        k_nope_BTHN, v_BTHV = kv_BTHX.split([self.nope_dim, self.v_dim], dim=-1)
        k_rope_BTHR = k_rope_BSR[:, :, None].expand(b, t, self.n_heads, self.rope_dim)
        q_BHSK = torch.cat((q_nope_BSHN, q_rope_BHSR.transpose(1, 2)), dim=-1).transpose(1, 2)
        k_BHTK = torch.cat((k_nope_BTHN, k_rope_BTHR), dim=-1).transpose(1, 2)
        v_BHTV = v_BTHV.transpose(1, 2)
        if ex is not None:  # sequence parallel: whole sequences, this rank's heads
            q_BHSK, k_BHTK, v_BHTV = exchange_to_heads(ex, q_BHSK, k_BHTK, v_BHTV)
            out_BhSV = self._attend(q_BHSK, k_BHTK, v_BHTV, mask_B1SS, causal)
            return self._output(x_BSD, exchange_to_sequence(ex, out_BhSV))
        out_BHSV = self._attend(q_BHSK, k_BHTK, v_BHTV, mask_B1SS, causal)
        return self._output(x_BSD, out_BHSV.transpose(1, 2))

    def _output(self, x_BSD: torch.Tensor, out_BSHV: torch.Tensor) -> torch.Tensor:
        """The output projection of every head's output, each gated by the sigmoid of its
        ``g_proj`` value first (computed in fp32, as transformers does) where the layer has
        one."""
        if self.g_proj is not None:
            gate_BSH = torch.sigmoid(self.g_proj(x_BSD).float()).to(out_BSHV.dtype)
            out_BSHV = out_BSHV * gate_BSH[..., None]
        return self.wo(out_BSHV.reshape(*out_BSHV.shape[:2], -1))

    def _sparse(
        self,
        x_BSD: torch.Tensor,
        q_latent_BSQ: torch.Tensor,
        absorbed: Absorbed,
        inputs: MixerInputs,
        state: LatentCache | None,
    ) -> torch.Tensor:
        """Attention over the selected keys (B, S, H, Vd); a layer with its own indexer selects
        them (and in training reports its KL). Under sequence parallelism this rank's queries
        (all heads) select from and attend to the whole rows' keys, gathered from every rank."""
        b, s, _ = x_BSD.shape
        ex = self.head_exchange
        queries, absorbed = row_queries(inputs, b, s, x_BSD.device, ex), whole_keys(absorbed, ex)
        own = None
        if self.indexer is not None:
            own = run_indexer(self.indexer, x_BSD, q_latent_BSQ, inputs, state, ex)
        idx_BSk, valid_BSk = selection(own, queries.own, self.index_topk, inputs, self.index_from)
        train = own is not None and self._trains_indexer()
        out_BSHC, p_BSk = sparse_latent_attention(
            absorbed.q_BSHK, absorbed.kv_BTK, idx_BSk, valid_BSk, self.scale, self.kv_rank, train
        )
        if train:
            args = (own, idx_BSk, valid_BSk, p_BSk, absorbed, self.scale, queries)
            kl_BS, recall = sparse_index_loss(*args, self.recall_queries)
            report_loss(inputs, self.index_from, kl_BS, self.index_weight, recall)
        return absorbed.values(out_BSHC)

    def _warmup_loss(
        self,
        x_BSD: torch.Tensor,
        q_latent_BSQ: torch.Tensor,
        absorbed: Absorbed,
        inputs: MixerInputs,
        state: LatentCache | None,
    ) -> None:
        """Dense warm-up: the indexer's KL over every key, reported (under sequence parallelism
        this rank's queries over the whole rows' keys, as in :meth:`_sparse`)."""
        b, s, _ = x_BSD.shape
        ex = self.head_exchange
        queries = row_queries(inputs, b, s, x_BSD.device, ex)
        absorbed = whole_keys(absorbed.detached(), ex)
        own = run_indexer(self.indexer, x_BSD, q_latent_BSQ, inputs, state, ex)
        args = (own, absorbed, self.scale, queries, self.index_topk, self.recall_queries)
        kl_BS, recall = warmup_index_loss(*args)
        report_loss(inputs, self.index_from, kl_BS, self.index_weight, recall)

    def new_state(
        self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> LatentCache:
        index_dim = self.indexer.head_dim if self.indexer is not None else 0
        return LatentCache(batch, self.kv_rank, self.rope_dim, max_len, dtype, device, index_dim)

    # counts (the protocol's; checked against the built module and saved-tensor hooks)

    @classmethod
    def param_shapes(cls, cfg: ModelConfig, spec: MixerSpec) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for name, (n_in, n_out) in cls.matrices(cfg, spec).items():
            out[f"{name}.weight"] = (n_out, n_in)
            if name == "wq_a":
                out["q_norm.weight"] = (cfg.q_lora_rank,)
            if name == "wkv_a":
                out["kv_norm.weight"] = (cfg.kv_lora_rank,)
            if name == "indexer.wk":  # a LayerNorm: weight and bias
                out |= dict.fromkeys(("indexer.k_norm.weight", "indexer.k_norm.bias"), (n_out,))
        return out

    @classmethod
    def matrices(cls, cfg: ModelConfig, spec: MixerSpec) -> dict[str, tuple[int, int]]:
        d, h, c, qk = cfg.d_model, cfg.n_heads, cfg.kv_lora_rank, cfg.attention_head_dim
        q = (
            {"wq": (d, h * qk)}
            if cfg.q_lora_rank is None
            else {"wq_a": (d, cfg.q_lora_rank), "wq_b": (cfg.q_lora_rank, h * qk)}
        )
        indexer = LightningIndexer.matrices(cfg) if spec.indexer else {}
        return {
            **q,
            "wkv_a": (d, c + cfg.qk_rope_head_dim),
            "wkv_b": (c, h * (cfg.qk_nope_head_dim + cfg.v_head_dim)),
            "wo": (h * cfg.v_head_dim, d),
            **({"g_proj": (d, h)} if cfg.mla_head_gate else {}),
            **{f"indexer.{name}": shape for name, shape in indexer.items()},
        }

    @classmethod
    def mixing_flops_per_token(cls, cfg: ModelConfig, spec: MixerSpec, seq_len: int) -> float:
        """Dense: scores ``(N + R)`` and values ``Vd`` wide per head over the whole sequence.
        Sparse attention (:func:`sparse_mixing_flops`): scores ``C + R`` and values ``C``
        wide per head (the shared-key form) over ``min(k, seq_len)`` keys, and the indexer's
        work."""
        if spec.index_from is not None:
            return sparse_mixing_flops(cfg, spec, seq_len)
        return 6 * cfg.n_heads * (cfg.attention_head_dim + cfg.v_head_dim) * seq_len

    @classmethod
    def saved_bytes_per_token(
        cls, cfg: ModelConfig, spec: MixerSpec, act_bytes: int, sp: int
    ) -> int:
        """The projection input ``aD``, with ``q_lora_rank`` Q the query latent ``aQ + 4`` and
        its norm's output ``aQ``; the ``wkv_a`` output ``a(C + R) + 4`` (its latent
        normalised), the normalised latent ``aC``, the ``wkv_b`` output ``aH(N + Vd)`` (the
        values are a view of it), the assembled q and k ``2aH(N + R)``, the SDPA output
        ``aHVd`` and logsumexp ``4H``. That is the memory-efficient kernel's (a GPU's); where
        torch's kernels want equal q/k and v head dims (CPU flash attention) the smaller side
        is zero-padded, which saves somewhat more. Under sequence parallelism the exchanged q,
        k and v take the places of the ones above, and the values are saved exchanged
        (``aHVd``) with the output in sequence order (``aHVd``) instead of the ``wkv_b``
        output: ``aH(Vd - N)`` more. Sparse attention: :func:`sparse_saved_bytes`."""
        dsa = sparse_saved_bytes(cfg, spec, act_bytes, sp) if spec.index_from is not None else 0
        if dsa and cfg.index_stage == "sparse":
            return dsa
        a, h, c, v = act_bytes, cfg.n_heads, cfg.kv_lora_rank, cfg.v_head_dim
        q_latent = 2 * a * cfg.q_lora_rank + 4 if cfg.q_lora_rank else 0
        latent = a * (c + cfg.qk_rope_head_dim) + 4 + a * c
        kv = a * h * (cfg.qk_nope_head_dim + v) + 2 * a * h * cfg.attention_head_dim
        exchanged = a * h * (v - cfg.qk_nope_head_dim) if sp > 1 else 0
        # the head gate: its fp32 sigmoid and, under bf16, its rounded copy (the gated product
        # is wo's input in the place of the heads' output in sequence order)
        gate = 4 * h + (a * h if a != 4 else 0) if cfg.mla_head_gate else 0
        return a * cfg.d_model + q_latent + latent + kv + a * h * v + 4 * h + exchanged + gate + dsa

    @classmethod
    def cache_bytes_per_token(cls, cfg: ModelConfig, spec: MixerSpec, dtype_bytes: int) -> int:
        index = cfg.index_head_dim if spec.indexer else 0
        return (cfg.kv_lora_rank + cfg.qk_rope_head_dim + index) * dtype_bytes

    @classmethod
    def exchange_bytes_per_token(
        cls, cfg: ModelConfig, spec: MixerSpec, act_bytes: int, sp: int
    ) -> float:
        """q, k and v out (every head has its own), the output back; ``(sp - 1) / sp`` of each
        leaves the GPU. Sparse attention: :func:`sparse_exchange_bytes` instead (its dense
        warm-up: besides)."""
        if sp == 1:
            return 0.0
        dsa = sparse_exchange_bytes(cfg, spec, act_bytes, sp) if spec.index_from is not None else 0
        if dsa and cfg.index_stage == "sparse":
            return float(dsa)
        dims = cfg.n_heads * (2 * cfg.attention_head_dim + 2 * cfg.v_head_dim)
        return act_bytes * dims * (sp - 1) / sp + dsa

    def _attend(
        self,
        q_BHSK: torch.Tensor,
        k_BHTK: torch.Tensor,
        v_BHTV: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        """SDPA; where torch would run its math kernel for the unequal q/k and v head dims
        (which keeps (B, H, S, T) probabilities; CPU flash attention wants equal dims), the
        smaller side is zero-padded to the larger (same scores with the explicit scale, the
        value's padding sliced off)."""
        # the per-head largest logit, when tracked (model/logit_max.py)
        observe_logits(self, q_BHSK, k_BHTK, self.scale, mask)
        docs = mask if isinstance(mask, Documents) else None
        if docs is not None:
            mask, causal = None, True  # causal within each document (doc_attention.py)
        note = "documents, no S x S mask" if docs is not None else "causal" if causal else "mask"
        qk, vd = q_BHSK.shape[-1], v_BHTV.shape[-1]
        if qk != vd:
            kernel = sdpa_kernel_name(q_BHSK, k_BHTK, v_BHTV, mask, causal, False, self.scale)
            if kernel in ("math", "unknown"):
                if vd < qk:
                    v_BHTV = F.pad(v_BHTV, (0, qk - vd))
                else:
                    q_BHSK, k_BHTK = F.pad(q_BHSK, (0, vd - qk)), F.pad(k_BHTK, (0, vd - qk))
                note += f", head dims padded to {max(qk, vd)}"
        if self.sdpa_kernel is None:
            self.sdpa_kernel = record_kernel(
                q_BHSK, k_BHTK, v_BHTV, mask, causal, False, f"MLA, {note}", self.scale
            )
        if docs is not None:
            out = document_attention(q_BHSK, k_BHTK, v_BHTV, docs, scale=self.scale)
        else:
            out = F.scaled_dot_product_attention(
                q_BHSK, k_BHTK, v_BHTV, attn_mask=mask, is_causal=causal, scale=self.scale
            )
        return out[..., :vd] if out.shape[-1] != vd else out
