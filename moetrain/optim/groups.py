"""Parameter groups: which weights decay, and DeepSpeed's split of expert weights.

Every optimizer builds its groups from these rules. ``decay`` holds the matrices, ``no_decay``
the norm weights, biases (anything 1-D, and every ``.bias``) and the embeddings unless
``optim.decay_embeddings``. Expert weights (``param.allreduce == False``, set by the
expert-parallel code) are then moved into DeepSpeed MoE groups (``'moe': True``, ``'name'`` =
their expert group) so ZeRO reduces and partitions them over their expert-data-parallel group
(:func:`split_expert_groups`); every other key of a group travels with its expert copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moetrain.config import OptimConfig
from moetrain.model import param_names

if TYPE_CHECKING:
    import torch
    from torch import nn

EMBEDDING_NAMES = (param_names.EMBED,)


def is_no_decay(name: str, param: torch.Tensor, decay_embeddings: bool) -> bool:
    """Norm weights and biases (anything 1-D) never decay; embeddings only if configured. (A
    ZeRO-3 partition's shape is its ``ds_shape``.)"""
    if len(getattr(param, "ds_shape", param.shape)) < 2 or name.endswith(".bias"):
        return True
    return not decay_embeddings and name in EMBEDDING_NAMES


def trainable(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` of every parameter that takes gradients, in the model's order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def split_expert_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """DeepSpeed's split of each group into its dense part and one MoE group per expert group
    (``deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer``); empty groups
    are dropped."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    groups = split_params_into_different_moe_groups_for_optimizer(groups)
    return [g for g in groups if g["params"]]


def decay_groups(model: nn.Module, optim: OptimConfig) -> list[dict[str, Any]]:
    """``decay`` / ``no_decay`` groups (weight decay ``optim.weight_decay`` / 0), split further
    into DeepSpeed MoE groups for expert weights."""
    decay, no_decay = [], []
    for name, p in trainable(model):
        (no_decay if is_no_decay(name, p, optim.decay_embeddings) else decay).append(p)
    return split_expert_groups(
        [
            {"name": "decay", "params": decay, "weight_decay": optim.weight_decay},
            {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
        ]
    )
