"""Settings an ``accelerate launch --use_deepspeed`` environment gives that differ from the
moetrain config. moetrain's values are used; these are reported, not applied."""

from __future__ import annotations

from moetrain.config import Config


def launcher_disagreements(cfg: Config, env: dict[str, str]) -> list[str]:
    """One message per accelerate setting that contradicts the config."""
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true":
        return []
    ours = {
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": (str(cfg.parallel.zero_stage), "parallel.zero_stage"),
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": (
            str(cfg.train.grad_accum_steps),
            "train.grad_accum_steps",
        ),
        "ACCELERATE_MIXED_PRECISION": (
            {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[cfg.train.precision],
            "train.precision",
        ),
    }
    out = []
    for var, (want, key) in ours.items():
        got = env.get(var)
        if got is not None and got != want and got != "auto":
            out.append(f"accelerate sets {var}={got}, but {key} gives {want}: using {key}")
    return out
