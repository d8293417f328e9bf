"""Single-device model code (never imports torch.distributed)."""

from moetrain.model.layers import RMSNorm, SwiGLU
from moetrain.model.mixers.gqa import Attention
from moetrain.model.moe import GroupedExperts, LocalDispatcher, MoELayer, MoEOutput, Router
from moetrain.model.transformer import Block, Transformer, TransformerOutput

__all__ = [
    "Attention",
    "Block",
    "GroupedExperts",
    "LocalDispatcher",
    "MoELayer",
    "MoEOutput",
    "RMSNorm",
    "Router",
    "SwiGLU",
    "Transformer",
    "TransformerOutput",
]
