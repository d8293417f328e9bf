"""``moetrain plan``'s ZeRO-1/2 gradient buffer (moetrain/plan/zero_grads.py) by hand: the
parameters a partition cuts counted whole, the padding past a group's end, a partition of
padding alone, the first reduce bucket, and the groups DeepSpeed gets. What a real DeepSpeed
engine allocates: tests/distributed/test_plan_zero_state.py."""

from __future__ import annotations

from itertools import accumulate

import pytest

from moetrain.plan import plan
from moetrain.plan.zero_grads import (
    first_bucket_elements,
    group_sizes,
    keeps_partition_buffer,
    partition_buffer_elements,
    rank_partition_buffer,
)
from tests.helpers.configs import tiny_config


@pytest.mark.parametrize(
    ("sizes", "ranks", "by_rank"),
    [
        # 20 elements, 2 ranks, partitions of 10: the second parameter straddles the cut, so
        # both ranks hold it whole
        ([6, 10, 4], 2, [16, 14]),
        # a cut between parameters: each rank its own
        ([10, 3, 7], 2, [10, 10]),
        # 9 elements padded to 12 (2 x 2 ranks): rank 1 holds the cut parameter and 3 zeros
        ([5, 4], 2, [9, 7]),
        # 2 elements padded to 8 over 4 ranks: ranks 1-3 reduce into a zero partition of 2
        ([2], 4, [2, 2, 2, 2]),
    ],
)
def test_partition_buffer_counts_cut_parameters_whole(
    sizes: list[int], ranks: int, by_rank: list[int]
) -> None:
    ends = list(accumulate(sizes))
    assert [rank_partition_buffer(ends, ranks, r) for r in range(ranks)] == by_rank
    assert partition_buffer_elements([(False, sizes)], ranks, 1) == max(by_rank)


def test_expert_groups_partition_over_their_expert_data_parallel_group() -> None:
    # world 4, EP 2: dense over 4 ranks (partitions of 4 of [8, 8]: every rank one whole 8),
    # experts over 2 (rank r is expert-data-parallel rank r // 2: partitions of 6 of [4, 8]:
    # rank 0 holds both whole, 12; rank 1 the 8)
    groups = [(False, [8, 8]), (True, [4, 8])]
    assert partition_buffer_elements(groups, 4, 2) == 8 + 12


def test_first_bucket() -> None:
    groups = [(False, [3, 4]), (True, [5])]
    assert first_bucket_elements(groups, 8) == 7  # 3 + 4 fit, 5 does not
    assert first_bucket_elements(groups, 2) == 3  # larger than the bucket: reduced alone
    assert first_bucket_elements(groups, 100) == 12


def test_groups_are_the_optimizers_with_each_gpus_experts() -> None:
    cfg = tiny_config(parallel__ep_size=2)
    groups = group_sizes(cfg)
    # AdamW's decay / no_decay, then DeepSpeed's MoE groups of each (the expert weights decay)
    assert [expert for expert, _ in groups] == [False, False, True]
    pl = plan(cfg, gpus=2)
    assert sum(sum(sizes) for _, sizes in groups) == pl.params_per_gpu


def test_plan_takes_the_buffer_only_where_deepspeed_keeps_it() -> None:
    fp32 = tiny_config(parallel__zero_stage=2)
    assert keeps_partition_buffer(fp32)
    assert not keeps_partition_buffer(tiny_config(parallel__zero_stage=3))
    assert not keeps_partition_buffer(tiny_config(parallel__zero_stage=2, train__precision="bf16"))
    assert keeps_partition_buffer(
        tiny_config(parallel__zero_stage=2, train__precision="bf16", train__grad_dtype="bf16")
    )
    assert not keeps_partition_buffer(
        tiny_config(parallel__zero_stage=2, parallel__offload_optimizer=True)
    )
    # ZeRO-2 with accumulation: two buffers; ZeRO-1 reducing after the backward (overlap off):
    # beside the gradients the first bucket did not take
    one = plan(fp32, gpus=2).grads_bytes
    assert plan(tiny_config(parallel__zero_stage=2, train__grad_accum_steps=2), 2).grads_bytes == (
        2 * one
    )
    whole = 4 * plan(fp32, gpus=2).params_per_gpu
    zero1 = tiny_config(
        parallel__zero_stage=1, parallel__overlap_comm=False, parallel__bucket_elements=1000
    )
    moved = 4 * first_bucket_elements(group_sizes(zero1), 1000)
    assert plan(zero1, gpus=2).grads_bytes == one + whole - moved
    overlapped = tiny_config(parallel__zero_stage=1, parallel__overlap_comm=True)
    assert plan(overlapped, gpus=2).grads_bytes == one


@pytest.mark.parametrize("zero3", [False, True])
def test_gradient_peak_leaves_the_reduce_buckets_out_without_unbinding_them(
    monkeypatch: pytest.MonkeyPatch, zero3: bool
) -> None:
    """The measuring helper of the engine checks (tests/helpers/zero_state.py): ZeRO-1/2's
    reduce buckets are lists of tensors, ZeRO-3's one flat tensor, counted whole and left out;
    iterating a tensor would unbind it into one view per element (about 1 GiB of views for a
    2M-element bucket: the peak RSS it once added to benchmarks/zero3_memory.py at ZeRO-3)."""
    from types import SimpleNamespace

    import torch

    from tests.helpers.zero_state import GradientPeak

    flat, grads = torch.zeros(1000), torch.zeros(100)
    bucket = SimpleNamespace(buffer=flat if zero3 else [flat])
    opt = SimpleNamespace(ipg_buckets={torch.float32: bucket}, grads_in_partition=grads)
    model = torch.nn.Linear(1, 1)
    model.weight.grad, model.bias.grad = flat[:1].view(1, 1), torch.zeros(1)  # one in a bucket
    trainer = SimpleNamespace(engine=SimpleNamespace(optimizer=opt), model=model)

    def no_iteration(self: torch.Tensor):  # noqa: ANN202
        raise AssertionError("a gradient buffer iterated element by element")

    monkeypatch.setattr(torch.Tensor, "__iter__", no_iteration)
    peak = GradientPeak(trainer)
    peak.sample()
    assert (peak.peak, peak.buffers) == (404, 400)  # the partition buffer and the bias's
