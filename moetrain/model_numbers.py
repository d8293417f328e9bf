"""Derived numbers from a config: parameter counts and training FLOPs per token.

FLOPs follow the usual convention (Kaplan et al., PaLM appendix B): 6 FLOPs per active matmul
parameter per token for forward + backward, plus attention scores and values,
12 x n_layers x n_heads x head_dim x seq_len per token (the causal mask is not discounted).
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config import Config


@dataclass(frozen=True)
class ModelNumbers:
    total_params: int
    active_params: int  # parameters touched by one token (including embeddings)
    embedding_params: int  # token embedding (+ untied LM head)
    expert_params: int  # routed-expert weights, all layers
    num_moe_layers: int
    flops_per_token: float  # training (forward + backward) FLOPs per token

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def model_numbers(cfg: Config, seq_len: int | None = None) -> ModelNumbers:
    """Count parameters exactly as moetrain's Transformer builds them."""
    m, e = cfg.model, cfg.moe
    d, hd = m.d_model, m.attention_head_dim
    seq_len = seq_len or cfg.data.seq_len
    attn = d * m.n_heads * hd * 2 + d * m.n_kv_heads * hd * 2
    qkv_bias = (m.n_heads + 2 * m.n_kv_heads) * hd if m.qkv_bias else 0
    qk_norms = 2 * hd if m.qk_norm_scope == "head" else (m.n_heads + m.n_kv_heads) * hd
    norms = 2 * d + (qk_norms if m.qk_norm else 0)
    dense_ffn = 3 * d * m.dense_hidden
    expert = 3 * d * e.expert_hidden
    shared = 3 * d * e.shared_hidden if e.num_shared_experts else 0
    shared_gate = d if (e.num_shared_experts and e.shared_expert_gate) else 0
    router = d * e.num_experts

    total = active = matmul_active = 0
    n_moe = 0
    for layer in range(m.n_layers):
        total += attn + qkv_bias + norms
        active += attn + qkv_bias + norms
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
    embed = m.vocab_size * d
    head = 0 if m.tie_embeddings else m.vocab_size * d
    total += embed + head + d  # + final norm
    active += embed + head + d
    matmul_active += m.vocab_size * d  # LM head matmul (tied or not)
    attn_flops = 12 * m.n_layers * m.n_heads * hd * seq_len
    return ModelNumbers(
        total_params=total,
        active_params=active,
        embedding_params=embed + head,
        expert_params=n_moe * e.num_experts * expert,
        num_moe_layers=n_moe,
        flops_per_token=6.0 * matmul_active + attn_flops,
    )


def human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"
