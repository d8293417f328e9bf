"""Peak memory of building an expert-parallel rank's model: only its experts vs full-then-slice.

    .venv/bin/python benchmarks/ep_init_memory.py
    .venv/bin/python benchmarks/ep_init_memory.py --experts 64 --layers 8

Shape: vocab 8192, d 256, 8 layers, 32 experts of hidden 512 (403 MiB of fp32 expert weights).
For each EP size, two fresh processes build the model of EP rank 0 and apply expert
parallelism: ``local`` (``Transformer(..., local_experts=...)``, what the trainer does) and
``full+slice`` (build every expert, then keep this rank's, the trainer's way until 2026-11-30).
Printed: peak resident-set growth over the RSS before building (``ru_maxrss``), the parameter
bytes the rank keeps, and that both ways hold equal weights (checked in the ``full+slice``
process against a ``local`` build from the same seed).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _build(args: argparse.Namespace, ep: int, local: bool) -> dict:
    import torch

    from moetrain.config import load_config
    from moetrain.model.transformer import Transformer
    from moetrain.parallel.expert_parallel import apply_expert_parallel
    from moetrain.parallel.topology import Topology

    cfg = load_config(
        None,
        [
            "model.vocab_size=8192",
            "model.d_model=256",
            f"model.n_layers={args.layers}",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            f"moe.num_experts={args.experts}",
            "moe.expert_hidden=512",
            f"parallel.ep_size={ep}",
        ],
    )
    topo = Topology(
        rank=0, world_size=ep, local_rank=0, ep_size=ep, backend="gloo", device=torch.device("cpu")
    )
    before = _rss_mib()
    torch.manual_seed(0)
    experts = topo.local_experts(args.experts) if local and ep > 1 else None
    model = apply_expert_parallel(Transformer(cfg.model, cfg.moe, local_experts=experts), topo)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    kept = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    equal = None
    if not local and ep > 1:
        torch.manual_seed(0)
        ref = Transformer(cfg.model, cfg.moe, local_experts=topo.local_experts(args.experts))
        equal = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                      ref.state_dict().values(), strict=True))  # fmt: skip
    return {"peak_growth_mib": peak, "params_mib": kept, "equal": equal}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ep", type=int, nargs="*", default=[1, 2, 4, 8])
    ap.add_argument("--child", nargs=2, metavar=("EP", "WAY"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_build(args, int(args.child[0]), args.child[1] == "local")))
        return
    print("| EP | params kept / rank (MiB) | peak growth, local (MiB) | peak growth, full+slice "
          "(MiB) | local / full+slice | same weights |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---|")
    for ep in args.ep:
        res = {}
        for way in ("local", "full"):
            cmd = [sys.executable, __file__, "--experts", str(args.experts), "--layers",
                   str(args.layers), "--child", str(ep), way]  # fmt: skip
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            res[way] = json.loads(out.strip().splitlines()[-1])
        loc, full = res["local"], res["full"]
        same = "-" if full["equal"] is None else str(full["equal"])
        print(
            f"| {ep} | {loc['params_mib']:.0f} | {loc['peak_growth_mib']:.0f} | "
            f"{full['peak_growth_mib']:.0f} | {loc['peak_growth_mib'] / full['peak_growth_mib']:.2f}x"
            f" | {same} |"
        )


if __name__ == "__main__":
    main()
