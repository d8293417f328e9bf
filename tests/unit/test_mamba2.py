"""Mamba-2 (``linear_attention`` layers of ``model.linear_attention: mamba2``): the chunked scan
against the token recurrence in fp64 (values, final state and gradients, documents and an
initial state), the layer against transformers' Granite 4.0-H layer both ways (values and
gradients over several chunks), packed documents through the whole hybrid model, generation
from its recurrent state, bf16, activation checkpointing, its saved tensors against the plan's
count, and its config refused by key."""

from __future__ import annotations

import pytest
import torch
from transformers.models.granitemoehybrid.configuration_granitemoehybrid import (
    GraniteMoeHybridConfig,
)
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
    GraniteMoeHybridMambaLayer,
)

from moetrain.config import ConfigError
from moetrain.config.layer_plan import FULL, LINEAR, mixer_spec
from moetrain.model import Transformer
from moetrain.model.mixers import MixerInputs, build_mixer
from moetrain.model.mixers.gated_deltanet import RecurrentState
from moetrain.model.mixers.mamba2 import Mamba2
from moetrain.model.ssd_scan import ssd_recurrent, ssd_scan
from tests.helpers.configs import tiny_config
from tests.helpers.recurrent_models import (
    check_checkpointing_and_bf16,
    check_generation,
    check_packed_documents,
    check_plan_saved_tensors,
)

# a hybrid model: layers 0, 1 Mamba-2 (4 heads of 8 in 2 groups, state 6), 2 full attention
HYBRID = {
    "model.n_layers": 3,
    "model.layer_types": [LINEAR, LINEAR, FULL],
    "model.linear_attention": "mamba2",
    "model.mamba_num_heads": 4,
    "model.mamba_head_dim": 8,
    "model.mamba_n_groups": 2,
    "model.mamba_state_dim": 6,
    "model.mamba_chunk_size": 16,
    "model.max_seq_len": 256,
}
SCAN_ARGS = ("x", "dt", "A", "B", "C", "D")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter away from its constant initialisation: norms, D, the decay (``A_log``
    in [-1, 2]) and the step's bias."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.rand(p.shape, generator=gen) * 3 - 1)
        elif name.endswith(("dt_bias", ".D", "conv1d.bias")):
            p.copy_(torch.randn(p.shape, generator=gen))
        elif "norm" in name:
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)


def _scan_inputs(dtype: torch.dtype, s: int = 45) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    b, h, p, g, n = 2, 4, 3, 2, 5

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=dtype)

    return dict(
        x=rand(b, s, h, p),
        dt=torch.nn.functional.softplus(rand(b, s, h)),
        A=-torch.tensor([0.05, 0.5, 2.0, 8.0], dtype=dtype),  # weak to strong decays
        B=rand(b, s, g, n),
        C=rand(b, s, g, n),
        D=rand(h),
    )


@pytest.mark.parametrize("chunk", [1, 8, 16, 64])
def test_chunked_scan_equals_the_recurrence_in_fp64_values_state_and_gradients(chunk) -> None:
    """45 tokens (chunks of 8: five, the last partial), two rows of which one packs four
    documents (one of a single token, one starting at a chunk's first slot), an initial state:
    outputs, final state and every input's gradient within 1e-12; a document start moved by one
    changes the output."""
    inputs = _scan_inputs(torch.float64)
    docs = torch.tensor([[0] * 10 + [1] * 6 + [2] * 1 + [3] * 28, [0] * 45])
    h0 = torch.randn(2, 4, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    leaves = {k: v.clone().requires_grad_() for k, v in {**inputs, "h0": h0}.items()}
    twins = {k: v.clone().requires_grad_() for k, v in {**inputs, "h0": h0}.items()}
    ya, sa = ssd_scan(
        *(leaves[k] for k in SCAN_ARGS),
        chunk_size=chunk,
        initial_state=leaves["h0"],
        output_final_state=True,
        doc_ids=docs,
    )
    yb, sb = ssd_recurrent(
        *(twins[k] for k in SCAN_ARGS),
        initial_state=twins["h0"],
        output_final_state=True,
        doc_ids=docs,
    )
    assert _rel(ya, yb) <= 1e-12 and _rel(sa, sb) <= 1e-12
    w, v = torch.randn_like(ya), torch.randn_like(sa)
    ((ya * w).sum() + (sa * v).sum()).backward()
    ((yb * w).sum() + (sb * v).sum()).backward()
    for k in leaves:
        assert _rel(leaves[k].grad, twins[k].grad) <= 1e-12, k
    moved = docs.clone()
    moved[0, 16] = 1  # the single-token document joins the one before it
    yc, _ = ssd_scan(*(inputs[k] for k in SCAN_ARGS), chunk_size=chunk, doc_ids=moved)
    assert _rel(yc, yb.detach()) > 1e-3


def _layer_pair(seed: int = 0) -> tuple[Mamba2, GraniteMoeHybridMambaLayer]:
    cfg = tiny_config(HYBRID).model
    torch.manual_seed(seed)
    ours = build_mixer(cfg, mixer_spec(cfg, 0))
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.3)
    randomise(ours, seed)
    with torch.no_grad():  # weak to strong decays per step
        ours.A_log.copy_(torch.tensor([-2.0, 0.0, 1.0, 2.0]))
        ours.dt_bias.copy_(torch.tensor([-1.0, 0.5, 1.0, 2.0]))
    hf = GraniteMoeHybridConfig(
        hidden_size=cfg.d_model,
        num_hidden_layers=1,
        num_attention_heads=cfg.n_heads,
        mamba_n_heads=4,
        mamba_d_head=8,
        mamba_n_groups=2,
        mamba_d_state=6,
        mamba_expand=1,
        mamba_chunk_size=32,
        rms_norm_eps=cfg.norm_eps,
        layer_types=["mamba"],
    )
    theirs = GraniteMoeHybridMambaLayer(hf, 0)
    state = {k.replace("wo.", "out_proj."): v for k, v in ours.state_dict().items()}
    theirs.load_state_dict(state)
    return ours, theirs


def _inputs(s: int) -> MixerInputs:
    return MixerInputs(torch.zeros(s, 0), torch.zeros(s, 0))


def test_layer_equals_transformers_values_and_gradients() -> None:
    """200 tokens (our chunks of 16, theirs of 32: both several, the last partial), per-step
    decays from ~0.9 to ~e^-15: values within 1e-5 of the largest, every gradient within
    5e-5; a D 1e-3 off fails the values, the groups read the other way round too."""
    ours, theirs = _layer_pair()
    x = torch.randn(2, 200, 32, generator=torch.Generator().manual_seed(1))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa, _inputs(200)), theirs(xb)
    assert _rel(ya, yb) <= 1e-5
    w = torch.randn_like(ya)
    (ya * w).sum().backward()
    (yb * w).sum().backward()
    assert _rel(xa.grad, xb.grad) <= 5e-5
    named = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert _rel(p.grad, named[name.replace("wo.", "out_proj.")].grad) <= 5e-5, name
    with torch.no_grad():
        theirs.D.add_(1e-3)
        assert _rel(theirs(x), ours(x, _inputs(200))) > 1e-5
        theirs.D.sub_(1e-3)
        inner, gn = 32, 12  # the in_proj rows of B then C: swap the two groups of each
        rows = theirs.in_proj.weight[2 * inner : 2 * inner + 2 * gn].view(2, 2, 6, 32)
        theirs.in_proj.weight[2 * inner : 2 * inner + 2 * gn] = rows[:, [1, 0]].reshape(24, 32)
        assert _rel(theirs(x), ours(x, _inputs(200))) > 1e-2


def test_packed_documents_equal_each_document_alone_through_the_hybrid_model() -> None:
    """A row of three documents (one spanning chunk boundaries, one a single token) through two
    Mamba-2 layers and a full-attention layer: logits and every parameter's gradient equal
    those of the documents run one by one; without document ids they do not."""
    cfg = tiny_config(HYBRID, {"model.loss_chunk_tokens": 0})
    check_packed_documents(cfg, randomise, [40, 1, 57])


def test_generation_from_the_recurrent_state_equals_full_recomputation() -> None:
    cfg = tiny_config(HYBRID)
    torch.manual_seed(3)
    model = Transformer(cfg.model, cfg.moe).eval()
    randomise(model)
    cache = model.new_cache(1, 100)
    assert sum(isinstance(s, RecurrentState) for s in cache.layers) == 2
    ch = 4 * 8 + 2 * 2 * 6
    assert cache.bytes_per_sequence == 2 * (3 * ch * 4 + 4 * 8 * 6 * 4)
    check_generation(model, 37, (30, 40))


def test_checkpointing_and_bf16_work_unchanged() -> None:
    check_checkpointing_and_bf16(tiny_config(HYBRID), randomise)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plan_activation_formula_matches_saved_tensors(dtype: torch.dtype) -> None:
    """The whole hybrid model's saved tensors against the plan's per-layer counts (rows a
    multiple of the scan's chunk)."""
    cfg = tiny_config(HYBRID, {"data.seq_len": 128, "model.loss_chunk_tokens": 128})
    check_plan_saved_tensors(cfg, dtype)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"model.mamba_n_groups": 3}, "model.mamba_n_groups"),
        ({"model.mamba_conv_kernel": 0}, "model.mamba_conv_kernel"),
        ({"model.mamba_state_dim": None}, "model.mamba_state_dim"),
        ({"model.mamba_dt_min": 0.1, "model.mamba_dt_max": 0.05}, "model.mamba_dt_max"),
        ({"model.nope_layers": [0]}, "model.nope_layers"),
        ({"model.linear_attention": "gqa"}, "model.linear_attention"),
        ({"model.attention": "mamba2"}, "model.attention"),
        ({"model.layer_types": None}, "model.mamba_num_heads"),
        (
            {"parallel.sp_size": 3, "data.seq_len": 48},
            "parallel.sp_size: must divide model.mamba_num_heads",
        ),
    ],
)
def test_unbuildable_configs_are_refused_by_key(overrides: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_config(HYBRID, overrides)
