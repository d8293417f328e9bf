"""One optimizer step's statistics: summed over its micro-batches on this rank, then over every
rank in one all-reduce (the losses, whether each rank skipped the step, the expert all-to-alls'
traffic, and per MoE layer the expert loads and routing statistics)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from moetrain.monitor.step_record import StepTotals
from moetrain.parallel.all_to_all import TrafficMeter


class StepStats:
    """Sums over the micro-batches of one step on this rank: loss / CE / MoE loss, each
    multi-token-prediction depth's loss (``mtp_depth`` of them), the mixers' own metrics
    (``TransformerOutput.mixer_losses``), whether this rank skipped the
    optimizer step (:meth:`mark_skipped`, so the reduction counts the ranks that
    did), the expert all-to-alls' traffic (:attr:`TrafficMeter.FIELDS`, counted only when
    ``traffic`` is on), and per MoE layer the expert loads and (dropped, entropy, aux, z, routed
    copies, copies routed to zero experts)."""

    def __init__(
        self, n_layers: int, device: torch.device, traffic: bool = False, mtp_depth: int = 0
    ) -> None:
        self.n_layers, self.device, self.count_traffic = n_layers, device, traffic
        self.mtp_depth = mtp_depth
        self.sums = torch.zeros(4 + mtp_depth, dtype=torch.float64, device=device)
        self.traffic = [0] * len(TrafficMeter.FIELDS)
        self.layer_sums = torch.zeros(6, n_layers, dtype=torch.float64, device=device)
        self.loads: torch.Tensor | None = None
        # the mixers' own metrics (``<name>/layer<i>/<metric>``: sparse attention's indexer)
        self.mixer: dict[str, torch.Tensor] = {}

    def add(self, out: Any, routed: int) -> None:
        """One micro-batch's model output (``TransformerOutput``); ``routed`` = its tokens x
        top_k."""
        losses = [out.loss, out.ce_loss, out.moe_loss, *out.mtp_losses[: self.mtp_depth]]
        self.sums[:3] += torch.stack([t.detach().double() for t in losses[:3]])
        if self.mtp_depth:
            self.sums[4:] += torch.stack([t.detach().double() for t in losses[3:]])
        for own in out.mixer_losses:
            for metric, value in own.metrics.items():
                key = f"{own.name}/layer{own.layer}/{metric}"
                self.mixer[key] = self.mixer.get(key, 0.0) + value.detach().double()
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
                torch.stack([m.zero_copies.double() for m in out.moe]),
            ]
        )

    def add_traffic(self, meters: list[TrafficMeter]) -> None:
        """What the dispatchers' meters counted since they were last read (host integers)."""
        for meter in meters:
            self.traffic = [a + b for a, b in zip(self.traffic, meter.take(), strict=True)]

    def mark_skipped(self, skipped: bool) -> None:
        self.sums[3] = float(skipped)

    def all_reduce(self, world_size: int, micro_batches: int) -> StepTotals:
        """Sum over every rank in one all-reduce; ``micro_batches``: how many every rank's sums
        are over together (the losses' and statistics' denominators)."""
        traffic = torch.tensor(self.traffic, dtype=torch.float64, device=self.device)
        mixer_keys = sorted(self.mixer)  # (every rank reports the same)
        mixer = [self.mixer[k].reshape(1).to(self.device) for k in mixer_keys]
        parts = [self.layer_sums.reshape(-1), self.sums, traffic, *mixer]
        if self.loads is not None:
            parts.insert(0, self.loads.reshape(-1))
        flat = torch.cat(parts)
        if world_size > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        n_loads = 0 if self.loads is None else self.loads.numel()
        loads = None if self.loads is None else flat[:n_loads].view_as(self.loads)
        layers = flat[n_loads : n_loads + self.layer_sums.numel()].view_as(self.layer_sums)
        sums = flat[n_loads + self.layer_sums.numel() :].tolist()  # the host sync
        d, n_traffic = 4 + self.mtp_depth, len(TrafficMeter.FIELDS)
        traffic_sums = dict(zip(TrafficMeter.FIELDS, sums[d : d + n_traffic], strict=True))
        mixer_sums = dict(zip(mixer_keys, sums[d + n_traffic :], strict=True))
        return StepTotals(
            loss=sums[0] / micro_batches,
            ce_loss=sums[1] / micro_batches,
            moe_loss=sums[2] / micro_batches,
            ranks_skipped=int(sums[3]),
            mtp_losses=tuple(x / micro_batches for x in sums[4:d]),
            micro_batches=micro_batches,
            traffic=traffic_sums if self.count_traffic else {},
            loads=loads,
            layer_sums=layers,
            mixer={k: v / micro_batches for k, v in mixer_sums.items()},
        )
