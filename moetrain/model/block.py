"""The transformer block: a pre-norm token mixer and a pre-norm FFN (dense or MoE), as the layer
plan (:mod:`moetrain.config.layer_plan`) says; either may be absent (a block of its mixer alone,
or of its FFN alone: Nemotron-H's layers). With ``model.block_norms: sandwich`` each branch's
output is normalised too, before its residual add (Trinity's, Gemma's sandwich norms); with
``post`` only the output (OLMo-2's; ``model.attention_block_norms`` places an attention
layer's norms apart from the others', as Olmo-Hybrid's). Gemma 4's pieces: ``moe.dense_branch``
runs a dense FFN beside the experts of an MoE layer, each with its own norms
(:meth:`Block._dense_and_experts`); ``model.layer_scalar`` multiplies the block's output by a
learned scalar. With ``model.hc_streams`` N > 1 the residual is N streams (B, S, N, D): each
branch reads and writes them through its hyper-connection (``attn_hc``, ``ffn_hc``;
:mod:`moetrain.model.hyper_connections`) instead of the plain residual add.
``moe.shortcut`` (LongCat-Flash's shortcut-connected MoE): an MoE block runs a
dense FFN on the experts' input and adds that alone to its residual stream; its statistics
carry the experts' output (``MoEOutput.shortcut_BSD``), which the next block, a dense one,
adds at its end (``shortcut_BSD``).

Shape legend: B batch, S sequence, N residual streams, D d_model.
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.config import ModelConfig, MoEConfig
from moetrain.config.layer_plan import LayerSpec
from moetrain.model.hyper_connections import HyperConnection
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
        clamp = moe_cfg.swiglu_clamp()  # (model.ffn_activation: clamped_swiglu)
        self.ffn_norm = self.ffn = self.ffn_post_norm = None
        if spec.ffn != "none":
            self.ffn_norm = make_norm(cfg, cfg.d_model) if pre else None
            self.ffn: nn.Module | None = (
                MoELayer(
                    moe_cfg,
                    cfg.d_model,
                    local_experts,
                    spec.index,
                    cfg.norm_eps,
                    shared_activation=cfg.ffn_activation,
                    vocab_size=cfg.vocab_size,
                )
                if self.is_moe
                else make_mlp(cfg.ffn_activation, cfg.d_model, cfg.dense_hidden, clamp)
            )
            if post:
                self.ffn_post_norm = make_norm(cfg, cfg.d_model)
        # moe.dense_branch: the dense FFN beside the experts, and the experts' own norms;
        # moe.shortcut: the dense FFN alone
        self.dense = self.dense_post_norm = self.moe_norm = self.moe_post_norm = None
        self.shortcut = moe_cfg.shortcut
        if self.is_moe and self.shortcut:
            self.dense = make_mlp(cfg.ffn_activation, cfg.d_model, cfg.dense_hidden, clamp)
        if self.is_moe and moe_cfg.dense_branch:
            self.dense = make_mlp(cfg.ffn_activation, cfg.d_model, cfg.dense_hidden, clamp)
            self.dense_post_norm = make_norm(cfg, cfg.d_model)
            self.moe_norm = make_norm(cfg, cfg.d_model)
            self.moe_post_norm = make_norm(cfg, cfg.d_model)
        self.layer_scalar = nn.Parameter(torch.ones(1)) if cfg.layer_scalar else None
        self.attn_hc = self.ffn_hc = None
        if cfg.hc_streams > 1:
            hc = (cfg.d_model, cfg.hc_streams, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)
            self.attn_hc = HyperConnection(*hc) if self.attn is not None else None
            self.ffn_hc = HyperConnection(*hc) if self.ffn is not None else None

    def forward(
        self,
        x_BSD: torch.Tensor,
        inputs: MixerInputs,
        state: MixerState | None = None,
        shortcut_BSD: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, MoEOutput | None]:
        """The block's output and its MoE layer's statistics (None without one); ``state``:
        the mixer's inference state (generation). ``x_BSD`` is (B, S, N, D) with
        hyper-connections (the streams); ``shortcut_BSD``: the previous block's shortcut
        experts' output (``moe.shortcut``), added at the end."""
        if self.attn is not None:
            h_BSD, hc = self._enter(self.attn_hc, x_BSD)
            y_BSD = self.attn(_normed(self.attn_norm, h_BSD), inputs, state)
            x_BSD = self._leave(self.attn_hc, x_BSD, self._scaled(y_BSD, self.attn_post_norm), hc)
        stats = None
        if self.ffn is not None:
            h_BSD, hc = self._enter(self.ffn_hc, x_BSD)
            if self.dense is not None and self.shortcut:
                normed_BSD = _normed(self.ffn_norm, h_BSD)
                shortcut_out, stats = self.ffn(normed_BSD, token_ids_BS=inputs.token_ids_BS)
                stats.shortcut_BSD = shortcut_out  # (the next block adds it)
                y_BSD = self.dense(normed_BSD)
            elif self.dense is not None:
                y_BSD, stats = self._dense_and_experts(h_BSD, inputs.token_ids_BS)
            elif self.is_moe:
                y_BSD, stats = self.ffn(
                    _normed(self.ffn_norm, h_BSD), token_ids_BS=inputs.token_ids_BS
                )
            else:
                y_BSD = self.ffn(_normed(self.ffn_norm, h_BSD))
            x_BSD = self._leave(self.ffn_hc, x_BSD, self._scaled(y_BSD, self.ffn_post_norm), hc)
        if shortcut_BSD is not None:
            x_BSD = x_BSD + shortcut_BSD
        if self.layer_scalar is not None:
            x_BSD = x_BSD * self.layer_scalar
        return x_BSD, stats

    def _dense_and_experts(
        self, x_BSD: torch.Tensor, token_ids_BS: torch.Tensor | None
    ) -> tuple[torch.Tensor, MoEOutput]:
        """``moe.dense_branch``: ``dense_post_norm(dense(ffn_norm(x))) +
        moe_post_norm(moe(moe_norm(x)))``, the router scoring ``x`` itself (Gemma 4's
        ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm_1`` around its MLP and
        ``pre_feedforward_layernorm_2`` / ``post_feedforward_layernorm_2`` around its experts)."""
        dense_BSD = self.dense_post_norm(self.dense(self.ffn_norm(x_BSD)))
        y_BSD, stats = self.ffn(self.moe_norm(x_BSD), route_BSD=x_BSD, token_ids_BS=token_ids_BS)
        return dense_BSD + self.moe_post_norm(y_BSD), stats

    @staticmethod
    def _enter(hc: HyperConnection | None, x: torch.Tensor) -> tuple[torch.Tensor, tuple | None]:
        """A branch's input: the residual itself, or its hyper-connection's collapse of the
        streams (with what :meth:`_leave` mixes by)."""
        return (x, None) if hc is None else hc(x)

    @staticmethod
    def _leave(
        hc: HyperConnection | None, x: torch.Tensor, y_BSD: torch.Tensor, state: tuple | None
    ) -> torch.Tensor:
        """The residual after a branch's output ``y_BSD``: ``x + y``, or the streams mixed by
        its hyper-connection."""
        return x + y_BSD if hc is None else hc.mix(x, y_BSD, state)

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
