"""`moetrain plan`'s activation counts of hyper-connections (``model.hc_streams``) and of the
router with zero experts (``moe.zero_experts``) against the tensors autograd really saves (as
tests/unit/test_plan.py checks the others), each as the difference to the same model without
them (the loss's transients cancel)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moetrain.config import Config
from moetrain.model import Transformer
from moetrain.model.moe.router import Router
from moetrain.plan import activation_bytes
from tests.unit.test_plan import _saved_bytes_per_token, _small

TOKENS = 128


def _plain(cfg: Config) -> Config:
    """``cfg`` without hyper-connections and zero experts."""
    model = dataclasses.replace(cfg.model, hc_streams=1)
    return dataclasses.replace(cfg, model=model, moe=dataclasses.replace(cfg.moe, zero_experts=0))


def _planned(cfg: Config, a: int) -> float:
    """``plan``'s saved bytes per token of ``cfg`` over :func:`_plain`'s."""
    extra = activation_bytes(cfg, TOKENS, False, a) - activation_bytes(
        _plain(cfg), TOKENS, False, a
    )
    return extra / TOKENS


@pytest.mark.parametrize("streams,dtype", [(2, torch.float32), (4, torch.bfloat16)])
def test_hyper_connection_activations_match_saved_tensors(streams: int, dtype: torch.dtype) -> None:
    """What ``model.hc_streams`` adds (each branch's hyper-connection, the final collapse),
    under bf16 with the fp32 copies of their weights autograd saves (parameter-sized, which
    ``plan`` leaves out). Negative control: one Sinkhorn iteration miscounted is outside the
    1e-3 tolerance."""
    cfg = _small({"model.loss_chunk_tokens": 128, "model.hc_streams": streams})
    a = 4 if dtype == torch.float32 else 2
    measured = _saved_bytes_per_token(cfg, dtype, TOKENS)
    measured -= _saved_bytes_per_token(_plain(cfg), dtype, TOKENS)
    planned = _planned(cfg, a)
    if dtype != torch.float32:
        n, d, blocks = streams, cfg.model.d_model, cfg.model.n_layers
        planned += 4 * (2 * blocks * ((2 + n) * n * n * d + 3) + n * n * d + 1) / TOKENS
    assert measured == pytest.approx(planned, rel=1e-3)
    iters = cfg.model.hc_sinkhorn_iters - 1
    off = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hc_sinkhorn_iters=iters))
    assert measured != pytest.approx(planned - _planned(cfg, a) + _planned(off, a), rel=1e-3)


def _route_to_real_experts(model: Transformer) -> None:
    """No copy routed to a zero expert: their selection biases far below any score."""
    for module in model.modules():
        if isinstance(module, Router):
            module.expert_bias[module.num_experts :] = -1e4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_expert_router_activations_match_saved_tensors(dtype: torch.dtype) -> None:
    """What ``moe.zero_experts`` Z adds with every copy routed to a real expert (the bound
    ``plan`` counts): the router's logits and probabilities over E + Z, the copies' masks,
    their summed weights (and under bf16 the fp32 input they scale; plus the router's fp32
    weight copy, parameter-sized, which ``plan`` leaves out). Routed as the router chooses,
    some copies skip the experts and less is saved. Negative control: the router counted
    over E alone is outside the tolerance."""
    z = 16
    cfg = _small({"model.loss_chunk_tokens": 128, "moe.zero_experts": z})
    a = 4 if dtype == torch.float32 else 2
    plain = _saved_bytes_per_token(_plain(cfg), dtype, TOKENS)
    measured = _saved_bytes_per_token(cfg, dtype, TOKENS, _route_to_real_experts) - plain
    moe_layers = len(cfg.moe.moe_layers(cfg.model.n_layers))
    planned = _planned(cfg, a)
    if dtype != torch.float32:
        planned += moe_layers * 4 * z * cfg.model.d_model / TOKENS
    assert measured == pytest.approx(planned, rel=1e-2)
    assert measured != pytest.approx(planned - moe_layers * 8 * z, rel=1e-2)
    assert _saved_bytes_per_token(cfg, dtype, TOKENS) - plain < measured
