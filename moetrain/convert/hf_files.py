"""The weight files of a Hugging Face model directory: their names, and the tensors in them
read by name (headers checked first, tensors read only when asked for)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from moetrain.checkpoint.format import CheckpointError

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
    prefixes, renamed; ``others`` lists the rest.
    """

    def __init__(self, hf_dir: str | Path, renames: Mapping[str, str] | None = None) -> None:
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
        self.dir, self.weight_map = hf_dir, weight_map
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(weight_map.values())):
            header = safetensors_header(hf_dir / file)
            listed = [n for n, f in weight_map.items() if f == file]
            absent = [n for n in listed if n not in header]
            if absent:
                raise CheckpointError(
                    f"{hf_dir / file}: does not hold {absent[:3]} (listed in {HF_INDEX_FILE})"
                )
            self.shapes.update({n: tuple(header[n]["shape"]) for n in listed})
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
        """The named tensors, each file opened once; a tensor holding NaN or inf is a
        CheckpointError naming it."""
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.weight_map[n], []).append(n)
        out = {}
        for file, keys in by_file.items():
            with safe_open(self.dir / file, "pt") as f:
                out.update({k: self._finite(k, f.get_tensor(self.stored[k])) for k in keys})
        return out

    def load_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of a tensor's first dimension, reading only those (checked
        as :meth:`load` checks)."""
        from safetensors import safe_open

        with safe_open(self.dir / self.weight_map[name], "pt") as f:
            return self._finite(name, f.get_slice(self.stored[name])[start:stop].contiguous())

    def _finite(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(
                f"{self.dir / self.weight_map[name]}: tensor {self.stored[name]} holds non-finite "
                "values (NaN or inf); a model cannot start from it"
            )
        return t
