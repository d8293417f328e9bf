"""How many multi-token-prediction layers a family's files hold: :func:`stored_mtp_depth`."""

from __future__ import annotations

from collections.abc import Iterable

from moetrain.checkpoint.format import CheckpointError
from moetrain.convert.families.layout import Layout


def stored_mtp_depth(layout: Layout, names: Iterable[str], n_layers: int, declared: int) -> int:
    """How many of the ``declared`` multi-token-prediction layers after ``n_layers`` decoder
    layers the tensor ``names`` hold (transformers' own saves have none); a layer holding
    tensors but not its projection is a CheckpointError naming the missing tensor."""
    if layout.mtp is None:
        return 0
    have, depth, mtp = set(names), 0, layout.mtp
    while depth < declared and (
        f"{mtp.own_prefix(n_layers, n_layers + depth)}{mtp.eh_proj}.weight" in have
    ):
        depth += 1
    prefix = f"model.layers.{n_layers + depth}."
    partial = sorted(n for n in have if n.startswith(prefix))
    if depth < declared and partial:  # a layer without its projection: not a module
        raise CheckpointError(
            f"tensor {prefix}{layout.mtp.eh_proj}.weight is missing: multi-token-prediction "
            f"layer {n_layers + depth} holds {len(partial)} other tensors ({partial[0]}, ...)"
        )
    return depth
