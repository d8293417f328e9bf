"""`moetrain plan` at ZeRO-2 and ZeRO-3 for the large shapes in configs/: memory per GPU, whether
it fits, the ZeRO-3 traffic per GPU and optimizer step, and the smallest GPU count (multiples
of 8, EP = min(GPUs, experts)) at which each stage fits, on H100-80GB and H200.

    .venv/bin/python benchmarks/zero3_plan.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = [  # (config, GPUs of the worked example)
    ("deepseek-v3-671b.yaml", 256),
    ("qwen3-235b-a22b.yaml", 64),
    ("mixtral-8x22b.yaml", 32),
]
GIB = 2**30


def _plan(name: str, gpus: int, stage: int, gpu: str):  # noqa: ANN202
    from moetrain.config import config_from_dict, read_config_data
    from moetrain.plan import plan

    data = read_config_data(ROOT / "configs" / name, [])
    experts = data["moe"]["num_experts"]
    overrides = [f"parallel.zero_stage={stage}", f"parallel.ep_size={min(gpus, experts)}"]
    cfg = config_from_dict(read_config_data(ROOT / "configs" / name, overrides))
    return plan(cfg, gpus=gpus, gpu=gpu)


def smallest(name: str, stage: int, gpu: str) -> int | None:
    """The fewest GPUs (a multiple of 8, up to 1024) at which ``stage`` fits."""
    for gpus in range(8, 1025, 8):
        try:
            if _plan(name, gpus, stage, gpu).fits:
                return gpus
        except Exception:  # noqa: BLE001 (a layout the config refuses at this count)
            continue
    return None


def main() -> None:
    print(
        "| shape | GPUs | stage 2 per GPU | stage 3 per GPU | stage 3: weights + gathered | "
        "stage 3 all-gather / reduce-scatter per GPU and step |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, gpus in CASES:
        two, three = (_plan(name, gpus, s, "h100") for s in (2, 3))
        fit = {True: "fits", False: "does not fit"}
        print(
            f"| {name} | {gpus} H100 | {two.total_bytes / GIB:.1f} GiB ({fit[two.fits]}) "
            f"| {three.total_bytes / GIB:.1f} GiB ({fit[three.fits]}) "
            f"| {three.weights_bytes / GIB:.1f} + {three.gathered_bytes / GIB:.1f} GiB "
            f"| {three.zero3_gather_bytes_per_step / GIB:,.0f} / "
            f"{three.zero3_reduce_bytes_per_step / GIB:,.0f} GiB |"
        )
    print()
    print("| shape | H100 stage 2 | H100 stage 3 | H200 stage 2 | H200 stage 3 |")
    print("|---|---:|---:|---:|---:|")
    for name, _ in CASES:
        cells = [smallest(name, s, gpu) for gpu in ("h100", "h200") for s in (2, 3)]
        print(f"| {name} | " + " | ".join(str(c) if c else "> 1024" for c in cells) + " |")


if __name__ == "__main__":
    main()
