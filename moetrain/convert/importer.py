"""Hugging Face model directory -> moetrain checkpoint (continue pretraining, upcycling).

The directory is opened as a ``checkpoint.init_from`` source (:mod:`moetrain.init_from.source`:
an MoE family, or a dense family upcycled with the ``moe`` settings given as overrides), its
weights streamed one expert layer at a time (:mod:`moetrain.init_from.weights`) into the
layout the trainer writes (:func:`moetrain.checkpoint.write.write_checkpoint`), with the
directory's tokenizer (a Hugging Face ``tokenizer.json`` and the files that configure it, or a
SentencePiece ``tokenizer.model``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from moetrain.checkpoint.format import CheckpointError
from moetrain.checkpoint.write import write_checkpoint
from moetrain.config import Config, read_config_data
from moetrain.data.tokenizer import tokenizer_files
from moetrain.init_from.source import open_init_source, resolve_config_data
from moetrain.init_from.weights import check_source_tensors, init_record, source_parts


def load_hf_state_dict(hf_dir: str | Path) -> tuple[dict[str, torch.Tensor], Config]:
    """The whole moetrain state dict of a HF directory (for inference: everything in memory)."""
    source = open_init_source(str(hf_dir))
    state: dict[str, torch.Tensor] = {}
    for _, part in source_parts(source, source.config):
        state.update(part)
    return state, source.config


def import_hf_checkpoint(
    hf_dir: str | Path,
    ckpt_dir: str | Path,
    step: int = 0,
    overrides: list[str] | None = None,
    tokenizer: str | Path | None = None,
) -> Path:
    """Write a committed moetrain checkpoint at ``ckpt_dir`` (must not exist) from a Hugging
    Face model directory; returns ``ckpt_dir``. ``overrides``: ``key=value`` settings of the
    checkpoint's config (for a dense model, the MoE to upcycle it into, e.g.
    ``moe.num_experts=8``); a setting that contradicts the model's shape is refused.
    ``tokenizer``: the tokenizer the checkpoint carries (a Hugging Face tokenizer directory or
    ``tokenizer.json``, or a SentencePiece ``.model``), default the model directory's own; a
    model directory without one gives a checkpoint without one, which ``moetrain convert``
    then needs ``--tokenizer`` for. Every check runs before anything is written; reads one
    expert layer at a time."""
    data = read_config_data(None, overrides)
    data.setdefault("checkpoint", {})["init_from"] = str(hf_dir)
    cfg, source = resolve_config_data(data)
    assert source is not None
    check_source_tensors(source, cfg.model.mtp_depth)
    files = tokenizer_files(tokenizer if tokenizer is not None else hf_dir)
    if tokenizer is not None and not files:
        raise CheckpointError(f"--tokenizer {tokenizer}: no tokenizer.json or .model there")
    return write_checkpoint(
        ckpt_dir,
        cfg,
        source_parts(source, cfg),
        files,
        step,
        {"imported_from": str(hf_dir)},
        init_record(source, cfg),
    )
