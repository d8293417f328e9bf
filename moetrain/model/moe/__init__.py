"""Mixture-of-Experts block: router -> dispatcher -> experts -> combine."""

from moetrain.model.moe.dispatch import Dispatcher, LocalDispatcher, permute, unpermute
from moetrain.model.moe.experts import GroupedExperts
from moetrain.model.moe.layer import MoELayer, MoEOutput
from moetrain.model.moe.router import Router, RouterOutput, capacity_keep

__all__ = [
    "Dispatcher",
    "GroupedExperts",
    "LocalDispatcher",
    "MoELayer",
    "MoEOutput",
    "Router",
    "RouterOutput",
    "capacity_keep",
    "permute",
    "unpermute",
]
