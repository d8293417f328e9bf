"""Packed, sharded, resumable training data from memory-mapped token shards.

The token shards of a split form one stream (documents end with EOS). Sample ``s`` is the
``seq_len + 1`` tokens starting at ``s * seq_len`` (consecutive samples share one token), so a
split of ``T`` tokens holds ``(T - 1) // seq_len`` samples; ``input_ids`` are its first
``seq_len`` tokens and ``labels`` the last ``seq_len``. With ``data.document_mask``,
``doc_ids`` numbers the documents inside each row (0, 1, ...; a document's EOS belongs to it).

Order: epoch ``e`` visits every sample once, in a keyed pseudo-random order from
``(seed, e, split)`` (``moetrain.data.permutation``, O(1) memory). Epochs are concatenated into
one infinite stream of positions ``0, 1, 2, ...``; each ``next()`` takes the next global batch of
``dp_world * micro_batch_size`` positions, and rank ``r`` gets the contiguous slice
``[r * micro_batch_size, (r + 1) * micro_batch_size)`` of it. ``dp_rank`` is the global rank
(every rank of every node is data-parallel; expert-parallel peers read different data).

State: ``state_dict()`` is the number of global samples consumed plus identity checks; it is
the same on every rank. Resuming with another ``dp_world`` or ``micro_batch_size`` continues the
stream at the consumed position: nothing is skipped or repeated (the new global batches simply
cover the following positions). A different seed, seq_len, split or shard set is an error.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from moetrain.config import DataConfig
from moetrain.data.errors import DataError
from moetrain.data.permutation import Permutation
from moetrain.data.shards import INDEX_FILE, verify_split
from moetrain.data.tokenizer import MODEL_FILE, tokenizer_file, tokenizer_files
from moetrain.fileio import file_sha256

_SPLIT_KEY = {"train": 0, "val": 1}
STATE_VERSION = 1
PLAN_POSITIONS = 4096  # global positions whose samples are computed at a time


class PackedLoader:
    """Infinite iterator of micro-batches for one data-parallel rank (see module docstring)."""

    def __init__(
        self,
        out_dir: Path,
        index: dict,
        split: str,
        seq_len: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_world: int,
        seed: int,
        document_mask: bool = False,
        stream_key: tuple[int, ...] = (),
    ):
        if dp_world < 1 or not 0 <= dp_rank < dp_world:
            raise DataError(f"dp_rank={dp_rank} must be in [0, dp_world={dp_world})")
        if micro_batch_size < 1:
            raise DataError(f"micro_batch_size={micro_batch_size} must be >= 1")
        self.out_dir, self.split, self.seq_len = Path(out_dir), split, seq_len
        self.micro_batch_size, self.dp_rank, self.dp_world = micro_batch_size, dp_rank, dp_world
        self.seed, self.document_mask = seed, document_mask
        self.stream_key = stream_key  # extends the permutation key (a source of a blend)
        self.eos_id = int(index["tokenizer"]["special_ids"]["eos"])
        self.tokenizer_sha256 = index["tokenizer"]["sha256"]
        self._shards = verify_split(self.out_dir, index, split, load_offsets=False)
        sizes = [len(v.tokens) for v in self._shards]
        self._shard_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.num_tokens = int(self._shard_starts[-1])
        self.num_samples = (self.num_tokens - 1) // seq_len if self.num_tokens else 0
        if self.num_samples < 1:
            raise DataError(
                f"{self.out_dir / INDEX_FILE}: split {split!r} has {self.num_tokens} tokens, "
                f"fewer than one sequence of data.seq_len+1={seq_len + 1}"
            )
        self._itemsize = np.dtype(index["dtype"]).itemsize
        self._dtype = np.dtype(index["dtype"]).newbyteorder("<")
        self._fds: dict[int, int] = {}
        self.consumed_samples = 0
        self._perm: tuple[int, Permutation] | None = None
        self._ahead: deque[np.ndarray] = deque()  # this rank's samples of the next batches
        self._plan_batches = 1  # doubles up to PLAN_POSITIONS / global batch

    # Shards are read with pread rather than through the memory map: the page cache keeps hot
    # data in memory, but it is not mapped into this process, so resident memory stays flat
    # however large the corpus and however long the run (a memmap's touched pages, widened by
    # readahead, would count as RSS and grow towards the corpus size).
    def _read(self, shard: int, lo: int, hi: int) -> np.ndarray:
        fd = self._fds.get(shard)
        if fd is None:
            fd = self._fds[shard] = os.open(self._shards[shard].path, os.O_RDONLY)
        nbytes = (hi - lo) * self._itemsize
        buf = os.pread(fd, nbytes, lo * self._itemsize)
        if len(buf) != nbytes:
            raise DataError(f"{self._shards[shard].path}: short read (file changed on disk?)")
        return np.frombuffer(buf, dtype=self._dtype)

    def close(self) -> None:
        """Close the shard files (reopened on demand)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __getstate__(self) -> dict:
        return self.__dict__ | {"_fds": {}}

    # ------------------------------------------------------------------ samples
    @property
    def global_batch_size(self) -> int:
        return self.dp_world * self.micro_batch_size

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.num_samples

    def _permutation(self, epoch: int) -> Permutation:
        if self._perm is None or self._perm[0] != epoch:
            key = (self.seed, epoch, _SPLIT_KEY.get(self.split, 2), *self.stream_key)
            self._perm = (epoch, Permutation(self.num_samples, key))
        return self._perm[1]

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        """Sample indices at stream ``positions`` (epoch-major, permuted within each epoch)."""
        positions = np.asarray(positions, dtype=np.int64)
        epochs, within = np.divmod(positions, self.num_samples)
        out = np.empty_like(positions)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._permutation(int(e))(within[sel])
        return out

    def sample_tokens(self, sample: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of sample ``sample`` (natural order), as int64."""
        start = int(sample) * self.seq_len
        end = start + self.seq_len + 1
        first = int(np.searchsorted(self._shard_starts, start, side="right")) - 1
        pieces, pos, i = [], start, first
        while pos < end:
            lo = pos - int(self._shard_starts[i])
            hi = min(end, int(self._shard_starts[i + 1])) - int(self._shard_starts[i])
            pieces.append(self._read(i, lo, hi))
            pos += hi - lo
            i += 1
        return (
            np.concatenate(pieces).astype(np.int64)
            if len(pieces) > 1
            else pieces[0].astype(np.int64)
        )

    def _batch(self, samples: np.ndarray) -> dict[str, torch.Tensor]:
        rows = np.stack([self.sample_tokens(s) for s in samples])
        return rows_batch(rows, self.eos_id, self.document_mask)

    def _rank_positions(self, global_start: int) -> np.ndarray:
        lo = global_start + self.dp_rank * self.micro_batch_size
        return np.arange(lo, lo + self.micro_batch_size, dtype=np.int64)

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if not self._ahead:  # the samples of the next batches, in one permutation call
            g, n = self.global_batch_size, self._plan_batches
            self._plan_batches = min(2 * n, max(1, PLAN_POSITIONS // g))
            start = self.consumed_samples
            positions = np.concatenate([self._rank_positions(start + b * g) for b in range(n)])
            self._ahead.extend(np.split(self.sample_ids(positions), n))
        samples = self._ahead.popleft()
        self.consumed_samples += self.global_batch_size
        return self._batch(samples)

    def iter_eval(self, num_batches: int) -> Iterator[dict[str, torch.Tensor]]:
        """``num_batches`` deterministic micro-batches in natural sample order, from the start
        every call (wrapping around a small split); does not touch the training position."""
        for b in range(num_batches):
            positions = self._rank_positions(b * self.global_batch_size)
            yield self._batch(positions % self.num_samples)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Small JSON-serialisable position; identical on every rank."""
        return {
            "version": STATE_VERSION,
            "split": self.split,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "num_samples": self.num_samples,
            "tokenizer_sha256": self.tokenizer_sha256,
            "consumed_samples": self.consumed_samples,
            "epoch": self.epoch,
            "dp_world": self.dp_world,
            "micro_batch_size": self.micro_batch_size,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (possibly saved with another dp_world / micro_batch_size)."""
        if "sources" in state:
            raise DataError(
                f"the data loader state was saved by a run blending data.sources "
                f"{sorted(state['sources'])}; this run reads one source ({self.out_dir})"
            )
        if state.get("version") != STATE_VERSION:
            raise DataError(
                f"data loader state version {state.get('version')!r} is not {STATE_VERSION}"
            )
        for key in ("split", "seed", "seq_len", "num_samples", "tokenizer_sha256"):
            if state.get(key) != getattr(self, key):
                raise DataError(
                    f"data loader state was saved with {key}={state.get(key)!r} but this loader "
                    f"has {key}={getattr(self, key)!r} ({self.out_dir}); the data stream cannot "
                    "be continued exactly"
                )
        consumed = state["consumed_samples"]
        if not isinstance(consumed, int) or consumed < 0:
            raise DataError(f"data loader state: bad consumed_samples {consumed!r}")
        self.consumed_samples = consumed
        self._ahead.clear()
        self._plan_batches = 1

    # ------------------------------------------------------------------ what the run loop uses
    def source_progress(self) -> dict[str, dict[str, float]]:
        """Per-source progress of a blend; a one-source loader has none."""
        return {}

    def evaluate(
        self, num_batches: int, evaluate: Callable[[Iterable[dict]], float]
    ) -> tuple[float, dict[str, float | None]]:
        """``evaluate`` (mean loss over batches) on :meth:`iter_eval`; no per-source losses."""
        return evaluate(self.iter_eval(num_batches)), {}


def rows_batch(rows: np.ndarray, eos_id: int, document_mask: bool) -> dict[str, torch.Tensor]:
    """A micro-batch from ``(B, seq_len + 1)`` token rows: inputs, labels (shifted by one) and,
    with ``document_mask``, the document number of every position (a document's EOS is its)."""
    batch = {
        "input_ids": torch.from_numpy(np.ascontiguousarray(rows[:, :-1])),
        "labels": torch.from_numpy(np.ascontiguousarray(rows[:, 1:])),
    }
    if document_mask:
        ends = rows[:, :-2] == eos_id
        doc = np.zeros((len(rows), rows.shape[1] - 1), dtype=np.int64)
        np.cumsum(ends, axis=1, out=doc[:, 1:])
        batch["doc_ids"] = torch.from_numpy(doc)
    return batch


def check_tokenizer(
    data_cfg: DataConfig, index_path: Path, tok: dict, vocab_size: int | None
) -> list[Path]:
    """The prepared data (``tok``: its index's tokenizer) was built with the configured tokenizer
    (``data.tokenizer`` / ``data.tokenizer_model``, else the copy beside the index) whose vocab
    is not larger than ``vocab_size``. Returns the copy's files (checkpoints carry them)."""
    copy = index_path.parent / tok.get("file", MODEL_FILE)
    source = data_cfg.tokenizer_source
    configured = tokenizer_file(source[1]) if source else copy
    if not configured.is_file():
        raise DataError(f"{configured}: tokenizer model not found")
    sha = file_sha256(configured)
    if sha != tok["sha256"]:
        raise DataError(
            f"{index_path}: shards were built with tokenizer sha256 {tok['sha256'][:12]}, "
            f"but the configured tokenizer {configured} has sha256 {sha[:12]}; rerun "
            "`moetrain prepare` with this tokenizer"
        )
    if vocab_size is not None and tok["vocab_size"] > vocab_size:
        raise DataError(
            f"{index_path}: tokenizer vocab size {tok['vocab_size']} is larger than "
            f"model.vocab_size={vocab_size}"
        )
    return tokenizer_files(copy)
