"""The optimizer's part of ``moetrain plan``: its state's bytes per parameter (``optim.name``'s
rules, counted on the model's shapes by :func:`moetrain.optim.summary.update_counts`) and the
FLOPs of its step beyond the elementwise (Muon's Newton-Schulz), with their time at the plan's
MFU of the fp32 peak."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from moetrain.config import Config
from moetrain.optim.registry import optimizer_spec
from moetrain.optim.summary import update_counts


@dataclass(frozen=True)
class StateBytes:
    """Bytes of optimizer state per parameter (fp32 master copies not included), averaged over
    the dense parameters and over the routed experts' (their ZeRO partitions differ)."""

    dense: float
    expert: float


def state_bytes_per_param(cfg: Config) -> StateBytes:
    """The optimizer state's bytes per parameter of ``cfg`` (``optim.name``'s optimizer)."""
    spec = optimizer_spec(cfg.optim.name)
    if len(set(spec.update_bytes.values())) == 1:  # one size for every update: nothing to count
        (size,) = set(spec.update_bytes.values())
        return StateBytes(float(size), float(size))
    state: Counter[bool] = Counter()
    params: Counter[bool] = Counter()
    for (update, _, expert), n in update_counts(cfg).items():
        state[expert] += spec.update_bytes[update] * n
        params[expert] += n
    dense, expert = (state[e] / params[e] if params[e] else 0.0 for e in (False, True))
    return StateBytes(dense, expert)


def optimizer_step_flops(cfg: Config, gpus: int) -> int:
    """FLOPs of one optimizer step per GPU beyond the elementwise (``optim.name``'s; Muon's
    Newton-Schulz), on ``gpus`` GPUs."""
    return optimizer_spec(cfg.optim.name).step_flops(cfg, gpus)


def optimizer_lines(
    name: str,
    state: StateBytes,
    masters: int,
    flops: int,
    fp32_tflops: float,
    mfu: float,
    step_s: float,
) -> list[str]:
    """The report's lines on the optimizer: its state's bytes per parameter (dense, experts;
    fp32 masters apart) and, when its step has FLOPs beyond the elementwise, their time at
    ``mfu`` of the fp32 peak and its share on top of a ``step_s`` step."""
    masters_note = f" + {masters} B fp32 master copy" if masters else ""
    lines = [
        f"optimizer ({name}): state {state.dense:.2f} B per dense parameter, "
        f"{state.expert:.2f} B per expert parameter{masters_note}"
    ]
    if flops:
        seconds = flops / (fp32_tflops * 1e12 * mfu)
        lines.append(
            f"optimizer step: {flops / 1e9:.4g} GFLOP per GPU (Newton-Schulz, fp32): "
            f"{seconds * 1e3:.1f} ms at MFU {mfu:.0%} of the fp32 peak, {seconds / step_s:.1%} "
            "on top of the step"
        )
    return lines
