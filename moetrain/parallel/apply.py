"""Parallelism applied to a model built on one device, in one place: expert parallelism,
sequence parallelism, the DeepSpeed MoE marking of the experts (at ZeRO-3 their placement tags,
:mod:`moetrain.parallel.zero3`), and activation checkpointing. A model built on the meta device
(ZeRO-3's streamed build) takes it too."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from moetrain.config import ParallelConfig
from moetrain.parallel.deepspeed import mark_experts_for_deepspeed
from moetrain.parallel.expert_parallel import apply_expert_parallel
from moetrain.parallel.sequence_parallel import apply_sequence_parallel
from moetrain.parallel.topology import Topology
from moetrain.parallel.zero3 import place_experts


def checkpoint_blocks(model: nn.Module) -> int:
    """Activation checkpointing: recompute every transformer block in backward."""
    from torch.utils.checkpoint import checkpoint

    count = 0
    for block in model.layers:
        inner = block.forward

        def forward(*args: Any, _inner: Callable[..., Any] = inner) -> Any:
            if torch.is_grad_enabled():
                return checkpoint(_inner, *args, use_reentrant=False)
            return _inner(*args)

        block.forward = forward
        count += 1
    return count


def apply_parallelism(model: nn.Module, cfg: ParallelConfig, topology: Topology) -> nn.Module:
    """Make ``model`` ready for the DeepSpeed engine on ``topology`` (in place; returned)."""
    apply_expert_parallel(model, topology, cfg.shadow_experts)
    apply_sequence_parallel(model, topology)
    if cfg.zero_stage == 3:
        place_experts(model, topology)
    else:
        mark_experts_for_deepspeed(model, topology)
    if cfg.activation_checkpointing:
        checkpoint_blocks(model)
    return model
