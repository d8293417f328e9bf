"""The recurrent and convolution mixers under sequence parallelism, exact at the layer: every
slice's rank (a thread, the Ulysses layout's all-to-all a swap,
:mod:`tests.helpers.threaded_exchange`) computes its positions of the whole rows' output, and
the input's and every parameter's gradients (summed over the ranks) equal one call on the whole
rows, in fp64 (the decays and steps fp32, the numerics policy: ``REL``), with packed documents that cross the slices (the state and the window restart
at a document start on another rank's slice). Gated DeltaNet, Kimi Delta Attention (both gate
layouts), Mamba-2 (groups split over the ranks, and repeated where the ranks do not split
them) and the gated convolution, at 2 and 4 ranks; a control with the ranks' slices swapped
is caught. One case of each kind by default, the rest with -m long."""

from __future__ import annotations

import pytest
import torch

from moetrain.config.layer_plan import mixer_spec
from moetrain.config.mixers import MIXER_KINDS
from moetrain.model.mixers import MixerInputs, build_mixer
from tests.helpers.configs import tiny_config
from tests.helpers.threaded_exchange import run_sliced

LINEAR = {"model.layer_types": ["linear_attention", "full_attention"], "model.n_layers": 2}
GDN = {
    **LINEAR,
    "model.linear_num_key_heads": 4,
    "model.linear_num_value_heads": 8,
    "model.linear_key_head_dim": 8,
    "model.linear_value_head_dim": 6,
}
KDA = {
    **LINEAR,
    "model.linear_attention": "kda",
    "model.linear_num_heads": 4,
    "model.linear_head_dim": 8,
}
MAMBA = {
    **LINEAR,
    "model.linear_attention": "mamba2",
    "model.mamba_num_heads": 4,
    "model.mamba_head_dim": 8,
    "model.mamba_n_groups": 2,
    "model.mamba_state_dim": 6,
    "model.mamba_chunk_size": 5,  # several chunks per row, not dividing it
    "model.mamba_dt_max": 0.5,
}
CONV = {**LINEAR, "model.linear_attention": "gated_conv", "model.gated_conv_bias": True}
CASES = {
    "gated_deltanet-sp2": (GDN, 2),
    "gated_deltanet-sp4": (GDN, 4),
    "kda-sp2": (KDA, 2),
    "kda-sp4": (KDA, 4),
    "kda-ling-sp2": (
        {**KDA, "model.kda_full_rank_gates": True, "model.kda_gate_lower_bound": -5.0},
        2,
    ),
    "mamba2-groups-split-sp2": (MAMBA, 2),
    "mamba2-groups-repeated-sp4": (MAMBA, 4),
    "mamba2-one-group-sp2": (
        {**MAMBA, "model.mamba_n_groups": 1, "model.mamba_conv_bias": False},
        2,
    ),
    "gated_conv-sp2": (CONV, 2),
    "gated_conv-wide-sp4": ({**CONV, "model.gated_conv_kernel": 5}, 4),
}
B, S = 2, 24
# the parameters' gradients are sums over the positions, taken per slice and added: fp32's
# rounding of the decays (Gated DeltaNet's and Mamba-2's are fp32 under fp64 too) shows there
REL = 1e-6
# documents start inside slices and right at none of the cuts of 2 and 4 ranks (6, 12, 18)
DOCS = torch.tensor([[0] * 5 + [1] * 9 + [2] * 10, [0] * 13 + [1] * 2 + [2] * 9])


def _mixer(settings: dict) -> torch.nn.Module:
    cfg = tiny_config(settings).model
    torch.manual_seed(0)
    mixer = build_mixer(cfg, mixer_spec(cfg, 0)).double()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every parameter random, decays from weak to strong
        for name, p in mixer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.4)
            if name.endswith("A_log"):
                p.copy_(torch.linspace(-1.5, 1.0, p.numel(), dtype=p.dtype).view(p.shape))
    return mixer


def _call(mixer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    cos = torch.zeros(S, 0, dtype=x.dtype)
    return mixer(x, MixerInputs(cos, cos, doc_ids_BS=DOCS))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _whole(mixer: torch.nn.Module, x: torch.Tensor, probe: torch.Tensor):
    x = x.clone().requires_grad_()
    out = _call(mixer, x)
    (out * probe).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in mixer.named_parameters()}


DEFAULT = ("kda-sp2", "mamba2-one-group-sp2", "gated_conv-sp2")  # the others with -m long


def _params(cases) -> list:
    return [pytest.param(c, marks=[] if c in DEFAULT else [pytest.mark.long]) for c in cases]


@pytest.mark.parametrize("case", _params(CASES))
def test_sequence_parallel_layer_equals_the_whole_rows(case: str) -> None:
    settings, sp = CASES[case]
    cfg = tiny_config(settings, {"parallel.sp_size": sp}).model  # (allowed by the config)
    assert MIXER_KINDS[cfg.linear_attention].sp_heads(cfg)
    mixer = _mixer(settings)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(B, S, cfg.d_model, generator=gen, dtype=torch.float64)
    probe = torch.randn(B, S, cfg.d_model, generator=gen, dtype=torch.float64)
    out, dx, grads = run_sliced(mixer, sp, x, probe, _call)
    want_out, want_dx, want_grads = _whole(mixer, x, probe)
    assert _rel(out, want_out) < REL
    assert _rel(dx, want_dx) < REL
    assert grads.keys() == want_grads.keys()
    for name, want in want_grads.items():
        assert _rel(grads[name], want) < REL, name
    # the documents matter here: without them the whole rows' output differs
    with torch.no_grad():
        cos = torch.zeros(S, 0, dtype=x.dtype)
        assert _rel(mixer(x, MixerInputs(cos, cos)), want_out) > 1e-3


@pytest.mark.parametrize(
    "case", _params(["kda-sp2", "mamba2-one-group-sp2", "gated_conv-wide-sp4"])
)
def test_a_wrong_slice_order_is_caught(case: str) -> None:
    """Negative control: the ranks' slices handed in the wrong order (rank 0 the second half)
    differ from the whole rows far beyond the bound."""
    settings, sp = CASES[case]
    mixer = _mixer(settings)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(B, S, mixer.wo.weight.shape[0], generator=gen, dtype=torch.float64)
    probe = torch.ones_like(x)
    swapped = torch.cat([x[:, S // 2 :], x[:, : S // 2]], 1)
    out, _, _ = run_sliced(mixer, sp, swapped, probe, _call)
    out = torch.cat([out[:, S // 2 :], out[:, : S // 2]], 1)
    want, _, _ = _whole(mixer, x, probe)
    assert _rel(out, want) > 1e-3


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param(GDN, id="gated_deltanet", marks=pytest.mark.long),
        pytest.param(KDA, id="kda", marks=pytest.mark.long),
        pytest.param(MAMBA, id="mamba2", marks=pytest.mark.long),
        pytest.param({**MAMBA, "model.mamba_n_groups": 1}, id="mamba2-one-group-repeated"),
        pytest.param(CONV, id="gated_conv", marks=pytest.mark.long),
    ],
)
def test_plan_saved_tensors_under_sequence_parallelism(settings: dict) -> None:
    """A rank's saved tensors at sp=2 (its slice of the rows, the heads exchanged: Mamba-2's
    one group repeated to both ranks) against the plan's per-layer count, per token of the
    slice (the count without the repeated group is 3.5% short there: caught)."""
    from moetrain.plan.activations import activation_bytes_per_token, head_bytes_per_token
    from tests.unit.test_plan import _saved_bytes_per_token

    fit = {"data.seq_len": 64, "model.max_seq_len": 64, "model.loss_chunk_tokens": 64}
    fit |= {"model.mamba_chunk_size": 16} if "model.mamba_chunk_size" in settings else {}
    cfg = tiny_config(settings, fit, {"parallel.sp_size": 2})
    tokens = 256
    layers = sum(activation_bytes_per_token(cfg, i, 4) for i in range(cfg.model.n_layers))
    chunked_loss = 4 * cfg.model.vocab_size * cfg.model.d_model / (tokens // 2)
    predicted = layers + head_bytes_per_token(cfg, 4) + chunked_loss
    assert _saved_bytes_per_token(cfg, torch.float32, tokens) == pytest.approx(predicted, rel=0.01)
