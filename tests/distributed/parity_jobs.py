"""Rank functions for the layout-parity tests (importable by spawned processes).

One spawned job runs several configurations in one process group to save start-up time.
Every layout sees the same global batch: global micro-batch ``G`` sequences per micro-step,
``G / world`` on each rank (rank r takes rows ``[r*mb, (r+1)*mb)``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from moetrain.config import Config
from tests.distributed.parity_variants import (
    ACCUM,
    GLOBAL_MICRO,
    GRAD_NAMES,
    GROUPED,
    REFERENCES,
    SEQ,
    STEPS,
    VARIANTS,
)
from tests.helpers.configs import tiny_config


def parity_config(world: int, ep: int, stage: int, **extra: Any) -> Config:
    """The tiny model with the parity tests' shape and training settings, for ``world`` ranks
    at expert parallelism ``ep`` and ZeRO stage ``stage``; ``extra``: more dotted settings."""
    settings = {
        "seed": 7,
        "model.vocab_size": 96,
        "model.dense_hidden": 64,
        "model.max_seq_len": SEQ,
        "moe.expert_hidden": 32,
        # a gated shared expert: under EP it runs while the all-to-alls are in flight
        "moe.num_shared_experts": 1,
        "moe.shared_expert_hidden": 16,
        "moe.shared_expert_gate": True,
        "moe.aux_loss_coef": 0.01,
        "moe.z_loss_coef": 0.001,
        "moe.bias_update_rate": 0.001,
        "data.seq_len": SEQ,
        "parallel.ep_size": ep,
        "parallel.zero_stage": stage,
        "optim.lr": 0.01,
        "optim.warmup_steps": 2,
        "optim.grad_clip": 0.3,  # the global norm starts near 2: clipping is active
        "optim.weight_decay": 0.1,
        "optim.schedule": "cosine",
        "train.max_steps": STEPS,
        "train.micro_batch_size": GLOBAL_MICRO // world,
        "train.grad_accum_steps": ACCUM,
        "train.eval_every": 0,
        "run_dir": "/tmp/moetrain-parity-unused",
    }
    return tiny_config(settings, extra)


def global_batches(step: int, vocab: int = 96) -> list[dict[str, torch.Tensor]]:
    """The global micro-batches of optimizer step ``step`` (same for every layout)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(ACCUM):
        seq = torch.randint(0, vocab, (GLOBAL_MICRO, SEQ + 1), generator=g)
        out.append({"input_ids": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous()})
    return out


def rank_slice(batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    mb = GLOBAL_MICRO // world
    return {k: v[rank * mb : (rank + 1) * mb] for k, v in batch.items()}


def _biases(model: torch.nn.Module) -> list[list[float]]:
    return [
        buf.tolist() for name, buf in model.named_buffers() if name.endswith("router.expert_bias")
    ]


def reference_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """The reference's optimizer: torch's per-op AdamW; with ``optim.name: muon``, moetrain's
    Muon on the whole parameters of one process (its update against a written-out float64
    reference: tests/unit/test_muon.py)."""
    from moetrain.optim.groups import decay_groups
    from moetrain.optim.registry import build_optimizer

    o = cfg.optim
    if o.name == "muon":
        return build_optimizer(model, o, torch.device("cpu"))
    return torch.optim.AdamW(
        decay_groups(model, o), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False
    )


class ReferenceQKClip:
    """The largest attention logits in the reference, tracked on the forwards of every step (the
    layouts log them too), overall (``max_logits``) and per layer (``layer_max_logits``); with
    QK-clip (``optim.muon.qk_clip``) their row multipliers go to the optimizer before its
    step."""

    def __init__(self, model: torch.nn.Module, cfg: Config) -> None:
        from moetrain.train.attention_logits import AttentionLogits

        self.threshold = cfg.optim.muon.qk_clip
        self.logits = AttentionLogits(model, world_size=1)
        self.clipped = 0
        self.max_logits: list[float] = []
        self.layer_max_logits: list[list[float]] = []

    def begin_step(self) -> None:
        self.logits.track(True)

    def before_update(self, opt: torch.optim.Optimizer) -> None:
        maxima = self.logits.reduce(torch.device("cpu"))
        self.logits.track(False)
        self.max_logits.append(float(maxima.max()))
        self.layer_max_logits.append(maxima.max(dim=1).values.tolist())
        if self.threshold > 0:
            opt.set_row_scales(self.logits.row_scales(maxima, self.threshold))
            self.clipped += int((maxima > self.threshold).sum())


def reference_run(
    variant: str | None = None, capacity_groups: int = 1, rows_reversed: bool = False
) -> dict[str, Any]:
    """One process, plain torch (no DeepSpeed), per-expert loop experts: the simplest reference.

    ``capacity_groups``: how many expert-parallel groups the layout splits each global
    micro-batch into (world / ep_size); each decides capacity over its own tokens.
    ``rows_reversed``: the rows of every micro-batch in reverse order -- the same function, with every sum over tokens taken in another order:
    the run differs from the plain one by rounding alone (the rounding floor of the parity
    tests).
    """
    from moetrain.model.moe.dispatch import LocalDispatcher
    from moetrain.model.transformer import Transformer
    from moetrain.optim.schedule import LRSchedule

    cfg = parity_config(1, 1, 0, **{"moe.grouped_mm": False, **VARIANTS.get(variant, {})})
    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model, cfg.moe)
    for layer in model.moe_layers():
        layer.dispatcher = LocalDispatcher(cfg.moe.num_experts, capacity_groups)
    o = cfg.optim
    opt = reference_optimizer(model, cfg)
    clip = ReferenceQKClip(model, cfg)
    sched = LRSchedule(opt, o, STEPS, 0)
    routers = [m.router for m in model.moe_layers()]
    params = dict(model.named_parameters())
    names = [n for n in GRAD_NAMES if n in params and params[n].requires_grad]
    losses, norms, grads, dropped = [], [], {}, 0
    zero_copies = 0  # (routed to zero experts: moe.zero_experts)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        loads = None
        for router in routers:
            router.begin_step()
        clip.begin_step()
        for batch in global_batches(step):
            if rows_reversed:  # (each capacity group's rows stay one group)
                batch = {k: v.flip(0) for k, v in batch.items()}
            weight = cfg.model.mtp_weight(step + 1)
            out = model(batch["input_ids"], None, batch["labels"], mtp_weight=weight)
            (out.loss / ACCUM).backward()
            for router in routers:
                router.end_micro_batch()
            total += float(out.loss.detach()) / ACCUM
            step_loads = torch.stack([m.tokens_per_expert_E for m in out.moe])
            loads = step_loads if loads is None else loads + step_loads
            dropped += sum(int(m.dropped) for m in out.moe)
            zero_copies += sum(int(m.zero_copies) for m in out.moe)
        if step == 0:
            grads = {n: params[n].grad.clone() for n in names}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        clip.before_update(opt)
        opt.step()
        sched.step()
        for router, load in zip(routers, loads, strict=True):
            router.update_bias(load)
        losses.append(total)
        norms.append(float(norm))
    return {
        "losses": losses,
        "norms": norms,
        "grads": grads,
        "weights": {n: params[n].detach().clone() for n in names},
        "biases": _biases(model),
        "dropped": dropped,
        "clipped": clip.clipped,
        "max_logits": clip.max_logits,
        "layer_max_logits": clip.layer_max_logits,
        # the zero-expert shares of every step and MoE layer, summed (as the layouts report)
        "zero_share": zero_copies / (ACCUM * GLOBAL_MICRO * SEQ * cfg.moe.top_k),
    }


def _parallel_run(cfg: Config, rank: int, world: int, steps: int = STEPS) -> dict[str, Any]:
    from deepspeed.utils import safe_get_full_grad

    from moetrain.parallel.topology import init_distributed
    from moetrain.train.trainer import Trainer

    topo = init_distributed(cfg)
    trainer = Trainer(cfg, topo)
    grads: dict[str, torch.Tensor] = {}
    ds_norm: list[float] = []

    def capture(tr: Trainer) -> None:
        params = dict(tr.model.named_parameters())
        for name in (n for n in GRAD_NAMES if n in params and params[n].requires_grad):
            g = safe_get_full_grad(params[name])
            grads[name] = g.detach().clone().float()
        if cfg.parallel.zero_stage == 0:
            # the norm DeepSpeed's own stage-0 clipping would use (max_norm=inf: no clipping)
            from deepspeed.runtime.utils import clip_grad_norm_

            ds_norm.append(float(clip_grad_norm_(tr.model.parameters(), max_norm=float("inf"))))

    losses, norms, dropped, replicas, clipped = [], [], 0.0, 0.0, 0
    max_logits, layer_max_logits = [], []
    zero_share = 0.0  # (metrics.jsonl's moe/layer<i>/zero_expert_share, summed)
    for step in range(steps):
        micro = [rank_slice(b, rank, world) for b in global_batches(step)]
        hook = capture if step == 0 else None
        rec = trainer.train_step(micro, before_step=hook, track_logits=True)
        max_logits.append(rec["attn/max_logit"])
        layer_max_logits.append(
            [v for k, v in rec.items() if k.startswith("attn/layer") and k.endswith("/max_logit")]
        )
        losses.append(rec["loss"])
        norms.append(rec["grad_norm"])
        dropped += sum(v["dropped"] for v in rec["moe_layers"].values())
        replicas += rec.get("comm/a2a_replicas", 0.0)
        zero_share += sum(v["zero_expert_share"] for v in rec["moe_layers"].values())
        clipped += rec.get("attn/clipped_heads", 0)
    lo, hi = topo.local_experts(cfg.moe.num_experts)
    params = dict(trainer.model.named_parameters())
    result = {
        "losses": losses,
        "norms": norms,
        "grads": grads,
        "weights": {n: params[n].detach().float().clone() for n in grads},
        "biases": _biases(trainer.model),
        "experts": (lo, hi),
        "ds_moe": bool(trainer.engine.has_moe_layers),
        "ds_stage": int(trainer.engine.zero_optimization_stage()),
        "deepspeed_stage0_norm": ds_norm[0] if ds_norm else None,
        "dropped": dropped,
        "replicas": replicas,
        "zero_share": zero_share,
        "clipped": clipped,
        "max_logits": max_logits,
        "layer_max_logits": layer_max_logits,
        "cut": cut_matrix_values(trainer),
    }
    del trainer
    if topo.watch is not None:  # (its heartbeat thread would beat on through the next layouts)
        topo.watch.stop()
    return result


def cut_matrix_values(trainer: Any) -> int:
    """How many values of Muon's matrices this rank's ZeRO partitions cut (the exchange's
    size; 0 for another optimizer)."""
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return sum(ex.size for _, ex in getattr(opt, "pieces", {}).values() if ex is not None)


def layout_key(layout: tuple) -> str:
    """``(ep, stage)`` -> ``ep2_zero1``; more items name a variant: ``"ckpt"`` (activation
    checkpointing), ``"overlap"`` (DeepSpeed's overlap_comm), ``"shadow"`` (up to 2 shadow
    experts per layer) or a key of :data:`VARIANTS`."""
    return "_".join([f"ep{layout[0]}", f"zero{layout[1]}", *layout[2:]])


def reference_key(world: int, layout: tuple) -> str:
    """The reference run a layout is compared with (see :func:`layouts_job`)."""
    variant = next((v for v in layout[2:] if v in VARIANTS), None)
    if variant is None:
        return "reference"
    if variant in GROUPED:
        return f"reference_{variant}_g{world // layout[0]}"
    return f"reference_{variant}"


def layouts_job(
    rank: int,
    world: int,
    layouts: list[tuple],
    references: tuple[str, ...] | None = None,
    twins: bool | Collection[str] = False,
) -> dict[str, Any]:
    """Run every ``(ep_size, zero_stage[, variant])`` in ``layouts`` on this group; the world-1
    job also runs the references (plain torch, one process): the base one, those of
    :data:`REFERENCES` and capacity's, and the rows-reversed twin (``twin_<key>``: the rounding
    floor) of each whose key is in ``twins`` (every one when ``twins`` is True); or those of
    the variants ``references`` only (their twins with ``twins``)."""
    out: dict[str, Any] = {}
    if world == 1 and references is not None:
        for variant in references:
            out[f"reference_{variant}"] = reference_run(variant)
            if twins:
                out[f"twin_reference_{variant}"] = reference_run(variant, rows_reversed=True)
    elif world == 1:
        runs = {"reference": (None, 1)}
        runs |= {f"reference_{variant}": (variant, 1) for variant in REFERENCES}
        runs |= {f"reference_capacity_g{g}": ("capacity", g) for g in (1, 2)}
        twin_keys = runs if twins is True else (twins or ())
        # (zero experts at capacity: only where a layout asks for it, with -m long)
        if twins is True or "reference_zero_capacity_g2" in twin_keys:
            runs["reference_zero_capacity_g2"] = ("zero_capacity", 2)
        for key, (variant, groups) in runs.items():
            out[key] = reference_run(variant, groups)
            if key in twin_keys:
                out[f"twin_{key}"] = reference_run(variant, groups, rows_reversed=True)
    for layout in layouts:
        ep, stage, *variant = layout
        extra = {}
        if "ckpt" in variant:  # both recompute options: block checkpointing, expert SwiGLU
            extra["parallel.activation_checkpointing"] = True
            extra["moe.recompute_act"] = True
        if "overlap" in variant:
            extra["parallel.overlap_comm"] = True
        if "shadow" in variant:
            extra["parallel.shadow_experts"] = 2
        for name in variant:
            extra.update(VARIANTS.get(name, {}))
        cfg = parity_config(world, ep, stage, **extra)
        out[layout_key(layout)] = _parallel_run(cfg, rank, world)
    return out
