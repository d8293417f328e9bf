"""fp32 master weights in the checkpoint's model files, under bf16/fp16.

With bf16 or fp16 the engine's module holds the low-precision copy of every weight; the weights
the optimizer updates are the fp32 masters inside DeepSpeed's ZeRO optimizer, partitioned over
the data-parallel ranks. :func:`fp32_masters_in_module` puts each parameter's whole fp32 master
(gathered with DeepSpeed's ``safe_get_full_fp32_param``, one all-reduce over that parameter's
data-parallel group) into the module, in host memory, for the duration of a checkpoint save, so
that DeepSpeed's dense and per-expert model files hold the fp32 masters: ``moetrain convert``
and the checkpoint readers then export the weights training really reached, in any ``--dtype``.

Resuming needs nothing else: DeepSpeed copies the fp32 values into the low-precision module
(rounding to nearest, the rounding that made the live copy) and restores the masters from its
optimizer shards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def fp32_masters_in_module(model: nn.Module) -> Iterator[int]:
    """Inside the context, every non-fp32 parameter of ``model`` (an engine's module under
    ZeRO-1/2) holds its fp32 master weight in host memory; yields how many were swapped.

    Collective: every rank must enter it, with the same model structure. The parameters'
    storage is put back on exit, also after an error.
    """
    params = [p for p in model.parameters() if p.dtype != torch.float32]
    swapped: list[tuple[nn.Parameter, torch.Tensor]] = []
    try:
        if params:
            from deepspeed.utils import safe_get_full_fp32_param

            for p in params:
                master = safe_get_full_fp32_param(p)
                if master is None:
                    raise RuntimeError(
                        f"no fp32 master weight for a {p.dtype} parameter of shape "
                        f"{tuple(p.shape)}: {p.dtype} training needs parallel.zero_stage=1 or 2"
                    )
                swapped.append((p, p.data))
                p.data = master.detach().cpu()  # a fresh buffer: no alias
        yield len(swapped)
    finally:
        for p, data in swapped:
            p.data = data
