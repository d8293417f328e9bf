"""Decoding through the model's KV cache, for tests that compare it with a full forward."""

from __future__ import annotations

import torch

from moetrain.model import Transformer


def logits_through_cache(
    model: Transformer, ids_BS: torch.Tensor, prefill: int, one_by_one: int
) -> torch.Tensor:
    """(B, S, V) logits of ``ids_BS`` computed through a new KV cache (room for 32 positions):
    a prefill of the first ``prefill`` positions, then ``one_by_one`` single tokens, then the
    rest at once (several new tokens against the cache)."""
    b, s = ids_BS.shape
    cache = model.new_cache(b, 32)
    with torch.no_grad():
        steps = [model(ids_BS[:, :prefill], cache=cache).logits]
        singles = range(prefill, prefill + one_by_one)
        steps += [model(ids_BS[:, i : i + 1], cache=cache).logits for i in singles]
        steps.append(model(ids_BS[:, prefill + one_by_one :], cache=cache).logits)
    return torch.cat(steps, 1)
