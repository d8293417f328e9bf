"""fp32 ZeRO-1/2 masters sharing the weights' storage (moetrain.parallel.fp32_partitions).

Two gloo ranks, expert parallelism 2: the same three steps with the masters shared and with
DeepSpeed's clones kept give bit-identical losses, gradient norms and weights, and every master
slice DeepSpeed hands out per parameter (``safe_get_full_fp32_param``) is the live weight."""

from __future__ import annotations

import pytest

from tests.helpers.configs import tiny_config
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.slow


def _run(rank: int, zero: int, share: bool) -> dict:
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    import moetrain.parallel.deepspeed as ds
    from moetrain.parallel.topology import init_distributed
    from moetrain.train.trainer import Trainer

    real = ds.share_fp32_partitions
    ds.share_fp32_partitions = real if share else (lambda opt: 0)
    try:
        cfg = tiny_config(
            parallel__ep_size=2, parallel__zero_stage=zero, train__precision="fp32", seed=7
        )
        trainer = Trainer(cfg, init_distributed(cfg))
    finally:
        ds.share_fp32_partitions = real
    opt = trainer.engine.optimizer
    weights = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    shared = [
        m.untyped_storage().data_ptr() in weights for m in opt.single_partition_of_fp32_groups
    ]
    g = torch.Generator().manual_seed(100 + rank)
    records = []
    for _ in range(3):
        ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len + 1), generator=g)
        rec = trainer.train_step([{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}])
        records.append((rec["loss"], rec["grad_norm"]))
    masters_match = all(
        torch.equal(safe_get_full_fp32_param(p), p.detach()) for p in trainer.model.parameters()
    )
    state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return {"shared": shared, "records": records, "masters_match": masters_match, "state": state}


def _job(rank: int, world: int, zero: int) -> dict:
    return {share: _run(rank, zero, share) for share in (True, False)}


@pytest.mark.parametrize("zero", [2, pytest.param(1, marks=pytest.mark.long)])
def test_shared_fp32_masters_train_bit_identically(zero: int) -> None:
    """ZeRO-2 (the default) in the default suite, ZeRO-1 (the same sharing) with -m long."""
    import torch

    for rank in run_distributed(_job, 2, zero, timeout=600.0):
        shared, cloned = rank[True], rank[False]
        assert all(shared["shared"]) and not any(cloned["shared"])
        assert shared["records"] == cloned["records"]
        assert shared["masters_match"] and cloned["masters_match"]
        assert shared["state"].keys() == cloned["state"].keys()
        for name, value in shared["state"].items():
            assert torch.equal(value, cloned["state"][name]), name
