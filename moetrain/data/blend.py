"""A deterministic blend of the sources of a mixture (``data.sources``) into one sample stream.

The global sample stream is the one :class:`~moetrain.data.loader.PackedLoader` numbers: each
global batch takes the next ``dp_world * micro_batch_size`` positions and rank ``r`` the
``r``-th micro-batch of them. Position ``p`` is given to a source by Tijdeman's rule for the
chairman assignment problem (:class:`~moetrain.data.apportion.Apportionment`, a block of
positions at a time): with weights ``w`` (normalised), after
``n`` positions source ``i`` holds ``c_i(n)`` of them with ``|c_i(n) - w_i * n| < 1`` for every
prefix ``n`` and every source, the property of Megatron's blended dataset (whose simpler
"largest error first" rule can miss it by up to half a sample more). Exact rational arithmetic
on the weights, so every rank on every machine computes the same assignment.

Source ``i``'s ``j``-th position is sample ``j`` of its own stream: epoch ``j // n_i`` (``n_i``
its samples), in a permutation keyed by the seed, the epoch, the split and the source's name,
so a source smaller than its share is repeated in fresh epochs, each in an order of its own,
and never mixes with another source inside a sample.

State: the positions consumed and every source's count (``state_dict()``, the same on every
rank). It does not depend on the data-parallel layout, so resuming with another ``dp_world`` or
``micro_batch_size`` continues every source exactly where it was: nothing skipped or repeated
within a source. Resuming with other weights starts a new segment of the blend at the resumed
position (the property then holds from there on, for the new weights).
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch

from moetrain.config import DataConfig
from moetrain.data.apportion import Apportionment
from moetrain.data.errors import DataError
from moetrain.data.loader import (
    PLAN_POSITIONS,
    STATE_VERSION,
    PackedLoader,
    check_tokenizer,
    rows_batch,
)
from moetrain.data.source_sets import (
    MIXTURE_FILE,
    match_sources,
    open_source_set,
    read_mixture_index,
)
from moetrain.data.sources import source_specs


def stream_key(name: str) -> int:
    """A source's permutation key, from its name (stable across runs and machines)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little")


class BlendedLoader:
    """Infinite iterator of micro-batches blending several sources (see module docstring)."""

    def __init__(
        self,
        loaders: dict[str, PackedLoader | None],
        weights: dict[str, float],
        micro_batch_size: int,
        dp_rank: int,
        dp_world: int,
    ) -> None:
        self.names = list(loaders)
        self.loaders = loaders  # None: a source without samples in this split (validation)
        self.weights = weights
        present = [ld for ld in loaders.values() if ld is not None]
        if not present:
            raise DataError(f"no source of the mixture has a sample in {sorted(loaders)}")
        first = present[0]
        self.split, self.seed, self.seq_len = first.split, first.seed, first.seq_len
        self.eos_id, self.document_mask = first.eos_id, first.document_mask
        self.tokenizer_sha256 = first.tokenizer_sha256
        self.micro_batch_size, self.dp_rank, self.dp_world = micro_batch_size, dp_rank, dp_world
        self.consumed_samples = 0
        self.counts = [0] * len(self.names)
        self._segment = (0, [0] * len(self.names))  # where the current weights took over
        self._apportion = Apportionment([weights[n] for n in self.names])
        # batches assigned ahead: (this rank's (source, sample) rows, consumed, counts after)
        self._ahead: deque[tuple[list[tuple[int, int]], int, list[int]]] = deque()
        self._planned = (0, list(self.counts))  # where assigning ahead continues
        self._plan_batches = 1  # doubles up to PLAN_POSITIONS / global batch

    @property
    def global_batch_size(self) -> int:
        return self.dp_world * self.micro_batch_size

    def _plan(self) -> None:
        """Assign the next global batches (1, 2, 4, ... up to about :data:`PLAN_POSITIONS`
        positions) to sources, and this rank's rows of them to samples, in one vectorised pass
        per source."""
        pos, counts = self._planned
        start, base = self._segment
        g, mb = self.global_batch_size, self.micro_batch_size
        batches = self._plan_batches
        self._plan_batches = min(2 * batches, max(1, PLAN_POSITIONS // g))
        m = batches * g
        seg = [c - b for c, b in zip(counts, base, strict=True)]
        picks = self._apportion.sequence(pos - start + 1, seg, m)
        running = np.cumsum(picks[None, :] == np.arange(len(self.names))[:, None], axis=1)
        at = np.asarray(counts, dtype=np.int64)[picks] + running[picks, np.arange(m)] - 1
        mine = (np.arange(m) % g) // mb == self.dp_rank
        samples = np.zeros(m, dtype=np.int64)
        for i, name in enumerate(self.names):
            sel = mine & (picks == i)
            if sel.any():
                loader = self.loaders[name]
                if loader is None:
                    raise DataError(f"source {name} has no sample in the {self.split} split")
                samples[sel] = loader.sample_ids(at[sel])
        rows = self.dp_rank * mb + np.arange(batches)[:, None] * g + np.arange(mb)  # (batches, mb)
        after = (np.asarray(counts, dtype=np.int64) + running[:, g - 1 :: g].T).tolist()
        sources, ids = picks[rows].tolist(), samples[rows].tolist()
        for b, (src, smp) in enumerate(zip(sources, ids, strict=True)):
            self._ahead.append((list(zip(src, smp, strict=True)), pos + (b + 1) * g, after[b]))
        self._planned = (pos + m, after[-1])

    def __iter__(self) -> BlendedLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if not self._ahead:
            self._plan()
        pairs, self.consumed_samples, self.counts = self._ahead.popleft()
        read = [ld.sample_tokens if ld is not None else None for ld in self.loaders.values()]
        rows = [read[i](s) for i, s in pairs]  # type: ignore[misc]
        return rows_batch(np.stack(rows), self.eos_id, self.document_mask)

    # ------------------------------------------------------------------ run loop
    def source_progress(self) -> dict[str, dict[str, float]]:
        """Per source: samples consumed by every rank together, and epochs of that source."""
        out = {}
        for name, count in zip(self.names, self.counts, strict=True):
            loader = self.loaders[name]
            epochs = count / loader.num_samples if loader is not None else 0.0
            out[name] = {"samples": count, "epochs": epochs}
        return out

    def evaluate(
        self, num_batches: int, evaluate: Callable[[Iterable[dict]], float]
    ) -> tuple[float, dict[str, float | None]]:
        """``evaluate`` on ``num_batches`` of every source's validation split; -> the weighted
        mean over the sources that have one, and each source's loss (None: no sample)."""
        losses: dict[str, float | None] = {}
        for name in self.names:
            loader = self.loaders[name]
            losses[name] = None if loader is None else evaluate(loader.iter_eval(num_batches))
        have = {n: v for n, v in losses.items() if v is not None}
        total = sum(self.weights[n] for n in have)
        return sum(self.weights[n] * v for n, v in have.items()) / total, losses

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Small JSON-serialisable position; identical on every rank."""
        start, base = self._segment
        return {
            "version": STATE_VERSION,
            "split": self.split,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "tokenizer_sha256": self.tokenizer_sha256,
            "consumed_samples": self.consumed_samples,
            "dp_world": self.dp_world,
            "micro_batch_size": self.micro_batch_size,
            "sources": {
                name: {
                    "weight": self.weights[name],
                    "num_samples": ld.num_samples if ld is not None else 0,
                    "consumed": count,
                }
                for name, ld, count in zip(
                    self.names, self.loaders.values(), self.counts, strict=True
                )
            },
            "segment": {"start": start, "counts": dict(zip(self.names, base, strict=True))},
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (saved with any dp_world / micro_batch_size); see the module
        docstring for changed weights."""
        if "sources" not in state:
            raise DataError(
                "the data loader state was saved by a run reading one source (data.source); "
                f"this run blends data.sources {self.names}"
            )
        if state.get("version") != STATE_VERSION:
            raise DataError(
                f"data loader state version {state.get('version')!r} is not {STATE_VERSION}"
            )
        for key in ("split", "seed", "seq_len", "tokenizer_sha256"):
            if state.get(key) != getattr(self, key):
                raise DataError(
                    f"data loader state was saved with {key}={state.get(key)!r} but this loader "
                    f"has {key}={getattr(self, key)!r}; the data stream cannot be continued exactly"
                )
        saved = state["sources"]
        if sorted(saved) != sorted(self.names):
            raise DataError(
                f"data loader state was saved blending {sorted(saved)}, this run blends "
                f"{sorted(self.names)}; the data stream cannot be continued exactly"
            )
        for name in self.names:
            ld = self.loaders[name]
            if ld is not None and saved[name]["num_samples"] != ld.num_samples:
                raise DataError(
                    f"data loader state: source {name!r} had {saved[name]['num_samples']} "
                    f"samples, now {ld.num_samples} (its shards changed); cannot continue exactly"
                )
        counts = [int(saved[n]["consumed"]) for n in self.names]
        consumed = state["consumed_samples"]
        if not isinstance(consumed, int) or consumed != sum(counts) or min(counts) < 0:
            raise DataError(f"data loader state: bad consumed_samples {consumed!r} for {counts}")
        self.consumed_samples, self.counts = consumed, counts
        self._ahead.clear()
        self._planned, self._plan_batches = (consumed, list(counts)), 1
        seg = state["segment"]
        self._segment = (int(seg["start"]), [int(seg["counts"][n]) for n in self.names])
        if any(saved[n]["weight"] != self.weights[n] for n in self.names):
            self._segment = (consumed, list(counts))  # new weights from here on


def build_blended_loader(
    data_cfg: DataConfig,
    split: str,
    open_split: Callable[..., PackedLoader],
    *,
    vocab_size: int | None = None,
) -> BlendedLoader:
    """The blend of every ``data.sources`` entry's shards of ``split``, prepared in
    ``data.output_dir``; ``open_split(directory, index, stream_key)`` opens one source's
    (:func:`moetrain.data.splits.build_loader`). A source's validation split without a sample is
    left out of evaluation (its loader is None), a training split without one is an error."""
    out = Path(data_cfg.output_dir)
    index = read_mixture_index(out)
    files = check_tokenizer(data_cfg, out / MIXTURE_FILE, index["tokenizer"], vocab_size)
    specs = source_specs(data_cfg)
    loaders: dict[str, PackedLoader | None] = {}
    for spec, entry in zip(specs, match_sources(index, specs, out), strict=True):
        directory, sub = open_source_set(out, entry, index["tokenizer"]["sha256"], spec.where)
        try:
            loaders[spec.name] = open_split(directory, sub, (stream_key(spec.name),))
        except DataError as e:
            if split == "train" or "fewer than one sequence" not in str(e):
                raise DataError(f"{spec.where}: {e}") from None
            loaders[spec.name] = None
    first = next((ld for ld in loaders.values() if ld is not None), None)
    if first is None:
        raise DataError(f"{out}: no source of the mixture has a sample in its {split} split")
    weights = {s.name: s.weight for s in specs}
    blended = BlendedLoader(loaders, weights, first.micro_batch_size, first.dp_rank, first.dp_world)
    blended.tokenizer_files = files
    return blended
