"""Each token mixer's weight names in a Hugging Face decoder layer against a moetrain block's
(:data:`MIXER_NAMES`, read by :mod:`moetrain.convert.weight_map`), and the renaming by such a
table; a new mixer kind adds its table here."""

from __future__ import annotations

from moetrain.model import param_names as pn


def block_name(name: str, kind: str | None = "weight") -> str:
    """A parameter name of block 0 (``model.param_names``) relative to its block, without its
    ``kind``: ``layers.0.attn.wq.weight`` -> ``attn.wq``."""
    name = name.removeprefix("layers.0.")
    return name.removesuffix(f".{kind}") if kind else name


_GQA = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
_MLA = {
    "wq": "q_proj",
    "wq_a": "q_a_proj",
    "q_norm": "q_a_layernorm",
    "wq_b": "q_b_proj",
    "wkv_a": "kv_a_proj_with_mqa",
    "kv_norm": "kv_a_layernorm",
    "wkv_b": "kv_b_proj",
    "wo": "o_proj",
    # sparse attention's indexer: the same names under it (wq_b, wk, k_norm, weights_proj)
    "indexer": "indexer",
    "g_proj": "g_proj",  # Ling 3.0's per-head output gate (model.mla_head_gate)
}
# Gated DeltaNet: Qwen3.5's names (Qwen3-Next's fused projections: _fused_linear_attention)
_GDN = {w: w for w in pn.GDN_WEIGHTS} | {"wo": "out_proj"}
# Kimi Delta Attention: Kimi Linear's files' names
_KDA = {w: w for w in pn.KDA_WEIGHTS} | {"wo": "o_proj"}
_MAMBA2 = {w: w for w in pn.MAMBA2_WEIGHTS} | {"wo": "out_proj"}
_GATED_CONV = {w: w for w in pn.GATED_CONV_WEIGHTS} | {"wo": "out_proj"}
# DeepSeek-V4's compressed attention: transformers' names (its released files' are the
# family's renames); the more specific names first (the first rule that matches is taken)
_COMPRESSED = {
    "wq_a": "q_a_proj",
    "q_norm": "q_a_norm",
    "wq_b": "q_b_proj",
    "wkv": "kv_proj",
    "kv_norm": "kv_norm",
    "wo_a": "o_a_proj.weight",
    "wo": "o_b_proj",
    "sinks": "sinks",
    "compressor.wkv": "compressor.kv_proj",
    "compressor.wgate": "compressor.gate_proj",
    "compressor": "compressor",
    "indexer.compressor.wkv": "compressor.indexer.kv_proj",
    "indexer.compressor.wgate": "compressor.indexer.gate_proj",
    "indexer.compressor": "compressor.indexer",
    "indexer.wq_b": "compressor.indexer.q_b_proj",
    "indexer.weights_proj": "compressor.indexer.scorer.weights_proj",
}
# A token mixer's weights: their names in a moetrain block -> in a Hugging Face decoder layer.
# A block takes the first table that names every one of its mixer's weights; a new mixer kind
# adds its table here.
MIXER_NAMES: tuple[dict[str, str], ...] = (
    {  # grouped-query attention
        **{block_name(pn.attn(0, ours)): f"self_attn.{theirs}" for ours, theirs in _GQA.items()},
        block_name(pn.qk_norm(0, "q")): "self_attn.q_norm",
        block_name(pn.qk_norm(0, "k")): "self_attn.k_norm",
        block_name(pn.attn_sinks(0), None): "self_attn.sinks",
    },
    {
        block_name(pn.attn(0, ours)): f"self_attn.{theirs}" for ours, theirs in _MLA.items()
    },  # latent
    {  # Gated DeltaNet
        **{block_name(pn.attn(0, ours)): f"linear_attn.{theirs}" for ours, theirs in _GDN.items()},
        **{block_name(pn.mixer_param(0, p), None): f"linear_attn.{p}" for p in pn.GDN_PARAMS},
    },
    {  # Kimi Delta Attention
        **{block_name(pn.attn(0, ours)): f"self_attn.{theirs}" for ours, theirs in _KDA.items()},
        **{block_name(pn.mixer_param(0, p), None): f"self_attn.{p}" for p in pn.GDN_PARAMS},
    },
    {  # Mamba-2 (Granite 4.0-H's names)
        **{block_name(pn.attn(0, ours)): f"mamba.{theirs}" for ours, theirs in _MAMBA2.items()},
        **{block_name(pn.mixer_param(0, p), None): f"mamba.{p}" for p in pn.MAMBA2_PARAMS},
    },
    {  # the gated short convolution (LFM2's names)
        block_name(pn.attn(0, ours)): f"conv.{theirs}" for ours, theirs in _GATED_CONV.items()
    },
    {  # DeepSeek-V4's compressed attention
        block_name(pn.attn(0, ours)): f"self_attn.{theirs}" for ours, theirs in _COMPRESSED.items()
    },
)


def rename(rules: dict[str, str], rest: str) -> str | None:
    """``rest`` (a name in a block) renamed by the first rule whose module it is or lies in."""
    for ours, theirs in rules.items():
        if rest == ours or rest.startswith(ours + "."):
            return theirs + rest[len(ours) :]
    return None
