"""Mistral (MistralForCausalLM), a dense source of upcycling: its sliding window must be unset
or cover the whole context."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config
from moetrain.convert.families.base import Family
from moetrain.convert.families.hf_config import dense_from_hf


def from_hf(hf: Any) -> Config:
    return dense_from_hf(hf, windowed=True)


FAMILY = Family(name="mistral", architecture="MistralForCausalLM", from_hf=from_hf)
