"""SentencePiece tokenizer: train with LLM-pretraining settings, load, encode, identify.

Trained models use BPE with byte fallback (no input is ever ``<unk>``), split digits, identity
normalisation (text is kept byte for byte: whitespace runs, tabs, unicode forms), full character
coverage and these fixed special ids, recorded next to the model in ``tokenizer.json`` and in the
shard index:

    pad = 0, unk = 1, bos = 2, eos = 3

Newlines are not learned as pieces (SentencePiece trains on lines); they encode through byte
fallback as ``<0x0A>``, as in Llama/Mistral tokenizers.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import sentencepiece as spm

from moetrain.checkpoint.io import file_sha256
from moetrain.data.errors import DataError

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
NUM_SPECIAL = 4
NUM_BYTE_PIECES = 256
MIN_VOCAB = NUM_SPECIAL + NUM_BYTE_PIECES + 1
MODEL_FILE = "tokenizer.model"
META_FILE = "tokenizer.json"
_MAX_LINE_BYTES = 1 << 16  # longer lines are cut into pieces of this size for training


@dataclass(frozen=True)
class SpecialIds:
    pad: int
    unk: int
    bos: int
    eos: int


class Tokenizer:
    """A loaded SentencePiece model plus its identity (sha256 of the ``.model`` file)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if path.is_dir():
            path = path / MODEL_FILE
        if not path.is_file():
            raise DataError(f"{path}: tokenizer model not found")
        self.path = path
        self.sha256 = file_sha256(path)
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.load(str(path))
        except (OSError, RuntimeError) as e:
            raise DataError(f"{path}: not a SentencePiece model ({e})") from None
        self.special = SpecialIds(
            pad=self.sp.pad_id(), unk=self.sp.unk_id(), bos=self.sp.bos_id(), eos=self.sp.eos_id()
        )
        if self.special.eos < 0:
            raise DataError(f"{path}: tokenizer has no EOS token; documents need one")

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def eos_id(self) -> int:
        return self.special.eos

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Encode many texts; one thread by default (parallelism comes from worker processes)."""
        return self.sp.encode(list(texts), num_threads=num_threads)

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode(list(ids))

    def metadata(self) -> dict:
        """What the shard index and checkpoints record about this tokenizer."""
        return {
            "file": self.path.name,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "special_ids": asdict(self.special),
        }


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a SentencePiece ``.model`` file, or ``tokenizer.model`` inside a directory."""
    return Tokenizer(path)


def check_vocab_size(vocab_size: int, where: str = "model.vocab_size") -> None:
    if vocab_size < MIN_VOCAB:
        raise DataError(
            f"{where}={vocab_size} is too small: the {NUM_SPECIAL} special tokens (pad, unk, "
            f"bos, eos) and {NUM_BYTE_PIECES} byte-fallback pieces need at least {MIN_VOCAB}"
        )


def _lines(docs: Iterable[str]) -> Iterable[str]:
    for doc in docs:
        for line in doc.split("\n"):
            if not line.strip():
                continue
            while len(line.encode("utf-8")) > _MAX_LINE_BYTES:
                yield line[: _MAX_LINE_BYTES // 4]
                line = line[_MAX_LINE_BYTES // 4 :]
            yield line


def train_tokenizer(
    docs: Iterable[str], vocab_size: int, out_dir: str | Path, *, seed: int = 0
) -> Tokenizer:
    """Train a BPE model on ``docs`` (split into lines); write ``tokenizer.model`` and
    ``tokenizer.json`` into ``out_dir``. Deterministic for the same input, seed and version."""
    check_vocab_size(vocab_size)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spm.set_random_generator_seed(seed)
    buf = io.BytesIO()
    settings = dict(
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        num_threads=os.cpu_count() or 1,
        max_sentence_length=_MAX_LINE_BYTES,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        hard_vocab_limit=True,
        minloglevel=2,
    )
    lines = iter(_lines(docs))
    try:
        first = next(lines)
    except StopIteration:
        raise DataError("tokenizer training input is empty (no non-blank lines)") from None

    def all_lines():
        yield first
        yield from lines

    try:
        spm.SentencePieceTrainer.train(sentence_iterator=all_lines(), model_writer=buf, **settings)
    except RuntimeError as e:
        raise DataError(
            f"SentencePiece could not train a vocab of {vocab_size} pieces: {e} "
            f"(the vocab must hold {NUM_SPECIAL} special tokens, {NUM_BYTE_PIECES} byte pieces "
            "and every character of the sample; raise model.vocab_size or use more text)"
        ) from None
    model_path = out_dir / MODEL_FILE
    model_path.write_bytes(buf.getvalue())
    tok = Tokenizer(model_path)
    meta = tok.metadata() | {"trainer": {k: v for k, v in settings.items() if k != "minloglevel"}}
    meta["trainer"]["num_threads"] = "all cores"
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return tok
