"""Decoder-only transformer: embeddings, pre-norm blocks (attention + dense or MoE FFN), LM head.

Shape legend: B batch, S sequence, D d_model, V vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.config import ModelConfig, MoEConfig
from moetrain.model.attention import Attention, KVCache
from moetrain.model.cpu_matmul import Linear
from moetrain.model.doc_attention import Documents
from moetrain.model.layers import RMSNorm, SwiGLU
from moetrain.model.loss import chunked_cross_entropy
from moetrain.model.mla import LatentCache, MLAttention
from moetrain.model.moe.experts import GroupedExperts
from moetrain.model.moe.layer import MoELayer, MoEOutput
from moetrain.model.rope import model_rope_tables


@dataclass
class TransformerOutput:
    """logits (B, S, V), None when the chunked loss skipped them; loss = ce_loss + moe_loss
    (only with labels); moe: one per MoE layer."""

    logits: torch.Tensor | None
    loss: torch.Tensor | None = None
    ce_loss: torch.Tensor | None = None
    moe_loss: torch.Tensor | None = None
    moe: list[MoEOutput] = field(default_factory=list)


class Block(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + ffn(norm(x))``."""

    def __init__(
        self,
        layer: int,
        cfg: ModelConfig,
        moe_cfg: MoEConfig,
        local_experts: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn: nn.Module = MLAttention(cfg) if cfg.attention == "mla" else Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.is_moe = moe_cfg.is_moe_layer(layer)
        self.ffn: nn.Module = (
            MoELayer(moe_cfg, cfg.d_model, local_experts, layer=layer)
            if self.is_moe
            else SwiGLU(cfg.d_model, cfg.dense_hidden)
        )

    def forward(
        self,
        x_BSD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask_B1SS: torch.Tensor | Documents | None,
        cache: KVCache | LatentCache | None = None,
    ) -> tuple[torch.Tensor, MoEOutput | None]:
        h_BSD = self.attn_norm(x_BSD)
        x_BSD = x_BSD + self.attn(h_BSD, cos, sin, mask_B1SS, cache=cache, layer=self.layer)
        h_BSD = self.ffn_norm(x_BSD)
        if self.is_moe:
            y_BSD, stats = self.ffn(h_BSD)
            return x_BSD + y_BSD, stats
        return x_BSD + self.ffn(h_BSD), None


class Transformer(nn.Module):
    """The language model; parameter names are the stable ones in docs/CONTRACTS.md.

    ``local_experts=(start, stop)``: every MoE layer builds only global experts
    ``[start, stop)`` (an expert-parallel rank); the weights equal those of the full model.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        moe_cfg: MoEConfig,
        local_experts: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.cfg, self.moe_cfg = model_cfg, moe_cfg
        self.embed = nn.Embedding(model_cfg.vocab_size, model_cfg.d_model)
        self.layers = nn.ModuleList(
            Block(i, model_cfg, moe_cfg, local_experts) for i in range(model_cfg.n_layers)
        )
        self.norm = RMSNorm(model_cfg.d_model, model_cfg.norm_eps)
        self.lm_head = Linear(model_cfg.d_model, model_cfg.vocab_size, bias=False)
        if model_cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = model_rope_tables(model_cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if self.embed.weight.device.type != "meta":  # (a meta model is filled by loading)
            self.init_weights()

    @torch.no_grad()
    def reset_rope(self) -> None:
        """Recompute the RoPE tables in place (a model built on the meta device and moved with
        ``to_empty`` has uninitialised buffers; every other tensor is a loaded weight)."""
        cos, sin = model_rope_tables(self.cfg)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, init_std) everywhere; output projections (attention ``wo``, FFN and expert
        ``w2``) use init_std / sqrt(2 * n_layers); norms are ones, the expert bias and the q/k/v
        biases zeros."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                is_out = name.endswith((".wo", ".w2"))
                nn.init.normal_(module.weight, 0.0, out_std if is_out else std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, GroupedExperts):
                module.reset_parameters(std, out_std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, MoELayer):
                module.router.expert_bias.zero_()
        if self.cfg.tie_embeddings:  # lm_head shares embed.weight; keep the embedding init
            self.lm_head.weight = self.embed.weight

    def forward(
        self,
        input_ids_BS: torch.Tensor,
        doc_ids_BS: torch.Tensor | None = None,
        labels_BS: torch.Tensor | None = None,
        cache: KVCache | LatentCache | None = None,
        return_logits: bool = True,
    ) -> TransformerOutput:
        """Logits for every position; with labels also the loss (labels of -100 are ignored;
        the cross-entropy is 0 when every label is).

        ``doc_ids_BS`` restricts attention to earlier tokens of the same document. ``cache``
        (inference): the tokens continue the cached ones at position ``cache.pos``; their keys
        and values are added to the cache, which then advances. ``return_logits=False`` with
        labels and ``model.loss_chunk_tokens`` > 0: the cross-entropy is computed in chunks of
        tokens without the full logits, and ``logits`` is None (what the trainer does).
        """
        s = input_ids_BS.shape[1]
        start = cache.pos if cache is not None else 0
        if start + s > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {start + s} exceeds model.max_seq_len={self.cfg.max_seq_len}"
            )
        if cache is not None and (doc_ids_BS is not None or start + s > cache.max_len):
            raise ValueError("cache: no document mask, and at most cache.max_len positions")
        cos, sin = self.rope_cos[start : start + s], self.rope_sin[start : start + s]
        x_BSD = self.embed(input_ids_BS)
        # the packed documents' layout, one for every layer: no S x S mask (doc_attention.py)
        mask = None
        if doc_ids_BS is not None:
            mask = Documents.from_ids(doc_ids_BS).to(x_BSD.device)
        moe_outs: list[MoEOutput] = []
        for block in self.layers:
            x_BSD, stats = block(x_BSD, cos, sin, mask, cache)
            if stats is not None:
                moe_outs.append(stats)
        if cache is not None:
            cache.pos += s
        h_BSD = self.norm(x_BSD)

        m = self.moe_cfg
        moe_loss = h_BSD.new_zeros((), dtype=torch.float32)
        for stats in moe_outs:
            if m.aux_loss_coef > 0:
                moe_loss = moe_loss + m.aux_loss_coef * stats.aux_loss
            if m.z_loss_coef > 0:
                moe_loss = moe_loss + m.z_loss_coef * stats.z_loss
        chunk = self.cfg.loss_chunk_tokens
        chunked = labels_BS is not None and not return_logits and chunk > 0
        logits_BSV = None if chunked else self.lm_head(h_BSD)
        out = TransformerOutput(logits=logits_BSV, moe_loss=moe_loss, moe=moe_outs)
        if labels_BS is None:
            return out
        if logits_BSV is None:
            out.ce_loss = chunked_cross_entropy(
                h_BSD.flatten(0, 1), self.lm_head.weight, labels_BS.flatten(), chunk
            )
        else:  # mean over labelled tokens; 0 (not NaN) when none is, as the chunked loss
            labelled = (labels_BS != -100).sum().clamp_min(1)
            out.ce_loss = (
                F.cross_entropy(
                    logits_BSV.float().flatten(0, 1),
                    labels_BS.flatten(),
                    ignore_index=-100,
                    reduction="sum",
                )
                / labelled
            )
        out.loss = out.ce_loss + moe_loss
        return out

    def new_cache(self, batch: int, max_len: int | None = None) -> KVCache | LatentCache:
        """An empty generation cache for ``batch`` sequences of up to ``max_len`` tokens: keys
        and values (grouped-query attention), or latents and rope keys (MLA)."""
        c, w = self.cfg, self.embed.weight
        n = max_len or c.max_seq_len
        if c.attention == "mla":
            rank, rope = c.kv_lora_rank, c.qk_rope_head_dim
            return LatentCache(c.n_layers, batch, rank, rope, n, w.dtype, w.device)
        return KVCache(c.n_layers, batch, c.n_kv_heads, c.attention_head_dim, n, w.dtype, w.device)

    def moe_layers(self) -> list[MoELayer]:
        """The MoE FFNs in layer order."""
        return [b.ffn for b in self.layers if isinstance(b.ffn, MoELayer)]
