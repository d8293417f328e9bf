"""``moetrain prepare``: corpus -> tokenizer -> token shards, written atomically.

Everything is built in a temporary directory next to ``data.output_dir``
(``.<name>.tmp-<host>-<pid>-<rand>``), fsynced, and renamed into place only when the index is
written, so an interrupted prepare never leaves a complete-looking shard set (a previous
complete set stays untouched until the rename). Temporary directories left by dead prepares are
removed on the next run. A rerun with the same inputs finds the finished set and returns at once
(same inputs = same source fingerprint and data/tokenizer settings; a streamed Hub dataset has no
fingerprint, so delete ``output_dir`` to rebuild one after it changed upstream).

Train/validation split: document ``i`` (in source order) goes to validation when
``blake2b(i) / 2**64 < data.val_fraction``; document 0 always does when ``val_fraction > 0``,
so small corpora still get a validation split. Independent of the run seed and of num_proc.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from moetrain.checkpoint.io import (
    install_dir,
    new_temp_dir,
    remove_stale_temp_dirs,
)
from moetrain.config import Config, DataConfig
from moetrain.data.errors import DataError
from moetrain.data.shards import (
    FORMAT,
    INDEX_FILE,
    VERSION,
    ShardWriter,
    read_index,
    token_dtype,
    verify_split,
    write_index,
)
from moetrain.data.sources import Corpus, default_num_proc, load_corpus
from moetrain.data.tokenizer import (
    META_FILE,
    AnyTokenizer,
    check_vocab_size,
    copy_tokenizer,
    load_tokenizer,
    train_tokenizer,
)

SPLIT_RULE = "val iff blake2b(str(doc_index), digest 8, key 'moetrain-split') / 2**64 < val_fraction, or doc_index == 0"
_SAMPLE_SEED = 0  # tokenizer sample and SentencePiece seed (independent of the run seed)
_BATCH = 128  # documents per tokenizer batch


def is_val_doc(index: int, val_fraction: float) -> bool:
    """The deterministic document split (see module docstring)."""
    if val_fraction <= 0:
        return False
    if index == 0:
        return True
    h = hashlib.blake2b(str(index).encode(), digest_size=8, key=b"moetrain-split").digest()
    return int.from_bytes(h, "little") / 2.0**64 < val_fraction


class _Encoder:
    """Batched tokenizer for ``datasets.map``: loads the model lazily in each worker."""

    def __init__(self, model_path: str, text_field: str, val_fraction: float):
        self.model_path, self.text_field, self.val_fraction = model_path, text_field, val_fraction
        self._tok: AnyTokenizer | None = None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_tok"} | {"_tok": None}

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        if self._tok is None:
            self._tok = load_tokenizer(self.model_path)
        eos = self._tok.eos_id
        texts = [t if isinstance(t, str) else "" for t in batch[self.text_field]]
        ids = self._tok.encode_batch(texts)
        out = [
            np.array(x + [eos], dtype=np.int32) if t else np.zeros(0, np.int32)
            for x, t in zip(ids, texts, strict=True)
        ]
        return {"ids": out, "val": [is_val_doc(i, self.val_fraction) for i in indices]}


def _prepare_key(cfg: Config, corpus_fp: str) -> str:
    d = cfg.data
    tok = load_tokenizer(d.tokenizer_source[1]).sha256 if d.tokenizer_source else None
    key = {
        "version": VERSION,
        "source": corpus_fp,
        "vocab_size": cfg.model.vocab_size,
        "tokenizer_model": tok,
        "tokenizer_sample_docs": d.tokenizer_sample_docs,
        "val_fraction": d.val_fraction,
        "shard_tokens": d.shard_tokens,
        "split_rule": SPLIT_RULE,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _tokenizer_sample(corpus: Corpus, n: int) -> list[str]:
    ds, field = corpus.dataset, corpus.text_field
    if corpus.streaming:
        return [ex[field] for ex in ds.take(n) if isinstance(ex[field], str)]
    if n < len(ds):
        rng = np.random.default_rng(_SAMPLE_SEED)
        ds = ds.select(np.sort(rng.choice(len(ds), size=n, replace=False)))
    return [t for t in ds[field] if isinstance(t, str)]


def _get_tokenizer(cfg: Config, corpus: Corpus, work: Path) -> AnyTokenizer:
    d, vocab = cfg.data, cfg.model.vocab_size
    if d.tokenizer_source:
        src = Path(d.tokenizer_source[1])
        tok = copy_tokenizer(load_tokenizer(src), work)  # checks that it exists and loads
        if tok.vocab_size > vocab:
            raise DataError(
                f"{src}: tokenizer vocab size {tok.vocab_size} > model.vocab_size={vocab}"
            )
        if tok.kind == "sentencepiece":
            (work / META_FILE).write_text(
                json.dumps(tok.metadata() | {"copied_from": str(src)}, indent=2) + "\n"
            )
        print(f"prepare: reusing {tok.kind} tokenizer {src} (sha256 {tok.sha256[:12]})")
        return tok
    t0 = time.time()
    docs = _tokenizer_sample(corpus, d.tokenizer_sample_docs)
    if not any(doc.strip() for doc in docs):
        raise DataError(f"data.source {corpus.description}: empty corpus (no text)")
    mb = sum(len(x) for x in docs) / 1e6
    print(
        f"prepare: training a {vocab}-piece BPE tokenizer on {len(docs)} documents ({mb:.1f} M chars)"
    )
    tok = train_tokenizer(docs, vocab, work, seed=_SAMPLE_SEED)
    print(f"prepare: tokenizer trained in {time.time() - t0:.1f}s (sha256 {tok.sha256[:12]})")
    return tok


def _tokenized_batches(corpus: Corpus, encoder: _Encoder, num_proc: int, work: Path):
    """Yield (flat int32 tokens, lengths, is_val) per batch of documents, in source order."""
    ds = corpus.dataset
    if not corpus.streaming:
        num_proc = max(1, min(num_proc, len(ds) // _BATCH or 1))
        (work / "tok").mkdir()
        mapped = ds.map(
            encoder,
            batched=True,
            batch_size=_BATCH,
            with_indices=True,
            num_proc=num_proc if num_proc > 1 else None,
            remove_columns=ds.column_names,
            cache_file_name=str(work / "tok" / "tokens.arrow"),
            desc=f"tokenize ({num_proc} proc)",
        )
        for table in tqdm(
            mapped.with_format("arrow").iter(batch_size=10 * _BATCH),
            total=-(-len(mapped) // (10 * _BATCH)),
            desc="write shards",
            unit="batch",
        ):
            ids = table.column("ids").combine_chunks()
            yield (
                ids.values.to_numpy(zero_copy_only=False),
                np.diff(ids.offsets.to_numpy()),
                table.column("val").to_numpy(zero_copy_only=False),
            )
        return
    # streaming: batches of the iterable dataset, tokenized by a process pool in order

    def batches():
        start = 0
        for batch in ds.iter(batch_size=_BATCH):
            n = len(batch[corpus.text_field])
            yield batch, list(range(start, start + n))
            start += n

    # fork (as datasets.map does on Linux): spawn would re-run an unguarded __main__ script
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    with ctx.Pool(num_proc) if num_proc > 1 else _Inline() as pool:
        for out in tqdm(
            pool.imap(_call_encoder, ((encoder, b, i) for b, i in batches())),
            desc="tokenize (streaming)",
            unit="batch",
        ):
            lengths = np.array([len(x) for x in out["ids"]], dtype=np.int64)
            flat = np.concatenate(out["ids"]) if len(lengths) else np.zeros(0, np.int32)
            yield flat, lengths, np.array(out["val"], dtype=bool)


def _call_encoder(args):
    encoder, batch, indices = args
    return encoder(batch, indices)


class _Inline:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def imap(self, fn, items):
        return map(fn, items)


def _write_shards(cfg: Config, corpus: Corpus, tok: AnyTokenizer, work: Path) -> dict:
    d = cfg.data
    dtype = token_dtype(tok.vocab_size)
    writers = {s: ShardWriter(work, s, dtype, d.shard_tokens) for s in ("train", "val")}
    encoder = _Encoder(str(tok.path), corpus.text_field, d.val_fraction)
    for flat, lengths, is_val in _tokenized_batches(
        corpus, encoder, default_num_proc(d.num_proc), work
    ):
        token_val = np.repeat(is_val, lengths)
        writers["train"].add(flat[~token_val], lengths[~is_val])
        writers["val"].add(flat[token_val], lengths[is_val])
    splits = {s: w.finish() for s, w in writers.items()}
    if splits["train"]["num_tokens"] + splits["val"]["num_tokens"] == 0:
        raise DataError(f"data.source {corpus.description}: empty corpus (no text)")
    if splits["train"]["num_tokens"] == 0:
        raise DataError(
            f"data.source {corpus.description}: too few documents "
            f"({splits['val']['num_docs']}) for a train/validation split; set data.val_fraction=0"
        )
    return splits


def prepare(cfg: Config) -> Path:
    """Train or reuse the tokenizer and write the token shards to ``cfg.data.output_dir``.

    Returns the output directory. A complete set built from the same inputs is reused.
    """
    d: DataConfig = cfg.data
    if not d.tokenizer_source:
        check_vocab_size(cfg.model.vocab_size)
    elif not Path(d.tokenizer_source[1]).exists():
        raise DataError(f"{d.tokenizer_source[0]}: {d.tokenizer_source[1]} does not exist")
    out = Path(d.output_dir).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    for p in remove_stale_temp_dirs(out):
        print(f"prepare: removed stale temporary directory {p}")
    t0 = time.time()
    work = new_temp_dir(out)
    try:
        corpus = load_corpus(d, cache_dir=out.parent, work_dir=work)
        key = _prepare_key(cfg, corpus.fingerprint)
        if (out / INDEX_FILE).is_file():
            try:
                index = read_index(out)
                if index.get("prepare_key") == key:
                    for split in index["splits"]:
                        verify_split(out, index, split)
                    print(
                        f"prepare: {out} is up to date ({index['splits']['train']['num_tokens']:,} train tokens)"
                    )
                    return out
            except DataError as e:
                print(f"prepare: rebuilding {out}: {e}")
        print(f"prepare: source {corpus.description}")
        tok = _get_tokenizer(cfg, corpus, work)
        if tok.vocab_size > cfg.model.vocab_size:
            raise DataError(
                f"{tok.path}: tokenizer vocab size {tok.vocab_size} > model.vocab_size={cfg.model.vocab_size}"
            )
        splits = _write_shards(cfg, corpus, tok, work)
        shutil.rmtree(work / "tok", ignore_errors=True)
        shutil.rmtree(work / "hf-cache", ignore_errors=True)
        index = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": token_dtype(tok.vocab_size).name,
            "tokenizer": tok.metadata() | {"file": tok.path.relative_to(work).as_posix()},
            "source": {
                "spec": d.source,
                "description": corpus.description,
                "fingerprint": corpus.fingerprint,
            },
            "prepare_key": key,
            "split_rule": SPLIT_RULE,
            "val_fraction": d.val_fraction,
            "eos_appended": True,
            "splits": splits,
        }
        write_index(work, index)
        install_dir(work, out, replace=True)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    tr, va = splits["train"], splits["val"]
    print(
        f"prepare: wrote {out}: train {tr['num_tokens']:,} tokens / {tr['num_docs']:,} docs in "
        f"{len(tr['shards'])} shard(s), val {va['num_tokens']:,} tokens / {va['num_docs']:,} docs "
        f"({time.time() - t0:.1f}s)",
        file=sys.stdout,
        flush=True,
    )
    return out
