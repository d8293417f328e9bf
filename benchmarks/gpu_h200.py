"""One prepared GPU run (H200, ~8 minutes): correctness vs CPU fp32, grouped GEMM vs per-expert
loop, bf16 MoE training throughput and MFU, planner memory vs measured, NCCL sanity.

    python3 benchmarks/gpu_h200.py                      # on the GPU machine (see README-gpu.md)
    .venv/bin/python benchmarks/gpu_h200.py --dry-run   # tiny shapes on CPU, same code paths

Sections (each recorded in the JSON even when it fails, with the error):
1. ``correctness``: a tiny model built in fp32 on CPU; the same weights on the device in bf16
   (and fp32, tf32 off); logits relative error ||dev - cpu|| / ||cpu|| and loss difference
   against stated tolerances.
2. ``grouped_gemm``: moetrain's GroupedExperts fwd+bwd with ``grouped_mm=True`` vs the
   per-expert loop, same weights and routed tokens, CUDA-event median.
3. ``matmul``: the measured bf16 matmul ceiling (8192^3, random data).
4. ``train``: a ~0.9B-total-parameter MoE (``TRAIN_SHAPE``) trained in bf16 through moetrain's
   DeepSpeed engine (``moetrain.parallel.deepspeed.initialize_engine``, ZeRO-1, EP=1) when
   deepspeed imports, else a bf16 model with torch AdamW on fp32 master weights (the JSON says
   which). Tokens/s, MFU = model FLOP/s (moetrain.numbers) / table peak (moetrain.monitor.mfu)
   and vs the measured matmul ceiling, peak memory vs ``moetrain.plan``.
5. ``nccl``: all_reduce on one rank (value check and a 256 MiB timing).

Results go to ``$OUT/gpu_h200.json`` (``--out`` overrides; default ./gpu_h200_out) and a
summary is printed last.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moetrain.config import Config, apply_overrides, config_from_dict  # noqa: E402
from moetrain.model import GroupedExperts, Transformer  # noqa: E402
from moetrain.model.moe.experts import grouped_mm_supported  # noqa: E402
from moetrain.numbers import model_numbers  # noqa: E402

TINY = {
    "model.vocab_size": 512,
    "model.d_model": 128,
    "model.n_layers": 2,
    "model.n_heads": 4,
    "model.n_kv_heads": 2,
    "moe.num_experts": 4,
    "moe.top_k": 2,
    "moe.expert_hidden": 256,
    "data.seq_len": 64,
    "train.micro_batch_size": 2,
}
# ~0.92B total, ~0.39B active parameters; head_dim 128.
TRAIN_SHAPE = {
    "model.vocab_size": 32768,
    "model.d_model": 2048,
    "model.n_layers": 8,
    "model.n_heads": 16,
    "model.n_kv_heads": 4,
    "model.max_seq_len": 2048,
    "moe.num_experts": 8,
    "moe.top_k": 2,
    "moe.expert_hidden": 1792,
    "data.seq_len": 2048,
    "train.micro_batch_size": 8,
    "train.precision": "bf16",
    "parallel.zero_stage": 1,
    "parallel.ep_size": 1,
    "optim.warmup_steps": 2,
}
DRY_TRAIN_SHAPE = {**TINY, "train.precision": "fp32", "parallel.zero_stage": 1}
LOGITS_RTOL_BF16 = 3e-2  # bf16 operands through 2 layers; near-tie routing may flip a few tokens
LOSS_ATOL_BF16 = 2e-2
LOGITS_RTOL_FP32 = 1e-4


def make_config(overrides: dict[str, Any]) -> Config:
    return config_from_dict(apply_overrides({}, [f"{k}={v}" for k, v in overrides.items()]))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def timed(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 2) -> list[float]:
    """Seconds per call: CUDA events on GPU, perf_counter on CPU."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


# --------------------------------------------------------------------------- sections


def correctness(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    cfg = make_config(TINY)
    torch.manual_seed(0)
    ref_model = Transformer(cfg.model, cfg.moe).eval()
    ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len))
    labels = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len))
    with torch.no_grad():
        ref = ref_model(ids, labels_BS=labels)
    res: dict[str, Any] = {"cpu_fp32_loss": float(ref.loss)}
    checks = [("fp32", torch.float32, LOGITS_RTOL_FP32, 1e-4)]
    if dtype == torch.bfloat16:
        checks.append(("bfloat16", torch.bfloat16, LOGITS_RTOL_BF16, LOSS_ATOL_BF16))
    for key, dt, rtol, ltol in checks:
        model = copy.deepcopy(ref_model).to(device=device, dtype=dt)
        for layer in model.moe_layers():  # router bias stays fp32, as the engine keeps it
            layer.router.expert_bias.data = layer.router.expert_bias.float()
        with torch.no_grad():
            out = model(ids.to(device), labels_BS=labels.to(device))
        err, dloss = rel_err(out.logits, ref.logits), abs(float(out.loss) - float(ref.loss))
        res[key] = {
            "logits_rel_err": err,
            "loss": float(out.loss),
            "loss_abs_diff": dloss,
            "logits_rtol": rtol,
            "loss_atol": ltol,
            "ok": err <= rtol and dloss <= ltol and bool(torch.isfinite(out.logits).all()),
        }
    res["ok"] = all(v["ok"] for v in res.values() if isinstance(v, dict))
    return res


def grouped_gemm(device: torch.device, dtype: torch.dtype, dry: bool) -> dict[str, Any]:
    e, d, f, tokens, k = (4, 64, 128, 512, 2) if dry else (8, 2048, 1792, 16384, 2)
    torch.manual_seed(1)
    fast = GroupedExperts(e, d, f, grouped_mm=True).to(device)
    for w in (fast.w13, fast.w2):
        torch.nn.init.normal_(w, std=0.02)
    fast = fast.to(dtype)
    loop = copy.deepcopy(fast)
    loop.use_grouped_mm = False
    ids = torch.randint(0, e, (tokens * k,), device=device)
    counts = torch.bincount(ids, minlength=e)
    x = torch.randn(tokens * k, d, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    outs = {}

    def step(mod: GroupedExperts) -> torch.Tensor:
        xi = x.detach().requires_grad_(True)
        y = mod(xi, counts)
        y.backward(grad)
        mod.zero_grad(set_to_none=True)
        return y

    res: dict[str, Any] = {
        "shape": {"E": e, "D": d, "F": f, "copies": tokens * k},
        "grouped_mm_used": grouped_mm_supported(x, fast.w13),
    }
    flops = 18.0 * tokens * k * d * f  # 3 matmuls, forward 2 + backward 4 FLOPs per MAC
    for name, mod in (("grouped", fast), ("loop", loop)):
        outs[name] = step(mod).detach()
        times = timed(lambda m=mod: step(m), device, reps=3 if dry else 20)
        med = statistics.median(times)
        res[name] = {"median_s": med, "tflops": flops / med / 1e12}
    res["speedup"] = res["loop"]["median_s"] / res["grouped"]["median_s"]
    res["rel_err_grouped_vs_loop"] = rel_err(outs["grouped"], outs["loop"])
    res["ok"] = res["rel_err_grouped_vs_loop"] < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    return res


def matmul_ceiling(device: torch.device, dtype: torch.dtype, dry: bool) -> dict[str, Any]:
    n = 512 if dry else 8192
    a, b = (
        torch.randn(n, n, device=device, dtype=dtype),
        torch.randn(n, n, device=device, dtype=dtype),
    )
    times = timed(lambda: a @ b, device, reps=3 if dry else 10, warmup=1 if dry else 3)
    med = statistics.median(times)
    tflops = 2.0 * n**3 / med / 1e12
    return {"n": n, "dtype": str(dtype), "median_s": med, "tflops": tflops, "ok": tflops > 0}


def _engine_available(choice: str) -> tuple[bool, str]:
    if choice == "torch":
        return False, "torch AdamW on fp32 master weights (chosen with --engine torch)"
    try:
        import deepspeed  # noqa: F401

        from moetrain.parallel.deepspeed import initialize_engine  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        if choice == "deepspeed":
            raise
        return False, f"torch AdamW on fp32 master weights (deepspeed unavailable: {exc!r})"
    return True, "DeepSpeed engine via moetrain.parallel.deepspeed.initialize_engine"


class MasterAdamW:
    """Fallback: bf16 model, AdamW on fp32 master copies (what DeepSpeed's bf16 path does)."""

    def __init__(self, model: torch.nn.Module, cfg: Config) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        o = cfg.optim
        self.opt = torch.optim.AdamW(
            self.master, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay
        )

    def step(self) -> None:
        for p, m in zip(self.params, self.master, strict=True):
            m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
            p.grad = None
        torch.nn.utils.clip_grad_norm_(self.master, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(self.params, self.master, strict=True):
                p.copy_(m)


def train(device: torch.device, dry: bool, engine_choice: str, steps: int) -> dict[str, Any]:
    from moetrain.monitor.mfu import lookup_peak_tflops
    from moetrain.plan import plan

    cfg = make_config(DRY_TRAIN_SHAPE if dry else TRAIN_SHAPE)
    nums = model_numbers(cfg)
    use_ds, engine_desc = _engine_available(engine_choice)
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with torch.device(device):
        model = Transformer(cfg.model, cfg.moe)
    if use_ds:
        from moetrain.parallel.apply import apply_parallelism
        from moetrain.parallel.deepspeed import deepspeed_config, initialize_engine
        from moetrain.parallel.topology import init_distributed
        from moetrain.train.optim import LRSchedule, build_optimizer

        topo = init_distributed(cfg)
        apply_parallelism(model, cfg.parallel, topo)
        tokens_per_step = cfg.train.micro_batch_size * cfg.data.seq_len
        engine, *_ = initialize_engine(
            model,
            build_optimizer(model, cfg.optim, topo.device),
            lambda opt: LRSchedule(opt, cfg.optim, steps + 2, tokens_per_step),
            deepspeed_config(cfg, topo.world_size),
        )

        def fwd_bwd_step(ids: torch.Tensor, labels: torch.Tensor) -> float:
            out = engine(ids, None, labels)
            engine.backward(out.loss)
            engine.step()
            return out.loss.detach()

    else:
        model = model.to(dtype)
        for layer in model.moe_layers():
            layer.router.expert_bias.data = layer.router.expert_bias.float()
        opt = MasterAdamW(model, cfg)

        def fwd_bwd_step(ids: torch.Tensor, labels: torch.Tensor) -> float:
            out = model(ids, labels_BS=labels)
            out.loss.backward()
            opt.step()
            return out.loss.detach()

    b, s, v = cfg.train.micro_batch_size, cfg.data.seq_len, cfg.model.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(0)
    batches = [
        (torch.randint(0, v, (b, s), generator=gen), torch.randint(0, v, (b, s), generator=gen))
        for _ in range(4)
    ]
    batches = [(i.to(device), lab.to(device)) for i, lab in batches]
    losses: list[float] = []
    it = iter(range(10**9))

    def one() -> None:
        ids, labels = batches[next(it) % len(batches)]
        losses.append(fwd_bwd_step(ids, labels))

    times = timed(one, device, reps=steps, warmup=2)
    med = statistics.median(times)
    tokens_per_s = b * s / med
    peak_table = lookup_peak_tflops("H200", "bf16") or 989.4
    achieved = tokens_per_s * nums.flops_per_token / 1e12
    pl = plan(cfg, gpus=1, gpu="h200")
    predicted = pl.model_state_bytes + pl.activations_bytes + pl.param_grad_transient_bytes
    res: dict[str, Any] = {
        "engine": engine_desc,
        "shape": cfg.to_dict()["model"] | {"moe": cfg.to_dict()["moe"]},
        "micro_batch": [b, s],
        "precision": cfg.train.precision,
        "zero_stage": cfg.parallel.zero_stage,
        "total_params": nums.total_params,
        "active_params": nums.active_params,
        "flops_per_token": nums.flops_per_token,
        "step_median_s": med,
        "step_times_s": times,
        "tokens_per_s": tokens_per_s,
        "model_tflops": achieved,
        "mfu_vs_table_peak": achieved / peak_table,
        "table_peak_tflops": peak_table,
        "losses": [float(x) for x in losses],
        "plan_predicted_bytes": predicted,
        "plan_activations_bytes": pl.activations_bytes,
        "plan_model_state_bytes": pl.model_state_bytes,
    }
    if device.type == "cuda":
        res["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        res["max_memory_reserved"] = torch.cuda.max_memory_reserved()
        res["plan_over_measured"] = predicted / res["max_memory_allocated"]
    res["ok"] = all(torch.isfinite(torch.tensor(res["losses"])).tolist())
    return res


def nccl(device: torch.device) -> dict[str, Any]:
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    x = torch.full((4,), 3.0, device=device)
    dist.all_reduce(x)
    big = torch.ones(64 * 1024 * 1024, device=device)  # 256 MiB fp32
    times = timed(lambda: dist.all_reduce(big), device, reps=5, warmup=1)
    return {
        "backend": dist.get_backend(),
        "world_size": dist.get_world_size(),
        "value_ok": bool((x == 3.0).all()),
        "all_reduce_256MiB_median_s": statistics.median(times),
        "ok": bool((x == 3.0).all()) and bool((big == 1.0).all()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU")
    ap.add_argument("--engine", choices=["auto", "deepspeed", "torch"], default="auto")
    ap.add_argument("--steps", type=int, default=None, help="timed training steps")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_h200_out"))
    args = ap.parse_args()
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run", file=sys.stderr)
        return 2
    device = torch.device("cpu" if dry else "cuda")
    low = torch.float32 if dry else torch.bfloat16
    torch.backends.cuda.matmul.allow_tf32 = False
    steps = args.steps or (2 if dry else 20)
    results: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dry_run": dry,
    }
    sections: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("correctness", lambda: correctness(device, low)),
        ("grouped_gemm", lambda: grouped_gemm(device, low, dry)),
        ("matmul", lambda: matmul_ceiling(device, low, dry)),
        ("train", lambda: train(device, dry, args.engine, steps)),
        ("nccl", lambda: nccl(device)),
    ]
    for name, fn in sections:
        t0 = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as exc:  # noqa: BLE001 - record and continue with the next section
            results[name] = {"ok": False, "error": repr(exc), "trace": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - t0
        print(f"[{name}] {time.perf_counter() - t0:.1f}s ok={results[name].get('ok')}", flush=True)
    tr = results.get("train", {})
    if "model_tflops" in tr and "tflops" in results.get("matmul", {}):
        tr["mfu_vs_measured_matmul"] = tr["model_tflops"] / results["matmul"]["tflops"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_h200.json").write_text(json.dumps(results, indent=2, default=str))
    print(summary(results))
    return 0 if all(results[n].get("ok") for n, _ in sections) else 1


def summary(r: dict[str, Any]) -> str:
    lines = [f"device {r['device']}, torch {r['torch']}, dry_run={r['dry_run']}"]
    c = r["correctness"]
    for key in ("fp32", "bfloat16"):
        if key in c:
            lines.append(
                f"correctness {key}: logits rel err {c[key]['logits_rel_err']:.2e} "
                f"(tol {c[key]['logits_rtol']:.0e}), loss diff {c[key]['loss_abs_diff']:.2e}"
            )
    if "error" in c:
        lines.append(f"correctness: ERROR {c['error']}")
    g = r["grouped_gemm"]
    if "speedup" in g:
        lines.append(
            f"experts fwd+bwd {g['shape']}: grouped {g['grouped']['median_s'] * 1e3:.2f} ms "
            f"({g['grouped']['tflops']:.1f} TFLOP/s), loop {g['loop']['median_s'] * 1e3:.2f} ms, "
            f"speedup {g['speedup']:.2f}x, rel err {g['rel_err_grouped_vs_loop']:.1e}"
        )
    m = r["matmul"]
    if "tflops" in m:
        lines.append(f"matmul {m['n']}^3 {m['dtype']}: {m['tflops']:.1f} TFLOP/s")
    t = r["train"]
    if "tokens_per_s" in t:
        lines.append(
            f"train [{t['engine']}] {t['total_params'] / 1e9:.2f}B total / "
            f"{t['active_params'] / 1e9:.2f}B active, {t['precision']} ZeRO-{t['zero_stage']}: "
            f"{t['tokens_per_s']:,.0f} tokens/s, {t['model_tflops']:.1f} TFLOP/s, "
            f"MFU {t['mfu_vs_table_peak']:.1%} of {t['table_peak_tflops']} "
            f"({t.get('mfu_vs_measured_matmul', float('nan')):.1%} of measured matmul)"
        )
        if "max_memory_allocated" in t:
            lines.append(
                f"memory: measured peak {t['max_memory_allocated'] / 2**30:.2f} GiB, plan "
                f"{t['plan_predicted_bytes'] / 2**30:.2f} GiB (ratio {t['plan_over_measured']:.2f})"
            )
    elif "error" in t:
        lines.append(f"train: ERROR {t['error']}")
    n = r["nccl"]
    if "error" in n:
        lines.append(f"nccl: ERROR {n['error']}")
    else:
        lines.append(
            f"{n['backend']} all_reduce world {n['world_size']}: value ok {n['value_ok']}, "
            f"256 MiB {n['all_reduce_256MiB_median_s'] * 1e3:.2f} ms"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
