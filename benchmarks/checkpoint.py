"""Checkpoint save / load time and size: the tiny config and a ~100M-parameter MoE.

One process, CPU, ZeRO-2 through the real DeepSpeed engine and moetrain's Checkpointer (atomic
commit, fsync, manifest). Saving is synchronous: the training step that saves stalls for exactly
the save time (measured here as the step-with-save minus a plain step).

    .venv/bin/python benchmarks/checkpoint.py
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("OMP_NUM_THREADS", "2")

SHAPES = {
    "tiny-cpu": [],
    "~100M": [
        "model.vocab_size=8192",
        "model.d_model=512",
        "model.n_layers=8",
        "model.n_heads=8",
        "model.n_kv_heads=4",
        "model.dense_hidden=2048",
        "moe.num_experts=8",
        "moe.expert_hidden=1024",
    ],
}


class Position:
    """The loader state a checkpoint records (the real loader's is a few integers too)."""

    tokenizer_sha256 = None

    def state_dict(self) -> dict[str, int]:
        return {"consumed": 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


def batch(cfg, g: torch.Generator) -> list[dict[str, torch.Tensor]]:
    seq = torch.randint(0, cfg.model.vocab_size, (2, 65), generator=g)
    return [{"input_ids": seq[:, :-1], "labels": seq[:, 1:]}]


def measure(name: str, overrides: list[str], root: Path) -> dict[str, float]:
    from moetrain.checkpoint.checkpointer import Checkpointer
    from moetrain.config import load_config
    from moetrain.model_numbers import model_numbers
    from moetrain.parallel.topology import init_distributed
    from moetrain.train.trainer import Trainer

    run_dir = root / name.replace("~", "")
    cfg = load_config(
        Path(__file__).resolve().parents[1] / "configs/tiny-cpu.yaml",
        [*overrides, "parallel.ep_size=1", "data.seq_len=64", f"run_dir={run_dir}"],
    )
    topo = init_distributed(cfg)
    trainer = Trainer(cfg, topo)
    ckpt = Checkpointer(cfg, topo)
    g = torch.Generator().manual_seed(0)
    trainer.train_step(batch(cfg, g))  # warm-up: optimizer states exist
    t0 = time.perf_counter()
    trainer.train_step(batch(cfg, g))
    plain_step = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer.train_step(batch(cfg, g))
    path = ckpt.save(trainer.run_state(Position()))
    step_with_save = time.perf_counter() - t0
    t0 = time.perf_counter()
    ckpt.save(trainer.run_state(Position()))  # same step again: replaces the directory
    save_s = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in path.iterdir())
    t0 = time.perf_counter()
    ckpt.load(path, trainer.run_state(Position()))
    load_s = time.perf_counter() - t0
    out = {
        "params_M": model_numbers(cfg).total_params / 1e6,
        "size_MiB": size / 2**20,
        "files": len(list(path.iterdir())),
        "save_s": save_s,
        "load_s": load_s,
        "step_s": plain_step,
        "stall_s": step_with_save - plain_step,
    }
    del trainer
    return out


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="moetrain-ckpt-bench-"))
    try:
        rows = {name: measure(name, ov, root) for name, ov in SHAPES.items()}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("| config | params | size | files | save | load | step | stall of the saving step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in rows.items():
        print(
            f"| {name} | {r['params_M']:.1f}M | {r['size_MiB']:.1f} MiB | {r['files']:.0f} | "
            f"{r['save_s']:.2f} s | {r['load_s']:.2f} s | {r['step_s']:.2f} s | "
            f"{r['stall_s']:.2f} s |"
        )


if __name__ == "__main__":
    main()
