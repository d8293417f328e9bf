"""A mixture (``data.sources``: jsonl, parquet and text sources, a tokenizer trained on their
weighted sample) prepared by two ranks through the real CLI gives the same bytes as the
one-process prepare: every file of the mixture directory and of every source's shard set.
Plain rank processes (RANK / WORLD_SIZE) in the default suite; under torchrun with ``-m long``.
(One source on several ranks: tests/e2e/test_prepare_distributed.py.)"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from moetrain.config import load_config
from moetrain.data.prepare import prepare
from tests.e2e.test_prepare_distributed import TORCHRUN, start_ranks
from tests.helpers.launch import CONFIG, ROOT, env_for
from tests.unit.test_data_mixture import write_sources

pytestmark = pytest.mark.slow


def _args(root: Path, sources: list[dict]) -> list[str]:
    return [
        "model.vocab_size=400",
        f"data.output_dir={root / 'out'}",  # the sources' shard sets go to root/sources
        "data.seq_len=16",
        "data.val_fraction=0.1",
        "data.num_proc=1",
        "data.shard_tokens=1000",
        "data.prepare_chunk_mb=0.002",  # every source in several chunks, on both ranks
        f"data.sources={json.dumps(sources)}",
        "parallel.timeout_minutes=2",
    ]


def _tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("launcher", ["plain", pytest.param("torchrun", marks=pytest.mark.long)])
def test_mixture_on_two_ranks_is_the_one_process_prepare(tmp_path, launcher):
    sources = write_sources(tmp_path)  # the same files (fingerprints) for both prepares
    root = tmp_path / "mix"  # the same paths too: the reference is moved aside after it
    args = _args(root, sources)
    prepare(load_config(CONFIG, args))
    reference = _tree(root)
    assert "out/mixture.json" in reference
    assert sum(name.startswith("sources/") and ".bin" in name for name in reference) >= 6
    root.rename(tmp_path / "reference")

    if launcher == "plain":
        procs = start_ranks(2, args, tmp_path / "ranks")
        codes = [p.wait(timeout=300) for p in procs]
        log = "".join(p.read_text() for p in sorted(tmp_path.glob("ranks.*.log")))
    else:
        cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "moetrain", "prepare"]
        r = subprocess.run([*cmd, CONFIG, *args], env=env_for(), cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
        codes, log = [r.returncode], r.stdout + r.stderr
    assert codes == [0] * len(codes), log[-4000:]
    assert "rank 1 of 2 wrote its chunks" in log  # rank 1 tokenized its share
    got = _tree(root)
    assert sorted(got) == sorted(reference)
    for name in got:
        assert got[name] == reference[name], f"{name} differs from the one-process prepare"
