"""What each parameter of the model is, for the optimizers that treat parameters differently:
its kind, and the matrices it holds.

Kinds of the matrices (two or more dims): ``embedding``, ``lm_head``, ``router`` (an MoE
layer's gate), ``shared_gate`` (the shared expert's gate), ``attention`` (every projection of
grouped-query or latent attention: ``wq``, ``wk``, ``wv``, ``wo``; ``wq_a``, ``wq_b``,
``wkv_a``, ``wkv_b``), ``experts`` (the stacked routed experts ``w13``, ``w2``),
``mtp_projection`` (a multi-token-prediction module's ``eh_proj``) and ``ffn`` (every other
matrix: dense SwiGLUs, shared experts). Norm weights, biases (the experts' stacked biases
included), attention sinks and any other parameter that is not a linear map between features
(anything not 2-D, and a module named ``*conv*``: a linear-attention layer's short depthwise
convolution, even stored (channels, width)) are ``vector``.

Matrices: a 2-D parameter is one matrix; a stacked expert weight (E, in, out) is E matrices,
one per expert, and each expert's ``w13`` = ``[w1 | w3]`` is two, its gate and its up
projection (as the released models store them: each its own Linear), :func:`matrix_blocks`.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moetrain.config import Config
from moetrain.config.sections import MUON_MATRIX_KINDS
from moetrain.model import param_names
from moetrain.model.moe.experts import EXPERT_BIASES

if TYPE_CHECKING:
    from torch import nn

MATRIX_KINDS: tuple[str, ...] = typing.get_args(MUON_MATRIX_KINDS)  # (spelled in the config)
VECTOR = "vector"


def param_kind(name: str, ndim: int) -> str:
    """The kind of the parameter ``name`` with ``ndim`` dims (module docstring)."""
    experts = param_names.parse_experts(name)
    if ndim < 2 or name.endswith(".bias") or (experts and experts[1] in EXPERT_BIASES):
        return VECTOR
    parts = name.split(".")
    if ndim != 2 and experts is None or "conv" in parts[-2]:  # not a linear map between
        return VECTOR  # features: a (depthwise) convolution's kernel, ...
    if experts is not None:
        return "experts"
    if name == param_names.EMBED:
        return "embedding"
    if name == param_names.LM_HEAD:
        return "lm_head"
    if parts[-2:] == ["gate", "weight"] and parts[-3:-2] == ["router"]:
        return "router"
    if parts[-2:] == ["shared_gate", "weight"]:
        return "shared_gate"
    if len(parts) > 3 and parts[2] == "attn":
        return "attention"
    if parts[-2:] == ["eh_proj", "weight"]:
        return "mtp_projection"
    return "ffn"


@dataclass(frozen=True)
class Block:
    """A run of one parameter's flat values that holds ``splits`` matrices of ``rows`` x
    ``cols // splits``: the ``rows`` x ``cols`` block at ``start``, cut into equal column
    chunks."""

    start: int
    rows: int
    cols: int
    splits: int = 1

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def stop(self) -> int:
        return self.start + self.numel


def matrix_blocks(name: str, shape: tuple[int, ...]) -> list[Block]:
    """The blocks of the matrix parameter ``name`` of ``shape``, in order (module docstring)."""
    if len(shape) == 2:
        return [Block(0, shape[0], shape[1])]
    if len(shape) == 3 and param_names.parse_experts(name) is not None:
        n, rows, cols = shape
        splits = 2 if name.endswith(".w13") else 1
        return [Block(i * rows * cols, rows, cols, splits) for i in range(n)]
    raise ValueError(f"{name}: shape {tuple(shape)} is not a matrix or a stack of expert matrices")


def meta_model(cfg: Config) -> nn.Module:
    """``cfg``'s model with every parameter on the meta device (shapes and names only)."""
    import torch

    from moetrain.model.transformer import Transformer

    with torch.device("meta"):
        return Transformer(cfg.model, cfg.moe)
