"""Checkpoint -> Hugging Face model directory, streaming one layer at a time.

``convert_checkpoint`` reads a committed moetrain checkpoint written with any world and EP size
(the per-expert DeepSpeed files), maps it to the chosen format's per-expert keys and writes:
``config.json`` (with ``architectures``), ``generation_config.json`` (bos/eos/pad ids),
safetensors weights (``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``
when above ``max_shard_bytes``, else ``model.safetensors``) and the tokenizer files.

Memory: the dense weights, one layer of experts and at most one pending shard. Atomicity:
everything is built in a hidden temporary directory beside ``out_dir``, fsynced and renamed into
place; on any error the temporary directory is removed and ``out_dir`` is untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from moetrain.config import Config, is_moe_layer
from moetrain.convert.formats import ARCHITECTURES, choose_format, hf_config
from moetrain.convert.hf import dense_key_map, expert_key, to_hf_state_dict
from moetrain.convert.tokenizer_export import export_tokenizer
from moetrain.train.checkpoint_files import CheckpointError, fsync_dir
from moetrain.train.checkpoint_reader import (
    checkpoint_config,
    expert_files,
    iter_layer_states,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
_KEEP_FP32 = ("e_score_correction_bias",)  # selection biases stay fp32 (as transformers keeps them)


def _expected_keys(cfg: Config, fmt: str) -> set[str]:
    keys = set(dense_key_map(cfg, fmt).values())
    for i in range(cfg.model.n_layers):
        if is_moe_layer(i, cfg.moe):
            for e in range(cfg.moe.num_experts):
                keys |= {expert_key(fmt, i, e, n) for n in ("w1", "w2", "w3")}
        if fmt == "qwen2_moe":
            keys |= {f"model.layers.{i}.self_attn.{p}_proj.bias" for p in "qkv"}
    return keys


class _ShardWriter:
    """Collects tensors and writes a safetensors file whenever the next one would overflow."""

    def __init__(self, out: Path, max_bytes: int) -> None:
        self.out, self.max_bytes = out, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = t
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        path = self.out / f".shard-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[str]:
        """Rename shards to their final names; write the index when sharded."""
        self.flush()
        n = len(self.files)
        if n == 1:
            self.files[0][0].rename(self.out / "model.safetensors")
            return ["model.safetensors"]
        weight_map, names = {}, []
        for i, (path, keys) in enumerate(self.files):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(self.out / name)
            names.append(name)
            weight_map.update(dict.fromkeys(keys, name))
        index = {
            "metadata": {"total_size": self.total_bytes},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names


def _write_configs(cfg: Config, fmt: str, out: Path, dtype: str, tokenizer: Path) -> None:
    from transformers import GenerationConfig

    from moetrain.data.tokenizer import Tokenizer

    special = Tokenizer(tokenizer).special
    ids = dict(bos_token_id=special.bos, eos_token_id=special.eos, pad_token_id=special.pad)
    hf = hf_config(cfg, fmt, **ids)
    hf.architectures = [ARCHITECTURES[fmt]]
    hf.dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    hf.save_pretrained(out)
    GenerationConfig(**ids).save_pretrained(out)


def convert_checkpoint(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    dtype: str = "fp32",
    fmt: str = "auto",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write a Hugging Face model directory for a committed checkpoint; return ``out_dir``.

    ``fmt``: auto | mixtral | qwen2_moe | qwen3_moe | olmoe | glm4_moe (ConfigError naming the
    setting when the format cannot represent the model). Raises CheckpointError for a
    missing, truncated or incomplete checkpoint, FileExistsError when ``out_dir`` is a
    non-empty directory and ``overwrite`` is false.
    """
    from moetrain.train.checkpoint_files import verify_manifest

    if dtype not in DTYPES:
        raise ValueError(f"--dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    ckpt, out = Path(ckpt_dir), Path(out_dir)
    cfg = checkpoint_config(ckpt)
    verify_manifest(ckpt)  # truncated or missing files, before anything is written
    expert_files(ckpt, cfg)  # every expert of every MoE layer present
    fmt = choose_format(cfg, fmt)
    tokenizer = ckpt / "tokenizer.model"
    if not tokenizer.is_file():
        raise CheckpointError(f"{tokenizer}: missing (the checkpoint carries its tokenizer)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{out}: already exists and is not empty (pass overwrite=True)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        target = DTYPES[dtype]
        writer = _ShardWriter(tmp, max_shard_bytes)
        written: set[str] = set()
        for _, part in iter_layer_states(ckpt, cfg):
            for name, t in to_hf_state_dict(part, cfg, fmt).items():
                keep = t.is_floating_point() and name.endswith(_KEEP_FP32)
                cast = t.float() if keep else (t.to(target) if t.is_floating_point() else t)
                writer.add(name, cast.contiguous())
                written.add(name)
            del part
        missing, extra = _expected_keys(cfg, fmt) - written, written - _expected_keys(cfg, fmt)
        if missing or extra:
            raise CheckpointError(
                f"{ckpt}: weights do not fit the model: missing "
                f"{sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}"
            )
        writer.finish()
        _write_configs(cfg, fmt, tmp, dtype, tokenizer)
        export_tokenizer(tokenizer, tmp)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
        tmp.rename(out)
        fsync_dir(out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
