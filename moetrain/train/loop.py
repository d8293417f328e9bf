"""``moetrain train``: the run loop under any launcher (or one plain process).

Each step: take ``train.grad_accum_steps`` micro-batches, run the step, then ask small objects
whether to log, evaluate and save; ranks agree on a stop signal and on the time-based save in
one all-reduce. Checkpoints (:mod:`moetrain.checkpoint.checkpointer`) are saved every
``checkpoint.save_every_steps`` steps and/or ``save_every_minutes`` minutes, at the end, and
when any rank receives SIGTERM/SIGINT; a run resumes from the newest complete checkpoint of its
run_dir, else starts from ``checkpoint.init_from`` when set (:mod:`moetrain.train.start`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml

from moetrain.checkpoint.checkpointer import Checkpointer
from moetrain.config import Config
from moetrain.faults import fault_point
from moetrain.model.attention import attention_report
from moetrain.model.cpu_matmul import use_cpu_matmul
from moetrain.model.recurrent_kernels import recurrent_report, use_recurrent_kernels
from moetrain.monitor.run_monitor import RunMonitor
from moetrain.parallel.deepspeed import check_precision_supported, dump_deepspeed_config
from moetrain.parallel.topology import Topology, init_distributed, shutdown
from moetrain.parallel.watchdog import CollectiveFailure, is_collective_failure
from moetrain.redact import redact
from moetrain.train.cadence import Clock, Periodic
from moetrain.train.host_allocator import tune_host_allocator
from moetrain.train.launcher_env import launcher_disagreements
from moetrain.train.signals import StopSignal, agree_any
from moetrain.train.start import check_start, choose_start, open_start
from moetrain.train.step import Batch
from moetrain.train.trainer import Trainer


def _take(it: Iterator[Batch], n: int) -> list[Batch]:
    out = []
    for _ in range(n):
        try:
            out.append(next(it))
        except StopIteration:
            raise RuntimeError("the training data loader ran out of batches") from None
    return out


def _write_run_files(cfg: Config, trainer: Trainer) -> None:
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_deepspeed_config(trainer.ds_config, run_dir)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(redact(cfg.to_dict()), sort_keys=False))


def set_up_process(cfg: Config) -> str | None:
    """What ``moetrain train`` sets for its process before anything else: threads per rank, the
    CPU matmul kernel, the recurrent mixers' kernels and, on a CPU-only machine, glibc's
    allocator (before any process group starts its threads). -> the allocator's note for the
    console, if any."""
    if cfg.train.threads_per_rank:
        torch.set_num_threads(cfg.train.threads_per_rank)
    use_cpu_matmul(cfg.train.cpu_matmul)
    use_recurrent_kernels(cfg.train.recurrent_kernels)
    if torch.cuda.is_available():
        return None
    return tune_host_allocator(cfg.train.host_allocator)


def run_training(cfg: Config, reset_optimizer: bool = False) -> dict[str, Any]:
    """Train ``cfg``; returns a summary dict.

    Resumes from the newest complete checkpoint of ``run_dir`` (``checkpoint.resume``);
    ``reset_optimizer`` loads weights, schedule and data position but not the optimizer state
    (needed to resume with another world size or EP size).
    """
    from moetrain.data.splits import build_loader

    allocator_note = set_up_process(cfg)
    topo: Topology | None = None
    monitor: RunMonitor | None = None
    stop = StopSignal().install()
    finished = False
    try:
        check_precision_supported(cfg.train.precision)  # before any process group starts
        check_start(cfg, reset_optimizer)  # a resume that cannot continue, refused here
        topo = init_distributed(cfg)
        source = open_start(cfg, topo)  # a bad init_from fails before anything is written
        t, c = cfg.train, cfg.checkpoint

        def loader(split: str) -> Any:
            return build_loader(
                cfg.data,
                split,
                t.micro_batch_size,
                topo.data_rank,  # a sequence-parallel group's ranks read the same rows
                topo.data_world,
                cfg.seed,
                vocab_size=cfg.model.vocab_size,
            )

        train_loader = loader("train")
        ckpt = Checkpointer(cfg, topo)
        resume_path = choose_start(cfg, ckpt, source)
        trainer = Trainer(cfg, topo, init=None if resume_path else source)
        resumed_wandb_id = None
        if resume_path is not None:
            state = ckpt.load(resume_path, trainer.run_state(train_loader), reset_optimizer)
            resumed_wandb_id = state.extra.get("wandb_run_id")
        progress = trainer.progress
        total, start_step = trainer.total_steps, progress.step
        monitor = RunMonitor(
            cfg, topo, trainer.tokens_per_step, total, start_step, resumed_wandb_id
        )
        for msg in launcher_disagreements(cfg, dict(os.environ)):
            monitor.say(f"warning: {msg}")
        if resume_path is not None:
            monitor.say(f"resumed from {resume_path} (step {progress.step})")
        if allocator_note is not None:
            monitor.say(allocator_note)
        if topo.is_main:
            _write_run_files(cfg, trainer)
        monitor.say(
            f"training {total} steps, {trainer.tokens_per_step} tokens/step, world "
            f"{topo.world_size} (ep {topo.ep_size}, sp {topo.sp_size}, zero "
            f"{cfg.parallel.zero_stage}, {topo.backend})"
        )
        log = Periodic(t.log_every, also=(start_step + 1, total))
        evaluate = Periodic(t.eval_every, also=(total,) if t.eval_every > 0 else ())
        save = Periodic(c.save_every_steps, also=(total,))
        save_clock = Clock(c.save_every_minutes)
        it = iter(train_loader)
        start = time.perf_counter()
        first_loss = last_loss = eval_loss = None
        stopped_by: str | None = None
        while progress.step < total:
            topo.phase(f"training step {progress.step + 1}")
            fault_point("train.step", topo.rank, progress.step + 1)
            t0 = time.perf_counter()
            micro = _take(it, t.grad_accum_steps)
            data_s = time.perf_counter() - t0
            rec = trainer.train_step(micro, track_logits=log.due(progress.step + 1))
            if progress.step == start_step + 1:
                monitor.say(f"attention: {attention_report(trainer.model)}")
                if (recurrent := recurrent_report(trainer.model)) is not None:
                    monitor.say(f"recurrent mixers: {recurrent}")
            first_loss = rec["loss"] if first_loss is None else first_loss
            last_loss = rec["loss"]
            sources = train_loader.source_progress()
            monitor.step_done(rec, data_s, log=log.due(progress.step), sources=sources)
            if evaluate.due(progress.step):
                topo.phase(f"evaluation at step {progress.step}")
                eval_loss, by_source = loader("val").evaluate(t.eval_steps, trainer.evaluate)
                monitor.eval_done(progress.step, eval_loss, by_source)
            topo.phase(f"agreeing on stop / save after step {progress.step}")
            signalled, time_due = agree_any(topo, [stop.received is not None, save_clock.due()])
            if signalled or time_due or save.due(progress.step):
                extra = {"wandb_run_id": monitor.wandb_run_id}
                path = ckpt.save(trainer.run_state(train_loader), extra)
                save_clock.reset()
                monitor.say(f"saved {path}")
            if signalled:
                stopped_by = "signal"
                monitor.say(f"stopping at step {progress.step} on a signal (checkpoint saved)")
                break
        wall = time.perf_counter() - start
        summary = {
            "steps": progress.step,
            "first_loss": first_loss,
            "final_loss": last_loss,
            "eval_loss": eval_loss,
            "tokens": progress.tokens_seen,
            "skipped_steps": progress.skipped_steps,
            "wall_s": wall,
            "tokens_per_s": (progress.step - start_step)
            * trainer.tokens_per_step
            / max(wall, 1e-9),
            "run_dir": str(cfg.run_dir),
            "resumed_from": str(resume_path) if resume_path else None,
            "stopped_by": stopped_by,
        }
        monitor.summary(summary)
        if first_loss is not None:
            monitor.say(
                f"done: step {progress.step}, loss {first_loss:.4f} -> {last_loss:.4f}, "
                f"{summary['tokens_per_s']:,.0f} tok/s"
            )
        finished = True
        return summary
    except RuntimeError as e:
        if topo is None or topo.watch is None or not is_collective_failure(e):
            raise
        raise CollectiveFailure(topo.watch.explain(e, cfg.parallel.timeout_minutes)) from e
    finally:
        stop.restore()
        if monitor is not None:
            monitor.close()
        shutdown(topo, clean=finished)
