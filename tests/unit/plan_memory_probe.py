"""Measure the peak memory of a few fp32 training steps of moetrain's Transformer (one process).

Usage: ``python plan_memory_probe.py '[{"overrides": {"model.d_model": 256, ...},
"checkpointing": false}, ...]'``. Prints one JSON line, a list with one entry per run:
``peak_bytes`` = VmHWM (peak resident set) minus the resident set just before building that
run's model, with the peak reset through /proc/self/clear_refs. Before the first run a tiny model
trains once, so library code pages and thread pools are already resident. Run it with
``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc hands every freed tensor back to the OS and the
resident set follows the live tensors. Gradients are zeroed in place (kept across steps, as
DeepSpeed keeps its gradient buffers). One thread (``torch.set_num_threads(1)``).
"""

from __future__ import annotations

import gc
import json
import sys

import torch

from moetrain.config import Config, apply_overrides, config_from_dict
from moetrain.model import Transformer
from moetrain.parallel.apply import checkpoint_blocks


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def build(cfg: Config, checkpointing: bool) -> Transformer:
    model = Transformer(cfg.model, cfg.moe)
    if checkpointing:  # the trainer's own activation checkpointing (non-reentrant, per block)
        checkpoint_blocks(model)
    return model


def train_steps(cfg: Config, checkpointing: bool, steps: int) -> float:
    torch.manual_seed(0)
    model = build(cfg, checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    b, s, v = cfg.train.micro_batch_size, cfg.data.seq_len, cfg.model.vocab_size
    loss_value = 0.0
    for _ in range(steps):
        ids = torch.randint(0, v, (b, s))
        labels = torch.randint(0, v, (b, s))
        out = model(ids, labels_BS=labels, return_logits=False)  # as the trainer calls it
        out.loss.backward()
        loss_value = out.loss.item()
        del out
        opt.step()
        opt.zero_grad(set_to_none=False)
    return loss_value


def _config(overrides: dict[str, object]) -> Config:
    return config_from_dict(apply_overrides({}, [f"{k}={v}" for k, v in overrides.items()]))


def main() -> None:
    runs = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    tiny = {
        "model.vocab_size": 512,
        "model.d_model": 64,
        "model.n_layers": 2,
        "model.n_heads": 4,
        "model.n_kv_heads": 2,
        "moe.num_experts": 4,
        "moe.expert_hidden": 64,
        "data.seq_len": 64,
        "train.micro_batch_size": 2,
    }
    train_steps(_config(tiny), False, 2)
    train_steps(_config(tiny), True, 2)
    results = []
    for run in runs:
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _status("VmRSS")
        loss = train_steps(_config(run["overrides"]), run["checkpointing"], 3)
        results.append({"peak_bytes": _status("VmHWM") - base, "base_bytes": base, "loss": loss})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
