"""The blend of data.sources: Tijdeman's apportionment, proportions at every prefix of the
stream, epochs per source, identical state on every rank, exact resume, another data-parallel
size on resume, changed weights, per-source evaluation."""

from __future__ import annotations

import json
import random
from collections import Counter
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from moetrain.data import DataError
from moetrain.data.blend import Apportionment, BlendedLoader, stream_key
from moetrain.data.loader import PackedLoader
from moetrain.data.shards import FORMAT, VERSION, ShardWriter, write_index

SEQ = 8
BASE = 100_000  # token value = (source + 1) * BASE + position in the source's stream
SIZES = {"web": 200, "code": 90, "math": 6}  # samples per source: math is repeated
WEIGHTS = {"web": 0.6, "code": 0.3, "math": 0.1}


def _source_set(path: Path, source: int, samples: int) -> dict:
    path.mkdir()
    rng = np.random.default_rng(source)
    splits = {}
    for split, n in (("train", samples), ("val", 3)):
        tokens = (source + 1) * BASE + np.arange(n * SEQ + 1)
        lengths = []
        while sum(lengths) < len(tokens):
            lengths.append(int(min(rng.integers(1, 30), len(tokens) - sum(lengths))))
        w = ShardWriter(path, split, np.dtype("uint32"), 50)
        w.add(tokens, np.array(lengths))
        splits[split] = w.finish()
    index = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": "uint32",
        "tokenizer": {"sha256": "0" * 64, "vocab_size": 1 << 20, "special_ids": {"eos": 3}},
        "splits": splits,
    }
    write_index(path, index)
    return index


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    tmp = tmp_path_factory.mktemp("blend")
    return {
        name: (tmp / name, _source_set(tmp / name, i, n))
        for i, (name, n) in enumerate(SIZES.items())
    }


def blend(sets, mb=2, rank=0, world=1, seed=3, weights=WEIGHTS, split="train") -> BlendedLoader:
    loaders = {
        name: PackedLoader(path, index, split, SEQ, mb, rank, world, seed, stream_key=(stream_key(name),))
        for name, (path, index) in sets.items()
    }  # fmt: skip
    return BlendedLoader(loaders, weights, mb, rank, world)


NAMES = list(SIZES)


def rows_of(batch) -> list[tuple[str, int]]:
    """(source, sample) of every row, from its first token."""
    first = batch["input_ids"][:, 0].numpy()
    return [(NAMES[t // BASE - 1], (t % BASE) // SEQ) for t in first.tolist()]


def global_stream(loaders: list[BlendedLoader], steps: int) -> list[tuple[str, int]]:
    out = []
    for _ in range(steps):
        for ld in loaders:  # rank order: the global batch's positions in order
            out += rows_of(next(ld))
    return out


def check_proportions(stream: list[tuple[str, int]], weights: dict[str, float]) -> None:
    total = sum(weights.values())
    counts = Counter()
    for n, (name, _) in enumerate(stream, start=1):
        counts[name] += 1
        for s, w in weights.items():
            assert abs(counts[s] - w / total * n) < 1, (n, s, counts[s], w / total * n)


def test_apportionment_is_within_one_sample_at_every_prefix():
    rng = random.Random(0)
    for trial in range(200):
        k = rng.randint(1, 7)
        weights = [rng.choice([rng.random(), 1e-3, 1.0, 0.1 * rng.randint(1, 9)]) for _ in range(k)]
        ap = Apportionment(weights)
        exact = [Fraction(w) / sum(map(Fraction, weights)) for w in weights]
        assert [Fraction(a, ap.total) for a in ap.parts] == exact  # the weights, exactly
        block = ap.picks(1, [0] * k, 400)  # one pass, running integers
        counts = [0] * k
        for n in range(1, 401):
            assert ap.pick(n, counts) == block[n - 1]  # the same as deciding position by position
            counts[block[n - 1]] += 1
            # |c_i - w_i n| < 1  <=>  |c_i total - a_i n| < total, in exact integers
            assert all(
                abs(c * ap.total - a * n) < ap.total for c, a in zip(counts, ap.parts, strict=True)
            ), (trial, weights, n, counts)
            if n == 150:  # a block started part-way continues the same sequence
                assert ap.picks(151, counts, 250) == block[150:]
    ap = Apportionment([0.6, 0.3, 0.1])
    counts = [0, 0, 0]
    for n in range(1, 11):
        counts[ap.pick(n, counts)] += 1
    assert counts == [6, 3, 1]


def test_block_sequence_is_the_sequential_rule():
    """The block computation (sorted deadlines, a queue where releases bind, exact integers
    for near ties) gives the position-by-position rule's sources: weights where the sorted
    order holds, where it parts often, equal and small-ratio weights, past a block's end, from
    part-way states, and at positions where floats lose precision."""
    rng = random.Random(1)
    cases = [[0.6, 0.3, 0.1], [0.5, 0.5], [1, 1, 1, 1], [0.25, 0.75], [0.7, 0.2, 0.05, 0.05],
             [0.7, 0.2, 0.1], [1e-9, 1, 1], [0.031, 0.462, 0.46, 0.047]]  # fmt: skip
    cases += [[rng.choice([rng.random(), 0.5, 0.1 * rng.randint(1, 9)]) for _ in range(rng.randint(2, 8))]
              for _ in range(40)]  # fmt: skip
    for weights in cases:
        ap = Apportionment(weights)
        k = len(weights)
        m = 5000 if len(weights) <= 4 else 1500  # past BLOCK (4096) for some
        ref = ap.picks_sequential(1, [0] * k, m)
        assert ap.sequence(1, [0] * k, m).tolist() == ref, weights
        start = rng.randint(2, m - 100)
        counts = Counter(ref[: start - 1])
        part = ap.sequence(start, [counts[i] for i in range(k)], 100).tolist()
        assert part == ref[start - 1 : start + 99], weights
        n = rng.choice([10**9, 10**12, 2**45 + 3])  # a state near the ideal, far into a run
        total = sum(map(Fraction, weights))
        far = [int(Fraction(w) / total * (n - 1)) for w in weights]
        far[0] += n - 1 - sum(far)
        try:
            want = ap.picks_sequential(n, far, 300)
        except RuntimeError:  # not a state the rule reaches: both refuse
            with pytest.raises(RuntimeError):
                ap.sequence(n, far, 300)
            continue
        assert ap.sequence(n, far, 300).tolist() == want, (weights, n)


@pytest.mark.parametrize("world,mb", [(1, 1), (2, 3), (3, 2)])
def test_blend_proportions_epochs_and_ranks(sets, world, mb):
    ranks = [blend(sets, mb=mb, rank=r, world=world) for r in range(world)]
    steps = -(-700 // (world * mb))
    stream = global_stream(ranks, steps)
    check_proportions(stream, WEIGHTS)
    states = [ld.state_dict() for ld in ranks]
    assert all(s == states[0] for s in states)  # the same on every rank
    for name, n in SIZES.items():
        seen = [sample for src, sample in stream if src == name]
        epochs = [seen[e * n : (e + 1) * n] for e in range(len(seen) // n)]
        assert epochs, name
        for epoch in epochs:  # every sample of the source once per epoch of that source
            assert sorted(epoch) == list(range(n)), name
        if len(epochs) > 2:  # each epoch in an order of its own
            assert len({tuple(e) for e in epochs}) > 1, name
        progress = ranks[0].source_progress()[name]
        assert progress["samples"] == len(seen)
        assert progress["epochs"] == pytest.approx(len(seen) / n)
    assert ranks[0].source_progress()["math"]["epochs"] > 8  # the small source is repeated


def test_exact_resume(sets):
    ref = blend(sets, mb=3, rank=1, world=2)
    for _ in range(7):
        next(ref)
    state = json.loads(json.dumps(ref.state_dict()))
    want = [next(ref) for _ in range(40)]
    resumed = blend(sets, mb=3, rank=1, world=2)
    resumed.load_state_dict(state)
    for a, b in zip(want, (next(resumed) for _ in range(40)), strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert (a[key] == b[key]).all()


@pytest.mark.parametrize("world,mb", [(3, 2), (1, 5), (4, 1)])
def test_another_data_parallel_size_on_resume(sets, world, mb):
    """Saved at 2 ranks x 3, resumed at another layout: the global stream, and so every
    source's samples, are the uninterrupted run's."""
    reference = global_stream([blend(sets, mb=1)], 300)
    old = [blend(sets, mb=3, rank=r, world=2) for r in range(2)]
    seen = global_stream(old, 11)
    state = old[0].state_dict()
    new = [blend(sets, mb=mb, rank=r, world=world) for r in range(world)]
    for ld in new:
        ld.load_state_dict(state)
    seen += global_stream(new, 200 // (world * mb))
    assert seen == reference[: len(seen)]
    for name in SIZES:
        assert Counter(x for x in seen if x[0] == name) == Counter(
            x for x in reference[: len(seen)] if x[0] == name
        )


def test_changed_weights_start_a_new_segment(sets):
    ld = blend(sets, mb=4)
    before = global_stream([ld], 10)
    state = ld.state_dict()
    new_weights = {"web": 0.2, "code": 0.2, "math": 0.6}
    resumed = blend(sets, mb=4, weights=new_weights)
    resumed.load_state_dict(state)
    after = global_stream([resumed], 50)
    check_proportions(after, new_weights)  # the new weights hold from the resume on
    assert resumed.state_dict()["segment"]["start"] == len(before)
    again = blend(sets, mb=4, weights=new_weights)  # and the new segment resumes exactly
    again.load_state_dict(resumed.state_dict())
    assert global_stream([again], 5) == global_stream([resumed], 5)


def test_states_that_cannot_continue_are_refused(sets):
    ld = blend(sets)
    next(ld)
    state = ld.state_dict()
    path, index = sets["web"]
    single = PackedLoader(path, index, "train", SEQ, 2, 0, 1, 3)
    with pytest.raises(DataError, match="blending data.sources"):
        single.load_state_dict(state)
    with pytest.raises(DataError, match="saved by a run reading one source"):
        ld.load_state_dict(single.state_dict())
    two = {k: v for k, v in sets.items() if k != "math"}
    with pytest.raises(DataError, match=r"blending \['code', 'math', 'web'\].*\['code', 'web'\]"):
        blend(two, weights={"web": 1.0, "code": 1.0}).load_state_dict(state)
    bad = json.loads(json.dumps(state))
    bad["sources"]["code"]["num_samples"] += 1
    with pytest.raises(DataError, match="source 'code' had 91 samples, now 90"):
        ld.load_state_dict(bad)
    with pytest.raises(DataError, match="seed=3 but this loader has seed=4"):
        blend(sets, seed=4).load_state_dict(state)


def test_evaluation_per_source(sets):
    ld = blend(sets, split="val")
    calls = []

    def evaluate(batches):
        rows = [row for b in batches for row in rows_of(b)]
        calls.append(rows)
        return float(NAMES.index(rows[0][0]) + 1)  # 1, 2, 3 for web, code, math

    loss, per_source = ld.evaluate(2, evaluate)
    assert per_source == {"web": 1.0, "code": 2.0, "math": 3.0}
    assert loss == pytest.approx(0.6 * 1 + 0.3 * 2 + 0.1 * 3)
    assert all(len(rows) == 4 and len({s for s, _ in rows}) == 1 for rows in calls)
    ld.loaders["math"] = None  # a source without a validation sample is left out
    loss, per_source = ld.evaluate(1, evaluate)
    assert per_source["math"] is None
    assert loss == pytest.approx((0.6 * 1 + 0.3 * 2) / 0.9)
