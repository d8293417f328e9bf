"""The most gradient memory a rank holds at once during a DeepSpeed ZeRO step, counted tensor by
tensor (each storage once; :class:`GradientPeak`), for the checks of ``moetrain plan``'s
gradient term against what DeepSpeed allocates."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages under ``tensors``."""
    return sum(_storages(tensors).values())


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _autograd_gradients(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The gradients autograd put on the parameters (``.grad``, ``.grad_accum``)."""
    for p in model.parameters():
        for t in (p.grad, getattr(p, "grad_accum", None)):
            if t is not None:
                yield t


def _deepspeed_gradients(opt: Any) -> Iterator[torch.Tensor]:
    """DeepSpeed's gradient buffers: ZeRO-1/2's partition buffer and its accumulated and
    averaged views, BF16_Optimizer's fp32 buffers, ZeRO-3's partitions."""
    if getattr(opt, "grads_in_partition", None) is not None:
        yield opt.grads_in_partition
    for name in ("all_grad_tensors", "averaged_gradients"):
        for ts in (getattr(opt, name, None) or {}).values():
            yield from ts or ()
    yield from getattr(opt, "fp32_groups_gradients_flat", ())
    if getattr(opt, "grad_partitions_flat_buffer", None) is not None:
        yield opt.grad_partitions_flat_buffer


def _bucket_buffers(opt: Any) -> Iterator[torch.Tensor]:
    """The reduce buckets' buffers: a list of tensors at ZeRO-1/2, one flat tensor (or None) at
    ZeRO-3. A tensor is taken whole: iterating it would unbind it into one view per element
    (a 2M-element bucket makes about a gigabyte of views at once)."""
    for bucket in getattr(opt, "ipg_buckets", {}).values():
        if isinstance(bucket.buffer, torch.Tensor):
            yield bucket.buffer
        else:
            yield from bucket.buffer or ()


class GradientPeak:
    """The most gradient memory a rank holds at once, in bytes, sampled after every copy of a
    gradient into ZeRO-1/2's partition buffer (where DeepSpeed allocates it, beside the
    gradients still to be reduced) and at :meth:`sample` (call it before the optimizer step):
    ``buffers`` DeepSpeed's buffers alone, ``peak`` with autograd's gradients not yet in them
    (held whole until the reduce at ZeRO-1 after the backward; at ZeRO-2 in flight to their
    bucket, which ``plan`` counts apart). The reduce buckets (``reduce_bucket_size``, reused for
    every bucket of a backward) are not counted: ``plan`` counts them apart, as framework
    memory."""

    def __init__(self, trainer: Any) -> None:
        self.opt, self.model = trainer.engine.optimizer, trainer.model
        self.peak = self.buffers = 0
        copy = getattr(self.opt, "copy_grads_in_partition", None)
        if copy is not None:

            def copy_and_sample(*args: Any, **kwargs: Any) -> Any:
                out = copy(*args, **kwargs)
                self.sample()
                return out

            self.opt.copy_grads_in_partition = copy_and_sample

    def sample(self) -> None:
        """Count the gradient memory held now (``peak`` and ``buffers`` keep the largest)."""
        buckets = {t.untyped_storage().data_ptr() for t in _bucket_buffers(self.opt)}
        buffers = _storages(_deepspeed_gradients(self.opt))
        autograd = _storages(_autograd_gradients(self.model))
        held = {p: n for p, n in (buffers | autograd).items() if p not in buckets}
        self.peak = max(self.peak, sum(held.values()))
        self.buffers = max(self.buffers, sum(buffers.values()))
