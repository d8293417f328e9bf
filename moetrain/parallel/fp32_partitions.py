"""fp32 training under ZeRO without a second copy of the weights.

DeepSpeed's ZeRO-1/2 optimizer clones each rank's partition of the flat weight buffer into an
fp32 "master" partition, and after every optimizer step copies the updated masters back into the
weights. Under bf16/fp16 that copy is the point (the masters keep the precision the weights
lack); under fp32 it is a duplicate of the same values: 4 bytes per parameter of the rank's
partition (dense weights over the data-parallel ranks, experts over their expert-data-parallel
group), freed by :func:`share_fp32_partitions`.

The master partition then is the rank's slice of the flat weight buffer itself: the optimizer
updates the weights in place, DeepSpeed's copy back becomes a copy onto itself, and the
all-gather that follows distributes the updated slices as before. Every value is the same as with
the clone, so training stays bit-identical; checkpoints keep the same files and keys (the masters
are still saved, and loading them writes the weights, as DeepSpeed then does anyway).

ZeRO-3 (:func:`share_zero3_fp32_partitions`): DeepSpeed's stage-3 optimizer means to skip the
clone when the weight partitions already have the masters' dtype and device
(``_create_fp32_partitions``), but compares a tensor's ``torch.device`` with the accelerator's
device *name* (a string), which is never equal: the clone is always made. The same sharing, per
sub-group: the master partition becomes the sub-group's slice of the flat partition buffer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["share_fp32_partitions", "share_zero3_fp32_partitions"]


def share_fp32_partitions(zero_optimizer: Any) -> int:
    """Make every fp32 master partition of ``zero_optimizer`` (DeepSpeed's ZeRO-1/2 optimizer)
    the slice of the weights it was cloned from, where both have the same dtype and device and
    the optimizer is not offloaded; -> bytes freed on this rank (0 when nothing was shared)."""
    if getattr(zero_optimizer, "cpu_offload", True) or not hasattr(
        zero_optimizer, "single_partition_of_fp32_groups"
    ):
        return 0
    freed = 0
    masters = zero_optimizer.single_partition_of_fp32_groups
    for i, master in enumerate(masters):
        rank = dist.get_rank(group=zero_optimizer.real_dp_process_group[i])
        freed += _share(zero_optimizer.parallel_partitioned_bit16_groups[i][rank], master)
    if freed:
        # DeepSpeed's per-parameter views of the masters (safe_get_full_fp32_param, universal
        # checkpoints) point at the clones: link them to the shared storage, as DeepSpeed does
        # itself after moving a partition, and the optimizer-state views again on the next step
        zero_optimizer._link_all_hp_params()
        zero_optimizer._hp_optimizer_states_linked = False
    return freed


def share_zero3_fp32_partitions(zero3_optimizer: Any) -> int:
    """Make every fp32 master sub-group of ``zero3_optimizer`` (DeepSpeed's ZeRO-3 optimizer)
    the weight partitions it was cloned from, where both have the same dtype, device and size
    and neither optimizer nor weights are offloaded; -> bytes freed on this rank."""
    if not hasattr(zero3_optimizer, "fp32_partitioned_groups_flat"):
        return 0
    if zero3_optimizer.offload_optimizer or zero3_optimizer.offload_param:
        return 0
    pairs = zip(
        zero3_optimizer.fp16_partitioned_groups_flat,
        zero3_optimizer.fp32_partitioned_groups_flat,
        strict=True,
    )
    return sum(_share(weights, master) for weights, master in pairs if weights is not None)


def _share(weights: torch.Tensor, master: torch.Tensor) -> int:
    """Point ``master`` at ``weights``' storage (the values it was cloned from) when both have
    the same dtype, device and shape; -> the bytes freed."""
    if (weights.dtype, weights.device, weights.shape) != (
        master.dtype,
        master.device,
        master.shape,
    ):
        return 0
    if weights.data_ptr() == master.data_ptr():
        return 0
    master.data = weights.data
    return master.numel() * master.element_size()
