"""Token-choice top-k router with load-balancing losses and capacity.

Shape legend: T tokens, D d_model, E experts, K top_k.

Scores are computed in fp32. Selection may be shifted by the aux-loss-free ``expert_bias``
(DeepSeek-V3); combine weights never include it. Where the bias is updated: NOT in forward.
The trainer calls :meth:`Router.update_bias` once per optimizer step with the expert load summed
over every rank (an all-reduce of ``MoEOutput.tokens_per_expert_E`` over the whole world), so the
bias stays identical on every rank and is never part of the autograd graph.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.config import MoEConfig


@dataclass
class RouterOutput:
    """What the router decided for T tokens.

    weights_TK: fp32 combine weights (route_scale applied, bias never included).
    ids_TK: int64 selected experts. keep_TK: False for assignments dropped by capacity.
    aux_loss, z_loss: unscaled fp32 scalars (the model multiplies by the coefficients).
    tokens_per_expert_E: detached float counts of selections before capacity (local batch).
    dropped: detached int64 scalar tensor, number of dropped assignments.
    entropy: detached mean over tokens of the entropy of the routing distribution.
    dropless: True when no capacity applies (keep_TK is all True): a host-side hint that lets
    a dispatcher skip the keep mask, and with it the host sync that counts the kept copies.
    """

    weights_TK: torch.Tensor
    ids_TK: torch.Tensor
    keep_TK: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    tokens_per_expert_E: torch.Tensor
    dropped: torch.Tensor
    entropy: torch.Tensor
    dropless: bool = False


def count_experts(ids: torch.Tensor, num_bins: int) -> torch.Tensor:
    """int64 count of each value ``0 .. num_bins - 1`` in ``ids`` (every value must be in that
    range): ``torch.bincount`` without its host syncs (CUDA ``bincount`` reads the minimum and
    the maximum of its input on the host). Integer atomics, so exact in any order."""
    flat = ids.reshape(-1)
    out = torch.zeros(num_bins, dtype=torch.int64, device=ids.device)
    return out.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))


def capacity_keep(
    ids_TK: torch.Tensor, priority_TK: torch.Tensor, num_experts: int, capacity: int
) -> torch.Tensor:
    """Keep at most ``capacity`` assignments per expert, highest priority first.

    Ties go to the earlier (token, slot) in row-major order, so the result is deterministic.
    Uses two stable sorts (no T x E x C tensor).
    """
    ids_N, prio_N = ids_TK.reshape(-1), priority_TK.reshape(-1)
    by_prio_N = torch.argsort(-prio_N, stable=True)
    order_N = by_prio_N[torch.argsort(ids_N[by_prio_N], stable=True)]
    counts_E = count_experts(ids_N, num_experts)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank_N = torch.arange(ids_N.numel(), device=ids_N.device) - starts_E[ids_N[order_N]]
    keep_N = torch.empty_like(ids_N, dtype=torch.bool)
    keep_N[order_N] = rank_N < capacity
    return keep_N.view_as(ids_TK)


class Router(nn.Module):
    """Linear gate ``router.gate.weight`` (E, D) + top-k selection + balancing losses.

    ``stats_reducer`` (set by parallel code, default None): sums the per-expert selection
    counts over every rank that routes tokens, so the aux loss uses global-batch fractions.
    """

    def __init__(self, cfg: MoEConfig, d_model: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        self.gate = nn.Linear(d_model, cfg.num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        self.stats_reducer: Callable[[torch.Tensor], torch.Tensor] | None = None

    def capacity(self, num_tokens: int) -> int | None:
        """Per-expert capacity ``ceil(cf * T * K / E)``, or None when dropless."""
        cf = self.cfg.capacity_factor
        if cf <= 0:
            return None
        return math.ceil(cf * num_tokens * self.top_k / self.num_experts)

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        cfg, e, k = self.cfg, self.num_experts, self.top_k
        if self.training and cfg.jitter > 0:
            x_TD = x_TD * torch.empty_like(x_TD).uniform_(1.0 - cfg.jitter, 1.0 + cfg.jitter)
        logits_TE = F.linear(x_TD.float(), self.gate.weight.float())
        bias_E = self.expert_bias

        if cfg.score_func == "sigmoid":
            scores_TE = torch.sigmoid(logits_TE)
            probs_TE = scores_TE / scores_TE.sum(-1, keepdim=True)
        else:
            scores_TE = probs_TE = torch.softmax(logits_TE, dim=-1)

        if cfg.topk_before_score:
            ids_TK = torch.topk(logits_TE + bias_E, k, dim=-1).indices
            weights_TK = torch.softmax(logits_TE.gather(1, ids_TK), dim=-1)
        else:
            ids_TK = torch.topk(scores_TE + bias_E, k, dim=-1).indices
            weights_TK = scores_TE.gather(1, ids_TK)
            if cfg.renormalize:
                weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)

        counts_E = count_experts(ids_TK, e).float()
        capacity = self.capacity(x_TD.shape[0])
        if capacity is None:
            keep_TK = torch.ones_like(ids_TK, dtype=torch.bool)
            dropped = torch.zeros((), dtype=torch.int64, device=x_TD.device)
        else:
            keep_TK = capacity_keep(ids_TK, weights_TK.detach(), e, capacity)
            dropped = (~keep_TK).sum()

        global_counts_E = counts_E if self.stats_reducer is None else self.stats_reducer(counts_E)
        frac_E = global_counts_E / global_counts_E.sum().clamp_min(1.0)
        t = max(x_TD.shape[0], 1)  # T = 0 (an empty micro-batch) gives zero losses, not NaN
        aux_loss = e * torch.sum(frac_E.detach() * probs_TE.sum(0) / t)
        z_loss = torch.logsumexp(logits_TE, dim=-1).pow(2).sum() / t
        with torch.no_grad():
            entropy = -(probs_TE * probs_TE.clamp_min(1e-20).log()).sum() / t

        return RouterOutput(
            weights_TK=weights_TK * cfg.route_scale,
            ids_TK=ids_TK,
            keep_TK=keep_TK,
            aux_loss=aux_loss,
            z_loss=z_loss,
            tokens_per_expert_E=counts_E,
            dropped=dropped.detach(),
            entropy=entropy,
            dropless=capacity is None,
        )

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor) -> None:
        """Aux-loss-free balancing: ``bias += rate * sign(mean(load) - load)``.

        Call once per optimizer step with the load summed over every rank; never in forward.
        """
        rate = self.cfg.bias_update_rate
        if rate <= 0:
            return
        load_E = load_E.to(self.expert_bias)
        self.expert_bias.add_(rate * torch.sign(load_E.mean() - load_E))
