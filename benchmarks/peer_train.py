"""The peer of ``benchmarks/train_command.py``: Hugging Face MixtralForCausalLM (Qwen2-MoE for
the ``shared`` shape, DeepseekV3ForCausalLM for ``deepseek_v3``, GptOssForCausalLM for
``gpt_oss``; with ``--hf-dir`` the saved model in its own class) trained through DeepSpeed
ZeRO-2 on moetrain's prepared token shards, as one training script started by a launcher (one
process per rank, as ``moetrain train`` is).

    deepspeed --num_gpus 2 benchmarks/peer_train.py --data DIR --steps 20 [--shape bench]

The same shape, optimizer, clipping, micro-batch and data as the moetrain side; ZeRO-2 with
DeepSpeed's default buckets, or moetrain's CPU bucket size with ``--cpu-buckets``. Prints one
JSON line with the median step time of the steps after the first two, the first step's
cross-entropy (the mean over ranks, less the balancing loss) and every step's start and end
(``step_wall``: wall-clock seconds, ``time.time()``, as moetrain's metrics.jsonl records them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_throughput's model builder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a moetrain-prepared data directory")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--shape", default="bench")
    ap.add_argument("--cpu-buckets", action="store_true")
    ap.add_argument("--hf-dir", help="a saved model to start from (its family's class)")
    ap.add_argument("--local_rank", type=int, default=0)  # passed by the deepspeed launcher
    args = ap.parse_args()

    import deepspeed
    import torch
    import torch.distributed as dist
    from train_throughput import LR, MICRO, SHAPES, _hf_model, peer_ds_config, peer_family

    from moetrain.config import DataConfig
    from moetrain.data.splits import build_loader

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = SHAPES[args.shape]
    torch.manual_seed(0)
    if args.hf_dir:
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(
                args.hf_dir, dtype=torch.float32, attn_implementation="sdpa"
            )
        except ValueError:  # a class without an SDPA path (DeepSeek-V4): its eager attention
            model = AutoModelForCausalLM.from_pretrained(
                args.hf_dir, dtype=torch.float32, attn_implementation="eager"
            )
    else:
        model = _hf_model(peer_family(shape), False, shape)
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1, fused=True
    )
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=opt, config=peer_ds_config(args.cpu_buckets)
    )
    data = DataConfig(output_dir=args.data, seq_len=shape["seq"])
    loader = iter(build_loader(data, "train", MICRO, rank, world, 1234))
    times, walls, first_ce = [], [], None
    for _ in range(args.steps):
        wall0, t0 = time.time(), time.perf_counter()
        batch = next(loader)
        # the loader's targets, as moetrain trains on them: the next token at each of the
        # seq_len positions (labels=input_ids would let transformers drop the last one)
        labels = batch["labels"]
        out = engine(input_ids=batch["input_ids"], labels=labels, shift_labels=labels)
        engine.backward(out.loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        walls.append([wall0, time.time()])
        if first_ce is None:
            first_ce = mean_over_ranks(cross_entropy(model, out))
    if rank == 0:
        tail = times[2:] or times
        row = {
            "step_s": statistics.median(tail),
            "loss": float(out.loss),
            "first_ce": first_ce,
            "step_wall": walls,
        }
        print(json.dumps(row), flush=True)
    dist.barrier()


def cross_entropy(model, out) -> float:
    """The step's cross-entropy: transformers' loss less the balancing loss it adds."""
    aux = getattr(out, "aux_loss", None)
    coef = getattr(model.config, "router_aux_loss_coef", 0.0)
    return float(out.loss) - (coef * float(aux) if aux is not None else 0.0)


def mean_over_ranks(value: float) -> float:
    """``value``'s mean over the ranks (each holds the same number of tokens), as moetrain
    logs its losses."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


if __name__ == "__main__":
    main()
