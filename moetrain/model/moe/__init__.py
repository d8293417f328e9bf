"""Mixture-of-Experts block: router -> dispatcher -> experts -> combine."""

from moetrain.model.moe.capacity import capacity_keep, expert_capacity
from moetrain.model.moe.dispatch import Dispatcher, LocalDispatcher, permute, unpermute
from moetrain.model.moe.experts import GroupedExperts
from moetrain.model.moe.layer import MoELayer, MoEOutput
from moetrain.model.moe.router import Router, RouterOutput

__all__ = [
    "Dispatcher",
    "GroupedExperts",
    "LocalDispatcher",
    "MoELayer",
    "MoEOutput",
    "Router",
    "RouterOutput",
    "capacity_keep",
    "expert_capacity",
    "permute",
    "unpermute",
]
