"""A mixture of three local sources (data.sources): prepare (one tokenizer, one shard set per
source, each the same bytes as a one-source prepare), the blend through build_loader, reuse of
prepared sources by another mixture, and bad input (each error names the source)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moetrain.config import ConfigError, load_config
from moetrain.data import DataError, build_loader, read_index
from moetrain.data.prepare import prepare
from moetrain.data.source_sets import read_mixture_index
from tests.unit.test_data_prepare import make_docs, write_jsonl

WEIGHTS = {"web": 0.6, "code": 0.3, "math": 0.1}
SEQ = 16


def mixture_config(tmp: Path, sources: list[dict], *extra: str):
    args = [
        "model.vocab_size=400",
        f"data.output_dir={tmp / 'out'}",
        f"data.seq_len={SEQ}",
        "data.val_fraction=0.1",
        "data.num_proc=1",
        "data.shard_tokens=1000",
        f"data.sources={json.dumps(sources)}",
        *extra,
    ]
    return load_config(None, args)


def numbered_docs(n: int, seed: int) -> list[str]:
    """``make_docs`` with a random number after every word: no two samples alike."""
    rng = np.random.default_rng(seed)
    return [
        " ".join(f"{w} {rng.integers(10**5)}" for w in doc.split())
        for doc in make_docs(n, seed=seed, words_per_doc=20)
    ]


def write_sources(tmp: Path) -> list[dict]:
    """web: jsonl, code: parquet with its own text field, math: a small text file (in three
    alphabets, so that a sample's tokens tell its source)."""
    web = write_jsonl(tmp / "web.jsonl", numbered_docs(100, seed=0))
    code = tmp / "code.parquet"
    pq.write_table(pa.table({"body": [d.upper() for d in numbered_docs(50, seed=1)]}), code)
    math = tmp / "math.txt"
    symbols = str.maketrans("abcdefghijklmnopqrstuvwxyz", "+-*/=<>()[]{}^%!~|&?#@$;',")
    docs = (d.replace("\n", " ").translate(symbols) for d in numbered_docs(5, seed=2))
    math.write_text("\n\n".join(docs))
    return [
        {"source": str(web), "weight": 0.6},
        {"source": str(code), "weight": 0.3, "text_field": "body"},
        {"source": str(math), "weight": 0.1},
    ]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mix")
    sources = write_sources(tmp)
    cfg = mixture_config(tmp, sources)
    return tmp, sources, cfg, prepare(cfg)


def shard_files(directory: Path) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes()
        for p in sorted(directory.iterdir())
        if p.name.startswith(("train-", "val-"))
    }


def test_each_source_is_its_own_shard_set_equal_to_a_one_source_prepare(mixed, tmp_path):
    tmp, sources, cfg, out = mixed
    index = read_mixture_index(out)
    assert (out / "tokenizer.model").is_file()
    assert [e["name"] for e in index["sources"]] == ["web", "code", "math"]
    for entry, src in zip(index["sources"], sources, strict=True):
        directory = (out / entry["dir"]).resolve()
        assert directory.parent == tmp / "sources"  # data.sources_dir's default
        sub = read_index(directory)
        assert sub["tokenizer"]["sha256"] == index["tokenizer"]["sha256"]
        one = load_config(
            None,
            [
                "model.vocab_size=400",
                f"data.source={src['source']}",
                f"data.text_field={src.get('text_field', 'text')}",
                f"data.output_dir={tmp_path / entry['name']}",
                "data.val_fraction=0.1",
                "data.num_proc=1",
                "data.shard_tokens=1000",
                f"data.tokenizer_model={out / 'tokenizer.model'}",
            ],
        )
        single = prepare(one)
        assert read_index(single)["splits"] == sub["splits"]
        assert shard_files(single) == shard_files(directory)


def test_blend_through_build_loader(mixed):
    _, _, cfg, out = mixed
    world, mb = 2, 3
    ranks = [build_loader(cfg.data, "train", mb, r, world, 7, vocab_size=400) for r in range(world)]
    ids = {}
    for name, loader in ranks[0].loaders.items():
        for s in range(loader.num_samples):
            ids[loader.sample_tokens(s)[:-1].tobytes()] = (name, s)
    assert len(ids) == sum(ld.num_samples for ld in ranks[0].loaders.values())  # unique rows
    loaders = ranks[0].loaders
    steps = max(ld.num_samples / WEIGHTS[n] for n, ld in loaders.items()) // (world * mb) + 2
    stream = []
    for _ in range(int(steps)):
        for ld in ranks:
            stream += [ids[row.numpy().tobytes()] for row in next(ld)["input_ids"]]
    counts = Counter()
    for n, (name, _) in enumerate(stream, start=1):
        counts[name] += 1
        for s, w in WEIGHTS.items():
            assert abs(counts[s] - w * n) < 1, (n, counts)
    for name, loader in ranks[0].loaders.items():
        seen = [s for src, s in stream if src == name]
        n = loader.num_samples
        assert len(seen) >= n, name
        for e in range(len(seen) // n):
            assert sorted(seen[e * n : (e + 1) * n]) == list(range(n)), name
    assert ranks[0].source_progress()["math"]["epochs"] > 2  # the small source repeats
    assert ranks[0].state_dict() == ranks[1].state_dict()
    val = build_loader(cfg.data, "val", 2, 0, 1, 7)
    loss, per_source = val.evaluate(1, lambda batches: float(sum(1 for _ in batches)))
    assert per_source == {"web": 1.0, "code": 1.0, "math": 1.0} and loss == 1.0
    val_tokens = {
        e["name"]: e["splits"]["val"]["num_tokens"] for e in read_mixture_index(out)["sources"]
    }
    assert min(val_tokens["web"], val_tokens["code"]) > val_tokens["math"] + 1
    long = dataclasses.replace(cfg.data, seq_len=val_tokens["math"])  # no math val sample
    loss, per_source = build_loader(long, "val", 1, 0, 1, 7).evaluate(1, lambda b: len(list(b)))
    assert per_source == {"web": 1, "code": 1, "math": None} and loss == 1.0
    with pytest.raises(DataError, match=r"data.sources\[2\] \(math\): .*fewer than one sequence"):
        build_loader(dataclasses.replace(cfg.data, seq_len=2000), "train", 1, 0, 1, 7)


def test_rerun_is_up_to_date_and_another_mixture_reuses_sources(mixed, tmp_path, capsys):
    tmp, sources, cfg, out = mixed
    before = {p: p.stat().st_mtime_ns for p in (tmp / "sources").rglob("*")}
    assert prepare(cfg) == out
    assert "up to date" in capsys.readouterr().out
    extra = write_jsonl(tmp_path / "extra.jsonl", make_docs(50, seed=9))
    other = mixture_config(
        tmp_path,
        [{**sources[0], "weight": 0.5}, sources[1], {"source": str(extra), "weight": 0.5}],
        f"data.tokenizer_model={out / 'tokenizer.model'}",
        f"data.sources_dir={tmp / 'sources'}",
    )
    out2 = prepare(other)
    printed = capsys.readouterr().out
    assert "source web: reusing" in printed and "source code: reusing" in printed
    assert {p: p.stat().st_mtime_ns for p in before} == before  # not tokenized again
    first, second = read_mixture_index(out), read_mixture_index(out2)
    dirs = {e["name"]: (out2 / e["dir"]).resolve() for e in second["sources"]}
    assert dirs["web"] == (out / first["sources"][0]["dir"]).resolve()
    assert dirs["extra"].parent == tmp / "sources"
    build_loader(other.data, "train", 2, 0, 1, 0, vocab_size=400)


def test_bad_sources_name_the_source(mixed, tmp_path):
    _, sources, _, _ = mixed
    nope = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match=rf"data.sources\[1\] \(nope\): {nope} does not exist"):
        prepare(mixture_config(tmp_path, [sources[0], {"source": nope, "weight": 1}]))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(
        DataError, match=r"data.sources\[1\] \(empty\): .*empty.jsonl: empty corpus"
    ):
        prepare(mixture_config(tmp_path, [sources[0], {"source": str(empty), "weight": 1}]))
    blank = write_jsonl(tmp_path / "blank.jsonl", ["", ""])
    with pytest.raises(DataError, match=r"data.sources\[1\] \(blank\) .*blank.jsonl.*empty corpus"):
        prepare(mixture_config(tmp_path, [sources[0], {"source": str(blank), "weight": 1}]))
    assert not list(tmp_path.glob(".out.*"))  # nothing half-written left behind
    for weight, pattern in (
        (0, r"data.sources\[0\].weight: must be > 0; got 0.0 \(source '.*web.jsonl'\)"),
        (-1.5, r"data.sources\[0\].weight: must be > 0; got -1.5"),
        ("lots", r"data.sources\[0\].weight: expected float, got 'lots' \(in '.*web.jsonl'\)"),
    ):
        with pytest.raises(ConfigError, match=pattern):
            mixture_config(tmp_path, [{**sources[0], "weight": weight}])
    for text in (".nan", ".inf"):  # YAML's non-finite floats, as an override of one entry
        with pytest.raises(ConfigError, match=r"data.sources\[1\].weight: must be a finite"):
            mixture_config(tmp_path, sources, f"data.sources[1].weight={text}")
    with pytest.raises(
        ConfigError, match=r"data.sources\[1\].name: 'web' .*also the name of data.sources\[0\]"
    ):
        mixture_config(tmp_path, [sources[0], {**sources[1], "name": "web"}])
    with pytest.raises(ConfigError, match=r"data.source: set to .* together with data.sources"):
        mixture_config(tmp_path, sources, "data.source=x.jsonl")


def test_train_refuses_mismatched_mixtures(mixed, tmp_path):
    tmp, sources, cfg, out = mixed
    renamed = mixture_config(tmp, [sources[0], {**sources[1], "name": "prog"}, sources[2]])
    with pytest.raises(DataError, match=r"data.sources\[1\] \(prog\): not in the mixture prepared"):
        build_loader(renamed.data, "train", 2, 0, 1, 0)
    moved = mixture_config(tmp, [sources[0], {**sources[1], "source": "elsewhere.parquet", "name": "code"}, sources[2]])  # fmt: skip
    with pytest.raises(
        DataError, match=r"data.sources\[1\] \(code\): .*prepared from .*code.parquet"
    ):
        build_loader(moved.data, "train", 2, 0, 1, 0)
    # a source's shard set replaced by one prepared with another tokenizer
    copy = tmp_path / "copy"
    shutil.copytree(out, copy / "out")
    shutil.copytree(tmp / "sources", copy / "sources")
    entry = read_mixture_index(copy / "out")["sources"][1]
    victim = (copy / "out" / entry["dir"]).resolve()
    other = prepare(
        load_config(
            None,
            [
                "model.vocab_size=300",
                f"data.source={sources[1]['source']}",
                "data.text_field=body",
                f"data.output_dir={tmp_path / 'other'}",
                "data.num_proc=1",
            ],
        )
    )
    shutil.rmtree(victim)
    shutil.copytree(other, victim)
    index = read_index(victim)
    index["prepare_key"] = entry["prepare_key"]
    (victim / "index.json").write_text(json.dumps(index))
    cfg2 = mixture_config(copy, sources)
    with pytest.raises(
        DataError,
        match=r"data.sources\[1\] \(code\): the shards in .* were built with tokenizer sha256",
    ):
        build_loader(cfg2.data, "train", 2, 0, 1, 0)
    cfg3 = mixture_config(tmp, sources, f"data.tokenizer_model={other / 'tokenizer.model'}")
    with pytest.raises(
        DataError,
        match=r"mixture.json: shards were built with tokenizer sha256 .* configured tokenizer",
    ):
        build_loader(cfg3.data, "train", 2, 0, 1, 0)
