"""From a training step's record to what is reported: metric names for metrics.jsonl and
wandb (perplexity, MFU, per-layer MoE health) and the console's progress line."""

from __future__ import annotations

import math
from typing import Any

from moetrain.config import Config
from moetrain.monitor.mfu import Peak, perf_metrics
from moetrain.monitor.moe_health import (
    DeadExpertWatch,
    LayerStats,
    load_lists,
    moe_health_metrics,
)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


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


def step_metrics(
    rec: dict[str, Any],
    cfg: Config,
    peak: Peak | None,
    world: int,
    watch: DeadExpertWatch | None = None,
) -> dict[str, Any]:
    """Flatten a train_step record into the metric names of metrics.jsonl and wandb; feed the
    dead-expert ``watch`` with the step's loads."""
    out = {k: v for k, v in rec.items() if k != "moe_layers"}
    out["perplexity"] = perplexity(rec["ce_loss"])
    if "tokens_per_s" in rec:
        out.update(perf_metrics(rec["tokens_per_s"] / world, rec["flops_per_token"], peak))
    stats = layer_stats(rec, cfg)
    if stats:
        out.update(
            moe_health_metrics(
                stats,
                aux_coef=cfg.moe.aux_loss_coef,
                z_coef=cfg.moe.z_loss_coef,
                ep_size=cfg.parallel.ep_size,
                hash_layers=cfg.moe.hash_layers or (),
            )
        )
        out.update(load_lists(stats))
        for i, v in rec["moe_layers"].items():
            out[f"moe/layer{i}/dropped_frac"] = v["dropped_frac"]
        if cfg.moe.zero_experts:  # the share of routed copies that went to zero experts
            shares = {i: v["zero_expert_share"] for i, v in rec["moe_layers"].items()}
            out.update({f"moe/layer{i}/zero_expert_share": s for i, s in shares.items()})
            out["moe/zero_expert_share"] = sum(shares.values()) / len(shares)
        if watch is not None:
            watch.update(rec["step"], {i: st.tokens_per_expert for i, st in stats.items()})
    return out


def source_metrics(progress: dict[str, dict[str, float]], seq_len: int) -> dict[str, float]:
    """``data/tokens/<name>`` (tokens of that source trained on, all ranks together) and
    ``data/epochs/<name>`` (passes over that source) from a blend's per-source progress."""
    out: dict[str, float] = {}
    for name, p in progress.items():
        out[f"data/tokens/{name}"] = int(p["samples"]) * seq_len
        out[f"data/epochs/{name}"] = float(p["epochs"])
    return out


def format_eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def progress_line(step: int, total: int, rec: dict[str, Any], eta_s: float) -> str:
    """One console line: step, loss, lr, tokens/s, ETA."""
    return (
        f"step {step}/{total} | loss {rec['loss']:.4f} (ce {rec['ce_loss']:.4f}) | "
        f"lr {rec['lr']:.3g} | grad {rec['grad_norm']:.3g} | "
        f"{rec.get('tokens_per_s', 0.0):,.0f} tok/s | ETA {format_eta(eta_s)}"
    )
