"""Qwen3-Next, Qwen3.5-MoE and Qwen3.5 (dense, upcycled) both ways over rows longer than several
of the rule's chunks, with strong and weak decays: transformers' model imported gives its logits,
and moetrain's export loads in transformers with the same logits."""

from __future__ import annotations

import pytest
import torch

from moetrain.checkpoint.read import load_model
from moetrain.convert.export import convert_checkpoint
from moetrain.convert.importer import import_hf_checkpoint
from moetrain.model.cpu_matmul import use_cpu_matmul
from tests.helpers.hf_models import save_hf_model, save_hf_tokenizer

transformers = pytest.importorskip("transformers")

LONG = {"max_position_embeddings": 256}  # (the tiny models hold 64 positions)


@pytest.fixture(autouse=True)
def torch_matmul():
    """transformers' matrix kernel on both sides (see tests/unit/test_released_configs.py)."""
    use_cpu_matmul("torch")
    yield
    use_cpu_matmul("onednn")


def _logits(path, ids: torch.Tensor) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(input_ids=ids).logits


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Within 1e-5 of the logits' scale (fp32)."""
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe_text", "qwen3_5_text"])
def test_long_rows_both_ways(family: str, tmp_path) -> None:
    tok = save_hf_tokenizer(["def f(x):\n    return x + 1"] * 20, 300, tmp_path / "tok")
    src = save_hf_model(family, tmp_path / "src", tokenizer=tok, overrides=LONG)
    ids = torch.randint(0, 300, (2, 200), generator=torch.Generator().manual_seed(0))
    ref = _logits(src, ids)
    dense = family == "qwen3_5_text"
    upcycle = ["moe.num_experts=4", "moe.top_k=2"] if dense else None
    ckpt = import_hf_checkpoint(src, tmp_path / "ckpt", overrides=upcycle)
    model, cfg = load_model(ckpt)
    decay = [
        -(b.attn.A_log.exp() * torch.nn.functional.softplus(b.attn.dt_bias)).detach()
        for b in model.layers
        if hasattr(b.attn, "A_log")
    ]
    assert min(float(d.min()) for d in decay) < -5 and max(float(d.max()) for d in decay) > -0.01
    with torch.no_grad():
        _close(model.eval()(ids).logits, ref)
    out = convert_checkpoint(ckpt, tmp_path / "hf")
    _close(_logits(out, ids), ref)
