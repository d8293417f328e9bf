"""What autograd keeps for backward: the distinct storages saved during a forward."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch


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
