"""The prepared form of a mixture (``data.sources``): one tokenizer, one shard set per source.

Each source is prepared into a shard set of its own (the format of :mod:`moetrain.data.shards`,
with a copy of the tokenizer) in ``data.sources_dir`` (default: ``sources/`` beside
``data.output_dir``), in a directory named by the source and a key of everything its tokens
depend on (the source's fingerprint, the tokenizer's sha256, the split and shard settings). A
mixture that shares a source and the tokenizer with another reuses that set without tokenizing
again. ``data.output_dir`` holds the tokenizer and ``mixture.json`` (written last)::

    {"format": "moetrain-mixture", "version": 1, "prepare_key": "...",
     "tokenizer": {"file", "kind", "sha256", "vocab_size", "special_ids"},
     "sources": [{"name", "spec", "weight", "fingerprint", "dir" (relative to output_dir),
                  "prepare_key", "splits": {"train": {"num_tokens", "num_docs"}, "val": ...}}]}

The weights recorded are those the tokenizer sample used; training uses the config's weights.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from moetrain.config import DataConfig
from moetrain.data.errors import DataError
from moetrain.data.shards import VERSION, is_complete, read_index
from moetrain.data.sources import SourceSpec
from moetrain.fileio import write_json_atomic

MIXTURE_FILE = "mixture.json"
FORMAT = "moetrain-mixture"
MIXTURE_VERSION = 1


def sources_dir(cfg: DataConfig) -> Path:
    """Where the sources' shard sets live: ``data.sources_dir``, or ``sources/`` beside
    ``data.output_dir``."""
    if cfg.sources_dir:
        return Path(cfg.sources_dir).resolve()
    return Path(cfg.output_dir).resolve().parent / "sources"


def source_set_key(
    fingerprint: str, tokenizer_sha256: str, cfg: DataConfig, split_rule: str
) -> str:
    """The identity of one source's shard set: what its bytes depend on."""
    key = {
        "version": VERSION,
        "source": fingerprint,
        "tokenizer_sha256": tokenizer_sha256,
        "val_fraction": cfg.val_fraction,
        "shard_tokens": cfg.shard_tokens,
        "split_rule": split_rule,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def source_set_dir(cfg: DataConfig, name: str, key: str) -> Path:
    return sources_dir(cfg) / f"{name}-{key[:16]}"


def write_mixture_index(
    out: Path, key: str, tokenizer: dict[str, Any], entries: list[dict[str, Any]]
) -> None:
    """``out/mixture.json``, atomically; entries' ``dir`` are made relative to ``out``."""
    index = {
        "format": FORMAT,
        "version": MIXTURE_VERSION,
        "prepare_key": key,
        "tokenizer": tokenizer,
        "sources": entries,
    }
    write_json_atomic(out / MIXTURE_FILE, index, sort_keys=False)


def relative_dir(target: Path, out: Path) -> str:
    """``target`` relative to the final ``out`` (so the tree can be moved as a whole)."""
    return os.path.relpath(target, out)


def read_mixture_index(out: str | Path) -> dict[str, Any]:
    """Read and sanity-check ``out/mixture.json``; errors name the file."""
    path = Path(out) / MIXTURE_FILE
    if not path.is_file():
        other = " (it holds a one-source shard set)" if (Path(out) / "index.json").is_file() else ""
        raise DataError(
            f"{path}: no mixture index{other}; run `moetrain prepare CONFIG` with this "
            "config's data.sources"
        )
    try:
        index = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: unreadable mixture index: {e}") from None
    if index.get("format") != FORMAT or index.get("version") != MIXTURE_VERSION:
        raise DataError(
            f"{path}: not a {FORMAT} v{MIXTURE_VERSION} index; rerun `moetrain prepare`"
        )
    return index


def open_source_set(
    out: Path, entry: dict[str, Any], tokenizer_sha256: str, where: str
) -> tuple[Path, dict[str, Any]]:
    """The directory and index of one source of a mixture, checked against the mixture:
    its key and its tokenizer; errors name the source (``where``)."""
    directory = (Path(out) / entry["dir"]).resolve()
    try:
        index = read_index(directory)
    except DataError as e:
        raise DataError(f"{where}: {e}") from None
    if index.get("prepare_key") != entry["prepare_key"]:
        raise DataError(
            f"{where}: {directory} holds another shard set than {Path(out) / MIXTURE_FILE} "
            "lists; rerun `moetrain prepare`"
        )
    sha = index["tokenizer"]["sha256"]
    if sha != tokenizer_sha256:
        raise DataError(
            f"{where}: the shards in {directory} were built with tokenizer sha256 {sha[:12]}, "
            f"but the mixture's tokenizer is {tokenizer_sha256[:12]}; rerun `moetrain prepare`"
        )
    return directory, index


def mixture_up_to_date(out: Path, key: str) -> bool:
    """Whether ``out`` holds a complete mixture prepared with ``key``."""
    try:
        index = read_mixture_index(out)
        if index.get("prepare_key") != key:
            return False
        for entry in index["sources"]:
            directory, _ = open_source_set(out, entry, index["tokenizer"]["sha256"], entry["name"])
            if not is_complete(directory, entry["prepare_key"]):
                return False
    except (DataError, KeyError, TypeError):
        return False
    return True


def match_sources(index: dict[str, Any], specs: list[SourceSpec], out: Path) -> list[dict]:
    """The index entry of every configured source, in config order; a source the mixture was
    not prepared with, or from another spec, is an error that names it."""
    entries = {e["name"]: e for e in index["sources"]}
    found = []
    for spec in specs:
        entry = entries.get(spec.name)
        if entry is None:
            raise DataError(
                f"{spec.where}: not in the mixture prepared in {out} (it has "
                f"{sorted(entries)}); rerun `moetrain prepare`"
            )
        if entry["spec"] != spec.source:
            raise DataError(
                f"{spec.where}: {out} was prepared from {entry['spec']!r}, the config says "
                f"{spec.source!r}; rerun `moetrain prepare`"
            )
        found.append(entry)
    return found
