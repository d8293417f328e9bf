"""Generation through the KV cache gives transformers' greedy tokens and its logits at every
step, for the families whose attention has pieces a cache must carry."""

from __future__ import annotations

import pytest

from tests.helpers.convert_models import load_hf, model_for, sharpened, tiny_cfg
from tests.helpers.decoding import generation_matches

transformers = pytest.importorskip("transformers")


def test_phimoe_generation_matches_transformers(tmp_path) -> None:
    """Generation with the KV cache (one LongRoPE table, the short factors) gives
    transformers' greedy tokens and its logits at every step."""
    cfg = tiny_cfg("phimoe")
    model = model_for(cfg)
    generation_matches(model, load_hf(cfg, model, "phimoe", tmp_path), 12)


def test_llama4_generation_matches_transformers(tmp_path) -> None:
    """Generation with the KV cache across chunk boundaries (chunks of 6; transformers keeps
    a chunk's worth of keys per chunked layer) with the NoPE layer's temperature at the cache's
    positions: transformers' greedy tokens and its logits at every step."""
    cfg = tiny_cfg("llama4_text")
    model = sharpened(model_for(cfg))
    generation_matches(model, load_hf(cfg, model, "llama4_text", tmp_path), 16)
