"""``moetrain prepare``: sources -> tokenizer -> token shards, in one process or on every rank
of every node.

One source (``data.source``): ``data.output_dir`` receives the tokenizer and the shard set. A
mixture (``data.sources``): one tokenizer for all sources (given, or trained on a sample in which
each source has its weight's share of the text), one shard set per source, cached by
fingerprint in ``data.sources_dir`` and reused by every mixture that shares the source and the
tokenizer, and ``mixture.json`` in ``data.output_dir`` (:mod:`moetrain.data.source_sets`).

Any number of ranks (``torchrun``, ``deepspeed``, ``srun`` or plain processes; see
:mod:`moetrain.data.ranks`) share the work: rank 0 reads the sources, makes the tokenizer and
the plan; every rank tokenizes a disjoint, size-balanced set of chunks of every source
(:mod:`moetrain.data.chunks`) with ``data.num_proc`` processes, its own among them (default: its
share of the node's cores); rank 0 packs the chunks in document order into the shard files and writes
the index once every rank has finished (:mod:`moetrain.data.build`). The other ranks return as
soon as their chunks are written. The output is the same, byte for byte, whatever the number of
ranks and processes. A rank or node that is killed leaves nothing that ``train`` would read as a
finished dataset (a previous complete set stays in place until the rename that replaces it),
and a rerun keeps the finished chunks. A rerun with the same inputs finds the finished set and
returns at once (same inputs = same source fingerprints and data/tokenizer settings; a streamed
Hub dataset has no fingerprint, so delete ``output_dir`` to rebuild one after it changed).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from moetrain.config import Config, DataConfig
from moetrain.data.build import (
    PLAN_FILE,
    Job,
    Plan,
    build_dir,
    open_corpus,
    pack_jobs,
    tokenize_jobs,
)
from moetrain.data.chunks import (
    SPLIT_RULE,
    chunk_bytes,
    is_val_doc,
    plan_chunks,
)
from moetrain.data.errors import DataError
from moetrain.data.ranks import Heartbeat, Ranks, RankStopped, Watch, default_num_proc
from moetrain.data.shards import VERSION, is_complete
from moetrain.data.source_sets import (
    mixture_up_to_date,
    source_set_dir,
    source_set_key,
    sources_dir,
)
from moetrain.data.sources import Corpus, SourceRef, resolve_source, source_specs
from moetrain.data.tokenizer import (
    META_FILE,
    AnyTokenizer,
    check_vocab_size,
    copy_tokenizer,
    load_tokenizer,
    train_tokenizer,
)
from moetrain.fileio import (
    remove_stale_temp_dirs,
)

__all__ = ["SPLIT_RULE", "is_val_doc", "prepare"]
_SAMPLE_SEED = 0  # tokenizer sample and SentencePiece seed (independent of the run seed)


class PhaseClock:
    """Wall seconds of each phase of this rank's prepare, in the order first entered."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def __str__(self) -> str:
        return ", ".join(f"{name} {s:.2f}s" for name, s in self.seconds.items())


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


def _mixture_key(cfg: Config, refs: list[SourceRef]) -> str:
    d = cfg.data
    given = load_tokenizer(d.tokenizer_source[1]).sha256 if d.tokenizer_source else None
    key = {
        "version": VERSION,
        "mixture": True,
        "vocab_size": cfg.model.vocab_size,
        "tokenizer_model": given,
        "tokenizer_sample_docs": None if given else d.tokenizer_sample_docs,
        # the weights shape the tokenizer sample only
        "sources": [
            [r.spec.name, r.spec.source, r.fingerprint, None if given else r.spec.weight]
            for r in refs
        ],
        "val_fraction": d.val_fraction,
        "shard_tokens": d.shard_tokens,
        "split_rule": SPLIT_RULE,
        "sources_dir": str(sources_dir(d)),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------- tokenizer


def _tokenizer_sample(corpus: Corpus, n: int) -> list[str]:
    if corpus.docs is None:
        assert corpus.stream is not None
        field = corpus.text_field
        return [ex[field] for ex in corpus.stream.take(n) if isinstance(ex[field], str)]
    total = len(corpus.docs)
    if n < total:
        rng = np.random.default_rng(_SAMPLE_SEED)
        texts = corpus.docs.take(np.sort(rng.choice(total, size=n, replace=False)).tolist())
    else:
        texts = [t for batch in corpus.docs.texts(0, total, 4096) for t in batch]
    return [t for t in texts if isinstance(t, str)]


def _mixture_sample(corpora: list[Corpus], refs: list[SourceRef], n: int) -> list[str]:
    """About ``n`` documents in which each source's share of the text is its weight's share."""
    means = []
    for corpus in corpora:
        probe = _tokenizer_sample(corpus, 1000)
        means.append(max(1.0, sum(len(t.encode()) for t in probe) / max(1, len(probe))))
    shares = np.array([r.spec.weight / m for r, m in zip(refs, means, strict=True)])
    docs = []
    for corpus, ref, share in zip(corpora, refs, shares / shares.sum(), strict=True):
        want = max(1, round(n * share))
        if corpus.docs is not None:
            want = min(want, len(corpus.docs))
        part = _tokenizer_sample(corpus, want)
        mb = sum(len(t) for t in part) / 1e6
        print(
            f"prepare: tokenizer sample: {ref.spec.name}: {len(part)} documents ({mb:.1f} M chars)"
        )
        docs += part
    return docs


def _get_tokenizer(
    cfg: Config, corpora: list[Corpus], refs: list[SourceRef], work: Path
) -> AnyTokenizer:
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
    if len(corpora) == 1:
        docs = _tokenizer_sample(corpora[0], d.tokenizer_sample_docs)
    else:
        docs = _mixture_sample(corpora, refs, d.tokenizer_sample_docs)
    if not any(doc.strip() for doc in docs):
        what = (
            refs[0].spec.where + " " + corpora[0].description if len(refs) == 1 else "data.sources"
        )
        raise DataError(f"{what}: empty corpus (no text)")
    mb = sum(len(x) for x in docs) / 1e6
    print(
        f"prepare: training a {vocab}-piece BPE tokenizer on {len(docs)} documents ({mb:.1f} M chars)"
    )
    tok = train_tokenizer(docs, vocab, work, seed=_SAMPLE_SEED)
    print(f"prepare: tokenizer trained in {time.time() - t0:.1f}s (sha256 {tok.sha256[:12]})")
    return tok


# ----------------------------------------------------------------------------- the plan


def _make_plan(
    cfg: Config, refs: list[SourceRef], out: Path, key: str, top: Path, ranks: Ranks,
    opened: dict[int, Corpus], clock: PhaseClock,
) -> Plan:  # fmt: skip
    """Rank 0: the tokenizer (into ``top``) and the jobs, written as ``top/plan.json``."""
    d = cfg.data
    mixture = bool(d.sources)
    if mixture and d.tokenizer_source:
        needed: list[int] = []  # sources are opened only when their shard set is built
    else:
        needed = list(range(len(refs)))
    with clock.phase("read sources"):
        corpora = [open_corpus(refs, i, top, opened) for i in needed]
    for r in refs:
        print(f"prepare: source {f'{r.spec.name}: ' if mixture else ''}{r.description}")
    with clock.phase("tokenizer"):
        tok = _get_tokenizer(cfg, corpora, [refs[i] for i in needed], top)
    if tok.vocab_size > cfg.model.vocab_size:
        raise DataError(
            f"{tok.path}: tokenizer vocab size {tok.vocab_size} > model.vocab_size={cfg.model.vocab_size}"
        )
    num_proc = default_num_proc(d.num_proc, ranks)
    max_chunk_bytes = int(d.prepare_chunk_mb * 2**20)
    jobs = []
    for i, ref in enumerate(refs):
        if mixture:
            skey = source_set_key(ref.fingerprint, tok.sha256, d, SPLIT_RULE)
            final = source_set_dir(d, ref.spec.name, skey)
            todo = not is_complete(final, skey)
            job_dir = build_dir(final, skey)
        else:
            skey, final, todo, job_dir = key, out, True, top
        chunks = costs = None
        if todo and not ref.spec.streaming:
            with clock.phase("read sources"):
                corpus = open_corpus(refs, i, top, opened)
            with clock.phase("plan"):
                assert corpus.docs is not None
                sizes = corpus.docs.sizes(ref.spec.where)
            if not sizes.any():
                raise DataError(f"{ref.spec.where} {ref.description}: empty corpus (no text)")
            chunks = plan_chunks(sizes, max_chunk_bytes, ranks.world * num_proc)
            costs = chunk_bytes(sizes, chunks)
        jobs.append(Job(i, ref.spec.name, str(final), skey, str(job_dir), chunks, costs, todo))
        if not todo:
            print(f"prepare: source {ref.spec.name}: reusing {final}")
    plan = Plan(key, tok.sha256, jobs)
    plan.write(top)
    return plan


# ----------------------------------------------------------------------------- prepare


def _up_to_date(out: Path, key: str, mixture: bool, say: bool = True) -> bool:
    done = mixture_up_to_date(out, key) if mixture else is_complete(out, key)
    if say and not done and out.exists():
        print(f"prepare: rebuilding {out} (incomplete, or prepared with other settings)")
    return done


def prepare(cfg: Config, ranks: Ranks | None = None) -> Path:
    """Train or reuse the tokenizer and write the token shards to ``cfg.data.output_dir``.

    ``ranks`` defaults to the launcher's environment. Returns the output directory: on rank 0
    once it is complete, on the other ranks once their share is written. A complete set built
    from the same inputs is reused.
    """
    d: DataConfig = cfg.data
    ranks = ranks or Ranks.from_env()
    if not d.tokenizer_source:
        check_vocab_size(cfg.model.vocab_size)
    elif not Path(d.tokenizer_source[1]).exists():
        raise DataError(f"{d.tokenizer_source[0]}: {d.tokenizer_source[1]} does not exist")
    out = Path(d.output_dir).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    mixture = bool(d.sources)
    refs = [resolve_source(spec, cache_dir=out.parent) for spec in source_specs(d)]
    key = _mixture_key(cfg, refs) if mixture else _prepare_key(cfg, refs[0].fingerprint)
    if _up_to_date(out, key, mixture):
        print(f"prepare: {out} is up to date")
        return out
    t0 = time.time()
    top = build_dir(out, key)
    top.mkdir(parents=True, exist_ok=True)
    opened: dict[int, Corpus] = {}
    try:
        _build(cfg, refs, out, key, top, ranks, opened)
    except DataError as e:
        if ranks.is_main and not isinstance(e, RankStopped):
            shutil.rmtree(top, ignore_errors=True)  # bad input: nothing worth keeping
        raise
    if ranks.is_main:
        shutil.rmtree(top, ignore_errors=True)
        print(f"prepare: wrote {out} ({time.time() - t0:.1f}s)", file=sys.stdout, flush=True)
    return out


def _build(
    cfg: Config, refs: list[SourceRef], out: Path, key: str, top: Path, ranks: Ranks,
    opened: dict[int, Corpus],
) -> None:  # fmt: skip
    """Every rank's part of the prepare: plan (rank 0) or wait for it, tokenize, pack (rank 0);
    each rank prints the time of each phase."""
    clock = PhaseClock()
    with Heartbeat(top, ranks.rank):
        watch = Watch(top, cfg.parallel.timeout_minutes * 60)
        if ranks.is_main:
            for p in remove_stale_temp_dirs(out):
                print(f"prepare: removed stale temporary directory {p}")
            plan = Plan.read(top, key)
            if plan is not None:
                print(f"prepare: continuing the unfinished prepare in {top}")
            else:
                (top / PLAN_FILE).unlink(missing_ok=True)  # no rank may act on a stale plan
                plan = _make_plan(cfg, refs, out, key, top, ranks, opened, clock)
        else:
            mixture = bool(cfg.data.sources)
            with clock.phase("wait for the plan"):
                watch.until(
                    lambda: (
                        Plan.read(top, key) is not None or _up_to_date(out, key, mixture, False)
                    ),
                    [0],
                    f"{top}/plan.json",
                )
            plan = Plan.read(top, key)
            if plan is None:  # rank 0 finished it all (every chunk was there already)
                return
        with clock.phase("read sources"):
            for job in plan.jobs:
                if job.todo:
                    open_corpus(refs, job.source, top, opened)
        with clock.phase("tokenize"):
            chunks = tokenize_jobs(cfg, refs, plan, top, ranks, opened)
        if not ranks.is_main:
            print(
                f"prepare: rank {ranks.rank} of {ranks.world} wrote its chunks; rank 0 writes the "
                f"index (times: {clock})"
            )
            return
        with clock.phase("pack"):
            pack_jobs(cfg, refs, plan, chunks, out, top, ranks, watch)
        print(f"prepare: times of rank 0: {clock}")
