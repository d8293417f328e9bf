"""MoE layer forward+backward: moetrain's MoE block vs a dense SwiGLU with the same active FLOPs,
Hugging Face's MixtralSparseMoeBlock and DeepSpeed's deepspeed.moe.layer.MoE, same experts.

    .venv/bin/python benchmarks/moe_layer.py                 # T in {4096, 16384}, d256 F512 E8 k2
    .venv/bin/python benchmarks/moe_layer.py --tokens 4096 --repeats 3
    .venv/bin/python benchmarks/moe_layer.py --tokens 4096 --cases dense moetrain-bf16 moetrain-bf16-combine

One thread, fp32 (the ``-bf16`` cases: the block in bf16, combining in fp32 as moetrain does,
and with the routing weights and the K-copy sums rounded to bf16 instead), CPU. Time: for each T one subprocess builds every case, warms each up once,
then runs ``--repeats`` rounds of one fwd+bwd pass per case, interleaved so that load from other
processes hits all cases alike; the timing process runs with the default allocator, as training
does. Reported: the median and the minimum CPU time of the process per pass (robust on a
shared machine, since time spent descheduled is not counted), the median over rounds of the
ratio to the dense pass of the same round, and the median wall time. Backward uses a fixed
random output gradient; parameter gradients are freed between passes. Memory: each (case, T) in
a fresh subprocess: the peak RSS during one fwd+bwd pass minus the RSS just before it. The peak
is reset through /proc/self/clear_refs (Linux) and glibc is told to serve every allocation
>= 64 KiB with mmap (MALLOC_MMAP_THRESHOLD_, memory processes only), so freed tensors leave RSS
at once and RSS tracks live tensors. The figure counts activations, temporaries and
parameter gradients of that pass.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

D, F_HIDDEN, E, K = 256, 512, 8, 2
CASES = [
    "moetrain",
    "moetrain-loop",
    "dense",
    "dense-packed",
    "hf-mixtral",
    "hf-mixtral-grouped",
    "deepspeed",
]
BF16_CASES = ["moetrain-bf16", "moetrain-bf16-combine"]
DESCRIPTION = {
    "moetrain": "moetrain MoELayer (sort dispatch + F.grouped_mm)",
    "moetrain-loop": "moetrain MoELayer, per-expert loop (moe.grouped_mm=false)",
    "dense": f"dense SwiGLU (plain PyTorch), hidden k*F = {K * F_HIDDEN}",
    "dense-packed": "dense SwiGLU, packed [w1|w3] + moetrain's silu_mul (the experts' tricks)",
    "hf-mixtral": "HF MixtralSparseMoeBlock (default eager experts)",
    "hf-mixtral-grouped": "HF MixtralSparseMoeBlock, experts_implementation=grouped_mm",
    "deepspeed": "deepspeed.moe.layer.MoE (k=2, drop_tokens=False)",
    "moetrain-bf16": "moetrain MoELayer in bf16 (combine in fp32)",
    "moetrain-bf16-combine": "moetrain MoELayer in bf16, combine in bf16 (weights, K-copy sums)",
}


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _expert_weights(seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "gate": torch.randn(E, D, generator=g) * 0.02,
        "w1": torch.randn(E, D, F_HIDDEN, generator=g) * 0.02,
        "w3": torch.randn(E, D, F_HIDDEN, generator=g) * 0.02,
        "w2": torch.randn(E, F_HIDDEN, D, generator=g) * 0.02,
    }


def plain_swiglu(d: int, hidden: int):
    """The usual PyTorch SwiGLU MLP (Llama/Mixtral style): ``w2(silu(w1 x) * w3 x)``."""
    import torch.nn.functional as F
    from torch import nn

    class PlainSwiGLU(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Linear(d, hidden, bias=False)
            self.w3 = nn.Linear(d, hidden, bias=False)
            self.w2 = nn.Linear(hidden, d, bias=False)

        def forward(self, x):  # noqa: ANN001, ANN202
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    return PlainSwiGLU()


@contextlib.contextmanager
def bf16_combine(layer):  # noqa: ANN001, ANN201
    """While open: ``layer`` combines in bf16, as before moetrain combined in fp32 (routing
    weights rounded to the activations' dtype before the weighted product, the sums over a
    token's copies accumulated in it)."""
    from moetrain.model.moe import dispatch

    keep_acc, keep_forward = dispatch._accumulation_dtype, layer.experts.forward

    def forward(x, counts, w=None, *rest):  # noqa: ANN001, ANN002, ANN202
        return keep_forward(x, counts, None if w is None else w.to(x.dtype), *rest)

    dispatch._accumulation_dtype, layer.experts.forward = (lambda t: t.dtype), forward
    try:
        yield
    finally:
        dispatch._accumulation_dtype, layer.experts.forward = keep_acc, keep_forward


def build(case: str):
    """Return ``fn(x_TD) -> y_TD``, its module and a context each pass runs in; all MoE variants
    with identical weights."""
    import torch

    if case in BF16_CASES:
        fn, layer, _ = build("moetrain")
        layer.to(torch.bfloat16)
        context = (lambda: bf16_combine(layer)) if case.endswith("combine") else _no_context
        return (lambda x: layer(x.to(torch.bfloat16)[None])[0][0].float()), layer, context
    fn, module = _build(case)
    return fn, module, _no_context


def _no_context():  # noqa: ANN202
    return contextlib.nullcontext()


def _build(case: str):
    import torch

    w = _expert_weights()
    if case in ("moetrain", "moetrain-loop"):
        from moetrain.config import MoEConfig
        from moetrain.model.moe.layer import MoELayer

        layer = MoELayer(
            MoEConfig(
                num_experts=E, top_k=K, expert_hidden=F_HIDDEN, grouped_mm=case == "moetrain"
            ),
            D,
        )
        with torch.no_grad():
            layer.router.gate.weight.copy_(w["gate"])
            layer.experts.w13.copy_(torch.cat([w["w1"], w["w3"]], 2))
            layer.experts.w2.copy_(w["w2"])
        return (lambda x: layer(x[None])[0][0]), layer
    if case.startswith("dense"):
        mlp = plain_swiglu(D, K * F_HIDDEN)
        with torch.no_grad():
            mlp.w1.weight.copy_(w["w1"][:K].transpose(1, 2).reshape(K * F_HIDDEN, D))
            mlp.w3.weight.copy_(w["w3"][:K].transpose(1, 2).reshape(K * F_HIDDEN, D))
            mlp.w2.weight.copy_(w["w2"][:K].reshape(K * F_HIDDEN, D).t())
        if case == "dense":
            return mlp, mlp
        from moetrain.model.layers import silu_mul_packed

        w13 = torch.nn.Parameter(torch.cat([mlp.w1.weight, mlp.w3.weight]).detach())
        packed = torch.nn.ParameterList([w13, mlp.w2.weight])
        return (lambda x: mlp.w2(silu_mul_packed(x @ w13.t()))), packed
    if case.startswith("hf-mixtral"):
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        kw = {"experts_implementation": "grouped_mm"} if case.endswith("grouped") else {}
        cfg = MixtralConfig(
            hidden_size=D,
            intermediate_size=F_HIDDEN,
            num_local_experts=E,
            num_experts_per_tok=K,
            **kw,
        )
        block = MixtralSparseMoeBlock(cfg)
        with torch.no_grad():
            block.gate.weight.copy_(w["gate"])
            block.experts.gate_up_proj.copy_(torch.cat([w["w1"], w["w3"]], 2).transpose(1, 2))
            block.experts.down_proj.copy_(w["w2"].transpose(1, 2))
        return (lambda x: block(x[None])[0]), block
    if case == "deepspeed":
        import deepspeed
        from deepspeed.moe.layer import MoE

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        deepspeed.init_distributed(dist_backend="gloo")
        moe = MoE(
            D,
            plain_swiglu(D, F_HIDDEN),
            num_experts=E,
            k=K,
            drop_tokens=False,
            use_rts=False,
            top2_2nd_expert_sampling=False,
        )
        moe.set_deepspeed_parallelism()
        with torch.no_grad():
            moe.deepspeed_moe.gate.wg.weight.copy_(w["gate"])
            for i, ex in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
                ex.w1.weight.copy_(w["w1"][i].t())
                ex.w3.weight.copy_(w["w3"][i].t())
                ex.w2.weight.copy_(w["w2"][i].t())
        return (lambda x: moe(x)[0]), moe
    raise ValueError(f"unknown case {case!r}; choose from {CASES}")


def _prepare(case: str, tokens: int):
    import torch

    torch.manual_seed(0)
    fn, module, context = build(case)
    params = list(module.parameters())
    x = torch.randn(tokens, D, requires_grad=True)
    gy = torch.randn(tokens, D)

    def step() -> None:
        for p in params:
            p.grad = None
        x.grad = None
        with context():
            fn(x).backward(gy)

    def clear() -> None:
        for p in params:
            p.grad = None
        x.grad = None

    return step, clear


def measure_memory(case: str, tokens: int) -> float:
    """Extra peak RSS (MiB) of one fwd+bwd pass, in a process that holds only this case."""
    import gc

    step, clear = _prepare(case, tokens)
    step()  # warm-up
    clear()
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS watermark
    base = _rss_kib("VmRSS")
    step()
    return (_rss_kib("VmHWM") - base) / 1024


def measure_time(cases: list[str], tokens: int, repeats: int) -> dict[str, dict[str, list[float]]]:
    """fwd+bwd seconds per case, CPU time of this process and wall time; the cases are
    interleaved round by round so that load from other processes hits every case alike (and
    each round gives a paired ratio to the dense reference)."""
    steps = {c: _prepare(c, tokens)[0] for c in cases}
    for step in steps.values():
        step()  # warm-up
    times: dict[str, dict[str, list[float]]] = {c: {"cpu": [], "wall": []} for c in cases}
    for _ in range(repeats):
        for c, step in steps.items():
            c0, w0 = time.process_time(), time.perf_counter()
            step()
            times[c]["cpu"].append(time.process_time() - c0)
            times[c]["wall"].append(time.perf_counter() - w0)
    return times


def _child(argv: list[str], env: dict[str, str]) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, *argv], env=env, capture_output=True, text=True
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        raise RuntimeError(f"{argv} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[0][len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--cases", nargs="+", default=CASES, choices=CASES + BF16_CASES)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--child-time", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child-mem", nargs=2, metavar=("CASE", "T"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_time or args.child_mem:
        import torch

        torch.set_num_threads(1)
        if args.child_time:
            out = measure_time(args.cases, args.child_time, args.repeats)
        else:
            out = {"mib": measure_memory(args.child_mem[0], int(args.child_mem[1]))}
        print("RESULT " + json.dumps(out))
        return

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    env_mem = {**env, "MALLOC_MMAP_THRESHOLD_": "65536"}  # RSS follows live tensors
    rows = []
    for t in args.tokens:
        times = _child(
            ["--child-time", str(t), "--repeats", str(args.repeats), "--cases", *args.cases], env
        )
        ref = times.get("dense", {}).get("cpu")
        for case in args.cases:
            mib = _child(["--child-mem", case, str(t)], env_mem)["mib"]
            cpu_s = times[case]["cpu"]
            cpu, best = 1000 * statistics.median(cpu_s), 1000 * min(cpu_s)
            wall = 1000 * statistics.median(times[case]["wall"])
            ratio = (
                statistics.median(a / b for a, b in zip(cpu_s, ref, strict=True)) if ref else None
            )
            rows.append((case, t, cpu, best, ratio, wall, mib))
            print(f"  {case:20s} T={t:6d} {cpu:9.1f} cpu-ms {mib:7.1f} MiB", file=sys.stderr)

    print(
        f"\nd={D}, expert hidden={F_HIDDEN}, E={E}, k={K}, 1 thread, fwd+bwd, "
        f"{args.repeats} interleaved rounds\n"
    )
    print(
        "| case | T | CPU ms (median) | CPU ms (min) | CPU / dense (median of rounds) "
        "| wall ms (median) | extra peak RSS MiB | MiB per 1k tokens |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for case, t, cpu, best, ratio, wall, mib in rows:
        r = f"{ratio:.3f}" if ratio is not None else "-"
        print(
            f"| {DESCRIPTION[case]} | {t} | {cpu:.1f} | {best:.1f} | {r} | {wall:.1f} | "
            f"{mib:.1f} | {1024 * mib / t:.2f} |"
        )


if __name__ == "__main__":
    main()
