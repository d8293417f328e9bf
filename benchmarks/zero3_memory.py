"""ZeRO-3 against ZeRO-1 and ZeRO-2 on 4 CPU ranks at a shape where the dense weights dominate:
each rank's model state counted tensor by tensor against `moetrain plan`, peak RSS per rank,
tokens/s.

Shape: vocab 32768, d 512, 4 layers, 4 experts of hidden 256 at EP 2 (the embedding and head
hold most of the weights), fp32, one 256-token row per rank per step. Each rank builds the real
Trainer under torchrun and trains ``--steps`` steps on the same synthetic batches. Per rank:

- model state: the weights it holds (at ZeRO-3 its partitions), its fp32 master partitions and
  AdamW's moments, counted before the last step, and the most gradient memory it held at once
  (``tests/helpers/zero_state.py``: at ZeRO-1/2 sampled wherever DeepSpeed copies a gradient
  into its partition buffer; the reduce bucket apart; autograd's gradients counted where they
  are held, at ZeRO-1 until its reduce, and reported apart where they are in flight to their
  reduce, against ``plan``'s fresh-gradient term), against ``plan``'s weights + gradients +
  optimizer states (at ZeRO-3 the partitions; ``plan``'s gathered working set is reported
  beside it). ``parallel.zero3_persistence_elements=0``: every weight is partitioned, as
  ``plan`` assumes; ``parallel.overlap_comm=false`` and ``parallel.bucket_elements=2000000``, CPU's defaults,
  said so that ``plan`` (which takes a GPU's otherwise) models the same reduce;
- peak RSS (VmHWM) and training memory (VmHWM minus the resident set before the Trainer, the
  peak reset through /proc/self/clear_refs);
- tokens/s: the global batch's tokens over the median step time after the first (all four
  ranks share the machine's cores: the ratio is what carries over, not the number).

    .venv/bin/python benchmarks/zero3_memory.py [--steps 4] [--stages 1 2 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rank_memory import ROOT, reset_peak, run_ranks, status, write_result  # noqa: E402

WORLD, SEQ = 4, 256
SHAPE = [
    "model.vocab_size=32768",
    "model.d_model=512",
    "model.n_layers=4",
    "model.n_heads=8",
    "model.n_kv_heads=8",
    "moe.num_experts=4",
    "moe.top_k=2",
    "moe.expert_hidden=256",
    "parallel.ep_size=2",
    "parallel.zero3_persistence_elements=0",
    "parallel.overlap_comm=false",
    "parallel.bucket_elements=2000000",
    "train.precision=fp32",
    "train.micro_batch_size=1",
    f"data.seq_len={SEQ}",
    f"model.max_seq_len={SEQ}",
    "logging.wandb.mode=disabled",
]


def model_state(trainer) -> dict[str, int]:  # noqa: ANN001
    """This rank's weights, fp32 masters and optimizer moments (bytes, each storage counted
    once)."""
    from tests.helpers.zero_state import storage_bytes

    opt = trainer.engine.optimizer
    params = list(trainer.model.parameters())
    if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3
        held = [p.ds_tensor for p in params]
        masters = list(opt.fp32_partitioned_groups_flat)
    else:  # ZeRO-1/2
        held = params
        masters = list(opt.single_partition_of_fp32_groups)
    # fp32 masters that share the weights' storage (moetrain.parallel.fp32_partitions)
    shared = {t.untyped_storage().data_ptr() for t in held}
    masters = [m for m in masters if m.untyped_storage().data_ptr() not in shared]
    moments = [t for s in opt.optimizer.state.values() for t in s.values() if t.dim()]
    return {"weights": storage_bytes(held), "optimizer": storage_bytes(masters + moments)}


def _config(stage: int):  # noqa: ANN202
    from moetrain.config import config_from_dict, read_config_data

    data = read_config_data(
        ROOT / "configs" / "tiny-cpu.yaml", [*SHAPE, f"parallel.zero_stage={stage}"]
    )
    return config_from_dict(data)


def worker(args: argparse.Namespace) -> None:
    import torch

    from moetrain.parallel.topology import init_distributed
    from moetrain.plan import plan
    from moetrain.train.trainer import Trainer
    from tests.helpers.zero_state import GradientPeak

    torch.set_num_threads(1)
    cfg = _config(args.stage)
    topo = init_distributed(cfg)
    base = reset_peak()
    trainer = Trainer(cfg, topo)
    grads = GradientPeak(trainer)
    times, state = [], {}

    def count(tr: Trainer) -> None:
        state.update(model_state(tr))
        grads.sample()

    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * step + topo.rank)
        ids = torch.randint(0, cfg.model.vocab_size, (1, SEQ + 1), generator=g)
        batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
        t0 = time.perf_counter()
        trainer.train_step([batch], before_step=count)
        times.append(time.perf_counter() - t0)
    pl = plan(cfg, gpus=topo.world_size, activation_checkpointing=False)
    out = {
        "rank": topo.rank,
        **state,
        # ZeRO-1 holds autograd's gradients until its reduce; at ZeRO-2/3 they are in flight
        # to their reduce (plan's fresh-gradient term, reported beside)
        "grads": grads.peak if args.stage == 1 else grads.buffers,
        "grads_in_flight": grads.peak - grads.buffers,
        "plan_fresh_grad": pl.param_grad_transient_bytes,
        "plan_weights": pl.weights_bytes,
        "plan_grads": pl.grads_bytes,
        "plan_optimizer": pl.optimizer_bytes,
        "plan_gathered": pl.gathered_bytes,
        "peak_rss": status("VmHWM"),
        "growth": status("VmHWM") - base,
        "tokens_per_s": WORLD * SEQ / statistics.median(times[1:] or times),
    }
    write_result(args.out, topo.rank, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    for p in (ap, w):
        p.add_argument("--steps", type=int, default=4)
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    w.add_argument("--stage", type=int, required=True)
    w.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.cmd == "worker":
        worker(args)
        return
    runs = {
        stage: run_ranks(__file__, WORLD, [f"--stage={stage}", f"--steps={args.steps}"])
        for stage in args.stages
    }
    mib = 2**20
    print(f"{WORLD} ranks, {args.steps} steps")
    print(
        "| stage | rank | model state (weights + grads + optimizer) | plan (weights + grads + "
        "optimizer) | plan / measured | plan's gathered set | peak RSS | training memory "
        "| tokens/s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for stage, ranks in runs.items():
        for r in ranks:
            got = r["weights"] + r["grads"] + r["optimizer"]
            want = r["plan_weights"] + r["plan_grads"] + r["plan_optimizer"]
            print(
                f"| {stage} | {r['rank']} | {got / mib:,.1f} MiB ({r['weights'] / mib:,.1f} + "
                f"{r['grads'] / mib:,.1f} + {r['optimizer'] / mib:,.1f}) | {want / mib:,.1f} MiB "
                f"({r['plan_weights'] / mib:,.1f} + {r['plan_grads'] / mib:,.1f} + "
                f"{r['plan_optimizer'] / mib:,.1f}) | {want / got:.3f}x "
                f"| {r['plan_gathered'] / mib:,.1f} MiB | {r['peak_rss'] / mib:,.0f} MiB "
                f"| {r['growth'] / mib:,.0f} MiB | {r['tokens_per_s']:,.0f} |"
            )

    def state(r: dict) -> int:
        return r["weights"] + r["grads"] + r["optimizer"]

    for stage, ranks in runs.items():  # plan is the largest rank's: against the largest
        worst = max(ranks, key=state)
        plan_state = worst["plan_weights"] + worst["plan_grads"] + worst["plan_optimizer"]
        flight = max(r["grads_in_flight"] for r in ranks)
        print(
            f"stage {stage}: plan / measured model state of the largest rank "
            f"{plan_state / state(worst):.3f}x (gradients "
            f"{worst['plan_grads'] / max(r['grads'] for r in ranks):.3f}x); gradients in "
            f"flight at most {flight / mib:,.1f} MiB, plan's fresh-gradient term "
            f"{worst['plan_fresh_grad'] / mib:,.1f} MiB"
        )
    if {2, 3} <= set(runs):

        def worst(stage: int, key) -> float:  # noqa: ANN001
            return max(key(r) for r in runs[stage])

        weights = lambda r: r["weights"]  # noqa: E731
        speed = min(r["tokens_per_s"] for r in runs[3]) / min(r["tokens_per_s"] for r in runs[2])
        print(
            f"stage 3 / stage 2: weights {worst(3, weights) / worst(2, weights):.2f}x, model "
            f"state {worst(3, state) / worst(2, state):.2f}x, peak RSS "
            f"{worst(3, lambda r: r['peak_rss']) / worst(2, lambda r: r['peak_rss']):.2f}x, "
            f"training memory "
            f"{worst(3, lambda r: r['growth']) / worst(2, lambda r: r['growth']):.2f}x, "
            f"tokens/s {speed:.2f}x"
        )


if __name__ == "__main__":
    main()
