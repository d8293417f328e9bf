"""The step record built in monitor/ from a step's totals over every rank."""

from __future__ import annotations

import torch

from moetrain.monitor.step_record import StepTotals, moe_layer_record, step_record


def _totals(loads: torch.Tensor | None, traffic: dict[str, float]) -> StepTotals:
    # 2 MoE layers; sums over 4 micro-batches: dropped, entropy, aux, z, routed copies,
    # copies routed to zero experts
    layer_sums = torch.tensor(
        [[2.0, 0.0], [4.0, 8.0], [1.0, 2.0], [0.4, 0.8], [40.0, 40.0], [10.0, 0.0]],
        dtype=torch.float64,
    )
    return StepTotals(1.5, 1.25, 0.25, 0, 4, traffic, loads, layer_sums)


def test_moe_layers_are_keyed_by_transformer_layer_with_means_over_micro_batches() -> None:
    loads = torch.tensor([[10.0, 30.0], [20.0, 20.0]], dtype=torch.float64)
    biases = [torch.tensor([0.5, -0.5]), torch.zeros(2)]
    layers = moe_layer_record(_totals(loads, {}), [1, 3], biases)
    assert sorted(layers) == [1, 3]
    assert layers[1] == {
        "tokens_per_expert": [10.0, 30.0],
        "dropped": 2.0,
        "dropped_frac": 2.0 / 40.0,
        "entropy": 1.0,
        "aux_loss": 0.25,
        "z_loss": 0.1,
        "expert_bias": [0.5, -0.5],
        "zero_expert_share": 10.0 / 40.0,
    }
    assert layers[3]["dropped_frac"] == 0.0 and layers[3]["entropy"] == 2.0
    assert layers[3]["zero_expert_share"] == 0.0
    assert moe_layer_record(_totals(None, {}), [], []) == {}


def test_record_keys_follow_what_the_run_has() -> None:
    common = dict(
        step=5,
        tokens=500,
        lr=1e-3,
        grad_norm=0.5,
        skipped=False,
        skipped_steps=1,
        times={"fwd_bwd": 0.2},
    )
    plain = step_record(_totals(None, {}), moe_layers={}, **common)
    assert plain == {
        "step": 5,
        "loss": 1.5,
        "ce_loss": 1.25,
        "moe_loss": 0.25,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "tokens": 500,
        "skipped": False,
        "skipped_steps": 1,
        "time/fwd_bwd_s": 0.2,
        "time/optimizer_s": 0.0,
    }
    fp16_ep = step_record(
        _totals(None, {"rows": 12.0}),
        moe_layers={1: {"dropped": 0.0}},
        loss_scale=1024.0,
        loss_scale_overflows=3,
        **common,
    )
    assert fp16_ep["comm/a2a_rows"] == 12.0
    assert (fp16_ep["loss_scale"], fp16_ep["loss_scale_overflows"]) == (1024.0, 3)
    assert fp16_ep["moe_layers"] == {1: {"dropped": 0.0}}
