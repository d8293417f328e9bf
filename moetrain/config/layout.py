"""The layout rules of a run, owned here and nowhere else: world = data-parallel x
expert-parallel, sequence parallelism, the ZeRO stage, and the batch they imply.

Pure Python (no torch), so config validation, `moetrain plan` and the topology all run the same
checks before anything heavy starts. Every error is a ``ConfigError`` naming the key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moetrain.config.checks import ConfigError
from moetrain.config.layer_plan import LINEAR, layer_types
from moetrain.config.mixers import mixer_kind
from moetrain.config.ranges import check_ranges

if TYPE_CHECKING:
    from moetrain.config import Config


def check_experts_divisible(num_experts: int, ep_size: int) -> None:
    """Expert parallelism splits every MoE layer's experts evenly over the EP ranks."""
    if ep_size < 1 or num_experts % ep_size:
        raise ConfigError(
            f"parallel.ep_size: must divide moe.num_experts={num_experts}; got {ep_size}"
        )


def check_sequence_parallel(cfg: Config) -> None:
    """What sequence parallelism (``parallel.sp_size`` > 1) needs and what it refuses.

    Each rank of a sequence-parallel group holds ``data.seq_len / sp_size`` consecutive tokens
    of the same sequences and, inside each token mixer, its heads split ``sp_size`` ways over
    the whole sequences (the head counts each mixer kind names,
    :meth:`moetrain.config.mixers.MixerKind.sp_heads`: ``model.n_heads`` for attention, whose
    key/value heads are replicated where ``model.n_kv_heads`` is not a multiple of
    ``sp_size``). Refused: the per-sequence balance loss (a sequence's tokens are split over
    ranks), multi-token prediction (its shifts cross the ranks' slices), and a capacity factor
    unless each expert-parallel group holds whole sequence-parallel groups (capacity counts an
    EP group's tokens: over slices of rows it would drop other copies than at sp_size 1).
    """
    sp = cfg.parallel.sp_size
    if sp == 1:
        return
    m = cfg.model
    kinds = {s.mixer.kind for s in cfg.layer_plan() if s.mixer is not None}
    for key, heads in sorted({h for kind in kinds for h in mixer_kind(kind).sp_heads(m)}):
        if heads % sp:
            raise ConfigError(
                f"parallel.sp_size: must divide {key}={heads} (each rank takes "
                f"{key.rpartition('.')[2]} / sp_size of them over the whole sequences); got {sp}"
            )
    if cfg.data.seq_len % sp:
        raise ConfigError(
            f"parallel.sp_size: must divide data.seq_len={cfg.data.seq_len} (each rank holds "
            f"seq_len / sp_size tokens of every sequence); got {sp}"
        )
    if cfg.moe.aux_loss_scope == "sequence":
        raise ConfigError(
            f"moe.aux_loss_scope: sequence is not supported with parallel.sp_size={sp} (a "
            "sequence's tokens are split over the sequence-parallel ranks); use "
            "global_micro_batch or global_batch, or parallel.sp_size=1"
        )
    ep = cfg.parallel.ep_size
    if cfg.moe.capacity_factor > 0 and ep % sp:
        raise ConfigError(
            f"moe.capacity_factor: with parallel.sp_size={sp} an expert's capacity is counted "
            f"over its expert-parallel group's tokens, which at parallel.ep_size={ep} are slices "
            "of rows: the drops would differ from sp_size 1. Set parallel.ep_size to a multiple "
            f"of {sp} (each EP group then holds whole rows), or moe.capacity_factor=0 (dropless)"
        )
    if m.mtp_depth > 0:
        raise ConfigError(
            f"model.mtp_depth: multi-token prediction is not supported with parallel.sp_size="
            f"{sp} (its shifted inputs and targets cross the ranks' sequence slices); got "
            f"{m.mtp_depth}; use model.mtp_depth=0 or parallel.sp_size=1"
        )


def check_zero3(cfg: Config) -> None:
    """What ZeRO-3 (``parallel.zero_stage=3``, :mod:`moetrain.parallel.zero3`) refuses: shadow
    experts (the dispatcher hands a replica its owner's stacked weights outside the experts'
    forward, where ZeRO-3 holds only a partition of them), fp16 (its loss scaling at ZeRO-3 is
    not proven here; bf16 is), optimizer offload (not proven here either), sparse
    attention and linear-attention layers (not proven against stage 2 yet). Sequence
    parallelism is supported (tests/distributed/test_zero3.py)."""
    p, t = cfg.parallel, cfg.train
    if p.zero_stage != 3:
        return
    if p.shadow_experts:
        raise ConfigError(
            f"parallel.shadow_experts: not supported with parallel.zero_stage=3 (a replica is sent "
            f"its owner's whole stacked weights, which ZeRO-3 partitions); got "
            f"{p.shadow_experts}; set parallel.shadow_experts=0 or parallel.zero_stage=2"
        )
    if t.precision == "fp16":
        raise ConfigError(
            "train.precision: fp16 is not supported with parallel.zero_stage=3; use bf16 (fp32 "
            "master weights, fp32 gradient accumulation and reduction, exact skipped steps) or "
            "parallel.zero_stage=2"
        )
    if p.offload_optimizer:
        raise ConfigError(
            "parallel.offload_optimizer: not supported with parallel.zero_stage=3; set "
            "parallel.offload_optimizer=false or parallel.zero_stage=2"
        )
    if cfg.model.index_topk is not None:
        raise ConfigError(
            f"model.index_topk: sparse attention is not supported with parallel.zero_stage=3 "
            f"yet (not proven against stage 2); got {cfg.model.index_topk}; set "
            f"parallel.zero_stage=2"
        )
    linear = [i for i, kind in enumerate(layer_types(cfg.model)) if kind == LINEAR]
    if linear:
        raise ConfigError(
            f"model.layer_types: linear-attention layers ({cfg.model.linear_attention}, layers "
            f"{linear}) are not supported with parallel.zero_stage=3 yet (not proven against "
            f"stage 2); set parallel.zero_stage=2"
        )


def check_layout(cfg: Config, world_size: int | None = None) -> int | None:
    """Check ``cfg``'s layout, and with ``world_size`` also against that world; return the
    data-parallel size (None without a world).

    Every sequence-parallel group (``parallel.sp_size`` consecutive ranks) reads its own data
    (expert-parallel peers are data-parallel for dense weights), so the data-parallel size for
    the batch is ``world / sp_size``; for the gradient reduction every rank counts as a
    data-parallel rank (each rank's loss is the mean over its own tokens, and the average over
    every rank is the global mean). ZeRO-3 partitions the dense weights over every rank and
    each expert's over its expert-data-parallel group; :func:`check_zero3` says what it
    refuses. Sparse attention's dense warm-up runs at stage 0 where the model has MoE layers
    (its frozen experts leave DeepSpeed's ZeRO-1/2 MoE optimizer nothing to hold). Stage 0 runs
    fp32 only: the
    bf16/fp16 numerics policy (fp32 gradient accumulation and reduction, exact skipped steps)
    needs DeepSpeed's ZeRO-1/2 optimizers (the stage's range is declared on the field, and
    checked here again for a config changed after loading).
    """
    p, t = cfg.parallel, cfg.train
    check_ranges(p, "parallel")
    check_experts_divisible(cfg.moe.num_experts, p.ep_size)
    check_sequence_parallel(cfg)
    check_zero3(cfg)
    if p.shadow_experts and cfg.moe.capacity_factor > 0:
        raise ConfigError(
            f"parallel.shadow_experts: needs dropless routing (moe.capacity_factor=0); got "
            f"moe.capacity_factor={cfg.moe.capacity_factor}. A capacity drops copies over every "
            "copy an expert receives, and a shadowed expert's copies are computed where they "
            "come from; set parallel.shadow_experts=0 or moe.capacity_factor=0"
        )
    if p.shadow_experts and cfg.moe.expert_biases:
        raise ConfigError(
            "parallel.shadow_experts: not supported with moe.expert_biases (a replica is sent "
            "its expert's weights, not its biases); set parallel.shadow_experts=0"
        )
    warmup = cfg.model.index_stage == "dense_warmup"
    if warmup and p.zero_stage > 0 and cfg.moe.moe_layers(cfg.model.n_blocks):
        raise ConfigError(
            f"parallel.zero_stage: sparse attention's dense warm-up (model.index_stage="
            f"dense_warmup) trains the indexers alone, every other parameter frozen, and "
            f"DeepSpeed's ZeRO-{p.zero_stage} optimizer needs trainable expert parameters in "
            "a model with MoE layers; use parallel.zero_stage=0 (the optimizer then holds only "
            "the indexers' state: nothing worth partitioning)"
        )
    if p.zero_stage == 0 and t.precision != "fp32":
        raise ConfigError(
            f"parallel.zero_stage: stage 0 supports train.precision=fp32 only; got "
            f"train.precision={t.precision}. DeepSpeed's stage-0 {t.precision} optimizer "
            "accumulates and reduces gradients in the weights' dtype (it refuses "
            "data_types.grad_accum_dtype=fp32) and cannot skip a non-finite step exactly; use "
            "parallel.zero_stage=1 or 2 (fp32 master weights, fp32 gradient accumulation and "
            "reduction), or train.precision=fp32"
        )
    if world_size is None:
        return None
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1; got {world_size}")
    if world_size % p.ep_size:
        raise ConfigError(
            f"parallel.ep_size: must divide the world size {world_size}; got {p.ep_size} "
            f"(choose an ep_size that divides both {world_size} and moe.num_experts="
            f"{cfg.moe.num_experts})"
        )
    if world_size % p.sp_size:
        raise ConfigError(
            f"parallel.sp_size: must divide the world size {world_size}; got {p.sp_size}"
        )
    dp = world_size // p.sp_size
    expected = t.micro_batch_size * t.grad_accum_steps * dp
    if t.global_batch_size is not None and t.global_batch_size != expected:
        raise ConfigError(
            f"train.global_batch_size: {t.global_batch_size} != train.micro_batch_size "
            f"({t.micro_batch_size}) x train.grad_accum_steps ({t.grad_accum_steps}) x "
            f"data-parallel size ({dp} = world / parallel.sp_size) = {expected}"
        )
    return dp
