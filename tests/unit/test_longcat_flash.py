"""LongCat-Flash's pieces as model options, each against a written-out reference: the shortcut
MoE (``moe.shortcut``) through a two-block model, the latent attention's LoRA scales
(``model.mla_lora_scale``) as the reparametrisation they are; their refusals by key; and the
released directory with its multi-token-prediction layers (``model.mtp.*``) imported, as
transformers loads it, leaving them unread. The family's logits both ways are in
tests/unit/test_convert_logits.py and tests/unit/test_released_configs.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetrain.checkpoint.read import load_model
from moetrain.config import ConfigError
from moetrain.convert.families import family
from moetrain.convert.importer import import_hf_checkpoint
from moetrain.model import Transformer
from moetrain.model.mixers import MixerInputs
from tests.helpers.configs import tiny_config
from tests.helpers.convert_cases import MLA_SHAPE, model_for
from tests.helpers.hf_models import save_hf_model

SHORTCUT = {
    "model.n_layers": 4,
    "moe.shortcut": True,
    "moe.layer_ffns": ["moe", "dense"] * 2,
    "moe.zero_experts": 2,
    "moe.top_k": 3,
}
MLA = {f"model.{k}": v for k, v in MLA_SHAPE.items()} | {"model.q_lora_rank": 12}


def test_shortcut_moe_joins_the_stream_one_block_later() -> None:
    """Each pair of blocks, written out: the MoE reads the first block's FFN input, its dense
    FFN joins the stream at once and the experts' output after the second block."""
    cfg = tiny_config(SHORTCUT)
    model = model_for(cfg)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        got = model(ids).logits
        x = model.embed(ids)
        cos, sin = model._rope(0, 9, 9)
        inputs = MixerInputs(cos, sin, None, None, 0)
        for first, second in zip(model.layers[0::2], model.layers[1::2], strict=True):
            x = x + first.attn(first.attn_norm(x), inputs)
            h = first.ffn_norm(x)
            experts, _ = first.ffn(h)
            x = x + first.dense(h)
            x = x + second.attn(second.attn_norm(x), inputs)
            x = x + second.ffn(second.ffn_norm(x)) + experts
        want = model.head(model.norm(x))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # (negative control: the experts joining the first block's stream instead differ)
    cfg_plain = tiny_config({**SHORTCUT, "moe.shortcut": False})
    assert not torch.allclose(Transformer(cfg_plain.model, cfg_plain.moe)(ids).logits, got)


def test_lora_scales_are_the_scaled_projections() -> None:
    """``model.mla_lora_scale`` equals the unscaled attention with ``wq_b`` times
    sqrt(D / q_lora_rank) and the KV latent's norm weight times sqrt(D / kv_lora_rank)."""
    scaled = tiny_config(MLA, {"model.mla_lora_scale": True})
    plain = tiny_config(MLA)
    a, b = model_for(scaled), model_for(plain)
    d = scaled.model.d_model
    with torch.no_grad():
        for layer in b.layers:
            layer.attn.wq_b.weight.mul_((d / 12) ** 0.5)
            layer.attn.kv_norm.weight.mul_((d / 16) ** 0.5)
        ids = torch.randint(0, 64, (2, 9))
        got, want, before = a(ids).logits, b(ids).logits, model_for(plain)(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - before).abs().max() > 1e-3  # (the scales change the logits)


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({**SHORTCUT, "moe.layer_ffns": ["moe", "moe", "moe", "dense"]}, "moe.shortcut"),
        (
            {**SHORTCUT, "model.n_layers": 3, "moe.layer_ffns": ["moe", "dense", "moe"]},
            "moe.shortcut",
        ),
        ({**SHORTCUT, "model.mtp_depth": 1}, "model.mtp_depth"),
        (
            {"model.mla_lora_scale": True, **{k: v for k, v in MLA.items() if "q_lora" not in k}},
            "model.mla_lora_scale",
        ),
    ],
)
def test_refused_by_key(settings: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_config(settings)


def test_families_without_the_pieces_refuse_them_by_key() -> None:
    cfg = tiny_config(SHORTCUT, MLA, {"model.mla_lora_scale": True})
    refused = {key for key, _ in family("deepseek_v3").problems(cfg.model, cfg.moe)}
    assert {"moe.shortcut", "moe.zero_experts", "model.mla_lora_scale"} <= refused
    assert family("longcat_flash").problems(cfg.model, cfg.moe) == [
        ("model.rope_interleave", "LongcatFlashForCausalLM rotates adjacent pairs; must be true"),
        (
            "moe.renormalize",
            "LongcatFlashForCausalLM does not renormalise the top-k weights; must be false",
        ),
    ]


def test_released_directory_with_mtp_layers_imports_them_unread(tmp_path) -> None:
    """The released files hold multi-token-prediction layers under ``model.mtp.`` that
    transformers' class ignores: the import reads the rest and gives transformers' logits."""
    import transformers

    src = save_hf_model("longcat_flash", tmp_path / "src")
    weights = load_file(str(src / "model.safetensors"))
    weights["model.mtp.layers.0.eh_proj.weight"] = torch.randn(32, 64)
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    model, cfg = load_model(import_hf_checkpoint(src, tmp_path / "ckpt"))
    assert (cfg.moe.zero_experts, cfg.moe.shortcut, cfg.model.n_layers) == (2, True, 4)
    ids = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        torch.testing.assert_close(model.eval()(ids).logits, ref, rtol=1e-5, atol=1e-5)


def test_a_router_bias_transformers_never_adds_is_refused() -> None:
    """transformers 5.25's LongCat-Flash router holds ``classifier.bias`` with ``router_bias``
    but scores with the weight alone: such a model is refused, naming the key."""
    from moetrain.convert.formats import config_from_hf
    from tests.helpers.hf_models import hf_config

    hf = hf_config("longcat_flash").to_dict()
    config_from_hf(hf)  # (as released: no router bias)
    with pytest.raises(ConfigError, match="router_bias"):
        config_from_hf({**hf, "router_bias": True})
