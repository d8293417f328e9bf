"""Corpus sources: local files, the builtin corpus and the Hugging Face Hub.

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

A mixture (``data.sources``) lists several such sources; :func:`source_specs` gives every
source with its settings resolved (an entry's missing settings come from ``data.*``) and the
label its errors carry (``data.source``, or ``data.sources[1] (code)``). A source is resolved
in two steps: :func:`resolve_source` finds its files and fingerprint (cheap: file names, sizes
and times), :func:`open_source` opens its documents: uncompressed JSON Lines in place
(:mod:`moetrain.data.jsonl`: no conversion before tokenizing), every other format through
Hugging Face ``datasets`` (an Arrow-backed dataset, or an ``IterableDataset`` when streamed).
"""

from __future__ import annotations

import glob
import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from moetrain.config import DataConfig
from moetrain.config.mixture import default_source_name
from moetrain.data.builtin import BUILTIN_STDLIB, ensure_builtin_corpus
from moetrain.data.errors import DataError
from moetrain.data.jsonl import JsonLines, is_json_lines
from moetrain.fileio import file_sha256

if TYPE_CHECKING:  # (imported where a source is read: training reads shards, never these)
    import datasets

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


@dataclass(frozen=True)
class SourceSpec:
    """One source with every setting resolved: ``data.source``, or one ``data.sources`` entry."""

    name: str
    source: str
    weight: float
    text_field: str
    source_format: str | None
    split: str
    max_docs: int | None
    streaming: bool
    where: str  # how errors name it: "data.source" or "data.sources[1] (code)"
    key_prefix: str  # where its settings live: "data." or "data.sources[1]."


def source_specs(cfg: DataConfig) -> list[SourceSpec]:
    """The sources of ``cfg``: the one ``data.source``, or every ``data.sources`` entry."""
    if not cfg.sources:
        return [
            SourceSpec(
                name=default_source_name(cfg.source),
                source=cfg.source,
                weight=1.0,
                text_field=cfg.text_field,
                source_format=cfg.source_format,
                split=cfg.split,
                max_docs=cfg.max_docs,
                streaming=cfg.streaming,
                where="data.source",
                key_prefix="data.",
            )
        ]
    out = []
    for i, s in enumerate(cfg.sources):
        name = s.name or default_source_name(s.source)
        out.append(
            SourceSpec(
                name=name,
                source=s.source,
                weight=s.weight,
                text_field=s.text_field or cfg.text_field,
                source_format=s.source_format or cfg.source_format,
                split=s.split or cfg.split,
                max_docs=s.max_docs if s.max_docs is not None else cfg.max_docs,
                streaming=cfg.streaming,
                where=f"data.sources[{i}] ({name})",
                key_prefix=f"data.sources[{i}].",
            )
        )
    return out


class Documents(Protocol):
    """The documents of a source that is read whole, by index (not streamed)."""

    def __len__(self) -> int: ...

    def sizes(self, where: str) -> np.ndarray:
        """Each document's size in bytes (what the chunk plan balances)."""
        ...

    def texts(self, lo: int, hi: int, batch: int) -> Iterator[list[str | None]]:
        """The texts (None: no text) of documents ``[lo, hi)``, in lists of ``batch``."""
        ...

    def take(self, indices: Sequence[int]) -> list[str | None]:
        """The texts of the documents ``indices``."""
        ...


class ArrowDocuments:
    """The documents of a ``datasets.Dataset`` (an Arrow table, memory-mapped)."""

    def __init__(self, dataset: datasets.Dataset, text_field: str) -> None:
        self.dataset = dataset.with_format("arrow")
        self.text_field = text_field

    def __len__(self) -> int:
        return len(self.dataset)

    def sizes(self, where: str) -> np.ndarray:
        """UTF-8 bytes of every document's text, from the Arrow offsets."""
        import pyarrow as pa
        import pyarrow.compute as pc

        out = []
        for table in self.dataset.iter(batch_size=1 << 16):
            column = table.column(self.text_field)
            if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
                if pa.types.is_null(column.type):
                    out.append(np.zeros(len(column), np.int64))
                    continue
                raise DataError(
                    f"{where}: text field {self.text_field!r} holds {column.type}, not text"
                )
            out.append(pc.fill_null(pc.binary_length(column), 0).to_numpy().astype(np.int64))
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def texts(self, lo: int, hi: int, batch: int) -> Iterator[list[str | None]]:
        for b in range(lo, hi, batch):
            yield self.dataset[b : min(b + batch, hi)].column(self.text_field).to_pylist()

    def take(self, indices: Sequence[int]) -> list[str | None]:
        return self.dataset.select(indices)[:].column(self.text_field).to_pylist()


@dataclass
class Corpus:
    """An opened source: its documents by index, or (``data.streaming``) a stream; the field
    that holds the text; a fingerprint."""

    docs: Documents | None
    stream: datasets.IterableDataset | None
    text_field: str
    fingerprint: str
    description: str

    @property
    def streaming(self) -> bool:
        return self.docs is None


@dataclass
class SourceRef:
    """A resolved, not yet opened source: its files and fingerprint (a Hub dataset is opened
    already: its fingerprint comes from the download)."""

    spec: SourceSpec
    fingerprint: str
    description: str
    fmt: str | None = None
    files: list[Path] | None = None
    text_field: str = "text"
    hub: Corpus | None = None


def _format_of(path: Path) -> str | None:
    name = path.name.lower()
    for ext in _COMPRESSED:
        name = name.removesuffix(ext)
    return _EXT_FORMAT.get(Path(name).suffix)


def resolve_files(source: str, where: str = "data.source") -> list[Path]:
    """The files a local source names (file, directory or glob), sorted; errors name it."""
    if any(c in source for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(source, recursive=True) if Path(p).is_file())
        if not files:
            raise DataError(f"{where}: no files match the glob {source!r}")
        return files
    path = Path(source)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and _format_of(p))
        if not files:
            raise DataError(f"{where}: directory {path} holds no text/json/parquet/csv files")
        return files
    raise DataError(f"{where}: {path} does not exist")


def _local_format(files: list[Path], spec: SourceSpec) -> str:
    if spec.source_format is not None:
        return spec.source_format
    formats = {_format_of(f) for f in files}
    if None in formats:
        bad = next(f for f in files if _format_of(f) is None)
        raise DataError(
            f"{bad}: cannot tell the format from the extension; set {spec.key_prefix}source_format "
            "(text, json, parquet or csv)"
        )
    if len(formats) > 1:
        raise DataError(
            f"{spec.where} {files[0].parent}: mixes formats {sorted(formats)}; use one format "
            f"per source or set {spec.key_prefix}source_format"
        )
    return formats.pop()


def _stat_fingerprint(files: list[Path], extra: dict) -> str:
    items = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return hashlib.sha256(json.dumps([items, extra]).encode()).hexdigest()


def resolve_source(spec: SourceSpec, cache_dir: Path) -> SourceRef:
    """Find the files of ``spec`` and its fingerprint, without reading the documents (the
    builtin corpus is built into ``cache_dir`` on first use; a Hub dataset is loaded)."""
    extra = {"max_docs": spec.max_docs, "text_field": spec.text_field}
    if spec.source == BUILTIN_STDLIB:
        path = ensure_builtin_corpus(cache_dir)
        fingerprint = hashlib.sha256(
            json.dumps([BUILTIN_STDLIB, file_sha256(path), extra]).encode()
        ).hexdigest()
        return SourceRef(spec, fingerprint, f"{BUILTIN_STDLIB} ({path})", "json", [path])
    if spec.source.startswith("hf:"):
        corpus = _load_hub(spec, extra)
        return SourceRef(spec, corpus.fingerprint, corpus.description, hub=corpus)
    if spec.source.startswith("builtin:"):
        raise DataError(
            f"{spec.where}: unknown builtin corpus {spec.source!r}; have {BUILTIN_STDLIB}"
        )
    files = resolve_files(spec.source, spec.where)
    fmt = _local_format(files, spec)
    text_field = "text" if fmt == "text" else spec.text_field
    fingerprint = _stat_fingerprint(files, extra | {"format": fmt})
    desc = f"{spec.source} ({len(files)} {fmt} file{'s' * (len(files) != 1)})"
    for f in files:
        if f.stat().st_size == 0 and len(files) == 1:
            raise DataError(f"{spec.where}: {f}: empty corpus (the file has no bytes)")
    return SourceRef(spec, fingerprint, desc, fmt, files, text_field)


def open_source(ref: SourceRef, work_dir: Path | None = None) -> Corpus:
    """Open ``ref``: uncompressed JSON Lines in place (:mod:`moetrain.data.jsonl`), any other
    local format as an Arrow-backed dataset, or a stream. ``work_dir`` (if given) receives the
    line index or the Arrow cache (processes that pass the same directory share it)."""
    if ref.hub is not None:
        return ref.hub
    spec, fmt = ref.spec, ref.fmt
    assert fmt is not None and ref.files is not None
    if fmt == "json" and not spec.streaming and is_json_lines(ref.files):
        return _open_json_lines(ref, work_dir)
    kwargs = {"sample_by": "paragraph"} if fmt == "text" else {}
    import datasets

    try:
        ds = datasets.load_dataset(
            _BUILDER[fmt],
            data_files=[str(f) for f in ref.files],
            split="train",
            streaming=spec.streaming,
            cache_dir=str(work_dir) if work_dir is not None else None,
            **kwargs,
        )
    except DataError:
        raise
    except Exception as e:  # datasets raises many types for unreadable input
        raise DataError(
            f"{spec.where} {ref.description}: could not be read as {fmt}: {e}"
        ) from None
    return _finish(ds, spec, ref.text_field, ref.fingerprint, ref.description)


def _open_json_lines(ref: SourceRef, work_dir: Path | None) -> Corpus:
    spec = ref.spec
    assert ref.files is not None
    docs = JsonLines.open(ref.files, ref.text_field, ref.fingerprint, work_dir)
    if spec.max_docs is not None:
        docs = docs.head(spec.max_docs)
    if len(docs) == 0:
        raise DataError(f"{spec.where} {ref.description}: empty corpus (no documents)")
    fields = docs.missing_text_field()
    if fields is not None:
        raise DataError(
            f"{spec.where} {ref.description}: text field {ref.text_field!r} not found "
            f"({spec.key_prefix}text_field); columns are {fields}"
        )
    return Corpus(docs, None, ref.text_field, ref.fingerprint, ref.description)


def _load_hub(spec: SourceSpec, extra: dict) -> Corpus:
    name, _, config = spec.source[3:].partition(":")
    if not name:
        raise DataError(f"{spec.where}: {spec.source!r} names no dataset; use hf:NAME[:CONFIG]")
    import datasets

    try:
        ds = datasets.load_dataset(name, config or None, split=spec.split, streaming=spec.streaming)
    except Exception as e:
        raise DataError(f"{spec.where} {spec.source}: could not load from the Hub: {e}") from None
    fp = getattr(ds, "_fingerprint", None) or "streaming"
    fingerprint = hashlib.sha256(
        json.dumps([spec.source, spec.split, fp, extra]).encode()
    ).hexdigest()
    return _finish(ds, spec, spec.text_field, fingerprint, f"{spec.source} split {spec.split}")


def _finish(ds, spec: SourceSpec, text_field: str, fingerprint: str, desc: str) -> Corpus:
    columns = ds.column_names
    if columns is None:  # streaming without known features: look at the first example
        first = next(iter(ds), None)
        if first is None:
            raise DataError(f"{spec.where} {desc}: empty corpus (no documents)")
        columns = list(first)
    if text_field not in columns:
        raise DataError(
            f"{spec.where} {desc}: text field {text_field!r} not found "
            f"({spec.key_prefix}text_field); columns are {columns}"
        )
    import datasets

    if isinstance(ds, datasets.IterableDataset):
        stream = ds.take(spec.max_docs) if spec.max_docs is not None else ds
        return Corpus(None, stream, text_field, fingerprint, desc)
    if spec.max_docs is not None:
        ds = ds.select(range(min(spec.max_docs, len(ds))))
    if len(ds) == 0:
        raise DataError(f"{spec.where} {desc}: empty corpus (no documents)")
    return Corpus(ArrowDocuments(ds, text_field), None, text_field, fingerprint, desc)
