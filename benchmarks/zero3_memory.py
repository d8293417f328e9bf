"""ZeRO-3 against ZeRO-2 on 4 CPU ranks at a shape where the dense weights dominate: each rank's
model state counted tensor by tensor against `moetrain plan`, peak RSS per rank, tokens/s.

Shape: vocab 32768, d 512, 4 layers, 4 experts of hidden 256 at EP 2 (the embedding and head
hold most of the weights), fp32, one 256-token row per rank per step. Each rank builds the real
Trainer under torchrun and trains ``--steps`` steps on the same synthetic batches. Per rank:

- model state: the weights it holds (at ZeRO-3 its partitions), its fp32 master partitions,
  AdamW's moments and its gradient partitions, counted after the last step, against ``plan``'s
  weights + gradients + optimizer states (at ZeRO-3 the partitions; ``plan``'s gathered working
  set is reported beside it). ``parallel.zero3_persistence_elements=0``: every weight is
  partitioned, as ``plan`` assumes;
- peak RSS (VmHWM) and training memory (VmHWM minus the resident set before the Trainer, the
  peak reset through /proc/self/clear_refs);
- tokens/s: the global batch's tokens over the median step time after the first (all four
  ranks share the machine's cores: the ratio is what carries over, not the number).

    .venv/bin/python benchmarks/zero3_memory.py [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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
    "train.precision=fp32",
    "train.micro_batch_size=1",
    f"data.seq_len={SEQ}",
    f"model.max_seq_len={SEQ}",
    "logging.wandb.mode=disabled",
]


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _bytes(tensors) -> int:  # noqa: ANN001
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def model_state(trainer) -> dict[str, int]:  # noqa: ANN001
    """This rank's weights, fp32 masters, optimizer moments and gradient partitions (bytes,
    each storage counted once)."""
    opt = trainer.engine.optimizer
    params = list(trainer.model.parameters())
    if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3
        held = [p.ds_tensor for p in params]
        masters = list(opt.fp32_partitioned_groups_flat)
        grads = _bytes([opt.grad_partitions_flat_buffer])
    else:  # ZeRO-2
        held = params
        masters = list(opt.single_partition_of_fp32_groups)
        grads = _bytes(t for ts in opt.averaged_gradients.values() if ts for t in ts)
    weights = _bytes(held)
    # fp32 masters that share the weights' storage (moetrain.parallel.fp32_partitions)
    shared = {t.untyped_storage().data_ptr() for t in held}
    masters = [m for m in masters if m.untyped_storage().data_ptr() not in shared]
    moments = [t for s in opt.optimizer.state.values() for t in s.values() if t.dim()]
    return {"weights": weights, "optimizer": _bytes(masters) + _bytes(moments), "grads": grads}


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

    torch.set_num_threads(1)
    cfg = _config(args.stage)
    topo = init_distributed(cfg)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS")
    trainer = Trainer(cfg, topo)
    times, state = [], {}
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * step + topo.rank)
        ids = torch.randint(0, cfg.model.vocab_size, (1, SEQ + 1), generator=g)
        batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
        t0 = time.perf_counter()
        trainer.train_step([batch], before_step=lambda tr: state.update(model_state(tr)))
        times.append(time.perf_counter() - t0)
    pl = plan(cfg, gpus=topo.world_size, activation_checkpointing=False)
    out = {
        "rank": topo.rank,
        **state,
        "plan_weights": pl.weights_bytes,
        "plan_grads": pl.grads_bytes,
        "plan_optimizer": pl.optimizer_bytes,
        "plan_gathered": pl.gathered_bytes,
        "peak_rss": _status("VmHWM"),
        "growth": _status("VmHWM") - base,
        "tokens_per_s": WORLD * SEQ / statistics.median(times[1:] or times),
    }
    Path(args.out, f"rank{topo.rank}.json").write_text(json.dumps(out))


def launch(stage: int, steps: int) -> list[dict]:
    """Each rank's figures (written by the rank to a file of its own: the ranks' output
    interleaves)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            str(Path(sys.executable).parent / "torchrun"),
            "--standalone",
            f"--nproc_per_node={WORLD}",
            __file__,
            "worker",
            f"--stage={stage}",
            f"--steps={steps}",
            f"--out={out}",
        ]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(WORLD)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    for p in (ap, w):
        p.add_argument("--steps", type=int, default=4)
    w.add_argument("--stage", type=int, required=True)
    w.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.cmd == "worker":
        worker(args)
        return
    runs = {stage: launch(stage, args.steps) for stage in (2, 3)}
    mib = 2**20
    print(f"{WORLD} ranks, {args.steps} steps")
    print(
        "| stage | rank | model state (weights + grads + optimizer) | plan | plan / measured "
        "| plan's gathered set | peak RSS | training memory | tokens/s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for stage, ranks in runs.items():
        for r in ranks:
            got = r["weights"] + r["grads"] + r["optimizer"]
            want = r["plan_weights"] + r["plan_grads"] + r["plan_optimizer"]
            print(
                f"| {stage} | {r['rank']} | {got / mib:,.1f} MiB ({r['weights'] / mib:,.1f} + "
                f"{r['grads'] / mib:,.1f} + {r['optimizer'] / mib:,.1f}) | {want / mib:,.1f} MiB "
                f"| {want / got:.3f}x | {r['plan_gathered'] / mib:,.1f} MiB "
                f"| {r['peak_rss'] / mib:,.0f} MiB | {r['growth'] / mib:,.0f} MiB "
                f"| {r['tokens_per_s']:,.0f} |"
            )

    def worst(stage: int, key) -> float:  # noqa: ANN001
        return max(key(r) for r in runs[stage])

    state = lambda r: r["weights"] + r["grads"] + r["optimizer"]  # noqa: E731
    weights = lambda r: r["weights"]  # noqa: E731
    speed = min(r["tokens_per_s"] for r in runs[3]) / min(r["tokens_per_s"] for r in runs[2])
    print(
        f"stage 3 / stage 2: weights {worst(3, weights) / worst(2, weights):.2f}x, model state "
        f"{worst(3, state) / worst(2, state):.2f}x, peak RSS "
        f"{worst(3, lambda r: r['peak_rss']) / worst(2, lambda r: r['peak_rss']):.2f}x, "
        f"training memory {worst(3, lambda r: r['growth']) / worst(2, lambda r: r['growth']):.2f}x, "
        f"tokens/s {speed:.2f}x"
    )


if __name__ == "__main__":
    main()
