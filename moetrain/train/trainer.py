"""The training loop: DeepSpeed engine, expert parallelism, eval, metrics, clean shutdown.

One optimizer step = ``train.grad_accum_steps`` micro-steps on every rank (each rank reads its
own micro-batches; all ranks are data-parallel). The loss is cross-entropy plus the MoE losses;
DeepSpeed divides it by the accumulation steps, reduces gradients (dense weights over every
rank, expert weights over their expert-data-parallel group), clips and steps. After each
optimizer step the per-expert loads of the step are summed over every rank and passed to
``Router.update_bias`` so the aux-loss-free bias stays identical everywhere.

Checkpoints (``train/checkpoint.py``) are saved every ``checkpoint.save_every_steps`` steps
and/or ``save_every_minutes`` minutes, at the end, and when any rank receives SIGTERM/SIGINT;
a run resumes from the newest complete checkpoint of its run_dir.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch import nn

from moetrain.config import Config
from moetrain.model.attention import attention_report
from moetrain.monitor.mfu import perf_metrics, resolve_peak
from moetrain.monitor.moe_health import (
    DeadExpertWatch,
    LayerStats,
    load_lists,
    load_matrix,
    moe_health_metrics,
)
from moetrain.monitor.step_timer import StepTimer
from moetrain.monitor.wandb_run import WandbSink
from moetrain.parallel.deepspeed import (
    clip_grad_norm_global,
    dump_deepspeed_config,
    global_grad_norm,
    initialize_engine,
)
from moetrain.parallel.expert_parallel import apply_expert_parallel, moe_layers
from moetrain.parallel.topology import Topology, init_distributed, shutdown
from moetrain.secrets import redact
from moetrain.train.checkpoint import Checkpointer
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
        # Same seed everywhere: every rank builds the same model, holding only its experts.
        torch.manual_seed(cfg.seed)
        local = topology.local_expert_range(cfg.moe.num_experts) if topology.ep_size > 1 else None
        model = Transformer(cfg.model, cfg.moe, local_experts=local)
        apply_expert_parallel(model, topology)
        if cfg.parallel.activation_checkpointing:
            checkpoint_blocks(model)
        self.engine, self.optimizer, self.schedule, self.ds_config = initialize_engine(
            model, cfg, topology, self.total_steps, self.tokens_per_step
        )
        self.model: nn.Module = self.engine.module
        named = list(moe_layers(self.model))
        self.routers = [layer.router for _, layer in named]
        # transformer layer index of each MoE layer (module names are "layers.<i>.ffn")
        self.moe_layer_ids = [int(name.split(".")[1]) for name, _ in named]
        self.step = 0  # optimizer steps taken (skipped ones included: they consume data)
        self.tokens_seen = 0
        self.skipped_steps = 0
        self._nonfinite_in_a_row = 0
        # torch.manual_seed differs per rank from here on (jitter, dropout-free otherwise)
        torch.manual_seed(cfg.seed + 1000 * topology.rank + 1)

    # ------------------------------------------------------------------ steps
    def _to_device(self, batch: Batch) -> Batch:
        return {k: v.to(self.topo.device, non_blocking=True) for k, v in batch.items()}

    def _forward(self, batch: Batch) -> Any:
        # the loss only: with model.loss_chunk_tokens > 0 the full logits are never built
        return self.engine(
            batch["input_ids"], batch.get("doc_ids"), batch["labels"], return_logits=False
        )

    def train_step(
        self,
        micro_batches: Iterable[Batch],
        before_step: Callable[[Trainer], None] | None = None,
    ) -> dict[str, Any]:
        """Run ``grad_accum_steps`` micro-steps and one optimizer step; return step metrics.

        ``before_step(trainer)`` runs after the last backward (gradients reduced, not yet
        clipped) and before the optimizer step (tests read or poison gradients there).

        Non-finite gradients: every rank takes the same decision, because the decision comes
        from a norm that is all-reduced over every rank (ZeRO-1/2: DeepSpeed's overflow check on
        the global norm skips the step and counts it in ``engine.skipped_steps``; stage 0:
        moetrain's global norm, and the step is skipped by dropping every gradient so AdamW
        leaves weights and moments alone). A skipped step still consumes its data; the
        aux-loss-free bias is not updated; after ``train.max_nonfinite_in_a_row`` skipped
        steps in a row training stops with an error.
        """
        self.engine.train()
        accum = self.cfg.train.grad_accum_steps
        dev = self.topo.device
        sums = torch.zeros(3, dtype=torch.float64, device=dev)  # loss, ce, moe
        n_layers = len(self.moe_layer_ids)
        # per MoE layer: dropped, entropy, aux, z, routed assignments
        layer_sums = torch.zeros(5, n_layers, dtype=torch.float64, device=dev)
        loads: torch.Tensor | None = None
        n = 0
        lr = float(self.schedule.get_last_lr()[0])
        grad_norm: float | None = None
        skipped_before = self.engine.skipped_steps
        skip_stage0 = False
        timer = StepTimer(dev)
        for batch in micro_batches:
            n += 1
            timer.start()
            batch = self._to_device(batch)
            out = self._forward(batch)
            self.engine.backward(out.loss)
            sums += torch.stack([out.loss.detach(), out.ce_loss.detach(), out.moe_loss.detach()])
            if out.moe:
                step_loads = torch.stack([m.tokens_per_expert_E for m in out.moe]).double()
                loads = step_loads if loads is None else loads + step_loads
                routed = batch["input_ids"].numel() * self.cfg.moe.top_k
                layer_sums += torch.stack(
                    [
                        torch.stack([m.dropped.double() for m in out.moe]),
                        torch.stack([m.entropy.detach().double() for m in out.moe]),
                        torch.stack([m.aux_loss.detach().double() for m in out.moe]),
                        torch.stack([m.z_loss.detach().double() for m in out.moe]),
                        torch.full((n_layers,), float(routed), dtype=torch.float64, device=dev),
                    ]
                )
            timer.lap("fwd_bwd")
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
                    if not math.isfinite(grad_norm):
                        skip_stage0 = True
                        for p in self.model.parameters():
                            p.grad = None
            self.engine.step()
            if n == accum:
                timer.lap("optimizer")
        if n != accum:
            raise ValueError(f"train_step got {n} micro-batches, expected {accum}")
        skipped = skip_stage0 or self.engine.skipped_steps > skipped_before
        if grad_norm is None:
            norm = self.engine.get_global_grad_norm()
            grad_norm = float(norm) if norm is not None else float("nan")

        # one all-reduce for the loads and statistics of every layer and the loss sums
        parts = [layer_sums.reshape(-1), sums]
        if loads is not None:
            parts.insert(0, loads.reshape(-1))
        flat = torch.cat(parts)
        if self.topo.world_size > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        n_loads = 0 if loads is None else loads.numel()
        micro_total = accum * self.topo.world_size
        if loads is not None:
            global_loads = flat[:n_loads].view_as(loads)
            if not skipped:
                for router, load_E in zip(self.routers, global_loads, strict=True):
                    router.update_bias(load_E.float())
        stats = flat[n_loads : n_loads + layer_sums.numel()].view_as(layer_sums)
        loss, ce, moe = (flat[n_loads + layer_sums.numel() :] / micro_total).tolist()
        times = timer.read()  # after the step's results reached the host: no extra wait

        self.step += 1
        self.tokens_seen += self.tokens_per_step
        self._count_skipped(skipped, loss, grad_norm)
        rec: dict[str, Any] = {
            "step": self.step,
            "loss": loss,
            "ce_loss": ce,
            "moe_loss": moe,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": self.tokens_seen,
            "skipped": skipped,
            "skipped_steps": self.skipped_steps,
            "time/fwd_bwd_s": times.get("fwd_bwd", 0.0),
            "time/optimizer_s": times.get("optimizer", 0.0),
        }
        if loads is not None:
            rec["moe_layers"] = {
                layer: {
                    "tokens_per_expert": global_loads[i].tolist(),
                    "dropped": float(stats[0, i]),
                    "dropped_frac": float(stats[0, i] / stats[4, i].clamp_min(1)),
                    "entropy": float(stats[1, i] / micro_total),
                    "aux_loss": float(stats[2, i] / micro_total),
                    "z_loss": float(stats[3, i] / micro_total),
                    "expert_bias": self.routers[i].expert_bias.tolist(),
                }
                for i, layer in enumerate(self.moe_layer_ids)
            }
        return rec

    def _count_skipped(self, skipped: bool, loss: float, grad_norm: float) -> None:
        if not skipped:
            self._nonfinite_in_a_row = 0
            return
        self.skipped_steps += 1
        self._nonfinite_in_a_row += 1
        if self.topo.is_main:
            print(
                f"moetrain: step {self.step}: skipped (loss {loss}, grad norm {grad_norm}); "
                f"{self._nonfinite_in_a_row} in a row",
                flush=True,
            )
        limit = self.cfg.train.max_nonfinite_in_a_row
        if self._nonfinite_in_a_row >= limit:
            raise FloatingPointError(
                f"{self._nonfinite_in_a_row} optimizer steps in a row had non-finite gradients "
                f"(step {self.step}, train.max_nonfinite_in_a_row={limit}); lower optim.lr, "
                "check the data, or use train.precision=fp32/bf16"
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


class StopSignal:
    """SIGTERM / SIGINT set a flag; ranks agree on it at step boundaries (one all-reduce).

    A signal delivered to any single rank (SLURM preemption, Ctrl-C) makes every rank save a
    checkpoint at the next step boundary and exit 0.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def _agree(topo: Topology, flags: list[bool]) -> list[bool]:
    """Logical OR of each flag over every rank."""
    if topo.world_size == 1:
        return flags
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=topo.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(x) for x in t.tolist()]


def layer_stats(rec: dict[str, Any], cfg: Config) -> dict[int, LayerStats]:
    """Per-layer MoE statistics of a train_step record, keyed by transformer layer index."""
    return {
        i: LayerStats(
            tokens_per_expert=v["tokens_per_expert"],
            dropped=v["dropped"],
            entropy=v["entropy"],
            aux_loss=v["aux_loss"],
            z_loss=v["z_loss"],
            expert_bias=v["expert_bias"] if cfg.moe.bias_update_rate > 0 else None,
        )
        for i, v in rec.get("moe_layers", {}).items()
    }


def _log_record(
    rec: dict[str, Any], cfg: Config, peak: Any, world: int, watch: DeadExpertWatch | None
) -> dict[str, Any]:
    """Flatten a train_step record into the metric names of metrics.jsonl and wandb."""
    out = {k: v for k, v in rec.items() if k != "moe_layers"}
    out["perplexity"] = math.exp(min(rec["ce_loss"], 50.0))
    if "tokens_per_s" in rec:
        out.update(perf_metrics(rec["tokens_per_s"] / world, rec["flops_per_token"], peak))
    stats = layer_stats(rec, cfg)
    if stats:
        layers = rec["moe_layers"]
        out.update(
            moe_health_metrics(stats, aux_coef=cfg.moe.aux_loss_coef, z_coef=cfg.moe.z_loss_coef)
        )
        out.update(load_lists(stats))
        for i, v in layers.items():
            out[f"moe/layer{i}/dropped_frac"] = v["dropped_frac"]
        if watch is not None:
            watch.update(rec["step"], {i: st.tokens_per_expert for i, st in stats.items()})
    return out


def run_training(cfg: Config, reset_optimizer: bool = False) -> dict[str, Any]:
    """Train ``cfg`` under any launcher (or one plain process); returns a summary dict.

    Resumes from the newest complete checkpoint of ``run_dir`` (``checkpoint.resume``);
    ``reset_optimizer`` loads weights, schedule and data position but not the optimizer state
    (needed to resume with another world size or EP size).
    """
    from moetrain.data.loader import build_loader

    if cfg.train.threads_per_rank:
        torch.set_num_threads(cfg.train.threads_per_rank)
    topo: Topology | None = None
    writer: MetricsWriter | None = None
    sink: WandbSink | None = None
    stop = StopSignal().install()
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
        ckpt = Checkpointer(cfg, topo)
        resume_path = ckpt.find_resume()
        resumed: dict[str, Any] = {}
        if resume_path is not None:
            resumed = ckpt.load(resume_path, trainer, train_loader, reset_optimizer)
            if topo.is_main:
                print(f"moetrain: resumed from {resume_path} (step {trainer.step})", flush=True)
        if topo.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            dump_deepspeed_config(trainer.ds_config, run_dir)
            (run_dir / "config.yaml").write_text(
                yaml.safe_dump(redact(cfg.to_dict()), sort_keys=False)
            )

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
            return trainer.evaluate(val.iter_eval(t.eval_steps))

        writer = MetricsWriter(run_dir, enabled=topo.is_main)
        sink = WandbSink(
            cfg.logging.wandb,
            run_dir,
            config=cfg.to_dict(),
            rank=topo.rank,
            resume_id=resumed.get("extra", {}).get("wandb_run_id"),
        )
        peak = (
            resolve_peak(t.precision, cfg.logging.peak_tflops, topo.device)
            if topo.is_main
            else None
        )
        watch = DeadExpertWatch(patience=max(20, 5 * t.log_every)) if topo.is_main else None
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
        start = last_save = time.perf_counter()
        start_step = trainer.step
        first_loss = last_loss = eval_loss = None
        stopped_by: str | None = None

        def save() -> None:
            nonlocal last_save
            path = ckpt.save(trainer, train_loader, extra={"wandb_run_id": sink.run_id})
            last_save = time.perf_counter()
            if topo.is_main:
                print(f"moetrain: saved {path}", flush=True)

        while trainer.step < total:
            t0 = time.perf_counter()
            micro = _take(it, t.grad_accum_steps)
            data_s = time.perf_counter() - t0
            rec = trainer.train_step(micro)
            if topo.is_main and trainer.step == start_step + 1:
                print(f"moetrain: attention: {attention_report(trainer.model)}", flush=True)
            meter.step()
            first_loss = rec["loss"] if first_loss is None else first_loss
            last_loss = rec["loss"]
            if trainer.step % t.log_every == 0 or trainer.step in (start_step + 1, total):
                rec.update(meter.measure())
                rec.update(memory_stats(topo.device))
                rec["time/data_s"] = data_s
                rec["flops_per_token"] = meter.flops_per_token
                if topo.is_main:
                    row = _log_record(rec, cfg, peak, topo.world_size, watch)
                    writer.write(row)
                    sink.log(row, trainer.step)
                    every = cfg.logging.heatmap_every
                    if rec.get("moe_layers") and every > 0 and trainer.step % every == 0:
                        sink.log_heatmap(
                            load_matrix(layer_stats(rec, cfg)),
                            trainer.step,
                            layer_labels=list(rec["moe_layers"]),
                        )
                    elapsed = time.perf_counter() - start
                    eta = elapsed / (trainer.step - start_step) * (total - trainer.step)
                    print("moetrain: " + progress_line(trainer.step, total, rec, eta), flush=True)
            if t.eval_every > 0 and (trainer.step % t.eval_every == 0 or trainer.step == total):
                eval_loss = run_eval()
                val = {
                    "step": trainer.step,
                    "val_loss": eval_loss,
                    "val_perplexity": math.exp(min(eval_loss, 50.0)),
                }
                writer.write(val)
                sink.log(val, trainer.step)
                if topo.is_main:
                    print(f"moetrain: step {trainer.step} val loss {eval_loss:.4f}", flush=True)
            minutes = (time.perf_counter() - last_save) / 60
            signalled, time_due = _agree(
                topo,
                [
                    stop.received is not None,
                    cfg.checkpoint.save_every_minutes > 0
                    and minutes >= cfg.checkpoint.save_every_minutes,
                ],
            )
            c = cfg.checkpoint
            step_due = c.save_every_steps > 0 and trainer.step % c.save_every_steps == 0
            if signalled or time_due or step_due or trainer.step == total:
                save()
            if signalled:
                stopped_by = "signal"
                if topo.is_main:
                    print(
                        f"moetrain: stopping at step {trainer.step} on a signal (checkpoint saved)",
                        flush=True,
                    )
                break
        wall = time.perf_counter() - start
        done = trainer.step - start_step
        summary = {
            "steps": trainer.step,
            "first_loss": first_loss,
            "final_loss": last_loss,
            "eval_loss": eval_loss,
            "tokens": trainer.tokens_seen,
            "skipped_steps": trainer.skipped_steps,
            "wall_s": wall,
            "tokens_per_s": done * trainer.tokens_per_step / max(wall, 1e-9),
            "run_dir": str(run_dir),
            "resumed_from": str(resume_path) if resume_path else None,
            "stopped_by": stopped_by,
        }
        writer.write({"summary": summary})
        if topo.is_main and first_loss is not None:
            print(
                f"moetrain: done: step {trainer.step}, loss {first_loss:.4f} -> "
                f"{last_loss:.4f}, {summary['tokens_per_s']:,.0f} tok/s",
                flush=True,
            )
        return summary
    finally:
        stop.restore()
        if sink is not None:
            sink.finish()
        if writer is not None:
            writer.close()
        shutdown(topo)
