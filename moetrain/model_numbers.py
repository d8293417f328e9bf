"""Derived numbers from a config: parameter counts and training FLOPs per token.

FLOPs follow the usual convention (Kaplan et al., PaLM appendix B): 6 FLOPs per active matmul
parameter per token for forward + backward, plus attention scores and values,
6 x n_layers x n_heads x (qk_head_dim + v_head_dim) x seq_len per token (12 x ... x head_dim
for grouped-query attention; the causal mask is not discounted). Multi-token-prediction
modules count as the blocks they are, plus their norms, ``eh_proj`` and one more LM-head
matmul each (their parameters are in the totals; the training FLOPs include them).
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config import Config, ModelConfig


@dataclass(frozen=True)
class ModelNumbers:
    total_params: int
    active_params: int  # parameters touched by one token (including embeddings)
    embedding_params: int  # token embedding (+ untied LM head)
    expert_params: int  # routed-expert weights, all layers
    num_moe_layers: int
    flops_per_token: float  # training (forward + backward) FLOPs per token
    mtp_params: int = 0  # the multi-token-prediction modules (in total and active params)

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def attention_matrices(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """Every weight matrix of one layer's attention, ``name -> (in, out)``."""
    d, h = m.d_model, m.n_heads
    if m.attention == "mla":
        qk, c = m.attention_head_dim, m.kv_lora_rank
        q = (
            {"wq": (d, h * qk)}
            if m.q_lora_rank is None
            else {"wq_a": (d, m.q_lora_rank), "wq_b": (m.q_lora_rank, h * qk)}
        )
        return {
            **q,
            "wkv_a": (d, c + m.qk_rope_head_dim),
            "wkv_b": (c, h * (m.qk_nope_head_dim + m.v_head_dim)),
            "wo": (h * m.v_head_dim, d),
        }
    hd, g = m.attention_head_dim, m.n_kv_heads
    return {"wq": (d, h * hd), "wk": (d, g * hd), "wv": (d, g * hd), "wo": (h * hd, d)}


def _attention_vectors(m: ModelConfig) -> int:
    """One layer's attention parameters outside its matrices: biases and norms."""
    if m.attention == "mla":  # the latent norms
        return m.kv_lora_rank + (m.q_lora_rank or 0)
    hd = m.attention_head_dim
    qkv_bias = (m.n_heads + 2 * m.n_kv_heads) * hd if m.qkv_bias else 0
    o_bias = m.d_model if m.o_bias else 0
    qk_norms = 2 * hd if m.qk_norm_scope == "head" else (m.n_heads + m.n_kv_heads) * hd
    return qkv_bias + o_bias + (qk_norms if m.qk_norm else 0)


def attention_flops_per_token(m: ModelConfig, seq_len: int) -> int:
    """Training FLOPs of the scores and values of every layer, per token."""
    v_dim = m.v_head_dim if m.attention == "mla" else m.attention_head_dim
    return 6 * m.n_blocks * m.n_heads * (m.attention_head_dim + v_dim) * seq_len


def model_numbers(cfg: Config, seq_len: int | None = None) -> ModelNumbers:
    """Count parameters exactly as moetrain's Transformer builds them."""
    m, e = cfg.model, cfg.moe
    d = m.d_model
    norm = 2 * d if m.norm == "layernorm" else d  # one norm's parameters (weight, bias)
    seq_len = seq_len or cfg.data.seq_len
    attn = sum(i * o for i, o in attention_matrices(m).values())
    vectors = 2 * norm + _attention_vectors(m)  # the block's two norms, attention biases, norms
    dense_ffn = 3 * d * m.dense_hidden
    expert = 3 * d * e.expert_hidden
    shared = 3 * d * e.shared_hidden if e.num_shared_experts else 0
    shared_gate = d if (e.num_shared_experts and e.shared_expert_gate) else 0
    router = d * e.num_experts

    total = active = matmul_active = mtp = 0
    n_moe = 0
    for layer in range(m.n_blocks):
        if layer == m.n_layers:
            mtp = total
        total += attn + vectors
        active += attn + vectors
        matmul_active += attn
        if e.is_moe_layer(layer):
            n_moe += 1
            ffn_total = router + e.num_experts * expert + shared + shared_gate
            ffn_active = router + e.top_k * expert + shared + shared_gate
            total += ffn_total
            active += ffn_active
            matmul_active += ffn_active
        else:
            total += dense_ffn
            active += dense_ffn
            matmul_active += dense_ffn
    if m.mtp_depth:  # each module: its block (above), enorm, hnorm, head_norm, eh_proj
        extra = 3 * norm + 2 * d * d
        total, active = total + m.mtp_depth * extra, active + m.mtp_depth * extra
        matmul_active += m.mtp_depth * (2 * d * d + m.vocab_size * d)  # + its LM-head matmul
        mtp = total - mtp
    embed = m.vocab_size * d
    head = 0 if m.tie_embeddings else m.vocab_size * d
    head_bias = m.vocab_size if m.lm_head_bias else 0
    total += embed + head + head_bias + norm  # + final norm
    active += embed + head + head_bias + norm
    matmul_active += m.vocab_size * d  # LM head matmul (tied or not)
    attn_flops = attention_flops_per_token(m, seq_len)
    return ModelNumbers(
        total_params=total,
        active_params=active,
        embedding_params=embed + head,
        expert_params=n_moe * e.num_experts * expert,
        num_moe_layers=n_moe,
        flops_per_token=6.0 * matmul_active + attn_flops,
        mtp_params=mtp,
    )


def human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"
