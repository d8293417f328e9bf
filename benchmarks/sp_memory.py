"""Sequence parallelism at a long sequence: peak memory per rank and tokens/s, sp=1 vs sp=2 at
the same global batch, against `moetrain plan`.

One row of S=16384 tokens per step (packed documents of 512 tokens, ``data.document_mask``),
fp32, ZeRO-2, the `tiny-cpu` width made deeper (d 256, 8 layers, 4 heads / 2 KV heads, 8 experts
top-2 of hidden 512, vocab 4096, chunked loss): sp=1 on one rank against sp=2 on two ranks
(each holds 8192 tokens of the row). Each rank builds the real Trainer (DeepSpeed engine) under
torchrun, then trains ``--steps`` steps on the same synthetic batches. Per rank:

- peak RSS: the process's VmHWM (what a user sees);
- training memory: VmHWM minus the resident set just before the Trainer is built (the peak
  reset through /proc/self/clear_refs), against ``plan``'s total less its GPU framework
  allowance (CUDA context, which a CPU run has not);
- tokens/s: the global batch's tokens over the median step time after the first.

glibc returns freed blocks at once (``benchmarks/rank_memory.py``), so the resident set
follows the live tensors. Memory does not depend on the machine's load; time does. On CPU both
layouts share the same two cores, so tokens/s shows SP's overhead, not a GPU's gain (the
attention of each rank runs on half the heads of twice the tokens).

    .venv/bin/python benchmarks/sp_memory.py [--seq 16384] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rank_memory import ROOT, reset_peak, run_ranks, status, write_result  # noqa: E402

SHAPE = [
    "model.vocab_size=4096",
    "model.d_model=256",
    "model.n_layers=8",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "moe.num_experts=8",
    "moe.top_k=2",
    "moe.expert_hidden=512",
    "parallel.ep_size=1",
    "parallel.zero_stage=2",
    "train.precision=fp32",
    "train.micro_batch_size=1",
    "data.document_mask=true",
    "logging.wandb.mode=disabled",
]
DOC = 512


def _config(seq: int, sp: int):
    from moetrain.config import config_from_dict, read_config_data

    extra = [f"data.seq_len={seq}", f"model.max_seq_len={seq}", f"parallel.sp_size={sp}"]
    return config_from_dict(read_config_data(ROOT / "configs" / "tiny-cpu.yaml", [*SHAPE, *extra]))


def _batch(seq: int, step: int, vocab: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, vocab, (1, seq + 1), generator=g)
    docs = (torch.arange(seq) // DOC).unsqueeze(0)
    return {
        "input_ids": ids[:, :-1].contiguous(),
        "labels": ids[:, 1:].contiguous(),
        "doc_ids": docs,
    }


def worker(args: argparse.Namespace) -> None:
    import torch

    from moetrain.parallel.topology import init_distributed
    from moetrain.plan import FRAMEWORK_BYTES, plan
    from moetrain.train.trainer import Trainer

    torch.set_num_threads(1)
    cfg = _config(args.seq, args.sp)
    topo = init_distributed(cfg)
    base = reset_peak()
    trainer = Trainer(cfg, topo)
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        trainer.train_step([_batch(args.seq, step, cfg.model.vocab_size)])
        times.append(time.perf_counter() - t0)
    predicted = plan(cfg, gpus=topo.world_size, activation_checkpointing=False)
    out = {
        "rank": topo.rank,
        "peak_rss": status("VmHWM"),
        "growth": status("VmHWM") - base,
        "base": base,
        "plan": predicted.total_bytes - FRAMEWORK_BYTES,
        "plan_activations": predicted.activations_bytes,
        "tokens_per_s": args.seq / statistics.median(times[1:] or times),
    }
    write_result(args.out, topo.rank, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    for p in (ap, w):
        p.add_argument("--seq", type=int, default=16384)
        p.add_argument("--steps", type=int, default=3)
    w.add_argument("--sp", type=int, required=True)
    w.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.cmd == "worker":
        worker(args)
        return
    runs = {
        sp: run_ranks(__file__, sp, [f"--seq={args.seq}", f"--sp={sp}", f"--steps={args.steps}"])
        for sp in (1, 2)
    }
    mib = 2**20
    print(f"S={args.seq}, one row per step, {args.steps} steps")
    print(
        "| sp | rank | peak RSS | training memory | plan (less GPU framework) | plan / measured | tokens/s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for sp, ranks in runs.items():
        for r in ranks:
            print(
                f"| {sp} | {r['rank']} | {r['peak_rss'] / mib:,.0f} MiB | {r['growth'] / mib:,.0f} MiB "
                f"| {r['plan'] / mib:,.0f} MiB | {r['plan'] / r['growth']:.2f}x | {r['tokens_per_s']:,.0f} |"
            )
    one = runs[1][0]
    two = max(runs[2], key=lambda r: r["peak_rss"])
    print(
        f"sp2 / sp1: peak RSS per rank {two['peak_rss'] / one['peak_rss']:.2f}x, training memory "
        f"{two['growth'] / one['growth']:.2f}x, tokens/s "
        f"{min(r['tokens_per_s'] for r in runs[2]) / one['tokens_per_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
