"""Per-rank memory of bf16 against fp32 training, measured on the real engine, against
`moetrain plan`'s model-state and activation terms.

2 gloo ranks, expert parallelism 2, the `bench` shape of train_throughput.py (vocab 8192, d 256,
4 layers, 8 experts top-2, expert hidden 512, seq 256, micro-batch 4), ZeRO-1 and ZeRO-2, fp32
and bf16 (fp32 gradient accumulation, the default). Per rank and case:

- model state, counted tensor by tensor after the last backward of a step: the module's
  weights, DeepSpeed's gradient buffers (ZeRO-1 bf16: the fp32 accumulation buffer; ZeRO-2:
  this rank's fp32 partition; fp32 ZeRO-1: the module's own gradients) plus any gradient
  still on the module, and the optimizer's fp32 master partitions and Adam moments;
  against ``plan(cfg, gpus=2)``'s weights + gradients + optimizer states.
- activations: the distinct storages autograd saves in one forward of the engine's module
  (saved-tensor hooks), plus the labels; against the saved-tensor part of plan's activation
  term (per-layer and head bytes per token times the tokens, plus the chunked loss's fp32
  LM-head gradient).

Memory figures do not depend on the machine's load.

    .venv/bin/python benchmarks/precision_memory.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BENCH = [
    "model.vocab_size=8192",
    "model.d_model=256",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.dense_hidden=1024",
    "model.max_seq_len=256",
    "moe.num_experts=8",
    "moe.top_k=2",
    "moe.expert_hidden=512",
    "data.seq_len=256",
    "train.micro_batch_size=4",
    "parallel.ep_size=2",
    "run_dir=runs/precision-memory-unused",
]
CASES = [("fp32", 1), ("bf16", 1), ("fp32", 2), ("bf16", 2)]


def _nbytes(tensors) -> int:  # noqa: ANN001
    return sum(t.numel() * t.element_size() for t in tensors)


def _storage_bytes(tensors) -> int:  # noqa: ANN001
    return sum(
        {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values()
    )


def _grad_bytes(trainer) -> int:  # noqa: ANN001
    opt = trainer.engine.optimizer
    module = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    if hasattr(opt, "fp32_groups_gradients_flat"):  # BF16_Optimizer (ZeRO-1, fp32 accumulation)
        buffers = list(opt.fp32_groups_gradients_flat)
    elif trainer.cfg.parallel.zero_stage == 2:
        buffers = [t for ts in opt.averaged_gradients.values() if ts for t in ts]
    else:  # fp32 ZeRO-1 accumulates in the module's own gradients
        buffers = []
    return _storage_bytes(buffers) + _storage_bytes(module)


def _optimizer_bytes(trainer) -> int:  # noqa: ANN001
    opt = trainer.engine.optimizer
    masters = getattr(opt, "single_partition_of_fp32_groups", None)
    if masters is None:
        masters = opt.fp32_groups_flat_partition
    weights = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    # fp32: the masters are slices of the weights (moetrain.parallel.fp32_partitions)
    masters = [m for m in masters if m.untyped_storage().data_ptr() not in weights]
    moments = [t for st in opt.optimizer.state.values() for t in st.values() if t.dim()]
    return _nbytes(masters) + _nbytes(moments)


def _saved_activation_bytes(trainer, batch) -> int:  # noqa: ANN001
    from tests.helpers.memory import saved_storages

    model = trainer.model
    with saved_storages([*model.parameters(), *model.buffers()]) as seen:
        out = trainer.forward(batch)
    del out
    return sum(seen.values()) + batch["labels"].untyped_storage().nbytes()


def _plan_saved_activations(cfg) -> int:  # noqa: ANN001
    from moetrain.plan import activation_bytes_per_token, head_bytes_per_token

    a = 4 if cfg.train.precision == "fp32" else 2
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    per_token = sum(activation_bytes_per_token(cfg, i, a) for i in range(cfg.model.n_layers))
    per_token += head_bytes_per_token(cfg, a)
    chunked = 4 * cfg.model.vocab_size * cfg.model.d_model if cfg.model.loss_chunk_tokens else 0
    return tokens * per_token + chunked


def _case(rank: int, world: int, precision: str, stage: int) -> dict:
    from moetrain.config import load_config
    from moetrain.parallel.topology import init_distributed
    from moetrain.plan import plan
    from moetrain.train.trainer import Trainer

    cfg = load_config(
        str(ROOT / "configs/tiny-cpu.yaml"),
        [*BENCH, f"train.precision={precision}", f"parallel.zero_stage={stage}"],
    )
    trainer = Trainer(cfg, init_distributed(cfg))
    g = torch.Generator().manual_seed(rank)
    b, s, v = cfg.train.micro_batch_size, cfg.data.seq_len, cfg.model.vocab_size

    def batch() -> dict[str, torch.Tensor]:
        seq = torch.randint(0, v, (b, s + 1), generator=g)
        return {"input_ids": seq[:, :-1], "labels": seq[:, 1:]}

    trainer.train_step([batch()])  # the optimizer state exists from here on
    grads: dict[str, int] = {}
    trainer.train_step([batch()], before_step=lambda tr: grads.update(n=_grad_bytes(tr)))
    acts = _saved_activation_bytes(trainer, batch())
    pl = plan(cfg, gpus=world)
    measured = {
        "weights": _nbytes(trainer.model.parameters()),
        "gradients": grads["n"],
        "optimizer": _optimizer_bytes(trainer),
    }
    planned = {
        "weights": pl.weights_bytes,
        "gradients": pl.grads_bytes,
        "optimizer": pl.optimizer_bytes,
    }
    return {
        "case": f"{precision} ZeRO-{stage}",
        "measured": measured,
        "plan": planned,
        "model_state": sum(measured.values()),
        "plan_model_state": pl.model_state_bytes,
        "activations": acts,
        "plan_activations": _plan_saved_activations(cfg),
        "plan_activation_term": pl.activations_bytes,
    }


def _job(rank: int, world: int) -> list[dict]:
    torch.set_num_threads(1)
    return [_case(rank, world, precision, stage) for precision, stage in CASES]


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    from tests.helpers.distributed import run_distributed

    ranks = run_distributed(_job, 2, timeout=3600)
    mib = 2**20
    print(
        "case          rank  weights  grads  optim  | model state  plan   ratio | activations  plan   ratio"
    )
    for rank, results in enumerate(ranks):
        for r in results:
            m = r["measured"]
            print(
                f"{r['case']:13s} {rank:4d} {m['weights'] / mib:8.2f} {m['gradients'] / mib:6.2f} "
                f"{m['optimizer'] / mib:6.2f} | {r['model_state'] / mib:11.2f} "
                f"{r['plan_model_state'] / mib:6.2f} {r['model_state'] / r['plan_model_state']:6.3f} | "
                f"{r['activations'] / mib:11.2f} {r['plan_activations'] / mib:6.2f} "
                f"{r['activations'] / r['plan_activations']:6.3f}"
            )
    by_case = {r["case"]: r for r in ranks[0]}
    for stage in (1, 2):
        f, b = by_case[f"fp32 ZeRO-{stage}"], by_case[f"bf16 ZeRO-{stage}"]
        print(
            f"ZeRO-{stage} rank 0, bf16 / fp32: model state "
            f"{b['model_state'] / f['model_state']:.3f}, activations "
            f"{b['activations'] / f['activations']:.3f}"
        )
    print(json.dumps(ranks))


if __name__ == "__main__":
    main()
