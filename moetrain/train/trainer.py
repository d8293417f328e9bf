"""The training loop: DeepSpeed engine, expert parallelism, eval, metrics, clean shutdown.

One optimizer step = ``train.grad_accum_steps`` micro-steps on every rank (each rank reads its
own micro-batches; all ranks are data-parallel). The loss is cross-entropy plus the MoE losses;
DeepSpeed divides it by the accumulation steps, reduces gradients (dense weights over every
rank, expert weights over their expert-data-parallel group), clips and steps. After each
optimizer step the per-expert loads of the step are summed over every rank and passed to
``Router.update_bias`` so the aux-loss-free bias stays identical everywhere.

Checkpointing hook: :meth:`Trainer.checkpoint_due` says when a checkpoint is due; saving and
resuming (DeepSpeed shards + trainer state + data position) belong to ``train/checkpoint.py``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moetrain.config import Config
from moetrain.parallel.deepspeed import (
    clip_grad_norm_global,
    dump_deepspeed_config,
    global_grad_norm,
    initialize_engine,
)
from moetrain.parallel.expert_parallel import apply_expert_parallel, moe_layers
from moetrain.parallel.topology import Topology, init_distributed, shutdown
from moetrain.train.metrics import (
    MetricsWriter,
    Throughput,
    memory_stats,
    progress_line,
)

Batch = dict[str, torch.Tensor]


def tokens_per_step(cfg: Config, world_size: int) -> int:
    t = cfg.train
    return t.micro_batch_size * t.grad_accum_steps * world_size * cfg.data.seq_len


def total_steps(cfg: Config, world_size: int) -> int:
    """``train.max_steps``, or ``train.max_tokens // tokens per step`` when that is set."""
    if cfg.train.max_tokens is not None:
        return max(1, cfg.train.max_tokens // tokens_per_step(cfg, world_size))
    return cfg.train.max_steps


def checkpoint_blocks(model: nn.Module) -> int:
    """Activation checkpointing: recompute every transformer block in backward."""
    from torch.utils.checkpoint import checkpoint

    count = 0
    for block in model.layers:
        inner = block.forward

        def forward(*args: Any, _inner: Callable[..., Any] = inner) -> Any:
            if torch.is_grad_enabled():
                return checkpoint(_inner, *args, use_reentrant=False)
            return _inner(*args)

        block.forward = forward
        count += 1
    return count


class Trainer:
    """Model + engine for one run; :meth:`train_step` runs one optimizer step."""

    def __init__(self, cfg: Config, topology: Topology) -> None:
        from moetrain.model.transformer import Transformer

        self.cfg, self.topo = cfg, topology
        self.tokens_per_step = tokens_per_step(cfg, topology.world_size)
        self.total_steps = total_steps(cfg, topology.world_size)
        # Same seed everywhere: every rank builds the full model, then keeps its experts.
        torch.manual_seed(cfg.seed)
        model = Transformer(cfg.model, cfg.moe)
        apply_expert_parallel(model, topology)
        if cfg.parallel.activation_checkpointing:
            checkpoint_blocks(model)
        self.engine, self.optimizer, self.schedule, self.ds_config = initialize_engine(
            model, cfg, topology, self.total_steps, self.tokens_per_step
        )
        self.model: nn.Module = self.engine.module
        self.routers = [layer.router for _, layer in moe_layers(self.model)]
        self.step = 0  # optimizer steps taken
        self.tokens_seen = 0
        self._nonfinite_in_a_row = 0
        # torch.manual_seed differs per rank from here on (jitter, dropout-free otherwise)
        torch.manual_seed(cfg.seed + 1000 * topology.rank + 1)

    # ------------------------------------------------------------------ steps
    def _to_device(self, batch: Batch) -> Batch:
        return {k: v.to(self.topo.device, non_blocking=True) for k, v in batch.items()}

    def _forward(self, batch: Batch) -> Any:
        return self.engine(batch["input_ids"], batch.get("doc_ids"), batch["labels"])

    def train_step(
        self,
        micro_batches: Iterable[Batch],
        before_step: Callable[[Trainer], None] | None = None,
    ) -> dict[str, Any]:
        """Run ``grad_accum_steps`` micro-steps and one optimizer step; return step metrics.

        ``before_step(trainer)`` runs after the last backward (gradients reduced, not yet
        clipped) and before the optimizer step (tests read gradients there).
        """
        self.engine.train()
        accum = self.cfg.train.grad_accum_steps
        dev = self.topo.device
        sums = torch.zeros(3, dtype=torch.float64, device=dev)  # loss, ce, moe
        loads: torch.Tensor | None = None
        n = 0
        lr = float(self.schedule.get_last_lr()[0])
        grad_norm: float | None = None
        for batch in micro_batches:
            n += 1
            out = self._forward(self._to_device(batch))
            self.engine.backward(out.loss)
            sums += torch.stack([out.loss.detach(), out.ce_loss.detach(), out.moe_loss.detach()])
            step_loads = torch.stack([m.tokens_per_expert_E for m in out.moe]).double()
            loads = step_loads if loads is None else loads + step_loads
            if n == accum:
                if before_step is not None:
                    before_step(self)
                if self.cfg.parallel.zero_stage == 0:
                    # DeepSpeed's stage-0 norm is wrong under EP (issue #8475): clip ourselves.
                    clip = self.cfg.optim.grad_clip
                    if clip > 0:
                        grad_norm = clip_grad_norm_global(self.model, clip, self.topo)
                    else:
                        grad_norm = float(global_grad_norm(self.model, self.topo))
            self.engine.step()
        if n != accum:
            raise ValueError(f"train_step got {n} micro-batches, expected {accum}")
        if grad_norm is None:
            norm = self.engine.get_global_grad_norm()
            grad_norm = float(norm) if norm is not None else float("nan")

        # one all-reduce for the loads of every layer and the loss sums
        flat = torch.cat([loads.reshape(-1), sums]) if loads is not None else sums
        if self.topo.world_size > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        n_loads = 0 if loads is None else loads.numel()
        if loads is not None:
            global_loads = flat[:n_loads].view_as(loads)
            for router, load_E in zip(self.routers, global_loads, strict=True):
                router.update_bias(load_E.float())
        loss, ce, moe = (flat[n_loads:] / (accum * self.topo.world_size)).tolist()

        self.step += 1
        self.tokens_seen += self.tokens_per_step
        self._check_finite(loss)
        rec: dict[str, Any] = {
            "step": self.step,
            "loss": loss,
            "ce_loss": ce,
            "moe_loss": moe,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": self.tokens_seen,
        }
        if loads is not None:
            rec["tokens_per_expert"] = global_loads.round().long().tolist()
        return rec

    def _check_finite(self, loss: float) -> None:
        if math.isfinite(loss):
            self._nonfinite_in_a_row = 0
            return
        self._nonfinite_in_a_row += 1
        limit = self.cfg.train.max_nonfinite_in_a_row
        if self._nonfinite_in_a_row >= limit:
            raise FloatingPointError(
                f"loss was not finite for {self._nonfinite_in_a_row} steps in a row (step "
                f"{self.step}); lower optim.lr or use train.precision=fp32/bf16"
            )

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch]) -> float:
        """Mean loss (CE + MoE) over ``batches`` on every rank, averaged over ranks."""
        self.engine.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.topo.device)
        for batch in batches:
            out = self._forward(self._to_device(batch))
            total += torch.stack([out.ce_loss.double(), torch.ones((), device=total.device)])
        if self.topo.world_size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        self.engine.train()
        return float(total[0] / total[1].clamp_min(1))

    def checkpoint_due(self, elapsed_min: float = 0.0) -> bool:
        """Whether ``checkpoint.save_every_steps`` / ``save_every_minutes`` call for a save."""
        c = self.cfg.checkpoint
        by_steps = c.save_every_steps > 0 and self.step % c.save_every_steps == 0
        by_time = c.save_every_minutes > 0 and elapsed_min >= c.save_every_minutes
        return by_steps or by_time or self.step == self.total_steps


# ---------------------------------------------------------------------------- entry point


def _take(it: Iterator[Batch], n: int) -> list[Batch]:
    out = []
    for _ in range(n):
        try:
            out.append(next(it))
        except StopIteration:
            raise RuntimeError("the training data loader ran out of batches") from None
    return out


def launcher_disagreements(cfg: Config, env: dict[str, str]) -> list[str]:
    """Settings an ``accelerate launch --use_deepspeed`` environment gives that differ from the
    moetrain config (moetrain's values are used; these are reported, not applied)."""
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true":
        return []
    ours = {
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": (str(cfg.parallel.zero_stage), "parallel.zero_stage"),
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": (
            str(cfg.train.grad_accum_steps),
            "train.grad_accum_steps",
        ),
        "ACCELERATE_MIXED_PRECISION": (
            {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[cfg.train.precision],
            "train.precision",
        ),
    }
    out = []
    for var, (want, key) in ours.items():
        got = env.get(var)
        if got is not None and got != want and got != "auto":
            out.append(f"accelerate sets {var}={got}, but {key} gives {want}: using {key}")
    return out


def run_training(cfg: Config, reset_optimizer: bool = False) -> dict[str, Any]:
    """Train ``cfg`` under any launcher (or one plain process); returns a summary dict.

    ``reset_optimizer`` is for resuming with another layout (weights only); it matters once
    checkpoint loading is wired in (train/checkpoint.py).
    """
    from moetrain.data.loader import build_loader

    if cfg.train.threads_per_rank:
        torch.set_num_threads(cfg.train.threads_per_rank)
    topo: Topology | None = None
    writer: MetricsWriter | None = None
    try:
        topo = init_distributed(cfg)
        run_dir = Path(cfg.run_dir)
        if topo.is_main:
            for msg in launcher_disagreements(cfg, dict(os.environ)):
                print(f"moetrain: warning: {msg}", flush=True)
        t = cfg.train
        vocab = cfg.model.vocab_size
        train_loader = build_loader(
            cfg.data,
            "train",
            t.micro_batch_size,
            topo.rank,
            topo.world_size,
            cfg.seed,
            vocab_size=vocab,
        )

        trainer = Trainer(cfg, topo)
        if topo.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            dump_deepspeed_config(trainer.ds_config, run_dir)
            (run_dir / "config.yaml").write_text(cfg.to_yaml())

        def run_eval() -> float:
            val = build_loader(
                cfg.data,
                "val",
                t.micro_batch_size,
                topo.rank,
                topo.world_size,
                cfg.seed,
                vocab_size=vocab,
            )
            return trainer.evaluate(_take(iter(val), t.eval_steps))

        writer = MetricsWriter(run_dir, enabled=topo.is_main)
        meter = Throughput(cfg, topo.world_size, trainer.tokens_per_step)
        it = iter(train_loader)
        total = trainer.total_steps
        if topo.is_main:
            print(
                f"moetrain: training {total} steps, {trainer.tokens_per_step} tokens/step, "
                f"world {topo.world_size} (ep {topo.ep_size}, zero {cfg.parallel.zero_stage}, "
                f"{topo.backend})",
                flush=True,
            )
        start = time.perf_counter()
        first_loss = last_loss = eval_loss = None
        while trainer.step < total:
            rec = trainer.train_step(_take(it, t.grad_accum_steps))
            meter.step()
            first_loss = rec["loss"] if first_loss is None else first_loss
            last_loss = rec["loss"]
            if trainer.step % t.log_every == 0 or trainer.step in (1, total):
                rec.update(meter.measure())
                rec.update(memory_stats(topo.device))
                writer.write(rec)
                if topo.is_main:
                    elapsed = time.perf_counter() - start
                    eta = elapsed / trainer.step * (total - trainer.step)
                    print("moetrain: " + progress_line(trainer.step, total, rec, eta), flush=True)
            if t.eval_every > 0 and (trainer.step % t.eval_every == 0 or trainer.step == total):
                eval_loss = run_eval()
                writer.write({"step": trainer.step, "eval_loss": eval_loss})
                if topo.is_main:
                    print(f"moetrain: step {trainer.step} eval loss {eval_loss:.4f}", flush=True)
            # checkpoint hook: train/checkpoint.py saves here when trainer.checkpoint_due(...)
        wall = time.perf_counter() - start
        summary = {
            "steps": trainer.step,
            "first_loss": first_loss,
            "final_loss": last_loss,
            "eval_loss": eval_loss,
            "tokens": trainer.tokens_seen,
            "wall_s": wall,
            "tokens_per_s": trainer.tokens_seen / max(wall, 1e-9),
            "run_dir": str(run_dir),
        }
        writer.write({"summary": summary})
        if topo.is_main:
            print(
                f"moetrain: done: {trainer.step} steps, loss {first_loss:.4f} -> "
                f"{last_loss:.4f}, {summary['tokens_per_s']:,.0f} tok/s",
                flush=True,
            )
        return summary
    finally:
        if writer is not None:
            writer.close()
        shutdown(topo)
