"""Muon (``optim.name: muon``): which parameters take it, its groups, its state, and how it
learns where ZeRO cut its matrices. The update itself: :mod:`moetrain.optim.muon_update`.

The matrices (:mod:`moetrain.optim.kinds`) take Muon, except the kinds listed in
``optim.muon.adamw_matrices`` (default: the embedding, the LM head, the router's gate and the
shared expert's gate); norm weights, biases, sinks and anything else that is not a matrix take
AdamW with the ``optim`` settings. Every projection of latent attention is a matrix of its own
(``wq`` or ``wq_a`` / ``wq_b``, ``wkv_a`` with the shared rotary key's rows inside it, ``wkv_b``,
``wo``), as Moonlight and Kimi K2 train them; a routed expert's gate, up and down projections
are three matrices per expert. Groups: ``muon`` (weight decay ``optim.weight_decay``), ``decay``
and ``no_decay`` (AdamW, :func:`moetrain.optim.groups.is_no_decay`), each group's dict saying
its ``update``; experts move to DeepSpeed's MoE groups as with AdamW.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from moetrain.config import Config, OptimConfig
from moetrain.model import param_names
from moetrain.optim.adamw import ADAM_KEYS, say
from moetrain.optim.groups import is_no_decay, split_expert_groups, trainable
from moetrain.optim.kinds import VECTOR, matrix_blocks, meta_model, param_kind
from moetrain.optim.spec import OptimizerSpec

if TYPE_CHECKING:
    import torch
    from torch import nn

MOMENTUM = "momentum_buffer"


def update_of(name: str, ndim: int, optim: OptimConfig) -> str:
    """``muon`` or ``adamw`` for the parameter ``name`` of ``ndim`` dims (module docstring)."""
    kind = param_kind(name, ndim)
    return "adamw" if kind == VECTOR or kind in optim.muon.adamw_matrices else "muon"


def muon_groups(model: nn.Module, optim: OptimConfig) -> list[dict[str, Any]]:
    """The ``muon``, ``decay`` and ``no_decay`` groups, split for DeepSpeed's experts."""
    muon, decay, no_decay = [], [], []
    for name, p in trainable(model):
        if update_of(name, p.ndim, optim) == "muon":
            muon.append(p)
        else:
            (no_decay if is_no_decay(name, p, optim.decay_embeddings) else decay).append(p)
    wd = optim.weight_decay
    return split_expert_groups(
        [
            {"name": "muon", "update": "muon", "params": muon, "weight_decay": wd},
            {"name": "decay", "update": "adamw", "params": decay, "weight_decay": wd},
            {"name": "no_decay", "update": "adamw", "params": no_decay, "weight_decay": 0.0},
        ]
    )


def build_muon(
    model: nn.Module, groups: list[dict[str, Any]], optim: OptimConfig, device: torch.device
) -> Any:
    """:class:`moetrain.optim.muon_update.Muon` over ``groups`` of ``model``."""
    from moetrain.optim.muon_update import Muon

    names = {id(p): n for n, p in model.named_parameters()}
    clip = f", QK-clip at {optim.muon.qk_clip:g}" if optim.muon.qk_clip > 0 else ""
    say(f"optimizer: Muon ({optim.muon.ns_steps} Newton-Schulz steps{clip}) + AdamW(fused=True)")
    return Muon(groups, names, optim)


def muon_state_keys(group: Mapping[str, Any]) -> tuple[str, ...]:
    """A Muon group's momentum, an AdamW group's two moments."""
    return (MOMENTUM,) if group.get("update") == "muon" else ADAM_KEYS


def attach_partitions(optimizer: Any, engine_optimizer: Any) -> None:
    """Tell ``optimizer`` (:class:`~moetrain.optim.muon_update.Muon`) which slice of which
    parameter lies where in each ZeRO-1/2 partition, and agree on each Muon group's cut
    matrices (collective over each group's data-parallel ranks). Nothing at stage 0."""
    from moetrain.optim.partitions import agree_on_cut_blocks, partition_pieces

    if not hasattr(engine_optimizer, "_param_slice_mappings"):
        return
    model_groups = getattr(engine_optimizer, "bit16_groups", None)
    if model_groups is None:  # DeepSpeed's bf16 optimizer (ZeRO-1 with fp32 accumulation)
        model_groups = engine_optimizer.bf16_groups
    for i, group in enumerate(optimizer.param_groups):
        pieces, order = partition_pieces(model_groups[i], optimizer.names)
        exchange = None
        if group["update"] == "muon":
            exchange = agree_on_cut_blocks(pieces, order, engine_optimizer.real_dp_process_group[i])
        optimizer.pieces[id(group["params"][0])] = (pieces, exchange)


def newton_schulz_step_flops(cfg: Config, gpus: int) -> int:
    """Newton-Schulz FLOPs of one step per GPU: at ZeRO-1/2 each rank orthogonalises the
    matrices of its partition (dense ones over every rank, its experts over their
    expert-data-parallel group: 1 / gpus of them all either way; a cut matrix twice, not
    counted); at stage 0 every rank all the dense ones and its experts'."""
    from moetrain.optim.newton_schulz import newton_schulz_flops

    dense = expert = 0
    steps = cfg.optim.muon.ns_steps
    for name, p in trainable(meta_model(cfg)):
        if update_of(name, p.ndim, cfg.optim) != "muon":
            continue
        flops = 0
        for block in matrix_blocks(name, tuple(p.shape)):
            width = block.cols // block.splits
            flops += block.splits * newton_schulz_flops(block.rows, width, steps)
        if param_names.parse_experts(name) is None:
            dense += flops
        else:
            expert += flops
    if cfg.parallel.zero_stage > 0:
        return (dense + expert) // gpus
    return dense + expert // cfg.parallel.ep_size


def muon_qk_clip(optim: OptimConfig) -> float:
    """``optim.muon.qk_clip`` (MuonClip's threshold; 0: off)."""
    return optim.muon.qk_clip


MUON = OptimizerSpec(
    name="muon",
    update_of=update_of,
    update_bytes={"muon": 4, "adamw": 8},
    param_groups=muon_groups,
    build=build_muon,
    state_keys=muon_state_keys,
    attach=attach_partitions,
    qk_clip=muon_qk_clip,
    step_flops=newton_schulz_step_flops,
)
