"""Muon (optim.name: muon): one step and two against a written-out float64 reference, the
per-expert orthogonalisation (the stacked-tensor mistake is caught), which parameters take which
update, Newton-Schulz itself, and what plan and print-config are told."""

from __future__ import annotations

import math

import pytest
import torch

from moetrain.model.transformer import Transformer
from moetrain.optim.newton_schulz import (
    DEFAULT_COEFFICIENTS,
    newton_schulz_flops,
    orthogonalize,
    orthogonalize_into,
)
from moetrain.optim.registry import build_optimizer, optimizer_spec
from tests.helpers.configs import tiny_config

LR, WD, MU = 0.01, 0.1, 0.95
MLA = {
    "model.attention": "mla",
    "model.q_lora_rank": 16,
    "model.kv_lora_rank": 16,
    "model.qk_nope_head_dim": 8,
    "model.qk_rope_head_dim": 16,
    "model.v_head_dim": 12,
    "model.n_kv_heads": 4,
}


def _cfg(**settings: object):
    base = {
        "optim.name": "muon",
        "optim.lr": LR,
        "optim.weight_decay": WD,
        "moe.first_k_dense": 1,
        "moe.num_shared_experts": 1,
        "model.n_layers": 3,
    }
    return tiny_config(base, settings)


def ns64(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The quintic Newton-Schulz iteration, written out in float64 on one matrix."""
    a, b, c = DEFAULT_COEFFICIENTS
    x = x.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def scaled(m: torch.Tensor) -> torch.Tensor:
    return ns64(m) * 0.2 * math.sqrt(max(m.shape))


def reference_update(name: str, u: torch.Tensor, stacked_as_one: bool = False) -> torch.Tensor:
    """Muon's update of one parameter from its Nesterov momentum ``u`` (float64): each expert's
    matrices on their own, w13's gate and up apart; ``stacked_as_one``: the mistake."""
    if u.ndim == 2:
        return scaled(u)
    if stacked_as_one:
        return scaled(u.reshape(-1, u.shape[-1])).view_as(u)
    halves = 2 if name.endswith(".w13") else 1
    return torch.stack(
        [torch.cat([scaled(part) for part in e.chunk(halves, dim=-1)], dim=-1) for e in u]
    )


def _model_and_grads(cfg, steps: int, seed: int = 0):
    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model, cfg.moe)
    gen = torch.Generator().manual_seed(seed)
    grads = [
        {n: torch.randn(p.shape, generator=gen) * 0.01 for n, p in model.named_parameters()}
        for _ in range(steps)
    ]
    return model, grads


def _reference(model, grads, cfg) -> dict[str, torch.Tensor]:
    """Float64 weights after ``len(grads)`` steps: Muon written out for the Muon parameters,
    torch's AdamW for the others."""
    spec = optimizer_spec("muon")
    weights = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    adamw_params = {
        n: torch.nn.Parameter(w)
        for n, w in weights.items()
        if spec.update_of(n, w.ndim, cfg.optim) == "adamw"
    }
    from moetrain.optim.groups import is_no_decay

    groups = [
        {
            "params": [p for n, p in adamw_params.items() if not is_no_decay(n, p, False)],
            "weight_decay": WD,
        },
        {
            "params": [p for n, p in adamw_params.items() if is_no_decay(n, p, False)],
            "weight_decay": 0.0,
        },
    ]
    o = cfg.optim
    adamw = torch.optim.AdamW(groups, lr=LR, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)
    momentum = {n: torch.zeros_like(w) for n, w in weights.items() if n not in adamw_params}
    for step_grads in grads:
        for n, p in adamw_params.items():
            p.grad = step_grads[n].double()
        adamw.step()
        for n, buf in momentum.items():
            g = step_grads[n].double()
            buf.mul_(MU).add_(g)
            u = g + MU * buf
            weights[n] = weights[n] * (1 - LR * WD) - LR * reference_update(n, u)
    weights.update({n: p.detach() for n, p in adamw_params.items()})
    return weights


def _muon_steps(model, grads, cfg) -> dict[str, torch.Tensor]:
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    for step_grads in grads:
        for n, p in model.named_parameters():
            p.grad = step_grads[n].clone()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _rel_update_error(got, want, before) -> float:
    """Largest error of a parameter's change, relative to that change's largest value."""
    worst = 0.0
    for n in want:
        change = want[n] - before[n].double()
        err = (got[n].double() - want[n]).abs().max() / change.abs().max()
        worst = max(worst, float(err))
    return worst


@pytest.mark.parametrize("steps", [1, 2])
def test_steps_equal_the_written_out_reference(steps: int) -> None:
    cfg = _cfg()
    model, grads = _model_and_grads(cfg, steps)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    want = _reference(model, grads, cfg)
    got = _muon_steps(model, grads, cfg)
    assert _rel_update_error(got, want, before) < 1e-4


def test_the_stacked_expert_tensor_is_never_one_matrix() -> None:
    """The reference's per-expert update differs from the stacked-tensor mistake (and from w13
    taken as one matrix) by far more than the tolerance above: that test would catch either."""
    cfg = _cfg()
    model, grads = _model_and_grads(cfg, 1)
    name = "layers.1.ffn.experts.w13"
    g = grads[0][name].double()
    u = g + MU * g
    right = reference_update(name, u)
    for wrong in (
        reference_update(name, u, stacked_as_one=True),
        reference_update("w2", u),  # gate and up together
    ):
        assert float((wrong - right).abs().max() / right.abs().max()) > 0.05
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    got = _muon_steps(model, grads, cfg)
    change = (before[name].double() * (1 - LR * WD) - got[name].double()) / LR
    assert float((change - right).abs().max() / right.abs().max()) < 1e-4


def test_a_matrix_update_depends_on_neither_its_batch_nor_its_strides() -> None:
    """Newton-Schulz of a matrix is the same, bit for bit, alone or in a stack, and written in
    place through a strided view (a cut or partitioned layout's) or into a new tensor: a layout
    that batches or lays out the matrices otherwise does not change the update."""
    gen = torch.Generator().manual_seed(2)
    w13 = torch.randn(3, 6, 2 * 10, generator=gen)  # 3 experts, gate | up of 6 x 10 each
    halves = w13.view(3, 6, 2, 10).transpose(1, 2)  # (expert, half, 6, 10), strided
    alone = [
        orthogonalize(halves[e, h].clone(), DEFAULT_COEFFICIENTS, 5)
        for e in range(3)
        for h in range(2)
    ]
    in_place = w13.clone()
    view = in_place.view(3, 6, 2, 10).transpose(1, 2)
    orthogonalize_into(view, view, DEFAULT_COEFFICIENTS, 5, scale=2.0)
    for i, want in enumerate(alone):
        assert torch.equal(view[i // 2, i % 2], want * 2.0)
        assert torch.equal(orthogonalize(halves, DEFAULT_COEFFICIENTS, 5)[i // 2, i % 2], want)
    tall = orthogonalize(halves.mT, DEFAULT_COEFFICIENTS, 5)  # (10 x 6: transposed in and out)
    assert torch.equal(tall[1, 0], alone[2].T)


def test_which_parameters_take_muon() -> None:
    cfg = _cfg(**{"model.mtp_depth": 1})
    spec = optimizer_spec("muon")
    model = Transformer(cfg.model, cfg.moe)
    updates = {n: spec.update_of(n, p.ndim, cfg.optim) for n, p in model.named_parameters()}
    muon = {n for n, u in updates.items() if u == "muon"}
    assert {
        "layers.0.attn.wq.weight",
        "layers.0.attn.wo.weight",
        "layers.0.ffn.w1.weight",  # the dense first layer
        "layers.1.ffn.experts.w13",
        "layers.1.ffn.experts.w2",
        "layers.1.ffn.shared_expert.w2.weight",
        "layers.3.eh_proj.weight",  # the multi-token-prediction module's projection
    } <= muon
    adamw = set(updates) - muon
    assert {"embed.weight", "lm_head.weight", "layers.1.ffn.router.gate.weight"} <= adamw
    assert all(model.get_parameter(n).ndim >= 2 for n in muon)
    assert all(
        n.endswith("norm.weight") or n in {"embed.weight", "lm_head.weight"} or "router" in n
        for n in adamw
    )
    # the router's gate on Muon too, as Moonlight's example trains it
    moved = _cfg(**{"optim.muon.adamw_matrices": ["embedding", "lm_head"]})
    assert spec.update_of("layers.1.ffn.router.gate.weight", 2, moved.optim) == "muon"


def test_latent_attention_matrices_take_muon() -> None:
    cfg = _cfg(**MLA)
    spec = optimizer_spec("muon")
    model = Transformer(cfg.model, cfg.moe)
    updates = {n: spec.update_of(n, p.ndim, cfg.optim) for n, p in model.named_parameters()}
    for w in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo"):
        assert updates[f"layers.0.attn.{w}.weight"] == "muon"
    for norm in ("q_norm", "kv_norm"):
        assert updates[f"layers.0.attn.{norm}.weight"] == "adamw"


def test_what_is_not_a_linear_map_never_takes_muon() -> None:
    from moetrain.optim.kinds import param_kind

    # a linear-attention layer's short convolution (transformers' (C, 1, K), or (C, K)), its
    # decay parameters, a norm: not matrices whatever their shape
    for name, ndim in (
        ("layers.0.linear_attn.conv1d.weight", 3),
        ("layers.0.linear_attn.q_conv1d.weight", 2),
        ("layers.0.linear_attn.A_log", 1),
        ("layers.0.attn.q_norm.weight", 1),
        ("layers.1.ffn.experts.w13_bias", 2),
    ):
        assert param_kind(name, ndim) == "vector", name
    assert param_kind("layers.0.linear_attn.in_proj_qkvz.weight", 2) == "ffn"


def test_a_kind_that_is_not_a_matrix_kind_is_refused() -> None:
    from moetrain.config import ConfigError

    with pytest.raises(ConfigError, match="optim.muon.adamw_matrices"):
        _cfg(**{"optim.muon.adamw_matrices": ["norm"]})


def test_state_names_bytes_and_print_config(capsys) -> None:
    from moetrain.cli import main
    from moetrain.optim.summary import update_counts
    from moetrain.plan.optimizer import state_bytes_per_param

    cfg = _cfg()
    spec = optimizer_spec("muon")
    assert spec.state_keys({"update": "muon"}) == ("momentum_buffer",)
    assert spec.state_keys({"update": "adamw"}) == ("exp_avg", "exp_avg_sq")
    counts = update_counts(cfg)
    muon_dense = sum(n for (u, _, e), n in counts.items() if u == "muon" and not e)
    dense = sum(n for (_, _, e), n in counts.items() if not e)
    expert_adamw = sum(n for (u, _, e), n in counts.items() if u == "adamw" and e)
    assert expert_adamw == 0  # (no expert biases here): every expert weight takes Muon
    got = state_bytes_per_param(cfg)
    assert got.expert == 4.0
    assert got.dense == pytest.approx((4 * muon_dense + 8 * (dense - muon_dense)) / dense)
    assert 4.0 < got.dense < 8.0
    args = [f"{k}={v}" for k, v in (("optim.name", "muon"), ("moe.num_shared_experts", 1))]
    assert main(["print-config", "configs/tiny-cpu.yaml", *args]) == 0
    out = capsys.readouterr().out
    assert "# updates (optim.name=muon)" in out
    line = next(s for s in out.splitlines() if s.startswith("update_muon: "))
    assert "attention" in line and "experts" in line and "embedding" not in line
    line = next(s for s in out.splitlines() if s.startswith("update_adamw: "))
    assert "embedding" in line and "router" in line and "vector" in line


def test_newton_schulz_orthogonalises_each_matrix_of_a_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    stack = torch.randn(3, 8, 20, generator=gen)
    stack[1] *= 100.0  # a scale of its own: normalised per matrix
    out = orthogonalize(stack, DEFAULT_COEFFICIENTS, 5)
    for i in range(3):
        torch.testing.assert_close(out[i].double(), ns64(stack[i]), rtol=1e-4, atol=1e-5)
        s = torch.linalg.svdvals(out[i])
        assert float(s.min()) > 0.6 and float(s.max()) < 1.25  # Keller Jordan's band
    tall = orthogonalize(stack[0].T, DEFAULT_COEFFICIENTS, 5)
    torch.testing.assert_close(tall, out[0].T)  # transposed in, transposed out
    assert orthogonalize(torch.zeros(4, 6), DEFAULT_COEFFICIENTS, 5).abs().max() == 0
    assert newton_schulz_flops(8, 20, 5) == 5 * (4 * 64 * 20 + 2 * 512)


def test_the_update_rms_matches_adamw_scale() -> None:
    """Moonlight's rule: 0.2 * sqrt(max(A, B)) makes the orthogonalised update's RMS about 0.2,
    the RMS of a typical AdamW update, whatever the matrix shape."""
    gen = torch.Generator().manual_seed(1)
    for shape in ((16, 64), (64, 16), (48, 48), (8, 200)):
        u = scaled(torch.randn(*shape, generator=gen))
        assert 0.15 < float(u.pow(2).mean().sqrt()) < 0.25, shape


def test_plan_counts_muon_state_and_newton_schulz() -> None:
    from moetrain.optim.kinds import matrix_blocks
    from moetrain.plan import format_plan, plan

    cfg = _cfg(**{"parallel.zero_stage": 2, "train.precision": "bf16"})
    adamw = _cfg(**{"optim.name": "adamw", "parallel.zero_stage": 2, "train.precision": "bf16"})
    muon_plan, adamw_plan = plan(cfg, 2, "h100"), plan(adamw, 2, "h100")
    assert muon_plan.optimizer_bytes < adamw_plan.optimizer_bytes
    assert adamw_plan.optimizer_flops == 0
    spec = optimizer_spec("muon")
    model = Transformer(cfg.model, cfg.moe)
    total = 0
    for name, p in model.named_parameters():
        if spec.update_of(name, p.ndim, cfg.optim) == "muon":
            for b in matrix_blocks(name, tuple(p.shape)):
                m, n = sorted((b.rows, b.cols // b.splits))
                total += b.splits * 5 * (4 * m * m * n + 2 * m**3)
    assert muon_plan.optimizer_flops == total // 2  # ZeRO-2: each GPU its half
    assert "Newton-Schulz" in format_plan(muon_plan)
    assert "Newton-Schulz" not in format_plan(adamw_plan)
    state = muon_plan.optimizer_state
    assert f"optimizer (muon): state {state.dense:.2f} B per dense parameter, 4.00 B per " in (
        format_plan(muon_plan)
    )
    adamw_line = "optimizer (adamw): state 8.00 B per dense parameter, 8.00 B per expert parameter"
    assert f"{adamw_line} + 4 B fp32 master copy" in format_plan(adamw_plan)


def test_muon_at_zero_stage_3_is_refused() -> None:
    from moetrain.config import ConfigError

    with pytest.raises(ConfigError, match="optim.name: muon .* parallel.zero_stage 0, 1 or 2"):
        _cfg(**{"parallel.zero_stage": 3})
