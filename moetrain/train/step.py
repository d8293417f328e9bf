"""One optimizer step: ``train.grad_accum_steps`` micro-steps on every rank, the skip decision
for non-finite gradients, the aux-loss-free bias update, and the step's progress and record.

The loss is cross-entropy plus the MoE losses; DeepSpeed divides it by the accumulation steps,
reduces gradients (dense weights over every rank, expert weights over their expert-data-parallel
group), clips and steps. The per-expert loads of the step are summed over every rank and passed
to ``Router.update_bias``, so the aux-loss-free bias stays identical everywhere; the loads, the
per-layer statistics and the loss sums travel in one all-reduce (:mod:`moetrain.train.step_stats`).

Non-finite gradients: every rank takes the same decision, because it comes from an all-reduce
over every rank (ZeRO-1/2: DeepSpeed's overflow check skips the optimizer step and counts it in
``engine.skipped_steps``; stage 0, fp32 only: moetrain's global norm, and the step is skipped by
dropping every gradient so AdamW leaves weights, moments and its step count alone); the same
all-reduce that carries the statistics checks that every rank agreed. A skipped step changes
nothing but the data position: no weight, fp32 master, Adam moment or step count, aux-loss-free
bias or learning-rate schedule position moves (the schedule is stepped here, only after a step
that was applied). Accounting and fp16 loss-scale calibration: :mod:`moetrain.train.nonfinite`.

On a step that asks for them, and on every step with QK-clip, the attention modules track each
head's largest logit (:mod:`moetrain.train.attention_logits`): the record gets them, and QK-clip
hands the optimizer its row multipliers before the update.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moetrain.config import Config
from moetrain.monitor.step_record import StepTotals, moe_layer_record, step_record
from moetrain.monitor.step_timer import StepTimer
from moetrain.parallel.deepspeed import clip_grad_norm_global, global_grad_norm
from moetrain.parallel.sequence_parallel import shard_batch
from moetrain.parallel.topology import Topology
from moetrain.train.attention_logits import AttentionLogits
from moetrain.train.nonfinite import LossScale, SkipCounter, read_loss_scale
from moetrain.train.progress import Progress
from moetrain.train.step_stats import StepStats

__all__ = ["Batch", "OptimizerStep", "forward_loss"]

Batch = dict[str, torch.Tensor]


def forward_loss(engine: Any, batch: Batch, mtp_weight: float | None = None) -> Any:
    """The model's loss on ``batch`` (a ``TransformerOutput``); with model.loss_chunk_tokens > 0
    the full logits are never built. ``mtp_weight``: the multi-token-prediction loss's weight
    (default ``model.mtp_loss_weight``)."""
    ids, docs, labels = batch["input_ids"], batch.get("doc_ids"), batch["labels"]
    return engine(ids, docs, labels, return_logits=False, mtp_weight=mtp_weight)


def clip_stage0(model: nn.Module, clip: float, topo: Topology) -> tuple[float, bool]:
    """Stage 0: DeepSpeed's norm is wrong under EP (issue #8475), so moetrain clips with the
    global norm itself (``clip`` 0: only the norm); a non-finite norm drops every gradient.
    -> ``(norm, skipped)``."""
    if clip > 0:
        norm = clip_grad_norm_global(model, clip, topo)
    else:
        norm = float(global_grad_norm(model, topo))
    if math.isfinite(norm):
        return norm, False
    for p in model.parameters():
        p.grad = None
    return norm, True


@dataclass
class _Backward:
    """What the micro-steps leave for the rest of the step."""

    stats: StepStats
    timer: StepTimer
    grad_norm: float | None  # moetrain's own (stage 0), else None: DeepSpeed's
    skipped_stage0: bool
    scale: LossScale | None  # the loss scale before the optimizer step (fp16)
    logits: dict[str, Any] | None = None  # the largest attention logits, when tracked


class OptimizerStep:
    """One optimizer step of ``engine`` (a DeepSpeed engine around a ``Transformer``), advancing
    ``progress``; ``skips`` accounts for skipped steps. Call it with a step's micro-batches.
    ``qk_clip``: QK-clip's threshold (0: off), whose row multipliers go to ``row_scales_to``."""

    def __init__(
        self,
        cfg: Config,
        topo: Topology,
        engine: Any,
        schedule: Any,
        progress: Progress,
        skips: SkipCounter,
        tokens_per_step: int,
        qk_clip: float = 0.0,
        row_scales_to: Callable[[dict[str, torch.Tensor]], None] | None = None,
    ) -> None:
        self.cfg, self.topo, self.engine, self.schedule = cfg, topo, engine, schedule
        self.progress, self.skips, self.tokens_per_step = progress, skips, tokens_per_step
        self.logits = AttentionLogits(engine.module, topo.world_size)
        self.qk_clip, self.row_scales_to = qk_clip, row_scales_to
        moe = engine.module.moe_layers()
        self.routers = [layer.router for layer in moe]
        self.layer_ids = [layer.layer for layer in moe]
        # the expert all-to-alls' traffic counters (dispatchers that communicate have one)
        self.meters = [
            layer.dispatcher.traffic for layer in moe if hasattr(layer.dispatcher, "traffic")
        ]

    def __call__(
        self,
        micro_batches: Iterable[Batch],
        before_step: Callable[[], None] | None = None,
        track_logits: bool = False,
    ) -> dict[str, Any]:
        """Run ``grad_accum_steps`` micro-steps and the optimizer step; return the step's record
        (:func:`moetrain.monitor.step_record.step_record`). ``before_step()`` runs after the
        last backward (gradients reduced, not yet clipped), before the optimizer step.
        ``track_logits``: record the largest attention logits (always with QK-clip; every
        rank must agree)."""
        lr = float(self.schedule.get_last_lr()[0])
        skipped_before = self.engine.skipped_steps
        track = track_logits or self.qk_clip > 0
        done = self._micro_steps(micro_batches, before_step, track)
        skipped = done.skipped_stage0 or self.engine.skipped_steps > skipped_before
        if not skipped:
            self.schedule.step()
        grad_norm = done.grad_norm
        if grad_norm is None:  # ZeRO-1/2: DeepSpeed's global norm (unscaled under fp16)
            norm = self.engine.get_global_grad_norm()
            grad_norm = float(norm) if norm is not None else float("nan")
        totals = self._reduce(done.stats, skipped)
        if totals.loads is not None and not skipped:
            for router, load_E in zip(self.routers, totals.loads, strict=True):
                router.update_bias(load_E.float())
        times = done.timer.read()  # after the step's results reached the host: no extra wait
        rec = self._finish(totals, lr, grad_norm, skipped, done.scale, times)
        return rec | (done.logits or {})

    def _micro_steps(
        self, micro_batches: Iterable[Batch], before_step: Callable[[], None] | None, track: bool
    ) -> _Backward:
        """Forward and backward of every micro-batch, DeepSpeed's ``step`` after each (it steps
        the optimizer after the last); stage 0 clips before that; with ``track``, the largest
        attention logits are reduced (and QK-clip's multipliers handed over) before it."""
        cfg, engine, device = self.cfg, self.engine, self.topo.device
        accum = cfg.train.grad_accum_steps
        engine.train()
        done = _Backward(
            StepStats(
                len(self.layer_ids),
                device,
                traffic=bool(self.meters),
                mtp_depth=cfg.model.mtp_depth,
            ),
            StepTimer(device),
            None,
            False,
            None,
        )
        for router in self.routers:
            router.begin_step()
        for meter in self.meters:
            meter.take()  # drop what evaluation sent since the last step
        n = 0
        mtp_weight = cfg.model.mtp_weight(self.progress.step + 1)
        self.logits.track(track)
        for batch in micro_batches:
            n += 1
            done.timer.start()
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            batch = shard_batch(batch, self.topo)  # sequence parallel: this rank's slice
            out = forward_loss(engine, batch, mtp_weight)
            engine.backward(out.loss)
            for router in self.routers:
                router.end_micro_batch()
            for meter in self.meters:
                meter.end_micro_batch()
            done.stats.add(out, batch["input_ids"].numel() * cfg.moe.top_k)
            done.timer.lap("fwd_bwd")
            if n == accum:
                if before_step is not None:
                    before_step()
                if cfg.parallel.zero_stage == 0:
                    done.grad_norm, done.skipped_stage0 = clip_stage0(
                        engine.module, cfg.optim.grad_clip, self.topo
                    )
                done.scale = read_loss_scale(engine.optimizer)
                if track:
                    done.logits = self._logits()
            engine.step()
            if n == accum:
                done.timer.lap("optimizer")
        if n != accum:
            raise ValueError(f"train_step got {n} micro-batches, expected {accum}")
        return done

    def _logits(self) -> dict[str, Any]:
        """The step's largest attention logits over every rank (collective), for the record;
        QK-clip's row multipliers to the optimizer."""
        maxima = self.logits.reduce(self.topo.device)
        self.logits.track(False)
        out = self.logits.record(maxima)
        if self.qk_clip > 0 and self.row_scales_to is not None:
            self.row_scales_to(self.logits.row_scales(maxima, self.qk_clip))
            out["attn/clipped_heads"] = int((maxima > self.qk_clip).sum())
        return out

    def _reduce(self, stats: StepStats, skipped: bool) -> StepTotals:
        """The statistics over every rank, which must all have taken the same skip decision."""
        world = self.topo.world_size
        stats.add_traffic(self.meters)
        stats.mark_skipped(skipped)
        totals = stats.all_reduce(world, self.cfg.train.grad_accum_steps * world)
        if totals.ranks_skipped not in (0, world):
            raise RuntimeError(
                f"step {self.progress.step + 1}: {totals.ranks_skipped} of {world} ranks skipped "
                "the optimizer step and the others applied it; the replicas have diverged"
            )
        return totals

    def _finish(
        self,
        totals: StepTotals,
        lr: float,
        grad_norm: float,
        skipped: bool,
        scale: LossScale | None,
        times: dict[str, float],
    ) -> dict[str, Any]:
        """Account for a skip, advance the progress, and build the step's record."""
        step = self.progress.step + 1
        scale_after = read_loss_scale(self.engine.optimizer)
        calibration = self.skips.update(
            skipped,
            step,
            totals.loss,
            grad_norm,
            self.topo.is_main,
            scale,
            scale_after.scale if scale_after else None,
        )
        self.progress.advance(self.tokens_per_step, skipped, calibration)
        biases = [router.expert_bias for router in self.routers]
        return step_record(
            totals,
            step=self.progress.step,
            tokens=self.progress.tokens_seen,
            lr=lr,
            grad_norm=grad_norm,
            skipped=skipped,
            skipped_steps=self.progress.skipped_steps,
            times=times,
            moe_layers=moe_layer_record(totals, self.layer_ids, biases),
            loss_scale=scale_after.scale if scale_after else None,
            loss_scale_overflows=self.progress.loss_scale_overflows,
        )
