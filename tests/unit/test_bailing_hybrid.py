"""Ling 3.0 (``bailing_hybrid``, transformers' ``BailingHybridForCausalLM``): the family against
transformers' model both ways (over several chunks of the KDA rule, packed documents), its
released layer pattern, its multi-token-prediction layers in the released layout (export,
import, transformers ignoring them), and what it cannot hold refused by key both ways."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file
from transformers import BailingHybridConfig

from moetrain.checkpoint.read import load_model
from moetrain.config import ConfigError
from moetrain.convert import formats
from moetrain.convert.families import bailing_hybrid
from moetrain.convert.hf import from_hf_state_dict, to_hf_state_dict
from moetrain.convert.importer import import_hf_checkpoint
from moetrain.model import Transformer
from tests.helpers.convert_cases import load_hf, model_for, tiny_cfg
from tests.helpers.hf_models import hf_config, save_hf_tokenizer
from tests.helpers.recurrent_models import check_family_both_ways, rel
from tests.unit.test_gated_deltanet import torch_matmul  # noqa: F401 (a fixture)

FAMILY = "bailing_hybrid"


def _decays(model: Transformer) -> Transformer:
    """The KDA gates' slopes and biases spread: per-step decays from ~1 to the bound's e^-5."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.copy_(torch.linspace(-1.0, 1.5, p.numel()).view(p.shape))
    return model


def test_ling_family_over_several_chunks_and_packed_both_ways(
    tmp_path,
    torch_matmul,  # noqa: F811
) -> None:
    """The tiny Ling 3.0 case (two KDA layers with full-rank gates and the bounded forget gate,
    latent attention with its head gate, group-limited sigmoid routing, a dense first layer;
    no tensor constant) over 130 tokens (three chunks of the rule): moetrain's logits equal
    transformers' on moetrain's export, transformers' weights imported back give them too (1e-5
    of the logits' scale, fp32), and a packed row of three documents equals each document
    through transformers alone; without the documents (the control) it does not, nor does
    transformers' model with the KDA gates' bound at -4."""
    cfg = tiny_cfg(FAMILY, {"model.max_seq_len": 256})
    model = _decays(model_for(cfg))
    hf = load_hf(cfg, model, FAMILY, tmp_path)
    assert type(hf).__name__ == bailing_hybrid.NAME
    ids = torch.randint(0, 96, (1, 130), generator=torch.Generator().manual_seed(0))
    _, alone = check_family_both_ways(cfg, model, hf, FAMILY, ids, [50, 1, 79])
    with torch.no_grad():
        assert rel(model(ids).logits, alone) > 1e-2
        ref = model(ids).logits
        for layer in hf.model.layers[:2]:  # (control: KDA's bound at -4, not the released -5)
            layer.self_attn.forget_gate.lower_bound = -4.0
        assert rel(hf(input_ids=ids).logits, ref) > 1e-3


def test_released_layer_pattern_both_ways() -> None:
    """12 layers in groups of 6 (Ling-3.0-Flash's layer_group_size): layers 5 and 11 latent
    attention, the others KDA; exported with the same group size and the pattern itself."""
    derived = ("layer_types", "mlp_layer_types", "expert_swiglu_limit_list")
    fields = {k: v for k, v in hf_config(FAMILY).to_dict().items() if k not in derived}
    fields.pop("share_expert_swiglu_limit_list")
    hf = BailingHybridConfig(**{**fields, "num_hidden_layers": 12, "layer_group_size": 6})
    cfg = bailing_hybrid.from_hf(hf)
    full = [i for i, t in enumerate(cfg.model.layer_types) if t == "full_attention"]
    assert full == [5, 11] and cfg.model.linear_attention == "kda"
    fields = bailing_hybrid.to_hf(cfg)
    assert fields["layer_group_size"] == 6 and fields["layer_types"] == cfg.model.layer_types


def test_mtp_layers_in_the_released_layout(tmp_path) -> None:
    """A model with one multi-token-prediction module exports it as layer 3 of the released
    layout (``enorm``, ``hnorm``, ``eh_proj``, a latent-attention layer under ``attention.``
    with its MoE, ``final_layernorm``; no embedding or head copies), which transformers' class
    ignores (nothing unexpected, the same logits as without it), and a directory declaring it
    (``num_nextn_predict_layers``) imports it back tensor for tensor (or leaves it unread)."""
    cfg = tiny_cfg(FAMILY, {"model.mtp_depth": 1})
    model = _decays(model_for(cfg))
    files = to_hf_state_dict(model.state_dict(), cfg, FAMILY)
    # the released names: KDA's output projection o_proj, latent attention's dense
    assert {
        "model.layers.0.attention.o_proj.weight",
        "model.layers.2.attention.dense.weight",
    } <= set(files)
    assert "model.word_embeddings.weight" in files and "model.layers.0.attention.A_log" in files
    mtp = sorted(
        n.removeprefix("model.layers.3.") for n in files if n.startswith("model.layers.3.")
    )
    for name in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "final_layernorm.weight",
        "attention.kv_a_proj_with_mqa.weight",
        "attention.g_proj.weight",
        "attention.dense.weight",
        "mlp.gate.expert_bias",
        "mlp.experts.7.down_proj.weight",
        "mlp.shared_experts.up_proj.weight",
    ):
        assert name in mtp, (name, mtp)
    assert not any("shared_head" in n or "embed" in n for n in mtp)
    back = from_hf_state_dict(files, cfg, FAMILY)
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())

    src = tmp_path / "src"
    formats.hf_config(cfg, FAMILY).save_pretrained(src)  # (num_nextn_predict_layers 1)
    save_file({k: v.contiguous() for k, v in files.items()}, str(src / "model.safetensors"))
    assert json.loads((src / "config.json").read_text())["num_nextn_predict_layers"] == 1
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # (its _keys_to_ignore_on_load_unexpected)
    save_hf_tokenizer(["def f(x):\n    return x"] * 4, 120, src)
    main, mcfg = load_model(import_hf_checkpoint(src, tmp_path / "main"))  # (left unread)
    assert mcfg.model.mtp_depth == 0
    assert all(torch.equal(model.state_dict()[k], v) for k, v in main.state_dict().items())
    ckpt = import_hf_checkpoint(src, tmp_path / "ckpt", overrides=["model.mtp_depth=1"])
    imported, icfg = load_model(ckpt)
    assert icfg.model.mtp_depth == 1
    for k, v in model.state_dict().items():
        assert torch.equal(imported.state_dict()[k], v), k
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = theirs.eval()(input_ids=ids).logits
        torch.testing.assert_close(imported.eval()(ids).logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("expert_swiglu_limit_list", [0, 7.0, 7.0]),
        ("share_expert_swiglu_limit_list", [0, 0, 7.0]),
        ("gated_attention_proj_granularity_type", "element_wise"),
        ("no_kda_lora", False),
        ("moe_shared_expert_intermediate_size", 40),
        ("use_qkv_bias", True),
        ("score_function", "softmax"),
        ("rope_interleave", False),
        ("mlp_layer_types", ["sparse", "dense", "sparse"]),
    ],
)
def test_released_flags_it_cannot_compute_are_refused_by_field(field, value) -> None:
    fields = {**hf_config(FAMILY).to_dict(), field: value}
    with pytest.raises(ConfigError, match=field):
        bailing_hybrid.from_hf(BailingHybridConfig(**fields))


def test_unclamped_and_zero_limits_import() -> None:
    """Zero limits (transformers' no clamping) and the unbounded gate (kda_safe_gate false)."""
    fields = {**hf_config(FAMILY).to_dict(), "expert_swiglu_limit_list": [0, 0, 0]}
    assert bailing_hybrid.from_hf(BailingHybridConfig(**fields)).model.kda_gate_lower_bound == -5
    fields["kda_safe_gate"] = False
    assert bailing_hybrid.from_hf(BailingHybridConfig(**fields)).model.kda_gate_lower_bound is None


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"model.kda_full_rank_gates": False}, "model.kda_full_rank_gates"),
        ({"model.mla_head_gate": False}, "model.mla_head_gate"),
        ({"model.rope_interleave": False}, "model.rope_interleave"),
        ({"model.linear_num_heads": 2}, "model.linear_num_heads"),
        ({"moe.score_func": "softmax"}, "moe.score_func"),
    ],
)
def test_what_the_class_cannot_hold_is_refused_by_key(changes, key) -> None:
    from moetrain.convert.formats import choose_format

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        choose_format(tiny_cfg(FAMILY, changes), FAMILY)
