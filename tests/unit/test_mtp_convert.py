"""Multi-token-prediction modules in and out of Hugging Face files, in the layout of DeepSeek-V3's
released checkpoints (``model.layers.<n_layers + k - 1>.``) and of Qwen3-Next's and Qwen3.5's
(``mtp.*``): transformers loads the export and computes the main model; moetrain reads the MTP
modules back exactly, or leaves them unread."""

from __future__ import annotations

import json

import pytest
import torch

from moetrain.checkpoint.format import CheckpointError
from moetrain.checkpoint.read import load_model
from moetrain.checkpoint.write import write_checkpoint
from moetrain.config import ConfigError
from moetrain.convert.export import convert_checkpoint
from moetrain.convert.formats import check_format
from moetrain.convert.hf_files import HFWeights
from moetrain.convert.importer import import_hf_checkpoint
from moetrain.model import param_names as pn
from tests.helpers.convert_models import model_for, tiny_cfg
from tests.helpers.hf_models import save_hf_tokenizer

VOCAB = 300

transformers = pytest.importorskip("transformers")


def _parts(model, cfg):
    state = model.state_dict()
    dense = {k: v for k, v in state.items() if not pn.parse_experts(k)}
    yield "dense", dense
    for layer in cfg.moe.moe_layers(cfg.model.n_blocks):
        yield (
            f"layers.{layer}",
            {pn.experts(layer, w): state[pn.experts(layer, w)] for w in ("w13", "w2")},
        )


DEEPSEEK_MTP = [
    f"model.layers.3.{n}.weight"
    for n in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens")
]
QWEN_MTP = [
    f"mtp.{n}.weight" for n in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
]
# format -> (the MTP module's own tensors, its block's prefix, config.json's count key)
LAYOUTS = {
    "deepseek_v3": (DEEPSEEK_MTP, "model.layers.3.", "num_nextn_predict_layers"),
    "glm4_moe": (DEEPSEEK_MTP, "model.layers.3.", "num_nextn_predict_layers"),
    "qwen3_next": (QWEN_MTP, "mtp.layers.0.", "num_nextn_predict_layers"),
    "qwen3_5_moe_text": (QWEN_MTP, "mtp.layers.0.", "mtp_num_hidden_layers"),
}


@pytest.mark.parametrize("fmt", LAYOUTS)
def test_mtp_modules_export_in_the_released_layout_and_import_exactly(tmp_path, fmt) -> None:
    cfg = tiny_cfg(fmt, {"model.mtp_depth": 1, "model.vocab_size": VOCAB})
    model = model_for(cfg)
    tok = save_hf_tokenizer(["the cat sat on the mat"] * 20, VOCAB, tmp_path / "tok")
    ckpt = write_checkpoint(tmp_path / "ckpt", cfg, _parts(model, cfg), sorted(tok.iterdir()))
    out = convert_checkpoint(ckpt, tmp_path / "hf", fmt=fmt)
    own, block, key = LAYOUTS[fmt]
    assert json.loads((out / "config.json").read_text()).get(key) == 1
    names = set(HFWeights(out).names())
    assert set(own) <= names
    assert {f"{block}input_layernorm.weight", f"{block}self_attn.o_proj.weight"} <= names
    assert any(n.startswith(f"{block}mlp.experts.") for n in names)  # the MTP block is MoE

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(
            hf(input_ids=ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5
        )

    back = import_hf_checkpoint(out, tmp_path / "back", overrides=["model.mtp_depth=1"])
    reloaded, back_cfg = load_model(back)
    assert back_cfg.model.mtp_depth == 1
    want, got = model.state_dict(), reloaded.state_dict()
    assert set(want) == set(got)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)
    labels = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        a, b = model(ids, labels_BS=labels), reloaded.eval()(ids, labels_BS=labels)
    torch.testing.assert_close(a.mtp_loss, b.mtp_loss, rtol=0, atol=0)

    main_only = import_hf_checkpoint(out, tmp_path / "main-only")
    _, main_cfg = load_model(main_only)
    assert main_cfg.model.mtp_depth == 0
    with pytest.raises((CheckpointError, ConfigError), match="model.mtp_depth"):
        import_hf_checkpoint(out, tmp_path / "deeper", overrides=["model.mtp_depth=2"])
    assert not (tmp_path / "deeper").exists()


def test_a_qwen3_next_directory_without_the_mtp_count_holds_its_module(tmp_path) -> None:
    """Qwen3-Next's config.json has no MTP count: its ``mtp.*`` tensors are the one module vLLM
    reads, imported on request; a second is refused by key."""
    cfg = tiny_cfg("qwen3_next", {"model.mtp_depth": 1, "model.vocab_size": VOCAB})
    model = model_for(cfg)
    tok = save_hf_tokenizer(["the cat sat on the mat"] * 20, VOCAB, tmp_path / "tok")
    ckpt = write_checkpoint(tmp_path / "ckpt", cfg, _parts(model, cfg), sorted(tok.iterdir()))
    out = convert_checkpoint(ckpt, tmp_path / "hf", fmt="qwen3_next")
    hf = json.loads((out / "config.json").read_text())
    del hf["num_nextn_predict_layers"]
    (out / "config.json").write_text(json.dumps(hf))
    back = import_hf_checkpoint(out, tmp_path / "back", overrides=["model.mtp_depth=1"])
    assert load_model(back)[1].model.mtp_depth == 1
    with pytest.raises(ConfigError, match="model.mtp_depth: cannot convert"):
        check_format("qwen3_next", tiny_cfg("qwen3_next", {"model.mtp_depth": 2}).model, cfg.moe)


def test_a_family_without_mtp_layers_refuses_them_by_key() -> None:
    cfg = tiny_cfg("qwen3_moe", {"model.mtp_depth": 1})
    with pytest.raises(ConfigError, match="model.mtp_depth"):
        check_format("qwen3_moe", cfg.model, cfg.moe)
