"""One prepared GPU run (H200, ~5 minutes): what moetrain's trainer runs, measured, plus the
checks that only a GPU can make for the CUDA paths (kernel choices, host syncs, timing).

    python3 benchmarks/gpu_h200.py                      # on the GPU machine (see README-gpu.md)
    .venv/bin/python benchmarks/gpu_h200.py --dry-run   # tiny shapes on CPU, same code paths

``preflight`` first: torch and CUDA versions, device name and compute capability, the bf16 peak
read from the device name (moetrain.monitor.mfu's table), deepspeed, ``F.grouped_mm`` and the
grouped-GEMM guard's decision for the training shape. A missing required piece (no CUDA device,
no ``F.grouped_mm``, no deepspeed, a device the peak table lacks) stops the run at once with
exit code 2 and the list on stderr. Then the sections (each recorded in the JSON even when it
fails, with the error):

1. ``correctness``: a tiny model built in fp32 on CPU; the same weights on the device in bf16
   (and fp32, tf32 off); logits relative error ||dev - cpu|| / ||cpu|| and loss difference
   against stated tolerances.
2. ``grouped_gemm``: moetrain's GroupedExperts fwd+bwd with ``grouped_mm=True`` vs the
   per-expert loop, same weights and routed tokens, CUDA-event median; the path that ran
   (``GroupedExperts.path``), which must be grouped GEMM where the guard allows it; experts
   without tokens get exactly zero weight gradients (PyTorch issue 172439 on sm100); an expert
   hidden size torch's kernel refuses (F = 1436) runs through the loop instead of raising.
3. ``matmul``: the measured bf16 matmul ceiling (8192^3, random data).
4. ``attention``: one attention layer with a document mask and grouped K/V (16 query heads, 4
   K/V heads, S 2048): the SDPA kernel torch picked (must not be the math kernel on CUDA),
   peak memory of fwd+bwd against the math kernel forced, outputs against the grouped call.
   ``hybrid`` (``benchmarks/gpu_hybrid.py``): one Gated DeltaNet, Kimi Delta Attention and
   Mamba-2 layer each (S 4096, four documents, bf16), forward + backward with the CUDA kernels
   of ``moetrain[kernels]`` (fla, causal-conv1d, mamba-ssm) against moetrain's torch path: what
   ran, time, peak memory, and their agreement (output and every gradient).
5. ``host_syncs``: one MoE layer (training shape, bf16, EP=1) fwd+bwd under
   ``torch.cuda.set_sync_debug_mode("warn")``: synchronizing CUDA calls, dropless (0 expected)
   and with a capacity factor (1: the kept-row count), next to the CPU op counter's numbers.
6. ``train``: a ~0.9B-total-parameter MoE (``TRAIN_SHAPE``) through moetrain's own
   ``Trainer.train_step`` (DeepSpeed ZeRO-1, EP=1, bf16 with fp32 gradient accumulation and
   master weights: DeepSpeed's BF16_Optimizer, chunked loss): tokens/s, MFU against
   the device's table peak and the measured matmul; peak memory of the steps (reset after the
   build) against ``moetrain.plan``; the step timer's split against synchronized wall time;
   ``torch.cuda.synchronize`` calls during the steps by caller (none from moetrain); the
   attention kernel and the experts' path the trainer ran.
   ``train_mla_mtp``: the same at the DeepSeek-V3 architecture (``MLA_MTP``: latent attention,
   grouped sigmoid routing, a shared expert, a dense first layer, one multi-token-prediction
   module), against its own plan.
   ``train_zero3``: the ``train`` run at ZeRO-3 (``parallel.zero_stage=3``, every weight
   partitioned; on one GPU the gathers are local): the same figures, against its own plan, and
   its losses against the ZeRO-1 run's (``losses_rel_diff_vs_zero1``).
7. ``precision``: the bf16/fp16 numerics policy on the device, through ``Trainer.train_step``
   on the tiny model. bf16 at ZeRO-1 and ZeRO-2: bf16 weights, fp32 losses and aux-loss-free
   bias, fp32 gradient buffers (no bf16 gradient left alive), and a NaN gradient that skips the
   step without changing a master weight, Adam state or the schedule. fp16 (GPU only; DeepSpeed's
   CPU accelerator has none): an overflow forced with a huge loss scale is calibration (step
   skipped, masters unchanged, ``loss_scale_overflows`` counted, not ``skipped_steps``, the scale
   drops), and the logged gradient norm is unscaled (it matches the fp32 run's to 2%).
8. ``nccl``: all_reduce on one rank (value check and a 256 MiB timing).

Results go to ``<--out>/gpu_h200.json`` (``--out DIR`` is required) and a summary is printed
last.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import socket
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # (also when loaded by path, as the tests do)

from gpu_hybrid import hybrid, hybrid_summary  # noqa: E402

from moetrain.config import Config, apply_overrides, config_from_dict  # noqa: E402
from moetrain.model import GroupedExperts, Transformer  # noqa: E402
from moetrain.model.cpu_matmul import use_cpu_matmul  # noqa: E402
from moetrain.model.moe.gemm_guard import grouped_mm_refusal  # noqa: E402
from moetrain.model_numbers import model_numbers  # noqa: E402

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
# ZeRO-3 with every weight partitioned (none kept whole below the persistence threshold)
ZERO3 = {"parallel.zero_stage": 3, "parallel.zero3_persistence_elements": 0}
# The DeepSeek-V3 architecture at TRAIN_SHAPE's width: latent attention with a query LoRA,
# sigmoid routing in groups with the aux-loss-free bias, a shared expert, a dense first layer,
# one multi-token-prediction module.
MLA_MTP = {
    "model.attention": "mla",
    "model.q_lora_rank": 512,
    "model.kv_lora_rank": 256,
    "model.qk_nope_head_dim": 128,
    "model.qk_rope_head_dim": 64,
    "model.v_head_dim": 128,
    "model.rope_interleave": "true",
    "model.mtp_depth": 1,
    "moe.score_func": "sigmoid",
    "moe.n_group": 4,
    "moe.topk_group": 2,
    "moe.num_shared_experts": 1,
    "moe.first_k_dense": 1,
    "moe.bias_update_rate": 0.001,
}
MLA_MTP_TRAIN_SHAPE = {**TRAIN_SHAPE, **MLA_MTP, "model.n_kv_heads": 16}
DRY_MLA_MTP = {
    **MLA_MTP,
    "model.q_lora_rank": 32,
    "model.kv_lora_rank": 32,
    "model.qk_nope_head_dim": 16,
    "model.qk_rope_head_dim": 8,
    "model.v_head_dim": 16,
    "model.n_kv_heads": 4,
}
DRY_MLA_MTP_TRAIN_SHAPE = {**DRY_TRAIN_SHAPE, **DRY_MLA_MTP}
LOGITS_RTOL_BF16 = 3e-2  # bf16 operands through 2 layers; near-tie routing may flip a few tokens
LOSS_ATOL_BF16 = 2e-2
LOGITS_RTOL_FP32 = 1e-4
ATTN_RTOL_BF16 = 2e-2  # expanded vs grouped K/V in bf16: different kernels, same math
TIMER_VS_WALL = (0.85, 1.05)  # the timer's fwd_bwd + optimizer over the synchronized step time


def make_config(overrides: dict[str, Any]) -> Config:
    return config_from_dict(apply_overrides({}, [f"{k}={v}" for k, v in overrides.items()]))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def peak_memory(device: torch.device, fn: Callable[[], Any]) -> int | None:
    """Bytes allocated at the peak of ``fn`` above what was allocated before (CUDA only)."""
    if device.type != "cuda":
        fn()
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated(device) - before


# --------------------------------------------------------------------------- preflight


def preflight(dry: bool) -> tuple[dict[str, Any], list[str]]:
    """What this machine has, and the required pieces it lacks (empty: go)."""
    from moetrain.monitor.mfu import lookup_peak_tflops, match_device

    cuda = torch.cuda.is_available()
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if cuda and not dry else "cpu",
        "capability": list(torch.cuda.get_device_capability()) if cuda and not dry else None,
        "grouped_mm_available": hasattr(F, "grouped_mm"),
    }
    missing = []
    if not dry and not cuda:
        missing.append("a CUDA device (use --dry-run on CPU)")
    if not info["grouped_mm_available"]:
        missing.append(f"torch.nn.functional.grouped_mm (torch {torch.__version__})")
    try:
        import deepspeed

        info["deepspeed"] = deepspeed.__version__
    except Exception as exc:  # noqa: BLE001 - any import failure is a missing piece
        info["deepspeed"] = None
        missing.append(f"deepspeed, which the trainer needs ({exc!r})")
    if not dry and cuda:
        info["peak_table_key"] = match_device(info["device"])
        info["peak_bf16_tflops"] = lookup_peak_tflops(info["device"], "bf16")
        if info["peak_bf16_tflops"] is None:
            missing.append(f"a bf16 peak for {info['device']!r} in moetrain.monitor.mfu")
    cfg = make_config(DRY_TRAIN_SHAPE if dry else TRAIN_SHAPE)
    cap = info["capability"]
    info["grouped_mm_refusal"] = grouped_mm_refusal(
        device_type="cpu" if dry else "cuda",
        dtype=torch.float32 if dry else torch.bfloat16,
        d_model=cfg.model.d_model,
        hidden=cfg.moe.expert_hidden,
        capability=tuple(cap) if cap else None,
    )
    return info, missing


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


def _experts(e: int, d: int, f: int, device: torch.device, dtype: torch.dtype) -> GroupedExperts:
    mod = GroupedExperts(e, d, f, grouped_mm=True).to(device)
    for w in (mod.w13, mod.w2):
        torch.nn.init.normal_(w, std=0.02)
    return mod.to(dtype)


def grouped_gemm(device: torch.device, dtype: torch.dtype, dry: bool) -> dict[str, Any]:
    e, d, f, tokens, k = (4, 64, 128, 512, 2) if dry else (8, 2048, 1792, 16384, 2)
    torch.manual_seed(1)
    fast = _experts(e, d, f, device, dtype)
    loop = copy.deepcopy(fast)
    loop.use_grouped_mm = False
    ids = torch.randint(0, e, (tokens * k,), device=device)
    counts = torch.bincount(ids, minlength=e)
    x = torch.randn(tokens * k, d, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    outs = {}

    def step(mod: GroupedExperts, cnt: torch.Tensor = counts) -> torch.Tensor:
        xi = x.detach().requires_grad_(True)
        y = mod(xi, cnt)
        y.backward(grad)
        mod.zero_grad(set_to_none=True)
        return y

    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    refusal = grouped_mm_refusal(
        device_type=device.type, dtype=dtype, d_model=d, hidden=f, capability=cap
    )
    res: dict[str, Any] = {"shape": {"E": e, "D": d, "F": f, "copies": tokens * k}}
    flops = 18.0 * tokens * k * d * f  # 3 matmuls, forward 2 + backward 4 FLOPs per MAC
    for name, mod in (("grouped", fast), ("loop", loop)):
        outs[name] = step(mod).detach()
        times = timed(lambda m=mod: step(m), device, reps=3 if dry else 20)
        med = statistics.median(times)
        res[name] = {"median_s": med, "tflops": flops / med / 1e12, "path": mod.path}
    res["path"] = fast.path
    res["guard_refusal"] = refusal
    res["speedup"] = res["loop"]["median_s"] / res["grouped"]["median_s"]
    res["rel_err_grouped_vs_loop"] = rel_err(outs["grouped"], outs["loop"])

    # experts 1 and 3 get no tokens: their weight gradients must be exactly zero
    empty = torch.zeros(e, dtype=counts.dtype, device=device)
    empty[0], empty[2] = tokens * k // 2, tokens * k - tokens * k // 2
    xi = x.detach().requires_grad_(True)
    fast(xi, empty).backward(grad)
    res["zero_token_experts_max_abs_grad"] = max(
        float(w.grad[i].abs().max()) for w in (fast.w13, fast.w2) for i in (1, 3)
    )
    fast.zero_grad(set_to_none=True)

    # an expert hidden size whose activation rows are not 16-byte aligned in bf16
    odd = _experts(e, d, 1436, device, dtype)
    y_odd = odd(x[:64], torch.tensor([64] + [0] * (e - 1), device=device))
    res["f1436"] = {"path": odd.path, "finite": bool(torch.isfinite(y_odd).all())}

    res["ok"] = (
        res["rel_err_grouped_vs_loop"] < (1e-2 if dtype == torch.bfloat16 else 1e-5)
        and (fast.path == "grouped_mm") == (refusal is None)
        and res["zero_token_experts_max_abs_grad"] == 0.0
        and res["f1436"]["finite"]
        and (dtype != torch.bfloat16 or odd.path.startswith("loop: SwiGLU activation"))
    )
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


def attention(device: torch.device, dtype: torch.dtype, dry: bool) -> dict[str, Any]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from moetrain.config.layer_plan import MixerSpec
    from moetrain.model.attention import document_mask, rope_tables
    from moetrain.model.mixers import MixerInputs
    from moetrain.model.mixers.gqa import Attention

    b, s, heads, kv, hd = (2, 64, 4, 2, 16) if dry else (2, 2048, 16, 4, 128)
    cfg = make_config(
        {"model.d_model": heads * hd, "model.n_heads": heads, "model.n_kv_heads": kv}
        | {"model.max_seq_len": s, "data.seq_len": s}
    )
    torch.manual_seed(2)
    attn = Attention(cfg.model, MixerSpec("gqa")).to(device=device, dtype=dtype)
    cos, sin = (t.to(device) for t in rope_tables(hd, s, cfg.model.rope_theta))
    bounds = torch.tensor([0, s // 5, s // 2, s - s // 8])  # four documents per row
    doc_ids = (torch.arange(s)[None, :, None] >= bounds).sum(-1).expand(b, s).to(device)
    mask = document_mask(doc_ids, dtype)
    x = torch.randn(b, s, heads * hd, device=device, dtype=dtype, requires_grad=True)

    def fwd_bwd() -> torch.Tensor:
        y = attn(x, MixerInputs(cos, sin, mask))
        y.float().square().mean().backward()
        return y.detach()

    out: dict[str, Any] = {"shape": {"B": b, "S": s, "H": heads, "G": kv, "Hd": hd}}
    y = fwd_bwd()
    out["kernel"] = attn.sdpa_kernel
    out["peak_bytes"] = peak_memory(device, fwd_bwd)
    if device.type == "cuda":
        with sdpa_kernel(SDPBackend.MATH):
            attn.sdpa_kernel = None
            y_math = fwd_bwd()
            out["math_peak_bytes"] = peak_memory(device, fwd_bwd)
        out["rel_err_vs_math"] = rel_err(y, y_math)
    ok_kernel = not out["kernel"].startswith("math") or device.type == "cpu"
    out["ok"] = ok_kernel and out.get("rel_err_vs_math", 0.0) <= ATTN_RTOL_BF16
    return out


def host_syncs(device: torch.device, dtype: torch.dtype, dry: bool) -> dict[str, Any]:
    from moetrain.model.moe.layer import MoELayer
    from moetrain.monitor.host_sync import HostSyncCounter

    cfg = make_config(DRY_TRAIN_SHAPE if dry else TRAIN_SHAPE)
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    out: dict[str, Any] = {"tokens": tokens}
    for name, cf in (("dropless", 0.0), ("capacity_1.25", 1.25)):
        torch.manual_seed(3)
        moe_cfg = dataclasses.replace(cfg.moe, capacity_factor=cf)
        layer = MoELayer(moe_cfg, cfg.model.d_model).to(device=device, dtype=dtype)
        layer.router.expert_bias.data = layer.router.expert_bias.float()
        for w in (layer.experts.w13, layer.experts.w2, layer.router.gate.weight):
            torch.nn.init.normal_(w, std=0.02)
        x = torch.randn(1, tokens, cfg.model.d_model, device=device, dtype=dtype)

        def run(layer: MoELayer = layer, x: torch.Tensor = x) -> None:
            xi = x.detach().requires_grad_(True)
            y, stats = layer(xi)
            (y.float().square().mean() + stats.aux_loss).backward()

        run()  # warm-up (allocator, kernels)
        sync(device)
        with HostSyncCounter() as ops:
            run()
        row: dict[str, Any] = {"ops": dict(ops.counts), "experts_path": layer.experts.path}
        if device.type == "cuda":
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    run()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            row["cuda_syncs"] = sum("synchronizing" in str(w.message) for w in caught)
        out[name] = row
    drop = out["dropless"]
    out["ok"] = drop["ops"] == {} and drop.get("cuda_syncs", 0) == 0
    return out


class SyncCalls:
    """Counts ``torch.cuda.synchronize`` calls by the module that called it."""

    def __init__(self) -> None:
        self.by_caller: Counter[str] = Counter()
        self._real: Any = None

    def __enter__(self) -> SyncCalls:
        self._real = torch.cuda.synchronize

        def counted(*args: Any, **kwargs: Any) -> Any:
            frame = sys._getframe(1)
            self.by_caller[frame.f_globals.get("__name__", "?")] += 1
            return self._real(*args, **kwargs)

        torch.cuda.synchronize = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.synchronize = self._real


def train(
    device: torch.device,
    dry: bool,
    steps: int,
    peak_tflops: float | None,
    shapes: tuple[dict[str, Any], dict[str, Any]] = (TRAIN_SHAPE, DRY_TRAIN_SHAPE),
) -> dict[str, Any]:
    """``shapes``: the run's settings on the GPU and in the dry run."""
    from moetrain.model.attention import attention_report
    from moetrain.parallel.topology import init_distributed
    from moetrain.plan import plan
    from moetrain.train.trainer import Trainer

    warmup = 2
    cfg = make_config((shapes[1] if dry else shapes[0]) | {"train.max_steps": steps + warmup + 1})
    nums = model_numbers(cfg)
    trainer = Trainer(cfg, init_distributed(cfg))  # DeepSpeed engine, as `moetrain train` builds
    sync(device)
    res: dict[str, Any] = {"step": "moetrain.train.trainer.Trainer.train_step"}
    if device.type == "cuda":
        res["memory_after_build"] = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)  # the build (fp32 init, casts) does not count

    b, s, v = cfg.train.micro_batch_size, cfg.data.seq_len, cfg.model.vocab_size
    accum = cfg.train.grad_accum_steps
    gen = torch.Generator(device="cpu").manual_seed(0)
    batches = [
        {"input_ids": torch.randint(0, v, (b, s), generator=gen)}
        | {"labels": torch.randint(0, v, (b, s), generator=gen)}
        for _ in range(4)
    ]
    records: list[dict[str, Any]] = []

    def one(i: int) -> None:
        records.append(trainer.train_step([batches[(i + j) % 4] for j in range(accum)]))

    for i in range(warmup):
        one(i)
    records.clear()
    sync(device)
    with SyncCalls() as calls:
        t0 = time.perf_counter()
        for i in range(steps):
            one(i)
        sync(device)
        wall = (time.perf_counter() - t0) / steps
    timer_s = statistics.median(r["time/fwd_bwd_s"] + r["time/optimizer_s"] for r in records)
    tokens_per_s = b * s * accum / wall
    achieved = tokens_per_s * nums.flops_per_token / 1e12
    pl = plan(cfg, gpus=1, gpu="h200")
    predicted = pl.model_state_bytes + pl.activations_bytes + pl.param_grad_transient_bytes
    paths = sorted({layer.experts.path for layer in trainer.model.moe_layers()})
    res |= {
        "shape": cfg.to_dict()["model"] | {"moe": cfg.to_dict()["moe"]},
        "micro_batch": [b, s],
        "grad_accum_steps": accum,
        "precision": cfg.train.precision,
        "zero_stage": cfg.parallel.zero_stage,
        "optimizer": type(trainer.engine.optimizer).__name__,
        "grad_accum_dtype": trainer.ds_config["data_types"]["grad_accum_dtype"],
        "loss_chunk_tokens": cfg.model.loss_chunk_tokens,
        "total_params": nums.total_params,
        "active_params": nums.active_params,
        "flops_per_token": nums.flops_per_token,
        "step_wall_s": wall,
        "tokens_per_s": tokens_per_s,
        "model_tflops": achieved,
        "timer_step_s": timer_s,
        "timer_split_s": {k: records[-1][f"time/{k}_s"] for k in ("fwd_bwd", "optimizer")},
        "timer_vs_wall": timer_s / wall,
        "synchronize_calls": dict(calls.by_caller),
        "attention_kernel": attention_report(trainer.model),
        "experts_path": paths,
        "losses": [r["loss"] for r in records],
        "plan_predicted_bytes": predicted,
        "plan_activations_bytes": pl.activations_bytes,
        "plan_model_state_bytes": pl.model_state_bytes,
    }
    if peak_tflops:
        res["peak_tflops"] = peak_tflops
        res["mfu_vs_table_peak"] = achieved / peak_tflops
    if device.type == "cuda":
        res["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
        res["max_memory_reserved"] = torch.cuda.max_memory_reserved(device)
        res["plan_over_measured"] = predicted / res["max_memory_allocated"]
    lo, hi = TIMER_VS_WALL
    res["ok"] = (
        all(torch.isfinite(torch.tensor(res["losses"])).tolist())
        and not any(name.startswith("moetrain") for name in calls.by_caller)
        and lo <= res["timer_vs_wall"] <= hi
        and (paths == ["grouped_mm"] or bool(grouped_mm_refusal_live(trainer)))
    )
    return res


def _adam_state(trainer: Any) -> list[Any]:
    """The optimizer's fp32 master partitions with their Adam state, and the schedule."""
    base = trainer.engine.optimizer.optimizer
    params = [p for g in base.param_groups for p in g["params"]]
    adam = [{k: v.detach().clone() for k, v in base.state.get(p, {}).items()} for p in params]
    return [[p.detach().clone() for p in params], adam, dict(trainer.schedule.state_dict())]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return bool(torch.equal(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def precision(device: torch.device, dry: bool) -> dict[str, Any]:
    """The numerics policy on the device (see the module docstring, section 7)."""
    from moetrain.parallel.topology import init_distributed
    from moetrain.train.trainer import Trainer

    gen = torch.Generator(device="cpu").manual_seed(1)
    v, b, s = TINY["model.vocab_size"], TINY["train.micro_batch_size"], TINY["data.seq_len"]
    seqs = [torch.randint(0, v, (b, s + 1), generator=gen) for _ in range(6)]
    batches = [[{"input_ids": q[:, :-1], "labels": q[:, 1:]}] for q in seqs]

    def build(precision: str, stage: int) -> Any:
        cfg = make_config(TINY | {"train.precision": precision, "parallel.zero_stage": stage})
        return Trainer(cfg, init_distributed(cfg))

    res: dict[str, Any] = {}
    ok = True
    for stage in (1, 2):
        tr = build("bf16", stage)
        seen: dict[str, Any] = {}

        def grads(t: Any, seen: dict[str, Any] = seen) -> None:
            opt = t.engine.optimizer
            bufs = getattr(opt, "fp32_groups_gradients_flat", None)
            if bufs is None:
                bufs = [x for xs in opt.averaged_gradients.values() if xs for x in xs]
            seen["grad_buffers"] = sorted({str(x.dtype) for x in bufs})
            seen["bf16_grads_alive"] = sum(p.grad is not None for p in t.model.parameters())

        tr.train_step(batches[0], before_step=grads)
        before = _adam_state(tr)
        w = dict(tr.model.named_parameters())["layers.0.attn.wq.weight"]
        hook = w.register_hook(lambda g: torch.full_like(g, float("nan")))
        skip = tr.train_step(batches[1])
        hook.remove()
        unchanged = _same(before, _adam_state(tr))
        after = tr.train_step(batches[2])
        r = {
            "optimizer": type(tr.engine.optimizer).__name__,
            "weights": str(w.dtype),
            "expert_bias": str(tr.routers[0].expert_bias.dtype),
            **seen,
            "skip": {"skipped": skip["skipped"], "state_unchanged": unchanged},
            "next_step_applied": not after["skipped"],
        }
        r["ok"] = (
            r["weights"] == "torch.bfloat16"
            and r["expert_bias"] == "torch.float32"
            and r["grad_buffers"] == ["torch.float32"]
            and r["bf16_grads_alive"] == 0
            and skip["skipped"]
            and unchanged
            and r["next_step_applied"]
        )
        ok = ok and r["ok"]
        res[f"bf16_zero{stage}"] = r
        del tr
    if device.type != "cuda":
        res["fp16"] = {"skipped": "DeepSpeed's CPU accelerator has no fp16"}
        res["ok"] = ok
        return res
    norms = {}
    for prec in ("fp32", "fp16"):
        tr = build(prec, 1)
        rec = tr.train_step(batches[0])
        norms[prec] = rec["grad_norm"]
        if prec == "fp32":
            del tr
    scaler = tr.engine.optimizer.loss_scaler
    scaler.cur_scale = 2.0**40  # fp16 gradients overflow for sure
    before = _adam_state(tr)
    forced = [tr.train_step(batches[i]) for i in (1, 2)]  # hysteresis 2: then the scale halves
    unchanged = _same(before, _adam_state(tr))
    f = {
        "forced_overflow": [
            {
                k: x.get(k)
                for k in ("skipped", "skipped_steps", "loss_scale", "loss_scale_overflows")
            }
            for x in forced
        ],
        "state_unchanged": unchanged,
        "grad_norm_fp16": norms["fp16"],
        "grad_norm_fp32": norms["fp32"],
        "scaler_state": tr.loss_scaler.state_dict(),
    }
    f["ok"] = (
        all(x["skipped"] for x in forced)
        and forced[-1]["skipped_steps"] == 0
        and forced[-1]["loss_scale_overflows"] == 2
        and forced[-1]["loss_scale"] < 2.0**40
        and unchanged
        and abs(norms["fp16"] - norms["fp32"]) <= 0.02 * norms["fp32"]
    )
    res["fp16"] = f
    res["ok"] = ok and f["ok"]
    return res


def grouped_mm_refusal_live(trainer: Any) -> str | None:
    """The guard's reason for the trainer's experts (None: grouped GEMM must have run)."""
    layer = trainer.model.moe_layers()[0]
    w = layer.experts.w13
    cap = torch.cuda.get_device_capability(w.device) if w.is_cuda else None
    return grouped_mm_refusal(
        device_type=w.device.type,
        dtype=w.dtype,
        d_model=w.shape[-2],
        hidden=w.shape[-1] // 2,
        capability=cap,
    )


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU")
    ap.add_argument("--steps", type=int, default=None, help="timed training steps")
    ap.add_argument("--out", required=True, help="directory for gpu_h200.json (created)")
    args = ap.parse_args(argv)
    dry = args.dry_run
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info, missing = preflight(dry)
    results: dict[str, Any] = {"dry_run": dry, "preflight": info, **info}
    if missing:
        results["missing"] = missing
        (out / "gpu_h200.json").write_text(json.dumps(results, indent=2, default=str))
        print("gpu_h200: MISSING, nothing measured:", *missing, sep="\n  - ", file=sys.stderr)
        return 2
    device = torch.device("cpu" if dry else "cuda")
    if dry:  # the dry run stands for the GPU run: torch's kernels, as on a GPU
        use_cpu_matmul("torch")
    low = torch.float32 if dry else torch.bfloat16
    torch.backends.cuda.matmul.allow_tf32 = False
    steps = args.steps or (2 if dry else 20)
    sections: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("correctness", lambda: correctness(device, low)),
        ("grouped_gemm", lambda: grouped_gemm(device, low, dry)),
        ("matmul", lambda: matmul_ceiling(device, low, dry)),
        ("attention", lambda: attention(device, low, dry)),
        ("hybrid", lambda: hybrid(device, low, dry, timed, peak_memory)),
        ("host_syncs", lambda: host_syncs(device, low, dry)),
        ("train", lambda: train(device, dry, steps, info.get("peak_bf16_tflops"))),
        (
            "train_mla_mtp",
            lambda: train(
                device,
                dry,
                steps,
                info.get("peak_bf16_tflops"),
                (MLA_MTP_TRAIN_SHAPE, DRY_MLA_MTP_TRAIN_SHAPE),
            ),
        ),
        (  # the train section's run with every weight a ZeRO-3 partition (one GPU: the
            # gathers are local), its losses beside the ZeRO-1 run's
            "train_zero3",
            lambda: train(
                device,
                dry,
                steps,
                info.get("peak_bf16_tflops"),
                (TRAIN_SHAPE | ZERO3, DRY_TRAIN_SHAPE | ZERO3),
            ),
        ),
        ("precision", lambda: precision(device, dry)),
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
    zero1, zero3 = results.get("train", {}), results.get("train_zero3", {})
    if "losses" in zero1 and "losses" in zero3:
        zero3["losses_rel_diff_vs_zero1"] = max(
            abs(a - b) / abs(b) for a, b in zip(zero3["losses"], zero1["losses"], strict=True)
        )
    for tr in (zero1, results.get("train_mla_mtp", {}), zero3):
        if "model_tflops" in tr and "tflops" in results.get("matmul", {}):
            tr["mfu_vs_measured_matmul"] = tr["model_tflops"] / results["matmul"]["tflops"]
    (out / "gpu_h200.json").write_text(json.dumps(results, indent=2, default=str))
    print(summary(results))
    return 0 if all(results[n].get("ok") for n, _ in sections) else 1


def _gib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def summary(r: dict[str, Any]) -> str:
    cap = r.get("capability")
    lines = [
        f"device {r['device']} (sm {cap}), torch {r['torch']}, cuda {r['cuda']}, "
        f"deepspeed {r.get('deepspeed')}, dry_run={r['dry_run']}"
    ]
    c = r["correctness"]
    for key in ("fp32", "bfloat16"):
        if key in c:
            lines.append(
                f"correctness {key}: logits rel err {c[key]['logits_rel_err']:.2e} "
                f"(tol {c[key]['logits_rtol']:.0e}), loss diff {c[key]['loss_abs_diff']:.2e}"
            )
    g = r["grouped_gemm"]
    if "speedup" in g:
        lines.append(
            f"experts fwd+bwd {g['shape']}: {g['path']} {g['grouped']['median_s'] * 1e3:.2f} ms "
            f"({g['grouped']['tflops']:.1f} TFLOP/s), loop {g['loop']['median_s'] * 1e3:.2f} ms, "
            f"speedup {g['speedup']:.2f}x, rel err {g['rel_err_grouped_vs_loop']:.1e}, "
            f"zero-token grad {g['zero_token_experts_max_abs_grad']:.1e}, "
            f"F=1436: {g['f1436']['path']}"
        )
    m = r["matmul"]
    if "tflops" in m:
        lines.append(f"matmul {m['n']}^3 {m['dtype']}: {m['tflops']:.1f} TFLOP/s")
    a = r["attention"]
    if "kernel" in a:
        lines.append(
            f"attention {a['shape']} document mask: {a['kernel']}, peak {_gib(a['peak_bytes'])} "
            f"(math kernel {_gib(a.get('math_peak_bytes'))})"
        )
    lines += hybrid_summary(r.get("hybrid", {}))
    h = r["host_syncs"]
    if "dropless" in h:
        for key in ("dropless", "capacity_1.25"):
            lines.append(
                f"host syncs, one MoE layer fwd+bwd {key}: ops {h[key]['ops']}, "
                f"CUDA sync calls {h[key].get('cuda_syncs', 'n/a')} ({h[key]['experts_path']})"
            )
    for section in ("train", "train_mla_mtp", "train_zero3"):
        t = r.get(section, {})
        if "tokens_per_s" in t:
            mfu = t.get("mfu_vs_table_peak")
            lines.append(
                f"{section} [{t['step']}] {t['total_params'] / 1e9:.2f}B total / "
                f"{t['active_params'] / 1e9:.2f}B active, {t['precision']} ZeRO-{t['zero_stage']}: "
                f"{t['tokens_per_s']:,.0f} tokens/s, {t['model_tflops']:.1f} TFLOP/s"
                + (f", MFU {mfu:.1%} of {t['peak_tflops']}" if mfu is not None else "")
                + f" ({t.get('mfu_vs_measured_matmul', float('nan')):.1%} of measured matmul)"
            )
            lines.append(
                f"  timer {t['timer_step_s'] * 1e3:.1f} ms vs wall {t['step_wall_s'] * 1e3:.1f} ms "
                f"({t['timer_vs_wall']:.2f}), synchronize calls {t['synchronize_calls']}, "
                f"attention {t['attention_kernel']}, experts {t['experts_path']}"
            )
            if "max_memory_allocated" in t:
                lines.append(
                    f"  memory: after build {_gib(t['memory_after_build'])}, peak of the steps "
                    f"{_gib(t['max_memory_allocated'])}, plan {_gib(t['plan_predicted_bytes'])} "
                    f"(plan / measured {t['plan_over_measured']:.2f})"
                )
    pr = r["precision"]
    for key in ("bf16_zero1", "bf16_zero2"):
        if key in pr:
            x = pr[key]
            lines.append(
                f"precision {key}: {x['optimizer']}, weights {x['weights']}, gradient buffers "
                f"{x['grad_buffers']}, NaN step skipped {x['skip']['skipped']} with state "
                f"unchanged {x['skip']['state_unchanged']}"
            )
    if "forced_overflow" in pr.get("fp16", {}):
        x = pr["fp16"]
        lines.append(
            f"precision fp16: forced overflows {x['forced_overflow']}, state unchanged "
            f"{x['state_unchanged']}, grad norm fp16 {x['grad_norm_fp16']:.4g} vs fp32 "
            f"{x['grad_norm_fp32']:.4g}"
        )
    elif "fp16" in pr:
        lines.append(f"precision fp16: {pr['fp16'].get('skipped')}")
    n = r["nccl"]
    if "backend" in n:
        lines.append(
            f"{n['backend']} all_reduce world {n['world_size']}: value ok {n['value_ok']}, "
            f"256 MiB {n['all_reduce_256MiB_median_s'] * 1e3:.2f} ms"
        )
    for name in (
        "correctness",
        "grouped_gemm",
        "matmul",
        "attention",
        "hybrid",
        "host_syncs",
        "train",
        "precision",
        "nccl",
    ):
        if "error" in r.get(name, {}):
            lines.append(f"{name}: ERROR {r[name]['error']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
