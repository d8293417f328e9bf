"""Llama (LlamaForCausalLM), a dense source of upcycling: plain RoPE or Llama 3's
``rope_type: llama3`` scaling, tied embeddings or not, no attention or MLP biases."""

from __future__ import annotations

from moetrain.convert.families.base import Family
from moetrain.convert.families.hf_config import dense_from_hf

FAMILY = Family(name="llama", architecture="LlamaForCausalLM", from_hf=dense_from_hf)
