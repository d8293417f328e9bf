"""Rank function for the init_from tests (importable by spawned processes): whole training runs
(``moetrain.train.loop.run_training``, the real engine and checkpoints), one after another in the
same 2-rank process group, each from its own command-line style overrides."""

from __future__ import annotations

from typing import Any


def train_runs(rank: int, world: int, runs: list[list[str]]) -> list[dict[str, Any]]:
    """``run_training`` of each run's config (resolved as ``moetrain train`` resolves it, the
    model shape from ``checkpoint.init_from``); -> each run's summary."""
    from moetrain.config import read_config_data
    from moetrain.init_from.source import resolve_config_data
    from moetrain.train.loop import run_training

    out = []
    for overrides in runs:
        cfg, _ = resolve_config_data(read_config_data(None, overrides))
        out.append(run_training(cfg))
    return out
