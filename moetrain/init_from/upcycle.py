"""Sparse upcycling: the weights of an MoE layer made from a dense SwiGLU FFN.

Komatsuzaki et al. (2022), with the fine-grained "virtual group" initialisation of He et al.
(2024, "Upcycling Large Language Models into Mixture of Experts"). With granularity ``G``
(``checkpoint.upcycle_granularity``) the dense FFN's hidden size ``F`` is cut into ``G`` slices
of ``F / G`` (``moe.expert_hidden``); global expert ``e`` is a copy of slice ``e % G``, and the
``E / G`` experts ``c*G .. c*G + G-1`` form virtual group ``c`` (one whole copy of the FFN).

- Router (``router.gate.weight``, E x D): Normal(0, ``model.init_std``) rows, one row per
  virtual group repeated for its ``G`` experts (for ``G = 1`` every row differs), drawn from a
  generator seeded by ``seed`` and the layer, so every rank computes the same router.
- Experts: the slices, with the down projection multiplied by ``G / moe.route_scale`` (and by
  1/2 when a shared expert takes the other half, below). Optional noise
  (``checkpoint.upcycle_noise``): every expert's weights times ``1 + noise * N(0, 1)``, drawn per
  global expert (seeded by ``seed``, layer, expert), to break the symmetry between copies.
- Shared expert (``moe.num_shared_experts`` > 0; its hidden size must be ``F``): a copy of the
  whole FFN contributing half of the output: with ``moe.shared_expert_gate`` the gate starts at
  zero (sigmoid = 1/2), without it its down projection is halved.

What is preserved at step 0: with top-k weights that sum to 1 (``moe.renormalize``, or softmax
over the selected logits with ``moe.topk_before_score``), dropless routing and no noise, the
layer computes exactly the dense FFN. For ``G = 1`` every selected expert is the FFN itself and
the weights sum to 1. For ``G > 1`` with ``moe.top_k`` a multiple of ``G``: the ``G`` experts of
a virtual group have equal router logits, so top-k takes whole groups (barring an exact tie
between two groups' logits), each group's ``G`` weights are equal, and ``G`` slices with weight
``w / G`` each and the down projection times ``G`` sum to ``w`` times the FFN. Other settings
(no renormalisation, capacity, noise, jitter) upcycle too but do not compute the dense function
exactly; :func:`inexact_reasons` names them.
"""

from __future__ import annotations

import torch

from moetrain.config import Config, ConfigError
from moetrain.model import param_names as pn

_SEED_STRIDE = 1_000_003


def check_upcycle(cfg: Config, dense_hidden: int) -> None:
    """Refuse MoE settings that cannot be made from a dense FFN of ``dense_hidden``."""
    g, moe = cfg.checkpoint.upcycle_granularity, cfg.moe
    if moe.latent_dim is not None:
        raise ConfigError(
            "moe.latent_dim: upcycled experts are slices of the dense FFN, which computes in "
            f"d_model; must be null; got {moe.latent_dim}"
        )
    for key, value in (
        ("model.ffn_activation", cfg.model.ffn_activation),
        ("moe.activation", "swiglu" if moe.gated else moe.activation),
    ):
        if value != "swiglu":
            raise ConfigError(
                f"{key}: upcycling slices a dense SwiGLU FFN into gated experts; must be "
                f"swiglu; got {value}"
            )
    if dense_hidden % g:
        raise ConfigError(
            f"checkpoint.upcycle_granularity: {g} does not divide the dense FFN's hidden size "
            f"{dense_hidden}"
        )
    if moe.expert_hidden * g != dense_hidden:
        raise ConfigError(
            f"moe.expert_hidden: upcycling a dense FFN of hidden size {dense_hidden} with "
            f"granularity {g} gives experts of {dense_hidden // g}; got {moe.expert_hidden}"
        )
    if moe.num_experts % g:
        raise ConfigError(
            f"moe.num_experts: must be a multiple of checkpoint.upcycle_granularity={g} (each "
            f"virtual group holds one whole copy of the FFN); got {moe.num_experts}"
        )
    if moe.top_k % g:
        raise ConfigError(
            f"moe.top_k: must be a multiple of checkpoint.upcycle_granularity={g} (top-k takes "
            f"whole virtual groups); got {moe.top_k}"
        )
    if moe.num_shared_experts and moe.shared_hidden != dense_hidden:
        raise ConfigError(
            f"moe.shared_expert_hidden: an upcycled shared expert is a copy of the dense FFN, "
            f"hidden size {dense_hidden}; got {moe.shared_hidden}"
        )


def inexact_reasons(cfg: Config) -> list[str]:
    """The settings under which the upcycled model does not compute the dense model exactly at
    step 0 (empty: it does)."""
    moe, out = cfg.moe, []
    if not (moe.renormalize or (moe.topk_before_score and moe.score_func == "softmax")):
        out.append("moe.renormalize=false (the top-k weights do not sum to 1)")
    floor = moe.top_k / moe.num_experts  # the least a softmax's top-k can sum to
    if moe.renormalize_min > 0 and (moe.score_func == "sigmoid" or moe.renormalize_min > floor):
        out.append(
            f"moe.renormalize_min={moe.renormalize_min:g} (top-k weights summing to less are "
            "not brought to 1)"
        )
    if moe.route_scale != 1:
        out.append(f"moe.route_scale={moe.route_scale} (the top-k weights sum to it, not to 1)")
    if moe.capacity_factor > 0:
        out.append("moe.capacity_factor > 0 (tokens over capacity are dropped)")
    if moe.jitter > 0:
        out.append("moe.jitter > 0 (noisy router input in training)")
    if cfg.checkpoint.upcycle_noise > 0:
        out.append("checkpoint.upcycle_noise > 0 (experts perturbed)")
    if moe.score_on_input and moe.top_k > 1:
        out.append(
            "moe.score_on_input=true with top_k > 1 (each expert sees its weight times the "
            "input, and the FFN is not linear)"
        )
    if moe.activation != "swiglu":
        out.append(f"moe.activation={moe.activation} (the experts' activation is not the FFN's)")
    return out


def _generator(seed: int, *ids: int) -> torch.Generator:
    value = seed
    for i in ids:
        value = value * _SEED_STRIDE + i + 1
    return torch.Generator().manual_seed(value % (2**63))


def upcycled_router(cfg: Config, layer: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``router.gate.weight`` (E, D) of MoE layer ``layer`` (see the module docstring)."""
    g, moe = cfg.checkpoint.upcycle_granularity, cfg.moe
    gen = _generator(cfg.seed, layer)
    rows = torch.randn(moe.num_experts // g, cfg.model.d_model, generator=gen)
    return (rows * cfg.model.init_std).repeat_interleave(g, dim=0).to(dtype)


def upcycled_experts(
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    cfg: Config,
    layer: int,
    experts: tuple[int, int],
) -> dict[str, torch.Tensor]:
    """Global experts ``[start, stop)`` of MoE layer ``layer`` from the dense FFN in Hugging Face
    layout (``w1`` gate and ``w3`` up (F, D), ``w2`` down (D, F)): moetrain's stacked
    ``layers.<i>.ffn.experts.w13`` (L, D, 2F/G) and ``.w2`` (L, F/G, D)."""
    g, moe = cfg.checkpoint.upcycle_granularity, cfg.moe
    f = moe.expert_hidden
    scale = g / moe.route_scale * (0.5 if moe.num_shared_experts else 1.0)
    noise = cfg.checkpoint.upcycle_noise
    w13s, w2s = [], []
    for e in range(*experts):
        rows = slice((e % g) * f, (e % g + 1) * f)
        w13 = torch.cat([w1[rows].t(), w3[rows].t()], dim=1).float()
        down = w2[:, rows].t().float() * scale
        if noise > 0:
            gen = _generator(cfg.seed, layer, e)
            w13 = w13 * (1 + noise * torch.randn(w13.shape, generator=gen))
            down = down * (1 + noise * torch.randn(down.shape, generator=gen))
        w13s.append(w13)
        w2s.append(down)
    out = {pn.experts(layer, "w13"): torch.stack(w13s), pn.experts(layer, "w2"): torch.stack(w2s)}
    if moe.expert_biases:  # (zeros: the dense FFN has none)
        n, d = len(w13s), cfg.model.d_model
        out[pn.experts(layer, "w13_bias")] = torch.zeros(n, 2 * f)
        out[pn.experts(layer, "w2_bias")] = torch.zeros(n, d)
    return out


def upcycled_dense_part(
    w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, cfg: Config, layer: int
) -> dict[str, torch.Tensor]:
    """The non-expert weights of upcycled MoE layer ``layer``: router, its (zero) selection
    bias, and the shared expert and its gate when the config has them."""
    moe = cfg.moe
    out = {
        pn.router_gate(layer): upcycled_router(cfg, layer),
        pn.expert_bias(layer): torch.zeros(moe.num_experts),
    }
    if moe.router_bias:
        out[pn.router_gate(layer, "bias")] = torch.zeros(moe.num_experts)
    if moe.num_shared_experts:
        half = 1.0 if moe.shared_expert_gate else 0.5
        out[pn.shared_expert(layer, "w1")] = w1.float()
        out[pn.shared_expert(layer, "w3")] = w3.float()
        out[pn.shared_expert(layer, "w2")] = w2.float() * half
        if moe.shared_expert_gate:
            out[pn.shared_gate(layer)] = torch.zeros(1, cfg.model.d_model)
    return out
