"""Does ``torch.compile`` of the dense parts (attention + RMSNorms) speed up training on CPU?

    .venv/bin/python benchmarks/compile_dense.py
    .venv/bin/python benchmarks/compile_dense.py --threads 2 --steps 7

One process, fp32, the shape of ``benchmarks/train_throughput.py`` (vocab 8192, d 256, 4 layers,
8 experts top-2, expert hidden 512, 4 x 256 tokens). Both models start from the same weights;
in the compiled one every block's ``attn_norm``, ``attn`` and ``ffn_norm`` are compiled in place
(``nn.Module.compile``; the MoE FFN, whose routing is data-dependent, stays eager). The two
alternate step by step. Reported: the first step's wall time (includes compilation; inductor
caches it on disk between runs), the median CPU time of forward + backward over ``--steps``
steps, the median of the paired ratios, and the largest relative gradient difference.
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


def stepper(compiled: bool):
    """``(step, model)``: one forward + backward of a fixed batch; the first call compiles."""
    model = build(compiled)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SHAPE["model.vocab_size"], (4, 256), generator=g)
    labels = torch.randint(0, SHAPE["model.vocab_size"], (4, 256), generator=g)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(ids, labels_BS=labels, return_logits=False).loss.backward()

    return step, model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    steps, first, times = {}, {}, {"eager": [], "compiled": []}
    for name in times:
        steps[name] = stepper(name == "compiled")
        t0 = time.perf_counter()
        steps[name][0]()
        first[name] = time.perf_counter() - t0
    for _ in range(args.steps):  # interleaved, so load changes hit both alike
        for name, (step, _) in steps.items():
            t = time.process_time()
            step()
            times[name].append(time.process_time() - t)
    grads = {n: {k: p.grad for k, p in m.named_parameters()} for n, (_, m) in steps.items()}
    diff = max(
        float((g - grads["compiled"][k]).abs().max() / g.abs().max().clamp_min(1e-12))
        for k, g in grads["eager"].items()
    )
    ratio = statistics.median(c / e for c, e in zip(times["compiled"], times["eager"], strict=True))
    print("| model | first step (s, wall) | fwd+bwd CPU ms (median) |")
    print("|---|---:|---:|")
    for name in times:
        print(f"| {name} | {first[name]:.1f} | {1e3 * statistics.median(times[name]):.0f} |")
    print(f"compiled / eager (median of paired steps): {ratio:.3f}; max rel grad diff {diff:.1e}")


if __name__ == "__main__":
    main()
