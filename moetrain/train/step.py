"""One optimizer step: ``train.grad_accum_steps`` micro-steps on every rank, the skip decision
for non-finite gradients, the aux-loss-free bias update, and the step's statistics.

The loss is cross-entropy plus the MoE losses; DeepSpeed divides it by the accumulation steps,
reduces gradients (dense weights over every rank, expert weights over their expert-data-parallel
group), clips and steps. The per-expert loads of the step are summed over every rank and passed
to ``Router.update_bias``, so the aux-loss-free bias stays identical everywhere; the loads, the
per-layer statistics and the loss sums travel in one all-reduce.

Non-finite gradients: every rank takes the same decision, because it comes from an all-reduce
over every rank (ZeRO-1/2: DeepSpeed's overflow check skips the optimizer step and counts it in
``engine.skipped_steps``; stage 0, fp32 only: moetrain's global norm, and the step is skipped by
dropping every gradient so AdamW leaves weights, moments and its step count alone); the same
all-reduce that carries the statistics checks that every rank agreed. A skipped step changes
nothing but the data position: no weight, fp32 master, Adam moment or step count, aux-loss-free
bias or learning-rate schedule position moves (the schedule is stepped here, only after a step
that was applied). Accounting and fp16 loss-scale calibration: :mod:`moetrain.train.nonfinite`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from moetrain.monitor.step_timer import StepTimer
from moetrain.parallel.all_to_all import TrafficMeter
from moetrain.parallel.deepspeed import clip_grad_norm_global, global_grad_norm
from moetrain.train.nonfinite import SkipCounter, read_loss_scale

__all__ = ["Batch", "SkipCounter", "StepStats", "run_step"]

Batch = dict[str, torch.Tensor]


class StepStats:
    """Sums over the micro-batches of one step on this rank: loss / CE / MoE loss, whether this
    rank skipped the optimizer step (:meth:`mark_skipped`, so the reduction counts the ranks that
    did), the expert all-to-alls' traffic (:attr:`TrafficMeter.FIELDS`), and per MoE layer the
    expert loads and (dropped, entropy, aux, z, routed copies)."""

    def __init__(self, n_layers: int, device: torch.device) -> None:
        self.n_layers, self.device = n_layers, device
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)
        self.traffic = [0] * len(TrafficMeter.FIELDS)
        self.layer_sums = torch.zeros(5, n_layers, dtype=torch.float64, device=device)
        self.loads: torch.Tensor | None = None

    def add(self, out: Any, routed: int) -> None:
        """One micro-batch's model output; ``routed`` = its tokens x top_k."""
        self.sums[:3] += torch.stack(
            [out.loss.detach(), out.ce_loss.detach(), out.moe_loss.detach()]
        )
        if not out.moe:
            return
        step_loads = torch.stack([m.tokens_per_expert_E for m in out.moe]).double()
        self.loads = step_loads if self.loads is None else self.loads + step_loads
        self.layer_sums += torch.stack(
            [
                torch.stack([m.dropped.double() for m in out.moe]),
                torch.stack([m.entropy.detach().double() for m in out.moe]),
                torch.stack([m.aux_loss.detach().double() for m in out.moe]),
                torch.stack([m.z_loss.detach().double() for m in out.moe]),
                torch.full(
                    (self.n_layers,), float(routed), dtype=torch.float64, device=self.device
                ),
            ]
        )

    def add_traffic(self, meters: list[TrafficMeter]) -> None:
        """What the dispatchers' meters counted since they were last read (host integers)."""
        for meter in meters:
            self.traffic = [a + b for a, b in zip(self.traffic, meter.take(), strict=True)]

    def mark_skipped(self, skipped: bool) -> None:
        self.sums[3] = float(skipped)

    def all_reduce(self, world_size: int) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Sum over every rank in one all-reduce -> ``(loads (layers, E) or None,
        layer sums (5, layers), sums (loss, CE, MoE loss, ranks that skipped, then the traffic
        fields))``."""
        traffic = torch.tensor(self.traffic, dtype=torch.float64, device=self.device)
        parts = [self.layer_sums.reshape(-1), self.sums, traffic]
        if self.loads is not None:
            parts.insert(0, self.loads.reshape(-1))
        flat = torch.cat(parts)
        if world_size > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        n_loads = 0 if self.loads is None else self.loads.numel()
        loads = None if self.loads is None else flat[:n_loads].view_as(self.loads)
        layers = flat[n_loads : n_loads + self.layer_sums.numel()].view_as(self.layer_sums)
        return loads, layers, flat[n_loads + self.layer_sums.numel() :]


def _clip_stage0(trainer: Any) -> tuple[float, bool]:
    """Stage 0: DeepSpeed's norm is wrong under EP (issue #8475), so moetrain clips with the
    global norm itself; a non-finite norm drops every gradient. -> ``(norm, skipped)``."""
    clip = trainer.cfg.optim.grad_clip
    if clip > 0:
        norm = clip_grad_norm_global(trainer.model, clip, trainer.topo)
    else:
        norm = float(global_grad_norm(trainer.model, trainer.topo))
    if math.isfinite(norm):
        return norm, False
    for p in trainer.model.parameters():
        p.grad = None
    return norm, True


def run_step(
    trainer: Any,
    micro_batches: Iterable[Batch],
    before_step: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """Run ``grad_accum_steps`` micro-steps and one optimizer step of ``trainer``
    (:class:`~moetrain.train.trainer.Trainer`); return the step's record.

    ``before_step(trainer)`` runs after the last backward (gradients reduced, not yet clipped)
    and before the optimizer step (tests read or poison gradients there).
    """
    cfg, topo, engine = trainer.cfg, trainer.topo, trainer.engine
    engine.train()
    accum = cfg.train.grad_accum_steps
    stats = StepStats(len(trainer.moe_layer_ids), topo.device)
    n = 0
    lr = float(trainer.schedule.get_last_lr()[0])
    grad_norm: float | None = None
    skipped_before = engine.skipped_steps
    skip_stage0 = False
    scale = None
    timer = StepTimer(topo.device)
    for router in trainer.routers:
        router.begin_step()
    for meter in trainer.traffic_meters:
        meter.take()  # drop what evaluation sent since the last step
    for batch in micro_batches:
        n += 1
        timer.start()
        batch = {k: v.to(topo.device, non_blocking=True) for k, v in batch.items()}
        out = trainer.forward(batch)
        engine.backward(out.loss)
        for router in trainer.routers:
            router.end_micro_batch()
        for meter in trainer.traffic_meters:
            meter.end_micro_batch()
        stats.add(out, batch["input_ids"].numel() * cfg.moe.top_k)
        timer.lap("fwd_bwd")
        if n == accum:
            if before_step is not None:
                before_step(trainer)
            if cfg.parallel.zero_stage == 0:
                grad_norm, skip_stage0 = _clip_stage0(trainer)
            scale = read_loss_scale(engine.optimizer)
        engine.step()
        if n == accum:
            timer.lap("optimizer")
    if n != accum:
        raise ValueError(f"train_step got {n} micro-batches, expected {accum}")
    skipped = skip_stage0 or engine.skipped_steps > skipped_before
    if not skipped:
        trainer.schedule.step()
    if grad_norm is None:  # ZeRO-1/2: DeepSpeed's global norm (unscaled under fp16)
        norm = engine.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else float("nan")

    stats.add_traffic(trainer.traffic_meters)
    stats.mark_skipped(skipped)
    loads, layers, sums = stats.all_reduce(topo.world_size)
    if int(sums[3]) not in (0, topo.world_size):
        raise RuntimeError(
            f"step {trainer.step + 1}: {int(sums[3])} of {topo.world_size} ranks skipped the "
            "optimizer step and the others applied it; the replicas have diverged"
        )
    micro_total = accum * topo.world_size
    if loads is not None and not skipped:
        for router, load_E in zip(trainer.routers, loads, strict=True):
            router.update_bias(load_E.float())
    loss, ce, moe = (sums[:3] / micro_total).tolist()
    times = timer.read()  # after the step's results reached the host: no extra wait

    trainer.step += 1
    trainer.tokens_seen += trainer.tokens_per_step
    scale_after = read_loss_scale(engine.optimizer)
    calibration = trainer.skips.update(
        skipped,
        trainer.step,
        loss,
        grad_norm,
        topo.is_main,
        scale,
        scale_after.scale if scale_after else None,
    )
    if calibration:
        trainer.loss_scale_overflows += 1
    elif skipped:
        trainer.skipped_steps += 1
    rec: dict[str, Any] = {
        "step": trainer.step,
        "loss": loss,
        "ce_loss": ce,
        "moe_loss": moe,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": trainer.tokens_seen,
        "skipped": skipped,
        "skipped_steps": trainer.skipped_steps,
        "time/fwd_bwd_s": times.get("fwd_bwd", 0.0),
        "time/optimizer_s": times.get("optimizer", 0.0),
    }
    if trainer.traffic_meters:
        names = [f"comm/a2a_{name}" for name in TrafficMeter.FIELDS]
        rec.update(zip(names, sums[4:].tolist(), strict=True))
    if scale_after is not None:
        rec["loss_scale"] = scale_after.scale
        rec["loss_scale_overflows"] = trainer.loss_scale_overflows
    if loads is not None:
        rec["moe_layers"] = {
            layer: {
                "tokens_per_expert": loads[i].tolist(),
                "dropped": float(layers[0, i]),
                "dropped_frac": float(layers[0, i] / layers[4, i].clamp_min(1)),
                "entropy": float(layers[1, i] / micro_total),
                "aux_loss": float(layers[2, i] / micro_total),
                "z_loss": float(layers[3, i] / micro_total),
                "expert_bias": trainer.routers[i].expert_bias.tolist(),
            }
            for i, layer in enumerate(trainer.moe_layer_ids)
        }
    return rec
