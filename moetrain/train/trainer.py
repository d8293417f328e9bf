"""A run's model and DeepSpeed engine, and what it does: one optimizer step, evaluation.

Every rank builds the same model with the same seed (or from ``checkpoint.init_from``), holding
only its own experts; parallelism
is applied (:func:`moetrain.parallel.apply.apply_parallelism`); the optimizer and the
learning-rate schedule are built here (:mod:`moetrain.train.optim`) and handed to the engine.
One optimizer step is :func:`moetrain.train.step.run_step`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moetrain.config import Config
from moetrain.init_from.source import InitSource
from moetrain.init_from.weights import build_model, init_record
from moetrain.parallel.apply import apply_parallelism
from moetrain.parallel.deepspeed import deepspeed_config, initialize_engine
from moetrain.parallel.master_weights import fp32_masters_in_module
from moetrain.parallel.topology import Topology
from moetrain.train.nonfinite import SkipCounter, load_loss_scaler_state, loss_scaler_state
from moetrain.train.optim import LRSchedule, build_optimizer
from moetrain.train.step import Batch, run_step


def tokens_per_step(cfg: Config, world_size: int) -> int:
    t = cfg.train
    return t.micro_batch_size * t.grad_accum_steps * world_size * cfg.data.seq_len


def total_steps(cfg: Config, world_size: int) -> int:
    """``train.max_steps``, or ``train.max_tokens // tokens per step`` when that is set."""
    if cfg.train.max_tokens is not None:
        return max(1, cfg.train.max_tokens // tokens_per_step(cfg, world_size))
    return cfg.train.max_steps


class Trainer:
    """Model + engine for one run; :meth:`train_step` runs one optimizer step.

    ``step`` counts optimizer steps taken (skipped ones included: they consume data);
    ``skipped_steps`` the non-finite ones, ``loss_scale_overflows`` the fp16 loss-scale
    calibration skips (:mod:`moetrain.train.nonfinite`).
    """

    def __init__(self, cfg: Config, topology: Topology, init: InitSource | None = None) -> None:
        from moetrain.model.transformer import Transformer

        self.cfg, self.topo = cfg, topology
        self.tokens_per_step = tokens_per_step(cfg, topology.world_size)
        self.total_steps = total_steps(cfg, topology.world_size)
        # Same seed everywhere: every rank builds the same model, holding only its experts.
        torch.manual_seed(cfg.seed)
        local = topology.local_experts(cfg.moe.num_experts) if topology.ep_size > 1 else None
        # what the weights were initialised from (checkpoint.init_from), kept in checkpoints
        self.init_record: dict[str, Any] | None = None
        if init is not None:  # before the engine: ZeRO's fp32 partitions start from these
            model = build_model(cfg, init, local)
            self.init_record = init_record(init, cfg)
        else:
            model = Transformer(cfg.model, cfg.moe, local_experts=local)
        apply_parallelism(model, cfg.parallel, topology)
        model.to(topology.device)
        optimizer = build_optimizer(model, cfg.optim, topology.device)
        self.ds_config = deepspeed_config(cfg, topology.world_size)
        self.engine, self.optimizer, self.schedule = initialize_engine(
            model, optimizer, self._make_schedule, self.ds_config
        )
        self.model: nn.Module = self.engine.module
        moe = self.model.moe_layers()
        self.routers = [layer.router for layer in moe]
        # the expert all-to-alls' traffic counters (dispatchers that communicate have one)
        self.traffic_meters = [
            layer.dispatcher.traffic for layer in moe if hasattr(layer.dispatcher, "traffic")
        ]
        self.moe_layer_ids = [layer.layer for layer in moe]
        self.step = 0
        self.tokens_seen = 0
        self.skipped_steps = 0
        self.loss_scale_overflows = 0
        self.skips = SkipCounter(cfg.train.max_nonfinite_in_a_row)
        # torch.manual_seed differs per rank from here on (jitter, dropout-free otherwise)
        torch.manual_seed(cfg.seed + 1000 * topology.rank + 1)

    def _make_schedule(self, optimizer: Any) -> LRSchedule:
        return LRSchedule(optimizer, self.cfg.optim, self.total_steps, self.tokens_per_step)

    def forward(self, batch: Batch) -> Any:
        """The loss only: with model.loss_chunk_tokens > 0 the full logits are never built."""
        return self.engine(
            batch["input_ids"], batch.get("doc_ids"), batch["labels"], return_logits=False
        )

    def train_step(
        self,
        micro_batches: Iterable[Batch],
        before_step: Callable[[Trainer], None] | None = None,
    ) -> dict[str, Any]:
        """One optimizer step (:func:`moetrain.train.step.run_step`); returns its record."""
        return run_step(self, micro_batches, before_step)

    def checkpoint_weights(self) -> AbstractContextManager[int]:
        """Around ``engine.save_checkpoint``: the module holds the fp32 master weights, so the
        checkpoint's model files do (:mod:`moetrain.parallel.master_weights`). Collective."""
        return fp32_masters_in_module(self.model)

    def loss_scaler_state(self) -> dict[str, float] | None:
        """The fp16 dynamic loss scaler's state (None without one), for the checkpoint."""
        return loss_scaler_state(self.engine.optimizer)

    def load_loss_scaler_state(self, state: dict[str, float] | None) -> None:
        load_loss_scaler_state(self.engine.optimizer, state)

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch]) -> float:
        """Mean cross-entropy over ``batches`` on every rank, averaged over ranks."""
        self.engine.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.topo.device)
        for batch in batches:
            batch = {k: v.to(self.topo.device, non_blocking=True) for k, v in batch.items()}
            out = self.forward(batch)
            total += torch.stack([out.ce_loss.double(), torch.ones((), device=total.device)])
        if self.topo.world_size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        self.engine.train()
        return float(total[0] / total[1].clamp_min(1))
