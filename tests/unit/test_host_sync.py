"""Host syncs in one MoE layer's forward and backward, counted on CPU by the ops that would make
a CUDA host wait (``moetrain.monitor.host_sync``): none when dropless at EP=1, one (the number
of kept copies) with capacity drops. The expert-parallel counts are in
tests/distributed/test_host_sync_ep.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from moetrain.config import MoEConfig
from moetrain.model.cpu_matmul import use_cpu_matmul
from moetrain.model.moe.dispatch import permute, unpermute
from moetrain.model.moe.layer import MoELayer
from moetrain.model.moe.router import count_experts
from moetrain.monitor.host_sync import HostSyncCounter

D = 8


@pytest.fixture(autouse=True)
def _kernels_of_a_gpu():
    """The counts stand for a CUDA run, so the model's matmuls take torch's kernels, as on a GPU
    (the CPU-only oneDNN path reads the expert offsets on the host, where nothing waits)."""
    use_cpu_matmul("torch")
    yield
    use_cpu_matmul("onednn")


def test_counter_sees_each_kind_of_sync_and_restores_tolist() -> None:
    t = torch.tensor([0, 2, 2, 5])
    original = torch.Tensor.tolist
    with HostSyncCounter() as c:
        t.sum().item()
        bool(t.any())
        torch.nonzero(t)
        torch.bincount(t)
        t.tolist()
        t[t > 1]
        torch.repeat_interleave(t)
        torch.repeat_interleave(torch.arange(4), t, output_size=9)  # size given: no sync
        torch.argsort(t, stable=True)
        t.cumsum(0)
    assert c.counts == {
        "_local_scalar_dense": 2,
        "nonzero": 1,
        "bincount": 1,
        "tolist": 1,
        "index": 1,
        "repeat_interleave": 1,
    }
    assert torch.Tensor.tolist is original


def test_count_experts_equals_bincount() -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5, (37, 3), generator=g)
    ids[ids == 3] = 4  # an empty bin in the middle
    for bins in (5, 7):
        expected = torch.bincount(ids.reshape(-1), minlength=bins)
        got = count_experts(ids, bins)
        assert got.dtype == torch.int64 and torch.equal(got, expected)
    assert torch.equal(
        count_experts(torch.zeros(0, 2, dtype=torch.int64), 3), torch.zeros(3).long()
    )


def test_dropless_hint_gives_the_same_permutation_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, D, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(9)])
    w = torch.rand(9, 2, generator=g)
    a = permute(x, ids, torch.ones(9, 2, dtype=torch.bool), w, 4)
    b = permute(x, ids, None, w, 4)
    for ta, tb in zip(a[:3], b[:3], strict=True):
        assert torch.equal(ta, tb)
    assert torch.equal(a[3].inverse_N, b[3].inverse_N)
    assert torch.equal(unpermute(a[0], a[3]), unpermute(b[0], b[3]))


def _layer(**kw) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(num_experts=4, top_k=2, expert_hidden=16, **kw), D)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    return layer


def _count(layer: MoELayer, recompute: bool = False) -> dict[str, int]:
    x = torch.randn(2, 6, D, requires_grad=True)
    with HostSyncCounter() as c:
        if recompute:  # what activation checkpointing runs: the forward twice
            y = checkpoint(lambda h: layer(h)[0], x, use_reentrant=False)
            aux = torch.zeros(())
        else:
            y, stats = layer(x)
            aux = stats.aux_loss
        (y.square().sum() + aux).backward()
    assert x.grad is not None
    return dict(c.counts)


SHAPES = [
    dict(),
    dict(num_shared_experts=1, shared_expert_gate=True, recompute_act=True),
    dict(score_func="sigmoid", topk_before_score=True, bias_update_rate=1e-3),
    dict(n_group=2, topk_group=1, aux_loss_scope="sequence"),
    dict(aux_loss_scope="global_batch"),
]


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("kw", SHAPES, ids=["plain", "shared", "sigmoid", "groups", "step"])
def test_dropless_layer_has_no_host_sync(kw: dict, recompute: bool) -> None:
    assert _count(_layer(**kw), recompute) == {}


def test_capacity_layer_syncs_once_for_the_kept_rows() -> None:
    assert _count(_layer(capacity_factor=1.0)) == {"_local_scalar_dense": 1}
    assert _count(_layer(capacity_factor=1.0), recompute=True) == {"_local_scalar_dense": 2}


def test_experts_without_rows_read_no_counts() -> None:
    """An expert-parallel rank that receives no rows takes the loop without reading counts."""
    from moetrain.model.moe.experts import GroupedExperts

    experts = GroupedExperts(4, D, 16)
    torch.nn.init.normal_(experts.w13)
    with HostSyncCounter() as c:
        y = experts(torch.zeros(0, D), torch.zeros(4, dtype=torch.int64))
        y.sum().backward()
    assert c.counts == {} and y.shape == (0, D) and experts.path == "loop: no tokens"
    assert torch.all(experts.w13.grad == 0)
