"""SentencePiece tokenizer: round trips, special ids, settings, errors."""

from __future__ import annotations

import json
import random

import pytest

from moetrain.data import DataError, load_tokenizer
from moetrain.data.tokenizer import META_FILE, MODEL_FILE, check_vocab_size, train_tokenizer

WORDS = [
    "the",
    "of",
    "and",
    "model",
    "expert",
    "router",
    "token",
    "data",
    "train",
    "loss",
    "layer",
    "gate",
    "shard",
    "index",
]
UNICODE = "café naïve Ünïcödé straße ñandú 東京 日本語 Москва Ελλάδα שלום"


def corpus(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        lines = []
        for _ in range(rng.randint(1, 6)):
            words = rng.choices(WORDS, k=rng.randint(3, 12))
            words.append(str(rng.randint(0, 10**6)))
            if i % 5 == 0:
                words.append(rng.choice(UNICODE.split()))
            lines.append(" " * rng.choice([0, 0, 4, 8]) + " ".join(words))
        docs.append("\n".join(lines))
    return docs


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tokenizer(corpus(), 400, tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize(
    "text",
    [
        "the model routes tokens to experts",
        UNICODE,
        "digits 0123456789 and 3.14159 and -42",
        "runs   of    spaces\t\ttabs\n\n\nnewlines  \n   trailing   ",
        "    indented = code(x)  # comment",
        "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🙂🚀 ∑∫√ 한국어 ไทย",  # characters never seen in training: byte fallback
        " leading space",
        "",
    ],
)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_unseen_characters_use_byte_fallback_not_unk(tok):
    ids = tok.encode("🙂 한")
    assert tok.special.unk not in ids
    pieces = [tok.sp.id_to_piece(i) for i in ids]
    assert "<0xF0>" in pieces and "<0xED>" in pieces  # first UTF-8 bytes of 🙂 and 한


def test_digits_are_split(tok):
    pieces = [tok.sp.id_to_piece(i) for i in tok.encode("1234567")]
    assert [p.lstrip("▁") for p in pieces if p.lstrip("▁")] == list("1234567")


def test_whitespace_runs_kept_and_newline_bytes(tok):
    pieces = [tok.sp.id_to_piece(i) for i in tok.encode("a\n        b")]
    assert "<0x0A>" in pieces
    assert any(set(p) == {"▁"} and len(p) > 1 for p in pieces)  # learned whitespace-only piece


def test_special_ids_fixed_and_recorded(tok, tmp_path):
    sp = tok.sp
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (0, 1, 2, 3)
    assert [sp.id_to_piece(i) for i in range(4)] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert tok.vocab_size == 400
    meta = json.loads((tok.path.parent / META_FILE).read_text())
    assert meta["special_ids"] == {"pad": 0, "unk": 1, "bos": 2, "eos": 3}
    assert meta["sha256"] == tok.sha256 and meta["vocab_size"] == 400
    assert meta["trainer"]["byte_fallback"] and meta["trainer"]["split_digits"]
    assert meta["trainer"]["normalization_rule_name"] == "identity"
    assert meta["trainer"]["character_coverage"] == 1.0
    # the ids in the metadata are the ones encode/decode use
    assert tok.decode([5, meta["special_ids"]["eos"]]) == tok.decode([5])
    assert tok.sp.encode("x", add_eos=True)[-1] == meta["special_ids"]["eos"]


def test_training_is_deterministic(tok, tmp_path):
    again = train_tokenizer(corpus(), 400, tmp_path)
    assert again.sha256 == tok.sha256


def test_load_from_dir_and_file(tok):
    assert load_tokenizer(tok.path.parent).sha256 == tok.sha256
    assert load_tokenizer(tok.path).vocab_size == 400


def test_vocab_too_small_for_specials(tmp_path):
    with pytest.raises(DataError, match=r"model.vocab_size=200 is too small.*at least 261"):
        check_vocab_size(200)
    with pytest.raises(DataError, match="too small"):
        train_tokenizer(corpus(20), 100, tmp_path)


def test_vocab_too_small_for_characters(tmp_path):
    docs = corpus(50) + ["".join(chr(0x4E00 + i) for i in range(300))]
    with pytest.raises(DataError, match="could not train a vocab of 300 pieces"):
        train_tokenizer(docs, 300, tmp_path)


def test_bad_model_files(tmp_path):
    with pytest.raises(DataError, match="tokenizer model not found"):
        load_tokenizer(tmp_path / "nope.model")
    bad = tmp_path / MODEL_FILE
    bad.write_bytes(b"not a model")
    with pytest.raises(DataError, match=f"{bad}: not a SentencePiece model"):
        load_tokenizer(bad)


def test_empty_training_input(tmp_path):
    with pytest.raises(DataError, match="empty"):
        train_tokenizer(["", "   \n  "], 400, tmp_path)
