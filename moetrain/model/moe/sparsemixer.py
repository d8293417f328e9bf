"""SparseMixer-v2's top-2 selection (Phi-3.5-MoE's ``sparsemixer``; Liu et al. 2024, "GRIN:
GRadient-INformed MoE"), in its deterministic form.

Shape legend: T tokens, E experts.

For each token, with logits ``z`` (fp32):

1. the first expert is ``i1 = argmax z``; its weight is the softmax, at ``i1``, of ``z`` with
   every logit far from ``z[i1]`` masked to -inf, where far means
   ``(z[i1] - z_j) / max(|z_j|, z[i1]) > 2 * eps``;
2. the second expert is ``i2 = argmax`` of ``z`` with ``z[i1]`` set to -inf; its weight is the
   softmax, at ``i2``, of that ``z`` with every logit far from ``z[i2]`` masked (the same rule,
   ``z[i2]`` in place of ``z[i1]``).

The weights are not renormalised. This is exactly what transformers' ``PhimoeForCausalLM``
computes in eval mode (its inference), op for op. In training mode transformers instead samples
each expert with Gumbel noise from the masked logits and multiplies the weight by 1 or 1/3 on a
coin (the Heun's-method midpoint of the paper), with a custom backward
(``PhimoeMultiplier``); those draws cannot be reproduced. moetrain trains with the
deterministic selection above, and its gradient is autograd's of these formulas: for a pick
``i`` with weight ``p_i`` and masked softmax ``p``, ``d p_i / d z_j = p_i * (delta_ij - p_j)``
(0 for masked logits, and for ``z[i1]`` in the second pick). That is ``PhimoeMultiplier``'s
backward in the case where its sampled expert is the argmax and its coin gives 1.
"""

from __future__ import annotations

import torch


def _pick(
    scores_TE: torch.Tensor, logits_TE: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The best of ``scores_TE`` and its weight: the softmax at that expert of ``scores_TE``
    with the logits far from the best masked (``logits_TE`` sets the relative scale)."""
    with torch.no_grad():
        best_T1, ids_T1 = scores_TE.max(dim=-1, keepdim=True)
        scale_TE = logits_TE.abs().clamp(min=best_T1)
        far_TE = ((best_T1 - logits_TE) / scale_TE) > (2 * eps)
    probs_TE = torch.softmax(scores_TE.masked_fill(far_TE, float("-inf")), dim=-1)
    return probs_TE.gather(dim=-1, index=ids_T1), ids_T1


def sparsemixer_top2(logits_TE: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights_T2, ids_T2)`` of sparsemixer's two picks from fp32 router logits (module
    docstring); ``eps`` is Phi-3.5-MoE's ``router_jitter_noise``."""
    w1_T1, ids1_T1 = _pick(logits_TE, logits_TE, eps)
    without_first_TE = torch.scatter(logits_TE, -1, ids1_T1, float("-inf"))
    w2_T1, ids2_T1 = _pick(without_first_TE, logits_TE, eps)
    return torch.cat((w1_T1, w2_T1), dim=-1), torch.cat((ids1_T1, ids2_T1), dim=-1)
