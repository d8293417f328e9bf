"""Block-quantized weights in a Hugging Face directory, read into fp32 by name.

The one format read is block-scaled fp8 as DeepSeek releases it (DeepSeek-V3 / V3.1 / V3.2, Kimi
K2, DeepSeek-V4, and the fp8 releases of other families in the same format), declared in
``config.json``'s ``quantization_config``: ``{"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128]}``. A matrix ``<m>.weight`` (rows, cols) is stored in
float8_e4m3fn beside its scales ``<m>.weight_scale_inv`` (DeepSeek-V4's files: ``<m>.scale``) of
shape (ceil(rows / 128), ceil(cols / 128)), one per block, the blocks at the right and bottom
edges partial; the weight is ``fp8 * scale`` (whatever the scale's name says). Stacked matrices
(E, rows, cols) have (E, ...) scales. ``scale_fmt: ue8m0`` (DeepSeek-V3.1 on) makes every scale a
power of two, stored in fp32 or as float8_e8m0fnu; ``expert_dtype: fp4`` (DeepSeek-V4-Flash, in
``quantization_config`` or at the top of ``config.json``) stores the routed experts as e2m1
pairs packed in int8 (the low nibble first) with one scale per 32 columns of a row (MXFP4).
Tensors stored without scales (embeddings, norms, routers) are read as they are.

:func:`quantization_of` parses and checks the config; :func:`pair_scales` finds each quantized
weight's scales from the safetensors headers alone (a missing or mis-shaped scale is refused,
naming the tensor and its file, before a tensor is read); :func:`dequantize` gives the fp32
weight. :class:`~moetrain.convert.hf_files.HFWeights` hides the scales from a directory's names
and reads every quantized weight through them, so every reader (``moetrain import``,
``checkpoint.init_from`` with each expert-parallel rank reading only its experts, the ZeRO-3
unit reads) takes dequantized weights. Exports are written in the training dtype, unquantized.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moetrain.checkpoint.format import CheckpointError
from moetrain.config import ConfigError

FP8, FP4 = "fp8", "fp4"
KEY = "quantization_config"
FP8_DTYPE = "F8_E4M3"  # safetensors' name of float8_e4m3fn
FP4_DTYPES = ("I8", "U8")  # e2m1 pairs packed in a byte
E8M0_BYTES = "U8"  # a ue8m0 scale stored as its exponent byte
SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")
FP4_BLOCK = (1, 32)  # MXFP4: one scale per 32 columns of a row
# e2m1's sixteen values by code (sign bit 8)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# the keys of quantization_config it reads or that do not change the weights' values
KNOWN_KEYS = frozenset(
    (
        "quant_method",
        "fmt",
        "activation_scheme",
        "weight_block_size",
        "scale_fmt",
        "expert_dtype",
        "modules_to_not_convert",
        "ignored_layers",
        "modules_to_convert",
        "dequantize",
    )
)


@dataclass(frozen=True)
class Quantization:
    """A directory's ``quantization_config``: the fp8 block (rows, cols), how scales are
    stored (``float``, or ``ue8m0`` powers of two) and the routed experts' format."""

    block: tuple[int, int]
    scale_fmt: str = "float"
    expert_dtype: str = FP8

    def describe(self) -> str:
        """In words, e.g. ``fp8 in blocks of 128x128 (ue8m0 scales), FP4 experts``."""
        scales = " (ue8m0 scales)" if self.scale_fmt == "ue8m0" else ""
        experts = ", FP4 experts" if self.expert_dtype == FP4 else ""
        return f"fp8 in blocks of {self.block[0]}x{self.block[1]}{scales}{experts}"


def _choice(raw: Mapping[str, Any], key: str, default: str, allowed: tuple[str, ...]) -> str:
    value = raw.get(key, default)
    if value not in allowed:
        raise ConfigError(f"{KEY}.{key}: moetrain reads {' or '.join(allowed)}; got {value!r}")
    return value


def quantization_of(
    hf: Mapping[str, Any], inner: Mapping[str, Any] | None = None
) -> Quantization | None:
    """The ``quantization_config`` of a ``config.json`` dict (or of its family's own config
    ``inner`` inside a wrapper), checked; None when it has none. ConfigError naming the key
    (``quantization_config.<key>``) of a format moetrain does not read."""
    inner = inner or {}
    raw = hf.get(KEY) or inner.get(KEY)
    if not raw:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{KEY}: must be a mapping; got {raw!r}")
    method = raw.get("quant_method")
    if method != FP8:
        raise ConfigError(
            f"{KEY}.quant_method: moetrain reads 'fp8' (block-scaled float8_e4m3fn weights with "
            f"their scales); got {method!r}: dequantize the model to bf16 or fp32 first"
        )
    unknown = sorted(set(raw) - KNOWN_KEYS)
    if unknown:
        raise ConfigError(
            f"{KEY}.{unknown[0]}: not a setting of the fp8 format moetrain reads "
            f"(it knows {sorted(KNOWN_KEYS)})"
        )
    _choice(raw, "fmt", "e4m3", ("e4m3", "float8_e4m3fn"))
    _choice(raw, "activation_scheme", "dynamic", ("dynamic",))
    block = raw.get("weight_block_size")
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ConfigError(
            f"{KEY}.weight_block_size: block-scaled weights need [rows, cols] of positive "
            f"integers (one scale per block); got {block!r}"
        )
    scale_fmt = _choice(raw, "scale_fmt", "float", ("float", "ue8m0"))
    top = hf.get("expert_dtype", inner.get("expert_dtype"))
    experts = raw if "expert_dtype" in raw or top is None else {"expert_dtype": top}
    expert_dtype = _choice(experts, "expert_dtype", FP8, (FP8, FP4))
    return Quantization((block[0], block[1]), scale_fmt, expert_dtype)


@dataclass(frozen=True)
class Quantized:
    """A quantized weight of a directory: its scales' stored name, its format (``fp8`` or
    ``fp4``), its dequantized shape and the block each scale covers."""

    scale: str
    kind: str
    shape: tuple[int, ...]
    block: tuple[int, int]


def scale_names(name: str) -> tuple[str, ...]:
    """Where a weight's scales may be stored: ``<name>_scale_inv``, or DeepSeek-V4's
    ``<m>.scale`` for ``<m>.weight``."""
    if name.endswith(".weight"):
        return (f"{name}_scale_inv", name.removesuffix("weight") + "scale")
    return (f"{name}_scale_inv",)


def _blocks(n: int, size: int) -> int:
    return -(-n // size)


Header = tuple[str, str, tuple[int, ...]]  # (file, dtype, shape)


def pair_scales(
    headers: Mapping[str, Header], quant: Quantization | None, where: Path
) -> dict[str, Quantized]:
    """Every quantized weight of a directory (stored name -> :class:`Quantized`), from its
    tensors' ``headers`` (stored name -> file, safetensors dtype, shape). CheckpointError naming
    the tensor and its file (under ``where``): a float8 weight without its scales, or scales
    of the wrong shape or dtype, or without their weight; a float8 or scaled int8 tensor that
    ``quant`` (the directory's ``quantization_config``) does not declare."""
    out: dict[str, Quantized] = {}
    for name, (file, dtype, shape) in headers.items():
        scale = next((s for s in scale_names(name) if s in headers), None)
        packed = dtype in FP4_DTYPES and scale is not None
        if not (dtype.startswith("F8_") and dtype != "F8_E8M0") and not packed:
            continue
        here = f"{where / file}: tensor {name}"
        if quant is None:
            raise CheckpointError(
                f"{here} is {dtype} but config.json declares no {KEY}; a quantized weight "
                "cannot be read without it"
            )
        if packed and quant.expert_dtype != FP4:
            raise CheckpointError(
                f"{here} is {dtype} beside scales {scale}: FP4-packed experts, but "
                f"{KEY}.expert_dtype is {quant.expert_dtype!r} (fp4 reads them)"
            )
        if dtype != FP8_DTYPE and not packed:
            raise CheckpointError(f"{here} is {dtype}; {KEY} declares float8_e4m3fn ({FP8_DTYPE})")
        if scale is None:
            raise CheckpointError(
                f"{here} is float8_e4m3fn without its scales ({' or '.join(scale_names(name))})"
            )
        out[name] = _checked(name, shape, headers[scale], scale, packed, quant, where)
    paired = {q.scale for q in out.values()}
    for name, (file, _, _) in headers.items():
        if name.endswith("_scale_inv") and name not in paired:
            raise CheckpointError(
                f"{where / file}: tensor {name} holds scales, but no float8 weight "
                f"{name.removesuffix('_scale_inv')} is stored beside it"
            )
    return out


def _checked(
    name: str,
    shape: tuple[int, ...],
    scale_header: Header,
    scale: str,
    packed: bool,
    quant: Quantization,
    where: Path,
) -> Quantized:
    """The :class:`Quantized` of weight ``name`` with its scales checked (dtype and shape)."""
    file, dtype, got = scale_header
    here = f"{where / file}: scales {scale} of {name}"
    allowed = SCALE_DTYPES + ((E8M0_BYTES,) if quant.scale_fmt == "ue8m0" else ())
    if dtype not in allowed:
        raise CheckpointError(f"{here} are {dtype}; scales are one of {list(allowed)}")
    if len(shape) < 2:
        raise CheckpointError(f"{where / file}: tensor {name} is quantized but not a matrix")
    *lead, rows, cols = shape
    if packed:
        cols *= 2  # (two e2m1 values a byte)
    block = FP4_BLOCK if packed else quant.block
    if packed and cols % FP4_BLOCK[1]:
        raise CheckpointError(
            f"{where / file}: tensor {name} packs {cols} fp4 columns, not a multiple of "
            f"{FP4_BLOCK[1]} (one scale per {FP4_BLOCK[1]})"
        )
    want = (*lead, _blocks(rows, block[0]), _blocks(cols, block[1]))
    if tuple(got) != want:
        raise CheckpointError(
            f"{here} have shape {list(got)}; {name} {[*lead, rows, cols]} in blocks of "
            f"{block[0]}x{block[1]} needs {list(want)}"
        )
    return Quantized(scale, FP4 if packed else FP8, (*lead, rows, cols), block)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """e2m1 pairs packed in bytes (the low nibble first) -> fp32, twice as many columns."""
    table = torch.tensor(E2M1, dtype=torch.float32)
    codes = packed.view(torch.uint8).long()
    pairs = torch.stack((table[codes & 0xF], table[codes >> 4]), dim=-1)
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize(weight: torch.Tensor, scale: torch.Tensor, q: Quantized) -> torch.Tensor:
    """The fp32 weight of a stored quantized ``weight`` and its ``scale`` (any leading rows
    of both, whole blocks of rows): each block's values times its scale."""
    values = unpack_fp4(weight) if q.kind == FP4 else weight.float()
    if scale.dtype == torch.uint8:  # a ue8m0 exponent byte
        scale = torch.exp2(scale.float() - 127.0)
    rows, cols = values.shape[-2:]
    grid = scale.float().repeat_interleave(q.block[0], dim=-2)[..., :rows, :]
    return values * grid.repeat_interleave(q.block[1], dim=-1)[..., :cols]


def row_window(q: Quantized, start: int, stop: int) -> tuple[slice, slice, slice]:
    """Rows ``[start, stop)`` of a quantized tensor's first dimension: the stored rows of the
    weight and of its scales to read, and those rows within the dequantized window (a matrix's
    rows are read in whole blocks; stacked matrices' first dimension is not blocked)."""
    if len(q.shape) > 2:
        return slice(start, stop), slice(start, stop), slice(None)
    size = q.block[0]
    first, last = start // size, _blocks(stop, size)
    weight = slice(first * size, min(last * size, q.shape[0]))
    return weight, slice(first, last), slice(start - first * size, stop - first * size)
