"""ZeRO-1/2's optimizer step without a second copy of the rank's gradient partition.

At the optimizer step DeepSpeed's ZeRO-1/2 optimizer concatenates each parameter group's
gradient partition (the gradients of the rank's slice, ``averaged_gradients[i]``, a list of
per-parameter tensors) into one new flat tensor (``torch.cat``) and hands that to the optimizer
as the fp32 master partition's gradient: a partition-sized allocation at the step and a pass over
its memory, for values the rank already holds in one buffer. With contiguous gradients DeepSpeed
copies each reduced gradient of the rank's partition into that buffer (``grads_in_partition``),
but in the order backward produces them, roughly the reverse of the partition's, so the per-
parameter tensors are not one run of memory.

:func:`flatten_grad_partitions_in_place` changes two things on the optimizer instance:

- each gradient's place in ``grads_in_partition`` is its place in the partitions (groups in
  order, each group's parameters in order), fixed once, instead of the next free place; every
  other step of the copy is DeepSpeed's;
- the step's first question for a partition (``_get_preflattened_grad_partition``, which DeepSpeed
  answers itself only for its compact fp32-accumulation buffers) is then answered with the span
  of that buffer, where the partition's tensors are exactly one contiguous run of memory
  (:func:`contiguous_span`); anywhere else (a padded last partition, offload, the compact
  buffers) DeepSpeed's own answer or concatenation stands.

The optimizer gets the same values either way, so training stays bit-identical.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["HOOKED_METHODS", "contiguous_span", "flatten_grad_partitions_in_place"]

HOOKED_METHODS = ("copy_grads_in_partition", "_get_preflattened_grad_partition")
"""The optimizer methods :func:`flatten_grad_partitions_in_place` replaces on the instance
(deleting these instance attributes restores DeepSpeed's own)."""


def contiguous_span(tensors: Sequence[torch.Tensor], numel: int) -> torch.Tensor | None:
    """A flat view of ``tensors`` when they lie one after another in one storage, each
    contiguous, with one dtype, ``numel`` elements in all; else None."""
    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr()
    for t in tensors:
        if (
            t.dtype != first.dtype
            or t.device != first.device
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != storage
            or t.data_ptr() != end
        ):
            return None
        end += t.numel() * t.element_size()
    if end - first.data_ptr() != numel * first.element_size():
        return None
    return first.as_strided((numel,), (1,), first.storage_offset())


def _partition_offsets(zero_optimizer: Any) -> tuple[dict[int, int], int]:
    """Each in-partition parameter's offset in ``grads_in_partition`` in partition order (by
    DeepSpeed's parameter id), and the buffer's size (DeepSpeed's: every such parameter whole)."""
    offsets: dict[int, int] = {}
    total = 0
    for group in zero_optimizer.params_in_partition:
        for param in group:
            offsets[zero_optimizer.get_param_id(param)] = total
            total += param.numel()
    return offsets, total


def flatten_grad_partitions_in_place(zero_optimizer: Any) -> bool:
    """Install the two changes of the module docstring on ``zero_optimizer`` (DeepSpeed's
    ZeRO-1/2 optimizer); -> whether they were installed (False where it lacks the hooks, e.g. an
    optimizer DeepSpeed's stage 0 uses, or offloads the optimizer)."""
    needed = (*HOOKED_METHODS, "averaged_gradients")
    if getattr(zero_optimizer, "cpu_offload", True) or not all(
        hasattr(zero_optimizer, name) for name in needed
    ):
        return False
    deepspeeds_span = zero_optimizer._get_preflattened_grad_partition
    deepspeeds_copy = zero_optimizer.copy_grads_in_partition
    offsets, total = _partition_offsets(zero_optimizer)

    def copy_grads_in_partition(param: torch.Tensor, group_idx: int | None = None) -> None:
        if group_idx is None:
            group_idx = zero_optimizer._get_param_group_idx(param)
        if zero_optimizer._use_compact_grad_partition_buffer(group_idx):
            return deepspeeds_copy(param, group_idx)
        if zero_optimizer.grads_in_partition is None:
            zero_optimizer.grads_in_partition_offset = 0
            zero_optimizer.grads_in_partition = torch.empty(
                total, dtype=zero_optimizer.dtype, device=param.device
            )
        grad = zero_optimizer.get_gradient_for_reduction(param)
        start = offsets[zero_optimizer.get_param_id(param)]
        place = zero_optimizer.grads_in_partition.narrow(0, start, param.numel())
        place.copy_(grad.view(-1))
        grad.data = place.view_as(grad)
        zero_optimizer.grads_in_partition_offset += param.numel()
        return None

    def grad_partition(group_idx: int) -> torch.Tensor | None:
        flat = deepspeeds_span(group_idx)
        grads = zero_optimizer.averaged_gradients.get(group_idx)
        if flat is not None or grads is None:
            return flat
        return contiguous_span(grads, int(zero_optimizer.partition_size[group_idx]))

    zero_optimizer.copy_grads_in_partition = copy_grads_in_partition
    zero_optimizer._get_preflattened_grad_partition = grad_partition
    return True
