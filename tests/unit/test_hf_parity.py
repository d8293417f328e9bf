"""Parity with a model nobody here wrote: Hugging Face transformers' MixtralForCausalLM, with
weights copied through moetrain.convert.hf, gives the same logits as moetrain's Transformer."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from moetrain.config import Config, ConfigError
from moetrain.convert.formats import hf_config
from moetrain.convert.hf import from_hf_state_dict, to_hf_state_dict
from moetrain.model import Transformer
from tests.helpers.configs import tiny_config

transformers = pytest.importorskip("transformers")


def tiny_cfg(**moe_kw) -> Config:
    """The tiny model as these tests have it; ``moe_kw``: MoEConfig fields."""
    return tiny_config(
        {
            "model.vocab_size": 96,
            "model.dense_hidden": 1024,
            "model.rope_theta": 5000.0,
            "model.norm_eps": 1e-6,
            "moe.expert_hidden": 24,
        },
        {f"moe.{k}": v for k, v in moe_kw.items()},
    )


def ours(cfg: Config) -> Transformer:
    torch.manual_seed(0)
    m = Transformer(cfg.model, cfg.moe).eval()
    with torch.no_grad():  # non-trivial norms, so a swapped norm would show
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return m


def load_hf(cfg: Config, model: Transformer, tmp_path, attn: str):
    """Write config.json + model.safetensors in Mixtral's per-expert layout, then from_pretrained."""
    hf_cfg = hf_config(cfg, "mixtral")
    hf_cfg.save_pretrained(tmp_path)
    save_file(
        to_hf_state_dict(model.state_dict(), cfg, "mixtral"), str(tmp_path / "model.safetensors")
    )
    hf, info = transformers.MixtralForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation=attn, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return hf.eval()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_mixtral_logits_match(tmp_path, attn: str) -> None:
    cfg = tiny_cfg()
    model = ours(cfg)
    hf = load_hf(cfg, model, tmp_path, attn)
    assert hf.config._attn_implementation == attn
    ids = torch.randint(0, cfg.model.vocab_size, (2, 17))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        got = model(ids).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert ref.abs().max() > 1e-2  # not trivially zero


def test_tied_embeddings_and_config_fields(tmp_path) -> None:
    cfg = tiny_cfg()
    cfg.model.tie_embeddings = True
    model = ours(cfg)
    hf = load_hf(cfg, model, tmp_path, "eager")
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["tie_word_embeddings"] is True and saved["num_local_experts"] == 4
    ids = torch.randint(0, cfg.model.vocab_size, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids).logits, hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5
        )


def test_round_trip_through_both_hf_layouts(tmp_path) -> None:
    cfg = tiny_cfg()
    model = ours(cfg)
    sd = model.state_dict()
    per_expert = to_hf_state_dict(sd, cfg, "mixtral")
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in per_expert
    for layout in (per_expert, load_hf(cfg, model, tmp_path, "eager").state_dict()):
        back = from_hf_state_dict(layout, cfg, "mixtral")
        assert set(back) == set(sd)
        for k in sd:
            torch.testing.assert_close(back[k], sd[k], atol=0, rtol=0, msg=k)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        (dict(num_shared_experts=1), "moe.num_shared_experts"),
        (dict(score_func="sigmoid"), "moe.score_func"),
        (dict(topk_before_score=True), "moe.topk_before_score"),
        (dict(renormalize=False), "moe.renormalize"),
        (dict(route_scale=2.0), "moe.route_scale"),
        (dict(first_k_dense=1), "moe.first_k_dense"),
        (dict(moe_every=2), "moe.moe_every"),
        (dict(bias_update_rate=0.01), "moe.bias_update_rate"),
        (dict(capacity_factor=1.25), "moe.capacity_factor"),
    ],
)
def test_settings_mixtral_cannot_represent_are_refused(override: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        hf_config(tiny_cfg(**override), "mixtral")


def test_qk_norm_and_nonzero_bias_are_refused() -> None:
    cfg = tiny_cfg()
    cfg.model.qk_norm = True
    with pytest.raises(ConfigError, match="model.qk_norm"):
        hf_config(cfg, "mixtral")
    cfg = tiny_cfg()
    sd = ours(cfg).state_dict()
    sd["layers.0.ffn.router.expert_bias"] = torch.ones(4)
    with pytest.raises(ConfigError, match="expert_bias"):
        to_hf_state_dict(sd, cfg, "mixtral")
