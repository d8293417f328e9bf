"""Rows a block at a time: elementwise math whose wider temporaries (an fp32 copy of bf16
activations) stay a few MiB whatever the number of rows."""

from __future__ import annotations

import torch

BLOCK_ELEMENTS = 1 << 21  # 8 MiB of fp32 per wide temporary of the weighted SwiGLU


def row_blocks(h: torch.Tensor) -> list[slice]:
    """Slices of h's rows (dim 0) of about :data:`BLOCK_ELEMENTS` elements each."""
    per_row = max(1, h[0].numel()) if h.shape[0] else 1
    step = max(1, BLOCK_ELEMENTS // per_row)
    return [slice(i, i + step) for i in range(0, h.shape[0], step)]
