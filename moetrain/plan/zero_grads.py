"""The gradient memory of DeepSpeed's ZeRO-1/2 optimizer per GPU (DeepSpeed 0.19,
``runtime/zero/stage_1_and_2.py``), for ``moetrain plan``.

DeepSpeed flattens each optimizer parameter group (``optim.name``'s groups, with DeepSpeed's MoE
split: dense groups partitioned over every GPU, each expert group over its expert-data-parallel
group) into one buffer, pads it to a multiple of twice the group's size and cuts it into equal
partitions, one per rank. What it keeps of the gradients depends on the accumulation dtype:

- ``train.grad_dtype`` differs from ``train.precision`` (bf16/fp16 weights, fp32 gradients, the
  default under bf16): ZeRO-2 reduces into an fp32 buffer of exactly the rank's partition, and
  ZeRO-1 (DeepSpeed's BF16_Optimizer) keeps whole fp32 gradients; ``plan``'s plain split.
- the same dtype (fp32 training, or bf16 gradients): the **partition buffer** of
  ``contiguous_gradients`` (``copy_grads_in_partition``) holds every parameter that overlaps the
  rank's partition *whole*, so a partition plus the parameters its edges cut (the embedding and
  the LM head are the large ones), summed over the groups, and the zeros that pad a partition
  past its group's end; the largest rank counts (:func:`partition_buffer_elements`). Beside it:

  - ZeRO-2 with ``train.grad_accum_steps`` > 1: the earlier micro-batches' sum
    (``all_grad_tensors``, a previous partition buffer) while the next backward fills a new
    one: **two buffers**;
  - ZeRO-1: the **whole gradients** autograd holds until DeepSpeed reduces them, which it does
    after the backward with ``parallel.overlap_comm`` off (each gradient as it is ready with it
    on, but only in the last micro-batch when ``train.grad_accum_steps`` > 1, the earlier ones
    summing whole). It allocates the partition buffer at its first reduce, when the gradients
    of that first reduce bucket have moved into the bucket and all others are still held
    (:func:`first_bucket_elements`; the groups' order, as the reduce after the backward takes
    them).

The reduce bucket (``reduce_bucket_size``, allocated afresh each micro-batch, twice with
``overlap_comm``) and the all-gather bucket are ``plan``'s framework term; a gradient larger than
the bucket is reduced where autograd put it, the largest parameter's fresh gradient term.
"""

from __future__ import annotations

import bisect
import math
from itertools import accumulate

from moetrain.config import Config
from moetrain.model import param_names
from moetrain.optim.groups import trainable
from moetrain.optim.kinds import meta_model
from moetrain.optim.registry import optimizer_spec

ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor: a group pads to 2 x its ranks


def keeps_partition_buffer(cfg: Config) -> bool:
    """Whether DeepSpeed's ZeRO-1/2 optimizer keeps ``cfg``'s gradients in the partition buffer
    of whole parameters (module docstring): ZeRO-1/2, not offloaded, gradients accumulated in
    the weights' own dtype."""
    p, t = cfg.parallel, cfg.train
    return p.zero_stage in (1, 2) and not p.offload_optimizer and t.grad_dtype == t.precision


def group_sizes(cfg: Config) -> list[tuple[bool, list[int]]]:
    """``(expert group, element counts of its parameters in order)`` of every parameter group
    DeepSpeed gets for ``cfg`` (one GPU's share: its ``num_experts / ep_size`` experts)."""
    import torch

    ep = cfg.parallel.ep_size
    model = meta_model(cfg)
    for name, param in trainable(model):
        if param_names.parse_experts(name) is not None:  # as expert parallelism leaves them
            param.data = torch.empty((param.shape[0] // ep, *param.shape[1:]), device="meta")
            param.allreduce = False  # DeepSpeed's MoE split reads these two
            param.group_name = "experts"
    groups = optimizer_spec(cfg.optim.name).param_groups(model, cfg.optim)
    return [(bool(g.get("moe")), [p.numel() for p in g["params"]]) for g in groups]


def rank_partition_buffer(ends: list[int], ranks: int, rank: int) -> int:
    """Elements DeepSpeed keeps for partition ``rank`` of a group of ``ranks`` whose parameters
    end at the cumulative ``ends``: every parameter overlapping it, whole, and the padding of its
    tail past the group's last element."""
    total = ends[-1]
    size = math.ceil(total / (ALIGNMENT * ranks)) * ALIGNMENT
    start, stop = size * rank, size * (rank + 1)
    first = bisect.bisect_right(ends, start)  # the parameter holding element `start`
    if first == len(ends):  # nothing but padding: DeepSpeed reduces into a zero partition
        return size
    last = bisect.bisect_left(ends, stop)  # the parameter holding element `stop - 1`
    begin = ends[first - 1] if first else 0
    whole = ends[min(last, len(ends) - 1)] - begin
    return whole + max(0, stop - total)


def partition_buffer_elements(groups: list[tuple[bool, list[int]]], world: int, ep: int) -> int:
    """The largest rank's partition buffer (module docstring) over ``world`` GPUs, in elements,
    of the ``groups`` (:func:`group_sizes`): its partition of every dense group (over ``world``)
    and of every expert group (over ``world / ep``, as the ``rank // ep``-th rank of its
    expert-data-parallel group)."""
    groups = [(expert, list(accumulate(sizes))) for expert, sizes in groups if sizes]
    best = 0
    for rank in range(world):
        held = 0
        for expert, ends in groups:
            ranks, index = (world // ep, rank // ep) if expert else (world, rank)
            held += rank_partition_buffer(ends, ranks, index)
        best = max(best, held)
    return best


def first_bucket_elements(groups: list[tuple[bool, list[int]]], bucket: int) -> int:
    """Elements of the gradients in DeepSpeed's first reduce of a step, taking the ``groups``'
    parameters in order: as many as fit in a ``bucket`` of elements, or the first alone when it
    is larger (DeepSpeed reduces such a gradient where it is, by itself)."""
    held = 0
    for _, sizes in groups:
        for n in sizes:
            if held and held + n > bucket:
                return held
            held += n
    return held


def zero12_grad_bytes(cfg: Config, world: int, whole_bytes: int, grad_bytes: int) -> int:
    """Gradient bytes per GPU that DeepSpeed's ZeRO-1/2 optimizer holds at once for ``cfg``
    where :func:`keeps_partition_buffer` (module docstring): the partition buffer, twice at
    ZeRO-2 with gradient accumulation, and at ZeRO-1 beside ``whole_bytes`` (every gradient of
    the GPU's parameters, less the first reduce bucket's) unless each is reduced as it is
    ready. ``grad_bytes``: bytes per gradient element; the bucket: ``plan``'s
    (``parallel.bucket_size`` with CUDA)."""
    p, t = cfg.parallel, cfg.train
    groups = group_sizes(cfg)
    buffer = partition_buffer_elements(groups, world, p.ep_size) * grad_bytes
    accumulating = t.grad_accum_steps > 1
    if p.zero_stage == 2:
        return 2 * buffer if accumulating else buffer
    overlap = True if p.overlap_comm is None else p.overlap_comm  # (on with CUDA)
    if overlap and not accumulating:
        return buffer
    moved = first_bucket_elements(groups, p.bucket_size(True)) * grad_bytes
    return buffer + max(0, whole_bytes - moved)
