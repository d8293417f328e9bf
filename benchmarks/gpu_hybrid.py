"""The GPU script's ``hybrid`` section (``benchmarks/gpu_h200.py``): the recurrent mixers'
CUDA kernels (fla's gated delta rule and Kimi Delta Attention, mamba-ssm's chunked scan,
causal-conv1d's convolution; ``pip install 'moetrain[kernels]'``) against moetrain's torch
paths, one layer each, forward + backward, bf16, packed documents.

Per mixer (Gated DeltaNet at Qwen3-Next's linear-attention shape, Kimi Delta Attention at
Kimi Linear's, Mamba-2 at Nemotron-H's; ``SHAPES``), one row of ``S`` = 4096 tokens holding
four documents: what each choice of ``train.recurrent_kernels`` ran (``auto``: the kernels;
``torch``), the CUDA-event median time and the peak memory of a forward + backward of each,
and their agreement: the output, the input's gradient and every parameter's gradient,
relative to the largest value, within ``RTOL_BF16``. ``ok`` needs the kernels to have run (a
missing package fails the section with its reason) and the agreement. With ``--dry-run`` it
runs on the CPU at tiny shapes, where both choices run the torch path.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from moetrain.config import apply_overrides, config_from_dict
from moetrain.config.layer_plan import FULL, LINEAR, mixer_spec
from moetrain.model.mixers import MixerInputs, build_mixer
from moetrain.model.recurrent_kernels import use_recurrent_kernels

RTOL_BF16 = 5e-2  # the kernels' bf16 products against the torch paths' fp32 state
S, DRY_S = 4096, 128
COMMON = {"model.n_layers": 2, "model.layer_types": f"[{LINEAR}, {FULL}]"}
SHAPES = {  # (GPU shape, dry-run shape)
    "gated_deltanet": (
        {
            "model.d_model": 2048,
            "model.linear_num_key_heads": 16,
            "model.linear_num_value_heads": 32,
            "model.linear_key_head_dim": 128,
            "model.linear_value_head_dim": 128,
        },
        {
            "model.d_model": 64,
            "model.linear_num_key_heads": 2,
            "model.linear_num_value_heads": 4,
            "model.linear_key_head_dim": 16,
            "model.linear_value_head_dim": 16,
        },
    ),
    "kda": (
        {"model.d_model": 2048, "model.linear_num_heads": 16, "model.linear_head_dim": 128},
        {"model.d_model": 64, "model.linear_num_heads": 4, "model.linear_head_dim": 16},
    ),
    "mamba2": (
        {
            "model.d_model": 2048,
            "model.mamba_num_heads": 64,
            "model.mamba_head_dim": 64,
            "model.mamba_n_groups": 8,
            "model.mamba_state_dim": 128,
            "model.mamba_chunk_size": 128,
        },
        {
            "model.d_model": 64,
            "model.mamba_num_heads": 4,
            "model.mamba_head_dim": 16,
            "model.mamba_n_groups": 2,
            "model.mamba_state_dim": 16,
            "model.mamba_chunk_size": 32,
        },
    ),
}


def _layer(kind: str, dry: bool, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    overrides = {**COMMON, "model.linear_attention": kind, **SHAPES[kind][dry]}
    overrides["model.max_seq_len"] = overrides["data.seq_len"] = DRY_S if dry else S
    cfg = config_from_dict(apply_overrides({}, [f"{k}={v}" for k, v in overrides.items()]))
    torch.manual_seed(0)
    layer = build_mixer(cfg.model, mixer_spec(cfg.model, 0))
    layer.init_own_parameters()
    return layer.to(device=device, dtype=dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _one(
    kind: str,
    device: torch.device,
    dtype: torch.dtype,
    dry: bool,
    timed: Callable[..., list[float]],
    peak_memory: Callable[..., int | None],
) -> dict[str, Any]:
    layer = _layer(kind, dry, device, dtype)
    s = DRY_S if dry else S
    d = layer.wo.weight.shape[0]
    gen = torch.Generator(device).manual_seed(1)
    x = torch.randn(1, s, d, device=device, dtype=dtype, generator=gen, requires_grad=True)
    w = torch.randn(1, s, d, device=device, dtype=torch.float32, generator=gen)
    bounds = torch.tensor([0, s // 5, s // 2, s - s // 8], device=device)  # four documents
    docs = (torch.arange(s, device=device)[None, :, None] >= bounds).sum(-1)
    inputs = MixerInputs(torch.zeros(s, 0), torch.zeros(s, 0), doc_ids_BS=docs)
    params = list(layer.parameters())

    def fwd_bwd() -> tuple[torch.Tensor, ...]:
        for p in (x, *params):
            p.grad = None
        y = layer(x, inputs)
        (y.float() * w).sum().backward()
        return (y.detach(), x.grad, *(p.grad for p in params))

    runs: dict[str, Any] = {}
    for choice in ("auto", "torch"):
        use_recurrent_kernels(choice)
        layer.kernel_choice.first = None
        outs = fwd_bwd()
        runs[choice] = {
            "ran": layer.kernel_choice.first,
            "median_s": statistics.median(timed(fwd_bwd, device, reps=3 if dry else 10)),
            "peak_bytes": peak_memory(device, fwd_bwd),
            "outs": outs,
        }
    use_recurrent_kernels("auto")
    kern, ref = runs["auto"].pop("outs"), runs["torch"].pop("outs")
    res: dict[str, Any] = {"S": s, "documents": 4, **runs}
    res["rel_err_out"] = _rel(kern[0], ref[0])
    res["rel_err_dx"] = _rel(kern[1], ref[1])
    res["rel_err_param_grads"] = max(_rel(a, b) for a, b in zip(kern[2:], ref[2:], strict=True))
    res["speedup"] = runs["torch"]["median_s"] / runs["auto"]["median_s"]
    if runs["auto"]["peak_bytes"]:
        res["memory_ratio"] = runs["auto"]["peak_bytes"] / runs["torch"]["peak_bytes"]
    agree = max(res["rel_err_out"], res["rel_err_dx"], res["rel_err_param_grads"]) <= RTOL_BF16
    expected = layer.kernel_choice.kernels if device.type == "cuda" else "torch (tensors on cpu)"
    res["ok"] = runs["auto"]["ran"] == expected and agree
    return res


def hybrid(
    device: torch.device,
    dtype: torch.dtype,
    dry: bool,
    timed: Callable[..., list[float]],
    peak_memory: Callable[..., int | None],
) -> dict[str, Any]:
    """The section: each recurrent mixer's kernels against its torch path (the docstring)."""
    out: dict[str, Any] = {"rtol": RTOL_BF16}
    for kind in SHAPES:
        try:
            out[kind] = _one(kind, device, dtype, dry, timed, peak_memory)
        except Exception as exc:  # noqa: BLE001 - record the mixer's failure, go on
            out[kind] = {"ok": False, "error": repr(exc)}
    out["ok"] = all(out[k]["ok"] for k in SHAPES)
    return out


def hybrid_summary(r: dict[str, Any]) -> list[str]:
    """The section's summary lines."""
    lines = []
    for kind in SHAPES:
        x = r.get(kind, {})
        if "speedup" in x:
            mem = x.get("memory_ratio")
            lines.append(
                f"hybrid {kind} S={x['S']} fwd+bwd: {x['auto']['ran']} "
                f"{x['auto']['median_s'] * 1e3:.2f} ms vs torch {x['torch']['median_s'] * 1e3:.2f} "
                f"ms ({x['speedup']:.2f}x"
                + (f", memory {mem:.2f}x" if mem else "")
                + f"), rel err out {x['rel_err_out']:.1e} dx {x['rel_err_dx']:.1e} "
                f"grads {x['rel_err_param_grads']:.1e} (tol {r['rtol']:.0e})"
            )
        elif "error" in x:
            lines.append(f"hybrid {kind}: ERROR {x['error']}")
    return lines
