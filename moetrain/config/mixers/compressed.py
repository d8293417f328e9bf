"""DeepSeek-V4's attention's keys and rules (``model.attention: compressed``): one key/value
head of ``model.head_dim`` dims read as both keys and values, queries through the low-rank
``model.q_lora_rank``, a sinks logit per head, the heads' outputs in ``model.o_groups`` groups
each projected to ``model.o_lora_rank`` before the output projection. Every layer attends to
its sliding window (``model.sliding_window``); its layer type says what it adds:

- ``sliding_attention``: nothing (RoPE of ``model.rope_theta``, never scaled);
- ``heavily_compressed_attention``: the entries of every closed window of
  ``model.compress_rate_hca`` tokens;
- ``compressed_sparse_attention``: entries of overlapping windows of
  ``model.compress_rate_csa`` tokens, of which a lightning indexer
  (``model.compress_index_heads`` x ``compress_index_head_dim``) keeps each query's
  ``model.compress_index_topk`` best closed ones.

The compressed layers' RoPE (queries, keys and entries) has base ``model.compress_rope_theta``
and, with ``model.rope_scaling: yarn``, YaRN's frequencies with cos / sin unscaled (attention
factor 1). RoPE turns the trailing ``head_dim * partial_rotary_factor`` dims of a head in
adjacent pairs. Its module is :mod:`moetrain.model.mixers.compressed`; the keys are
transformers' ``DeepseekV4Config``'s (``layer_types``, ``compress_rates``, ``o_groups``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moetrain.config.checks import ConfigError, require
from moetrain.config.mixers.base import MixerKind
from moetrain.config.ranges import FUNCTION, POSITIVE_INT, above

if TYPE_CHECKING:
    from moetrain.config.layer_plan import MixerSpec
    from moetrain.config.model import ModelConfig

# the compressed layers: the key of their window of tokens
RATE_KEYS = {"csa": "compress_rate_csa", "hca": "compress_rate_hca"}
INDEX_KEYS = ("compress_index_heads", "compress_index_head_dim", "compress_index_topk")


@dataclass
class CompressedKeys:
    """DeepSeek-V4's attention's own ``model`` keys (besides the shared head_dim,
    partial_rotary_factor, q_lora_rank and sliding_window, which it requires)."""

    # the grouped output projection: the heads in o_groups groups, each group's outputs to
    # o_lora_rank dims (one block per group), then all groups' to d_model (required)
    o_groups: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    o_lora_rank: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    # the windows of tokens each compressed entry pools (transformers' compress_rates)
    compress_rate_csa: int = field(default=4, metadata=POSITIVE_INT | FUNCTION)
    compress_rate_hca: int = field(default=128, metadata=POSITIVE_INT | FUNCTION)
    # the RoPE base of the compressed layers (the sliding ones take model.rope_theta)
    compress_rope_theta: float = field(default=160000.0, metadata=above(0) | FUNCTION)
    # the compressed sparse layers' lightning indexer: heads, head dims and the entries each
    # query keeps (required with such layers; unset without)
    compress_index_heads: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    compress_index_head_dim: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)
    compress_index_topk: int | None = field(default=None, metadata=POSITIVE_INT | FUNCTION)


class Compressed(MixerKind):
    """DeepSeek-V4's attention (module docstring)."""

    name = "compressed"
    compresses = True
    keys = (
        "head_dim",
        "partial_rotary_factor",
        "q_lora_rank",
        "o_groups",
        "o_lora_rank",
        "compress_rate_csa",
        "compress_rate_hca",
        "compress_rope_theta",
        *INDEX_KEYS,
    )

    @classmethod
    def validate(cls, model: ModelConfig, specs: list[MixerSpec]) -> None:
        for key in ("head_dim", "q_lora_rank", "o_groups", "o_lora_rank"):
            require(getattr(model, key) is not None, f"model.{key}", "must be set")
        require(
            model.n_heads % model.o_groups == 0,
            "model.o_groups",
            f"must divide model.n_heads={model.n_heads}; got {model.o_groups}",
        )
        require(
            model.n_kv_heads == 1,
            "model.n_kv_heads",
            f"must be 1: one key/value head, read as keys and values; got {model.n_kv_heads}",
        )
        rope = cls.rope_dim(model)
        require(
            rope >= 2 and rope % 2 == 0,
            "model.partial_rotary_factor",
            f"must rotate an even number of dims, at least 2, of the {model.head_dim} of a "
            f"head; {model.partial_rotary_factor:g} rotates {rope}",
        )
        require(
            model.mtp_depth == 0,
            "model.mtp_depth",
            "multi-token-prediction blocks attend to the full context, which this kind does "
            "not; leave it 0",
        )
        require(
            all(s.window is not None and s.chunk is None for s in specs),
            "model.layer_types",
            "every layer of this kind attends to a sliding window: each must be "
            "sliding_attention, compressed_sparse_attention or heavily_compressed_attention",
        )
        require(
            all(s.rope for s in specs), "model.nope_layers", "every layer of this kind has RoPE"
        )
        cls._validate_rope(model)
        sparse = any(s.compress == "csa" for s in specs)
        for key in INDEX_KEYS:
            require(
                (getattr(model, key) is not None) == sparse,
                f"model.{key}",
                "must be set with compressed_sparse_attention layers, and only with them",
            )
        require(
            not sparse or model.compress_index_head_dim >= rope,
            "model.compress_index_head_dim",
            f"must be at least the {rope} dims RoPE rotates (the indexer rotates as many); "
            f"got {model.compress_index_head_dim}",
        )

    @classmethod
    def _validate_rope(cls, model: ModelConfig) -> None:
        """The compressed layers' YaRN, with its attention factor 1; no other scaling."""
        require(
            model.rope_scaling in ("none", "yarn"),
            "model.rope_scaling",
            "the compressed layers take YaRN (cos / sin unscaled) or none; the sliding ones "
            f"none; got {model.rope_scaling}",
        )
        for key in ("rope_mscale", "rope_mscale_all_dim"):
            require(
                getattr(model, key) is None,
                f"model.{key}",
                "does not apply: this kind's YaRN leaves cos / sin unscaled",
            )
        require(
            model.rope_truncate is not False and not model.rope_interleave,
            "model.rope_truncate" if model.rope_truncate is False else "model.rope_interleave",
            "this kind always rotates adjacent pairs with YaRN's whole correction dims: "
            "leave model.rope_truncate and model.rope_interleave unset",
        )

    @classmethod
    def head_dim(cls, model: ModelConfig) -> int:
        return model.head_dim or 0

    @classmethod
    def rope_dim(cls, model: ModelConfig) -> int:
        return int(cls.head_dim(model) * model.partial_rotary_factor)

    @classmethod
    def sp_heads(cls, model: ModelConfig) -> tuple[tuple[str, int], ...]:
        raise ConfigError(
            "parallel.sp_size: model.attention=compressed has no sequence parallelism yet "
            "(its compressor windows and the indexer's selection span each whole sequence); "
            "use parallel.sp_size=1"
        )
