"""LFM2-MoE (``lfm2_moe``): its router's renormalisation by the sum plus 1e-6 against a
written-out reference (values and gradients), the family both ways with its gated convolutions
mattering (packed documents, generation through the state), and the fields it cannot
represent refused by name. Its logits, weights, ``init_from`` and released config are checked
with every family's (test_convert_logits.py, test_init_from.py, test_released_configs.py)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.lfm2_moe.configuration_lfm2_moe import Lfm2MoeConfig

from moetrain.config import ConfigError, MoEConfig
from moetrain.model.moe.router import Router
from tests.helpers.recurrent_models import check_family_both_ways, rel
from tests.unit.test_gated_conv import randomise


def test_renormalisation_by_the_sum_plus_eps_equals_the_written_out_rule() -> None:
    """Sigmoid scores, top-2 of 4 with logits near -12 (scores ~1e-5: the eps matters):
    weights ``s_k / (s_1 + s_2 + eps) * route_scale`` and their gradients, as LFM2-MoE's router
    computes them (fp32, as the router scores); the plain sum (the control) differs by more than 1e-2."""
    cfg = MoEConfig(
        num_experts=4, top_k=2, score_func="sigmoid", renormalize_eps=1e-5, route_scale=2.5
    )
    router = Router(cfg, d_model=4)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(4))
    x = torch.tensor([[-12.0, -11.0, -12.5, -11.5], [1.0, -2.0, 0.5, 3.0]])
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = router(xa)
    scores = torch.sigmoid(xb)
    top = scores.topk(2, dim=-1)
    want = top.values / (top.values.sum(-1, keepdim=True) + 1e-5) * 2.5
    assert torch.equal(out.ids_TK, top.indices)
    assert rel(out.weights_TK, want) <= 1e-6
    (ga,) = torch.autograd.grad(out.weights_TK.square().sum(), xa)
    (gb,) = torch.autograd.grad(want.square().sum(), xb)
    assert rel(ga, gb) <= 1e-6
    plain = top.values / top.values.sum(-1, keepdim=True) * 2.5
    assert rel(out.weights_TK[:1], plain[:1].detach()) > 1e-2


def test_lfm2_moe_family_both_ways_packed_and_generating(tmp_path) -> None:
    """The tiny LFM2-MoE case (conv, attention, conv; a dense first layer; sigmoid routing with
    its selection bias), the convolutions' input projections 10x (so that they show): its
    export's logits in transformers equal moetrain's, transformers' weights imported back give
    them too (1e-5 of the logits' scale, fp32); a packed row of three documents equals each
    document through transformers alone; greedy generation and the logits through the state
    equal transformers' through its cache. Control: B and C swapped in one layer's files."""
    from tests.helpers.convert_models import load_hf, model_for, tiny_cfg
    from tests.helpers.decoding import generation_matches

    cfg = tiny_cfg("lfm2_moe")
    model = model_for(cfg)
    randomise(model)
    hf = load_hf(cfg, model, "lfm2_moe", tmp_path)
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(0))
    ref, _ = check_family_both_ways(cfg, model, hf, "lfm2_moe", ids, [17, 1, 22])
    with torch.no_grad():
        w = hf.model.layers[2].conv.in_proj.weight
        w.copy_(torch.cat([w[32:64], w[:32], w[64:]]))
        assert rel(hf(input_ids=ids).logits, ref) > 1e-3
        w.copy_(torch.cat([w[32:64], w[:32], w[64:]]))
    generation_matches(model, hf, 10)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("use_expert_bias", False),
        ("layer_types", ["conv", "sliding_attention", "conv"]),
        ("head_dim", 16),
    ],
)
def test_lfm2_moe_configs_it_cannot_represent_are_refused_by_field(field, value) -> None:
    from moetrain.convert.families import lfm2_moe
    from tests.helpers.convert_models import tiny_cfg

    fields = lfm2_moe.to_hf(tiny_cfg("lfm2_moe")) | {field: value}
    with pytest.raises(ConfigError, match=rf"^{field}: "):
        lfm2_moe.from_hf(Lfm2MoeConfig(**fields))
