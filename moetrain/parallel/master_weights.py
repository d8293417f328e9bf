"""fp32 master weights in the checkpoint's model files, under bf16/fp16.

With bf16 or fp16 the engine's module holds the low-precision copy of every weight; the weights
the optimizer updates are the fp32 masters inside DeepSpeed's ZeRO optimizer, partitioned over
the data-parallel ranks. :func:`fp32_masters_in_module` puts the whole fp32 master of each
parameter a rank writes into the module, in host memory, for the duration of a checkpoint save,
so that DeepSpeed's dense and per-expert model files hold the fp32 masters: ``moetrain convert``
and the checkpoint readers then export the weights training really reached, in any ``--dtype``.

Which rank writes what is DeepSpeed's rule (its default checkpoint engine): the dense file is
written by data-parallel rank 0, an expert's file by expert-data-parallel rank 0 of its expert
group. Every rank takes part in every parameter's gather (one all-reduce over its data-parallel
group), but only a writer keeps the result: a rank's extra host memory during a save is the
fp32 masters of the weights it writes (rank 0: the dense weights and its experts; a rank that
writes nothing: one parameter at a time). ``moetrain plan`` counts it.

Resuming needs nothing else: DeepSpeed copies the fp32 values into the low-precision module
(rounding to nearest, the rounding that made the live copy) and restores the masters from its
optimizer shards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from moetrain.parallel.deepspeed import is_ep_sharded


def writes_to_checkpoint(param: nn.Parameter) -> bool:
    """Whether this rank writes ``param`` into a checkpoint's model files (DeepSpeed's default
    checkpoint engine: data-parallel rank 0 writes the dense file, expert-data-parallel rank 0
    of an expert's group its file). Needs DeepSpeed's process groups (an initialised engine)."""
    from deepspeed.utils import groups

    if is_ep_sharded(param):
        return groups._get_expert_data_parallel_rank(param.group_name) == 0
    return groups._get_sequence_data_parallel_rank() == 0


@contextmanager
def fp32_masters_in_module(model: nn.Module) -> Iterator[int]:
    """Inside the context, every non-fp32 parameter of ``model`` (an engine's module under
    ZeRO-1/2) that this rank writes into the checkpoint holds its fp32 master weight in host
    memory; yields how many were swapped.

    Collective: every rank must enter it, with the same model structure. The parameters'
    storage is put back on exit, also after an error.
    """
    params = [p for p in model.parameters() if p.dtype != torch.float32]
    swapped: list[tuple[nn.Parameter, torch.Tensor]] = []
    try:
        if params:
            from deepspeed.utils import safe_get_full_fp32_param

            for p in params:
                master = safe_get_full_fp32_param(p)  # collective: every rank gathers
                if master is None:
                    raise RuntimeError(
                        f"no fp32 master weight for a {p.dtype} parameter of shape "
                        f"{tuple(p.shape)}: {p.dtype} training needs parallel.zero_stage=1 or 2"
                    )
                if not writes_to_checkpoint(p):
                    del master  # another rank writes it: nothing kept
                    continue
                swapped.append((p, p.data))
                p.data = master.detach().cpu()  # a fresh buffer: no alias
        yield len(swapped)
    finally:
        for p, data in swapped:
            p.data = data
