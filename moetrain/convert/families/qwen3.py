"""Qwen3 (Qwen3ForCausalLM), a dense source of upcycling: per-head query/key RMSNorm."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config
from moetrain.convert.families.base import Family
from moetrain.convert.families.hf_config import dense_from_hf


def from_hf(hf: Any) -> Config:
    return dense_from_hf(hf, qk_norm=True)


FAMILY = Family(name="qwen3", architecture="Qwen3ForCausalLM", from_hf=from_hf)
