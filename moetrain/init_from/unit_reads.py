"""A ``checkpoint.init_from`` source read one unit of the model at a time, for a model
partitioned as it is built (``parallel.zero_stage=3``, :mod:`moetrain.train.zero3_build`).

``read(names, layer, experts)`` returns the moetrain tensors it is asked for (dense ones) and,
when asked, one MoE layer's experts ``[start, stop)``, nothing else:

- a Hugging Face directory (:class:`UnitReads`): each call opens only the files that hold them
  and reads only those tensors. A dense source is upcycled unit by unit, as
  :func:`moetrain.init_from.weights.source_parts` upcycles it. Every tensor's name and shape is
  checked against the model before anything is read
  (:func:`~moetrain.init_from.weights.check_source_tensors`);
- a moetrain checkpoint (:class:`CheckpointUnitReads`, through
  :class:`moetrain.checkpoint.read.CheckpointTensors`): written at ZeRO-0/1/2, its dense file
  mapped (each tensor read from it where it is copied) and the experts from their per-expert
  files; written at ZeRO-3, each tensor assembled from the ranks' partitions of it (the files
  mapped), the experts from the files of the saved expert-parallel ranks that hold them only.
  A unit's experts are read one layer at a time.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from moetrain.checkpoint.read import CheckpointTensors
from moetrain.config import Config
from moetrain.init_from.source import InitSource
from moetrain.init_from.upcycle import upcycled_dense_part, upcycled_experts
from moetrain.init_from.weights import (
    check_source_tensors,
    dense_ffn,
    dense_source_map,
    source_map,
    upcycled_ffns,
)
from moetrain.model import param_names as pn


class UnitReads:
    """``source``'s weights for the run ``cfg``, a unit at a time (the module docstring);
    ``experts``: the global experts of each MoE layer this rank holds."""

    def __init__(self, source: InitSource, cfg: Config, experts: tuple[int, int]) -> None:
        check_source_tensors(source, cfg.model.mtp_depth)
        self.source, self.cfg, self.experts = source, cfg, experts
        self.files = source.weights()
        if source.upcycle:
            self.map, self.skip = dense_source_map(source, cfg), upcycled_ffns(cfg)
        else:
            self.map, self.skip = source_map(source, self.files, cfg.model.mtp_depth), set()
        self.moe_layers = set(cfg.moe.moe_layers(cfg.model.n_blocks))

    def read(
        self, names: Collection[str], layer: int | None, experts: bool
    ) -> dict[str, torch.Tensor]:
        """The dense tensors ``names`` of one unit (block ``layer``, or None outside the
        blocks) and, with ``experts``, that block's experts ``[start, stop)``; nothing else."""
        names = set(names)
        out = self.map.read_dense(self.files, self.skip, only=names)
        moe = layer is not None and layer in self.moe_layers
        if moe and self.source.upcycle:
            out |= self._upcycled(names, layer, experts)
        elif moe and experts:
            out |= self.map.read_experts(self.files, layer, self.experts)
        prefix = pn.experts_prefix(layer) if moe and experts else None
        return {k: v for k, v in out.items() if k in names or (prefix and k.startswith(prefix))}

    def _upcycled(self, names: set[str], layer: int, experts: bool) -> dict[str, torch.Tensor]:
        """Upcycled MoE block ``layer``'s router, bias, shared expert (those in ``names``) and,
        with ``experts``, its experts; the dense FFN is read only when they need it."""
        shared = {pn.shared_expert(layer, w) for w in pn.SWIGLU_WEIGHTS}
        if experts or names & shared:
            ffn = dense_ffn(self.map, self.files, layer)
        else:  # (the router and its zero bias need no FFN; the empty shared expert is dropped)
            ffn = [torch.zeros(0, 0)] * 3
        out = {k: v for k, v in upcycled_dense_part(*ffn, self.cfg, layer).items() if k in names}
        if experts:
            out |= upcycled_experts(*ffn, self.cfg, layer, self.experts)
        return out


class CheckpointUnitReads:
    """A moetrain checkpoint's weights (written at any ZeRO stage) for the run ``cfg``, a unit
    at a time (the module docstring); ``experts``: the global experts of each MoE layer this
    rank holds."""

    def __init__(self, source: InitSource, cfg: Config, experts: tuple[int, int]) -> None:
        check_source_tensors(source, cfg.model.mtp_depth)
        self.source, self.cfg, self.experts = source, cfg, experts
        self.tensors = CheckpointTensors(source.path, source.config)

    def read(
        self, names: Collection[str], layer: int | None, experts: bool
    ) -> dict[str, torch.Tensor]:
        """The dense tensors ``names`` of one unit (block ``layer``, or None outside the
        blocks) and, with ``experts``, that block's experts ``[start, stop)``; nothing else."""
        out = self.tensors.dense(names) if names else {}
        if experts and layer is not None:
            out |= self.tensors.experts(layer, *self.experts)
        return out


def unit_reads(
    source: InitSource, cfg: Config, experts: tuple[int, int]
) -> UnitReads | CheckpointUnitReads:
    """``source`` read a unit at a time (the module docstring)."""
    if source.kind == "huggingface":
        return UnitReads(source, cfg, experts)
    return CheckpointUnitReads(source, cfg, experts)
