"""Group-limited routing through the real trainer (4 gloo ranks, EP=4, two simulated nodes of 2
ranks, as two torchrun agents would be): with one expert group per EP rank and topk_group=1,
every token sends exactly one row per MoE layer (all its copies go to one rank), and the
off-rank rows and bytes that the step records report fall below those of plain top-k routing.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.configs import tiny_config
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.slow

STEPS, MICRO, SEQ = 1, 2, 16
KEYS = ("rows", "rows_off_rank", "rows_off_node", "bytes_off_rank", "bytes_off_node")


def _job(rank: int, world: int) -> dict:
    os.environ["GROUP_RANK"] = str(rank // 2)  # ranks {0, 1} and {2, 3}: two "nodes"
    from moetrain.parallel.topology import init_distributed
    from moetrain.train.trainer import Trainer

    out: dict = {}
    for name, groups in (("plain", {}), ("grouped", {"moe.n_group": 4, "moe.topk_group": 1})):
        cfg = tiny_config(
            groups,
            seed=11,
            moe__num_experts=8,
            moe__top_k=2,
            parallel__ep_size=4,
            parallel__zero_stage=0,
            train__micro_batch_size=MICRO,
            data__seq_len=SEQ,
            run_dir="/tmp/moetrain-group-traffic-unused",
        )
        topo = init_distributed(cfg)
        trainer = Trainer(cfg, topo)
        records = []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 * step + rank)
            seq = torch.randint(0, cfg.model.vocab_size, (MICRO, SEQ + 1), generator=g)
            batch = {"input_ids": seq[:, :-1], "labels": seq[:, 1:]}
            rec = trainer.train_step([batch])
            records.append({k: rec[f"comm/a2a_{k}"] for k in KEYS})
        out[name] = {"nodes": topo.nodes, "records": records}
        del trainer
    return out


def test_one_row_per_token_and_less_traffic_with_groups_on_ep_ranks() -> None:
    results = run_distributed(_job, 4)
    rows_per_layer = 4 * MICRO * SEQ  # every rank's tokens, one MoE layer
    layers = 2
    for res in results:  # the records are summed over ranks: the same on every rank
        assert res == results[0]
    plain, grouped = (results[0][n]["records"] for n in ("plain", "grouped"))
    assert results[0]["plain"]["nodes"] == (0, 0, 1, 1)
    for p, g in zip(plain, grouped, strict=True):
        assert g["rows"] == layers * rows_per_layer  # all of a token's copies on one rank
        assert p["rows"] > g["rows"]  # plain top-2 often reaches two ranks
        assert p["rows_off_rank"] > g["rows_off_rank"] > 0
        assert p["bytes_off_rank"] > g["bytes_off_rank"]
        assert p["rows_off_node"] > g["rows_off_node"] > 0
        assert p["bytes_off_node"] > g["bytes_off_node"]
        assert p["rows_off_node"] < p["rows_off_rank"]  # some rows stay on the node
