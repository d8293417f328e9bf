"""Count the operations that make the host wait for the device, on any device.

On CUDA these ops block the CPU until the GPU has caught up (a host sync): the host stops
queueing work, and under expert parallelism every rank waits for its slowest kernel. On CPU
nothing waits, but the same ops run, so counting them proves on a CPU-only machine where the
CUDA run would sync. Counted (each call once, whatever it costs on CUDA):

- ``aten._local_scalar_dense``: ``item()``, ``bool()``, ``int()``, ``float()`` of a tensor;
- ops whose output size depends on the data: ``nonzero``, ``masked_select``, ``unique`` and
  friends, indexing with a boolean mask, ``repeat_interleave`` without ``output_size``;
- ``bincount`` (CUDA reads the minimum and maximum on the host: two syncs per call);
- ``equal`` (returns a Python bool);
- ``Tensor.tolist()``, which bypasses the dispatcher and is patched while counting.

Nested calls inside another op's kernel are not seen (a dispatch mode sees what Python calls).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ALWAYS = {
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "bincount",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
    "equal",
}


def _has_bool_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def syncs_on_cuda(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether aten op ``name`` (``func.name()`` without namespace and overload) called with
    these arguments makes the host wait for a CUDA device."""
    if name in _ALWAYS:
        return True
    if name == "repeat_interleave":
        return isinstance(args[0], torch.Tensor) and kwargs.get("output_size") is None
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        return _has_bool_index(args)
    return False


class HostSyncCounter(TorchDispatchMode):
    """``with HostSyncCounter() as c: ...``; then ``c.total`` and ``c.counts`` (op -> calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._tolist: Any = None

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> HostSyncCounter:
        original = torch.Tensor.tolist
        counts = self.counts

        def tolist(t: torch.Tensor) -> Any:
            counts["tolist"] += 1
            return original(t)

        self._tolist = original
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = func.name().split("::")[-1].split(".")[0]
        if syncs_on_cuda(name, args, kwargs):
            self.counts[name] += 1
        return func(*args, **kwargs)
