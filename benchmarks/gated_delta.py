"""The chunked gated delta rule (:mod:`moetrain.model.delta_rule`) against transformers' own torch
path (``torch_chunk_gated_delta_rule``, Qwen3-Next's training fallback): forward + backward
time and peak memory, side by side, alternating.

    .venv/bin/python benchmarks/gated_delta.py                          # S = 4096 and 16384
    .venv/bin/python benchmarks/gated_delta.py --seq-lens 4096 --rounds 5

Qwen3-Next's head shapes shrunk: batch 1, 2 query/key heads and 4 value heads of 128 (its
1 : 2 grouping), q and k L2-normalised inside the rule, Qwen3-Next's decay
``g = -exp(A_log) * softplus(a)`` and ``beta = sigmoid(b)``, chunks of 64 for both, fp32, one
thread, CPU. Each measurement runs in a fresh subprocess: with glibc serving allocations >= 64
KiB by mmap (so that RSS follows live tensors), one warm-up pass, then the peak RSS of one pass
over the RSS just before it (peak reset through /proc/self/clear_refs); then, under the
allocator `moetrain train` sets on CPU (``train.host_allocator`` ``keep``), one warm-up pass
and the median CPU time of ``--repeats`` passes. A round runs both paths, in alternating
order from round to round; the ratios are the median over rounds of each round's ratio, with
their range. ``--mild-decays`` draws decays of at most e^-0.3 a step instead: Qwen3-Next's
decays, as initialised, make many of a chunk's decay factors subnormal numbers, which slow a
CPU's multiplications; the rule flushes those below 5e-30 to zero, transformers' path does not.
"""

from __future__ import annotations

import argparse
import json

from side_by_side import alternating_rounds, map_large_blocks, measure_step, print_table, run_child

HK, H, D, CHUNK = 2, 4, 128, 64
PATHS = ("moetrain", "transformers")


def _child(path: str, s: int, repeats: int, mild: bool) -> dict:
    map_large_blocks()
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    if path == "moetrain":
        from moetrain.model.delta_rule import gated_delta_rule

        def rule(q, k, v, g, beta):
            return gated_delta_rule(q, k, v, g, beta, qk_l2norm=True, chunk_size=CHUNK)[0]
    else:
        from transformers.models.qwen3_next.modeling_qwen3_next import (
            torch_chunk_gated_delta_rule,
        )

        def rule(q, k, v, g, beta):
            out = torch_chunk_gated_delta_rule(
                q, k, v, g, beta, chunk_size=CHUNK, use_qk_l2norm_in_kernel=True
            )
            return out[0]

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, s, HK, D, generator=gen)
    k = torch.randn(1, s, HK, D, generator=gen)
    v = torch.randn(1, s, H, D, generator=gen)
    if mild:
        g = -0.3 * torch.rand(1, s, H, generator=gen)
    else:  # Qwen3-Next's initialisation: A_log = log(U(0, 16)), dt_bias 1
        a_log = torch.empty(H).uniform_(0.0, 16.0, generator=gen).log()
        g = -a_log.exp() * F.softplus(torch.randn(1, s, H, generator=gen) + 1.0)
    beta = torch.randn(1, s, H, generator=gen).sigmoid()
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta)]
    grad = torch.randn(1, s, H, D, generator=gen)

    def step() -> None:
        rule(*leaves).backward(grad)
        for t in leaves:
            t.grad = None

    return measure_step(step, repeats)


def _run(path: str, s: int, repeats: int, mild: bool) -> dict:
    args = ["--child", path, "--seq-lens", str(s), "--repeats", str(repeats)]
    return run_child(__file__, args + (["--mild-decays"] if mild else []), f"{path} at S={s}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mild-decays", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        res = _child(args.child, args.seq_lens[0], args.repeats, args.mild_decays)
        print("RESULT " + json.dumps(res))
        return
    rows = alternating_rounds(
        PATHS, args.seq_lens, args.rounds, lambda n, s: _run(n, s, args.repeats, args.mild_decays)
    )
    decays = "decays of at most e^-0.3 a step" if args.mild_decays else "Qwen3-Next's decays"
    print(
        f"\nfwd+bwd, batch 1, {HK} q/k heads and {H} v heads of {D}, chunks of {CHUNK}, {decays}, "
        f"fp32, 1 thread; {args.rounds} alternating rounds, median of {args.repeats} passes each\n"
    )
    print_table(rows, PATHS)


if __name__ == "__main__":
    main()
