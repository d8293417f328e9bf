"""The weight files of a Hugging Face model directory: their names, and the tensors in them
read by name (headers checked first, tensors read only when asked for; block-quantized weights
dequantized to fp32 through their scales, :mod:`moetrain.convert.quantized`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from moetrain.checkpoint.format import CheckpointError
from moetrain.convert.quantized import Quantization, Quantized, dequantize, pair_scales, row_window

HF_INDEX_FILE = "model.safetensors.index.json"
HF_SINGLE_FILE = "model.safetensors"


def safetensors_header(path: Path) -> dict[str, dict]:
    """The tensor table of a safetensors file (name -> dtype, shape, data_offsets), checked
    against the file's size: a missing, truncated or malformed file is a CheckpointError that
    names it. Reads only the header."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: weight file is missing")
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > size - 8:
                raise ValueError(f"header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    if 8 + n + end != size:
        raise CheckpointError(
            f"{path}: truncated or corrupt safetensors file: its header needs {8 + n + end} "
            f"bytes, the file has {size}"
        )
    return header


class HFWeights:
    """Lazy access by name to the tensors of a Hugging Face model directory (one
    ``model.safetensors``, or shards listed in ``model.safetensors.index.json``).

    Opening reads and checks every file's header (missing, truncated or malformed files are
    refused, named); ``shapes`` holds every tensor's shape without reading any tensor.
    ``renames``: a stored name prefix -> the one it stands for (a family's model inside a larger
    one, :class:`~moetrain.convert.families.layout.Wrapper`): only the tensors under those
    prefixes, renamed; ``others`` lists the rest. ``quantization``: the directory's
    ``quantization_config`` (:func:`~moetrain.convert.quantized.quantization_of`): its quantized
    weights are read dequantized, in fp32, and their scales are not among the names (a float8
    weight, or scales, that it cannot read are refused at opening, named).
    """

    def __init__(
        self,
        hf_dir: str | Path,
        renames: Mapping[str, str] | None = None,
        quantization: Quantization | None = None,
    ) -> None:
        hf_dir = Path(hf_dir)
        index = hf_dir / HF_INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, KeyError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{index}: unreadable index ({e})") from None
        elif (hf_dir / HF_SINGLE_FILE).is_file():
            weight_map = dict.fromkeys(safetensors_header(hf_dir / HF_SINGLE_FILE), HF_SINGLE_FILE)
        else:
            raise CheckpointError(f"{hf_dir}: no {HF_SINGLE_FILE} or {HF_INDEX_FILE}")
        self.dir, self._file_of = hf_dir, dict(weight_map)  # (stored name -> file)
        headers: dict[str, tuple[str, str, tuple[int, ...]]] = {}
        for file in sorted(set(weight_map.values())):
            header = safetensors_header(hf_dir / file)
            listed = [n for n, f in weight_map.items() if f == file]
            absent = [n for n in listed if n not in header]
            if absent:
                raise CheckpointError(
                    f"{hf_dir / file}: does not hold {absent[:3]} (listed in {HF_INDEX_FILE})"
                )
            headers.update(
                {n: (file, header[n]["dtype"], tuple(header[n]["shape"])) for n in listed}
            )
        self.quantized: dict[str, Quantized] = pair_scales(headers, quantization, hf_dir)
        scales = {q.scale for q in self.quantized.values()}
        weight_map = {n: f for n, f in weight_map.items() if n not in scales}
        self.shapes = {
            n: self.quantized[n].shape if n in self.quantized else headers[n][2] for n in weight_map
        }
        renames = renames or {"": ""}

        def seen(name: str) -> str | None:
            stored = next((p for p in renames if name.startswith(p)), None)
            return None if stored is None else renames[stored] + name[len(stored) :]

        self.others = sorted(n for n in weight_map if seen(n) is None)
        # name as seen -> name in the files
        self.stored = {seen(n): n for n in weight_map if seen(n) is not None}
        self.weight_map = {n: weight_map[s] for n, s in self.stored.items()}
        self.shapes = {n: self.shapes[s] for n, s in self.stored.items()}

    def names(self) -> list[str]:
        return list(self.weight_map)

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors (quantized ones dequantized), each file opened once; a tensor
        holding NaN or inf is a CheckpointError naming it."""
        stored = [self.stored[n] for n in names]
        scales = [self.quantized[s].scale for s in stored if s in self.quantized]
        raw = self._read(dict.fromkeys(stored + scales, slice(None)))
        return {n: self._finite(n, self._value(s, raw)) for n, s in zip(names, stored, strict=True)}

    def load_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of a tensor's first dimension, reading only those (a
        quantized matrix's: the blocks of rows that hold them, and their scales; checked as
        :meth:`load` checks)."""
        s = self.stored[name]
        q = self.quantized.get(s)
        if q is None:
            return self._finite(name, self._read({s: slice(start, stop)})[s])
        weight, scale, within = row_window(q, start, stop)
        raw = self._read({s: weight, q.scale: scale})
        return self._finite(name, dequantize(raw[s], raw[q.scale], q)[within].contiguous())

    def _read(self, rows: dict[str, slice]) -> dict[str, torch.Tensor]:
        """Stored tensors (name -> the rows of its first dimension to read), each file opened
        once."""
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for n in rows:
            by_file.setdefault(self._file_of[n], []).append(n)
        out = {}
        for file, keys in by_file.items():
            with safe_open(self.dir / file, "pt") as f:
                for k in keys:
                    whole = rows[k] == slice(None)
                    out[k] = f.get_tensor(k) if whole else f.get_slice(k)[rows[k]].contiguous()
        return out

    def _value(self, stored: str, raw: dict[str, torch.Tensor]) -> torch.Tensor:
        q = self.quantized.get(stored)
        return raw[stored] if q is None else dequantize(raw[stored], raw[q.scale], q)

    def _finite(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(
                f"{self.dir / self.weight_map[name]}: tensor {self.stored[name]} holds non-finite "
                "values (NaN or inf); a model cannot start from it"
            )
        return t
