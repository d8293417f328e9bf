"""Hugging Face sources that cannot start a model are refused naming the tensor, before
anything is written: weights holding NaN or inf (attention, an expert, a stacked expert read
row by row), and a multi-token-prediction layer without its projection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetrain.checkpoint.format import CheckpointError
from moetrain.checkpoint.write import write_checkpoint
from moetrain.convert.export import convert_checkpoint
from moetrain.convert.importer import import_hf_checkpoint
from moetrain.init_from.source import open_init_source
from moetrain.model import param_names as pn
from tests.helpers.convert_models import model_for, tiny_cfg
from tests.helpers.hf_models import save_hf_model, save_hf_tokenizer

pytest.importorskip("transformers")


def _rewrite(src: Path, change) -> None:
    """Apply ``change`` to the tensors of ``src``'s single safetensors file."""
    path = src / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("family", "tensor", "value"),
    [
        ("mixtral", "model.layers.0.self_attn.q_proj.weight", float("nan")),
        ("mixtral", "model.layers.1.block_sparse_moe.experts.3.w2.weight", float("inf")),
        ("gpt_oss", "model.layers.1.mlp.experts.down_proj", float("-inf")),  # read by rows
    ],
)
def test_non_finite_weights_are_refused_by_tensor_name(tmp_path, family, tensor, value) -> None:
    src = save_hf_model(family, tmp_path / "src")

    def poison(tensors: dict[str, torch.Tensor]) -> None:
        assert tensor in tensors, sorted(tensors)
        tensors[tensor].view(-1)[-1] = value

    _rewrite(src, poison)
    with pytest.raises(CheckpointError, match=rf"tensor {tensor} holds non-finite values"):
        import_hf_checkpoint(src, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_an_mtp_layer_without_its_projection_is_refused_naming_it(tmp_path) -> None:
    """A DeepSeek-V3 export with one MTP module whose ``eh_proj`` is gone: the layer's other
    tensors are there, so the source is refused naming the missing tensor (not read as a
    model without MTP modules, nor as one with none to give)."""
    vocab = 300
    cfg = tiny_cfg("deepseek_v3", {"model.mtp_depth": 1, "model.vocab_size": vocab})
    model = model_for(cfg)
    state = model.state_dict()
    parts = [("dense", {k: v for k, v in state.items() if not pn.parse_experts(k)})]
    for layer in cfg.moe.moe_layers(cfg.model.n_blocks):
        parts.append(
            (
                f"layers.{layer}",
                {
                    k: v
                    for k, v in state.items()
                    if pn.parse_experts(k) and k.startswith(f"layers.{layer}.")
                },
            )
        )
    tok = save_hf_tokenizer(["the cat sat on the mat"] * 20, vocab, tmp_path / "tok")
    ckpt = write_checkpoint(tmp_path / "ckpt", cfg, parts, sorted(tok.iterdir()))
    src = convert_checkpoint(ckpt, tmp_path / "hf", fmt="deepseek_v3")
    assert json.loads((src / "config.json").read_text())["num_nextn_predict_layers"] == 1
    missing = "model.layers.3.eh_proj.weight"
    _rewrite(src, lambda tensors: tensors.pop(missing))
    with pytest.raises(CheckpointError, match=rf"tensor {missing} is missing"):
        open_init_source(str(src))
    with pytest.raises(CheckpointError, match=rf"tensor {missing} is missing"):
        import_hf_checkpoint(src, tmp_path / "back", overrides=["model.mtp_depth=1"])
    assert not (tmp_path / "back").exists()
