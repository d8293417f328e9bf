"""Building shard sets with any number of ranks: the shared plan, and the packer of rank 0.

A prepare works in a build directory beside its output, named by the prepare's key
(``.<output>.build-<key>``), on the filesystem every rank sees. Rank 0 writes the tokenizer and
then ``plan.json`` there (which shard sets to build, and each one's chunks); the other ranks wait
for the plan, then every rank tokenizes its chunks (:mod:`moetrain.data.chunks`) into the build
directory of each shard set. Rank 0 packs each shard set from the chunks in document order into a
fresh temporary directory, writes its ``index.json`` and installs it with one rename
(:func:`moetrain.fileio.building_dir`); only then is the build directory removed. Until
that rename nothing looks like a finished shard set, and a rerun finds the plan, the tokenizer
and every finished chunk where the killed run left them.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from moetrain.config import Config, DataConfig
from moetrain.data.chunks import (
    SPLIT_RULE,
    chunk_done,
    chunk_owners,
    parts_dir,
    read_chunk,
    tokenize_chunks,
)
from moetrain.data.errors import DataError
from moetrain.data.ranks import Ranks, Watch, default_num_proc
from moetrain.data.shards import (
    FORMAT,
    VERSION,
    ShardWriter,
    read_index,
    token_dtype,
    write_index,
)
from moetrain.data.source_sets import relative_dir, write_mixture_index
from moetrain.data.sources import Corpus, SourceRef, open_source
from moetrain.data.tokenizer import (
    HF_DIR,
    META_FILE,
    MODEL_FILE,
    load_tokenizer,
    prepared_tokenizer_file,
)
from moetrain.fileio import building_dir, file_sha256, write_json_atomic

PLAN_FILE = "plan.json"
_PLAN_FORMAT = "moetrain-prepare-plan-2"


def build_dir(final: Path, key: str) -> Path:
    """The build directory of ``final`` for a prepare with ``key`` (beside it, hidden)."""
    return final.parent / f".{final.name}.build-{key[:16]}"


@dataclass
class Job:
    """One source's shard set: where it goes, its key, and its chunks with their bytes (None:
    streamed)."""

    source: int  # index into the prepare's sources
    name: str
    final: str
    key: str
    build: str
    chunks: list[tuple[int, int]] | None
    chunk_bytes: list[int] | None
    todo: bool = True  # False: a finished shard set of this key exists and is reused

    def owners(self, count: int, world: int) -> list[int]:
        """The rank that tokenizes each of the job's ``count`` chunks."""
        if self.chunk_bytes is None:  # streamed: dealt in turn as they are read
            return [c % world for c in range(count)]
        return chunk_owners(self.chunk_bytes, world)


@dataclass
class Plan:
    """What rank 0 decided for every rank: the tokenizer and the jobs."""

    key: str
    tokenizer_sha256: str
    jobs: list[Job]

    def write(self, top: Path) -> None:
        data = {"format": _PLAN_FORMAT, **asdict(self)}
        write_json_atomic(top / PLAN_FILE, data, sort_keys=False)

    @classmethod
    def read(cls, top: Path, key: str) -> Plan | None:
        """The plan in ``top`` for ``key`` whose tokenizer is still there, else None."""
        path = top / PLAN_FILE
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if data.get("format") != _PLAN_FORMAT or data.get("key") != key:
            return None
        ident = prepared_tokenizer_file(top)
        if not ident.is_file() or file_sha256(ident) != data.get("tokenizer_sha256"):
            return None
        jobs = [
            Job(**{**j, "chunks": None if j["chunks"] is None else [tuple(c) for c in j["chunks"]]})
            for j in data["jobs"]
        ]
        return cls(key, data["tokenizer_sha256"], jobs)


def copy_prepared_tokenizer(src_dir: Path, dst_dir: Path) -> None:
    """The tokenizer files ``prepare`` keeps in ``src_dir``, into ``dst_dir``."""
    for name in (MODEL_FILE, META_FILE):
        if (src_dir / name).is_file():
            shutil.copyfile(src_dir / name, dst_dir / name)
    if (src_dir / HF_DIR).is_dir():
        shutil.copytree(src_dir / HF_DIR, dst_dir / HF_DIR)


def pack(
    job: Job,
    chunks: list[tuple[int, int]],
    parts: Path,
    *,
    dtype: np.dtype,
    shard_tokens: int,
    owners: list[int],
    watch: Watch,
    tokenizer_dir: Path,
    index: dict[str, Any],
    where: str,
) -> dict[str, Any]:
    """Write ``job``'s shard set from its chunks (waiting for other ranks' chunks) and install
    it at ``job.final``; ``index`` is its ``index.json`` without the splits; chunk ``c`` of
    ``chunks`` comes from rank ``owners[c]``. Returns the splits."""
    with building_dir(job.final, replace=True) as tmp:
        copy_prepared_tokenizer(tokenizer_dir, tmp)
        writers = {s: ShardWriter(tmp, s, dtype, shard_tokens) for s in ("train", "val")}
        for c, (lo, hi) in enumerate(chunks):
            owner = owners[c]
            if owner == 0 and not chunk_done(parts, lo, hi, dtype):
                raise DataError(f"{parts}: chunk [{lo}, {hi}) of {job.name} is missing")
            watch.until(
                lambda lo=lo, hi=hi: chunk_done(parts, lo, hi, dtype),
                [owner] if owner else [],
                f"documents [{lo}, {hi}) of {job.name} from rank {owner}",
            )
            tokens, lengths, is_val = read_chunk(parts, lo, hi, dtype)
            token_val = np.repeat(is_val, lengths)
            writers["train"].add(tokens[~token_val], lengths[~is_val])
            writers["val"].add(tokens[token_val], lengths[is_val])
        splits = {s: w.finish() for s, w in writers.items()}
        train, val = splits["train"], splits["val"]
        if train["num_tokens"] + val["num_tokens"] == 0:
            raise DataError(f"{where} {index['source']['description']}: empty corpus (no text)")
        if train["num_tokens"] == 0:
            raise DataError(
                f"{where} {index['source']['description']}: too few documents "
                f"({val['num_docs']}) for a train/validation split; set data.val_fraction=0"
            )
        write_index(tmp, {**index, "splits": splits})
    return splits


def open_corpus(refs: list[SourceRef], i: int, top: Path, opened: dict[int, Corpus]) -> Corpus:
    if i not in opened:
        opened[i] = open_source(refs[i], top / "read-cache" / str(i))
    return opened[i]


def tokenize_jobs(
    cfg: Config, refs: list[SourceRef], plan: Plan, top: Path, ranks: Ranks,
    opened: dict[int, Corpus],
) -> dict[int, list[tuple[int, int]]]:  # fmt: skip
    """This rank's chunks of every job; -> job source index -> every chunk of that job."""
    d = cfg.data
    num_proc = default_num_proc(d.num_proc, ranks)
    dtype = token_dtype(cfg.model.vocab_size)
    chunks = {}
    for job in plan.jobs:
        if not job.todo:
            continue
        corpus = open_corpus(refs, job.source, top, opened)
        total = len(job.chunks) if job.chunks is not None else None
        with tqdm(total=total, desc=f"tokenize {job.name} ({num_proc} proc)", unit="chunk",
                  disable=not ranks.is_main) as bar:  # fmt: skip
            chunks[job.source] = tokenize_chunks(
                corpus,
                job.chunks,
                parts_dir(Path(job.build), plan.tokenizer_sha256),
                costs=job.chunk_bytes,
                tokenizer_path=prepared_tokenizer_file(top),
                dtype=dtype,
                val_fraction=d.val_fraction,
                rank=ranks.rank,
                world=ranks.world,
                num_proc=num_proc,
                chunk_bytes=int(d.prepare_chunk_mb * 2**20),
                done=bar.update,
            )
    return chunks


def pack_jobs(
    cfg: Config, refs: list[SourceRef], plan: Plan, chunks: dict[int, list[tuple[int, int]]], out: Path,
    top: Path, ranks: Ranks, watch: Watch,
) -> None:  # fmt: skip
    """Rank 0: every job's shard set, then (for a mixture) ``mixture.json`` and the tokenizer."""
    d = cfg.data
    dtype = token_dtype(cfg.model.vocab_size)
    ident = prepared_tokenizer_file(top)
    tok = load_tokenizer(ident).metadata() | {"file": ident.relative_to(top).as_posix()}
    entries = []
    for job in plan.jobs:
        ref = refs[job.source]
        if job.todo:
            splits = pack(
                job,
                chunks[job.source],
                parts_dir(Path(job.build), plan.tokenizer_sha256),
                dtype=dtype,
                shard_tokens=d.shard_tokens,
                owners=job.owners(len(chunks[job.source]), ranks.world),
                watch=watch,
                tokenizer_dir=top,
                index=index_fields(ref, tok, job.key, d, dtype),
                where=ref.spec.where,
            )
            if Path(job.build) != top:
                shutil.rmtree(job.build, ignore_errors=True)
        else:
            splits = read_index(job.final)["splits"]
        tr, va = splits["train"], splits["val"]
        print(
            f"prepare: {job.name}: train {tr['num_tokens']:,} tokens / {tr['num_docs']:,} docs in "
            f"{len(tr.get('shards', [])) or '-'} shard(s), val {va['num_tokens']:,} tokens / "
            f"{va['num_docs']:,} docs ({job.final})"
        )
        brief = {
            s: {"num_tokens": v["num_tokens"], "num_docs": v["num_docs"]} for s, v in splits.items()
        }
        entries.append(
            {
                "name": job.name,
                "spec": ref.spec.source,
                "weight": ref.spec.weight,
                "fingerprint": ref.fingerprint,
                "dir": relative_dir(Path(job.final), out),
                "prepare_key": job.key,
                "splits": brief,
            }
        )
    if d.sources:
        with building_dir(out, replace=True) as tmp:
            copy_prepared_tokenizer(top, tmp)
            write_mixture_index(tmp, plan.key, tok, entries)


def index_fields(ref: SourceRef, tok: dict, key: str, d: DataConfig, dtype: np.dtype) -> dict:
    source = {
        "spec": ref.spec.source,
        "description": ref.description,
        "fingerprint": ref.fingerprint,
    }
    return {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype.name,
        "tokenizer": tok,
        "source": source | ({"name": ref.spec.name} if d.sources else {}),
        "prepare_key": key,
        "split_rule": SPLIT_RULE,
        "val_fraction": d.val_fraction,
        "eos_appended": True,
    }
