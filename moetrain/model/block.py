"""The transformer block: pre-norm attention (grouped-query or latent) and a dense or MoE FFN.

Shape legend: B batch, S sequence, D d_model.
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.config import ModelConfig, MoEConfig
from moetrain.model.attention import Attention, KVCache
from moetrain.model.doc_attention import Documents
from moetrain.model.layers import SwiGLU, make_norm
from moetrain.model.mla import LatentCache, MLAttention
from moetrain.model.moe.layer import MoELayer, MoEOutput


class Block(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + ffn(norm(x))``; with
    ``model.residual_multiplier`` m, ``x + m * attn(norm(x))`` and ``x + m * ffn(norm(x))``."""

    def __init__(
        self,
        layer: int,
        cfg: ModelConfig,
        moe_cfg: MoEConfig,
        local_experts: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.attn_norm = make_norm(cfg, cfg.d_model)
        self.attn: nn.Module = MLAttention(cfg) if cfg.attention == "mla" else Attention(cfg, layer)
        self.ffn_norm = make_norm(cfg, cfg.d_model)
        self.residual_multiplier = cfg.residual_multiplier
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
        a_BSD = self.attn(h_BSD, cos, sin, mask_B1SS, cache=cache, layer=self.layer)
        x_BSD = x_BSD + self._scaled(a_BSD)
        h_BSD = self.ffn_norm(x_BSD)
        if self.is_moe:
            y_BSD, stats = self.ffn(h_BSD)
            return x_BSD + self._scaled(y_BSD), stats
        return x_BSD + self._scaled(self.ffn(h_BSD)), None

    def _scaled(self, y_BSD: torch.Tensor) -> torch.Tensor:
        """A branch's output times ``model.residual_multiplier`` (untouched at 1.0)."""
        m = self.residual_multiplier
        return y_BSD if m == 1.0 else y_BSD * m
