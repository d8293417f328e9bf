"""The names of the ``Transformer``'s parameters and buffers (its state-dict keys), spelled here
and nowhere else: converters, checkpoint readers and writers call these.

Layer ``i`` holds ``layers.<i>.attn_norm`` / ``attn.{wq,wk,wv,wo}`` (biases on wq/wk/wv with
``model.qkv_bias``, on wo with ``model.o_bias``; ``attn.q_norm`` / ``attn.k_norm`` with
``model.qk_norm``) / ``ffn_norm`` (and with ``model.block_norms: sandwich``
``attn_post_norm`` / ``ffn_post_norm``; each norm a ``.weight``, and a ``.bias`` with
``model.norm: layernorm``, as ``norm`` and the MTP norms),
then either a dense SwiGLU ``ffn.{w1,w3,w2}`` or an MoE block: ``ffn.router.gate`` (E, D), the
selection bias buffer ``ffn.router.expert_bias`` (E), the stacked experts ``ffn.experts.w13``
(E, D, 2F) and ``ffn.experts.w2`` (E, F, D), and optionally ``ffn.shared_expert.{w1,w3,w2}`` and
``ffn.shared_gate``. With ``model.ffn_activation: relu2`` a dense FFN and a shared expert hold
``w1`` (up, F x D) and ``w2`` only (:data:`MLP_WEIGHTS`), and with ``moe.activation: relu2`` the
experts' ``w13`` is (E, D, F), the up projection alone; a latent MoE (``moe.latent_dim`` L)
adds ``ffn.latent_in`` (L, D) and ``ffn.latent_out`` (D, L), its experts' D being L. Options add
``attn.wo.bias`` (``model.o_bias``), ``attn.sinks`` (H,) (``model.attention_sinks``),
``ffn.router.gate.bias`` (E,) (``moe.router_bias``), the buffer ``ffn.router.token_experts``
(V, K) int64 (``moe.hash_layers``), ``ffn.router.input_scale`` (D,)
(``moe.router_input_norm``), ``ffn.router.expert_scale`` (E,) (``moe.expert_scale``),
``layer_scalar`` (1,) (``model.layer_scalar``), ``attn_hc`` / ``ffn_hc`` ``.{fn,base,scale}``
(``model.hc_streams``; and the model's ``hc_head``), with ``moe.dense_branch`` ``dense.{w1,w3,w2}``,
``dense_post_norm``, ``moe_norm`` and ``moe_post_norm`` beside an MoE block's ``ffn`` (with
``moe.shortcut`` ``dense.{w1,w3,w2}`` alone), and the
expert biases ``ffn.experts.w13_bias`` (E, 2F), ``ffn.experts.w2_bias`` (E, D)
(``moe.expert_biases``; expert parameters, stacked and partitioned like w13 and w2).
``lm_head.bias`` exists with ``model.lm_head_bias`` (tied or not). A Gated DeltaNet layer's
mixer holds ``attn.{in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,conv1d,norm,wo}.weight`` and
``attn.A_log``, ``attn.dt_bias`` (:data:`GDN_WEIGHTS`, :data:`GDN_PARAMS`).

A multi-token-prediction module ``k`` (1-based) is block ``layers.<n_layers + k - 1>``, named
as any block, plus ``enorm`` (the next token's embedding), ``hnorm`` (the previous depth's
hidden state), ``eh_proj`` (D, 2D) on their concatenation and ``head_norm`` before the shared
LM head.
"""

from __future__ import annotations

import re

EMBED = "embed.weight"
FINAL_NORM = "norm.weight"
FINAL_NORM_BIAS = "norm.bias"  # model.norm: layernorm
LM_HEAD = "lm_head.weight"
LM_HEAD_BIAS = "lm_head.bias"  # model.lm_head_bias
ATTN_PROJECTIONS = ("wq", "wk", "wv", "wo")
SWIGLU_WEIGHTS = ("w1", "w3", "w2")  # gate (F, D), up (F, D), down (D, F)
MLP_WEIGHTS = ("w1", "w2")  # a squared-ReLU MLP's (model.ffn_activation: relu2): up, down
LATENT_PROJECTIONS = ("latent_in", "latent_out")  # a latent MoE's (moe.latent_dim)
# a stacked expert weight, as a regular expression: group 1 the layer, group 2 the weight
EXPERTS_PATTERN = r"layers\.(\d+)\.ffn\.experts"
_EXPERTS_RE = re.compile(rf"^{EXPERTS_PATTERN}\.(\w+)$")


def attn_norm(layer: int, kind: str = "weight") -> str:
    """``kind``: weight | bias (``model.norm: layernorm``)."""
    return f"layers.{layer}.attn_norm.{kind}"


def ffn_norm(layer: int, kind: str = "weight") -> str:
    """``kind``: weight | bias (``model.norm: layernorm``)."""
    return f"layers.{layer}.ffn_norm.{kind}"


def post_norm(layer: int, branch: str, kind: str = "weight") -> str:
    """A sandwich block's norm of a branch's output (``model.block_norms: sandwich``;
    ``branch``: attn | ffn; ``kind``: weight | bias)."""
    return f"layers.{layer}.{branch}_post_norm.{kind}"


def attn(layer: int, projection: str, kind: str = "weight") -> str:
    """``projection``: wq | wk | wv | wo, or with latent attention wq (or wq_a, q_norm, wq_b),
    wkv_a, kv_norm, wkv_b, wo, and under sparse attention its indexer's indexer.wq_b,
    indexer.wk, indexer.k_norm (weight and bias), indexer.weights_proj; ``kind``: weight |
    bias."""
    return f"layers.{layer}.attn.{projection}.{kind}"


MTP_NORMS = ("enorm", "hnorm", "head_norm")


def mtp_norm(layer: int, which: str, kind: str = "weight") -> str:
    """A multi-token-prediction block's norm (``which``: enorm | hnorm | head_norm; ``kind``:
    weight | bias)."""
    return f"layers.{layer}.{which}.{kind}"


def mtp_projection(layer: int) -> str:
    """A multi-token-prediction block's ``eh_proj`` (D, 2D): [embedding | hidden] -> D."""
    return f"layers.{layer}.eh_proj.weight"


# Gated DeltaNet's weights (model/mixers/gated_deltanet.py), under layers.<i>.attn: its
# projections and convolution (a ``.weight`` each), its per-head decay parameters (bare)
GDN_WEIGHTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "norm", "wo")
GDN_PARAMS = ("A_log", "dt_bias")  # (Kimi Delta Attention's too)
# Kimi Delta Attention's weights (model/mixers/kda.py), under layers.<i>.attn (a ``.weight`` each)
KDA_WEIGHTS = (
    *(f"{p}_{w}" for w in ("proj", "conv1d") for p in "qkv"),
    *("f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj", "o_norm", "wo"),
    *("f_proj", "g_proj"),  # (its full-rank gates, model.kda_full_rank_gates)
)
# Mamba-2's (model/mixers/mamba2.py): its projections, convolution and gated norm (a
# ``.weight`` each, biases where configured), its per-head parameters (bare)
MAMBA2_WEIGHTS = ("in_proj", "conv1d", "norm", "wo")
MAMBA2_PARAMS = ("A_log", "dt_bias", "D")
# the gated short convolution's (model/mixers/gated_conv.py): a ``.weight`` each, biases where
# configured
GATED_CONV_WEIGHTS = ("in_proj", "conv", "wo")


def mixer_param(layer: int, name: str) -> str:
    """A bare parameter of block ``layer``'s token mixer (Gated DeltaNet's ``A_log``,
    ``dt_bias``; Mamba-2's and its ``D``)."""
    return f"layers.{layer}.attn.{name}"


def attn_sinks(layer: int) -> str:
    """The per-head sink logits (H,) of ``model.attention_sinks``."""
    return f"layers.{layer}.attn.sinks"


def qk_norm(layer: int, which: str) -> str:
    """``which``: q | k."""
    return f"layers.{layer}.attn.{which}_norm.weight"


def dense_ffn(layer: int, weight: str) -> str:
    """A dense layer's FFN weight (``weight``: w1 | w3 | w2; w1 | w2 not gated)."""
    return f"layers.{layer}.ffn.{weight}.weight"


def router_gate(layer: int, kind: str = "weight") -> str:
    """``kind``: weight (E, D) | bias (E,) (``moe.router_bias``)."""
    return f"layers.{layer}.ffn.router.gate.{kind}"


def expert_bias(layer: int) -> str:
    """The router's selection bias buffer (aux-loss-free balancing)."""
    return f"layers.{layer}.ffn.router.expert_bias"


def dense_branch(layer: int, weight: str) -> str:
    """The dense FFN beside an MoE layer's experts (``moe.dense_branch``, ``moe.shortcut``;
    ``weight``: w1 | w3 | w2)."""
    return f"layers.{layer}.dense.{weight}.weight"


# moe.dense_branch's norms: the dense output's, the experts' input's and output's
BRANCH_NORMS = ("dense_post_norm", "moe_norm", "moe_post_norm")


def branch_norm(layer: int, which: str) -> str:
    """One of :data:`BRANCH_NORMS` of block ``layer``."""
    return f"layers.{layer}.{which}.weight"


def router_scalar(layer: int, which: str) -> str:
    """``which``: input_scale (D,) (``moe.router_input_norm``) | expert_scale (E,)
    (``moe.expert_scale``)."""
    return f"layers.{layer}.ffn.router.{which}"


def layer_scalar(layer: int) -> str:
    """Block ``layer``'s output scalar (1,) (``model.layer_scalar``)."""
    return f"layers.{layer}.layer_scalar"


HC_TENSORS = ("fn", "base", "scale")  # a hyper-connection's (model.hc_streams)
HC_BRANCHES = ("attn_hc", "ffn_hc")


def hyper_connection(layer: int, branch: str, tensor: str) -> str:
    """``branch``: attn_hc | ffn_hc (the mixer's, the FFN's); ``tensor``: fn | base | scale."""
    return f"layers.{layer}.{branch}.{tensor}"


def hyper_head(tensor: str) -> str:
    """The streams' final collapse: fn | base | scale."""
    return f"hc_head.{tensor}"


def token_experts(layer: int) -> str:
    """Hash routing's token -> experts table (moe.hash_layers), a buffer (V, K) int64."""
    return f"layers.{layer}.ffn.router.token_experts"


def shared_expert(layer: int, weight: str) -> str:
    return f"layers.{layer}.ffn.shared_expert.{weight}.weight"


def latent_projection(layer: int, which: str) -> str:
    """A latent MoE's projection (``which``: latent_in (L, D) | latent_out (D, L))."""
    return f"layers.{layer}.ffn.{which}.weight"


def shared_gate(layer: int) -> str:
    return f"layers.{layer}.ffn.shared_gate.weight"


def experts_prefix(layer: int) -> str:
    """The prefix of an MoE layer's stacked expert weights (``...ffn.experts.``)."""
    return f"layers.{layer}.ffn.experts."


def experts(layer: int, weight: str) -> str:
    """A stacked expert weight (``weight``: w13 (E, D, 2F) | w2 (E, F, D), and with
    ``moe.expert_biases`` w13_bias (E, 2F) | w2_bias (E, D))."""
    return experts_prefix(layer) + weight


def parse_experts(name: str) -> tuple[int, str] | None:
    """``(layer, weight)`` of a stacked expert weight's name, None for any other name."""
    m = _EXPERTS_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def is_expert_bias(name: str) -> bool:
    """Whether ``name`` is some layer's router selection bias."""
    return re.fullmatch(r"layers\.\d+\.ffn\.router\.expert_bias", name) is not None
