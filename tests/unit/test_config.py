"""Config loading, overrides and validation errors (each names the dotted key)."""

from pathlib import Path

import pytest

from moetrain.config import Config, ConfigError, config_from_dict, load_config
from moetrain.config.layout import check_layout

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_configs_directory_is_not_empty():
    assert any(p.name == "tiny-cpu.yaml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads_and_validates(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert config_from_dict(cfg.to_dict()) == cfg


def test_defaults_without_file():
    assert load_config() == Config()


def test_overrides_are_typed_and_nested():
    cfg = load_config(
        ROOT / "configs/tiny-cpu.yaml",
        [
            "moe.num_experts=16",
            "optim.lr=1e-3",
            "model.tie_embeddings=true",
            "logging.wandb.tags=[a, b]",
        ],
    )
    assert cfg.moe.num_experts == 16
    assert cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.model.tie_embeddings is True
    assert cfg.logging.wandb.tags == ["a", "b"]


def test_int_widens_to_float_but_not_the_reverse():
    assert load_config(None, ["optim.lr=1"]).optim.lr == 1.0
    with pytest.raises(ConfigError, match=r"model\.d_model: expected int, got 1\.5"):
        load_config(None, ["model.d_model=1.5"])


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("moe.bogus=1", r"moe\.bogus: unknown key; allowed keys here: num_experts"),
        ("bogus.x=1", r"bogus: unknown key"),
        ("train.max_steps=abc", r"train\.max_steps: expected int, got 'abc'"),
        ("model.tie_embeddings=3", r"model\.tie_embeddings: expected bool"),
        ("moe.score_func=tanh", r"moe\.score_func: expected 'softmax' \| 'sigmoid'"),
        ("model.n_heads=3", r"model\.n_heads: must divide model\.d_model=128"),
        ("model.n_kv_heads=3", r"model\.n_kv_heads: must divide model\.n_heads=4"),
        ("moe.top_k=9", r"moe\.top_k: must be between 1 and moe\.num_experts=8; got 9"),
        ("moe.top_k=0", r"moe\.top_k: must be >= 1; got 0"),
        ("parallel.ep_size=3", r"parallel\.ep_size: must divide moe\.num_experts=8; got 3"),
        ("parallel.zero_stage=4", r"parallel\.zero_stage: must be in \[0, 3\]"),
        ("parallel.bucket_elements=0", r"parallel\.bucket_elements: must be > 0"),
        ("data.seq_len=4096", r"data\.seq_len: must be <= model\.max_seq_len=256"),
        ("moe.first_k_dense=9", r"moe\.first_k_dense: must be between 0 and model\.n_layers=4"),
        ("moe.capacity_factor=-1", r"moe\.capacity_factor: must be >= 0 \(0 = dropless\); got -1"),
        ("moe.aux_loss_scope=batch", r"moe\.aux_loss_scope: expected 'micro_batch' \|"),
        ("moe.n_group=3", r"moe\.n_group: must be >= 1 and divide moe\.num_experts=8; got 3"),
        ("moe.n_group=0", r"moe\.n_group: must be >= 1"),
        ("moe.topk_group=2", r"moe\.topk_group: must be between 1 and moe\.n_group=1; got 2"),
        ("moe.n_group=8", r"moe\.topk_group: moe\.top_k=2 experts must fit in topk_group=1 "),
        ("optim.min_lr_ratio=2", r"optim\.min_lr_ratio: must be in \[0, 1\]"),
        ("moe.shared_expert_gate=true", r"moe\.shared_expert_gate: needs moe\.num_shared_experts"),
        ("model.head_dim=7", r"model\.head_dim: must be even"),
        ("model.loss_chunk_tokens=-1", r"model\.loss_chunk_tokens: must be >= 0"),
        ("model=3", r"model: expected a mapping"),
        ("noequals", r"expected KEY=VALUE"),
    ],
)
def test_bad_values_name_the_key(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(ROOT / "configs/tiny-cpu.yaml", [override])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping at the top level"):
        load_config(lst)


def test_world_layout_checks():
    cfg = load_config(None, ["parallel.ep_size=4", "train.micro_batch_size=2"])
    assert check_layout(cfg, 8) == 8
    with pytest.raises(ConfigError, match=r"parallel\.ep_size: must divide the world size 6"):
        check_layout(cfg, 6)
    cfg = load_config(None, ["train.micro_batch_size=2", "train.global_batch_size=10"])
    with pytest.raises(ConfigError, match=r"train\.global_batch_size: 10 != .* = 8"):
        check_layout(cfg, 4)
