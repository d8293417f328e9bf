"""Granite 4.0-H (``granitemoehybrid``) both ways over rows of many Mamba-2 chunks, with RoPE and
without it (as released): transformers' model imported gives its logits, moetrain's export
loads in transformers with the same logits, and a packed row of documents gives each
document's logits alone."""

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


def _hf(path):  # noqa: ANN001, ANN202
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Within 1e-5 of the logits' scale (fp32)."""
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize(
    "position",
    [pytest.param("rope", marks=pytest.mark.long), "nope"],  # (nope as released)
)
def test_long_rows_and_packed_documents_both_ways(position: str, tmp_path) -> None:
    """Rows of 150 tokens (19 chunks of 8) both ways; a row packing documents of 60, 1 and 89
    tokens equals transformers' logits of each document alone."""
    tok = save_hf_tokenizer(["def f(x):\n    return x + 1"] * 20, 300, tmp_path / "tok")
    overrides = dict(LONG, position_embedding_type=position)
    src = save_hf_model("granitemoehybrid", tmp_path / "src", tokenizer=tok, overrides=overrides)
    hf = _hf(src)
    ids = torch.randint(0, 300, (2, 150), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    ckpt = import_hf_checkpoint(src, tmp_path / "ckpt")
    model, cfg = load_model(ckpt)
    assert cfg.model.nope_layers == ([1] if position == "nope" else None)
    model.eval()
    lengths = [60, 1, 89]
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
    with torch.no_grad():
        _close(model(ids).logits, ref)
        packed = model(ids[:1], doc_ids_BS=docs).logits
        alone = torch.cat([hf(input_ids=d).logits for d in ids[:1].split(lengths, dim=1)], 1)
    _close(packed, alone)
    # (the documents do change the logits: by 100 times the tolerance)
    assert (packed - ref[:1]).abs().max() > 1e-3 * ref.abs().max()
    out = convert_checkpoint(ckpt, tmp_path / "hf")
    with torch.no_grad():
        _close(_hf(out)(input_ids=ids).logits, ref)
