"""DeepSeek's quantized releases written from a transformers save, by the tests: fp8 with one
scale per block (fp32, or powers of two), FP4 experts with a power-of-two scale per 32 columns,
DeepSeek-V4's released names; and the written-out dequantization they are read against."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors import torch as safetensors_torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_CODES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # codes 0-7; 8-15 the same, negative
FP4_GROUP = 32
KEEP = re.compile(r"(embed|lm_head|^head\.|norm|\.gate\.weight|weights_proj|compressor\.w)")
EXPERT = re.compile(r"\.experts\.(\d+)\.")
SCALE = re.compile(r"(_scale_inv|\.scale)$")


def _scale(amax: float, top: float, ue8m0: bool) -> float:
    s = max(amax, 1e-8) / top
    return 2.0 ** math.ceil(math.log2(s)) if ue8m0 else s


def quantize_fp8(w: torch.Tensor, block: tuple[int, int], ue8m0: bool):
    """(float8_e4m3fn weight, fp32 scale per block) of a matrix, block by block."""
    (rows, cols), (br, bc) = w.shape, block
    scale = torch.empty(math.ceil(rows / br), math.ceil(cols / bc))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = w[i * br : (i + 1) * br, j * bc : (j + 1) * bc].float()
            scale[i, j] = _scale(float(part.abs().max()), E4M3_MAX, ue8m0)
            q[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (part / scale[i, j]).to(q.dtype)
    return q, scale


def reference_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The written-out dequantization: every block's fp8 values times its scale."""
    (br, bc), out = block, torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc)
            out[rows, cols] = q[rows, cols].float() * scale[i, j].float()
    return out


def quantize_fp4(w: torch.Tensor):
    """(e2m1 pairs packed in int8, the low nibble first; a power-of-two scale per 32 columns)."""
    rows, cols = w.shape
    scale = torch.empty(rows, cols // FP4_GROUP)
    codes = torch.empty(rows, cols, dtype=torch.uint8)
    table = torch.tensor(E2M1_CODES)
    for r in range(rows):
        for g in range(cols // FP4_GROUP):
            part = w[r, g * FP4_GROUP : (g + 1) * FP4_GROUP].float()
            scale[r, g] = _scale(float(part.abs().max()), E2M1_MAX, True)
            nearest = ((part.abs() / scale[r, g])[:, None] - table).abs().argmin(dim=1)
            codes[r, g * FP4_GROUP : (g + 1) * FP4_GROUP] = nearest + 8 * (part < 0)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), scale


def reference_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, half = packed.shape
    out = torch.empty(rows, 2 * half)
    for r in range(rows):
        for c in range(2 * half):
            byte = int(packed[r, c // 2]) & 0xFF
            code = byte & 0xF if c % 2 == 0 else byte >> 4
            value = E2M1_CODES[code & 7] * (-1.0 if code & 8 else 1.0)
            out[r, c] = value * float(scale[r, c // FP4_GROUP])
    return out


def v4_released_name(name: str) -> str:
    """transformers' save_pretrained name of a DeepSeek-V4 tensor -> DeepSeek's released one."""
    name = name.removeprefix("model.").replace(".attn.norm.", ".attn.kv_norm.")
    if name.startswith("hc_head."):
        return name.replace("hc_head.hc_", "hc_head_")
    return {"embed_tokens.weight": "embed.weight"}.get(name, name)


RELEASES = {  # family -> how DeepSeek releases it
    "deepseek_v3": dict(block=(16, 16), scale_fmt="float"),
    "deepseek_v32": dict(block=(16, 8), scale_fmt="ue8m0"),  # (powers of two, stored fp32)
    "deepseek_v4": dict(block=(16, 16), scale_fmt="ue8m0", fp4=True, released_names=True),
}


def write_release(src: Path, out: Path, family: str) -> dict[str, torch.Tensor]:
    """``src`` (a transformers save) written as ``family``'s quantized release at ``out``: the
    weights in one file, their scales in another; -> the dequantized matrices by ``src`` name
    (the written-out reference)."""
    how = RELEASES[family]
    v4 = how.get("released_names", False)
    rename = v4_released_name if v4 else (lambda n: n)
    weights, scales, reference = {}, {}, {}
    for name, t in safetensors_torch.load_file(src / "model.safetensors").items():
        stored = rename(name)
        if t.dim() != 2 or not name.endswith(".weight") or KEEP.search(name):
            weights[stored] = t
            continue
        if how.get("fp4") and EXPERT.search(name):
            q, s = quantize_fp4(t)
            reference[name] = reference_fp4(q, s)
        else:
            q, s = quantize_fp8(t, how["block"], how["scale_fmt"] == "ue8m0")
            reference[name] = reference_fp8(q, s, how["block"])
        weights[stored] = q
        if v4:  # (e8m0 scales, as DeepSeek-V4 ships them)
            scales[stored.removesuffix("weight") + "scale"] = s.to(torch.float8_e8m0fnu)
        else:
            scales[stored + "_scale_inv"] = s
    if v4:  # the released multi-token-prediction layer, which transformers does not read
        q, s = quantize_fp8(torch.randn(32, 64) * 0.02, how["block"], True)
        weights |= {"mtp.0.e_proj.weight": q, "mtp.0.enorm.weight": torch.ones(32)}
        scales["mtp.0.e_proj.scale"] = s.to(torch.float8_e8m0fnu)
    out.mkdir()
    safetensors_torch.save_file(weights, out / "model-00001-of-00002.safetensors")
    safetensors_torch.save_file(scales, out / "model-00002-of-00002.safetensors")
    index = {n: "model-00001-of-00002.safetensors" for n in weights}
    index |= {n: "model-00002-of-00002.safetensors" for n in scales}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(how["block"]),
        **({"scale_fmt": "ue8m0"} if how["scale_fmt"] == "ue8m0" else {}),
    }
    if v4:
        config |= {"expert_dtype": "fp4", "num_nextn_predict_layers": 1}  # (top level)
    (out / "config.json").write_text(json.dumps(config))
    return reference


def write_dequantized(src: Path, out: Path, reference: dict[str, torch.Tensor]) -> Path:
    """``src`` (a transformers save) with its quantized matrices replaced by their written-out
    dequantization ``reference``, as transformers saves it, at ``out``."""
    shutil.copytree(src, out)
    tensors = safetensors_torch.load_file(src / "model.safetensors")
    safetensors_torch.save_file(tensors | reference, out / "model.safetensors")
    return out
