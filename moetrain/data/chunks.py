"""Tokenizing a source in chunks, spread over the ranks of a prepare and the workers of each.

The documents of a source are cut into chunks, contiguous document ranges sized by their text
(:func:`plan_chunks`): at most ``data.prepare_chunk_mb`` each, shrinking towards the end of the
source, so every worker stays busy and all finish together however unequal the documents are.
A streamed source is cut while it is read, at the first document that takes a chunk past
``data.prepare_chunk_mb``. The chunks of a planned source are dealt to the ranks largest first,
each to the rank with the fewest bytes so far (:func:`chunk_owners`); those of a stream go to
rank ``c % world`` as they are read. Inside a rank, ``data.num_proc`` processes (the rank's own
and forked workers) take its chunks largest first, each the next one when it is free. The result of the chunk of documents ``[lo, hi)``
is two files in ``<build>/parts-<tokenizer sha256>/``, each written atomically, the second last:

    <lo>-<hi>.tokens     the documents' token ids with EOS appended, in order, in the shard dtype
    <lo>-<hi>.docs.npy   int64 (documents, 2): each document's token count (0 for an empty one)
                         and 1 if it belongs to the validation split

A chunk whose files are both there is finished: a rerun skips it (the names say which documents
and which tokenizer, so files of another plan are never mistaken for this one's). The chunking
does not change the result: the packer reads the chunks in document order and writes the shards
one process would.

Train/validation split: document ``i`` (in source order) goes to validation when
``blake2b(i) / 2**64 < data.val_fraction``; document 0 always does when ``val_fraction > 0``,
so small corpora still get a validation split. Independent of the run seed and of the ranks.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import multiprocessing
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moetrain.data.errors import DataError
from moetrain.data.sources import Corpus, Documents
from moetrain.data.tokenizer import Tokenizer, load_tokenizer
from moetrain.fileio import atomic_file

SPLIT_RULE = "val iff blake2b(str(doc_index), digest 8, key 'moetrain-split') / 2**64 < val_fraction, or doc_index == 0"
SMALLEST_CHUNK = 32  # the smallest chunk of a plan: 1/32 of a worker's share of the source
_BATCH = 128  # documents per tokenizer call


def is_val_doc(index: int, val_fraction: float) -> bool:
    """The deterministic document split (see module docstring)."""
    if val_fraction <= 0:
        return False
    if index == 0:
        return True
    h = hashlib.blake2b(str(index).encode(), digest_size=8, key=b"moetrain-split").digest()
    return int.from_bytes(h, "little") / 2.0**64 < val_fraction


# ----------------------------------------------------------------------------- the plan


def chunk_targets(total_bytes: int, max_bytes: int, workers: int) -> list[int]:
    """Sizes, in document order, of the chunks of a source of ``total_bytes`` shared by
    ``workers`` tokenizing processes (over all ranks). Each chunk takes 1/(2 x ``workers``) of
    what is left, at most ``max_bytes`` and at least 1/:data:`SMALLEST_CHUNK` of a worker's
    share (factoring, as in loop scheduling): few chunks, and small ones last, where they set
    how long the last worker runs after the others have finished."""
    max_bytes = max(1, max_bytes)
    smallest = max(1, total_bytes // (SMALLEST_CHUNK * workers))
    sizes, left = [], total_bytes
    while left > 0:
        size = min(left, max_bytes, max(smallest, left // (2 * workers)))
        sizes.append(size)
        left -= size
    return sizes


def plan_chunks(sizes: np.ndarray, max_bytes: int, workers: int) -> list[tuple[int, int]]:
    """Contiguous document ranges ``[lo, hi)`` covering every document, cut where the bytes so
    far reach the :func:`chunk_targets` sizes (a document counts one byte more than its text;
    a range ends with the document that reaches its target)."""
    n = len(sizes)
    if n == 0:
        return []
    ends = np.cumsum(np.asarray(sizes, dtype=np.int64) + 1)
    targets = np.cumsum(chunk_targets(int(ends[-1]), max_bytes, workers))[:-1]
    cuts = np.searchsorted(ends, targets, side="left") + 1
    bounds = np.unique(np.concatenate([[0], np.clip(cuts, 1, n - 1), [n]]))
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def chunk_bytes(sizes: np.ndarray, chunks: list[tuple[int, int]]) -> list[int]:
    """Bytes of each chunk, counting a document one byte more than its text (as the plan does)."""
    ends = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64) + 1)])
    return [int(ends[hi] - ends[lo]) for lo, hi in chunks]


def chunk_owners(costs: Sequence[int], world: int) -> list[int]:
    """The rank of each chunk: largest first, each to the rank with the fewest bytes so far
    (ties: the lower rank). The ranks' shares differ by at most one chunk."""
    owners = [0] * len(costs)
    load = [(0, r) for r in range(world)]
    for c in largest_first(range(len(costs)), costs):
        total, r = heapq.heappop(load)
        owners[c] = r
        heapq.heappush(load, (total + costs[c], r))
    return owners


def largest_first(indices: Iterable[int], costs: Sequence[int]) -> list[int]:
    """``indices`` by decreasing cost (ties: in order)."""
    return sorted(indices, key=lambda c: (-costs[c], c))


# ----------------------------------------------------------------------------- chunk files


def parts_dir(build: Path, tokenizer_sha256: str) -> Path:
    """Where the chunks of a build directory tokenized with this tokenizer go."""
    return Path(build) / f"parts-{tokenizer_sha256[:16]}"


def _paths(parts: Path, lo: int, hi: int) -> tuple[Path, Path]:
    return parts / f"{lo:012d}-{hi:012d}.tokens", parts / f"{lo:012d}-{hi:012d}.docs.npy"


def read_chunk(
    parts: Path, lo: int, hi: int, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, lengths, is_val) of the finished chunk ``[lo, hi)``; errors name the file."""
    tokens_path, docs_path = _paths(parts, lo, hi)
    try:
        docs = np.load(docs_path)
        tokens = np.fromfile(tokens_path, dtype=dtype)
    except (OSError, ValueError) as e:
        raise DataError(f"{docs_path}: unreadable chunk: {e}") from None
    if docs.shape != (hi - lo, 2) or int(docs[:, 0].sum()) != len(tokens):
        raise DataError(
            f"{tokens_path}: {len(tokens)} tokens, but {docs_path} lists "
            f"{int(docs[:, 0].sum()) if docs.ndim == 2 else '?'}; remove both to redo the chunk"
        )
    return tokens, docs[:, 0], docs[:, 1].astype(bool)


def chunk_done(parts: Path, lo: int, hi: int, dtype: np.dtype) -> bool:
    """Whether the chunk ``[lo, hi)`` is finished (both files there and consistent)."""
    tokens_path, docs_path = _paths(parts, lo, hi)
    if not docs_path.is_file():
        return False
    try:
        docs = np.load(docs_path, mmap_mode="r")
        size = tokens_path.stat().st_size
    except (OSError, ValueError):
        return False
    return docs.shape == (hi - lo, 2) and size == int(docs[:, 0].sum()) * dtype.itemsize


# ----------------------------------------------------------------------------- workers


@dataclass
class _Worker:
    """What a worker needs; set once per process (inherited through fork, or pickled)."""

    parts: Path
    tokenizer_path: str
    dtype: np.dtype
    val_fraction: float
    docs: Documents | None = None  # a non-streaming source's documents
    _tok: Tokenizer | None = None

    def tokenizer(self) -> Tokenizer:
        if self._tok is None:
            self._tok = load_tokenizer(self.tokenizer_path)
        return self._tok


_WORKER: _Worker | None = None


def _init(worker: _Worker) -> None:
    global _WORKER
    _WORKER = worker


def _encode_chunk(lo: int, hi: int, batches: Iterable[list]) -> None:
    w = _WORKER
    assert w is not None
    tok = w.tokenizer()
    eos = tok.eos_id
    docs: list[tuple[int, int]] = []
    tokens_path, docs_path = _paths(w.parts, lo, hi)
    with atomic_file(tokens_path, "wb") as f:
        index = lo
        for batch in batches:
            texts = [t if isinstance(t, str) else "" for t in batch]
            flat: list[int] = []
            for ids, text in zip(tok.encode_batch(texts), texts, strict=True):
                n = len(ids) + 1 if text else 0
                if n:
                    flat += ids
                    flat.append(eos)
                docs.append((n, is_val_doc(index, w.val_fraction)))
                index += 1
            f.write(np.array(flat, dtype=w.dtype).tobytes())
    if index != hi:
        raise DataError(f"chunk [{lo}, {hi}) read {index - lo} documents")
    with atomic_file(docs_path, "wb") as f:
        np.save(f, np.array(docs, dtype=np.int64).reshape(-1, 2))


def _range_task(task: tuple[int, int]) -> None:
    lo, hi = task
    assert _WORKER is not None and _WORKER.docs is not None
    _encode_chunk(lo, hi, _WORKER.docs.texts(lo, hi, _BATCH))


def _texts_task(task: tuple[int, list]) -> None:
    lo, texts = task
    batches = (texts[b : b + _BATCH] for b in range(0, len(texts), _BATCH))
    _encode_chunk(lo, lo + len(texts), batches)


def _run(fn: Callable, tasks: Iterable, num_proc: int, worker: _Worker, done: Callable) -> None:
    """``fn(task)`` for every task, here and in ``num_proc - 1`` forked workers. Each takes
    the next task when it is free (so a long chunk never leaves another idle), and only then:
    streamed texts are never all in memory. ``done()`` follows every finished task."""
    _init(worker)  # this process works too: one process less to start, and none sits idle
    queue_, forked = _TaskQueue(iter(tasks)), num_proc - 1
    # fork, as datasets.map does on Linux: spawn would re-run an unguarded __main__ script
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    pool = multiprocessing.get_context(method).Pool(forked, _init, (worker,)) if forked else None
    with pool or contextlib.nullcontext():

        def feed(finished: bool) -> None:  # here at first, then in the pool's result thread
            try:
                if finished:
                    done()
                task = queue_.take()
            except BaseException as e:  # noqa: BLE001 (e.g. a failing stream: raised below)
                queue_.stop(e)
                return
            if task is _END:
                queue_.ended.put(None)
            else:
                assert pool is not None
                pool.apply_async(
                    fn, (task,), callback=lambda _: feed(True), error_callback=queue_.stop
                )

        for _ in range(forked):
            feed(False)
        while (task := queue_.take()) is not _END:
            fn(task)
            done()
        for _ in range(forked):
            error = queue_.ended.get()
            if error is not None:
                raise error


_END = object()


class _TaskQueue:
    """Hands the next task to whichever thread asks, under a lock, until the tasks run out or
    a worker stops with an error; ``ended`` gets one entry per forked worker (None, or the
    error)."""

    def __init__(self, tasks: Iterator) -> None:
        self._tasks = tasks
        self._lock = threading.Lock()
        self._failed = False
        self.ended: queue.SimpleQueue = queue.SimpleQueue()

    def take(self) -> object:
        with self._lock:
            return _END if self._failed else next(self._tasks, _END)

    def stop(self, error: BaseException) -> None:
        self._failed = True
        self.ended.put(error)


def stream_chunks(corpus: Corpus, chunk_bytes: int) -> Iterator[tuple[int, list]]:
    """``(first document index, texts)`` of consecutive chunks of a streamed source."""
    first = size = 0
    texts: list = []
    assert corpus.stream is not None
    for batch in corpus.stream.iter(batch_size=_BATCH):
        for text in batch[corpus.text_field]:
            texts.append(text)
            size += len(text.encode("utf-8", "replace")) + 1 if isinstance(text, str) else 1
            if size >= chunk_bytes:
                yield first, texts
                first, size, texts = first + len(texts), 0, []
    if texts:
        yield first, texts


def tokenize_chunks(
    corpus: Corpus,
    chunks: list[tuple[int, int]] | None,
    parts: Path,
    *,
    costs: list[int] | None,
    tokenizer_path: Path,
    dtype: np.dtype,
    val_fraction: float,
    rank: int,
    world: int,
    num_proc: int,
    chunk_bytes: int,
    done: Callable[[], None] = lambda: None,
) -> list[tuple[int, int]]:
    """Tokenize this rank's unfinished chunks into ``parts``; ``chunks`` and their ``costs``
    (bytes) are the plan of a non-streaming source (None: cut the stream; every rank reads all
    of it). Returns every chunk of the source (this rank's or not), in order."""
    parts.mkdir(parents=True, exist_ok=True)
    worker = _Worker(parts, str(tokenizer_path), dtype, val_fraction)
    if chunks is not None:
        worker.docs = corpus.docs
        assert costs is not None and len(costs) == len(chunks)
        owners = chunk_owners(costs, world)
        mine = [
            chunks[c]
            for c in largest_first(range(len(chunks)), costs)
            if owners[c] == rank and not chunk_done(parts, *chunks[c], dtype)
        ]
        _run(_range_task, mine, num_proc, worker, done)
        return list(chunks)
    seen: list[tuple[int, int]] = []

    def my_stream() -> Iterator[tuple[int, list]]:
        for first, texts in stream_chunks(corpus, chunk_bytes):
            lo, hi = first, first + len(texts)
            seen.append((lo, hi))
            if (len(seen) - 1) % world == rank and not chunk_done(parts, lo, hi, dtype):
                yield lo, texts

    _run(_texts_task, my_stream(), num_proc, worker, done)
    return seen
