"""MoE health metrics: load imbalance, dropped tokens, router entropy, aux/z losses, bias.

Input per MoE layer is a :class:`LayerStats` (build one from a model ``MoEOutput`` with
:meth:`LayerStats.from_moe_output`). For global-batch numbers, sum ``tokens_per_expert`` and
``dropped`` over every rank first (the same all-reduce ``Router.update_bias`` needs); otherwise
the metrics describe the local batch of the calling rank.

Metric names (``i`` = the caller's layer key, normally the transformer layer index, so that
``moe/layer3/...`` matches parameter names ``layers.3.ffn...``)::

    moe/layer{i}/tokens                    selections (tokens x top_k) before capacity
    moe/layer{i}/imbalance_max_over_mean   max / mean of tokens per expert (1 = balanced)
    moe/layer{i}/imbalance_min_over_mean   min / mean (0 = some expert got nothing)
    moe/layer{i}/cv                        coefficient of variation, population std / mean
    moe/layer{i}/load_entropy_norm         entropy of the load shares / log(E) (1 = balanced)
    moe/layer{i}/dead_experts              experts below ``dead_rel_threshold`` x mean load
    moe/layer{i}/ep_max_over_mean          (expert parallelism) max / mean of the copies each EP
                                           rank's experts compute; the other ranks wait for the
                                           busiest at the layer's exchanges (1 = balanced)
    moe/layer{i}/dropped_frac              dropped assignments / selections (capacity drops)
    moe/layer{i}/entropy                   mean per-token router entropy (nats), if given
    moe/layer{i}/aux_loss, aux_loss_scaled load-balancing loss, unscaled and x aux_coef
    moe/layer{i}/z_loss, z_loss_scaled     router z-loss, unscaled and x z_coef
    moe/layer{i}/bias_{min,max,mean,std}   aux-loss-free expert bias, if given

Global summaries: ``moe/imbalance_max_over_mean`` and ``moe/ep_max_over_mean`` (worst layer),
``moe/cv_mean``, ``moe/dropped_frac`` (all layers pooled), ``moe/dead_experts`` (sum),
``moe/entropy_mean``, ``moe/load_entropy_norm_mean``, ``moe/aux_loss``, ``moe/aux_loss_scaled``,
``moe/z_loss``, ``moe/z_loss_scaled`` (sums over layers, as the model adds them to the loss),
``moe/bias_absmax``; with hash-routed layers (``moe.hash_layers``) their load alone:
``moe/hash_imbalance_max_over_mean`` (worst of them) and ``moe/hash_dead_experts`` (sum).

For the JSONL record (and ``report.py``), :func:`load_lists` gives the per-expert lists
``moe/layer{i}/tokens_per_expert`` (and ``moe/layer{i}/expert_bias``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moetrain.monitor.console import Printer, console


def _array(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor, without importing torch here
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float64).reshape(-1)


def _scalar(x: Any) -> float | None:
    if x is None:
        return None
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().item()
    return float(x)


@dataclass
class LayerStats:
    """Statistics of one MoE layer for one step (counts may be summed over ranks/micro-steps).

    tokens_per_expert: (E,) selections per expert before capacity. dropped: number of dropped
    assignments. entropy: mean per-token routing entropy in nats. aux_loss, z_loss: unscaled.
    expert_bias: (E,) aux-loss-free bias buffer (``router.expert_bias``).
    """

    tokens_per_expert: Any
    dropped: Any = 0
    entropy: Any = None
    aux_loss: Any = None
    z_loss: Any = None
    expert_bias: Any = None

    @classmethod
    def from_moe_output(cls, out: Any, expert_bias: Any = None) -> LayerStats:
        """From a model ``MoEOutput`` (fields tokens_per_expert_E, dropped, entropy, aux_loss,
        z_loss); pass ``layer.ffn.router.expert_bias`` as ``expert_bias`` if wanted."""
        return cls(
            tokens_per_expert=out.tokens_per_expert_E,
            dropped=out.dropped,
            entropy=getattr(out, "entropy", None),
            aux_loss=out.aux_loss,
            z_loss=out.z_loss,
            expert_bias=expert_bias,
        )


def layer_metrics(
    stats: LayerStats,
    *,
    aux_coef: float = 0.0,
    z_coef: float = 0.0,
    dead_rel_threshold: float = 0.01,
    ep_size: int = 1,
) -> dict[str, float]:
    """Metrics of one layer, without the ``moe/layer{i}/`` prefix. ``ep_size`` > 1: EP rank
    ``r`` holds experts ``[r * E / ep_size, (r + 1) * E / ep_size)``."""
    load = _array(stats.tokens_per_expert)
    e = load.size
    total = float(load.sum())
    mean = total / e if e else 0.0
    out: dict[str, float] = {"tokens": total}
    if mean > 0:
        share = load / total
        nz = share[share > 0]
        out["imbalance_max_over_mean"] = float(load.max() / mean)
        out["imbalance_min_over_mean"] = float(load.min() / mean)
        out["cv"] = float(load.std() / mean)
        out["load_entropy_norm"] = float(-(nz * np.log(nz)).sum() / math.log(e)) if e > 1 else 1.0
        out["dead_experts"] = float((load < dead_rel_threshold * mean).sum())
        if ep_size > 1:
            per_rank = load.reshape(ep_size, e // ep_size).sum(1)
            out["ep_max_over_mean"] = float(per_rank.max() / per_rank.mean())
        out["dropped_frac"] = float(_scalar(stats.dropped) or 0.0) / total
    if (entropy := _scalar(stats.entropy)) is not None:
        out["entropy"] = entropy
    if (aux := _scalar(stats.aux_loss)) is not None:
        out["aux_loss"] = aux
        out["aux_loss_scaled"] = aux_coef * aux
    if (z := _scalar(stats.z_loss)) is not None:
        out["z_loss"] = z
        out["z_loss_scaled"] = z_coef * z
    if stats.expert_bias is not None:
        bias = _array(stats.expert_bias)
        out.update(
            bias_min=float(bias.min()),
            bias_max=float(bias.max()),
            bias_mean=float(bias.mean()),
            bias_std=float(bias.std()),
        )
    return out


def _as_items(layers: Mapping[int, LayerStats] | Sequence[LayerStats]) -> list[tuple[int, Any]]:
    return list(layers.items()) if isinstance(layers, Mapping) else list(enumerate(layers))


def moe_health_metrics(
    layers: Mapping[int, LayerStats] | Sequence[LayerStats],
    *,
    aux_coef: float = 0.0,
    z_coef: float = 0.0,
    dead_rel_threshold: float = 0.01,
    ep_size: int = 1,
    hash_layers: Sequence[int] = (),
) -> dict[str, float]:
    """Flat ``{name: float}`` of every layer's metrics plus the global ``moe/...`` summaries.

    ``layers``: ``{layer_index: LayerStats}``, or a sequence (keys 0..n-1). ``aux_coef`` and
    ``z_coef`` are ``moe.aux_loss_coef`` and ``moe.z_loss_coef``; ``ep_size`` is
    ``parallel.ep_size``; ``hash_layers``: the keys of the hash-routed layers
    (``moe.hash_layers``).
    """
    metrics: dict[str, float] = {}
    per_layer = []
    hashed = []
    tokens = dropped = 0.0
    bias_absmax = None
    for i, stats in _as_items(layers):
        m = layer_metrics(
            stats,
            aux_coef=aux_coef,
            z_coef=z_coef,
            dead_rel_threshold=dead_rel_threshold,
            ep_size=ep_size,
        )
        per_layer.append(m)
        if int(i) in hash_layers:
            hashed.append(m)
        metrics.update({f"moe/layer{i}/{k}": v for k, v in m.items()})
        tokens += m["tokens"]
        dropped += float(_scalar(stats.dropped) or 0.0)
        if "bias_min" in m:
            b = max(abs(m["bias_min"]), abs(m["bias_max"]))
            bias_absmax = b if bias_absmax is None else max(bias_absmax, b)
    if not per_layer:
        return metrics

    def values(key: str) -> list[float]:
        return [m[key] for m in per_layer if key in m]

    if v := values("imbalance_max_over_mean"):
        metrics["moe/imbalance_max_over_mean"] = max(v)
        metrics["moe/cv_mean"] = float(np.mean(values("cv")))
        metrics["moe/load_entropy_norm_mean"] = float(np.mean(values("load_entropy_norm")))
        metrics["moe/dead_experts"] = float(sum(values("dead_experts")))
    if v := values("ep_max_over_mean"):
        metrics["moe/ep_max_over_mean"] = max(v)
    if tokens > 0:
        metrics["moe/dropped_frac"] = dropped / tokens
    if v := values("entropy"):
        metrics["moe/entropy_mean"] = float(np.mean(v))
    for key in ("aux_loss", "aux_loss_scaled", "z_loss", "z_loss_scaled"):
        if v := values(key):
            metrics[f"moe/{key}"] = float(sum(v))
    if bias_absmax is not None:
        metrics["moe/bias_absmax"] = bias_absmax
    if v := [m["imbalance_max_over_mean"] for m in hashed if "imbalance_max_over_mean" in m]:
        metrics["moe/hash_imbalance_max_over_mean"] = max(v)
        metrics["moe/hash_dead_experts"] = float(sum(m.get("dead_experts", 0.0) for m in hashed))
    return metrics


def load_lists(
    layers: Mapping[int, LayerStats] | Sequence[LayerStats],
) -> dict[str, list[float]]:
    """Per-expert lists for the JSONL record: ``moe/layer{i}/tokens_per_expert`` and, where a
    bias is given, ``moe/layer{i}/expert_bias``."""
    out: dict[str, list[float]] = {}
    for i, stats in _as_items(layers):
        out[f"moe/layer{i}/tokens_per_expert"] = _array(stats.tokens_per_expert).tolist()
        if stats.expert_bias is not None:
            out[f"moe/layer{i}/expert_bias"] = _array(stats.expert_bias).tolist()
    return out


def load_matrix(layers: Mapping[int, LayerStats] | Sequence[LayerStats]) -> np.ndarray:
    """(layers x experts) tokens-per-expert matrix, rows in the order given (for heatmaps)."""
    return np.stack([_array(s.tokens_per_expert) for _, s in _as_items(layers)])


class DeadExpertWatch:
    """Warns on the console when an expert receives (almost) no tokens for many steps.

    An expert is *starved* at a step when its load is below ``rel_threshold`` x the layer's mean
    load per expert (the uniform share; 0.01 = under 1% of a fair share). When it has been
    starved at every observed step from step ``s0`` to the current step ``s`` and
    ``s - s0 + 1 >= patience`` steps, one warning is printed for it; no further warning for that
    expert until it recovers (load back at or above the threshold), which is also reported once.
    Call :meth:`update` at any cadence (every step or every log step) with increasing steps.
    """

    def __init__(
        self, rel_threshold: float = 0.01, patience: int = 100, printer: Printer = console
    ) -> None:
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.rel_threshold = rel_threshold
        self.patience = patience
        self.printer = printer
        self._since: dict[tuple[int, int], int] = {}  # (layer, expert) -> first starved step
        self._warned: set[tuple[int, int]] = set()

    @property
    def warned(self) -> set[tuple[int, int]]:
        """(layer, expert) pairs currently reported as dead."""
        return set(self._warned)

    def update(self, step: int, load: Mapping[int, Any] | Sequence[Any]) -> list[tuple[int, int]]:
        """Observe ``{layer: tokens_per_expert (E,)}`` (or a sequence) at ``step``; returns the
        (layer, expert) pairs newly warned about at this call."""
        new: list[tuple[int, int]] = []
        for layer, counts in _as_items(load):
            arr = _array(counts)
            mean = float(arr.mean()) if arr.size else 0.0
            if mean <= 0:  # no tokens routed at all in this layer: nothing to judge
                continue
            for e, c in enumerate(arr):
                key = (layer, e)
                if c < self.rel_threshold * mean:
                    since = self._since.setdefault(key, step)
                    if key not in self._warned and step - since + 1 >= self.patience:
                        self._warned.add(key)
                        new.append(key)
                        self.printer(
                            f"warning: MoE layer {layer} expert {e} received "
                            f"{c / arr.sum():.2%} of tokens (< {self.rel_threshold:g} x fair "
                            f"share {1 / arr.size:.2%}) for {step - since + 1} steps "
                            f"(since step {since}); it may be dead"
                        )
                else:
                    self._since.pop(key, None)
                    if key in self._warned:
                        self._warned.discard(key)
                        self.printer(
                            f"MoE layer {layer} expert {e} recovered at step {step} "
                            f"({c / arr.sum():.2%} of tokens)"
                        )
        return new
