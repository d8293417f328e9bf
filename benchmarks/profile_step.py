"""Where a training step's time goes: moetrain's Trainer profiled op by op, grouped by role.

    .venv/bin/python benchmarks/profile_step.py                  # 2 ranks, EP=2, ZeRO-2
    .venv/bin/python benchmarks/profile_step.py --world 1 --ep 1 --steps 5
    .venv/bin/python benchmarks/profile_step.py --shape fine      # train_throughput's shapes
    .venv/bin/python benchmarks/profile_step.py --shape shared --set moe.shared_expert_overlap=false
    .venv/bin/python benchmarks/profile_step.py --family deepseek_v4

The shapes of ``benchmarks/train_throughput.py`` (default ``bench``: vocab 8192, d 256, 4 layers,
8 experts top-2, expert hidden 512, seq 256, micro-batch 4 per rank, fp32, one thread per rank,
gloo). Rank 0 runs ``--steps`` steps under ``torch.profiler`` after ``--warmup`` steps. Every
top-level op (forward ops, autograd backward nodes, the optimizer step) is put in one category
by its name; its CPU time includes its children. The 25 most expensive top-level ops are listed
too. The optimizer step (``engine.step``: ZeRO-2 gradient reduce-scatter, AdamW, parameter
all-gather) is timed as one block. Printed: ms per step and share of the profiled step time per
category; the rest is Python and framework overhead. ``--family``: the model of
``train_command.py --family`` instead (its saved source model, the same training keys).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # the repository: tests.helpers

# first match wins; matched against the top-level op name (backward nodes by their node name)
CATEGORIES = [
    ("optimizer step (ZeRO reduce + AdamW + gather)", r"^optimizer step$"),
    ("LM head + cross-entropy (chunked)", r"ChunkedLinearCrossEntropy|cross_entropy|NllLoss"),
    # the down projection's node also recomputes the SwiGLU product in backward
    ("expert GEMMs (grouped_mm, down projection)", r"(?i:grouped_?mm)|DownProjection"),
    ("expert all-to-all (incl. waiting for the peer)", r"AllToAll|all_to_all"),
    ("ZeRO gradient hooks (AccumulateGrad, bucket flatten)", r"AccumulateGrad|flatten_dense"),
    ("SwiGLU activation", r"SiluMul|silu|Silu"),
    (
        "routing, permutation, combine",
        r"GatherCopies|SumCopies|Permute|topk|Topk|argsort|sort|bincount|index_select|"
        r"IndexSelect|index_add|IndexAdd|softmax|Softmax|logsumexp|LogsumexpBackward|gather|"
        r"Gather",
    ),
    ("attention (SDPA)", r"scaled_dot_product|ScaledDotProduct|flash_attention"),
    ("dense GEMMs (qkvo, router, dense FFN)", r"linear|Linear|matmul|^aten::mm$|MmBackward|addmm"),
    ("RMSNorm, RoPE, residual, other elementwise", r"."),
]


def categorize(name: str) -> str:
    name = name.removeprefix("autograd::engine::evaluate_function: ")
    return next(cat for cat, pattern in CATEGORIES if re.search(pattern, name))


def family_trainer(ep: int, config: str, keys: list[str], overrides: list[str]):  # noqa: ANN201
    """moetrain's Trainer of a ``train_command.py --family`` model (``config`` and ``keys``:
    its ``family_overrides``) with the command's training keys and ``overrides``, set up as
    ``moetrain train`` sets up its process (the weights: its own init, not the source's)."""
    from train_throughput import LR, MICRO

    from moetrain.cli import load_config  # (the architecture from checkpoint.init_from)
    from moetrain.parallel.topology import init_distributed
    from moetrain.train.loop import set_up_process
    from moetrain.train.trainer import Trainer

    cfg = load_config(
        config,
        [
            *keys,
            f"parallel.ep_size={ep}",
            "parallel.zero_stage=2",
            f"train.micro_batch_size={MICRO}",
            "train.precision=fp32",
            f"optim.lr={LR}",
            "optim.grad_clip=1.0",
            "optim.warmup_steps=0",
            "optim.schedule=constant",
            "run_dir=runs/bench-unused",  # nothing is written there
            *overrides,
        ],
    )
    set_up_process(cfg)
    return Trainer(cfg, init_distributed(cfg))


def profile_job(
    rank: int,
    world: int,
    ep: int,
    shape: str,
    warmup: int,
    steps: int,
    overrides: list[str],
    family: tuple[str, list[str]] | None = None,
) -> dict | None:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from train_throughput import SHAPES, _batches, moetrain_trainer

    torch.set_num_threads(1)
    if family is None:
        trainer = moetrain_trainer(ep, overrides, SHAPES[shape])
    else:
        trainer = family_trainer(ep, *family, overrides)
    engine_step = trainer.engine.step

    def timed_engine_step(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with record_function("optimizer step"):
            return engine_step(*args, **kwargs)

    trainer.engine.step = timed_engine_step
    batches = _batches(rank, world, warmup + steps, SHAPES[shape])
    for batch in batches[:warmup]:
        trainer.train_step([batch])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in batches[warmup:]:
            with record_function("train step"):
                trainer.train_step([batch])
    if rank != 0:
        return None
    events = prof.events()
    roots = [e for e in events if e.name == "train step"]
    total_us = sum(e.cpu_time_total for e in roots)
    by_cat: dict[str, float] = defaultdict(float)
    by_op: dict[tuple[str, str], float] = defaultdict(float)
    for e in events:
        parent = e.cpu_parent
        if parent is not None and parent.name == "train step" and e.name != "train step":
            by_cat[categorize(e.name)] += e.cpu_time_total
            by_op[categorize(e.name), e.name] += e.cpu_time_total
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:25]
    return {"total_us": total_us, "by_category_us": dict(by_cat), "steps": steps, "top": top}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--shape", default="bench", help="a shape of train_throughput.py")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override")
    ap.add_argument("--family", help="a train_command.py --family model instead of --shape's")
    args = ap.parse_args()
    from tests.helpers.distributed import run_distributed

    family = None
    if args.family:
        from train_command import family_overrides
        from train_throughput import SHAPES

        config, keys = family_overrides(args.family, SHAPES[args.shape]["seq"])  # (saves it)
        family = (str(config), keys)

    res = run_distributed(
        profile_job,
        args.world,
        args.ep,
        args.shape,
        args.warmup,
        args.steps,
        args.set,
        family,
        timeout=1800.0,
    )[0]
    n, total = res["steps"], res["total_us"]
    print(f"\nworld {args.world}, EP {args.ep}: {total / n / 1e3:.0f} ms per step (rank 0, CPU)\n")
    print("| category | ms / step | share |")
    print("|---|---:|---:|")
    cats = sorted(res["by_category_us"].items(), key=lambda kv: -kv[1])
    for cat, us in cats:
        print(f"| {cat} | {us / n / 1e3:.1f} | {100 * us / total:.1f}% |")
    print("\ntop ops (category, name, ms / step):")
    for (cat, name), us in res["top"]:
        print(f"  {us / n / 1e3:8.1f}  {cat[:24]:24s}  {name}")
    rest = total - sum(res["by_category_us"].values())
    print(
        f"| Python / framework (not inside an op) | {rest / n / 1e3:.1f} | {100 * rest / total:.1f}% |"
    )


if __name__ == "__main__":
    main()
