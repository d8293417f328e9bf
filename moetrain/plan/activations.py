"""The activation model of ``moetrain plan``: the bytes a training forward keeps for backward,
per token of a layer and for a whole micro-batch, counted from what moetrain's modules save
(checked against saved-tensor hooks and measured memory in ``tests/unit/test_plan.py``).

A block keeps its input norms (RMSNorm: the input in dtype and an fp32 rsqrt per row; with
sandwich norms its branches' output norms too; a post-norm block its output norms instead), what its
token mixer saves (each mixer kind's own count:
:meth:`moetrain.model.mixers.TokenMixer.saved_bytes_per_token`) and what its FFN saves
(:func:`ffn_bytes_per_token`); with hyper-connections (``model.hc_streams`` > 1) each branch's
(:func:`hyper_connection_bytes_per_token`) and the streams' final collapse; the head and the loss
keep theirs (:func:`head_bytes_per_token`, :func:`loss_transient_bytes`). Parameter-sized copies
(under bf16 the router's and the hyper-connections' fp32 weights) are not counted.
"""

from __future__ import annotations

from moetrain.config import Config, ModelConfig
from moetrain.config.layer_plan import LayerSpec, mixer_spec
from moetrain.model.mixers import mixer_class


def _rmsnorm_bytes(d: int, a: int) -> int:
    """RMSNorm saves its input (in dtype) and the fp32 rsqrt of each row."""
    return a * d + 4


def _branch_norms_bytes(m: ModelConfig, a: int, layer: int) -> int:
    """A branch's norms in block ``layer``: its input's or its output's, both with sandwich
    norms (each saves its input)."""
    return _rmsnorm_bytes(m.d_model, a) * (2 if m.norm_placement(layer) == "sandwich" else 1)


def hyper_connection_bytes_per_token(m: ModelConfig, a: int, head: bool = False) -> int:
    """Bytes one branch's hyper-connection (``head``: the final collapse) saves per token, N =
    ``model.hc_streams`` streams of width D (a = activation bytes; the coefficients in fp32):
    the streams in fp32 ``4ND`` (the streams themselves where a = 4, else their fp32 copy) and
    their RMS factor ``4``; the head's also its coefficients, sigmoid and ``pre`` ``12N``; a
    branch's also the streams in dtype ``aND`` where a != 4 (the mix reads them), the
    coefficients ``4(2+N)N``, ``pre``'s sigmoid and ``pre`` ``8N``, ``post``'s sigmoid ``4N``
    and ``post`` in dtype ``aN``, the mixing matrix's softmax ``4N^2``, Sinkhorn's
    ``k = 2 * hc_sinkhorn_iters - 1`` divisions (each its denominator ``4N``, each quotient
    ``4N^2``; the last, the mixing matrix, also in dtype ``aN^2`` where a != 4) and the
    branch's output ``aD``."""
    n, d = m.hc_streams, m.d_model
    streams = 4 * n * d + 4
    if head:
        return streams + 12 * n
    in_dtype = a * n * d + a * n * n if a != 4 else 0
    k = 2 * m.hc_sinkhorn_iters - 1
    coefficients = 4 * (2 + n) * n + 12 * n + a * n
    mixing = 4 * n * n * (k + 1) + 4 * n * k
    return streams + in_dtype + coefficients + mixing + a * d


def attention_bytes_per_token(m: ModelConfig, a: int, sp: int = 1, layer: int = 0) -> int:
    """Bytes block ``layer``'s token mixer and its norms save for backward per token of this
    GPU's slice (a = activation bytes; ``sp``: ``parallel.sp_size``); 0 without a mixer."""
    spec = mixer_spec(m, layer)
    if spec is None:
        return 0
    saved = mixer_class(spec).saved_bytes_per_token(m, spec, a, sp)
    return _branch_norms_bytes(m, a, layer) + saved


def ffn_bytes_per_token(cfg: Config, layer: LayerSpec, act_bytes: int) -> int:
    """Bytes block ``layer``'s FFN (and its input norm) saves per token (a = ``act_bytes``):

    - MoE FFN: RMSNorm ``aD + 4``; router input in fp32 ``4D``, logits and probabilities
      ``8E`` (``8(E + Z)`` with Z = ``moe.zero_experts``; their copies' masks ``2K``, summed
      weights ``4`` and, where a != 4, the input's fp32 copy ``4D`` they scale), top-k ids,
      gathered and renormalised weights, z-loss logsumexp ``12K + 8``;
      permutation indices (int64) ``16K`` (token and inverse dropless, token and slot with
      capacity); per routed copy (K per token) the expert input ``aD``, the packed gate|up
      output ``2aF`` and the routing weight ``a`` the SwiGLU applies (+ the weighted SwiGLU
      product ``aF`` unless ``moe.recompute_act``; other activations:
      :func:`_expert_act_bytes`), with ``moe.score_on_input`` the weighted input ``aD`` too;
      the combine keeps only indices; shared expert ``aD + 3aF_s`` (+ gate ``aD + a``);
      ``moe.dense_branch``'s dense FFN's intermediates and three more norms (one of them saves
      the FFN's output).
    - dense FFN: RMSNorm, its output ``aD``, SwiGLU intermediates ``3aF_dense`` (GeGLU's
      ``4aF_dense``, :data:`MLP_SAVED`).

    Squared-ReLU MLPs (``model.ffn_activation: relu2``) keep ``2aF`` (the up projection's
    output and the squares) instead of SwiGLU's ``3aF``, squared-ReLU experts
    (``moe.activation: relu2``) ``aF`` per copy and the weighted squares ``aF`` (unless
    recomputed); a latent MoE (``moe.latent_dim`` L) routes copies of ``aL`` and keeps its
    combined output ``aL`` for ``latent_out`` (its input shared with the router's and the shared
    expert's).

    With ``capacity_factor`` < 1 only that fraction of the K copies reaches the experts.
    Expert-parallel ranks see T*K copies on average; routing imbalance raises it. Copies routed
    to zero experts skip the experts: counted as if every copy reached one (the router decides
    the share, so this is the bound).
    """
    m, e = cfg.model, cfg.moe
    a, d = act_bytes, m.d_model
    if layer.ffn == "none":
        return 0
    mlp = MLP_SAVED[m.ffn_activation]  # a dense FFN's / shared expert's (x aF)
    if layer.ffn == "dense":
        return _branch_norms_bytes(m, a, layer.index) + a * d + mlp * a * m.dense_hidden
    k = e.top_k
    kept = k * min(e.capacity_factor, 1.0) if e.capacity_factor > 0 else k
    ffn = (
        _branch_norms_bytes(m, a, layer.index) + 4 * d + 8 * e.routed_choices + 12 * k + 8 + 16 * k
    )
    if e.zero_experts:  # the zero experts' masks, summed weights, the input they scale
        ffn += 2 * k + 4 + (4 * d if a != 4 else 0)
    routed = e.latent_dim or d  # each copy's width
    ffn += kept * (a * routed + _expert_act_bytes(cfg, a) * e.expert_hidden + a)
    if e.score_on_input:  # each copy's input scaled by its weight, the experts' input
        ffn += kept * a * routed
    if e.num_shared_experts or e.latent_dim:  # fp32: the input shared with the router
        ffn += a * d if a != 4 else 0
    if e.latent_dim:
        ffn += a * e.latent_dim  # the combined output, latent_out's input
    if e.num_shared_experts:
        fs = e.shared_expert_hidden or e.num_shared_experts * e.expert_hidden
        ffn += mlp * a * fs
        if e.shared_expert_gate:
            ffn += a * d + a
    if e.dense_branch:  # the dense FFN beside the experts, 3 more norms (its output is the
        ffn += 3 * _rmsnorm_bytes(d, a) + mlp * a * m.dense_hidden  # input of one of them)
    return int(ffn)


MLP_SAVED = {"swiglu": 3, "geglu": 4, "relu2": 2}
"""What a dense FFN or shared expert of ``model.ffn_activation`` saves, in units of ``aF``:
SwiGLU (one fused node) its gate and up outputs and their product; GeGLU (autograd's
composition) also the GELU's output; squared ReLU the up output and the squares."""


def _expert_act_bytes(cfg: Config, a: int) -> int:
    """Bytes per hidden unit a routed copy's activation keeps (``moe.activation``; ``a`` =
    activation bytes). SwiGLU / clamped SwiGLU (one node each): the packed gate|up output
    ``2a`` and, unless ``moe.recompute_act``, the weighted product ``a``; squared ReLU the up
    output and the weighted squares unless recomputed. GeGLU is autograd's composition: in the
    routing weights' fp32 (``c`` = 4) where they scale it, the gate|up output widened (``2c``;
    the packed output itself when already fp32), the GELU's output and the unweighted product
    (``c`` each), then the weighted product cast back (``a``, unless recomputed; recomputing
    keeps the packed output ``2a`` instead where the widening copied it); with
    ``moe.score_on_input`` (no weights) the packed output, the GELU's output and the product."""
    e = cfg.moe
    if e.activation == "geglu":
        if e.score_on_input:
            return 3 * a + (0 if e.recompute_act else a)
        c = 4
        kept = (2 * a if c != a else 0) if e.recompute_act else a
        return 4 * c + kept
    return ((1 if e.gated else 0) + (1 if e.recompute_act else 2)) * a


def activation_bytes_per_token(cfg: Config, layer: int, act_bytes: int) -> int:
    """Bytes saved for backward per token by block ``layer`` (a = ``act_bytes``, 4 or 2): its
    mixer with its norm (:func:`attention_bytes_per_token`) and its FFN
    (:func:`ffn_bytes_per_token`), as the layer plan builds them, each branch with its
    hyper-connection (``model.hc_streams`` > 1)."""
    spec = cfg.layer_plan()[layer]
    mixer = attention_bytes_per_token(cfg.model, act_bytes, cfg.parallel.sp_size, layer)
    saved = mixer + ffn_bytes_per_token(cfg, spec, act_bytes)
    if cfg.model.hc_streams > 1:
        branches = (mixer_spec(cfg.model, layer) is not None) + (spec.ffn != "none")
        saved += branches * hyper_connection_bytes_per_token(cfg.model, act_bytes)
    return saved


def head_bytes_per_token(cfg: Config, act_bytes: int) -> int:
    """Final norm, input ids and labels (int64), then the loss: plain (``model.loss_chunk_tokens``
    = 0) the LM-head input, logits (held by the caller, dtype) and fp32 log-softmax; chunked the
    gradient wrt the LM-head input (dtype), computed in forward. With hyper-connections the
    streams' final collapse before the final norm."""
    d, v, a = cfg.model.d_model, cfg.model.vocab_size, act_bytes
    loss = a * d if cfg.model.loss_chunk_tokens > 0 else a * d + a * v + 4 * v
    collapse = 0
    if cfg.model.hc_streams > 1:
        collapse = hyper_connection_bytes_per_token(cfg.model, a, head=True)
    return _rmsnorm_bytes(d, a) + 16 + loss + collapse


def loss_transient_bytes(cfg: Config, tokens: int, act_bytes: int) -> int:
    """The loss's peak beyond :func:`head_bytes_per_token`, alive while every activation is.

    Plain: backward's fp32 gradients of the log-softmax output and the logits (+ the cast back
    to dtype under bf16/fp16). Chunked: the fp32 gradient wrt the LM-head weight, kept from
    forward to backward, plus the larger of one chunk in forward (fp32 logits; under bf16/fp16
    also their dtype original, then their gradient in dtype and the chunk's weight gradient) and
    backward's scaled copies (input gradient; under bf16/fp16 the fp32 weight gradient too).
    """
    d, v, a = cfg.model.d_model, cfg.model.vocab_size, act_bytes
    chunk = cfg.model.loss_chunk_tokens
    if chunk == 0:
        return tokens * (8 * v + (a * v if a != 4 else 0))
    rows = min(chunk, tokens)
    low = a != 4
    forward = max(rows * v * (4 + a), rows * v * a + a * v * d) if low else rows * v * 4
    backward = tokens * a * d + (4 * v * d if low else 0)
    return 4 * v * d + max(forward, backward)


def activation_bytes(cfg: Config, tokens: int, checkpointing: bool, act_bytes: int) -> int:
    """Peak activation bytes of one micro-batch of ``tokens`` tokens on a GPU (its slice of
    the rows under sequence parallelism).

    Without checkpointing: every layer's saved tensors + the head + the loss's transient
    (multi-token-prediction modules: their blocks are layers, their inputs and heads the head's). With
    checkpointing of every block: each block keeps only its input ``aD`` (its N streams ``aND``
    with hyper-connections); the peak is those plus
    the larger of (head + loss transient) and one block's recomputed set. Shadow experts
    (``parallel.shadow_experts`` under expert parallelism) add, per MoE layer whose saved set is
    alive, the most replicas' weights its experts keep for backward (``3aDF`` each).
    """
    m, e, n = cfg.model, cfg.moe, cfg.model.n_blocks
    layers = [activation_bytes_per_token(cfg, i, act_bytes) for i in range(n)]
    head = tokens * head_bytes_per_token(cfg, act_bytes)
    head += loss_transient_bytes(cfg, tokens, act_bytes)
    if m.mtp_depth:
        # each module: enorm and hnorm (their inputs and rsqrt), [emb | h], head_norm, then
        # its loss (chunked: the gradient wrt the head's input and an fp32 LM-head weight
        # gradient; plain: the fp32 log-softmax and the int64 targets)
        a, d, v = act_bytes, m.d_model, m.vocab_size
        chunked = m.loss_chunk_tokens > 0
        per_token = 3 * _rmsnorm_bytes(d, a) + 2 * a * d + (a * d if chunked else 4 * v + 8)
        head += m.mtp_depth * (tokens * per_token + (4 * v * d if chunked else 0))
    replicas = 0
    if cfg.parallel.ep_size > 1:
        replicas = cfg.parallel.shadow_experts * 3 * act_bytes * m.d_model * e.expert_hidden
    moe_layers = len(e.moe_layers(n))
    if not checkpointing:
        return tokens * sum(layers) + head + moe_layers * replicas
    kept = n * act_bytes * m.d_model * m.hc_streams
    return tokens * kept + max(head, tokens * max(layers, default=0) + replicas)
