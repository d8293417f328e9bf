"""Corpus sources through Hugging Face ``datasets``.

``data.source`` is one of:

- ``builtin:stdlib``: the embedded standard-library corpus (see ``moetrain.data.builtin``),
  cached as JSON lines in ``cache_dir``;
- a local file, directory or glob (``corpus/*.jsonl``, ``**`` allowed) of text / jsonl / json /
  parquet / csv files (``.gz``/``.bz2``/``.xz``/``.zst`` compressed too); the format comes from
  the extension or ``data.source_format``. Text files give one document per block of lines separated by a blank line; the other
  formats take the document from the ``data.text_field`` column;
- ``hf:NAME[:CONFIG]``: a dataset on the Hugging Face Hub, split ``data.split``. This path needs
  the network and is not exercised by the offline test suite.

With ``data.streaming`` the corpus is read as an ``IterableDataset`` and never held whole.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import datasets

from moetrain.checkpoint.io import file_sha256
from moetrain.config import DataConfig
from moetrain.data.builtin import BUILTIN_STDLIB, ensure_builtin_corpus
from moetrain.data.errors import DataError

_EXT_FORMAT = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "json",
    ".json": "json",
    ".ndjson": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst")
_BUILDER = {"text": "text", "json": "json", "parquet": "parquet", "csv": "csv"}


@dataclass
class Corpus:
    """A loaded source: the dataset, the name of its text column, and a fingerprint."""

    dataset: datasets.Dataset | datasets.IterableDataset
    text_field: str
    fingerprint: str
    description: str

    @property
    def streaming(self) -> bool:
        return isinstance(self.dataset, datasets.IterableDataset)


def _format_of(path: Path) -> str | None:
    name = path.name.lower()
    for ext in _COMPRESSED:
        name = name.removesuffix(ext)
    return _EXT_FORMAT.get(Path(name).suffix)


def resolve_files(source: str) -> list[Path]:
    """The files a local source names (file, directory or glob), sorted; errors name it."""
    if any(c in source for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(source, recursive=True) if Path(p).is_file())
        if not files:
            raise DataError(f"data.source: no files match the glob {source!r}")
        return files
    path = Path(source)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and _format_of(p))
        if not files:
            raise DataError(f"data.source: directory {path} holds no text/json/parquet/csv files")
        return files
    raise DataError(f"data.source: {path} does not exist")


def _local_format(files: list[Path], source_format: str | None) -> str:
    if source_format is not None:
        return source_format
    formats = {_format_of(f) for f in files}
    if None in formats:
        bad = next(f for f in files if _format_of(f) is None)
        raise DataError(
            f"{bad}: cannot tell the format from the extension; set data.source_format "
            "(text, json, parquet or csv)"
        )
    if len(formats) > 1:
        raise DataError(
            f"data.source {files[0].parent}: mixes formats {sorted(formats)}; use one format "
            "per source or set data.source_format"
        )
    return formats.pop()


def _stat_fingerprint(files: list[Path], extra: dict) -> str:
    items = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return hashlib.sha256(json.dumps([items, extra]).encode()).hexdigest()


def load_corpus(cfg: DataConfig, cache_dir: Path, work_dir: Path | None = None) -> Corpus:
    """Open ``cfg.source`` as a (possibly streaming) dataset with a checked text column.

    ``cache_dir`` keeps the builtin corpus; ``work_dir`` (if given) receives the Arrow cache of
    local sources, so that it is removed together with the prepare's temporary directory.
    """
    extra = {"max_docs": cfg.max_docs, "text_field": cfg.text_field}
    hf_cache = str(work_dir / "hf-cache") if work_dir is not None else None
    if cfg.source == BUILTIN_STDLIB:
        path = ensure_builtin_corpus(cache_dir)
        fmt, files = "json", [path]
        fingerprint = hashlib.sha256(
            json.dumps([BUILTIN_STDLIB, file_sha256(path), extra]).encode()
        ).hexdigest()
        text_field, desc = "text", f"{BUILTIN_STDLIB} ({path})"
    elif cfg.source.startswith("hf:"):
        return _load_hub(cfg, extra)
    elif cfg.source.startswith("builtin:"):
        raise DataError(
            f"data.source: unknown builtin corpus {cfg.source!r}; have {BUILTIN_STDLIB}"
        )
    else:
        files = resolve_files(cfg.source)
        fmt = _local_format(files, cfg.source_format)
        text_field = "text" if fmt == "text" else cfg.text_field
        fingerprint = _stat_fingerprint(files, extra | {"format": fmt})
        desc = f"{cfg.source} ({len(files)} {fmt} file{'s' * (len(files) != 1)})"
    for f in files:
        if f.stat().st_size == 0 and len(files) == 1:
            raise DataError(f"{f}: empty corpus (the file has no bytes)")
    kwargs = {"sample_by": "paragraph"} if fmt == "text" else {}
    try:
        ds = datasets.load_dataset(
            _BUILDER[fmt],
            data_files=[str(f) for f in files],
            split="train",
            streaming=cfg.streaming,
            cache_dir=hf_cache,
            **kwargs,
        )
    except DataError:
        raise
    except Exception as e:  # datasets raises many types for unreadable input
        raise DataError(f"data.source {desc}: could not be read as {fmt}: {e}") from None
    return _finish(ds, cfg, text_field, fingerprint, desc)


def _load_hub(cfg: DataConfig, extra: dict) -> Corpus:
    name, _, config = cfg.source[3:].partition(":")
    if not name:
        raise DataError(f"data.source: {cfg.source!r} names no dataset; use hf:NAME[:CONFIG]")
    try:
        ds = datasets.load_dataset(name, config or None, split=cfg.split, streaming=cfg.streaming)
    except Exception as e:
        raise DataError(f"data.source {cfg.source}: could not load from the Hub: {e}") from None
    fp = getattr(ds, "_fingerprint", None) or "streaming"
    fingerprint = hashlib.sha256(
        json.dumps([cfg.source, cfg.split, fp, extra]).encode()
    ).hexdigest()
    return _finish(ds, cfg, cfg.text_field, fingerprint, f"{cfg.source} split {cfg.split}")


def _finish(ds, cfg: DataConfig, text_field: str, fingerprint: str, desc: str) -> Corpus:
    columns = ds.column_names
    if columns is None:  # streaming without known features: look at the first example
        first = next(iter(ds), None)
        if first is None:
            raise DataError(f"data.source {desc}: empty corpus (no documents)")
        columns = list(first)
    if text_field not in columns:
        raise DataError(
            f"data.source {desc}: text field {text_field!r} not found (data.text_field); "
            f"columns are {columns}"
        )
    if cfg.max_docs is not None:
        ds = (
            ds.take(cfg.max_docs)
            if isinstance(ds, datasets.IterableDataset)
            else ds.select(range(min(cfg.max_docs, len(ds))))
        )
    if isinstance(ds, datasets.Dataset) and len(ds) == 0:
        raise DataError(f"data.source {desc}: empty corpus (no documents)")
    return Corpus(ds, text_field, fingerprint, desc)


def default_num_proc(num_proc: int) -> int:
    return num_proc if num_proc > 0 else (os.cpu_count() or 1)
