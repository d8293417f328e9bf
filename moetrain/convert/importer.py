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
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

import moetrain
from moetrain.config import Config
from moetrain.convert.formats import MODEL_TYPES, config_from_hf
from moetrain.convert.hf import from_hf_state_dict
from moetrain.model.moe.experts import EXPERT_WEIGHTS
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


def _trainer_state(cfg: Config, step: int, sha: str | None, extra: dict) -> dict:
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
        "extra": extra,
    }


def write_checkpoint(
    ckpt_dir: str | Path,
    cfg: Config,
    parts: Iterable[tuple[str, dict[str, torch.Tensor]]],
    tokenizer_model: str | Path | None = None,
    step: int = 0,
    extra: dict | None = None,
) -> Path:
    """Write the trainer's checkpoint layout from streamed ``parts`` (as
    ``checkpoint_reader.iter_layer_states`` yields them: ``("dense", non-expert state)``, then
    ``("layers.<i>", {"layers.<i>.ffn.experts.w13": (E, D, 2F), ...})`` per MoE layer). Built in a
    temporary directory, committed (``COMMITTED.json`` last) and renamed to ``ckpt_dir``."""
    ckpt = Path(ckpt_dir)
    if ckpt.exists():
        raise FileExistsError(f"{ckpt}: already exists")
    moe_idx = {i: n for n, i in enumerate(cfg.moe.moe_layers(cfg.model.n_layers))}
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=ckpt.parent, prefix=f".{ckpt.name}.tmp-"))
    try:
        for where, part in parts:
            if where == "dense":
                module = {k: v for k, v in part.items() if ".ffn.experts." not in k}
                state = {"module": module, "dp_world_size": 1, "mp_world_size": 1}
                torch.save(state, tmp / DENSE_FILE)
                continue
            layer = int(where.split(".")[1])
            for e in range(cfg.moe.num_experts):
                prefix = f"layers.{layer}.ffn.experts.deepspeed_moe.experts.deepspeed_experts.{e}"
                sd = {
                    f"{prefix}.{n}": part[f"layers.{layer}.ffn.experts.{n}"][e].clone()
                    for n in EXPERT_WEIGHTS
                }
                name = f"layer_{moe_idx[layer]}_expert_{e}_mp_rank_00_model_states.pt"
                torch.save(sd, tmp / name)
        sha = None
        if tokenizer_model is not None:
            from moetrain.data.tokenizer import Tokenizer

            shutil.copyfile(tokenizer_model, tmp / "tokenizer.model")
            sha = Tokenizer(tmp / "tokenizer.model").sha256
        state = _trainer_state(cfg, step, sha, extra or {})
        write_json_atomic(tmp / "trainer_state.json", state)
        files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir())}
        write_json_atomic(tmp / COMMIT_FILE, {"step": step, "files": files})
        tmp.rename(ckpt)
        fsync_dir(ckpt.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ckpt


def import_hf_checkpoint(hf_dir: str | Path, ckpt_dir: str | Path, step: int = 0) -> Path:
    """Write a committed moetrain checkpoint at ``ckpt_dir`` (must not exist) from a Hugging
    Face model directory; returns ``ckpt_dir``. Reads one expert layer at a time."""
    hf_dir = Path(hf_dir)
    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    cfg = config_from_hf(hf_cfg)
    arch = (hf_cfg.get("architectures") or [None])[0]
    fmt = MODEL_TYPES.get(arch) or hf_cfg["model_type"]
    weights = _Weights(hf_dir)

    def parts() -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        dense_hf = weights.load(weights.names(None))
        yield "dense", from_hf_state_dict(dense_hf, cfg, fmt, expert_layers=[])
        for layer in range(cfg.model.n_layers):
            if cfg.moe.is_moe_layer(layer):
                part = weights.load(weights.names(layer)) | dense_hf
                yield (
                    f"layers.{layer}",
                    from_hf_state_dict(part, cfg, fmt, expert_layers=[layer], dense=False),
                )

    tok = hf_dir / "tokenizer.model"
    return write_checkpoint(
        ckpt_dir,
        cfg,
        parts(),
        tok if tok.is_file() else None,
        step,
        {"imported_from": str(hf_dir)},
    )
