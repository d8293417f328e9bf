"""A run's model and DeepSpeed engine, and what it does: one optimizer step, evaluation.

Every rank builds the same model with the same seed (or from ``checkpoint.init_from``), holding
only its own experts; parallelism
is applied (:func:`moetrain.parallel.apply.apply_parallelism`); the optimizer and the
learning-rate schedule are built here (``optim.name``'s optimizer, :mod:`moetrain.optim`) and handed
to the engine.
One optimizer step is :class:`moetrain.train.step.OptimizerStep`; the run's progress is a
:class:`~moetrain.train.progress.Progress`, and :meth:`Trainer.run_state` hands a checkpointer
the stateful objects it saves and restores.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moetrain.checkpoint.checkpointer import RunState
from moetrain.config import Config
from moetrain.init_from.source import InitSource
from moetrain.init_from.weights import build_model, init_record
from moetrain.optim.registry import build_optimizer, optimizer_spec
from moetrain.optim.schedule import LRSchedule
from moetrain.parallel.apply import apply_parallelism
from moetrain.parallel.deepspeed import deepspeed_config, initialize_engine
from moetrain.parallel.master_weights import fp32_masters_in_module
from moetrain.parallel.sequence_parallel import shard_batch
from moetrain.parallel.topology import Topology
from moetrain.parallel.zero3 import check_placement
from moetrain.train.host_allocator import settle_host_allocator
from moetrain.train.nonfinite import LossScalerState, SkipCounter
from moetrain.train.progress import Progress
from moetrain.train.step import Batch, OptimizerStep, forward_loss
from moetrain.train.zero3_build import build_zero3_model


def tokens_per_step(cfg: Config, world_size: int) -> int:
    """Tokens of one optimizer step over every rank, each counted once: a sequence-parallel
    group of ``parallel.sp_size`` ranks shares its sequences."""
    t = cfg.train
    data_world = world_size // cfg.parallel.sp_size
    return t.micro_batch_size * t.grad_accum_steps * data_world * cfg.data.seq_len


def total_steps(cfg: Config, world_size: int) -> int:
    """``train.max_steps``, or ``train.max_tokens // tokens per step`` when that is set."""
    if cfg.train.max_tokens is not None:
        return max(1, cfg.train.max_tokens // tokens_per_step(cfg, world_size))
    return cfg.train.max_steps


class Trainer:
    """Model + engine for one run; :meth:`train_step` runs one optimizer step.

    ``progress`` (:class:`~moetrain.train.progress.Progress`): steps taken, tokens seen, skipped
    steps, fp16 loss-scale overflows, and what the first weights were loaded from.
    """

    def __init__(self, cfg: Config, topology: Topology, init: InitSource | None = None) -> None:
        from moetrain.model.transformer import Transformer

        self.cfg, self.topo = cfg, topology
        self.tokens_per_step = tokens_per_step(cfg, topology.world_size)
        self.total_steps = total_steps(cfg, topology.world_size)
        # Same seed everywhere: every rank builds the same model, holding only its experts.
        torch.manual_seed(cfg.seed)
        local = topology.local_experts(cfg.moe.num_experts) if topology.ep_size > 1 else None
        self.progress = Progress()
        self.ds_config = deepspeed_config(cfg, topology.world_size)
        if init is not None:
            self.progress.init = init_record(init, cfg)
        if cfg.parallel.zero_stage == 3:  # partitioned as it is built (parallel/zero3.py)
            model = build_zero3_model(cfg, topology, self.ds_config, local, init)
        else:
            if init is not None:  # before the engine: ZeRO's fp32 partitions start from these
                model = build_model(cfg, init, local)
            else:
                model = Transformer(cfg.model, cfg.moe, local_experts=local)
            apply_parallelism(model, cfg.parallel, topology)
            model.to(topology.device)
        optimizer = build_optimizer(model, cfg.optim, topology.device)
        self.engine, self.optimizer, self.schedule = initialize_engine(
            model, optimizer, self._make_schedule, self.ds_config
        )
        if cfg.parallel.zero_stage == 3:
            check_placement(self.engine, topology)
        spec = optimizer_spec(cfg.optim.name)
        if spec.attach is not None:  # (after the engine: how ZeRO partitioned the groups)
            spec.attach(optimizer, self.optimizer)
        qk_clip = spec.qk_clip(cfg.optim)
        self.model: nn.Module = self.engine.module
        self._step = OptimizerStep(
            cfg,
            topology,
            self.engine,
            self.schedule,
            self.progress,
            SkipCounter(cfg.train.max_nonfinite_in_a_row),
            self.tokens_per_step,
            qk_clip,
            optimizer.set_row_scales if qk_clip > 0 else None,
        )
        self.routers = self._step.routers
        self.loss_scaler = LossScalerState(self.engine.optimizer)
        # torch.manual_seed differs per rank from here on (jitter, dropout-free otherwise)
        torch.manual_seed(cfg.seed + 1000 * topology.rank + 1)

    def _make_schedule(self, optimizer: Any) -> LRSchedule:
        return LRSchedule(optimizer, self.cfg.optim, self.total_steps, self.tokens_per_step)

    def forward(self, batch: Batch) -> Any:
        """The loss only (:func:`moetrain.train.step.forward_loss`)."""
        return forward_loss(self.engine, batch)

    def train_step(
        self,
        micro_batches: Iterable[Batch],
        before_step: Callable[[Trainer], None] | None = None,
        track_logits: bool = False,
    ) -> dict[str, Any]:
        """One optimizer step (:class:`moetrain.train.step.OptimizerStep`); returns its record.
        ``before_step(trainer)`` runs after the last backward (gradients reduced, not yet
        clipped) and before the optimizer step (tests read or poison gradients there);
        ``track_logits``: the record holds the largest attention logits (``attn/...``)."""
        hook = None if before_step is None else lambda: before_step(self)
        record = self._step(micro_batches, hook, track_logits)
        settle_host_allocator()  # (the run's lasting buffers exist now)
        return record

    def checkpoint_weights(self) -> AbstractContextManager[int]:
        """Around ``engine.save_checkpoint``: the module holds the fp32 master weights, so the
        checkpoint's model files do (:mod:`moetrain.parallel.master_weights`). Collective. At
        ZeRO-3 nothing: the model files hold no weights, the optimizer files the fp32 masters'
        partitions."""
        if self.cfg.parallel.zero_stage == 3:
            return nullcontext(0)
        return fp32_masters_in_module(self.model)

    def run_state(self, data: Any) -> RunState:
        """What a checkpoint of this run saves and restores, with ``data`` the training data
        position (a loader; its tokenizer identity and files travel with the checkpoint)."""
        files = getattr(data, "tokenizer_files", None) or ()
        return RunState(
            engine=self.engine,
            progress=self.progress,
            schedule=self.schedule,
            loss_scaler=self.loss_scaler,
            data=data,
            fp32_weights=self.checkpoint_weights,
            tokenizer_sha256=getattr(data, "tokenizer_sha256", None),
            tokenizer_files=tuple(Path(f) for f in files),
        )

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch]) -> float:
        """Mean cross-entropy over ``batches`` on every rank, averaged over ranks."""
        self.engine.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.topo.device)
        for batch in batches:
            batch = {k: v.to(self.topo.device, non_blocking=True) for k, v in batch.items()}
            out = self.forward(shard_batch(batch, self.topo))
            total += torch.stack([out.ce_loss.double(), torch.ones((), device=total.device)])
        if self.topo.world_size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        self.engine.train()
        return float(total[0] / total[1].clamp_min(1))
