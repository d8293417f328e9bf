"""Parity models with no constant tensor left: whatever a model initialises to one value (norm
weights at 1; biases, selection biases, sinks and a zero-initialised router at 0) is drawn at
random around that value before it is saved or compared, so that an import or export that drops,
swaps or misplaces such a tensor changes the logits (a constant one would not).

Used on both sides of every conversion test: transformers' models (``tests/helpers/hf_models.py``,
``tests/unit/test_released_configs.py``) and moetrain's (``tests/helpers/convert_models.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

ZERO_SPREAD = 0.2  # a zero constant becomes U(-0.2, 0.2); a constant c, c * U(0.5, 1.5)


def constant_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The floating-point tensors of ``module``'s state dict (parameters and saved buffers)
    whose elements are all equal, by name (a tied tensor once); a one-element tensor when it
    is 0 or 1."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in module.state_dict(keep_vars=True).items():
        if not t.is_floating_point() or t.numel() == 0 or id(t) in seen:
            continue
        seen.add(id(t))
        flat = t.detach().reshape(-1)
        if flat.numel() == 1:  # (a scalar: constant while it holds an initialiser's 0 or 1)
            constant = float(flat[0]) in (0.0, 1.0)
        else:
            constant = bool((flat == flat[0]).all())
        if constant:
            out[name] = t
    return out


@torch.no_grad()
def randomise_constants(
    module: nn.Module, seed: int = 0, keep: Callable[[str], bool] = lambda _: False
) -> list[str]:
    """Draw every constant tensor of ``module`` (:func:`constant_tensors`, but those ``keep``
    names) at random around its value: ``c * U(0.5, 1.5)``, or ``U(-0.2, 0.2)`` for 0.
    Returns the names drawn."""
    gen = torch.Generator().manual_seed(seed)
    drawn = []
    for name, t in constant_tensors(module).items():
        if keep(name):
            continue
        c = float(t.reshape(-1)[0])
        u = torch.rand(t.shape, generator=gen, dtype=torch.float32)  # U(0, 1)
        values = (u * 2 - 1) * ZERO_SPREAD if c == 0 else c * (u + 0.5)
        t.copy_(values.to(t.dtype))
        drawn.append(name)
    return drawn
