"""What autograd keeps for backward (the distinct storages saved during a forward) and the
largest tensor a computation creates."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@contextmanager
def saved_storages(owned: Iterable[torch.Tensor] = ()) -> Iterator[dict[int, int]]:
    """Inside the context, every storage autograd saves for backward is recorded (data pointer
    -> bytes), each once, except the storages of ``owned`` tensors (parameters, buffers)."""
    skip = {t.untyped_storage().data_ptr() for t in owned}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


class LargestTensor(TorchDispatchMode):
    """Inside the context, the largest tensor any operator returns (forward and backward):
    ``numel`` its element count, ``op`` and ``shape`` where it came from."""

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.op, self.shape = 0, "", ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op, self.shape = t.numel(), str(func), tuple(t.shape)
        return out
