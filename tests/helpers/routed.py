"""Which experts a parity test's batch reaches: a broken expert that no token of the test is
routed to cannot show in a logits comparison, so every parity test that compares moetrain's
logits with transformers' checks that each MoE layer routes a token to every expert.

Counts come from moetrain's own routing metric (``MoEOutput.tokens_per_expert_E``, the
selections before capacity), taken by a forward hook on each MoE layer.

At the usual init (std 0.02, unit-scale hidden states of width 32) router logits spread by about
0.1, while a randomised selection bias or router bias spreads by 0.2 (random_constants.py): the
bias alone picks the experts, and the same few win for every token. :func:`spread_routers`
draws the router weights wider (:data:`ROUTER_STD`), so that the token decides. In the
families with an attention output bias (gpt-oss, Phi-3.5-MoE) that bias, randomised to 0.2, also
outweighs the 0.02 embeddings in the residual stream, so every token reaches the first router
alike: their tiny models are initialised at :data:`OUTPUT_BIAS_FAMILY_STD`. A hash-routed
layer's token-id -> experts table (DeepSeek-V4's ``tid2eid``) that transformers leaves at zeros
sends every token to expert 0: :func:`spread_routers` draws it too.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from moetrain.model.moe.layer import MoELayer

ROUTER_STD = 0.3  # router logits spread ~1.7 at width 32: the token, not the bias, picks
OUTPUT_BIAS_FAMILY_STD = 0.2  # init std of the families with an attention output bias
ROUTER_NAME = re.compile(r"\.(gate|router)\.(\w+\.)?weight$")  # transformers' and moetrain's


@torch.no_grad()
def spread_routers(model: nn.Module, width: int, seed: int = 0) -> list[str]:
    """Redraw every router weight of ``model`` (a 2-D ``...gate[.x].weight`` or
    ``...router[.x].weight`` of ``width`` columns: one row per expert) from N(0, ROUTER_STD),
    and every constant hash-routing table (distinct random experts per token). Returns the
    names redrawn."""
    gen = torch.Generator().manual_seed(seed)
    drawn = []
    for name, p in model.named_parameters():
        if ROUTER_NAME.search(name) and p.dim() == 2 and p.shape[1] == width:
            p.copy_(torch.randn(p.shape, generator=gen) * ROUTER_STD)
            drawn.append(name)
    experts = model.get_parameter(drawn[0]).shape[0] if drawn else 0  # (a router's rows)
    for name, table in model.state_dict(keep_vars=True).items():
        if name.endswith("tid2eid") and bool((table == table.flatten()[0]).all()):
            rows = [torch.randperm(experts, generator=gen)[: table.shape[1]] for _ in table]
            table.copy_(torch.stack(rows))  # each token its own distinct experts
            drawn.append(name)
    return drawn


@contextmanager
def routed_counts(model: nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Within the block, every forward of ``model`` adds each MoE layer's selections per routed
    expert into the yielded dict (transformer layer index -> int64 counts, one per expert)."""
    counts: dict[int, torch.Tensor] = {}

    def record(layer: MoELayer, _args, output) -> None:  # noqa: ANN001
        load = output[1].tokens_per_expert_E.detach().round().long()
        counts[layer.layer] = counts.get(layer.layer, 0) + load

    hooks = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, MoELayer)]
    try:
        yield counts
    finally:
        for h in hooks:
            h.remove()


def unrouted(counts: dict[int, torch.Tensor]) -> dict[int, list[int]]:
    """Layer -> the experts with no token routed to them (layers that route every expert left
    out)."""
    out = {}
    for layer, load in sorted(counts.items()):
        idle = (load == 0).nonzero().flatten().tolist()
        if idle:
            out[layer] = idle
    return out


def assert_every_expert_routed(name: str, counts: dict[int, torch.Tensor]) -> None:
    """Fail naming ``name`` (the family or case), each layer and its experts that the test's
    batch never reaches; also fail when no MoE layer ran at all."""
    assert counts, f"{name}: no MoE layer ran, so no expert is checked"
    idle = unrouted(counts)
    detail = "; ".join(f"layer {layer}: experts {e}" for layer, e in idle.items())
    assert not idle, f"{name}: no token of the test reaches {detail} (a broken one cannot show)"
