"""JSON Lines read in place: the same documents as ``datasets`` reads, errors that name the
document, and prepares equal to the ``datasets`` path."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import datasets
import numpy as np
import pytest

from moetrain.data import DataError
from moetrain.data.jsonl import JsonLines, is_json_lines
from moetrain.data.prepare import prepare
from moetrain.data.sources import open_source, resolve_source, source_specs
from tests.unit.test_data_prepare import config, make_docs, read_docs

BOM = b"\xef\xbb\xbf"


def edge_case_files(root: Path) -> list[Path]:
    """Two JSON Lines files and an empty one with everything the reader must skip or keep."""
    docs = make_docs(60, seed=3)
    a = [json.dumps({"text": d, "id": i}) for i, d in enumerate(docs[:30])]
    a[3] = json.dumps({"text": "line\u2028separator and \u00e9\u6771", "id": 3}, ensure_ascii=False)
    a[5] = json.dumps({"text": None, "id": 5})  # null text: an empty document
    a[7] = json.dumps({"id": 7})  # no text field: an empty document
    a[9] = json.dumps({"text": "", "id": 9})
    b = [json.dumps({"id": i, "text": d}) for i, d in enumerate(docs[30:])]
    root.mkdir(parents=True, exist_ok=True)
    # a byte order mark, CRLF line ends, blank and whitespace-only lines, no final newline
    (root / "a.jsonl").write_bytes(
        BOM + b"\r\n".join(x.encode() for x in a[:10]) + b"\r\n\n   \n\t\r\n"
        + b"\n".join(x.encode() for x in a[10:]) + b"\n"
    )  # fmt: skip
    (root / "b.jsonl").write_bytes(b"\n\n" + b"\n".join(x.encode() for x in b))
    (root / "c.jsonl").write_bytes(b"")
    return sorted(root.glob("*.jsonl"))


def _open(tmp_path: Path, source: str | Path, **over):
    spec = source_specs(config(tmp_path, source, **over).data)[0]
    return open_source(resolve_source(spec, tmp_path), tmp_path / "cache")


def test_json_lines_give_the_documents_datasets_reads(tmp_path):
    files = edge_case_files(tmp_path / "src")
    assert is_json_lines(files)
    corpus = _open(tmp_path, tmp_path / "src" / "*.jsonl")
    assert isinstance(corpus.docs, JsonLines)
    want = datasets.load_dataset(
        "json", data_files=[str(f) for f in files], split="train", cache_dir=str(tmp_path / "hf")
    )["text"]
    docs = corpus.docs
    assert len(docs) == len(want) == 60
    assert [t for batch in docs.texts(0, len(docs), 7) for t in batch] == want
    assert [t for batch in docs.texts(25, 41, 4) for t in batch] == want[25:41]  # across files
    picks = [0, 3, 5, 7, 29, 30, 59]
    assert docs.take(picks) == [want[i] for i in picks]
    lines = [ln for f in files for ln in f.read_bytes().removeprefix(BOM).split(b"\n")]
    assert sorted(docs.sizes("x").tolist()) == sorted(len(ln) for ln in lines if ln.strip())
    # another process of the same prepare reads the line index instead of scanning again
    again = _open(tmp_path, tmp_path / "src" / "*.jsonl")
    assert isinstance(again.docs.lines, np.memmap)
    assert np.array_equal(again.docs.lines, docs.lines)
    assert len(_open(tmp_path, tmp_path / "src" / "*.jsonl", data__max_docs=12).docs) == 12


def test_prepare_reads_json_lines_as_datasets_does(tmp_path):
    edge_case_files(tmp_path / "src")
    src = tmp_path / "src" / "*.jsonl"
    outs = [
        prepare(config(tmp_path / "inplace", src, data__num_proc=2)),
        prepare(config(tmp_path / "datasets", src, data__streaming="true")),
    ]
    for split in ("train", "val"):
        assert read_docs(outs[0], split) == read_docs(outs[1], split)
    assert not list((tmp_path / "inplace").glob(".out.*"))  # the build directory is gone


def test_json_arrays_and_compressed_files_are_read_by_datasets(tmp_path):
    docs = make_docs(20, seed=4)
    array = tmp_path / "c.json"
    array.write_text(json.dumps([{"text": d} for d in docs]))
    packed = tmp_path / "c.jsonl.gz"
    packed.write_bytes(
        gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in docs).encode())
    )
    for src in (array, packed):
        assert not is_json_lines([src])
        corpus = _open(tmp_path, src)
        assert not isinstance(corpus.docs, JsonLines)
        assert corpus.docs.take(list(range(20))) == docs


@pytest.mark.parametrize(
    "line, error",
    [
        (b'{"text": "unterminated}', r"at byte 26: document 1 is not valid JSON"),
        (b'["text", "a list"]', r"at byte 26: document 1 is a JSON list, not an object"),
        (b'{"text": 42}', r"at byte 26: text field 'text' of document 1 holds int, not text"),
        (b'{"text": "bad utf-8 \xff"}', r"at byte 26: document 1 is not valid JSON"),
        (b'{"text": "a \\ud800 alone"}', r"at byte 26: document 1 holds an unpaired surrogate"),
    ],
)
def test_a_bad_document_is_named_by_its_file_and_byte(tmp_path, line, error):
    src = tmp_path / "c.jsonl"
    head = b'{"text": "a good one"}\n  \n'  # the bad document starts at byte 26
    src.write_bytes(head + line + b'\n{"text": "last"}\n')
    with pytest.raises(DataError, match=f"{src} {error}"):
        prepare(config(tmp_path, src, data__val_fraction=0))
    assert not list(tmp_path.glob(".out.*"))


def test_a_text_field_no_document_has(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text('{"body": "x", "id": 1}\n{"id": 2, "extra": 3}\n')
    with pytest.raises(DataError, match=r"text field 'text' not found.*\['body', 'id', 'extra'\]"):
        prepare(config(tmp_path, src))
    # the field may be missing from the first documents (datasets reads it as null there)
    src.write_text('{"id": 1}\n' + "".join(json.dumps({"text": d}) + "\n" for d in make_docs(30)))
    assert len(_open(tmp_path, src).docs) == 31
