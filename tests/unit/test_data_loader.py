"""PackedLoader: packing, global order, rank sharding, exact resume, DP-size changes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moetrain.data import DataError
from moetrain.data.loader import PackedLoader
from moetrain.data.permutation import Permutation
from moetrain.data.shards import FORMAT, VERSION, ShardWriter, write_index

EOS = 3
OFFSET = 10  # token value = OFFSET + position in the split's stream (no EOS in it)


def make_set(tmp: Path, split_tokens: dict[str, np.ndarray], shard_tokens: int, dtype="uint32"):
    """A shard set written with the real writer; documents of 1..20 tokens."""
    rng = np.random.default_rng(0)
    splits = {}
    for split, tokens in split_tokens.items():
        lengths = []
        while sum(lengths) < len(tokens):
            lengths.append(int(min(rng.integers(1, 20), len(tokens) - sum(lengths))))
        w = ShardWriter(tmp, split, np.dtype(dtype), shard_tokens)
        w.add(tokens, np.array(lengths))
        splits[split] = w.finish()
    index = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype,
        "tokenizer": {"sha256": "0" * 64, "vocab_size": 70000, "special_ids": {"eos": EOS}},
        "splits": splits,
    }
    write_index(tmp, index)
    return index


SEQ = 8


@pytest.fixture
def dataset(tmp_path):
    """train: 8*29+1 tokens = 29 samples of 9 tokens, spread over shards of 37 tokens."""
    n = SEQ * 29 + 1
    index = make_set(
        tmp_path,
        {"train": OFFSET + np.arange(n), "val": OFFSET + np.arange(SEQ * 5 + 3)},
        shard_tokens=37,
    )
    return tmp_path, index


def loader(dataset, mb=2, rank=0, world=1, seed=7, split="train", doc_mask=False):
    path, index = dataset
    return PackedLoader(path, index, split, SEQ, mb, rank, world, seed, doc_mask)


def samples_of(batch) -> list[int]:
    """Recover sample indices from token values (token = OFFSET + stream position)."""
    starts = batch["input_ids"][:, 0] - OFFSET
    assert torch.all(starts % SEQ == 0)
    return (starts // SEQ).tolist()


def test_samples_are_shifted_windows_across_shards(dataset):
    ld = loader(dataset)
    assert ld.num_samples == 29 and len(ld._shards) > 5
    for s in range(ld.num_samples):
        row = ld.sample_tokens(s)
        assert row.tolist() == list(range(OFFSET + s * SEQ, OFFSET + s * SEQ + SEQ + 1))
    batch = next(ld)
    assert batch["input_ids"].shape == batch["labels"].shape == (2, SEQ)
    assert batch["input_ids"].dtype == torch.long
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    assert torch.equal(batch["labels"][:, -1], batch["input_ids"][:, -1] + 1)


@pytest.mark.parametrize("world,mb", [(1, 1), (2, 3), (3, 2), (4, 5)])
def test_each_epoch_is_every_sample_once_and_ranks_disjoint(dataset, world, mb):
    loaders = [loader(dataset, mb=mb, rank=r, world=world) for r in range(world)]
    n = loaders[0].num_samples
    stream, per_rank = [], [[] for _ in range(world)]
    while len(stream) < 3 * n:
        for r, ld in enumerate(loaders):
            got = samples_of(next(ld))
            per_rank[r].append(got)
            stream += got
    epochs = [stream[e * n : (e + 1) * n] for e in range(3)]
    for ep in epochs:
        assert sorted(ep) == list(range(n))
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled every epoch
    assert epochs[0] != list(range(n))
    # ranks never share a sample inside an epoch: positions of rank r are its own
    g = world * mb
    for e in range(3):
        owner = {}
        for pos in range(e * n, (e + 1) * n):
            rank = (pos % g) // mb
            assert owner.setdefault(stream[pos], rank) == rank
    assert all(ld.state_dict() == loaders[0].state_dict() for ld in loaders)


def test_order_depends_on_seed_only(dataset):
    a = [samples_of(next(loader(dataset, seed=1))) for _ in range(1)]
    b = [samples_of(next(loader(dataset, seed=1))) for _ in range(1)]
    c = [samples_of(next(loader(dataset, seed=2, mb=29)))]
    assert a == b
    assert c[0] != samples_of(next(loader(dataset, seed=1, mb=29)))


def test_state_restore_across_epoch_boundary_is_exact(dataset):
    ref = loader(dataset, mb=3, rank=1, world=2, doc_mask=True)
    for _ in range(3):  # 18 of 29 samples consumed
        next(ref)
    state = json.loads(json.dumps(ref.state_dict()))
    assert state["consumed_samples"] == 18 and state["epoch"] == 0
    want = [next(ref) for _ in range(8)]  # crosses into epoch 1 and 2
    assert ref.epoch == 2
    resumed = loader(dataset, mb=3, rank=1, world=2, doc_mask=True)
    resumed.load_state_dict(state)
    for a, b in zip(want, (next(resumed) for _ in range(8)), strict=True):
        assert a.keys() == b.keys() == {"input_ids", "labels", "doc_ids"}
        for k in a:
            assert torch.equal(a[k], b[k])


@pytest.mark.parametrize("world,mb", [(4, 2), (3, 1), (1, 5)])
def test_changed_dp_size_continues_by_consumed_samples(dataset, world, mb):
    """Saved at dp_world=2, micro_batch=3; resumed with another layout: nothing skipped or
    repeated relative to the one stream of global positions."""
    reference = loader(dataset, mb=1)  # one rank, one sample per step = the stream itself
    stream = [samples_of(next(reference))[0] for _ in range(120)]
    old = [loader(dataset, mb=3, rank=r, world=2) for r in range(2)]
    seen = []
    for _ in range(5):
        for ld in old:
            seen += samples_of(next(ld))
    state = old[0].state_dict()
    assert state["consumed_samples"] == 30 and state["dp_world"] == 2
    new = [loader(dataset, mb=mb, rank=r, world=world) for r in range(world)]
    for ld in new:
        ld.load_state_dict(state)
    for _ in range(6):
        for ld in new:
            seen += samples_of(next(ld))
    assert seen == stream[: len(seen)]


def test_state_from_another_stream_is_refused(dataset, tmp_path):
    state = loader(dataset).state_dict()
    with pytest.raises(DataError, match="saved with seed=7 but this loader has seed=8"):
        loader(dataset, seed=8).load_state_dict(state)
    with pytest.raises(DataError, match="split='train' but this loader has split='val'"):
        loader(dataset, split="val").load_state_dict(state)
    path, index = dataset
    other = PackedLoader(path, index, "train", SEQ * 2, 2, 0, 1, 7)
    with pytest.raises(DataError, match="seq_len=8 but this loader has seq_len=16"):
        other.load_state_dict(state)
    with pytest.raises(DataError, match="bad consumed_samples"):
        loader(dataset).load_state_dict(state | {"consumed_samples": -1})


def test_doc_ids_follow_eos(tmp_path):
    docs = [[5, 6, EOS], [7, EOS], [8, 9, 10, 11, EOS], [12, EOS], [13, 14, EOS]]
    tokens = np.concatenate(docs)
    w = ShardWriter(tmp_path, "train", np.dtype("uint16"), 100)
    w.add(tokens, np.array([len(d) for d in docs]))
    index = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": "uint16",
        "tokenizer": {"sha256": "0", "vocab_size": 64, "special_ids": {"eos": EOS}},
        "splits": {"train": w.finish()},
    }
    ld = PackedLoader(tmp_path, index, "train", 6, 1, 0, 1, 0, document_mask=True)
    assert ld.num_samples == 2
    rows = {tuple(b["input_ids"][0].tolist()): b["doc_ids"][0].tolist() for b in ld.iter_eval(2)}
    assert rows[(5, 6, EOS, 7, EOS, 8)] == [0, 0, 0, 1, 1, 2]
    assert rows[(9, 10, 11, EOS, 12, EOS)] == [0, 0, 0, 0, 1, 1]


def test_iter_eval_is_deterministic_and_sharded(dataset):
    ranks = [loader(dataset, mb=2, rank=r, world=2, split="val") for r in range(2)]
    n = ranks[0].num_samples
    assert n == 5
    next(ranks[0])  # training position does not affect evaluation
    got = [[samples_of(b) for b in ld.iter_eval(2)] for ld in ranks]
    assert got == [[[0, 1], [4, 0]], [[2, 3], [1, 2]]]  # natural order, wraps around
    assert got[0] == [samples_of(b) for b in ranks[0].iter_eval(2)]


def test_bad_arguments(dataset, tmp_path):
    with pytest.raises(DataError, match=r"dp_rank=2 must be in \[0, dp_world=2\)"):
        loader(dataset, rank=2, world=2)
    path, index = dataset
    with pytest.raises(DataError, match="split 'train' has 233 tokens, fewer than one sequence"):
        PackedLoader(path, index, "train", 500, 1, 0, 1, 0)
    with pytest.raises(DataError, match="no split 'test'"):
        PackedLoader(path, index, "test", SEQ, 1, 0, 1, 0)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 65, 1000, 4097])
def test_permutation_is_a_bijection(n):
    p = Permutation(n, (1, 2, 3))
    out = p(np.arange(n))
    assert sorted(out.tolist()) == list(range(n))
    if n > 8:
        assert out.tolist() != list(range(n))
        assert out.tolist() != Permutation(n, (1, 2, 4))(np.arange(n)).tolist()
    with pytest.raises(IndexError):
        p(np.array([n]))
