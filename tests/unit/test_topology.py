"""Layout validation (fails fast, before any process group) and the DeepSpeed config."""

from __future__ import annotations

import json

import pytest
import torch

from moetrain.config import ConfigError, load_config
from moetrain.config.layout import check_layout
from moetrain.config.sections import CPU_BUCKET_ELEMENTS, GPU_BUCKET_ELEMENTS
from moetrain.parallel.deepspeed import deepspeed_config, dump_deepspeed_config
from moetrain.parallel.topology import Topology
from tests.helpers.configs import tiny_config


def _cfg(**kw: object):
    base = {"moe.num_experts": 8, "train.micro_batch_size": 2, "train.grad_accum_steps": 2}
    base.update(kw)
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


def test_valid_layouts() -> None:
    assert check_layout(_cfg(**{"parallel.ep_size": 2}), 4) == 4
    assert check_layout(_cfg(**{"parallel.ep_size": 1}), 1) == 1
    assert check_layout(_cfg(**{"train.global_batch_size": 16}), 4) == 4


def test_ep_must_divide_world() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.ep_size: must divide the world size 3"):
        check_layout(_cfg(**{"parallel.ep_size": 2}), 3)


def test_ep_must_divide_experts() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.ep_size: must divide moe\.num_experts=8"):
        load_config(None, ["moe.num_experts=8", "parallel.ep_size=3"])
    cfg = _cfg()
    cfg.parallel.ep_size = 3  # bypassing load_config's check: check_layout checks again
    with pytest.raises(ConfigError, match="moe.num_experts=8"):
        check_layout(cfg, 6)


def test_global_batch_mismatch() -> None:
    cfg = _cfg(**{"train.global_batch_size": 10})
    with pytest.raises(ConfigError, match=r"train\.global_batch_size: 10 != .* = 16"):
        check_layout(cfg, 4)


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ({"parallel.shadow_experts": 1}, r"parallel\.shadow_experts: not supported with parallel"),
        ({"train.precision": "fp16"}, r"train\.precision: fp16 is not supported with parallel"),
        ({"parallel.offload_optimizer": "true"}, r"parallel\.offload_optimizer: not supported"),
        (
            {
                "model.attention": "mla",
                "model.n_kv_heads": 4,
                "model.q_lora_rank": 16,
                "model.kv_lora_rank": 16,
                "model.qk_nope_head_dim": 8,
                "model.qk_rope_head_dim": 8,
                "model.v_head_dim": 8,
                "model.index_topk": 4,
                "model.index_n_heads": 2,
                "model.index_head_dim": 8,
            },
            r"model\.index_topk: sparse attention is not supported with parallel",
        ),
        (
            {
                "model.full_attention_interval": 2,
                "model.linear_num_key_heads": 2,
                "model.linear_num_value_heads": 2,
                "model.linear_key_head_dim": 8,
                "model.linear_value_head_dim": 8,
            },
            r"model\.layer_types: linear-attention layers \(gated_deltanet, layers \[0, 2\]\)",
        ),
    ],
)
def test_zero3_refuses_by_key(setting: dict, match: str) -> None:
    check_layout(_cfg(**{"parallel.zero_stage": 3}), 2)  # ZeRO-3 itself is allowed
    with pytest.raises(ConfigError, match=match):
        check_layout(_cfg(**{"parallel.zero_stage": 3, **setting}), 2)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_stage0_needs_fp32(precision: str, clip: float) -> None:
    """Stage 0 cannot hold the bf16/fp16 numerics policy: refused, naming both keys, with or
    without clipping, at config load and again in check_layout."""
    cfg = _cfg(**{"parallel.zero_stage": 0, "train.precision": "fp32", "optim.grad_clip": clip})
    check_layout(cfg, 2)
    cfg.train.precision = precision  # bypassing load_config's check: check_layout checks again
    match = rf"parallel\.zero_stage: stage 0 supports train\.precision=fp32 only; got train\.precision={precision}"
    with pytest.raises(ConfigError, match=match):
        check_layout(cfg, 2)
    with pytest.raises(ConfigError, match="parallel.zero_stage=1 or 2"):
        _cfg(**{"parallel.zero_stage": 0, "train.precision": precision, "optim.grad_clip": clip})


def test_topology_groups_arithmetic() -> None:
    import torch

    t = Topology(
        rank=5, world_size=8, local_rank=1, ep_size=4, backend="gloo", device=torch.device("cpu")
    )
    assert t.ep_rank == 1 and t.expert_dp_size == 2 and t.dp_size == 8
    assert t.ep_ranks() == [4, 5, 6, 7]
    assert t.expert_dp_ranks() == [1, 5]
    assert t.local_experts(16) == (4, 8)
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


def test_deepspeed_config_bucket_size() -> None:
    """Small buckets on CPU (DeepSpeed allocates the reduce bucket every micro-step), large ones
    with CUDA, the config key over both; `moetrain plan` (GPU) counts the CUDA default."""
    zero = deepspeed_config(_cfg(), 2)["zero_optimization"]
    default = GPU_BUCKET_ELEMENTS if torch.cuda.is_available() else CPU_BUCKET_ELEMENTS
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == default
    assert _cfg().parallel.bucket_size(False) == CPU_BUCKET_ELEMENTS
    assert _cfg().parallel.bucket_size(True) == GPU_BUCKET_ELEMENTS
    cfg = _cfg(**{"parallel.bucket_elements": 123_456})
    assert cfg.parallel.bucket_size(True) == cfg.parallel.bucket_size(False) == 123_456
    assert deepspeed_config(cfg, 2)["zero_optimization"]["reduce_bucket_size"] == 123_456


def test_deepspeed_config_precision_and_offload() -> None:
    ds = deepspeed_config(
        _cfg(**{"train.precision": "bf16", "parallel.offload_optimizer": True}), 2
    )
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    ds = deepspeed_config(_cfg(**{"train.precision": "fp16"}), 2)
    assert ds["fp16"]["enabled"] and ds["fp16"]["loss_scale"] == 0


def test_deepspeed_moe_marker_shim() -> None:
    """Experts become DeepSpeed MoE modules with per-expert state-dict keys (one file per
    global expert in DeepSpeed checkpoints) that load back into the stacked weights."""
    import torch
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import is_moe_param

    from moetrain.model.transformer import Transformer
    from moetrain.parallel.deepspeed import mark_experts_for_deepspeed
    from moetrain.parallel.expert_parallel import moe_layers, slice_experts

    cfg = tiny_config(model__n_layers=1, model__dense_hidden=1024, model__max_seq_len=2048)

    def topo(ep: int) -> Topology:
        return Topology(rank=1, world_size=2, local_rank=1, ep_size=ep, backend="gloo",
                        device=torch.device("cpu"))  # fmt: skip

    def build(ep: int) -> Transformer:
        torch.manual_seed(0)
        model = Transformer(cfg.model, cfg.moe)
        for _, layer in moe_layers(model):
            slice_experts(layer.experts, *topo(ep).local_experts(4))
        return model

    # marking changes nothing in the computation (ep 1: all experts local)
    x = torch.randint(0, 64, (2, 8))
    marked, plain = build(1), build(1)
    mark_experts_for_deepspeed(marked, topo(1))
    torch.testing.assert_close(marked(x).logits, plain(x).logits, rtol=0, atol=0)

    # ep 2, rank 1: experts 2 and 3 are local
    model = build(2)
    assert mark_experts_for_deepspeed(model, topo(2)) == 1
    experts = model.layers[0].ffn.experts
    assert isinstance(experts, MoE) and experts.num_experts == 4
    assert experts.num_local_experts == 2 and experts.expert_group_name == "ep_size_2"
    for name, p in model.named_parameters():
        assert is_moe_param(p) == (".experts." in name)
        if ".experts." in name:
            assert p.group_name == "ep_size_2"
    torch.testing.assert_close(experts.w13, plain.layers[0].ffn.experts.w13[2:4])

    sd = model.state_dict()
    prefix = "layers.0.ffn.experts."
    assert prefix + "w13" not in sd
    key = prefix + "deepspeed_moe.experts.deepspeed_experts.1.w2"
    torch.testing.assert_close(sd[key], experts.w2[1].detach())
    assert len([k for k in sd if k.startswith(prefix)]) == 2 * 2

    other = build(2)
    mark_experts_for_deepspeed(other, topo(2))
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    other.load_state_dict(sd)
    for name in ("w13", "w2"):
        torch.testing.assert_close(
            getattr(other.layers[0].ffn.experts, name), getattr(experts, name)
        )


def test_accelerate_settings_that_disagree_are_reported() -> None:
    from moetrain.train.launcher_env import launcher_disagreements

    cfg = _cfg(**{"parallel.zero_stage": 1})
    assert launcher_disagreements(cfg, {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}) == []
    env = {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2",
        "ACCELERATE_MIXED_PRECISION": "bf16",
    }
    msgs = launcher_disagreements(cfg, env)
    assert len(msgs) == 2
    assert "parallel.zero_stage gives 1" in msgs[0] and "train.precision gives no" in msgs[1]


def test_rank_builds_only_its_experts_with_the_full_models_weights() -> None:
    """``Transformer(..., local_experts=...)`` allocates only this rank's experts, with the
    values the full model (same seed) has there; apply_expert_parallel takes either model and
    refuses one holding other experts than this rank's."""
    import torch

    from moetrain.model.transformer import Transformer
    from moetrain.parallel.expert_parallel import apply_expert_parallel, moe_layers

    cfg = tiny_config(model__dense_hidden=1024, model__max_seq_len=2048)

    def topo(ep_rank: int) -> Topology:
        return Topology(rank=ep_rank, world_size=2, local_rank=ep_rank, ep_size=2,
                        backend="gloo", device=torch.device("cpu"))  # fmt: skip

    def build(local: tuple[int, int] | None) -> Transformer:
        torch.manual_seed(0)
        return Transformer(cfg.model, cfg.moe, local_experts=local)

    full = build(None).state_dict()
    for ep_rank, (lo, hi) in enumerate([(0, 2), (2, 4)]):
        local = build((lo, hi))
        for name, value in local.state_dict().items():
            is_expert = ".experts." in name
            assert value.shape[0] == (2 if is_expert else full[name].shape[0]), name
            assert torch.equal(value, full[name][lo:hi] if is_expert else full[name]), name
        sliced = apply_expert_parallel(build(None), topo(ep_rank)).state_dict()
        apply_expert_parallel(local, topo(ep_rank))
        assert all(torch.equal(v, sliced[k]) for k, v in local.state_dict().items())
        assert all(layer.experts.local_experts[0] == lo for _, layer in moe_layers(local))
    with pytest.raises(ValueError, match=r"holds experts \[2, 4\) of 4; EP rank 0 of 2"):
        apply_expert_parallel(build((2, 4)), topo(0))


@pytest.mark.parametrize("initialised", [False, True], ids=["fresh", "launcher_started"])
def test_each_rank_selects_its_own_gpu(initialised: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both branches of init_distributed make cuda:LOCAL_RANK the current device (stopped
    right after, before DeepSpeed: no GPU here)."""
    import deepspeed
    import torch.distributed as dist

    from moetrain.config import Config
    from moetrain.parallel import topology

    class Stop(Exception):
        pass

    def stop(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise Stop

    selected = []
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: initialised)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 1)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(deepspeed, "init_distributed", stop)
    with pytest.raises(Stop):
        topology.init_distributed(Config())
    assert selected and all(d in (3, torch.device("cuda", 3)) for d in selected)
