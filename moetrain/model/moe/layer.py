"""MoE block = router -> dispatcher -> experts -> combine (+ optional shared expert, computed
while the dispatcher's exchanges are in flight unless ``moe.shared_expert_overlap`` is off).
With ``moe.latent_dim`` (a latent MoE) the routed tokens are projected into the latent
(``latent_in``) before the dispatch and the combined output back (``latent_out``) after the
combine, so the experts and the exchanges work in the latent; the router and the shared expert
read the block's input. With zero experts (``moe.zero_experts``, LongCat-Flash) the copies the
router sends to one are not dispatched: the layer adds ``x * (the sum of the token's zero-expert
weights)`` to the routed experts' output.

Shape legend: B batch, S sequence, T = B*S tokens, D d_model, E experts, K top_k,
N kept token copies, F expert hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moetrain.config import MoEConfig
from moetrain.model.cpu_matmul import Linear
from moetrain.model.layers import MLP, make_mlp
from moetrain.model.moe.dispatch import Dispatcher, LocalDispatcher, Routes
from moetrain.model.moe.experts import GroupedExperts
from moetrain.model.moe.router import Router


@dataclass
class MoEOutput:
    """Losses and monitoring statistics of one MoE layer for one forward.

    aux_loss, z_loss: unscaled scalars with gradient. tokens_per_expert_E: detached float
    selections before capacity (local batch; what ``Router.update_bias`` consumes after an
    all-reduce). dropped: int64 scalar tensor, the copies this rank's experts dropped (under
    expert parallelism they come from every rank of the EP group); dropped_fraction = dropped /
    (T * K) with this rank's T.
    entropy: mean routing entropy. load_max_over_mean: max / mean of tokens_per_expert_E.
    zero_copies: int64 scalar, the copies routed to zero experts (``moe.zero_experts``).
    shortcut_BSD: with ``moe.shortcut``, the layer's output on its way to the next block (set
    by the block, taken by the model's loop).
    """

    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    tokens_per_expert_E: torch.Tensor
    dropped: torch.Tensor
    dropped_fraction: torch.Tensor
    entropy: torch.Tensor
    load_max_over_mean: torch.Tensor
    zero_copies: torch.Tensor
    shortcut_BSD: torch.Tensor | None = None


class _SharedExpertStages:
    """The (optionally gated) shared expert on ``x_TD`` in two stages that a dispatcher can
    run while its exchanges are in flight: ``up`` (its input projections and activation) and ``down``
    (down projection, gate). ``output()`` runs what has not run yet."""

    def __init__(self, expert: MLP, gate: nn.Linear | None, x_TD: torch.Tensor) -> None:
        self.expert, self.gate, self.x_TD = expert, gate, x_TD
        self.h_TF: torch.Tensor | None = None
        self.y_TD: torch.Tensor | None = None

    def up(self) -> None:
        self.h_TF = self.expert.up(self.x_TD)

    def down(self) -> None:
        if self.h_TF is None:
            self.up()
        y_TD = self.expert.w2(self.h_TF)
        if self.gate is not None:
            y_TD = torch.sigmoid(self.gate(self.x_TD)) * y_TD
        self.y_TD = y_TD

    def output(self) -> torch.Tensor:
        if self.y_TD is None:
            self.down()
        return self.y_TD


class MoELayer(nn.Module):
    """Token-choice top-k MoE FFN; ``forward(x_BSD) -> (y_BSD, MoEOutput)``.

    ``dispatcher`` is a plain attribute so expert parallelism can swap in its all-to-all one.
    ``local_experts=(start, stop)``: build only those global experts (expert parallelism).
    ``layer``: the transformer layer index of this MoE layer (for metrics and checkpoints).
    ``norm_eps``: the eps of the router's input norm (``moe.router_input_norm``);
    ``shared_activation``: the shared expert's MLP (``model.ffn_activation``);
    ``vocab_size``: the size of a hash-routed layer's token-id table (``moe.hash_layers``).
    """

    def __init__(
        self,
        cfg: MoEConfig,
        d_model: int,
        local_experts: tuple[int, int] | None = None,
        layer: int = 0,
        norm_eps: float = 1e-6,
        shared_activation: str = "swiglu",
        vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        self.router = Router(cfg, d_model, norm_eps, vocab_size, layer)
        self.dispatcher: Dispatcher = LocalDispatcher(cfg.num_experts)
        self.latent_in = self.latent_out = None
        if cfg.latent_dim is not None:
            self.latent_in = Linear(d_model, cfg.latent_dim, bias=False)
            self.latent_out = Linear(cfg.latent_dim, d_model, bias=False)
        self.experts = GroupedExperts(
            cfg.num_experts,
            cfg.latent_dim or d_model,
            cfg.expert_hidden,
            cfg.grouped_mm,
            local_experts,
            recompute_act=cfg.recompute_act,
            biases=cfg.expert_biases,
            activation=cfg.activation,
            alpha=cfg.swiglu_alpha,
            limit=cfg.swiglu_limit,
            score_on_input=cfg.score_on_input,
            up_offset=cfg.swiglu_up_offset,
        )
        self.shared_expert: MLP | None = None
        self.shared_gate: nn.Linear | None = None
        if cfg.num_shared_experts > 0:
            self.shared_expert = make_mlp(
                shared_activation, d_model, cfg.shared_hidden, cfg.swiglu_clamp()
            )
            if cfg.shared_expert_gate:
                self.shared_gate = Linear(d_model, 1, bias=False)

    def forward(
        self,
        x_BSD: torch.Tensor,
        route_BSD: torch.Tensor | None = None,
        token_ids_BS: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, MoEOutput]:
        """The experts' output for ``x_BSD`` and the layer's statistics; ``route_BSD``: what
        the router scores where it is not ``x_BSD`` (``moe.dense_branch``: the residual
        stream); ``token_ids_BS``: the tokens' ids (a hash-routed layer selects by them)."""
        b, s, d = x_BSD.shape
        x_TD = x_BSD.reshape(b * s, d)
        route_TD = x_TD if route_BSD is None else route_BSD.reshape(b * s, d)
        token_ids_T = None if token_ids_BS is None else token_ids_BS.reshape(b * s)
        r = self.router(route_TD, num_seqs=b, token_ids_T=token_ids_T)
        shared = None
        if self.shared_expert is not None:
            shared = _SharedExpertStages(self.shared_expert, self.shared_gate, x_TD)
        overlap = shared is not None and self.cfg.shared_expert_overlap
        routes = Routes(r.ids_TK, r.weights_TK, self.cfg.capacity_factor)
        identity_T1 = None
        if self.cfg.zero_experts:
            routes.zero_TK = r.ids_TK >= self.cfg.num_experts
            identity_T1 = r.weights_TK.masked_fill(~routes.zero_TK, 0.0).sum(-1, keepdim=True)
            routes.weights_TK = r.weights_TK.masked_fill(routes.zero_TK, 0.0)
        routed_TD = x_TD if self.latent_in is None else self.latent_in(x_TD)  # (T, latent)
        sent = self.dispatcher.dispatch(routed_TD, routes, overlap=shared.up if overlap else None)
        y_ND = self.experts(sent.x_ND, sent.counts_L, sent.weights_N, sent.w13, sent.w2)
        y_TD = self.dispatcher.combine(y_ND, sent, overlap=shared.down if overlap else None)
        if self.latent_out is not None:
            y_TD = self.latent_out(y_TD)
        if shared is not None:
            y_TD = y_TD + shared.output()
        if identity_T1 is not None:  # the zero experts' output: the input, weighted
            y_TD = y_TD + (x_TD.float() * identity_T1).to(y_TD.dtype)
        load_E = r.tokens_per_expert_E
        stats = MoEOutput(
            aux_loss=r.aux_loss,
            z_loss=r.z_loss,
            tokens_per_expert_E=load_E.detach(),
            dropped=sent.dropped,
            dropped_fraction=sent.dropped.float() / max(r.ids_TK.numel(), 1),
            entropy=r.entropy,
            load_max_over_mean=(load_E.max() / load_E.mean().clamp_min(1e-9)).detach(),
            zero_copies=r.zero_copies,
        )
        return y_TD.view(b, s, d), stats
