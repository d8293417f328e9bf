"""The entries of a weight map (:mod:`moetrain.convert.weight_map`): each relates some moetrain
tensors (``ours``) to the Hugging Face tensors that hold them (``theirs``) and converts between
the two, one class per transform: a rename, a selection bias stored as a row, tensors joined
along their first dim, rows regrouped per head, each head's two halves apart, row parts apart, a tensor the files have no place for, and an MoE layer's experts per
expert, fused or stacked.

Expert entries read any range of experts from a :class:`TensorSource` (the safetensors files, or
a state dict in memory), each expert-parallel rank only its own. Shapes: moetrain's ``w13``
(E, D, 2F) = ``[w1 | w3]`` (gate, up; experts that are not gated: (E, D, F), up alone) and
``w2`` (E, F, D); ``nn.Linear`` holds (out, in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from moetrain.config import ConfigError
from moetrain.model import param_names as pn
from moetrain.model.moe.experts import pack_w13, unpack_w13

Shape = tuple[int, ...]
Tensors = list[torch.Tensor]
Into = dict[str, torch.Tensor] | None  # a model's tensors, filled in place where possible


class TensorSource(Protocol):
    """Where a map reads Hugging Face tensors from, by name (:class:`~moetrain.convert.
    hf_files.HFWeights`, or :class:`InMemory`)."""

    def names(self) -> list[str]: ...

    def load(self, names: list[str]) -> dict[str, torch.Tensor]: ...

    def load_rows(self, name: str, start: int, stop: int) -> torch.Tensor: ...


class InMemory:
    """A state dict as a :class:`TensorSource`."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        missing = [n for n in names if n not in self.tensors]
        if missing:
            raise KeyError(f"the state dict has no {missing[0]!r}")
        return {n: self.tensors[n] for n in names}

    def load_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.tensors[name][start:stop]


@dataclass(frozen=True)
class Entry:
    """``ours`` <-> ``theirs``, one tensor each, the same values and shape (a rename)."""

    ours: tuple[str, ...]
    theirs: tuple[str, ...]
    keep_fp32 = False  # written in fp32 whatever the export's dtype
    keep_int64 = False  # an integer table, written as int64

    def to_hf(self, tensors: Tensors) -> Tensors:
        return tensors

    def from_hf(self, tensors: Tensors) -> Tensors:
        return tensors

    def hf_shapes(self, shapes: list[Shape]) -> list[Shape]:
        return shapes


@dataclass(frozen=True)
class IntegerTable(Entry):
    """An integer buffer (hash routing's token -> experts table), written as int64 whatever
    the export's dtype."""

    keep_int64 = True


@dataclass(frozen=True)
class SelectionBias(Entry):
    """The router's selection bias (E,), in fp32, stored as one row (1, E) where ``row``
    (ERNIE's)."""

    row: bool = False
    keep_fp32 = True

    def to_hf(self, tensors: Tensors) -> Tensors:
        return [tensors[0].reshape(1, -1)] if self.row else tensors

    def from_hf(self, tensors: Tensors) -> Tensors:
        return [tensors[0].float().reshape(-1)]

    def hf_shapes(self, shapes: list[Shape]) -> list[Shape]:
        return [(1, *shapes[0])] if self.row else shapes


@dataclass(frozen=True)
class Joined(Entry):
    """``ours`` joined along their first dim in one tensor (Granite-MoE-Shared's shared expert:
    [gate; up])."""

    def to_hf(self, tensors: Tensors) -> Tensors:
        return [torch.cat(tensors, dim=0)]

    def from_hf(self, tensors: Tensors) -> Tensors:
        return list(tensors[0].chunk(len(self.ours), dim=0))

    def hf_shapes(self, shapes: list[Shape]) -> list[Shape]:
        return [(sum(s[0] for s in shapes), *shapes[0][1:])]


@dataclass(frozen=True)
class RowParts(Entry):
    """One moetrain tensor whose rows the files hold as parts of ``sizes`` rows, one tensor
    each (Olmo-Hybrid's ``q_proj``, ``k_proj``, ``v_proj`` of Gated DeltaNet's
    ``in_proj_qkv``)."""

    sizes: tuple[int, ...] = ()

    def to_hf(self, tensors: Tensors) -> Tensors:
        return list(tensors[0].split(list(self.sizes)))

    def from_hf(self, tensors: Tensors) -> Tensors:
        return [torch.cat(tensors)]

    def hf_shapes(self, shapes: list[Shape]) -> list[Shape]:
        return [(n, *shapes[0][1:]) for n in self.sizes]


@dataclass(frozen=True)
class HeadHalves(Entry):
    """One moetrain tensor (rows, ...) holding per head two halves of rows, ``[a | b]`` (the
    gated query projection: each head's query, then its gate) <-> two tensors of the files, the
    a rows and the b rows, heads in order (Trinity's ``q_proj`` and ``gate_proj``)."""

    heads: int = 1

    def to_hf(self, tensors: Tensors) -> Tensors:
        t = tensors[0]
        halves = t.reshape(self.heads, 2, -1, *t.shape[1:]).unbind(1)
        return [h.reshape(-1, *t.shape[1:]) for h in halves]

    def from_hf(self, tensors: Tensors) -> Tensors:
        a, b = (t.reshape(self.heads, -1, *t.shape[1:]) for t in tensors)
        return [torch.stack((a, b), dim=1).reshape(-1, *a.shape[2:])]

    def hf_shapes(self, shapes: list[Shape]) -> list[Shape]:
        rows, *rest = shapes[0]
        return [(rows // 2, *rest)] * 2


@dataclass(frozen=True)
class Column(Entry):
    """A vector (n,) stored as (1, 1, n, 1) (Kimi Linear's per-head ``A_log``)."""

    def to_hf(self, tensors: Tensors) -> Tensors:
        return [tensors[0].reshape(1, 1, -1, 1)]

    def from_hf(self, tensors: Tensors) -> Tensors:
        return [tensors[0].reshape(-1)]

    def hf_shapes(self, shapes: list[Shape]) -> list[Shape]:
        return [(1, 1, *shapes[0], 1)]


@dataclass(frozen=True)
class GroupedRows(Entry):
    """``ours`` (each (rows, in)) cut into row parts, every part into ``groups`` equal slices,
    stored as one tensor of group 0's slices of every part in order, then group 1's, ...
    (Qwen3-Next's ``in_proj_qkvz``: per query/key head its q, k, v and z rows; ``in_proj_ba``:
    its b and a rows). ``parts``: each of ``ours``' row parts."""

    groups: int = 1
    parts: tuple[tuple[int, ...], ...] = ()

    def _slices(self) -> list[int]:
        return [n // self.groups for sizes in self.parts for n in sizes]

    def to_hf(self, tensors: Tensors) -> Tensors:
        pieces = [
            part.reshape(self.groups, -1, *t.shape[1:])
            for t, sizes in zip(tensors, self.parts, strict=True)
            for part in t.split(list(sizes))
        ]
        joined = torch.cat(pieces, dim=1)
        return [joined.reshape(-1, *joined.shape[2:])]

    def from_hf(self, tensors: Tensors) -> Tensors:
        grouped = tensors[0].reshape(self.groups, -1, *tensors[0].shape[1:])
        pieces = iter(grouped.split(self._slices(), dim=1))
        out = []
        for sizes in self.parts:
            parts = [next(pieces).reshape(n, *grouped.shape[2:]) for n in sizes]
            out.append(torch.cat(parts))
        return out

    def hf_shapes(self, shapes: list[Shape]) -> list[Shape]:
        return [(sum(s[0] for s in shapes), *shapes[0][1:])]


@dataclass(frozen=True)
class NoSelectionBias(Entry):
    """A selection bias the files have no place for (``theirs`` is empty): written only when
    zero (it would change which experts are picked), read as zeros."""

    fmt: str = ""
    num_experts: int = 0

    def to_hf(self, tensors: Tensors) -> Tensors:
        if bool(tensors[0].ne(0).any()):
            raise ConfigError(
                f"{self.ours[0]}: non-zero expert bias cannot be represented in {self.fmt} (it "
                "changes which experts are selected)"
            )
        return []

    def from_hf(self, tensors: Tensors) -> Tensors:
        return [torch.zeros(self.num_experts)]

    def hf_shapes(self, shapes: list[Shape]) -> list[Shape]:
        return []


@dataclass(frozen=True)
class UnusedSelectionBias(NoSelectionBias):
    """A hash-routed layer's selection bias (``moe.hash_layers``): its routing never reads it,
    so it is not written (whatever it holds) and reads as zeros."""

    def to_hf(self, tensors: Tensors) -> Tensors:
        return []


@dataclass(frozen=True)
class Experts(Entry):
    """An MoE layer's experts: ``ours`` its stacked tensors (w13, w2, and their biases),
    ``theirs`` the files' tensors. ``read`` takes experts ``[start, stop)`` only."""

    num_experts: int = 0

    @property
    def layer(self) -> int:
        """The MoE layer these experts are of."""
        return pn.parse_experts(self.ours[0])[0]

    def read(self, source: TensorSource, start: int, stop: int, into: Into = None) -> Tensors:
        """``ours`` for experts ``[start, stop)``; ``into``: tensors of ``ours``' names to fill
        in place where the layout allows it (a model's parameters)."""
        raise NotImplementedError

    def from_hf(self, tensors: Tensors) -> Tensors:
        return self.read(
            InMemory(dict(zip(self.theirs, tensors, strict=True))), 0, self.num_experts
        )


@dataclass(frozen=True)
class PerExpertFiles(Experts):
    """One tensor per expert and projection, ``theirs`` = gate, up, down of expert 0, then of
    expert 1, ..., each (out, in); experts that are not ``gated``: up, down."""

    gated: bool = True

    @property
    def _per_expert(self) -> int:
        return 3 if self.gated else 2

    def to_hf(self, tensors: Tensors) -> Tensors:
        w13, w2 = tensors[:2]
        parts = (*unpack_w13(w13), w2) if self.gated else (w13, w2)
        return [w[e].t() for e in range(self.num_experts) for w in parts]

    def hf_shapes(self, shapes: list[Shape]) -> list[Shape]:
        (_, d, width), (_, f, _) = shapes
        return ([(f, d)] * (width // f) + [(d, f)]) * self.num_experts

    def read(self, source: TensorSource, start: int, stop: int, into: Into = None) -> Tensors:
        k = self._per_expert
        names = self.theirs[k * start : k * stop]
        t = source.load(list(names))
        first = t[names[0]]
        (f, d), n = first.shape, stop - start
        into = into or {}
        w13 = into.get(self.ours[0], torch.empty(n, d, (k - 1) * f, dtype=first.dtype))
        w2 = into.get(self.ours[1], torch.empty(n, f, d, dtype=first.dtype))
        with torch.no_grad():  # each expert transposed straight into place
            for i in range(n):
                *ins, dn = (t.pop(names[k * i + j]) for j in range(k))
                for j, w in enumerate(ins):  # gate then up (or up alone)
                    w13[i, :, j * f : (j + 1) * f].copy_(w.t().contiguous())
                w2[i].copy_(dn.t().contiguous())
        return [w13, w2]


def cat_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """moetrain's ``w13`` (E, D, 2F) -> the fused gate_up (E, 2F, D) = [gate; up]."""
    w1, w3 = unpack_w13(w13)
    return torch.cat([w1.mT, w3.mT], dim=1)


@dataclass(frozen=True)
class FusedFiles(Experts):
    """Two tensors, ``nn.Linear``'s orientation: gate_up (E, 2F, D) = [gate; up] (not
    ``gated``: up (E, F, D)), down (E, D, F)."""

    gated: bool = True

    def to_hf(self, tensors: Tensors) -> Tensors:
        w13, w2 = tensors
        return [cat_gate_up(w13) if self.gated else w13.mT, w2.mT]

    def hf_shapes(self, shapes: list[Shape]) -> list[Shape]:
        (e, d, width), (_, f, _) = shapes
        return [(e, width, d), (e, d, f)]

    def read(self, source: TensorSource, start: int, stop: int, into: Into = None) -> Tensors:
        gate_up = source.load_rows(self.theirs[0], start, stop)  # (L, 2F, D) or (L, F, D)
        if self.gated:
            f = gate_up.shape[1] // 2
            w13 = pack_w13(gate_up[:, :f].mT, gate_up[:, f:].mT)
        else:
            w13 = gate_up.mT
        w2 = source.load_rows(self.theirs[1], start, stop).transpose(1, 2)
        return [w13.contiguous(), w2.contiguous()]


def interleave(t: torch.Tensor) -> torch.Tensor:
    """``[gate | up]`` along the last dim -> gate and up interleaved, gate the even columns."""
    gate, up = t.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`interleave`."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


@dataclass(frozen=True)
class StackedFiles(Experts):
    """moetrain's own orientation, tensor for tensor (``theirs`` aligned with ``ours``), gate
    and up interleaved where ``interleaved`` (gpt-oss: w13 and its bias)."""

    interleaved: bool = False

    def _gate_up(self, i: int) -> bool:
        return self.interleaved and self.ours[i].endswith(("w13", "w13_bias"))

    def to_hf(self, tensors: Tensors) -> Tensors:
        return [interleave(t) if self._gate_up(i) else t for i, t in enumerate(tensors)]

    def read(self, source: TensorSource, start: int, stop: int, into: Into = None) -> Tensors:
        out = []
        for i, name in enumerate(self.theirs):
            t = source.load_rows(name, start, stop)
            out.append((deinterleave(t) if self._gate_up(i) else t).contiguous())
        return out
