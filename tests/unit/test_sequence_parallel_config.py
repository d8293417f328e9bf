"""Sequence parallelism's layout rules (``parallel.sp_size``, ``config/layout.py``), refused by
key before any process group starts, and its single-process pieces: the topology's ranks, the
batch slice, tokens per step, and the model's hook (off by default)."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import ConfigError
from moetrain.config.layout import check_layout
from moetrain.model.head_exchange import kv_repeats
from moetrain.parallel.sequence_parallel import shard_batch
from moetrain.parallel.topology import Topology
from moetrain.train.trainer import tokens_per_step
from tests.helpers.configs import tiny_config


def test_sp_size_default_is_one_and_valid() -> None:
    cfg = tiny_config()
    assert cfg.parallel.sp_size == 1
    assert check_layout(cfg, 4) == 4
    assert check_layout(tiny_config({"parallel.sp_size": 2}), 4) == 2


@pytest.mark.parametrize(
    "settings,key",
    [
        ({"parallel.sp_size": 0}, "parallel.sp_size"),
        ({"parallel.sp_size": 3}, r"parallel\.sp_size: must divide model\.n_heads=4"),
        (
            {"parallel.sp_size": 2, "data.seq_len": 31},
            r"parallel\.sp_size: must divide data\.seq_len=31",
        ),
        ({"parallel.sp_size": 2, "moe.aux_loss_scope": "sequence"}, r"moe\.aux_loss_scope"),
        ({"parallel.sp_size": 2, "model.mtp_depth": 1}, r"model\.mtp_depth"),
        # capacity over slices of rows (tests/distributed/test_sp_parity.py: whole rows exact)
        (
            {"parallel.sp_size": 2, "moe.capacity_factor": 1.0},
            r"moe\.capacity_factor: .*parallel\.ep_size=1 are slices of rows",
        ),
        (
            {"parallel.sp_size": 4, "parallel.ep_size": 2, "moe.capacity_factor": 1.0},
            r"moe\.capacity_factor",
        ),
    ],
)
def test_refused_by_key(settings: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        tiny_config(settings)


def test_a_capacity_factor_over_whole_rows_is_allowed() -> None:
    tiny_config({"parallel.sp_size": 2, "parallel.ep_size": 2, "moe.capacity_factor": 1.0})


def test_what_sp_1_allows_is_unchanged() -> None:
    tiny_config({"moe.aux_loss_scope": "sequence", "model.mtp_depth": 1, "data.seq_len": 31})


def test_sp_must_divide_the_world() -> None:
    cfg = tiny_config({"parallel.sp_size": 2})
    with pytest.raises(ConfigError, match=r"parallel\.sp_size: must divide the world size 3"):
        check_layout(cfg, 3)


def test_global_batch_counts_sequence_groups() -> None:
    """train.global_batch_size counts each SP group's sequences once: world / sp_size groups."""
    ok = {"parallel.sp_size": 2, "train.micro_batch_size": 2, "train.global_batch_size": 4}
    assert check_layout(tiny_config(ok), 4) == 2
    bad = tiny_config({**ok, "train.global_batch_size": 8})
    with pytest.raises(ConfigError, match=r"train\.global_batch_size: 8 != .* = 4"):
        check_layout(bad, 4)


def test_tokens_per_step_counts_each_token_once() -> None:
    one = tiny_config({"train.micro_batch_size": 2, "train.grad_accum_steps": 3})
    two = tiny_config(
        {"train.micro_batch_size": 2, "train.grad_accum_steps": 3, "parallel.sp_size": 2}
    )
    assert tokens_per_step(one, 4) == 2 * 3 * 4 * 32
    assert tokens_per_step(two, 4) == 2 * 3 * 2 * 32


def _topo(rank: int, world: int, sp: int, ep: int = 1) -> Topology:
    return Topology(rank, world, rank, ep, "gloo", torch.device("cpu"), sp_size=sp)


def test_topology_sequence_groups() -> None:
    ranks = [_topo(r, 8, 2, ep=4) for r in range(8)]
    assert [t.sp_rank for t in ranks] == [0, 1] * 4
    assert [t.data_rank for t in ranks] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(t.data_world == 4 and t.dp_size == 8 for t in ranks)
    assert ranks[5].sp_ranks() == [4, 5] and ranks[5].ep_ranks() == [4, 5, 6, 7]
    plain = _topo(3, 4, 1)
    assert (plain.sp_rank, plain.data_rank, plain.data_world) == (0, 3, 4)


def test_shard_batch_slices_positions_keeps_doc_ids_whole() -> None:
    ids = torch.arange(2 * 8).view(2, 8)
    batch = {"input_ids": ids, "labels": ids + 100, "doc_ids": ids // 3}
    assert shard_batch(batch, _topo(1, 2, 1)) is batch
    out = shard_batch(batch, _topo(3, 4, 2))  # sp rank 1 of 2: positions 4..7
    assert torch.equal(out["input_ids"], ids[:, 4:])
    assert torch.equal(out["labels"], ids[:, 4:] + 100)
    assert out["doc_ids"] is batch["doc_ids"]


@pytest.mark.parametrize(
    "kv,sp,rep", [(4, 2, 1), (2, 2, 1), (2, 4, 2), (1, 4, 4), (6, 4, 2), (8, 8, 1)]
)
def test_kv_repeats(kv: int, sp: int, rep: int) -> None:
    assert kv_repeats(kv, sp) == rep
    assert (kv * rep) % sp == 0


def test_kv_repeats_give_each_rank_its_query_heads_kv() -> None:
    """After the repeat, rank j's key/value heads are those its query heads use."""
    for heads, kv, sp in [(4, 2, 4), (4, 1, 2), (12, 6, 4), (8, 2, 8)]:
        rep = kv_repeats(kv, sp)
        repeated = [g for g in range(kv) for _ in range(rep)]  # repeat_interleave
        per_rank_q, per_rank_kv = heads // sp, len(repeated) // sp
        for j in range(sp):
            mine = set(repeated[j * per_rank_kv : (j + 1) * per_rank_kv])
            group = heads // kv
            need = {h // group for h in range(j * per_rank_q, (j + 1) * per_rank_q)}
            assert need == mine, (heads, kv, sp, j)
            # and SDPA's grouping on the rank maps query i to kv head i // (q / kv)
            local = repeated[j * per_rank_kv : (j + 1) * per_rank_kv]
            for i, h in enumerate(range(j * per_rank_q, (j + 1) * per_rank_q)):
                assert local[i // (per_rank_q // per_rank_kv)] == h // group


def test_model_has_no_exchange_by_default() -> None:
    from moetrain.model.transformer import Transformer

    cfg = tiny_config()
    model = Transformer(cfg.model, cfg.moe)
    assert model.head_exchange is None
    assert all(block.attn.head_exchange is None for block in model.layers)


class _OneRank:
    """A head exchange over one rank: both directions are the identity."""

    rank, size = 0, 1

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        return x


MLA = {
    "model.attention": "mla",
    "model.n_kv_heads": 4,
    "model.kv_lora_rank": 16,
    "model.qk_nope_head_dim": 8,
    "model.qk_rope_head_dim": 8,
    "model.v_head_dim": 8,
}


@pytest.mark.parametrize("settings", [{}, MLA], ids=["gqa", "mla"])
def test_exchange_path_on_one_rank_equals_the_default(settings: dict) -> None:
    """The exchanged path (q/k/v through the exchange, attention, back) with a one-rank
    exchange computes what the default path does, with and without documents."""
    from moetrain.model.transformer import Transformer

    cfg = tiny_config(settings)
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16))
    docs = torch.tensor([[0] * 5 + [1] * 11, [0] * 9 + [1] * 7])
    want = [model(ids, d, ids).loss for d in (None, docs)]
    model.set_head_exchange(_OneRank())
    got = [model(ids, d, ids).loss for d in (None, docs)]
    model.set_head_exchange(None)
    assert all(block.attn.head_exchange is None for block in model.layers)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="whole rows"):
        model.set_head_exchange(_OneRank())
        model(ids, docs[:, :8], ids)
