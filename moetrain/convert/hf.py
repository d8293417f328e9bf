"""A whole moetrain state dict to and from a Hugging Face format's, through the one weight
mapper (:class:`~moetrain.convert.weight_map.WeightMap`), after checking that the format
represents the model: for a model held whole in memory (the tests, a quick look)."""

from __future__ import annotations

import torch

from moetrain.config import Config
from moetrain.convert.formats import check_format
from moetrain.convert.weight_entries import InMemory
from moetrain.convert.weight_map import WeightMap


def to_hf_state_dict(
    state_dict: dict[str, torch.Tensor], cfg: Config, fmt: str
) -> dict[str, torch.Tensor]:
    """A moetrain state dict, or any part of one holding whole entries, -> the tensors of
    ``fmt``'s files (contiguous). ConfigError for a setting or a tensor (a non-zero expert bias)
    that ``fmt`` cannot hold."""
    check_format(fmt, cfg.model, cfg.moe)
    return WeightMap(cfg, fmt).to_hf(state_dict)


def from_hf_state_dict(
    hf_state_dict: dict[str, torch.Tensor], cfg: Config, fmt: str
) -> dict[str, torch.Tensor]:
    """A state dict of ``fmt`` (the files' names and layout, or transformers v5's in-memory
    ones) -> the moetrain state dict (contiguous)."""
    check_format(fmt, cfg.model, cfg.moe)
    source, weights = InMemory(hf_state_dict), WeightMap(cfg, fmt, present=hf_state_dict)
    out = weights.read_dense(source)
    for layer in weights.moe_layers:
        out |= weights.read_experts(source, layer)
    return {k: v.detach().contiguous() for k, v in out.items()}
