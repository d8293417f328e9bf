"""Decoding through the model's KV cache, for tests that compare it with a full forward or with
transformers' ``generate``."""

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


def generation_matches(model: Transformer, hf, new_tokens: int) -> None:  # noqa: ANN001
    """From a 7-token prompt, ``model``'s greedy tokens are ``hf``'s, and its logits through
    the KV cache (the prompt, then one token at a time) are ``hf``'s at every position."""
    from moetrain.generate import generate_ids

    prompt = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(2))
    hf.generation_config.eos_token_id = None
    ref = hf.generate(prompt, do_sample=False, max_new_tokens=new_tokens)
    got = generate_ids(model, prompt[0].tolist(), new_tokens, temperature=0.0)
    assert got == ref[0, 7:].tolist()
    n = 7 + new_tokens - 1
    with torch.no_grad():
        cache, steps = model.new_cache(1, n + 1), []
        steps.append(model(ref[:, :7], cache=cache).logits)
        for i in range(7, n):
            steps.append(model(ref[:, i : i + 1], cache=cache).logits)
        torch.testing.assert_close(
            torch.cat(steps, 1), hf(input_ids=ref[:, :n]).logits, atol=1e-5, rtol=1e-5
        )
