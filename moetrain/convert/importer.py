"""Hugging Face model directory -> moetrain checkpoint (continue pretraining, upcycling).

Reads ``config.json`` (Mixtral, Qwen2-MoE, Qwen3-MoE or GLM4-MoE; anything moetrain cannot
compute exactly is refused naming the field) and the safetensors weights (one file, or sharded
with an index; per-expert or transformers-v5 fused expert layout), and writes the layout the
trainer writes: ``mp_rank_00_model_states.pt`` (``{"module": dense state}``), one
``layer_<moe_idx>_expert_<G>_mp_rank_00_model_states.pt`` per global expert (DeepSpeed's key
names), ``trainer_state.json`` (resolved config, step, layout world 1 / EP 1),
``tokenizer.model`` when the directory has a SentencePiece model, and ``COMMITTED.json`` last.
The result is read by ``checkpoint_reader.load_model`` and converts back with
``convert_checkpoint``. Expert layers are read one at a time (``safe_open``).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

import moetrain
from moetrain.config import Config, is_moe_layer
from moetrain.convert.formats import MODEL_TYPES, config_from_hf
from moetrain.convert.hf import from_hf_state_dict
from moetrain.train.checkpoint_files import (
    COMMIT_FILE,
    CheckpointError,
    fsync_dir,
    write_json_atomic,
)
from moetrain.train.checkpoint_reader import DENSE_FILE

_EXPERT_NAME = re.compile(r"^model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.")


class _Weights:
    """Lazy access to the tensors of a HF directory, by name."""

    def __init__(self, hf_dir: Path) -> None:
        index = hf_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (hf_dir / "model.safetensors").is_file():
            with safe_open(hf_dir / "model.safetensors", "pt") as f:
                weight_map = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise CheckpointError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")
        self.dir, self.weight_map = hf_dir, weight_map

    def names(self, layer: int | None) -> list[str]:
        """Expert tensors of ``layer``, or (None) every non-expert tensor."""
        out = []
        for n in self.weight_map:
            m = _EXPERT_NAME.match(n)
            if (m is None and layer is None) or (m is not None and int(m.group(1)) == layer):
                out.append(n)
        return out

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.weight_map[n], []).append(n)
        out = {}
        for file, keys in by_file.items():
            with safe_open(self.dir / file, "pt") as f:
                out.update({k: f.get_tensor(k) for k in keys})
        return out


def _trainer_state(cfg: Config, step: int, sha: str | None, src: Path) -> dict:
    return {
        "format_version": 1,
        "moetrain_version": moetrain.__version__,
        "step": step,
        "tokens_seen": 0,
        "skipped_steps": 0,
        "loader": None,
        "schedule": None,
        "layout": {"world_size": 1, "ep_size": 1, "zero_stage": cfg.parallel.zero_stage},
        "tokenizer_sha256": sha,
        "config": cfg.to_dict(),
        "extra": {"imported_from": str(src)},
    }


def import_hf_checkpoint(hf_dir: str | Path, ckpt_dir: str | Path, step: int = 0) -> Path:
    """Write a committed moetrain checkpoint at ``ckpt_dir`` (must not exist) from a Hugging
    Face model directory; returns ``ckpt_dir``. Built in a temporary directory and renamed."""
    hf_dir, ckpt = Path(hf_dir), Path(ckpt_dir)
    if ckpt.exists():
        raise FileExistsError(f"{ckpt}: already exists")
    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    cfg = config_from_hf(hf_cfg)
    arch = (hf_cfg.get("architectures") or [None])[0]
    fmt = MODEL_TYPES.get(arch) or hf_cfg["model_type"]
    weights = _Weights(hf_dir)
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=ckpt.parent, prefix=f".{ckpt.name}.tmp-"))
    try:
        dense_hf = weights.load(weights.names(None))
        module = from_hf_state_dict(dense_hf, cfg, fmt, expert_layers=[])
        torch.save({"module": module, "dp_world_size": 1, "mp_world_size": 1}, tmp / DENSE_FILE)
        del module
        moe_layers = [i for i in range(cfg.model.n_layers) if is_moe_layer(i, cfg.moe)]
        for moe_idx, layer in enumerate(moe_layers):
            part = weights.load(weights.names(layer)) | dense_hf
            experts = from_hf_state_dict(part, cfg, fmt, expert_layers=[layer], dense=False)
            for e in range(cfg.moe.num_experts):
                prefix = f"layers.{layer}.ffn.experts.deepspeed_moe.experts.deepspeed_experts.{e}"
                sd = {
                    f"{prefix}.{n}": experts[f"layers.{layer}.ffn.experts.{n}"][e].clone()
                    for n in ("w1", "w2", "w3")
                }
                torch.save(sd, tmp / f"layer_{moe_idx}_expert_{e}_mp_rank_00_model_states.pt")
        sha = None
        if (hf_dir / "tokenizer.model").is_file():
            from moetrain.data.tokenizer import Tokenizer

            shutil.copyfile(hf_dir / "tokenizer.model", tmp / "tokenizer.model")
            sha = Tokenizer(tmp / "tokenizer.model").sha256
        write_json_atomic(tmp / "trainer_state.json", _trainer_state(cfg, step, sha, hf_dir))
        files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir())}
        write_json_atomic(tmp / COMMIT_FILE, {"step": step, "files": files})
        tmp.rename(ckpt)
        fsync_dir(ckpt.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ckpt
