"""Checkpoint -> Hugging Face model directory, streaming one layer at a time.

``convert_checkpoint`` reads a committed moetrain checkpoint written with any world and EP size
and ZeRO stage (the per-expert DeepSpeed files; at ZeRO-3 each rank's partitions), maps it to the chosen format's per-expert keys and writes:
``config.json`` (with ``architectures``), ``generation_config.json`` (bos/eos/pad ids),
safetensors weights (``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``
when above ``max_shard_bytes``, else ``model.safetensors``) and the tokenizer files.

Memory: the dense weights plus one layer of experts; shard headers are planned from the
config, so tensors stream straight into the files (no shard-sized buffer). Atomicity:
everything is built in a hidden temporary directory beside ``out_dir``, fsynced and renamed into
place; on any error the temporary directory is removed and ``out_dir`` is untouched.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from moetrain.checkpoint.format import (
    CheckpointError,
    TrainerState,
    tokenizer_path,
    verify_manifest,
)
from moetrain.checkpoint.read import check_experts, checkpoint_config, iter_layer_states
from moetrain.config import Config
from moetrain.convert.families import family
from moetrain.convert.formats import choose_format, family_of_architecture, hf_config
from moetrain.convert.hf_files import HF_INDEX_FILE, HF_SINGLE_FILE
from moetrain.convert.tokenizer_export import export_tokenizer
from moetrain.convert.weight_map import WeightMap
from moetrain.data.tokenizer import tokenizer_file
from moetrain.fileio import building_dir

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
}


def _plan(weights: WeightMap, dtype: torch.dtype) -> list[list[tuple[str, tuple, torch.dtype]]]:
    """The HF tensors (name, shape, dtype) of each streamed part, in ``iter_layer_states`` order:
    the dense weights, then each MoE layer's experts; names sorted within a part. Selection
    biases stay fp32 (as transformers keeps them)."""

    def part(layer: int | None) -> list[tuple[str, tuple, torch.dtype]]:
        tensors = weights.hf_tensors(layer)
        kept = {True: torch.float32, False: dtype}  # (an integer table names its own dtype)
        return sorted((n, s, kept.get(keep, keep)) for n, s, keep in tensors)

    return [part(None)] + [part(layer) for layer in weights.moe_layers]


class _ShardWriter:
    """Streams tensors into safetensors files planned in advance.

    Each shard's header (names, dtypes, shapes, offsets) is written when the shard is opened, so
    tensors are appended as they arrive and only the current part is ever in memory. A new
    shard starts when the next tensor would take it past ``max_bytes``.
    """

    def __init__(self, out: Path, plan: list[list[tuple[str, tuple, torch.dtype]]], max_bytes: int):
        self.out, self.parts = out, plan
        flat = [t for part in plan for t in part]
        self.shards: list[list[tuple[str, tuple, torch.dtype]]] = [[]]
        size = 0
        for name, shape, dt in flat:
            nbytes = _nbytes(shape, dt)
            if self.shards[-1] and size + nbytes > max_bytes:
                self.shards.append([])
                size = 0
            self.shards[-1].append((name, shape, dt))
            size += nbytes
        self.total_bytes = sum(_nbytes(s, dt) for _, s, dt in flat)
        n = len(self.shards)
        self.names = (
            [HF_SINGLE_FILE]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        self.shard_of = {t[0]: i for i, shard in enumerate(self.shards) for t in shard}
        self.next_part, self.file, self.file_idx = 0, None, -1

    def write_part(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        """Append one streamed part; it must hold exactly the planned tensors."""
        if self.next_part >= len(self.parts):
            raise CheckpointError(f"{where}: more parts than the model has")
        planned = self.parts[self.next_part]
        if set(tensors) != {n for n, _, _ in planned}:
            missing = sorted({n for n, _, _ in planned} - set(tensors))[:5]
            extra = sorted(set(tensors) - {n for n, _, _ in planned})[:5]
            raise CheckpointError(
                f"{where}: weights do not fit the model: missing {missing}, unexpected {extra}"
            )
        for name, shape, dt in planned:
            t = tensors[name].to(dt).contiguous()
            if tuple(t.shape) != shape:
                raise CheckpointError(f"{where}: {name} has shape {tuple(t.shape)}, not {shape}")
            self._open(self.shard_of[name])
            self.file.write(t.view(-1).view(torch.uint8).numpy().data)
        self.next_part += 1

    def _open(self, idx: int) -> None:
        if idx == self.file_idx:
            return
        self._close()
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, dt in self.shards[idx]:
            nbytes = _nbytes(shape, dt)
            header[name] = {
                "dtype": _ST_DTYPES[dt],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.file = open(self.out / self.names[idx], "wb")  # noqa: SIM115
        self.file.write(len(blob).to_bytes(8, "little") + blob)
        self.file_idx = idx

    def _close(self) -> None:
        if self.file is not None:
            self.file.close()  # fsynced with the directory when it is installed
            self.file = None

    def finish(self) -> None:
        """Close the last shard; write the index when sharded."""
        self._close()
        if self.next_part != len(self.parts):
            raise CheckpointError(f"only {self.next_part} of {len(self.parts)} parts were read")
        if len(self.names) == 1:
            return
        weight_map = {n: self.names[i] for n, i in sorted(self.shard_of.items())}
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out / HF_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _nbytes(shape: tuple, dt: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dt).element_size()


def _write_configs(cfg: Config, fmt: str, out: Path, dtype: str, tokenizer: Path) -> None:
    from transformers import GenerationConfig

    from moetrain.data.tokenizer import load_tokenizer

    special = load_tokenizer(tokenizer).special
    ids = dict(bos_token_id=special.bos, eos_token_id=special.eos, pad_token_id=special.pad)
    # a tokenizer without one: null, not -1 (which transformers refuses) or the family's default
    ids = {k: v if v >= 0 else None for k, v in ids.items()}
    hf = hf_config(cfg, fmt, **ids)
    hf.architectures = [family(fmt).config_architecture]  # the released files' class name
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
    tokenizer: str | Path | None = None,
    drop_mtp: bool = False,
) -> Path:
    """Write a Hugging Face model directory for a committed checkpoint; return ``out_dir``.

    ``drop_mtp``: export the model without its multi-token-prediction modules (they do not
    change the main model's function), e.g. to a family whose files cannot hold them.

    ``tokenizer``: the tokenizer to export with it (a Hugging Face tokenizer directory or
    ``tokenizer.json``, or a SentencePiece ``.model``) when the checkpoint carries none (one
    imported from a model directory without tokenizer files); default the checkpoint's own.

    ``fmt``: auto (the family of the Hugging Face model the run started from where it
    represents the model, else the first that does), or one of
    :data:`~moetrain.convert.families.FORMATS` (ConfigError naming the setting when the format
    cannot represent the model). Raises CheckpointError for a
    missing, truncated or incomplete checkpoint, FileExistsError when ``out_dir`` is a
    non-empty directory and ``overwrite`` is false.
    """
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    ckpt, out = Path(ckpt_dir), Path(out_dir)
    stored = checkpoint_config(ckpt)
    verify_manifest(ckpt)  # truncated or missing files, before anything is written
    check_experts(ckpt, stored)  # every expert of every MoE layer present
    cfg = stored
    if drop_mtp:
        cfg = dataclasses.replace(stored, model=dataclasses.replace(stored.model, mtp_depth=0))
    init = TrainerState.read(ckpt).init or {}  # auto: the family the run started from, first
    fmt = choose_format(cfg, fmt, prefer=family_of_architecture(init.get("architecture")))
    if tokenizer is not None:
        tokenizer = tokenizer_file(tokenizer)
        if not tokenizer.is_file():
            raise CheckpointError(f"--tokenizer: {tokenizer} is not a tokenizer file")
    else:
        tokenizer = tokenizer_path(ckpt)
    if tokenizer is None:
        raise CheckpointError(
            f"{ckpt}: carries no tokenizer (tokenizer.model or tokenizer.json; a checkpoint "
            "imported from a model directory without one): pass --tokenizer PATH"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{out}: already exists and is not empty (pass overwrite=True)")
    weights = WeightMap(cfg, fmt)
    with building_dir(out, replace=True) as tmp:  # an existing out was checked above
        writer = _ShardWriter(tmp, _plan(weights, DTYPES[dtype]), max_shard_bytes)
        for where, part in iter_layer_states(ckpt, stored):
            part = {k: v for k, v in part.items() if k in weights.shapes}  # (MTP when dropped)
            if part:
                writer.write_part(weights.to_hf(part), f"{ckpt} ({where})")
            del part
        writer.finish()
        _write_configs(cfg, fmt, tmp, dtype, tokenizer)
        export_tokenizer(tokenizer, tmp)
    return out
