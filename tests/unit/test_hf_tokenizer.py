"""A model's own Hugging Face tokenizer (tokenizer.json): prepare gives the ids the tokenizers
library gives, records its identity, refuses a vocabulary larger than the model, and the
converted model's AutoTokenizer round-trips the text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, processors

from moetrain.cli import main
from moetrain.config import load_config
from moetrain.convert.export import convert_checkpoint
from moetrain.convert.importer import import_hf_checkpoint
from moetrain.data import DataError, build_loader, read_index
from moetrain.data.prepare import prepare
from moetrain.data.source_sets import read_mixture_index
from moetrain.data.tokenizer import HFTokenizer, load_tokenizer
from tests.helpers.hf_models import EOS_TOKEN, save_hf_model, save_hf_tokenizer
from tests.unit.test_data_prepare import read_docs, write_jsonl

transformers = pytest.importorskip("transformers")

TEXT = (
    "Ünïcödé café 東京 — naïve 🙂 emoji\n"
    "digits 1234567890 3.14159 -42\n"
    "whitespace   runs\t\ttabs \n\n\n  trailing   \n"
    "def add(a, b):\n    return a + b  # sum\n\tif x != 0: print(f'{x!r}')\n"
)
TRAIN = [TEXT, "def f(x):\n    return x * 2\n", "the café in 東京 sells 12 cakes"] * 30


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return save_hf_tokenizer(TRAIN, 300, tmp_path_factory.mktemp("tok") / "tokenizer")


def prepared(tmp_path: Path, tokenizer: Path, docs: list[str], **over) -> Path:
    src = write_jsonl(tmp_path / "corpus.jsonl", docs)
    args = {
        "model.vocab_size": 320,
        "data.source": str(src),
        "data.output_dir": str(tmp_path / "out"),
        "data.tokenizer": str(tokenizer),
        "data.seq_len": 16,
        "data.val_fraction": 0.0,
        "data.num_proc": 1,
    } | {k.replace("__", "."): v for k, v in over.items()}
    return prepare(load_config(None, [f"{k}={v}" for k, v in args.items()]))


def test_prepare_ids_equal_the_tokenizers_library(tok_dir, tmp_path) -> None:
    raw = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    docs = [TEXT, "x = 1", TEXT[::-1]]
    out = prepared(tmp_path, tok_dir, docs)
    eos = raw.token_to_id(EOS_TOKEN)
    assert read_docs(out, "train") == [raw.encode(d).ids + [eos] for d in docs]
    index = read_index(out)
    tok = index["tokenizer"]
    assert tok["kind"] == "huggingface" and tok["file"] == "tokenizer/tokenizer.json"
    assert tok["sha256"] == HFTokenizer(tok_dir).sha256 and tok["vocab_size"] == 300
    assert tok["special_ids"]["eos"] == eos and index["dtype"] == "uint16"
    assert load_tokenizer(out / "tokenizer").decode(raw.encode(TEXT).ids) == TEXT


def test_a_mixture_with_a_hugging_face_tokenizer(tok_dir, tmp_path) -> None:
    """data.sources + data.tokenizer: every source's shard set and mixture.json record the
    tokenizer copy, its ids are the tokenizers library's, and the blended loader hands the
    tokenizer's files to checkpoints."""
    raw = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    docs = {"a": [TEXT, "x = 1"], "b": ["the café in 東京", TEXT[::-1]]}
    sources = [
        {"source": str(write_jsonl(tmp_path / f"{name}.jsonl", d)), "weight": w}
        for (name, d), w in zip(docs.items(), (0.7, 0.3), strict=True)
    ]
    cfg = load_config(
        None,
        [
            "model.vocab_size=320",
            f"data.sources={json.dumps(sources)}",
            f"data.output_dir={tmp_path / 'out'}",
            f"data.tokenizer={tok_dir}",
            "data.seq_len=8",
            "data.val_fraction=0",
            "data.num_proc=1",
        ],
    )
    out = prepare(cfg)
    mixture = read_mixture_index(out)
    assert mixture["tokenizer"]["file"] == "tokenizer/tokenizer.json"
    assert mixture["tokenizer"]["kind"] == "huggingface"
    eos = raw.token_to_id(EOS_TOKEN)
    for entry, texts in zip(mixture["sources"], docs.values(), strict=True):
        directory = out / entry["dir"]
        assert (directory / "tokenizer" / "tokenizer.json").is_file()
        assert read_docs(directory, "train") == [raw.encode(t).ids + [eos] for t in texts]
    loader = build_loader(cfg.data, "train", 1, 0, 1, seed=0, vocab_size=320)
    assert sorted(f.name for f in loader.tokenizer_files) == sorted(
        f.name for f in tok_dir.iterdir()
    )


def test_post_processor_specials_kept_and_one_eos(tok_dir, tmp_path) -> None:
    """A tokenizer whose post-processor adds BOS and EOS (Llama-style BOS): documents keep them,
    and end with exactly one EOS."""
    other = tmp_path / "bos_eos"
    other.mkdir()
    raw = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    raw.add_special_tokens(["<s>"])
    bos, eos = raw.token_to_id("<s>"), raw.token_to_id(EOS_TOKEN)
    raw.post_processor = processors.TemplateProcessing(
        single=f"<s> $A {EOS_TOKEN}", special_tokens=[("<s>", bos), (EOS_TOKEN, eos)]
    )
    raw.save(str(other / "tokenizer.json"))
    (other / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS_TOKEN}))
    out = prepared(tmp_path, other, ["x = 1", "y"])
    assert read_docs(out, "train") == [raw.encode(d).ids for d in ("x = 1", "y")]
    assert read_docs(out, "train")[0][0] == bos


def test_larger_vocab_than_model_and_missing_eos_refused(tok_dir, tmp_path) -> None:
    with pytest.raises(DataError, match="tokenizer vocab size 300 > model.vocab_size=200"):
        prepared(tmp_path, tok_dir, [TEXT], model__vocab_size=200)
    assert not (tmp_path / "out").exists()
    no_eos = tmp_path / "no_eos"
    no_eos.mkdir()
    (no_eos / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    with pytest.raises(DataError, match="no EOS token"):
        prepared(tmp_path, no_eos, [TEXT])
    with pytest.raises(DataError, match="data.tokenizer: .*missing does not exist"):
        prepared(tmp_path, tmp_path / "missing", [TEXT])


def test_convert_exports_the_same_tokenizer(tok_dir, tmp_path) -> None:
    """Round trip: a checkpoint carrying the tokenizer -> convert -> AutoTokenizer gives the
    same ids and decodes them back to the text."""
    hf_dir = save_hf_model("mixtral", tmp_path / "hf", tokenizer=tok_dir)
    ckpt = import_hf_checkpoint(hf_dir, tmp_path / "ckpt")
    assert (ckpt / "tokenizer.json").is_file() and not (ckpt / "tokenizer.model").exists()
    out = convert_checkpoint(ckpt, tmp_path / "out")
    auto = transformers.AutoTokenizer.from_pretrained(out)
    ids = Tokenizer.from_file(str(tok_dir / "tokenizer.json")).encode(TEXT).ids
    assert auto(TEXT)["input_ids"] == ids
    assert auto.decode(ids) == TEXT
    assert (out / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == auto.convert_tokens_to_ids(EOS_TOKEN)


def test_a_tokenizer_without_pad_or_bos_converts(tok_dir, tmp_path) -> None:
    """Mixtral's, Mistral's and Llama 3's tokenizers have no pad token: `moetrain import` then
    `moetrain convert` leave it unset in the exported configs (transformers refuses -1) and
    transformers loads the model."""
    no_pad = tmp_path / "no_pad"
    no_pad.mkdir()
    (no_pad / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    del config["pad_token"]
    (no_pad / "tokenizer_config.json").write_text(json.dumps(config))
    hf_dir = save_hf_model("mixtral", tmp_path / "hf", tokenizer=no_pad)
    out = tmp_path / "out"
    assert main(["import", str(hf_dir), str(tmp_path / "ckpt")]) == 0
    assert main(["convert", str(tmp_path / "ckpt"), str(out)]) == 0
    for name in ("config.json", "generation_config.json"):
        saved = json.loads((out / name).read_text())
        assert saved.get("pad_token_id") is None and saved.get("bos_token_id") is None, name
        assert saved["eos_token_id"] == HFTokenizer(no_pad).eos_id, name
    transformers.AutoModelForCausalLM.from_pretrained(out)
    assert transformers.AutoTokenizer.from_pretrained(out).pad_token is None


def test_split_special_tokens_as_transformers_reads_it(tok_dir, tmp_path) -> None:
    """Special-token strings inside the text: read as the special token by default, kept as
    text with tokenizer_config.json's split_special_tokens (as AutoTokenizer does)."""
    text = f"a {EOS_TOKEN} b"
    eos = HFTokenizer(tok_dir).eos_id
    assert eos in HFTokenizer(tok_dir).encode(text)
    split = tmp_path / "split"
    split.mkdir()
    (split / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (split / "tokenizer_config.json").write_text(
        json.dumps(config | {"split_special_tokens": True})
    )
    ids = HFTokenizer(split).encode(text)
    assert eos not in ids
    assert transformers.AutoTokenizer.from_pretrained(split)(text)["input_ids"] == ids


def test_truncation_and_padding_in_the_file_are_ignored(tok_dir, tmp_path) -> None:
    """A tokenizer.json saved with truncation and padding on: documents are still tokenized
    whole, and a batch gives what each document gives alone."""
    raw = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    saved = tmp_path / "tokenizer"
    saved.mkdir()
    for f in tok_dir.iterdir():
        (saved / f.name).write_bytes(f.read_bytes())
    configured = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    configured.enable_truncation(max_length=4)
    configured.enable_padding(pad_id=0, pad_token=EOS_TOKEN, length=64)
    configured.save(str(saved / "tokenizer.json"))
    assert json.loads((saved / "tokenizer.json").read_text())["truncation"] is not None
    docs = [TEXT, "x = 1", "def f(x):\n    return x * 2\n"]
    whole = [raw.encode(d).ids for d in docs]
    tok = HFTokenizer(saved)
    assert [tok.encode(d) for d in docs] == whole
    assert tok.encode_batch(docs) == whole
    out = prepared(tmp_path, saved, docs)
    eos = raw.token_to_id(EOS_TOKEN)
    assert read_docs(out, "train") == [ids + [eos] for ids in whole]
