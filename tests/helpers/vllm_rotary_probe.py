"""What vLLM's CPU rotary kernel does with per-head queries and keys: run by the serving tests
with the interpreter of ``.venv-serving`` (vLLM's CPU build), never imported by the test suite.

    python tests/helpers/vllm_rotary_probe.py

prints one line ``ROTARY {...}``: the largest differences from vLLM's PyTorch RoPE
(``forward_native``, plain RoPE, NeoX halves) of its CPU kernel (``forward_cpu``) given the query
and key as ``[tokens, heads * head_dim]`` (``flat``) and as ``[tokens, heads, head_dim]``
(``per_head``), and of the latter from ``rows_as_tokens``: each head's row taken for a token of
one head, the first ``tokens`` rows rotated by positions 0, 1, 2 ... and the others left as they
are.
"""

from __future__ import annotations

import json

import torch

TOKENS, HEADS, KV_HEADS, HEAD_DIM = 8, 4, 2, 32


def rows_as_tokens(rope, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x`` [tokens, heads, head_dim] as the kernel is measured to treat it."""
    rows = x.reshape(-1, HEAD_DIM).clone()
    n = positions.numel()
    rows[:n] = rope.forward_native(positions, rows[:n].clone(), None)[0]
    return rows.view_as(x)


def main() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            HEAD_DIM,
            max_position=64,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
            is_neox_style=True,
        )
    gen = torch.Generator().manual_seed(0)
    positions = torch.arange(TOKENS)
    q = torch.randn(TOKENS, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(TOKENS, KV_HEADS, HEAD_DIM, generator=gen)
    ref_q, ref_k = rope.forward_native(positions, q.clone(), k.clone())
    flat_q, flat_k = rope.forward_cpu(
        positions, q.clone().view(TOKENS, -1), k.clone().view(TOKENS, -1)
    )
    head_q, head_k = rope.forward_cpu(positions, q.clone(), k.clone())

    def gap(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.reshape(b.shape) - b).abs().max())

    found = {
        "flat": max(gap(flat_q, ref_q), gap(flat_k, ref_k)),
        "per_head": max(gap(head_q, ref_q), gap(head_k, ref_k)),
        "rows_as_tokens": max(
            gap(head_q, rows_as_tokens(rope, positions, q)),
            gap(head_k, rows_as_tokens(rope, positions, k)),
        ),
    }
    print("ROTARY " + json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
