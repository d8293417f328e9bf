"""Tokenizers: SentencePiece (trained here, or a ``.model`` file) and Hugging Face
``tokenizer.json`` (a model's own tokenizer, via the ``tokenizers`` library), behind one
interface: ``encode`` / ``encode_batch`` / ``decode``, ``vocab_size``, ``eos_id``, ``special``,
``sha256`` (of the identity file), ``metadata()`` and ``files`` (what travels with shards,
checkpoints and converted models). :func:`load_tokenizer` picks the backend from the path.

A Hugging Face tokenizer encodes a document as it encodes any text (its normaliser,
pre-tokeniser and post-processor, e.g. Llama 3's ``<|begin_of_text|>``; special-token strings in
the text are read as special tokens, as ``tokenizers`` and transformers do by default, unless
``tokenizer_config.json`` sets ``split_special_tokens``, as transformers reads it); a
trailing EOS its post-processor adds is left to ``prepare``, which ends every document with one
EOS. Its special tokens come from ``tokenizer_config.json`` (or ``special_tokens_map.json``)
beside ``tokenizer.json``; an EOS token is required.

SentencePiece models trained here:

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

from moetrain.data.errors import DataError
from moetrain.fileio import file_sha256

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
NUM_SPECIAL = 4
NUM_BYTE_PIECES = 256
MIN_VOCAB = NUM_SPECIAL + NUM_BYTE_PIECES + 1
MODEL_FILE = "tokenizer.model"
META_FILE = "tokenizer.json"  # beside a trained or copied SentencePiece model: its metadata
HF_FILE = "tokenizer.json"  # a Hugging Face tokenizer (its sha256 is the identity)
HF_CONFIG_FILE = "tokenizer_config.json"
HF_FILES = (HF_FILE, HF_CONFIG_FILE, "special_tokens_map.json", "chat_template.jinja")
HF_DIR = "tokenizer"  # where prepare keeps a Hugging Face tokenizer's files
_MAX_LINE_BYTES = 1 << 16  # longer lines are cut into pieces of this size for training


@dataclass(frozen=True)
class SpecialIds:
    pad: int
    unk: int
    bos: int
    eos: int


class _Identified:
    """What both backends share: the identity file (``path``), its ``sha256``, the special ids,
    and what shards, checkpoints and converted models record about them."""

    kind: str
    special: SpecialIds

    def _identify(self, path: str | Path, name: str, what: str) -> Path:
        """``path`` (a file, or ``name`` inside a directory) checked and fingerprinted."""
        path = Path(path)
        if path.is_dir():
            path = path / name
        if not path.is_file():
            raise DataError(f"{path}: {what} not found")
        self.path = path
        self.sha256 = file_sha256(path)
        return path

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def eos_id(self) -> int:
        return self.special.eos

    def metadata(self) -> dict:
        """What the shard index and checkpoints record about this tokenizer."""
        return {
            "file": self.path.name,
            "kind": self.kind,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "special_ids": asdict(self.special),
        }

    @property
    def files(self) -> list[Path]:
        """The files that make up this tokenizer."""
        return tokenizer_files(self.path)


class Tokenizer(_Identified):
    """A loaded SentencePiece model plus its identity (sha256 of the ``.model`` file)."""

    kind = "sentencepiece"

    def __init__(self, path: str | Path):
        path = self._identify(path, MODEL_FILE, "tokenizer model")
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

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Encode many texts; one thread by default (parallelism comes from worker processes)."""
        return self.sp.encode(list(texts), num_threads=num_threads)

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode(list(ids))


def _token_text(value: object) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it (a string or an AddedToken dict)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer(_Identified):
    """A Hugging Face ``tokenizer.json`` (``tokenizers`` library) plus its identity (sha256 of
    ``tokenizer.json``) and special tokens (see the module docstring)."""

    kind = "huggingface"

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as RustTokenizer

        path = self._identify(path, HF_FILE, "Hugging Face tokenizer file")
        try:
            self.tk = RustTokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises a bare Exception
            raise DataError(f"{path}: not a Hugging Face tokenizer file ({e})") from None
        # a file saved with truncation or padding on would cut documents to its length and pad
        # short ones, depending on how they are batched: documents are tokenized whole
        self.tk.no_truncation()
        self.tk.no_padding()
        vocab = self.tk.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0
        named: dict = {}
        for name in ("special_tokens_map.json", HF_CONFIG_FILE):  # the latter wins
            f = path.parent / name
            if f.is_file():
                try:
                    named |= json.loads(f.read_text())
                except json.JSONDecodeError as e:
                    raise DataError(f"{f}: not valid JSON ({e})") from None
        ids = {}
        for role in ("pad", "unk", "bos", "eos"):
            token = _token_text(named.get(f"{role}_token"))
            ids[role] = vocab.get(token, -1) if token is not None else -1
        self.special = SpecialIds(**ids)
        if self.special.eos < 0:
            raise DataError(
                f"{path}: no EOS token (eos_token in {HF_CONFIG_FILE} or special_tokens_map.json, "
                "present in the vocabulary); documents need one"
            )
        # transformers' split_special_tokens: special-token strings in the text stay text
        self.tk.encode_special_tokens = bool(named.get("split_special_tokens", False))
        # the post-processor's own trailing EOS (if it adds one) is left to prepare
        self._strip_eos = self.tk.encode("").ids[-1:] == [self.special.eos]

    @property
    def vocab_size(self) -> int:
        """Largest token id + 1 (added tokens included)."""
        return self._vocab_size

    def _ids(self, encoding: object) -> list[int]:
        ids = encoding.ids
        return ids[:-1] if self._strip_eos and ids[-1:] == [self.special.eos] else ids

    def encode(self, text: str) -> list[int]:
        return self._ids(self.tk.encode(text))

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Encode many texts (the library's own thread pool decides its threads)."""
        return [self._ids(e) for e in self.tk.encode_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=False)


AnyTokenizer = Tokenizer | HFTokenizer


def _is_hf_tokenizer_file(path: Path) -> bool:
    """A ``tokenizer.json`` that is a Hugging Face tokenizer (not the metadata written beside a
    SentencePiece model, which has the same name)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "model" in data and "sha256" not in data


def load_tokenizer(path: str | Path) -> AnyTokenizer:
    """The tokenizer at ``path``: a SentencePiece ``.model`` file, a Hugging Face
    ``tokenizer.json``, or a directory holding one (a Hugging Face ``tokenizer.json`` is
    preferred to a ``tokenizer.model`` beside it)."""
    path = Path(path)
    if path.is_dir():
        if (path / HF_FILE).is_file() and _is_hf_tokenizer_file(path / HF_FILE):
            return HFTokenizer(path)
        return Tokenizer(path)
    if path.suffix == ".json":
        return HFTokenizer(path)
    return Tokenizer(path)


def tokenizer_file(path: str | Path) -> Path:
    """The identity file (whose sha256 names the tokenizer) of what :func:`load_tokenizer`
    would load from ``path``, without loading it."""
    path = Path(path)
    if not path.is_dir():
        return path
    hf = path / HF_FILE
    return hf if hf.is_file() and _is_hf_tokenizer_file(hf) else path / MODEL_FILE


def tokenizer_files(path: str | Path) -> list[Path]:
    """The files of the tokenizer at ``path`` (see :func:`load_tokenizer`), without loading it;
    empty when there is none."""
    ident = tokenizer_file(path)
    if not ident.is_file():
        return []
    if ident.suffix != ".json":
        return [ident]
    return [ident.parent / n for n in HF_FILES if (ident.parent / n).is_file()]


def prepared_tokenizer_file(directory: Path) -> Path:
    """The identity file of the tokenizer copy that ``prepare`` keeps in ``directory``."""
    hf = directory / HF_DIR
    return tokenizer_file(hf) if hf.is_dir() else directory / MODEL_FILE


def copy_tokenizer(tok: AnyTokenizer, dest: Path) -> AnyTokenizer:
    """Copy ``tok``'s files into ``dest`` (a SentencePiece model into ``dest`` itself, a Hugging
    Face tokenizer into ``dest/tokenizer/``); returns the copy, loaded."""
    import shutil

    target = dest if tok.kind == "sentencepiece" else dest / HF_DIR
    target.mkdir(parents=True, exist_ok=True)
    for f in tok.files:
        shutil.copyfile(f, target / (MODEL_FILE if tok.kind == "sentencepiece" else f.name))
    return load_tokenizer(target)


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
