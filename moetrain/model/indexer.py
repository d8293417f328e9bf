"""The lightning indexer of DeepSeek sparse attention (DeepSeek-V3.2; GLM-5): a few small heads
that score every earlier token for each query, so that latent attention attends only to the
``model.index_topk`` best (:mod:`moetrain.model.sparse_index` computes the scores).

Shape legend: B batch, S sequence, Q q_lora_rank (the query latent), D d_model, Hi
``model.index_n_heads``, Di ``model.index_head_dim``, R ``model.qk_rope_head_dim``.

Parameters (names as DeepSeek's and transformers' ``indexer.*``): ``wq_b`` (Q -> Hi Di), the
indexer's queries from latent attention's normalised query latent; ``wk`` (D -> Di), one key
per token, normalised by ``k_norm`` (a LayerNorm with a bias, eps 1e-6); ``weights_proj``
(D -> Hi), each head's weight per query. The first R dims of every query and key are rotated
with the model's RoPE tables, half-split (DeepSeek-V3.2) or in adjacent pairs with
``model.index_rope_interleave`` (GLM-5). The score is ``sum_h w_h relu(q_h . k)`` with ``w``
the projected weights times ``Hi ** -0.5 * Di ** -0.5`` (transformers scales the dot products
by ``Di ** -0.5`` before the relu: the same scores). Queries, keys and weights are returned in
fp32, as transformers scores them. DeepSeek's own kernels rotate queries and keys by a
Hadamard transform and score in fp8: an orthogonal transform keeps the dot products, so the
scores are the same up to the fp8 rounding, which is not reproduced.
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.config import ModelConfig
from moetrain.model.cpu_matmul import Linear
from moetrain.model.layers import LayerNorm
from moetrain.model.rope import apply_rope

INDEX_NORM_EPS = 1e-6


class LightningIndexer(nn.Module):
    """One layer's indexer (see the module docstring)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, d = cfg.index_n_heads, cfg.index_head_dim
        self.n_heads, self.head_dim = h, d
        self.interleave = cfg.index_rope_interleave
        self.wq_b = Linear(cfg.q_lora_rank, h * d, bias=False)
        self.wk = Linear(cfg.d_model, d, bias=False)
        self.k_norm = LayerNorm(d, INDEX_NORM_EPS)
        self.weights_proj = Linear(cfg.d_model, h, bias=False)
        self.weight_scale = h**-0.5 * d**-0.5

    @staticmethod
    def matrices(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        """Its weight matrices, ``name -> (in, out)``."""
        h, d = cfg.index_n_heads, cfg.index_head_dim
        return {
            "wq_b": (cfg.q_lora_rank, h * d),
            "wk": (cfg.d_model, d),
            "weights_proj": (cfg.d_model, h),
        }

    def keys(self, x_BSD: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor) -> torch.Tensor:
        """Every token's rotated key (B, S, Di), in x's dtype (what a cache keeps)."""
        k_BSD = self.k_norm(self.wk(x_BSD))
        return apply_rope(k_BSD[:, None], cos_SR, sin_SR, self.interleave)[:, 0]

    def queries(
        self,
        x_BSD: torch.Tensor,
        q_latent_BSQ: torch.Tensor,
        cos_SR: torch.Tensor,
        sin_SR: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's rotated queries (B, S, Hi, Di) and head weights (B, S, Hi), fp32."""
        b, s, _ = x_BSD.shape
        q_BHSD = self.wq_b(q_latent_BSQ).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        q_BSHD = apply_rope(q_BHSD, cos_SR, sin_SR, self.interleave).transpose(1, 2)
        w_BSH = self.weights_proj(x_BSD).float() * self.weight_scale
        return q_BSHD.float(), w_BSH
