"""Layout validation (fails fast, before any process group) and the DeepSpeed config."""

from __future__ import annotations

import json

import pytest

from moetrain.config import ConfigError, load_config
from moetrain.parallel.deepspeed import deepspeed_config, dump_deepspeed_config
from moetrain.parallel.topology import Topology, validate_layout


def _cfg(**kw: object):
    base = {"moe.num_experts": 8, "train.micro_batch_size": 2, "train.grad_accum_steps": 2}
    base.update(kw)
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


def test_valid_layouts() -> None:
    assert validate_layout(_cfg(**{"parallel.ep_size": 2}), 4) == 4
    assert validate_layout(_cfg(**{"parallel.ep_size": 1}), 1) == 1
    assert validate_layout(_cfg(**{"train.global_batch_size": 16}), 4) == 4


def test_ep_must_divide_world() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.ep_size: must divide the world size 3"):
        validate_layout(_cfg(**{"parallel.ep_size": 2}), 3)


def test_ep_must_divide_experts() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.ep_size: must divide moe\.num_experts=8"):
        load_config(None, ["moe.num_experts=8", "parallel.ep_size=3"])
    cfg = _cfg()
    cfg.parallel.ep_size = 3  # bypassing load_config's check: validate_layout checks again
    with pytest.raises(ConfigError, match="moe.num_experts=8"):
        validate_layout(cfg, 6)


def test_global_batch_mismatch() -> None:
    cfg = _cfg(**{"train.global_batch_size": 10})
    with pytest.raises(ConfigError, match=r"train\.global_batch_size: 10 != .* = 16"):
        validate_layout(cfg, 4)


def test_zero3_refused() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.zero_stage"):
        load_config(None, ["parallel.zero_stage=3"])
    cfg = _cfg()
    cfg.parallel.zero_stage = 3
    with pytest.raises(ConfigError, match="ZeRO-3 would partition"):
        validate_layout(cfg, 2)


def test_stage0_clipping_needs_fp32() -> None:
    cfg = _cfg(**{"parallel.zero_stage": 0, "train.precision": "bf16", "optim.grad_clip": 1.0})
    with pytest.raises(ConfigError, match="stage 0 with gradient clipping"):
        validate_layout(cfg, 2)
    validate_layout(
        _cfg(**{"parallel.zero_stage": 0, "train.precision": "bf16", "optim.grad_clip": 0}), 2
    )


def test_topology_groups_arithmetic() -> None:
    import torch

    t = Topology(
        rank=5, world_size=8, local_rank=1, ep_size=4, backend="gloo", device=torch.device("cpu")
    )
    assert t.ep_rank == 1 and t.expert_dp_size == 2 and t.dp_size == 8
    assert t.ep_ranks() == [4, 5, 6, 7]
    assert t.expert_dp_ranks() == [1, 5]
    assert t.local_expert_range(16) == (4, 8)
    assert t.ep_group_name == "ep_size_4"


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_deepspeed_config(stage: int, tmp_path) -> None:
    cfg = _cfg(**{"parallel.zero_stage": stage, "optim.grad_clip": 0.5, "train.precision": "fp32"})
    ds = deepspeed_config(cfg, 4)
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 2
    assert ds["train_batch_size"] == 16
    assert ds["zero_optimization"]["stage"] == stage
    assert ds["zero_allow_untested_optimizer"] is True
    # stage 0: DeepSpeed's clipping is off, moetrain clips with the correct global norm
    assert ds["gradient_clipping"] == (0.0 if stage == 0 else 0.5)
    assert not ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert "offload_optimizer" not in ds["zero_optimization"]
    path = dump_deepspeed_config(ds, tmp_path / "run")
    assert json.loads(path.read_text()) == ds


def test_deepspeed_config_precision_and_offload() -> None:
    ds = deepspeed_config(
        _cfg(**{"train.precision": "bf16", "parallel.offload_optimizer": True}), 2
    )
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    ds = deepspeed_config(_cfg(**{"train.precision": "fp16"}), 2)
    assert ds["fp16"]["enabled"] and ds["fp16"]["loss_scale"] == 0
