"""Expert parallelism applied to a model built on one device.

:func:`apply_expert_parallel` (every rank built the model with the same seed, either the full
model or, as the trainer does, only its own experts via ``Transformer(..., local_experts=...)``):
- slices each MoE layer's stacked expert weights to this rank's experts ``[ep_rank*L, +L)``
  when they are still the full set,
- replaces ``layer.dispatcher`` with :class:`~moetrain.parallel.ep_dispatcher.AllToAllDispatcher`
  (when ``ep_size > 1``), which knows the node of each EP rank for its traffic counts and
  replicates up to ``shadow_experts`` hot experts per forward (``parallel.shadow_experts``),
- sets ``router.stats_reducer`` to a no-grad sum over every rank (the global scopes of the
  load-balancing loss).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moetrain.config.layout import check_experts_divisible
from moetrain.parallel.ep_dispatcher import AllToAllDispatcher
from moetrain.parallel.topology import Topology


def global_sum_reducer(group: Any = None) -> Callable[[Tensor], Tensor]:
    """A no-grad all-reduce (sum) over ``group`` (default: every rank)."""

    def reduce(t: Tensor) -> Tensor:
        with torch.no_grad():
            out = t.detach().clone()
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    return reduce


def moe_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, layer)`` of every MoE layer (modules with router, dispatcher and experts)."""
    from moetrain.model.moe.layer import MoELayer

    for name, module in model.named_modules():
        if isinstance(module, MoELayer):
            yield name, module


def sharded_experts(model: nn.Module, ep_size: int, purpose: str) -> list[nn.Module]:
    """The experts module of every MoE layer of ``model``, each checked to hold its EP rank's
    share (``num_experts / ep_size``): ValueError naming ``purpose`` (what needs them) when
    expert parallelism has not been applied yet."""
    out = []
    for _, layer in moe_layers(model):
        experts = layer.experts
        if experts.num_local_experts * ep_size != experts.num_experts:
            raise ValueError(
                f"experts hold {experts.num_local_experts} of {experts.num_experts}: apply "
                f"expert parallelism (ep_size={ep_size}) before {purpose}"
            )
        out.append(experts)
    return out


def slice_experts(experts: nn.Module, start: int, stop: int) -> None:
    """Keep global experts ``[start, stop)`` of a module holding all of them (stacked weights
    ``w13 (E,D,2F)``, ``w2 (E,F,D)``, and their biases); ``num_experts`` stays the global
    count."""
    for wname in experts.param_names:
        w = getattr(experts, wname)
        sliced = nn.Parameter(w.detach()[start:stop].clone(), requires_grad=w.requires_grad)
        setattr(experts, wname, sliced)
    experts.local_experts = (start, stop)
    experts.num_local_experts = stop - start


def apply_expert_parallel(
    model: nn.Module, topology: Topology, shadow_experts: int = 0
) -> nn.Module:
    """Make a single-device model expert-parallel on ``topology`` (in place; returned).

    Its MoE layers hold either every expert or exactly this rank's ones.
    """
    for _, layer in moe_layers(model):
        experts = layer.experts
        num_experts = experts.num_experts
        check_experts_divisible(num_experts, topology.ep_size)
        start, stop = topology.local_experts(num_experts)
        held = experts.local_experts
        if held == (0, num_experts) and topology.ep_size > 1:
            slice_experts(experts, start, stop)
        elif held not in ((0, num_experts), (start, stop)):
            raise ValueError(
                f"MoE layer holds experts [{held[0]}, {held[1]}) of {num_experts}; EP rank "
                f"{topology.ep_rank} of {topology.ep_size} needs all of them or [{start}, {stop})"
            )
        if topology.ep_size > 1:
            layer.dispatcher = AllToAllDispatcher(
                num_experts,
                topology.ep_size,
                topology.ep_rank,
                topology.ep_group,
                nodes=topology.ep_nodes(),
                experts=experts,
                max_shadows=shadow_experts,
            )
        if topology.world_size > 1:
            layer.router.stats_reducer = global_sum_reducer()
    return model
