"""The exported Hugging Face tokenizer gives SentencePiece's ids exactly."""

from __future__ import annotations

import json

import pytest

from moetrain.convert.tokenizer_export import export_tokenizer
from moetrain.data.tokenizer import train_tokenizer

transformers = pytest.importorskip("transformers")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b  # 1234567890\n",
    "Numbers 3.14159 and 2718 and 42, whitespace    runs\tand tabs.",
    "Ünïcödé text: café, naïve, Straße, 日本語, Ελληνικά.",
] * 20

TEXTS = [
    "hello world",
    "",
    " ",
    "  leading spaces",
    "trailing spaces   ",
    "a\tb\nc\n\n",
    "x    y        z",
    "12345 3.14159 007 1e-9",
    "Ünïcödé — 日本語 Ελληνικά café",
    "emoji 🚀🦄 and rare 𝔘𝔫𝔦 ﷽ \u200b\u00a0",  # need byte fallback
    "\x00\x01 control",
    "<s> and </s> and <pad> written as text",
    "def f(x):\n    return x**2\n",
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    sp = train_tokenizer(CORPUS, 400, root / "sp")
    out = root / "hf"
    export_tokenizer(sp.path, out)
    return sp, out


def test_same_ids_as_sentencepiece(exported) -> None:
    sp, out = exported
    hf = transformers.AutoTokenizer.from_pretrained(out)
    assert len(hf) == sp.vocab_size == 400  # not a 3-token vocab
    assert any(i >= 4 + 256 for t in TEXTS for i in sp.encode(t))  # learned merges in play
    byte_ids = [i for i in sp.encode(TEXTS[9]) if 4 <= i < 260]
    assert byte_ids  # byte fallback exercised
    for text in TEXTS:
        ids = sp.encode(text)
        assert hf(text)["input_ids"] == ids, text
        assert hf.encode(text) == ids, text  # no BOS/EOS added
        assert hf.decode(ids) == sp.decode(ids), text
    batch = hf(TEXTS)["input_ids"]
    assert batch == [sp.encode(t) for t in TEXTS]


def test_special_ids_and_config(exported) -> None:
    sp, out = exported
    hf = transformers.AutoTokenizer.from_pretrained(out)
    s = sp.special
    assert (hf.pad_token_id, hf.unk_token_id, hf.bos_token_id, hf.eos_token_id) == (
        s.pad,
        s.unk,
        s.bos,
        s.eos,
    )
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["add_bos_token"] is False and cfg["add_eos_token"] is False
    assert (out / "tokenizer.model").read_bytes() == sp.path.read_bytes()
    assert hf.decode([s.bos, *sp.encode("hi there"), s.eos], skip_special_tokens=True) == "hi there"
