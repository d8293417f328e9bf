"""Which update each parameter of a config's model takes, counted on the model's shapes (built
on the meta device: no memory, no values): the optimizer state's bytes per parameter and the
step's FLOPs for ``moetrain plan``, and the table ``moetrain print-config`` shows."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from moetrain.config import Config
from moetrain.model import param_names
from moetrain.optim.groups import trainable
from moetrain.optim.kinds import meta_model, param_kind
from moetrain.optim.registry import optimizer_spec


@dataclass(frozen=True)
class StateBytes:
    """Bytes of optimizer state per parameter (fp32 master copies not included), averaged over
    the dense parameters and over the routed experts' (their ZeRO partitions differ)."""

    dense: float
    expert: float


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


def state_bytes_per_param(cfg: Config) -> StateBytes:
    """The optimizer state's bytes per parameter of ``cfg`` (``optim.name``'s optimizer)."""
    spec = optimizer_spec(cfg.optim.name)
    if len(set(spec.update_bytes.values())) == 1:  # one size for every update: nothing to count
        (size,) = set(spec.update_bytes.values())
        return StateBytes(float(size), float(size))
    state, params = Counter(), Counter()
    for (update, _, expert), n in update_counts(cfg).items():
        state[expert] += spec.update_bytes[update] * n
        params[expert] += n
    dense, expert = (state[e] / params[e] if params[e] else 0.0 for e in (False, True))
    return StateBytes(dense, expert)


def optimizer_step_flops(cfg: Config, gpus: int) -> int:
    """FLOPs of one optimizer step per GPU beyond the elementwise (``optim.name``'s; Muon's
    Newton-Schulz), on ``gpus`` GPUs."""
    return optimizer_spec(cfg.optim.name).step_flops(cfg, gpus)


def optimizer_flops_line(flops: int, fp32_tflops: float, mfu: float, step_s: float) -> list[str]:
    """``moetrain plan``'s line on the optimizer step's FLOPs per GPU (none when 0): their time
    at ``mfu`` of the fp32 peak, and its share on top of a ``step_s`` step."""
    if not flops:
        return []
    seconds = flops / (fp32_tflops * 1e12 * mfu)
    return [
        f"optimizer step: {flops / 1e9:.4g} GFLOP per GPU (Newton-Schulz, fp32): "
        f"{seconds * 1e3:.1f} ms at MFU {mfu:.0%} of the fp32 peak, {seconds / step_s:.1%} on "
        "top of the step"
    ]


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
