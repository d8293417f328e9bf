"""Does ``torch.compile`` of the dense parts (attention + RMSNorms) speed up training on CPU?

    .venv/bin/python benchmarks/compile_dense.py
    .venv/bin/python benchmarks/compile_dense.py --threads 2 --steps 7

One process, fp32, the shape of ``benchmarks/train_throughput.py`` (vocab 8192, d 256, 4 layers,
8 experts top-2, expert hidden 512, 4 x 256 tokens). Both models start from the same weights;
in the compiled one every block's ``attn_norm``, ``attn`` and ``ffn_norm`` are compiled in place
(``nn.Module.compile``; the MoE FFN, whose routing is data-dependent, stays eager). Reported:
the first step's wall time (includes compilation), the median CPU time of forward + backward
over ``--steps`` steps, and the largest relative gradient difference between the two.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moetrain.config import apply_overrides, config_from_dict
from moetrain.model import Transformer

SHAPE = {
    "model.vocab_size": 8192,
    "model.d_model": 256,
    "model.n_layers": 4,
    "model.n_heads": 4,
    "model.n_kv_heads": 2,
    "model.max_seq_len": 256,
    "moe.num_experts": 8,
    "moe.top_k": 2,
    "moe.expert_hidden": 512,
    "data.seq_len": 256,
}


def build(compiled: bool) -> Transformer:
    cfg = config_from_dict(apply_overrides({}, [f"{k}={v}" for k, v in SHAPE.items()]))
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe)
    if compiled:
        for block in model.layers:
            for part in (block.attn_norm, block.attn, block.ffn_norm):
                part.compile()
    return model


def run(compiled: bool, steps: int) -> dict:
    model = build(compiled)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SHAPE["model.vocab_size"], (4, 256), generator=g)
    labels = torch.randint(0, SHAPE["model.vocab_size"], (4, 256), generator=g)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(ids, labels_BS=labels, return_logits=False).loss.backward()

    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t = time.process_time()
        step()
        times.append(time.process_time() - t)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"first_s": first, "step_ms": 1e3 * statistics.median(times), "grads": grads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    eager, comp = run(False, args.steps), run(True, args.steps)
    diff = max(
        float((eager["grads"][n] - g).abs().max() / eager["grads"][n].abs().max().clamp_min(1e-12))
        for n, g in comp["grads"].items()
    )
    print("| model | first step (s, wall) | fwd+bwd CPU ms (median) |")
    print("|---|---:|---:|")
    for name, r in (("eager", eager), ("dense parts compiled", comp)):
        print(f"| {name} | {r['first_s']:.1f} | {r['step_ms']:.0f} |")
    print(
        f"compiled / eager: {comp['step_ms'] / eager['step_ms']:.3f}; max rel grad diff {diff:.1e}"
    )


if __name__ == "__main__":
    main()
