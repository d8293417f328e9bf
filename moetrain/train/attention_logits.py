"""A step's largest pre-softmax attention logits: tracked on the forward passes of the steps that
need them (:mod:`moetrain.model.logit_max`), the maximum over every rank (one all-reduce), the
record's ``attn/max_logit`` (and ``attn/layer<i>/max_logit``), and QK-clip's row multipliers.

QK-clip (Kimi K2's MuonClip, threshold tau): a head whose largest logit S exceeds tau gets
``gamma = tau / S`` (1 elsewhere) and its query and key weights rescaled after the step so that
its logits scale by gamma, as the mixer says (``TokenMixer.qk_clip_scales``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moetrain.model.mixers.base import TokenMixer


def clip_factors(maxima_H: torch.Tensor, threshold: float) -> torch.Tensor:
    """Per head ``min(1, threshold / max logit)`` (1 where the maximum is not above it)."""
    over = maxima_H > threshold
    return torch.where(over, threshold / maxima_H.clamp_min(threshold), 1.0)


class AttentionLogits:
    """The token mixers of ``model`` with query-key logits (attention), in layer order."""

    def __init__(self, model: nn.Module, world_size: int) -> None:
        self.modules = [
            (n, m)
            for n, m in model.named_modules()
            if isinstance(m, TokenMixer) and m.query_key_logits
        ]
        self.world_size = world_size

    def track(self, on: bool) -> None:
        """Track (and start from nothing) on the forward passes from now on, or stop."""
        for _, module in self.modules:
            module.track_logits = on
            module.logit_max_H = None

    def reduce(self, device: torch.device) -> torch.Tensor:
        """(layers, heads) fp32: the maxima since :meth:`track`, over every rank (collective)."""
        rows = []
        for _, module in self.modules:
            seen = getattr(module, "logit_max_H", None)
            rows.append(seen if seen is not None else torch.full((module.n_heads,), -torch.inf))
        maxima = torch.stack([r.to(device, torch.float32) for r in rows])
        if self.world_size > 1:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        return maxima

    def record(self, maxima: torch.Tensor) -> dict[str, Any]:
        """The step record's entries: the largest logit overall and per layer."""
        out: dict[str, Any] = {"attn/max_logit": float(maxima.max())}
        for (name, _), row in zip(self.modules, maxima, strict=True):
            out[f"attn/{_layer(name)}/max_logit"] = float(row.max())
        return out

    def row_scales(self, maxima: torch.Tensor, threshold: float) -> dict[str, torch.Tensor]:
        """QK-clip's row multipliers by parameter name, for the heads over ``threshold``."""
        out: dict[str, torch.Tensor] = {}
        for (name, module), row in zip(self.modules, maxima, strict=True):
            gamma = clip_factors(row.cpu(), threshold)
            if bool((gamma < 1).any()):
                scales = module.qk_clip_scales(gamma)
                out.update({f"{name}.{param}": rows for param, rows in scales.items()})
        return out


def _layer(module_name: str) -> str:
    """``layers.3.attn`` -> ``layer3``."""
    parts = module_name.split(".")
    return f"layer{parts[1]}" if len(parts) > 1 and parts[0] == "layers" else module_name
