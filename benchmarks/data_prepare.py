"""Prepare throughput on the builtin corpus: num_proc=1 vs num_proc=2 vs a plain loop.

    .venv/bin/python benchmarks/data_prepare.py [--work DIR]

All three do the same work with the same trained tokenizer (vocab 4096, configs/tiny-cpu.yaml):
every document encoded, EOS appended, tokens written as uint16. ``prepare`` runs are timed end
to end (reading the corpus, datasets.map, shard writing, fsync, rename), so they include the
overheads the plain loop does not have. Also reports the first full prepare of tiny-cpu.yaml
(builtin corpus build + tokenizer training + shards), the README's first step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import sentencepiece as spm

from moetrain.config import load_config
from moetrain.data import prepare, read_index
from moetrain.data.builtin import builtin_cache_path
from moetrain.data.prepare import _Encoder
from moetrain.data.sources import load_corpus

REPO = Path(__file__).resolve().parents[1]


def timed_prepare(work: Path, name: str, overrides: list[str]) -> tuple[float, int]:
    cfg = load_config(
        REPO / "configs/tiny-cpu.yaml", [f"data.output_dir={work / name}", *overrides]
    )
    t0 = time.perf_counter()
    out = prepare(cfg)
    dt = time.perf_counter() - t0
    index = read_index(out)
    return dt, index["splits"]["train"]["num_tokens"] + index["splits"]["val"]["num_tokens"]


def cpu_seconds() -> float:
    ru = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(r.ru_utime + r.ru_stime for r in ru)


def map_only(work: Path, model: Path, num_proc: int) -> tuple[float, float, int]:
    """Just the datasets.map(batched=True, num_proc) tokenize step, as prepare runs it."""
    cfg = load_config(REPO / "configs/tiny-cpu.yaml", [f"data.output_dir={work / 'x'}"])
    corpus = load_corpus(cfg.data, cache_dir=work, work_dir=work / f"map{num_proc}")
    enc = _Encoder(str(model), corpus.text_field, 0.01)
    c0, t0 = cpu_seconds(), time.perf_counter()
    out = corpus.dataset.map(
        enc,
        batched=True,
        batch_size=128,
        with_indices=True,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=corpus.dataset.column_names,
        cache_file_name=str(work / f"map{num_proc}" / "t.arrow"),
    )
    dt, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    n = sum(len(x) for x in out.with_format("arrow")["ids"].to_pylist())
    return dt, cpu, n


def plain_loop(corpus: Path, model: Path, out: Path) -> tuple[float, int]:
    t0 = time.perf_counter()
    sp = spm.SentencePieceProcessor(model_file=str(model))
    eos = sp.eos_id()
    n = 0
    with open(corpus) as f, open(out, "wb") as w:
        for line in f:
            ids = sp.encode(json.loads(line)["text"])
            ids.append(eos)
            w.write(np.asarray(ids, dtype=np.uint16).tobytes())
            n += len(ids)
    return time.perf_counter() - t0, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"cpus={os.cpu_count()} loadavg={os.getloadavg()} work={work}")

    cache = builtin_cache_path(work)
    had_cache = cache.is_file()
    dt, n = timed_prepare(work, "full", [])
    print(
        f"RESULT first prepare of tiny-cpu.yaml (corpus cached before: {had_cache}): {dt:.1f}s, {n:,} tokens"
    )
    model = work / "full" / "tokenizer.model"
    results = {}
    for k in (1, 2):
        c0 = cpu_seconds()
        dt, n = timed_prepare(
            work, f"np{k}", [f"data.tokenizer_model={model}", f"data.num_proc={k}"]
        )
        results[k] = n / dt
        cpu = cpu_seconds() - c0
        print(
            f"RESULT prepare num_proc={k}: {dt:.2f}s wall, {cpu:.2f}s CPU, {n:,} tokens, {n / dt:,.0f} tokens/s"
        )
    for k in (1, 2):
        dt, cpu, n = map_only(work, model, k)
        results[f"map{k}"] = n / dt
        print(
            f"RESULT datasets.map tokenize only, num_proc={k}: {dt:.2f}s wall, {cpu:.2f}s CPU, {n / dt:,.0f} tokens/s"
        )
    print(
        f"RESULT speed-up of the map step, num_proc 2 vs 1: {results['map2'] / results['map1']:.2f}x"
    )
    c0 = cpu_seconds()
    dt, n = plain_loop(cache, model, work / "plain.bin")
    print(f"  (plain loop CPU {cpu_seconds() - c0:.2f}s)")
    print(
        f"RESULT plain sentencepiece loop (1 process): {dt:.2f}s, {n:,} tokens, {n / dt:,.0f} tokens/s"
    )
    print(
        f"RESULT speed-up num_proc 2 vs 1: {results[2] / results[1]:.2f}x; num_proc=1 vs plain: {results[1] / (n / dt):.2f}x"
    )
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
