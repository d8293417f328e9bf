"""The packed loader in real processes (gloo): epoch coverage, disjoint ranks, exact resume,
and resuming a 2-rank position on 1 rank."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moetrain.config import load_config
from moetrain.data import build_loader
from moetrain.data.prepare import prepare
from tests.helpers.distributed import run_distributed

MB, SEED = 3, 5
pytestmark = pytest.mark.slow


def _config(tmp: Path):
    return load_config(
        None,
        [
            "model.vocab_size=300",
            f"data.source={tmp / 'c.jsonl'}",
            f"data.output_dir={tmp / 'out'}",
            "data.seq_len=16",
            "data.num_proc=1",
            "data.document_mask=true",
        ],
    )


def _rank_fn(rank: int, world: int, tmp: str) -> dict:
    cfg = _config(Path(tmp))
    ld = build_loader(
        cfg.data, "train", MB, dist.get_rank(), dist.get_world_size(), SEED, vocab_size=300
    )
    n = ld.num_samples
    steps = -(-n // (world * MB)) + 2  # all of epoch 0 and into epoch 1
    rows, saved = [], None
    for step in range(steps):
        if step == 3:
            saved = json.loads(json.dumps(ld.state_dict()))
        rows.append(next(ld)["input_ids"].tolist())
    resumed = build_loader(cfg.data, "train", MB, rank, world, SEED)
    resumed.load_state_dict(saved)
    replay = [next(resumed)["input_ids"].tolist() for _ in range(steps - 3)]
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    return {"rows": rows, "state": saved, "replay_ok": replay == rows[3:], "all": gathered}


def test_loader_over_two_processes(tmp_path):
    rng = np.random.default_rng(0)
    words = ["moe", "expert", "router", "token", "shard", "loader", "gloo", "rank", "epoch"]
    docs = [  # random digits make every 16-token window unique, so rows identify samples
        " ".join(f"{w} {rng.integers(10**6)}" for w in rng.choice(words, rng.integers(3, 25)))
        for _ in range(200)
    ]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = _config(tmp_path)
    prepare(cfg)

    results = run_distributed(_rank_fn, 2, str(tmp_path))
    assert all(r["replay_ok"] for r in results)  # exact resume across the epoch boundary
    assert results[0]["all"] == results[1]["all"] == [r["rows"] for r in results]
    assert results[0]["state"] == results[1]["state"]

    one = build_loader(cfg.data, "train", MB, 0, 1, SEED)
    n = one.num_samples
    every = Counter(tuple(one.sample_tokens(s)[:-1].tolist()) for s in range(n))
    stream = [
        row
        for step in zip(results[0]["rows"], results[1]["rows"], strict=True)
        for part in step
        for row in part
    ]
    epoch0 = [tuple(r) for r in stream[:n]]
    assert len(every) == n  # windows are unique
    assert Counter(epoch0) == every  # every sample exactly once in epoch 0
    per_rank = [{tuple(r) for step in res["rows"] for r in step} for res in results]
    first_epoch_rank = [set(), set()]
    for pos, row in enumerate(epoch0):
        first_epoch_rank[(pos % (2 * MB)) // MB].add(row)
    assert not first_epoch_rank[0] & first_epoch_rank[1]  # no sample on two ranks
    assert per_rank[0] and per_rank[1]

    # the 2-rank position resumed on one rank with a 2x micro-batch: the same global batch
    single = build_loader(cfg.data, "train", 2 * MB, 0, 1, SEED)
    single.load_state_dict(results[0]["state"])
    got = single.__next__()["input_ids"]
    want = torch.tensor(results[0]["rows"][3] + results[1]["rows"][3])
    assert torch.equal(got, want)
