"""The expert all-to-alls of a layout, for ``moetrain plan``: how many EP ranks and nodes one
token's rows reach at most, and with balanced routing the rows per token that leave a GPU or a
node and the bytes each GPU sends per optimizer step.

The dispatcher sends a token's row once to each EP rank holding one of its experts (two ranks on
one remote node get a row each: there is no per-node forwarding) and gets one row back; a
group-limited token (``moe.n_group``, ``moe.topk_group``) reaches only the ranks of
its ``topk_group`` groups. Expert-parallel groups are blocks of ``ep_size`` consecutive ranks and
ranks fill nodes of ``gpus_per_node`` in order, so when an EP group spans nodes, EP rank r sits
on the group's node ``r // gpus_per_node``.

Balanced routing: each token picks ``topk_group`` groups uniformly, then ``top_k`` experts
uniformly among theirs, and lives on any EP rank with equal chance (estimated by sampling with a
fixed seed). Bytes per off-rank row and MoE layer: the row (``d_model`` x activation bytes) and
its 2 x top_k fp32 slot values out, the result row back; backward sends the same again, and
activation checkpointing repeats the forward's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from moetrain.config import Config
from moetrain.model.mixers import mixer_class


@dataclass(frozen=True)
class Traffic:
    """Expert all-to-all fan-out and volume of one layout (see the module docstring)."""

    ep_size: int
    ep_nodes: int  # nodes one EP group spans
    max_ranks: int  # most EP ranks one token's rows reach
    max_nodes: int  # most nodes they reach
    rows_off_rank: float  # per token and MoE layer, balanced routing
    rows_off_node: float
    bytes_per_gpu_step: float  # sent by each GPU per optimizer step


def _spans(cfg: Config, per_rank: int, gpus_per_node: int) -> list[tuple[set[int], set[int]]]:
    """The EP ranks and nodes of each expert group."""
    e, g = cfg.moe.num_experts, cfg.moe.n_group
    size = e // g
    out = []
    for group in range(g):
        ranks = {x // per_rank for x in range(group * size, (group + 1) * size)}
        out.append((ranks, {r // gpus_per_node for r in ranks}))
    return out


def expert_traffic(
    cfg: Config,
    tokens_per_gpu_step: int,
    gpus_per_node: int,
    act_bytes: int,
    recompute: bool = False,
    samples: int = 4096,
) -> Traffic:
    """:class:`Traffic` of ``cfg``'s layout (``parallel.ep_size``) and routing."""
    moe, ep = cfg.moe, cfg.parallel.ep_size
    per_rank = moe.num_experts // ep
    ep_nodes = max(1, -(-ep // gpus_per_node))
    spans = _spans(cfg, per_rank, gpus_per_node)
    widest = sorted(spans, key=lambda s: len(s[0]), reverse=True)[: moe.topk_group]
    max_ranks = min(moe.top_k, ep, sum(len(r) for r, _ in widest))
    by_nodes = sorted(spans, key=lambda s: len(s[1]), reverse=True)[: moe.topk_group]
    max_nodes = min(moe.top_k, ep_nodes, sum(len(n) for _, n in by_nodes))

    rng = random.Random(0)
    size = moe.num_experts // moe.n_group
    off_rank = off_node = 0.0
    for _ in range(samples):
        groups = rng.sample(range(moe.n_group), moe.topk_group)
        experts = rng.sample([g * size + i for g in groups for i in range(size)], moe.top_k)
        ranks = {x // per_rank for x in experts}
        off_rank += len(ranks) * (1 - 1 / ep)  # the token's own rank: any of the ep
        off_node += len(ranks) * (1 - 1 / ep_nodes)  # a row per rank, also to a remote node
    off_rank, off_node = off_rank / samples, off_node / samples
    n_moe = len(moe.moe_layers(cfg.model.n_blocks))
    row_bytes = 2 * cfg.model.d_model * act_bytes + 8 * moe.top_k
    passes = 3 if recompute else 2  # forward, backward (and forward again)
    volume = tokens_per_gpu_step * n_moe * off_rank * row_bytes * passes
    return Traffic(ep, ep_nodes, max_ranks, max_nodes, off_rank, off_node, volume)


def format_traffic(t: Traffic, gpus_per_node: int) -> str:
    """One line of ``moetrain plan``."""
    if t.ep_size == 1:
        return "expert all-to-all: none (parallel.ep_size=1)"
    nodes = (
        f"; EP group spans {t.ep_nodes} nodes of {gpus_per_node} GPUs, at most {t.max_nodes} "
        f"per token, {t.rows_off_node:.2f} rows per token leave the node"
        if t.ep_nodes > 1
        else ""
    )
    return (
        f"expert all-to-all: a token's rows reach at most {t.max_ranks} of {t.ep_size} EP "
        f"ranks; balanced routing sends {t.rows_off_rank:.2f} rows per token and MoE layer to "
        f"other GPUs{nodes}; {t.bytes_per_gpu_step / 2**30:.2f} GiB sent per GPU per step"
    )


@dataclass(frozen=True)
class HeadTraffic:
    """Sequence parallelism's head all-to-alls (``parallel.sp_size`` = n): per mixer layer and
    micro-batch, forward sends what the mixer exchanges (attention: q, k and v, key/value heads
    repeated where n does not divide them, and the output back in sequence order); backward
    sends the same again, and activation checkpointing repeats the forward's. Of each exchange
    ``(n - 1) / n`` leaves the GPU; an SP group is n consecutive ranks, so it spans nodes only
    when n exceeds ``gpus_per_node``."""

    sp_size: int
    sp_nodes: int  # nodes one SP group spans
    bytes_per_token_layer: float  # sent off the GPU per local token and mixer layer, forward
    bytes_per_gpu_step: float


def head_traffic(
    cfg: Config,
    tokens_per_gpu_step: int,
    gpus_per_node: int,
    act_bytes: int,
    recompute: bool = False,
) -> HeadTraffic:
    """:class:`HeadTraffic` of ``cfg`` (``tokens_per_gpu_step``: this GPU's slice of the
    tokens of one optimizer step); each mixer says what it exchanges
    (:meth:`moetrain.model.mixers.TokenMixer.exchange_bytes_per_token`)."""
    m, n = cfg.model, cfg.parallel.sp_size
    per_layer = [
        mixer_class(layer.mixer).exchange_bytes_per_token(m, layer.mixer, act_bytes, n)
        for layer in cfg.layer_plan()
        if layer.mixer is not None
    ]
    per_token = sum(per_layer)
    passes = 3 if recompute else 2
    return HeadTraffic(
        sp_size=n,
        sp_nodes=-(-n // gpus_per_node),
        bytes_per_token_layer=per_token / max(1, len(per_layer)),
        bytes_per_gpu_step=per_token * passes * tokens_per_gpu_step,
    )


def format_head_traffic(t: HeadTraffic) -> str:
    """One line of ``moetrain plan``."""
    if t.sp_size == 1:
        return "sequence-parallel all-to-all: none (parallel.sp_size=1)"
    where = f"across {t.sp_nodes} nodes" if t.sp_nodes > 1 else "within a node"
    return (
        f"sequence-parallel all-to-all (heads <-> sequence, {t.sp_size} ranks {where}): "
        f"{t.bytes_per_token_layer:,.0f} bytes per token and layer leave the GPU in forward; "
        f"{t.bytes_per_gpu_step / 2**30:.2f} GiB sent per GPU per step"
    )
