"""Token-choice top-k router with load-balancing losses.

Shape legend: T tokens, D d_model, E experts, K top_k, G expert groups (``moe.n_group``),
X experts per group, B sequences, S tokens per sequence.

Scores are computed in fp32. Selection may be shifted by the aux-loss-free ``expert_bias``
(DeepSeek-V3; with softmax scores too, ERNIE-4.5); combine weights never include it. With
``moe.renormalize`` the chosen weights are divided by their sum, or by ``moe.renormalize_min``
where the sum is smaller (ERNIE-4.5's ``moe_norm_min``: a selection bias can pick experts whose
scores are all but zero), or by the sum plus ``moe.renormalize_eps`` (LFM2-MoE's 1e-6). Where the bias is updated: NOT in forward.
The trainer calls :meth:`Router.update_bias` once per optimizer step with the expert load summed
over every rank (an all-reduce of ``MoEOutput.tokens_per_expert_E`` over the whole world), so the
bias stays identical on every rank and is never part of the autograd graph.

``moe.topk_before_score`` selects on the logits (plus the selection bias) and scores only the
chosen k: softmax over them (Granite-MoE, gpt-oss), or each one's sigmoid, renormalised with
``moe.renormalize`` (Llama 4: top-1, ``sigmoid(logit)``; selecting on the logits keeps the order
where fp32 sigmoids of large logits would tie at 1).

Group-limited routing (``moe.n_group`` > 1): each token keeps only its ``moe.topk_group`` best
groups of experts (``moe.group_score``: a group's score is the sum of its two best selection
scores, DeepSeek-V3 and GLM-4.5's rule, or its best one, DeepSeek-V2's) and picks its top-k
experts inside them.

The load-balancing loss is ``E * sum_e f_e * P_e`` with P_e the mean routing probability of the
micro-batch's tokens (with gradient) and f_e a detached fraction of expert selections taken over
``moe.aux_loss_scope``: ``micro_batch`` (this rank's tokens), ``global_micro_batch`` (every rank's
tokens of this micro-step, through ``stats_reducer``), ``sequence`` (f and P per sequence, the
loss averaged over sequences) or ``global_batch`` (every rank's tokens of this micro-step and of
the earlier micro-steps of the optimizer step: :meth:`Router.begin_step` /
:meth:`Router.end_micro_batch` delimit them). Capacity is not the router's: the dispatchers apply
it where each expert lives (:mod:`moetrain.model.moe.capacity`).

``moe.score_func: sqrtsoftplus`` scores each expert ``sqrt(softplus(logit))`` (DeepSeek-V4);
like sigmoid's, its probabilities P_e are the scores over their sum.

Hash routing (``moe.hash_layers``, DeepSeek-V4's first layers): the selection is the fixed
row ``token_experts[token id]`` of a (V, K) table, a saved buffer that no optimizer touches;
the scores of the chosen experts weight them as above. The table is drawn at initialisation
from a generator seeded by the layer index alone (no global RNG), so every rank, and every
expert-parallel layout, routes a token identically.

Zero experts (``moe.zero_experts`` = Z > 0, LongCat-Flash): the gate scores E + Z choices and
the top-k picks among all of them; ids ``E .. E + Z - 1`` are the zero experts (the MoE layer
returns the input for them, :mod:`moetrain.model.moe.layer`). ``tokens_per_expert_E`` counts the
E routed experts only and ``zero_copies`` the picks of zero experts. In the load-balancing loss
the zero experts are one group whose selection fraction is their mean (the LongCat-Flash
report's extra group, frequency averaged within it): each zero expert's f_e is replaced by the
zero experts' mean before ``(E + Z) * sum_e f_e * P_e``; balanced routing still gives 1. The
selection bias holds E + Z entries, and :meth:`Router.update_bias` moves the E routed experts'
only (the report's rule leaves the zero experts' bias at zero).

``moe.router_type: sparsemixer`` replaces the selection and its weights by Phi-3.5-MoE's top-2
rule (:mod:`moetrain.model.moe.sparsemixer`); the losses, counts and entropy are as above (the
probabilities P_e the softmax of the logits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from moetrain.config import MoEConfig
from moetrain.model.attention import unit_rms
from moetrain.model.cpu_matmul import linear
from moetrain.model.moe.sparsemixer import sparsemixer_top2


@dataclass
class RouterOutput:
    """What the router decided for T tokens.

    weights_TK: fp32 combine weights (route_scale applied, bias never included).
    ids_TK: int64 selected experts (within the token's groups under group-limited routing).
    aux_loss, z_loss: unscaled fp32 scalars (the model multiplies by the coefficients).
    tokens_per_expert_E: detached float counts of this rank's selections of the E routed
    experts (before capacity). entropy: detached mean over tokens of the entropy of the routing
    distribution. zero_copies: detached int64 count of the picks of zero experts (ids >= E).
    """

    weights_TK: torch.Tensor
    ids_TK: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    tokens_per_expert_E: torch.Tensor
    entropy: torch.Tensor
    zero_copies: torch.Tensor


def count_experts(ids: torch.Tensor, num_bins: int) -> torch.Tensor:
    """int64 count of each value ``0 .. num_bins - 1`` in ``ids`` (every value must be in that
    range): ``torch.bincount`` without its host syncs (CUDA ``bincount`` reads the minimum and
    the maximum of its input on the host). Integer atomics, so exact in any order."""
    flat = ids.reshape(-1)
    out = torch.zeros(num_bins, dtype=torch.int64, device=ids.device)
    return out.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))


def limit_to_groups(
    choice_TE: torch.Tensor, n_group: int, topk_group: int, group_score: str = "top2_sum"
) -> torch.Tensor:
    """``choice_TE`` with -inf outside each token's ``topk_group`` best of ``n_group`` equal
    groups of experts; a group's score is the sum of its two best values (``top2_sum``; its best
    one when a group holds a single expert) or its best value (``max``)."""
    t, e = choice_TE.shape
    grouped_TGX = choice_TE.view(t, n_group, e // n_group)
    best = 1 if group_score == "max" else min(2, e // n_group)
    group_scores_TG = grouped_TGX.topk(best, dim=-1).values.sum(-1)
    chosen = group_scores_TG.topk(topk_group, dim=-1).indices
    allowed_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, chosen, True)
    return grouped_TGX.masked_fill(~allowed_TG.unsqueeze(-1), float("-inf")).view(t, e)


class RouterGate(nn.Linear):
    """The router's linear gate (``nn.Linear``'s parameters and keys): fp32 logits of any input,
    computed from fp32 copies of the weight and bias inside this module's forward (ZeRO-3
    gathers a module's parameters for its forward only)."""

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()  # moe.router_bias
        return linear(x_TD.float(), self.weight.float(), bias)


def hash_table(vocab_size: int, num_experts: int, top_k: int, layer: int) -> torch.Tensor:
    """A (vocab_size, top_k) int64 table of distinct experts per token id, uniform over the
    experts, drawn from a generator seeded by ``layer`` alone (the same on every rank)."""
    gen = torch.Generator().manual_seed(0x5EED + layer)
    return torch.rand(vocab_size, num_experts, generator=gen).topk(top_k, dim=-1).indices


def routing_scores(logits_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    """The per-expert scores of ``moe.score_func`` (softmax over the experts; sigmoid or
    sqrt(softplus) of each logit)."""
    if score_func == "sigmoid":
        return torch.sigmoid(logits_TE)
    if score_func == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits_TE).sqrt()
    return torch.softmax(logits_TE, dim=-1)


class Router(nn.Module):
    """Linear gate ``router.gate.weight`` (E, D) (and ``router.gate.bias`` (E,) with
    ``moe.router_bias``: part of the logits) + top-k selection + balancing losses.

    ``stats_reducer`` (set by parallel code, default None): sums the per-expert selection
    counts over every rank that routes tokens; the global scopes of the aux loss use it.
    ``step_counts_E`` (int64 buffer, not saved): the ``global_batch`` scope's counts of the
    optimizer step's earlier micro-steps (every rank). ``token_experts`` (vocab_size, K) int64,
    a saved buffer (:func:`hash_table` of ``layer``; None unless ``layer`` is one of
    ``moe.hash_layers``), selects each token's experts. Gemma 4's scalars: ``input_scale`` (D,)
    with ``moe.router_input_norm`` (the gate scores ``unit_rms(x) * input_scale * D^-0.5``,
    ``norm_eps`` the norm's eps) and ``expert_scale`` (E,) with ``moe.expert_scale`` (each
    chosen expert's combine weight times its scale, before ``moe.route_scale``).
    """

    def __init__(
        self,
        cfg: MoEConfig,
        d_model: int,
        norm_eps: float = 1e-6,
        vocab_size: int | None = None,
        layer: int = 0,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        choices = cfg.routed_choices  # E + Z (moe.zero_experts)
        self.gate = RouterGate(d_model, choices, bias=cfg.router_bias)
        self.norm_eps = norm_eps
        self.input_scale = nn.Parameter(torch.ones(d_model)) if cfg.router_input_norm else None
        self.expert_scale = nn.Parameter(torch.ones(cfg.num_experts)) if cfg.expert_scale else None
        self.register_buffer("expert_bias", torch.zeros(choices, dtype=torch.float32))
        self.register_buffer(
            "step_counts_E", torch.zeros(choices, dtype=torch.int64), persistent=False
        )
        table = None
        if cfg.is_hash_layer(layer):
            if vocab_size is None:
                raise ValueError(f"moe.hash_layers: layer {layer}'s router needs the vocab size")
            table = torch.zeros(vocab_size, cfg.top_k, dtype=torch.int64)
        self.register_buffer("token_experts", table)
        if table is not None and table.device.type != "meta":
            self.reset_parameters()
        self.stats_reducer: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._micro_counts_E: torch.Tensor | None = None  # this micro-step's, until committed

    def forward(
        self, x_TD: torch.Tensor, num_seqs: int = 1, token_ids_T: torch.Tensor | None = None
    ) -> RouterOutput:
        """Route ``x_TD``, the tokens of ``num_seqs`` equal sequences (the ``sequence`` scope
        balances each one); ``token_ids_T``: their token ids (a hash-routed layer's
        selection)."""
        cfg, e = self.cfg, self.cfg.routed_choices
        if self.training and cfg.jitter > 0:
            x_TD = x_TD * torch.empty_like(x_TD).uniform_(1.0 - cfg.jitter, 1.0 + cfg.jitter)
        if self.input_scale is not None:  # (in x's dtype, as transformers' Gemma 4 router)
            x_TD = unit_rms(x_TD, self.norm_eps) * self.input_scale * x_TD.shape[-1] ** -0.5
        logits_TE = self.gate(x_TD)
        scores_TE = probs_TE = routing_scores(logits_TE, cfg.score_func)
        if cfg.score_func != "softmax":
            probs_TE = scores_TE / scores_TE.sum(-1, keepdim=True)

        if self.token_experts is not None:
            if token_ids_T is None:
                raise ValueError(f"moe.hash_layers: layer {self.layer} routes by token ids")
            weights_TK, ids_TK = self._hashed(scores_TE, token_ids_T)
        elif cfg.router_type == "sparsemixer":
            weights_TK, ids_TK = sparsemixer_top2(logits_TE, cfg.router_jitter_eps)
        else:
            weights_TK, ids_TK = self._top_k(logits_TE, scores_TE)
        if self.expert_scale is not None:
            weights_TK = weights_TK * self.expert_scale.float()[ids_TK]
        counts_E = count_experts(ids_TK, e)
        t = max(x_TD.shape[0], 1)  # T = 0 (an empty micro-batch) gives zero losses, not NaN
        z_loss = torch.logsumexp(logits_TE, dim=-1).pow(2).sum() / t
        with torch.no_grad():
            entropy = -(probs_TE * probs_TE.clamp_min(1e-20).log()).sum() / t

        return RouterOutput(
            weights_TK=weights_TK * cfg.route_scale,
            ids_TK=ids_TK,
            aux_loss=self._aux_loss(probs_TE, ids_TK, counts_E, num_seqs),
            z_loss=z_loss,
            tokens_per_expert_E=counts_E[: self.num_experts].float(),
            entropy=entropy,
            zero_copies=counts_E[self.num_experts :].sum(),
        )

    def _hashed(
        self, scores_TE: torch.Tensor, token_ids_T: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights_TK, ids_TK)`` of hash routing: the table's experts for each token id,
        weighted by their scores (renormalised with ``moe.renormalize``), before route_scale."""
        ids_TK = self.token_experts[token_ids_T.reshape(-1)]
        return self._renormalized(scores_TE.gather(1, ids_TK)), ids_TK

    def _renormalized(self, weights_TK: torch.Tensor) -> torch.Tensor:
        """The k weights over their sum (``moe.renormalize``; with ``renormalize_min`` /
        ``renormalize_eps``), or as they are."""
        cfg = self.cfg
        if not cfg.renormalize:
            return weights_TK
        total_T1 = weights_TK.sum(-1, keepdim=True)
        if cfg.renormalize_min > 0:  # (0: the plain sum, bit for bit)
            total_T1 = total_T1.clamp_min(cfg.renormalize_min)
        if cfg.renormalize_eps > 0:  # (LFM2-MoE's sum + 1e-6)
            total_T1 = total_T1 + cfg.renormalize_eps
        return weights_TK / total_T1

    def _top_k(
        self, logits_TE: torch.Tensor, scores_TE: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights_TK, ids_TK)`` of the top-k rule: the selection (biased, group-limited;
        on the logits with ``moe.topk_before_score``) and the weights (softmax over the k, or
        the k's scores, renormalised), before route_scale."""
        cfg = self.cfg
        choice_TE = (logits_TE if cfg.topk_before_score else scores_TE) + self.expert_bias
        if cfg.n_group > 1:
            choice_TE = limit_to_groups(choice_TE, cfg.n_group, cfg.topk_group, cfg.group_score)
        ids_TK = torch.topk(choice_TE, self.top_k, dim=-1).indices
        if cfg.topk_before_score and cfg.score_func == "softmax":
            return torch.softmax(logits_TE.gather(1, ids_TK), dim=-1), ids_TK
        if cfg.topk_before_score:  # sigmoid of the chosen logits (Llama 4)
            weights_TK = torch.sigmoid(logits_TE.gather(1, ids_TK))
        else:
            weights_TK = scores_TE.gather(1, ids_TK)
        return self._renormalized(weights_TK), ids_TK

    def _aux_loss(
        self, probs_TE: torch.Tensor, ids_TK: torch.Tensor, counts_E: torch.Tensor, num_seqs: int
    ) -> torch.Tensor:
        """``E * sum_e f_e * P_e`` over ``moe.aux_loss_scope`` (see the module docstring; zero
        experts: one group, their mean f_e)."""
        scope, e = self.cfg.aux_loss_scope, self.cfg.routed_choices
        t = probs_TE.shape[0]
        if scope == "sequence":
            if t == 0:
                return probs_TE.sum() * 0.0
            b = num_seqs
            counts_BE = torch.zeros(b, e, device=ids_TK.device).scatter_add_(
                1, ids_TK.reshape(b, -1), torch.ones_like(ids_TK, dtype=torch.float32).view(b, -1)
            )
            frac_BE = self._group_zero_experts(counts_BE / ids_TK.reshape(b, -1).shape[1])
            mean_probs_BE = probs_TE.view(b, t // b, e).mean(1)
            return e * torch.sum(frac_BE * mean_probs_BE) / b
        if scope != "micro_batch" and self.stats_reducer is not None:
            counts_E = self.stats_reducer(counts_E)
        if scope == "global_batch" and self.training:
            self._micro_counts_E = counts_E.detach()
            counts_E = counts_E + self.step_counts_E
        frac_E = self._group_zero_experts(counts_E.float() / counts_E.sum().clamp_min(1).float())
        return e * torch.sum(frac_E.detach() * probs_TE.sum(0) / max(t, 1))

    def _group_zero_experts(self, frac_xE: torch.Tensor) -> torch.Tensor:
        """``frac_xE`` (fractions over the last dim, E + Z) with each zero expert's fraction
        replaced by the zero experts' mean (one group in the balancing loss)."""
        if not self.cfg.zero_experts:
            return frac_xE
        routed, zero = frac_xE.split([self.num_experts, self.cfg.zero_experts], dim=-1)
        return torch.cat([routed, zero.mean(-1, keepdim=True).expand_as(zero)], dim=-1)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Its own parameters' initial values: a zero selection bias, unit scalars, the
        hash-routing table (:func:`hash_table`)."""
        self.expert_bias.zero_()
        if self.token_experts is not None:
            v, k = self.token_experts.shape
            self.token_experts.copy_(hash_table(v, self.num_experts, k, self.layer))
        for scale in (self.input_scale, self.expert_scale):
            if scale is not None:
                scale.fill_(1.0)

    @torch.no_grad()
    def begin_step(self) -> None:
        """Start an optimizer step: forget the ``global_batch`` scope's counts."""
        self.step_counts_E.zero_()
        self._micro_counts_E = None

    @torch.no_grad()
    def end_micro_batch(self) -> None:
        """After a micro-step's backward: add its (every rank's) counts to the step's, for the
        ``global_batch`` scope. A forward that activation checkpointing runs again in backward
        recomputes the same counts, so they are added once, here."""
        if self._micro_counts_E is not None:
            self.step_counts_E += self._micro_counts_E
            self._micro_counts_E = None

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor) -> None:
        """Aux-loss-free balancing: ``bias += rate * sign(mean(load) - load)``.

        Call once per optimizer step with the load of the E routed experts summed over every
        rank; never in forward. A frozen router (a training stage that trains other parts
        alone) keeps its bias, and so does a hash-routed one (its table selects, not the
        bias); zero experts' entries stay as they are.
        """
        rate = self.cfg.bias_update_rate
        hashed = self.token_experts is not None  # (selects by its table, without the bias)
        if rate <= 0 or hashed or not self.gate.weight.requires_grad:
            return
        load_E = load_E.to(self.expert_bias)
        self.expert_bias[: self.num_experts].add_(rate * torch.sign(load_E.mean() - load_E))
