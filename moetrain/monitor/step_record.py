"""The record of one optimizer step (what ``Trainer.train_step`` returns), built from the step's
statistics summed over every rank; :mod:`moetrain.monitor.records` flattens it into metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor


@dataclass(frozen=True)
class StepTotals:
    """One step's statistics over every rank (the step's one all-reduce).

    ``loss``, ``ce_loss``, ``moe_loss``: means over the ``micro_batches`` micro-batches of every
    rank; ``ranks_skipped``: how many ranks skipped the optimizer step; ``traffic``: the expert
    all-to-alls' counters by name (empty without expert parallelism); ``loads`` (MoE layers, E):
    selections per expert; ``layer_sums`` (6, MoE layers): dropped copies, entropy, aux loss,
    z loss, routed copies and the copies routed to zero experts summed over the micro-batches (``loads`` None without MoE layers);
    ``mtp_losses``: each multi-token-prediction depth's loss, a mean as ``loss`` (empty without);
    ``mixer``: the mixers' own metrics by ``<name>/layer<i>/<metric>``, means as ``loss``.
    """

    loss: float
    ce_loss: float
    moe_loss: float
    ranks_skipped: int
    micro_batches: int
    traffic: dict[str, float]
    loads: Tensor | None
    layer_sums: Tensor
    mtp_losses: tuple[float, ...] = ()
    mixer: dict[str, float] = field(default_factory=dict)


def moe_layer_record(
    totals: StepTotals, layer_ids: list[int], expert_bias: list[Tensor]
) -> dict[int, dict[str, Any]]:
    """Per transformer layer index: tokens_per_expert, dropped, dropped_frac (of the routed
    copies), entropy, aux_loss, z_loss (means over micro-batches), expert_bias and
    zero_expert_share (the routed copies that went to zero experts, ``moe.zero_experts``)."""
    if totals.loads is None:
        return {}
    sums, n = totals.layer_sums, totals.micro_batches
    return {
        layer: {
            "tokens_per_expert": totals.loads[i].tolist(),
            "dropped": float(sums[0, i]),
            "dropped_frac": float(sums[0, i] / sums[4, i].clamp_min(1)),
            "entropy": float(sums[1, i] / n),
            "aux_loss": float(sums[2, i] / n),
            "z_loss": float(sums[3, i] / n),
            "expert_bias": expert_bias[i].tolist(),
            "zero_expert_share": float(sums[5, i] / sums[4, i].clamp_min(1)),
        }
        for i, layer in enumerate(layer_ids)
    }


def step_record(
    totals: StepTotals,
    *,
    step: int,
    tokens: int,
    lr: float,
    grad_norm: float,
    skipped: bool,
    skipped_steps: int,
    times: dict[str, float],
    moe_layers: dict[int, dict[str, Any]],
    loss_scale: float | None = None,
    loss_scale_overflows: int = 0,
) -> dict[str, Any]:
    """The step's record: ``step, loss, ce_loss, moe_loss, lr, grad_norm, tokens, skipped,
    skipped_steps, time/fwd_bwd_s, time/optimizer_s``, ``comm/a2a_<counter>`` under expert
    parallelism, ``loss_scale`` and ``loss_scale_overflows`` with a dynamic loss scale (fp16),
    ``mtp_loss`` (the mean over depths, unweighted) and ``mtp_loss/depth<k>`` with
    multi-token prediction, the mixers' own metrics (:func:`mixer_metrics`), and ``moe_layers`` (:func:`moe_layer_record`) when the model has MoE layers."""
    rec: dict[str, Any] = {
        "step": step,
        "loss": totals.loss,
        "ce_loss": totals.ce_loss,
        "moe_loss": totals.moe_loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": tokens,
        "skipped": skipped,
        "skipped_steps": skipped_steps,
        "time/fwd_bwd_s": times.get("fwd_bwd", 0.0),
        "time/optimizer_s": times.get("optimizer", 0.0),
    }
    rec.update({f"comm/a2a_{name}": value for name, value in totals.traffic.items()})
    rec.update(mixer_metrics(totals.mixer))
    if totals.mtp_losses:
        rec["mtp_loss"] = sum(totals.mtp_losses) / len(totals.mtp_losses)
        for k, value in enumerate(totals.mtp_losses, start=1):
            rec[f"mtp_loss/depth{k}"] = value
    if loss_scale is not None:
        rec["loss_scale"] = loss_scale
        rec["loss_scale_overflows"] = loss_scale_overflows
    if moe_layers:
        rec["moe_layers"] = moe_layers
    return rec


def mixer_metrics(per_layer: dict[str, float]) -> dict[str, float]:
    """The mixers' own metrics: each ``<name>/layer<i>/<metric>`` as given, and
    ``<name>/<metric>``, its mean over the layers (sparse attention: ``index/kl``, the
    indexers' KL divergence, and ``index/recall``, their top-k recall against dense
    attention)."""
    groups: dict[str, list[float]] = {}
    for key, value in per_layer.items():
        name, _, metric = key.split("/")
        groups.setdefault(f"{name}/{metric}", []).append(value)
    return {**per_layer, **{k: sum(v) / len(v) for k, v in groups.items()}}
