"""ZeRO-1/2's step taking the gradient partition in place (moetrain.parallel.grad_partitions).

Two gloo ranks, expert parallelism 2, two micro-batches per step: the same three steps with the
hook installed and with DeepSpeed's own concatenation give bit-identical losses, gradient norms
and weights, and with the hook every parameter group's partition is a view of DeepSpeed's
gradient buffer (nothing concatenated) while DeepSpeed alone has none for any group."""

from __future__ import annotations

import pytest

from tests.helpers.configs import tiny_config
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.slow


def _run(rank: int, zero: int, install: bool) -> dict:
    import torch

    import moetrain.parallel.deepspeed as ds
    from moetrain.parallel.topology import init_distributed
    from moetrain.train.trainer import Trainer

    real = ds.flatten_grad_partitions_in_place
    ds.flatten_grad_partitions_in_place = real if install else (lambda opt: False)
    try:
        cfg = tiny_config(
            parallel__ep_size=2,
            parallel__zero_stage=zero,
            train__precision="fp32",
            train__grad_accum_steps=2,
            seed=7,
        )
        trainer = Trainer(cfg, init_distributed(cfg))
    finally:
        ds.flatten_grad_partitions_in_place = real
    opt = trainer.engine.optimizer
    in_place: list[bool] = []

    def before_step(_trainer: Trainer) -> None:
        for i, grads in sorted(opt.averaged_gradients.items()):
            span = opt._get_preflattened_grad_partition(i)
            in_place.append(span is not None and span.data_ptr() == grads[0].data_ptr())

    g = torch.Generator().manual_seed(100 + rank)
    records = []
    for _ in range(3):
        micro = []
        for _ in range(2):
            ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len + 1), generator=g)
            micro.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
        rec = trainer.train_step(micro, before_step=before_step)
        records.append((rec["loss"], rec["grad_norm"]))
    state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return {"in_place": in_place, "records": records, "state": state}


def _job(rank: int, world: int, zero: int) -> dict:
    return {install: _run(rank, zero, install) for install in (True, False)}


@pytest.mark.parametrize("zero", [2, pytest.param(1, marks=pytest.mark.long)])
def test_grad_partitions_in_place_train_bit_identically(zero: int) -> None:
    """ZeRO-2 (the default) in the default suite, ZeRO-1 with -m long."""
    import torch

    for rank in run_distributed(_job, 2, zero, timeout=600.0):
        hooked, plain = rank[True], rank[False]
        assert hooked["in_place"] and all(hooked["in_place"])
        assert plain["in_place"] and not any(plain["in_place"])
        assert hooked["records"] == plain["records"]
        assert hooked["state"].keys() == plain["state"].keys()
        for name, value in hooked["state"].items():
            assert torch.equal(value, plain["state"][name]), name
