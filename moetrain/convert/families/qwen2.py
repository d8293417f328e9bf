"""Qwen2 (Qwen2ForCausalLM), a dense source of upcycling: q/k/v biases (``model.qkv_bias``)."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config
from moetrain.convert.families.base import Family
from moetrain.convert.families.hf_config import dense_from_hf


def from_hf(hf: Any) -> Config:
    return dense_from_hf(hf, qkv_bias=True)


FAMILY = Family(name="qwen2", architecture="Qwen2ForCausalLM", from_hf=from_hf)
