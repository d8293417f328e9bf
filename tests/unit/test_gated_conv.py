"""The gated short convolution (``linear_attention`` layers of ``model.linear_attention:
gated_conv``, LFM2's ``conv`` layers): the layer against a written-out token-by-token reference
in fp64 (values and gradients, packed documents, a bias; a window leaking across documents
fails it), against transformers' LFM2-MoE layer both ways, packed documents through the
hybrid model, generation from its state, bf16, activation checkpointing, its saved tensors
against the plan's count, and its config refused by key (the LFM2-MoE family:
test_lfm2_moe.py)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.lfm2_moe.configuration_lfm2_moe import Lfm2MoeConfig
from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeShortConv

from moetrain.config import ConfigError
from moetrain.config.layer_plan import FULL, LINEAR, mixer_spec
from moetrain.model import Transformer
from moetrain.model.mixers import MixerInputs, build_mixer
from moetrain.model.mixers.gated_conv import ConvState, GatedConv
from tests.helpers.configs import tiny_config
from tests.helpers.recurrent_models import (
    check_checkpointing_and_bf16,
    check_generation,
    check_packed_documents,
    check_plan_saved_tensors,
    rel,
)

# a hybrid model: layers 0, 1 gated convolutions (width 3), 2 full attention
HYBRID = {
    "model.n_layers": 3,
    "model.layer_types": [LINEAR, LINEAR, FULL],
    "model.linear_attention": "gated_conv",
    "model.max_seq_len": 256,
}


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter away from its constant initialisation (norms, biases), and the gated
    convolutions' input projections 10x their initial scale (the gates multiply three of
    its outputs: at 0.02 the convolution hardly shows in the logits)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "in_proj.weight" in name:
            p.mul_(10.0)
        elif "norm" in name:
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        elif name.endswith(".bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def _inputs(s: int, doc_ids: torch.Tensor | None = None) -> MixerInputs:
    return MixerInputs(torch.zeros(s, 0), torch.zeros(s, 0), doc_ids_BS=doc_ids)


def _layer(bias: bool, dtype: torch.dtype = torch.float64) -> GatedConv:
    cfg = tiny_config(HYBRID, {"model.gated_conv_bias": bias})
    torch.manual_seed(0)
    layer = build_mixer(cfg.model, mixer_spec(cfg.model, 0)).to(dtype)
    layer.init_own_parameters()
    randomise(layer)
    return layer


def reference(layer: GatedConv, x: torch.Tensor, doc_ids: torch.Tensor, leak: bool = False):
    """LFM2's gated convolution written out token by token: ``h[t] = bias + sum_j w[j]
    u[t - W + 1 + j]`` over the positions of t's own document (all earlier ones with
    ``leak``), ``u = B * x``, out ``wo(C * h)``."""
    w = layer.conv.weight[:, 0]  # (D, W)
    width = w.shape[1]
    bcx = x @ layer.in_proj.weight.T
    if layer.in_proj.bias is not None:
        bcx = bcx + layer.in_proj.bias
    b, c, xx = bcx.chunk(3, dim=-1)
    u = b * xx
    rows = []
    for r in range(x.shape[0]):
        out = []
        for t in range(x.shape[1]):
            h = layer.conv.bias if layer.conv.bias is not None else torch.zeros_like(u[r, t])
            for j in range(width):
                src = t - width + 1 + j
                if src >= 0 and (leak or doc_ids[r, src] == doc_ids[r, t]):
                    h = h + w[:, j] * u[r, src]
            out.append(c[r, t] * h)
        rows.append(torch.stack(out))
    y = torch.stack(rows) @ layer.wo.weight.T
    return y if layer.wo.bias is None else y + layer.wo.bias


@pytest.mark.parametrize("bias", [False, True])
def test_layer_equals_the_written_out_reference_values_and_gradients(bias: bool) -> None:
    """Two rows of 13 tokens, one packing documents of 5, 1 and 7 (a single-token document, a
    document shorter than the window): values and every gradient within 1e-12 in fp64; the
    reference whose window crosses the documents differs (the control)."""
    layer = _layer(bias)
    x = torch.randn(2, 13, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    doc_ids = torch.tensor([[0] * 5 + [1] + [2] * 7, [0] * 13])
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya = layer(xa, _inputs(13, doc_ids))
    grads_a = torch.autograd.grad(ya.square().sum(), [xa, *layer.parameters()])
    yb = reference(layer, xb, doc_ids)
    grads_b = torch.autograd.grad(yb.square().sum(), [xb, *layer.parameters()])
    assert rel(ya, yb) <= 1e-12
    names = ["x", *(n for n, _ in layer.named_parameters())]
    for name, a, b in zip(names, grads_a, grads_b, strict=True):
        assert rel(a, b) <= 1e-12, name
    with torch.no_grad():
        assert rel(reference(layer, x, doc_ids, leak=True), ya) > 1e-3


def _transformers_layer(ours: GatedConv, bias: bool) -> Lfm2MoeShortConv:
    hf = Lfm2MoeConfig(
        hidden_size=32, conv_L_cache=3, conv_bias=bias, num_hidden_layers=1, layer_types=["conv"]
    )
    theirs = Lfm2MoeShortConv(hf, 0).to(ours.conv.weight.dtype)
    state = {k.replace("wo.", "out_proj."): v for k, v in ours.state_dict().items()}
    theirs.load_state_dict(state)
    return theirs


@pytest.mark.parametrize("bias", [False, True])
def test_layer_equals_transformers_values_and_gradients_both_ways(bias: bool) -> None:
    """fp32, 40 tokens: ours loaded into transformers' layer and transformers' (re-drawn)
    loaded back into ours give the same values (1e-6) and gradients (1e-5); a convolution
    tap off by 1e-3 fails the values."""
    ours = _layer(bias, torch.float32)
    theirs = _transformers_layer(ours, bias)
    x = torch.randn(2, 40, 32, generator=torch.Generator().manual_seed(2))
    for _ in range(2):  # ours -> theirs, then theirs (re-drawn) -> ours
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = ours(xa, _inputs(40)), theirs(xb)
        assert rel(ya, yb) <= 1e-6
        w = torch.randn_like(ya)
        (ya * w).sum().backward()
        (yb * w).sum().backward()
        assert rel(xa.grad, xb.grad) <= 1e-5
        named = dict(theirs.named_parameters())
        for name, p in ours.named_parameters():
            assert rel(p.grad, named[name.replace("wo.", "out_proj.")].grad) <= 1e-5, name
        ours.zero_grad(), theirs.zero_grad()
        with torch.no_grad():
            for p in theirs.parameters():
                p.copy_(torch.randn_like(p) * 0.2)
            ours.load_state_dict(
                {k.replace("out_proj.", "wo."): v for k, v in theirs.state_dict().items()}
            )
    with torch.no_grad():
        theirs.conv.weight[:, 0, 1] += 1e-3
        assert rel(theirs(x), ours(x, _inputs(40))) > 1e-6


def test_packed_documents_equal_each_document_alone_through_the_hybrid_model() -> None:
    """A row of documents of 9, 1, 2 and 20 tokens (two shorter than the window) through two
    gated convolution layers and a full-attention layer: logits and every parameter's gradient
    equal those of the documents one by one; without document ids they do not."""
    cfg = tiny_config(HYBRID, {"model.loss_chunk_tokens": 0, "model.gated_conv_bias": True})
    check_packed_documents(cfg, randomise, [9, 1, 2, 20])


def test_generation_from_the_state_equals_full_recomputation() -> None:
    cfg = tiny_config(HYBRID)
    torch.manual_seed(3)
    model = Transformer(cfg.model, cfg.moe).eval()
    randomise(model)
    cache = model.new_cache(1, 100)
    assert sum(isinstance(s, ConvState) for s in cache.layers) == 2
    assert cache.bytes_per_sequence == 2 * (2 * 32 * 4)
    check_generation(model, 21, (1, 12))


def test_checkpointing_and_bf16_work_unchanged() -> None:
    check_checkpointing_and_bf16(tiny_config(HYBRID), randomise)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plan_activation_formula_matches_saved_tensors(dtype: torch.dtype) -> None:
    cfg = tiny_config(HYBRID, {"data.seq_len": 64, "model.loss_chunk_tokens": 64})
    check_plan_saved_tensors(cfg, dtype)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"model.gated_conv_kernel": 0}, "model.gated_conv_kernel"),
        ({"model.nope_layers": [0]}, "model.nope_layers"),
        ({"model.attention": "gated_conv"}, "model.attention"),
        ({"model.linear_attention": "gqa"}, "model.linear_attention"),
        (
            {"parallel.sp_size": 3, "data.seq_len": 48},
            "parallel.sp_size: must divide model.d_model",
        ),
    ],
)
def test_unbuildable_configs_are_refused_by_key(overrides: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_config(HYBRID, overrides)


def test_its_keys_are_refused_where_no_layer_is_a_gated_convolution() -> None:
    for key, value in (("model.gated_conv_kernel", 4), ("model.gated_conv_bias", True)):
        with pytest.raises(ConfigError, match=rf"{key}: only applies with .*gated_conv"):
            tiny_config({key: value})
