"""The blend of a prepared three-source mixture read by real rank processes (gloo), as the
trainer builds it: 2 ranks read a while and save the loader state (as a checkpoint does); 3
ranks resume from it. Per source, the samples seen equal the uninterrupted
one-process run's: nothing skipped or repeated within any source."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch.distributed as dist

from moetrain.data import build_loader
from moetrain.data.prepare import prepare
from tests.helpers.distributed import run_distributed
from tests.unit.test_data_mixture import mixture_config, write_sources

SEED = 11
pytestmark = pytest.mark.slow


def _ids(cfg) -> dict[bytes, tuple[str, int]]:
    loader = build_loader(cfg.data, "train", 1, 0, 1, SEED)
    return {
        ld.sample_tokens(s)[:-1].tobytes(): (name, s)
        for name, ld in loader.loaders.items()
        for s in range(ld.num_samples)
    }


def _read(rank: int, world: int, tmp: str, mb: int, steps: int, state: dict | None) -> dict:
    cfg = mixture_config(Path(tmp), write_sources_paths(Path(tmp)))
    loader = build_loader(cfg.data, "train", mb, dist.get_rank(), dist.get_world_size(), SEED)
    if state is not None:
        loader.load_state_dict(state)
    rows = [next(loader)["input_ids"].numpy().tobytes() for _ in range(steps)]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rows)
    return {"rows": gathered, "state": loader.state_dict()}


def write_sources_paths(tmp: Path) -> list[dict]:
    """The source entries of the mixture already written in ``tmp``."""
    return [
        {"source": str(tmp / "web.jsonl"), "weight": 0.6},
        {"source": str(tmp / "code.parquet"), "weight": 0.3, "text_field": "body"},
        {"source": str(tmp / "math.txt"), "weight": 0.1},
    ]


def _global_stream(result: list[dict], mb: int, ids: dict) -> list[tuple[str, int]]:
    """Rows of every rank in global order (step by step, rank by rank)."""
    per_rank = result[0]["rows"]
    out = []
    for step in zip(*per_rank, strict=True):
        for blob in step:
            size = len(blob) // mb
            out += [ids[blob[i * size : (i + 1) * size]] for i in range(mb)]
    return out


def test_resume_on_another_number_of_ranks(tmp_path):
    sources = write_sources(tmp_path)
    assert sources == write_sources_paths(tmp_path)
    cfg = mixture_config(tmp_path, sources)
    prepare(cfg)
    ids = _ids(cfg)
    reference = []
    whole = build_loader(cfg.data, "train", 1, 0, 1, SEED)
    for _ in range(400):
        reference.append(ids[next(whole)["input_ids"].numpy().tobytes()])

    first = run_distributed(_read, 2, str(tmp_path), 3, 20, None)
    state = first[0]["state"]
    assert first[1]["state"] == state and state["consumed_samples"] == 120
    seen = _global_stream(first, 3, ids)
    again = run_distributed(_read, 3, str(tmp_path), 2, 40, state)
    assert all(r["state"] == again[0]["state"] for r in again)
    seen += _global_stream(again, 2, ids)
    assert seen == reference[: len(seen)]  # the same global stream...
    for name in ("web", "code", "math"):  # ...so every source's samples are the same
        mine = Counter(s for src, s in seen if src == name)
        want = Counter(s for src, s in reference[: len(seen)] if src == name)
        assert mine == want, name
