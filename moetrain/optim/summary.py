"""Which update each parameter of a config's model takes, counted on the model's shapes (built
on the meta device: no memory, no values): the table ``moetrain print-config`` shows, and the
counts ``moetrain plan`` weighs the state's bytes by (:mod:`moetrain.plan.optimizer`)."""

from __future__ import annotations

from collections import Counter

from moetrain.config import Config
from moetrain.model import param_names
from moetrain.optim.groups import trainable
from moetrain.optim.kinds import meta_model, param_kind
from moetrain.optim.registry import optimizer_spec


def update_counts(cfg: Config) -> Counter[tuple[str, str, bool]]:
    """``(update, kind, expert) -> parameters`` of ``cfg``'s model under ``optim.name``
    (kinds: :func:`moetrain.optim.kinds.param_kind`; expert: a routed expert's weight)."""
    spec = optimizer_spec(cfg.optim.name)
    model = meta_model(cfg)
    counts: Counter[tuple[str, str, bool]] = Counter()
    for name, p in trainable(model):
        update = spec.update_of(name, p.ndim, cfg.optim)
        expert = param_names.parse_experts(name) is not None
        counts[(update, param_kind(name, p.ndim), expert)] += p.numel()
    return counts


def update_table(cfg: Config) -> list[str]:
    """``print-config``'s lines: per update, the parameters (by kind) that take it."""
    counts = update_counts(cfg)
    lines = []
    for update in sorted({u for u, _, _ in counts}):
        kinds = Counter()
        for (u, kind, _), n in counts.items():
            if u == update:
                kinds[kind] += n
        parts = ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items()))
        lines.append(f"{update}: {sum(kinds.values())}  # {parts}")
    return lines
