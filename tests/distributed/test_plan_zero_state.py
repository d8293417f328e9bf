"""`moetrain plan`'s model-state terms against a real DeepSpeed ZeRO engine (2 gloo ranks).

After one optimizer step of the real Trainer, each rank's model weights, its ZeRO fp32
partition and AdamW's moments are counted tensor by tensor and compared with
``plan(cfg, gpus=2)``: the formula must hold for what DeepSpeed actually allocates (fp32 and
bf16, ZeRO-1 and ZeRO-2, EP 1 and 2)."""

from __future__ import annotations

import pytest

from tests.helpers.configs import tiny_config
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.slow

SHAPE = {
    "model.vocab_size": 512,
    "model.d_model": 64,
    "model.dense_hidden": 1024,
    "model.max_seq_len": 32,
    "moe.expert_hidden": 96,
    "data.seq_len": 32,
    "train.micro_batch_size": 2,
    "run_dir": "/tmp/moetrain-plan-zero-unused",
}
LAYOUTS = [  # (ep_size, zero_stage, precision)
    (2, 2, "fp32"),
    (1, 1, "fp32"),
    (2, 1, "bf16"),
]


def _nbytes(tensors) -> int:  # noqa: ANN001
    return sum(t.numel() * t.element_size() for t in tensors)


def _job(rank: int, world: int) -> list[dict]:
    import torch

    from moetrain.parallel.topology import init_distributed
    from moetrain.plan import plan
    from moetrain.train.trainer import Trainer

    out = []
    for ep, zero, precision in LAYOUTS:
        cfg = tiny_config(
            SHAPE, parallel__ep_size=ep, parallel__zero_stage=zero, train__precision=precision
        )
        trainer = Trainer(cfg, init_distributed(cfg))
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, 512, (2, 33), generator=g)
        trainer.train_step([{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}])
        zero_opt = trainer.engine.optimizer
        moments = [
            t for state in zero_opt.optimizer.state.values() for t in state.values() if t.dim()
        ]
        pl = plan(cfg, gpus=world)
        out.append(
            {
                "layout": (ep, zero, precision),
                "weights": _nbytes(trainer.model.parameters()),
                "plan_weights": pl.weights_bytes,
                "optimizer": _nbytes(zero_opt.single_partition_of_fp32_groups) + _nbytes(moments),
                "plan_optimizer": pl.optimizer_bytes,
            }
        )
        del trainer, zero_opt, moments
    return out


def test_plan_model_state_equals_deepspeed_zero_allocations() -> None:
    for rank_results in run_distributed(_job, 2, timeout=600.0):
        for r in rank_results:
            assert r["weights"] == r["plan_weights"], r
            # ZeRO pads each flat group to a multiple of the world size: a few elements
            assert r["optimizer"] == pytest.approx(r["plan_optimizer"], rel=1e-3), r
