"""Generation benchmark on one converted model: moetrain's KV-cache decoding vs transformers'
``generate`` (its own cache), both greedy, same prompt, same number of new tokens, same process;
also moetrain without a cache (full recompute every token) as a reference.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/generate.py HF_DIR [--new 64] [--repeats 3]

HF_DIR: e.g. runs/bench-convert/hf-fp32 written by benchmarks/convert.py. EOS is
disabled on both sides so every run produces exactly ``--new`` tokens.
"""

from __future__ import annotations

import argparse
import time

import torch

from moetrain.generate import load_for_generation, sample_next


@torch.inference_mode()
def moetrain_greedy(model, ids: list[int], new: int, cache: bool) -> list[int]:
    x = torch.tensor([ids])
    out: list[int] = []
    kv = model.new_cache(1, len(ids) + new) if cache else None
    for _ in range(new):
        logits = model(x if not cache or not out else x[:, -1:], cache=kv).logits[:, -1]
        nxt = sample_next(logits, 0.0, 1.0, 0, None)
        out.append(int(nxt))
        x = torch.cat([x, nxt[:, None]], 1)
    return out


def best_of(fn, repeats: int) -> tuple[float, list[int]]:
    times, res = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = fn()
        times.append(time.perf_counter() - t0)
    return min(times), res


def main() -> None:
    import transformers

    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model, tok = load_for_generation(args.hf_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32).eval()
    ids = tok.encode("def parse_args(argv):\n    parser = argparse.ArgumentParser(")
    n = args.new

    def run_hf() -> list[int]:
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                eos_token_id=None,
                pad_token_id=0,
            )
        return out[0, len(ids) :].tolist()

    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(
        f"model {params:.1f}M params, prompt {len(ids)} tokens, {n} new tokens, "
        f"threads {torch.get_num_threads()}"
    )
    t_kv, kv = best_of(lambda: moetrain_greedy(model, ids, n, True), args.repeats)
    t_hf, ref = best_of(run_hf, args.repeats)
    t_full, full = best_of(lambda: moetrain_greedy(model, ids, n, False), 1)
    print(f"moetrain KV cache : {n / t_kv:7.1f} tok/s ({t_kv:.2f}s)")
    print(f"transformers      : {n / t_hf:7.1f} tok/s ({t_hf:.2f}s)")
    print(f"moetrain no cache : {n / t_full:7.1f} tok/s ({t_full:.2f}s)")
    print(f"same tokens: moetrain KV == transformers {kv == ref}; KV == no cache {kv == full}")


if __name__ == "__main__":
    main()
