"""Where a block normalises (``model.block_norms``, ``model.attention_block_norms``): sandwich
norms (each branch's output normalised too, before its residual add) and post norms (the output
only), each layer against a written-out reference of the block, values and gradients; their
parameters, counts and refusal by key."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import ConfigError
from moetrain.model import Transformer
from moetrain.model import param_names as pn
from moetrain.model_numbers import model_numbers
from tests.helpers.configs import tiny_config
from tests.helpers.random_constants import randomise_constants

SANDWICH = {"model.block_norms": "sandwich", "moe.first_k_dense": 1}  # a dense and an MoE block


# Olmo-Hybrid's layout: Gated DeltaNet layers pre-norm, the attention layer post-norm
HYBRID_POST = {
    "model.n_layers": 3,
    "model.full_attention_interval": 3,
    "model.linear_num_key_heads": 2,
    "model.linear_num_value_heads": 2,
    "model.linear_key_head_dim": 8,
    "model.linear_value_head_dim": 8,
    "model.attention_block_norms": "post",
}


def _reference_block(block, x, inputs, placement: str):
    """Pre: ``x + m * attn(attn_norm(x))``; sandwich: ``x + m * attn_post_norm(attn(
    attn_norm(x)))``; post: ``x + m * attn_post_norm(attn(x))``; then the same around the FFN."""
    m = block.residual_multiplier
    pre = (lambda n, h: n(h)) if placement != "post" else (lambda n, h: h)
    post = (lambda n, h: n(h)) if placement != "pre" else (lambda n, h: h)
    x = x + m * post(block.attn_post_norm, block.attn(pre(block.attn_norm, x), inputs))
    y = block.ffn(pre(block.ffn_norm, x))
    y = y[0] if block.is_moe else y
    return x + m * post(block.ffn_post_norm, y)


CASES = {
    "sandwich": (SANDWICH, ["sandwich", "sandwich"]),
    "sandwich, residual x 0.5": (
        {**SANDWICH, "model.residual_multiplier": 0.5},
        ["sandwich", "sandwich"],
    ),
    "post": ({**SANDWICH, "model.block_norms": "post"}, ["post", "post"]),
    "pre linear, post attention": (HYBRID_POST, ["pre", "pre", "post"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_block_matches_the_written_out_placement(case: str) -> None:
    settings, placements = CASES[case]
    cfg = tiny_config(settings)
    assert [cfg.model.norm_placement(i) for i in range(cfg.model.n_layers)] == placements
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe).eval()
    randomise_constants(model)  # the post norms' weights apart from the pre norms'
    captured = []  # each block's input and mixer inputs, as the model calls it
    hooks = [
        b.register_forward_hook(lambda blk, args, _: captured.append((blk, *args[:2])))
        for b in model.layers
    ]
    model(torch.randint(0, cfg.model.vocab_size, (2, 9)))
    for h in hooks:
        h.remove()
    for block, x, inputs in captured:
        x = x.detach().requires_grad_(True)
        got = block(x, inputs)[0]
        want = _reference_block(block, x, inputs, placements[block.layer])
        assert (block.attn_norm is None) == (placements[block.layer] == "post")
        assert (block.ffn_post_norm is None) == (placements[block.layer] == "pre")
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        g = torch.randn_like(got)
        (grad_got,) = torch.autograd.grad(got, x, g)
        (grad_want,) = torch.autograd.grad(want, x, g)
        torch.testing.assert_close(grad_got, grad_want, rtol=1e-6, atol=1e-6)
    assert len(captured) == cfg.model.n_layers
    assert model_numbers(cfg).total_params == sum(p.numel() for p in model.parameters())


def test_post_norms_change_the_function_and_are_named() -> None:
    cfg, pre = tiny_config(SANDWICH), tiny_config({"moe.first_k_dense": 1})
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe)
    names = set(model.state_dict())
    for i in range(cfg.model.n_layers):
        assert {pn.post_norm(i, "attn"), pn.post_norm(i, "ffn")} <= names
    torch.manual_seed(0)
    plain = Transformer(pre.model, pre.moe)
    assert not any("post_norm" in n for n in plain.state_dict())
    assert model_numbers(cfg).total_params == sum(p.numel() for p in model.parameters())
    assert model_numbers(cfg).total_params - model_numbers(pre).total_params == (
        2 * cfg.model.n_layers * cfg.model.d_model
    )
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if k in plain.state_dict()})
    ids = torch.randint(0, cfg.model.vocab_size, (1, 7))
    with torch.no_grad():  # the post norms rescale each branch: another function
        assert not torch.allclose(model(ids).logits, plain(ids).logits, atol=1e-3)


def test_an_unknown_placement_is_refused_by_key() -> None:
    with pytest.raises(ConfigError, match=r"model\.block_norms"):
        tiny_config({"model.block_norms": "middle"})
    with pytest.raises(ConfigError, match=r"model\.attention_block_norms"):
        tiny_config({"model.attention_block_norms": "middle"})
