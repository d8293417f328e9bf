"""Loader throughput and memory.

    .venv/bin/python benchmarks/loader.py [--data data/stdlib-4k]
    .venv/bin/python benchmarks/loader.py --blend [--rounds 7]

1. tokens/s of ``build_loader`` on the prepared tiny-cpu shards (micro-batch 8, seq 128, rank 0
   of 2, with and without document masks), next to the tokens/s the tiny model consumes in a
   forward+backward+AdamW step on this machine (one rank, all threads);
2. resident memory while reading synthetic uint16 shard sets of growing size (the same number
   of random batches from each): anonymous RSS must not grow with the corpus size; file-backed
   RSS is the memmapped pages touched (reclaimable page cache), bounded by what was read.

``--blend`` instead: tokens/s of a three-source blend (``data.sources``: the builtin corpus cut
into three files, weights 0.6 / 0.3 / 0.1, one tokenizer) against the whole corpus as one source,
same micro-batch, rank 0 of 2; interleaved rounds, the ratio is the median of the per-round
ratios, by the wall clock and by the process's CPU time (steadier on a shared machine).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from moetrain.config import load_config
from moetrain.data import build_loader
from moetrain.data.loader import PackedLoader
from moetrain.data.prepare import prepare
from moetrain.data.shards import FORMAT, VERSION, ShardWriter, write_index

REPO = Path(__file__).resolve().parents[1]


def rss_kb() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmRSS"):
            out[key] = int(val.split()[0])
    return out


def loader_rate(ld, batches: int) -> float:
    return loader_rates(ld, batches)[0]


def loader_rates(ld, batches: int) -> tuple[float, float]:
    """tokens/s by the wall clock and by this process's CPU time (the loader is one thread,
    so the second hardly moves when other jobs share the cores)."""
    next(ld)
    t0, c0 = time.perf_counter(), time.process_time()
    n = sum(next(ld)["input_ids"].numel() for _ in range(batches))
    return n / (time.perf_counter() - t0), n / (time.process_time() - c0)


def model_rate(cfg, steps: int = 5) -> float:
    try:
        from moetrain.model.transformer import Transformer
    except ImportError as e:  # model code not present
        print(f"  (model not importable: {e})")
        return float("nan")
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    b, s = cfg.train.micro_batch_size, cfg.data.seq_len
    x = torch.randint(0, cfg.model.vocab_size, (b, s + 1))
    for i in range(steps + 1):
        if i == 1:
            t0 = time.perf_counter()
        out = model(x[:, :-1], labels_BS=x[:, 1:])
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    return steps * b * s / (time.perf_counter() - t0)


def synthetic_set(path: Path, num_tokens: int) -> PackedLoader:
    path.mkdir(parents=True)
    rng = np.random.default_rng(0)
    w = ShardWriter(path, "train", np.dtype(np.uint16), 50_000_000)
    chunk = 10_000_000
    for start in range(0, num_tokens, chunk):
        n = min(chunk, num_tokens - start)
        toks = rng.integers(4, 4096, n, dtype=np.uint16)
        w.add(toks, np.full(n // 500, 500))
    index = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": "uint16",
        "tokenizer": {"sha256": "0", "vocab_size": 4096, "special_ids": {"eos": 3}},
        "splits": {"train": w.finish()},
    }
    write_index(path, index)
    return PackedLoader(path, index, "train", 128, 8, 0, 2, 1234)


def blend_vs_single(work: Path, rounds: int, batches: int) -> None:
    import json
    import statistics

    from moetrain.data.builtin import ensure_builtin_corpus

    single = load_config(REPO / "configs/tiny-cpu.yaml", [f"data.output_dir={work / 'single'}"])
    prepare(single)
    docs = ensure_builtin_corpus(work).read_text().splitlines()
    sources = []
    for i, (name, w) in enumerate((("a", 0.6), ("b", 0.3), ("c", 0.1))):
        path = work / f"{name}.jsonl"
        path.write_text("\n".join(docs[i::3]) + "\n")
        sources.append({"source": str(path), "weight": w})
    tok = work / "single" / "tokenizer.model"
    mixed = load_config(
        REPO / "configs/tiny-cpu.yaml",
        [f"data.output_dir={work / 'mixed'}", f"data.sources={json.dumps(sources)}",
         f"data.tokenizer_model={tok}"],
    )  # fmt: skip
    prepare(mixed)
    rates: dict[str, list[float]] = {"single": [], "blend": []}
    cpu: dict[str, list[float]] = {"single": [], "blend": []}
    for r in range(rounds):
        for name, cfg in (("single", single), ("blend", mixed)):
            ld = build_loader(cfg.data, "train", 8, 0, 2, cfg.seed, vocab_size=cfg.model.vocab_size)
            wall, by_cpu = loader_rates(ld, batches)
            rates[name].append(wall)
            cpu[name].append(by_cpu)
        print(
            f"round {r}: single {rates['single'][-1]:,.0f}, blend {rates['blend'][-1]:,.0f} tokens/s"
            f" (by CPU time {cpu['single'][-1]:,.0f}, {cpu['blend'][-1]:,.0f})",
            flush=True,
        )
    for label, got in (("wall clock", rates), ("CPU time", cpu)):
        pairs = [b / s for b, s in zip(got["blend"], got["single"], strict=True)]
        print(
            f"RESULT loader by {label}, 3-source blend: median {statistics.median(got['blend']):,.0f} tokens/s; "
            f"one source: {statistics.median(got['single']):,.0f} tokens/s"
        )
        print(
            f"RESULT blend / single by {label}: median of paired rounds {statistics.median(pairs):.2f}x "
            f"(range {min(pairs):.2f}-{max(pairs):.2f}x)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--data", default=None, help="prepared output_dir (default: prepare into a temp dir)"
    )
    ap.add_argument("--batches", type=int, default=3000)
    ap.add_argument(
        "--sizes", default="10,100,400", help="synthetic corpus sizes, millions of tokens"
    )
    ap.add_argument("--blend", action="store_true", help="3-source blend vs one source")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-loader-"))
    if args.blend:
        print(f"loadavg={os.getloadavg()}")
        blend_vs_single(tmp, args.rounds, args.batches)
        print(f"loadavg at the end={os.getloadavg()}")
        shutil.rmtree(tmp, ignore_errors=True)
        return
    over = [f"data.output_dir={args.data or tmp / 'stdlib-4k'}"]
    cfg = load_config(REPO / "configs/tiny-cpu.yaml", over)
    if args.data is None:
        prepare(cfg)
    print(f"threads={torch.get_num_threads()}")
    for mask in (False, True):
        cfg.data.document_mask = mask
        ld = build_loader(cfg.data, "train", 8, 0, 2, cfg.seed, vocab_size=cfg.model.vocab_size)
        print(
            f"RESULT loader document_mask={mask}: {loader_rate(ld, args.batches):,.0f} tokens/s (mb 8 x seq 128)"
        )
    rate = model_rate(cfg)
    print(f"RESULT tiny model fwd+bwd+AdamW, 1 rank: {rate:,.0f} tokens/s")

    base = rss_kb()
    for m in (int(x) for x in args.sizes.split(",")):
        ld = synthetic_set(tmp / f"syn{m}", m * 1_000_000)
        before = rss_kb()
        rate = loader_rate(ld, args.batches)
        after = rss_kb()
        print(
            f"RESULT corpus {m:>4}M tokens ({m * 2} MB on disk): {rate:,.0f} tokens/s, "
            f"RssAnon {after['RssAnon'] / 1024:.1f} MB (+{(after['RssAnon'] - base['RssAnon']) / 1024:.1f} since start), "
            f"RssFile +{(after['RssFile'] - before['RssFile']) / 1024:.1f} MB while reading"
        )
        del ld
        shutil.rmtree(tmp / f"syn{m}")
    print(f"max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
