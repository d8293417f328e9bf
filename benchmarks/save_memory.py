"""Host memory of a bf16 checkpoint save, per rank, against ``moetrain plan``.

    .venv/bin/python benchmarks/save_memory.py                      # ~1B parameters, 2 ranks
    .venv/bin/python benchmarks/save_memory.py --d-model 512 --experts 8   # a smaller model

Starts 2 ranks under ``torchrun`` (gloo, one thread each) that build a bf16 MoE trainer
(ZeRO-2, expert parallelism ``--ep``), take one optimizer step on random tokens, then save a
checkpoint through ``Checkpointer.save``. Each rank measures the growth of its resident set
during the save: ``VmHWM`` after the save (the peak, reset just before it through
``/proc/self/clear_refs``) minus ``VmRSS`` before. Printed per rank, next to the fp32 masters
that rank writes (what the save gathers and keeps, :mod:`moetrain.parallel.master_weights`), the
fp32 size of every weight it holds (what a rank kept when every rank gathered everything), and
the plan's figure for rank 0 (``save_host_bytes``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MiB = 1024**2


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _overrides(args: argparse.Namespace, run_dir: str) -> list[str]:
    return [
        f"run_dir={run_dir}",
        "model.vocab_size=32000",
        f"model.d_model={args.d_model}",
        f"model.n_layers={args.layers}",
        "model.n_heads=16",
        "model.n_kv_heads=4",
        f"model.max_seq_len={args.seq}",
        f"moe.num_experts={args.experts}",
        "moe.top_k=2",
        f"moe.expert_hidden={args.expert_hidden}",
        f"data.seq_len={args.seq}",
        f"parallel.ep_size={args.ep}",
        "parallel.zero_stage=2",
        "train.precision=bf16",
        "train.micro_batch_size=1",
        "train.threads_per_rank=1",
        "checkpoint.keep_last=1",
    ]


class _Position:
    """The loader's part of a checkpoint (the save needs a state dict only)."""

    def state_dict(self) -> dict:
        return {}


def worker(args: argparse.Namespace) -> None:
    import torch

    from moetrain.checkpoint.checkpointer import Checkpointer
    from moetrain.config import load_config
    from moetrain.parallel.master_weights import writes_to_checkpoint
    from moetrain.parallel.topology import init_distributed
    from moetrain.plan import plan
    from moetrain.train.trainer import Trainer

    cfg = load_config(None, _overrides(args, args.run_dir))
    topo = init_distributed(cfg)
    trainer = Trainer(cfg, topo)
    ids = torch.randint(0, cfg.model.vocab_size, (1, args.seq + 1))
    trainer.train_step([{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}])
    params = list(trainer.model.parameters())
    writes = sum(4 * p.numel() for p in params if writes_to_checkpoint(p))
    held = sum(4 * p.numel() for p in params)
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    Checkpointer(cfg, topo).save(trainer.run_state(_Position()))
    grew = (_status_kib("VmHWM") - before) * 1024
    row = {"rank": topo.rank, "save_growth_mib": grew / MiB, "writes_fp32_mib": writes / MiB}
    row["holds_fp32_mib"] = held / MiB
    if topo.rank == 0:
        row["plan_save_mib"] = plan(cfg, topo.world_size).save_host_bytes / MiB
        row["params"] = sum(p.numel() for p in params)
    print("RESULT " + json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--expert-hidden", type=int, default=2816)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--ep", type=int, default=1)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc_per_node", "2", __file__, "--worker", "--run-dir", run_dir]
        cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "worker"]
        cmd = [c for c in cmd if not c.startswith("--run-dir=")]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
    rows = [
        json.loads(ln.split("RESULT ", 1)[1]) for ln in proc.stdout.splitlines() if "RESULT " in ln
    ]
    rows.sort(key=lambda r: r["rank"])
    first = rows[0]
    print(f"{first['params'] / 1e9:.2f}B parameters, 2 ranks, ep {args.ep}, bf16, ZeRO-2")
    print(f"plan: {first['plan_save_mib']:.0f} MiB of host memory on rank 0 during a save")
    for r in rows:
        print(
            f"rank {r['rank']}: resident set grew {r['save_growth_mib']:.0f} MiB during the save; "
            f"fp32 masters it writes {r['writes_fp32_mib']:.0f} MiB; fp32 of all it holds "
            f"{r['holds_fp32_mib']:.0f} MiB"
        )


if __name__ == "__main__":
    main()
