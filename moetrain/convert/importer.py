"""Hugging Face model directory -> moetrain checkpoint (continue pretraining, upcycling).

Reads ``config.json`` (Mixtral, Qwen2-MoE, Qwen3-MoE or GLM4-MoE; anything moetrain cannot
compute exactly is refused naming the field) and the safetensors weights (one file, or sharded
with an index; per-expert or transformers-v5 fused expert layout), and writes the layout the
trainer writes (:func:`moetrain.checkpoint.write.write_checkpoint`), with the directory's
SentencePiece ``tokenizer.model`` when it has one. Expert layers are read one at a time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from moetrain.checkpoint.read import HFWeights
from moetrain.checkpoint.write import write_checkpoint
from moetrain.config import Config
from moetrain.convert.formats import MODEL_TYPES, config_from_hf
from moetrain.convert.hf import from_hf_state_dict
from moetrain.data.tokenizer import MODEL_FILE

_EXPERT_NAME = re.compile(r"^model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.")


def expert_layer_of(name: str) -> int | None:
    """The layer of a Hugging Face expert tensor name, None for any other tensor."""
    m = _EXPERT_NAME.match(name)
    return int(m.group(1)) if m else None


def read_hf_config(hf_dir: Path) -> tuple[Config, str]:
    """moetrain's config of a Hugging Face model directory and its format name."""
    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    cfg = config_from_hf(hf_cfg)
    arch = (hf_cfg.get("architectures") or [None])[0]
    return cfg, MODEL_TYPES.get(arch) or hf_cfg["model_type"]


def hf_layer_states(
    hf_dir: Path, cfg: Config, fmt: str
) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """moetrain weights of a HF directory, streamed as ``iter_layer_states`` yields them."""
    weights = HFWeights(hf_dir)
    names = weights.names()
    dense_hf = weights.load([n for n in names if expert_layer_of(n) is None])
    yield "dense", from_hf_state_dict(dense_hf, cfg, fmt, expert_layers=[])
    for layer in cfg.moe.moe_layers(cfg.model.n_layers):
        part = weights.load([n for n in names if expert_layer_of(n) == layer]) | dense_hf
        state = from_hf_state_dict(part, cfg, fmt, expert_layers=[layer], dense=False)
        yield f"layers.{layer}", state


def load_hf_state_dict(hf_dir: str | Path) -> tuple[dict[str, torch.Tensor], Config]:
    """The whole moetrain state dict of a HF directory (for inference: everything in memory)."""
    hf_dir = Path(hf_dir)
    cfg, fmt = read_hf_config(hf_dir)
    state: dict[str, torch.Tensor] = {}
    for _, part in hf_layer_states(hf_dir, cfg, fmt):
        state.update(part)
    return state, cfg


def import_hf_checkpoint(hf_dir: str | Path, ckpt_dir: str | Path, step: int = 0) -> Path:
    """Write a committed moetrain checkpoint at ``ckpt_dir`` (must not exist) from a Hugging
    Face model directory; returns ``ckpt_dir``. Reads one expert layer at a time."""
    hf_dir = Path(hf_dir)
    cfg, fmt = read_hf_config(hf_dir)
    tok = hf_dir / MODEL_FILE
    return write_checkpoint(
        ckpt_dir,
        cfg,
        hf_layer_states(hf_dir, cfg, fmt),
        tok if tok.is_file() else None,
        step,
        {"imported_from": str(hf_dir)},
    )
