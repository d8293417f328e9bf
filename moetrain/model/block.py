"""The transformer block: a pre-norm token mixer and a pre-norm FFN (dense or MoE), as the layer
plan (:mod:`moetrain.config.layer_plan`) says; either may be absent (a block of its mixer alone,
or of its FFN alone: Nemotron-H's layers). With ``model.block_norms: sandwich`` each branch's
output is normalised too, before its residual add (Trinity's, Gemma's sandwich norms); with
``post`` only the output (OLMo-2's; ``model.attention_block_norms`` places an attention
layer's norms apart from the others', as Olmo-Hybrid's).

Shape legend: B batch, S sequence, D d_model.
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.config import ModelConfig, MoEConfig
from moetrain.config.layer_plan import LayerSpec
from moetrain.model.layers import make_mlp, make_norm
from moetrain.model.mixers import MixerInputs, MixerState, TokenMixer, build_mixer
from moetrain.model.moe.layer import MoELayer, MoEOutput


class Block(nn.Module):
    """Pre-norm block: ``x + attn(attn_norm(x))`` then ``x + ffn(ffn_norm(x))``; with
    ``model.residual_multiplier`` m, ``x + m * attn(...)`` and ``x + m * ffn(...)``; with
    sandwich norms ``x + m * attn_post_norm(attn(...))`` and ``x + m * ffn_post_norm(ffn(...))``
    (None otherwise); post-norm ``x + m * attn_post_norm(attn(x))``, no pre norms. A block
    whose plan has no mixer has no ``attn_norm`` / ``attn`` (None), one with FFN "none" no
    ``ffn_norm`` / ``ffn``."""

    def __init__(
        self,
        spec: LayerSpec,
        cfg: ModelConfig,
        moe_cfg: MoEConfig,
        local_experts: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.layer = spec.index
        self.residual_multiplier = cfg.residual_multiplier
        placement = cfg.norm_placement(spec.index)
        pre, post = placement != "post", placement != "pre"
        self.attn_norm = self.attn = self.attn_post_norm = None
        if spec.mixer is not None:
            self.attn_norm = make_norm(cfg, cfg.d_model) if pre else None
            self.attn: TokenMixer | None = build_mixer(cfg, spec.mixer)
            if post:
                self.attn_post_norm = make_norm(cfg, cfg.d_model)
        self.is_moe = spec.ffn == "moe"
        self.ffn_norm = self.ffn = self.ffn_post_norm = None
        if spec.ffn != "none":
            self.ffn_norm = make_norm(cfg, cfg.d_model) if pre else None
            self.ffn: nn.Module | None = (
                MoELayer(
                    moe_cfg,
                    cfg.d_model,
                    local_experts,
                    layer=spec.index,
                    shared_activation=cfg.ffn_activation,
                )
                if self.is_moe
                else make_mlp(cfg.ffn_activation, cfg.d_model, cfg.dense_hidden)
            )
            if post:
                self.ffn_post_norm = make_norm(cfg, cfg.d_model)

    def forward(
        self,
        x_BSD: torch.Tensor,
        inputs: MixerInputs,
        state: MixerState | None = None,
    ) -> tuple[torch.Tensor, MoEOutput | None]:
        """The block's output and its MoE layer's statistics (None without one); ``state``:
        the mixer's inference state (generation)."""
        if self.attn is not None:
            y_BSD = self.attn(_normed(self.attn_norm, x_BSD), inputs, state)
            x_BSD = x_BSD + self._scaled(y_BSD, self.attn_post_norm)
        if self.ffn is None:
            return x_BSD, None
        h_BSD = _normed(self.ffn_norm, x_BSD)
        if self.is_moe:
            y_BSD, stats = self.ffn(h_BSD)
            return x_BSD + self._scaled(y_BSD, self.ffn_post_norm), stats
        return x_BSD + self._scaled(self.ffn(h_BSD), self.ffn_post_norm), None

    def _scaled(self, y_BSD: torch.Tensor, post_norm: nn.Module | None) -> torch.Tensor:
        """A branch's output through its post norm (sandwich norms), times
        ``model.residual_multiplier`` (untouched at 1.0)."""
        if post_norm is not None:
            y_BSD = post_norm(y_BSD)
        m = self.residual_multiplier
        return y_BSD if m == 1.0 else y_BSD * m


def _normed(norm: nn.Module | None, x_BSD: torch.Tensor) -> torch.Tensor:
    """A branch's input through its pre norm (none in a post-norm block)."""
    return x_BSD if norm is None else norm(x_BSD)
