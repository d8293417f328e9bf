"""prepare(): sources, shard contents vs index, atomicity (SIGKILL mid-way), reruns, errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from moetrain.config import load_config
from moetrain.data import DataError, build_loader, load_tokenizer, read_index
from moetrain.data.prepare import is_val_doc, prepare
from moetrain.data.shards import verify_split
from moetrain.data.tokenizer import train_tokenizer
from moetrain.fileio import remove_stale_temp_dirs

REPO = Path(__file__).resolve().parents[2]
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "expert",
    "router",
    "token",
    "shard",
    "loader",
    "index",
    "über",
    "東京",
]


def make_docs(n: int = 120, seed: int = 0, words_per_doc: int = 40) -> list[str]:
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        k = int(rng.integers(5, words_per_doc))
        words = [WORDS[j] for j in rng.integers(0, len(WORDS), k)]
        docs.append(f"doc {i}: " + " ".join(words) + f"\n  value = {int(rng.integers(0, 99999))}")
    return docs


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def config(tmp_path: Path, source: str | Path, **over):
    args = {
        "model.vocab_size": 320,
        "data.source": str(source),
        "data.output_dir": str(tmp_path / "out"),
        "data.seq_len": 16,
        "data.val_fraction": 0.1,
        "data.num_proc": 1,
        "data.shard_tokens": 1000,
    }
    args.update({k.replace("__", "."): v for k, v in over.items()})
    return load_config(None, [f"{k}={v}" for k, v in args.items()])


def read_docs(out: Path, split: str) -> list[list[int]]:
    index = read_index(out)
    docs = []
    for view in verify_split(out, index, split):
        starts = np.asarray(view.doc_starts)
        docs += [view.tokens[a:b].tolist() for a, b in zip(starts[:-1], starts[1:], strict=True)]
    return docs


def check_matches(out: Path, docs: list[str]) -> None:
    """Every document, in order, is in its split, decodes to its text and ends with EOS."""
    index = read_index(out)
    tok = load_tokenizer(out)
    eos = index["tokenizer"]["special_ids"]["eos"]
    assert index["tokenizer"]["sha256"] == tok.sha256
    for split in ("train", "val"):
        want = [
            d
            for i, d in enumerate(docs)
            if is_val_doc(i, index["val_fraction"]) == (split == "val")
        ]
        got = read_docs(out, split)
        assert len(got) == len(want) == index["splits"][split]["num_docs"]
        assert sum(map(len, got)) == index["splits"][split]["num_tokens"]
        for ids, text in zip(got, want, strict=True):
            assert ids[-1] == eos and eos not in ids[:-1]
            assert tok.decode(ids[:-1]) == text


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prep")
    docs = make_docs(300)  # > 2 map batches, so num_proc=2 really uses two processes
    cfg = config(tmp, write_jsonl(tmp / "c.jsonl", docs))
    return cfg, prepare(cfg), docs


def test_index_matches_data(prepared):
    cfg, out, docs = prepared
    assert out == Path(cfg.data.output_dir).resolve()
    check_matches(out, docs)
    index = read_index(out)
    assert index["dtype"] == "uint16"
    assert index["tokenizer"]["special_ids"] == {"pad": 0, "unk": 1, "bos": 2, "eos": 3}
    assert index["tokenizer"]["vocab_size"] == 320
    assert len(index["splits"]["train"]["shards"]) > 1  # shard_tokens=1000 rolls over
    for shard in index["splits"]["train"]["shards"][:-1]:
        assert shard["num_tokens"] >= 1000
    assert index["splits"]["val"]["num_docs"] >= 1
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".out.")]


def test_rerun_is_up_to_date(prepared, capsys):
    cfg, out, _ = prepared
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert prepare(cfg) == out
    assert "up to date" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_num_proc_and_streaming_give_identical_shards(prepared, tmp_path):
    cfg, out, docs = prepared
    src = cfg.data.source
    for over in ({"data__num_proc": 2}, {"data__streaming": "true", "data__num_proc": 2}):
        other = prepare(config(tmp_path / str(len(over)), src, **over))
        assert read_index(other)["splits"] == read_index(out)["splits"]
        for split in ("train", "val"):
            assert read_docs(other, split) == read_docs(out, split)


def test_reuse_tokenizer_model(prepared, tmp_path):
    cfg, out, docs = prepared
    cfg2 = config(tmp_path, cfg.data.source, data__tokenizer_model=str(out / "tokenizer.model"))
    out2 = prepare(cfg2)
    assert read_index(out2)["tokenizer"]["sha256"] == read_index(out)["tokenizer"]["sha256"]
    check_matches(out2, docs)
    build_loader(cfg2.data, "train", 2, 0, 1, 0, vocab_size=320)


@pytest.mark.parametrize("fmt", ["parquet", "csv", "json-glob", "text-dir"])
def test_other_source_formats(tmp_path, fmt):
    docs = make_docs(40, seed=1)
    if fmt == "parquet":
        src = tmp_path / "c.parquet"
        pq.write_table(pa.table({"body": docs}), src)
        cfg = config(tmp_path, src, data__text_field="body")
    elif fmt == "csv":
        src = tmp_path / "c.csv"
        pacsv.write_csv(pa.table({"text": docs}), src)
        cfg = config(tmp_path, src)
    elif fmt == "json-glob":
        write_jsonl(tmp_path / "d" / "a.jsonl", docs[:20], "content")
        write_jsonl(tmp_path / "d" / "b.jsonl", docs[20:], "content")
        src = tmp_path / "d" / "*.jsonl"
        cfg = config(tmp_path, src, data__text_field="content")
    else:  # text files: documents are blocks separated by blank lines
        docs = [d.replace("\n", " ") for d in docs]
        (tmp_path / "t").mkdir()
        (tmp_path / "t" / "a.txt").write_text("\n\n".join(docs[:20]))
        (tmp_path / "t" / "b.txt").write_text("\n\n".join(docs[20:]))
        cfg = config(tmp_path, tmp_path / "t")
    check_matches(prepare(cfg), docs)


def test_max_docs(tmp_path):
    docs = make_docs(60)
    out = prepare(config(tmp_path, write_jsonl(tmp_path / "c.jsonl", docs), data__max_docs=25))
    check_matches(out, docs[:25])


# --------------------------------------------------------------------------- interruption

KILL_SCRIPT = textwrap.dedent(
    """
    import sys
    from moetrain.config import load_config
    from moetrain.data.prepare import prepare
    prepare(load_config(None, sys.argv[1:]))
    """
)


def _run_and_kill(cfg, out: Path, wait_for: str) -> Path:
    """Start prepare in a subprocess, SIGKILL it once its temporary dir holds ``wait_for``."""
    args = [f"{k}={v}" for k, v in _flat(cfg).items()]
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, *args], cwd=REPO)
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            work = [p for p in out.parent.glob(f".{out.name}.tmp-*") if (p / wait_for).exists()]
            if work:
                assert proc.poll() is None, "prepare finished before it could be killed"
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                return work[0]
            assert proc.poll() is None, "prepare exited early"
            time.sleep(0.005)
        raise AssertionError("prepare never reached the point to kill it")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _flat(cfg) -> dict:
    d = cfg.data
    return {
        "model.vocab_size": cfg.model.vocab_size,
        "data.source": d.source,
        "data.output_dir": d.output_dir,
        "data.seq_len": d.seq_len,
        "data.val_fraction": d.val_fraction,
        "data.num_proc": d.num_proc,
        "data.shard_tokens": d.shard_tokens,
    }


@pytest.fixture(scope="module")
def big_source(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("big")
    return write_jsonl(tmp / "big.jsonl", make_docs(2000, seed=2, words_per_doc=60))


def test_killed_prepare_leaves_nothing_complete_and_rerun_succeeds(tmp_path, big_source):
    cfg = config(tmp_path, big_source, data__shard_tokens=20000)
    out = Path(cfg.data.output_dir).resolve()
    work = _run_and_kill(cfg, out, "tokenizer.json")  # after the tokenizer, during shards
    assert work.exists() and not (work / "index.json").exists()
    assert not out.exists()  # nothing that looks like a shard set
    with pytest.raises(DataError, match="no shard index"):
        build_loader(cfg.data, "train", 2, 0, 1, 0)
    prepare(cfg)
    assert not work.exists()  # stale temporary directory of the dead prepare removed
    index = read_index(out)
    for split in ("train", "val"):
        verify_split(out, index, split)


def test_killed_rebuild_keeps_previous_complete_set(tmp_path, big_source):
    cfg = config(tmp_path, big_source, data__shard_tokens=20000, data__max_docs=300)
    out = prepare(cfg)
    before = read_index(out)
    cfg2 = config(tmp_path, big_source, data__shard_tokens=20000, model__vocab_size=300)
    _run_and_kill(cfg2, out, "tokenizer.json")
    assert read_index(out) == before
    for split in ("train", "val"):
        verify_split(out, before, split)
    build_loader(cfg.data, "train", 2, 0, 1, 0, vocab_size=320)


def test_stale_dirs_of_live_processes_are_kept(tmp_path):
    out = tmp_path / "out"
    import socket

    live = tmp_path / f".out.tmp-{socket.gethostname()}-{os.getpid()}-abcd"
    dead = tmp_path / f".out.tmp-{socket.gethostname()}-99999999-abcd"
    live.mkdir()
    dead.mkdir()
    assert remove_stale_temp_dirs(out) == [dead]
    assert live.exists() and not dead.exists()


# --------------------------------------------------------------------------- bad input


def test_missing_path(tmp_path):
    with pytest.raises(DataError, match=f"data.source: {tmp_path / 'nope.jsonl'} does not exist"):
        prepare(config(tmp_path, tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="no files match the glob"):
        prepare(config(tmp_path, tmp_path / "*.parquet"))
    with pytest.raises(DataError, match="data.tokenizer_model: .*missing.model does not exist"):
        prepare(
            config(tmp_path, tmp_path / "x.jsonl", data__tokenizer_model=tmp_path / "missing.model")
        )


def test_empty_corpus(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=f"{empty}: empty corpus"):
        prepare(config(tmp_path, empty))
    blank = write_jsonl(tmp_path / "blank.jsonl", ["", ""])
    with pytest.raises(DataError, match=f"{blank}.*empty corpus"):
        prepare(config(tmp_path, blank))
    assert not list(tmp_path.glob(".out.*"))


def test_missing_text_field(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(10), field="body")
    with pytest.raises(DataError, match=r"c.jsonl.*text field 'text' not found.*\['body', 'id'\]"):
        prepare(config(tmp_path, src))


def test_unknown_extension(tmp_path):
    src = tmp_path / "c.dat"
    src.write_text("hello")
    with pytest.raises(DataError, match=f"{src}: cannot tell the format.*data.source_format"):
        prepare(config(tmp_path, src))


def test_vocab_too_small(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(10))
    with pytest.raises(DataError, match="model.vocab_size=100 is too small"):
        prepare(config(tmp_path, src, model__vocab_size=100))


def test_tokenizer_vocab_larger_than_model_refused(prepared, tmp_path):
    cfg, out, _ = prepared
    tok = str(out / "tokenizer.model")
    with pytest.raises(DataError, match=f"{tok}: tokenizer vocab size 320 > model.vocab_size=300"):
        prepare(config(tmp_path, cfg.data.source, data__tokenizer_model=tok, model__vocab_size=300))
    assert not (tmp_path / "out").exists()
    with pytest.raises(
        DataError, match=r"index.json: tokenizer vocab size 320 is larger than model.vocab_size=300"
    ):
        build_loader(cfg.data, "train", 2, 0, 1, 0, vocab_size=300)
    # a smaller vocabulary is fine (a model's embedding often has spare rows)
    build_loader(cfg.data, "train", 2, 0, 1, 0, vocab_size=512)


def test_shards_built_with_another_tokenizer(prepared, tmp_path):
    cfg, out, docs = prepared
    other = train_tokenizer(docs[::-1] + ["zzz qqq"], 320, tmp_path / "other")
    cfg2 = config(tmp_path, cfg.data.source, data__output_dir=out, data__tokenizer_model=other.path)
    with pytest.raises(
        DataError,
        match=r"shards were built with tokenizer sha256 .* configured tokenizer .*other/tokenizer.model",
    ):
        build_loader(cfg2.data, "train", 2, 0, 1, 0)


def test_shard_size_mismatch(prepared, tmp_path):
    cfg, out, docs = prepared
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    shard = copy / read_index(copy)["splits"]["train"]["shards"][0]["file"]
    with open(shard, "ab") as f:
        f.write(b"\0\0")
    cfg2 = config(tmp_path, cfg.data.source, data__output_dir=copy)
    with pytest.raises(DataError, match=f"{shard}: size .* does not match its index"):
        build_loader(cfg2.data, "train", 2, 0, 1, 0)
    shard.unlink()
    with pytest.raises(DataError, match=f"{shard}: shard file listed in index.json is missing"):
        build_loader(cfg2.data, "train", 2, 0, 1, 0)


def test_bad_source_specs(tmp_path):
    cfg = config(tmp_path, "x.jsonl")
    cfg.data.source = "hf:"  # (YAML would read a bare "hf:" as a mapping)
    with pytest.raises(DataError, match="names no dataset; use hf:NAME"):
        prepare(cfg)
    with pytest.raises(DataError, match="unknown builtin corpus 'builtin:nope'"):
        prepare(config(tmp_path, "builtin:nope"))
