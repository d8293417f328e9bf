"""A model trained with multi-token prediction exports to a family whose files cannot hold MTP
layers with ``moetrain convert --drop-mtp``: the main model's logits in transformers, no MTP
tensor in the files; without the option the refusal names it."""

from __future__ import annotations

import json

import pytest
import torch

from moetrain.checkpoint.write import write_checkpoint
from moetrain.cli import main
from moetrain.convert.hf_files import HFWeights
from moetrain.model import param_names as pn
from tests.helpers.convert_models import model_for, tiny_cfg
from tests.helpers.hf_models import save_hf_tokenizer

transformers = pytest.importorskip("transformers")
VOCAB = 300


def _checkpoint(tmp_path, fmt: str):
    cfg = tiny_cfg(fmt, {"model.mtp_depth": 2, "model.vocab_size": VOCAB})
    model = model_for(cfg)
    state = model.state_dict()
    parts = [("dense", {k: v for k, v in state.items() if not pn.parse_experts(k)})]
    for layer in cfg.moe.moe_layers(cfg.model.n_blocks):
        experts = {pn.experts(layer, w): state[pn.experts(layer, w)] for w in ("w13", "w2")}
        parts.append((f"layers.{layer}", experts))
    tok = save_hf_tokenizer(["the cat sat on the mat"] * 20, VOCAB, tmp_path / "tok")
    return write_checkpoint(tmp_path / "ckpt", cfg, parts, sorted(tok.iterdir())), model, cfg


@pytest.mark.parametrize("fmt", ["qwen3_moe", "deepseek_v3"])
def test_drop_mtp_exports_the_main_model(tmp_path, capsys, fmt) -> None:
    ckpt, model, cfg = _checkpoint(tmp_path, fmt)
    out = tmp_path / "hf"
    if fmt == "qwen3_moe":  # a grouped-query family: refused, naming the option
        assert main(["convert", str(ckpt), str(out)]) == 2
        err = capsys.readouterr().err
        assert "model.mtp_depth=2: Qwen3MoeForCausalLM computes" in err and "--drop-mtp" in err
        assert main(["convert", str(ckpt), str(out), "--format", fmt]) == 2
        assert "--drop-mtp" in capsys.readouterr().err
        assert not out.exists()
    assert main(["convert", str(ckpt), str(out), "--drop-mtp"]) == 0
    names = HFWeights(out).names()
    n = cfg.model.n_layers
    assert not any(
        name.startswith((f"model.layers.{n}.", f"model.layers.{n + 1}.")) for name in names
    )
    written = json.loads((out / "config.json").read_text())
    assert written["num_hidden_layers"] == n and not written.get("num_nextn_predict_layers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == written["architectures"][0]
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.eval()(ids).logits
        torch.testing.assert_close(hf(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
