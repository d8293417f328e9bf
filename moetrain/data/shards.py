"""Token shards on disk: the writer, the JSON index, and its validation.

A prepared ``output_dir`` holds::

    tokenizer.model            SentencePiece model (its sha256 is the tokenizer's identity)
    tokenizer.json             tokenizer metadata: sha256, vocab size, special ids, trainer settings
    tokenizer/                 instead of both: a Hugging Face tokenizer's files (tokenizer.json, ...)
    index.json                 the shard set (written last; see below)
    train-00000.bin ...        raw little-endian uint16 (vocab <= 65536) or uint32 token ids
    train-00000.offsets.npy    int64 document start offsets in that shard, plus the end (len docs+1)
    val-00000.bin ...          the same for the validation split

Every document ends with the EOS id. ``index.json``::

    {"format": "moetrain-shards", "version": 1, "dtype": "uint16",
     "tokenizer": {"file", "kind", "sha256", "vocab_size", "special_ids": {"pad", "unk", "bos", "eos"}},
     "source": {"spec", "description", "fingerprint"[, "name" (a mixture's source)]},
     "prepare_key": "...",
     "split_rule": "...", "val_fraction": 0.01,
     "splits": {"train": {"num_tokens", "num_docs", "shards": [{"file", "offsets",
                "num_tokens", "num_docs"}]}, "val": {...}}}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moetrain.data.errors import DataError
from moetrain.fileio import write_json_atomic

INDEX_FILE = "index.json"
FORMAT = "moetrain-shards"
VERSION = 1
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class ShardWriter:
    """Appends documents of one split to shard files of about ``shard_tokens`` tokens each.

    Documents never straddle two shards; a shard is closed once it reaches ``shard_tokens``.
    The files are written into a directory that is fsynced as a whole when it is installed
    (:func:`moetrain.fileio.install_dir`).
    """

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.out_dir, self.split, self.dtype, self.shard_tokens = (
            out_dir,
            split,
            dtype,
            shard_tokens,
        )
        self.shards: list[dict] = []
        self._f = None
        self._offsets: list[np.ndarray] = []
        self._tokens = 0

    def _open(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}"
        self._name = name
        self._f = open(self.out_dir / f"{name}.bin", "wb")  # noqa: SIM115 (closed in _close)
        self._offsets, self._tokens = [], 0

    def _close(self) -> None:
        if self._f is None:
            return
        self._f.close()
        self._f = None
        starts = np.concatenate(self._offsets + [np.array([self._tokens], dtype=np.int64)])
        offsets_file = f"{self._name}.offsets.npy"
        with open(self.out_dir / offsets_file, "wb") as f:
            np.save(f, starts)
        self.shards.append(
            {
                "file": f"{self._name}.bin",
                "offsets": offsets_file,
                "num_tokens": int(self._tokens),
                "num_docs": int(len(starts) - 1),
            }
        )

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as one flat token array and their lengths (EOS included)."""
        lengths = lengths[lengths > 0]
        pos = 0
        while len(lengths):
            if self._f is None:
                self._open()
            # how many whole documents fit before this shard reaches shard_tokens
            room = self.shard_tokens - self._tokens
            ends = np.cumsum(lengths)
            n = int(np.searchsorted(ends, room, side="left")) + 1
            n = min(n, len(lengths))
            take = int(ends[n - 1])
            starts = self._tokens + np.concatenate([[0], ends[: n - 1]]).astype(np.int64)
            self._offsets.append(starts)
            self._f.write(np.ascontiguousarray(tokens[pos : pos + take], dtype=self.dtype).data)
            self._tokens += take
            pos += take
            lengths = lengths[n:]
            if self._tokens >= self.shard_tokens:
                self._close()

    def finish(self) -> dict:
        self._close()
        return {
            "num_tokens": sum(s["num_tokens"] for s in self.shards),
            "num_docs": sum(s["num_docs"] for s in self.shards),
            "shards": self.shards,
        }


def write_index(out_dir: Path, index: dict) -> None:
    write_json_atomic(out_dir / INDEX_FILE, index, sort_keys=False)


def read_index(out_dir: str | Path) -> dict:
    """Read and sanity-check ``index.json``; errors name the file."""
    path = Path(out_dir) / INDEX_FILE
    if not path.is_file():
        raise DataError(
            f"{path}: no shard index; run `moetrain prepare CONFIG` to build {Path(out_dir)}"
        )
    try:
        index = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: unreadable shard index: {e}") from None
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise DataError(
            f"{path}: not a {FORMAT} v{VERSION} index (format={index.get('format')!r}, "
            f"version={index.get('version')!r}); rerun `moetrain prepare`"
        )
    return index


@dataclass
class ShardView:
    """One memory-mapped shard of a split."""

    path: Path
    tokens: np.memmap
    doc_starts: np.ndarray


def verify_split(out_dir: Path, index: dict, split: str, *, load_offsets: bool = True) -> list:
    """Check every shard file of ``split`` against the index; return memmapped views."""
    out_dir = Path(out_dir)
    if split not in index["splits"]:
        raise DataError(f"{out_dir / INDEX_FILE}: no split {split!r}; have {list(index['splits'])}")
    dtype = np.dtype(index["dtype"])
    views = []
    for shard in index["splits"][split]["shards"]:
        path = out_dir / shard["file"]
        if not path.is_file():
            raise DataError(f"{path}: shard file listed in {INDEX_FILE} is missing")
        expected = shard["num_tokens"] * dtype.itemsize
        size = path.stat().st_size
        if size != expected:
            raise DataError(
                f"{path}: size {size} bytes does not match its index ({shard['num_tokens']} "
                f"{dtype.name} tokens = {expected} bytes); the shard set is corrupt, rerun "
                "`moetrain prepare`"
            )
        starts = None
        if load_offsets:
            opath = out_dir / shard["offsets"]
            try:
                starts = np.load(opath, mmap_mode="r")
            except (OSError, ValueError) as e:
                raise DataError(f"{opath}: unreadable document offsets: {e}") from None
            if len(starts) != shard["num_docs"] + 1 or int(starts[-1]) != shard["num_tokens"]:
                raise DataError(
                    f"{opath}: document offsets do not match {INDEX_FILE} "
                    f"({len(starts) - 1} docs ending at {int(starts[-1])}, index says "
                    f"{shard['num_docs']} docs, {shard['num_tokens']} tokens)"
                )
        views.append(ShardView(path, np.memmap(path, dtype=dtype, mode="r"), starts))
    return views


def is_complete(out_dir: str | Path, prepare_key: str) -> bool:
    """Whether ``out_dir`` holds a complete shard set prepared with ``prepare_key``."""
    try:
        index = read_index(out_dir)
        if index.get("prepare_key") != prepare_key:
            return False
        for split in index["splits"]:
            verify_split(Path(out_dir), index, split)
    except (DataError, KeyError, TypeError):
        return False
    return True
