"""Which kernels the recurrent mixers run: the CUDA kernels of optional packages (fla's gated
delta rule and Kimi Delta Attention, causal-conv1d's short convolution, mamba-ssm's chunked
scan) or moetrain's own torch code, and the record of that choice.

``train.recurrent_kernels`` (set once per process with :func:`use_recurrent_kernels`):

- ``auto`` (default): a call runs the CUDA kernels when its tensors are on a CUDA device, the
  packages import (at least the versions this code was written against) and the call's
  features are ones the kernels take (each mixer's kernel module says which); the torch path
  otherwise.
- ``torch``: the torch path always.
- ``cuda``: the CUDA kernels always; a call that cannot run them is an error that says why.

Each recurrent mixer holds a :class:`KernelChoice` and records what its first call ran and why
(``"fla chunk_gated_delta_rule + causal_conv1d"``, ``"torch (tensors on cpu)"``);
:func:`recurrent_report` is the one line the training log prints, as it does for the
attention kernels. The packages are imported only when a call's tensors are on CUDA.
"""

from __future__ import annotations

import importlib
import re
import warnings
from types import ModuleType
from typing import Literal

import torch
from torch import nn

Choice = Literal["auto", "torch", "cuda"]
CHOICES: tuple[str, ...] = ("auto", "torch", "cuda")
KEY = "train.recurrent_kernels"
INSTALL = "pip install 'moetrain[kernels]'"

MIN_VERSIONS = {  # the releases whose documented API the kernel modules call
    "fla": (0, 6, 0),
    "causal_conv1d": (1, 4, 0),
    "mamba_ssm": (2, 2, 0),
}
DISTRIBUTIONS = {"fla": "fla-core", "causal_conv1d": "causal-conv1d", "mamba_ssm": "mamba-ssm"}

_choice: str = "auto"
_imported: dict[str, tuple[ModuleType | None, str | None]] = {}


def use_recurrent_kernels(choice: str) -> None:
    """Set the recurrent mixers' kernel choice for this process (``train.recurrent_kernels``);
    ``cuda`` on a machine without a CUDA device is refused here, before anything runs."""
    global _choice
    if choice not in CHOICES:
        raise ValueError(f"{KEY} must be one of {list(CHOICES)}; got {choice!r}")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{KEY} = cuda needs a CUDA device; this machine has none (use auto or torch)"
        )
    _choice = choice


def recurrent_kernels_choice() -> str:
    """The choice set by :func:`use_recurrent_kernels` (``auto`` unless set)."""
    return _choice


def _version(text: str) -> tuple[int, ...]:
    """The leading numbers of a version string: ``"2.2.4.post1"`` -> (2, 2, 4)."""
    parts = []
    for piece in text.split(".")[:3]:
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


def load_package(name: str) -> tuple[ModuleType | None, str | None]:
    """``(module, None)`` for an importable package at least ``MIN_VERSIONS[name]``, else
    ``(None, why)``; cached per process."""
    if name not in _imported:
        _imported[name] = _import(name)
    return _imported[name]


def _import(name: str) -> tuple[ModuleType | None, str | None]:
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        return None, f"{name} does not import ({exc}; {INSTALL})"
    except Exception as exc:  # noqa: BLE001 - a broken CUDA build raises anything at import
        return None, f"{name} fails to import ({type(exc).__name__}: {exc})"
    have = getattr(module, "__version__", None)
    if have is None:
        from importlib import metadata

        try:
            have = metadata.version(DISTRIBUTIONS[name])
        except metadata.PackageNotFoundError:
            have = "0"
    need = MIN_VERSIONS[name]
    if _version(str(have)) < need:
        wanted = ".".join(map(str, need))
        return None, f"{name} {have} is older than {wanted}, the API this code calls"
    return module, None


class KernelChoice:
    """One recurrent mixer's choice between ``kernels`` (e.g. ``"fla chunk_gated_delta_rule +
    causal_conv1d"``, from ``packages``) and its torch path, with the record of its first
    call (``first``)."""

    def __init__(self, kernels: str, packages: tuple[str, ...]) -> None:
        self.kernels = kernels
        self.packages = packages
        self.first: str | None = None

    def why_not(self, x: torch.Tensor, unsupported: str | None) -> str | None:
        """Why a call with tensors like ``x`` (and ``unsupported``: the call's feature the
        kernels do not take, if any) runs the torch path; None: it runs the kernels."""
        if _choice == "torch":
            return f"{KEY} = torch"
        if not x.is_cuda:
            return f"tensors on {x.device.type}"
        for name in self.packages:
            _, why = load_package(name)
            if why is not None:
                return why
        return unsupported

    def use_kernels(self, x: torch.Tensor, unsupported: str | None = None) -> bool:
        """Whether this call runs the CUDA kernels; records the first call's choice, refuses
        a call that cannot run them under ``cuda``, warns once on a CUDA call that falls back
        to torch."""
        why = self.why_not(x, unsupported)
        if why is not None and _choice == "cuda":
            raise ValueError(f"{KEY} = cuda, but {self.kernels} cannot run this call: {why}")
        if self.first is None:
            self.first = self.kernels if why is None else f"torch ({why})"
            if why is not None and x.is_cuda and _choice == "auto":
                warnings.warn(
                    f"a recurrent mixer runs its torch path on {x.device}: {why}", stacklevel=3
                )
        return why is None


def recurrent_report(model: nn.Module) -> str | None:
    """One line on the kernels the model's recurrent mixers ran on their first call (None
    before any call or without such mixers), e.g. ``gated_deltanet: fla chunk_gated_delta_rule
    + causal_conv1d``."""
    seen = []
    for m in model.modules():
        choice = getattr(m, "kernel_choice", None)
        if isinstance(choice, KernelChoice) and choice.first is not None:
            seen.append(f"{getattr(m, 'kind', type(m).__name__)}: {choice.first}")
    return ", ".join(dict.fromkeys(seen)) if seen else None


def sequence_index(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, S) int32 document number within each row (0 for the row's first document) from
    ``doc_ids`` (B, S) (equal neighbouring ids are one document): the ``seq_idx`` of
    causal-conv1d and mamba-ssm."""
    starts = torch.zeros_like(doc_ids, dtype=torch.int32)
    starts[:, 1:] = (doc_ids[:, 1:] != doc_ids[:, :-1]).to(torch.int32)
    return starts.cumsum(1, dtype=torch.int32).contiguous()
