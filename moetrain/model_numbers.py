"""Derived numbers from a config: parameter counts and training FLOPs per token.

FLOPs follow the usual convention (Kaplan et al., PaLM appendix B): 6 FLOPs per active matmul
parameter per token for forward + backward, plus each mixer's own (attention's scores and
values, 6 x n_heads x (qk_head_dim + v_head_dim) x seq_len per token and layer, the causal mask
not discounted: ``TokenMixer.mixing_flops_per_token``). Multi-token-prediction
modules count as the blocks they are, plus their norms, ``eh_proj`` and one more LM-head
matmul each (their parameters are in the totals; the training FLOPs include them).
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config import Config
from moetrain.model.mixers import mixer_class


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


def model_numbers(cfg: Config, seq_len: int | None = None) -> ModelNumbers:
    """Count parameters exactly as moetrain's Transformer builds them, block by block of the
    layer plan (each mixer counts its own: :mod:`moetrain.model.mixers`)."""
    m, e = cfg.model, cfg.moe
    d = m.d_model
    norm = 2 * d if m.norm == "layernorm" else d  # one norm's parameters (weight, bias)
    seq_len = seq_len or cfg.data.seq_len
    mlp = 2 if m.ffn_activation == "relu2" else 3  # matrices of a dense FFN / shared expert
    dense_ffn = mlp * d * m.dense_hidden
    expert = (3 if e.gated else 2) * (e.latent_dim or d) * e.expert_hidden
    shared = mlp * d * e.shared_hidden if e.num_shared_experts else 0
    shared_gate = d if (e.num_shared_experts and e.shared_expert_gate) else 0
    router = d * e.routed_choices + (d if e.router_input_norm else 0)
    router += e.num_experts if e.expert_scale else 0
    latent = 2 * d * e.latent_dim if e.latent_dim else 0  # a latent MoE's two projections
    # moe.dense_branch: the dense FFN beside the experts, with its post norm and the experts'
    dense_branch = dense_ffn + 3 * norm if e.dense_branch else 0
    dense_branch += dense_ffn if e.shortcut else 0  # moe.shortcut: its dense FFN alone
    layer_scalar = 1 if m.layer_scalar else 0
    # model.hc_streams N > 1: a hyper-connection around each branch, and the final collapse
    n_hc = m.hc_streams
    hc_matrix = (2 + n_hc) * n_hc * n_hc * d if n_hc > 1 else 0  # fn, a matmul per token
    hc = hc_matrix + (2 + n_hc) * n_hc + 3 if n_hc > 1 else 0
    hc_head_matrix = n_hc * n_hc * d if n_hc > 1 else 0
    hc_head = hc_head_matrix + n_hc + 1 if n_hc > 1 else 0

    total = active = matmul_active = mtp = mixing = 0
    n_moe = 0
    for layer in cfg.layer_plan():
        if layer.index == m.n_layers:
            mtp = total
        total, active = total + layer_scalar, active + layer_scalar
        # a branch's norms: before or after it, or both (sandwich)
        branch_norms = norm * (2 if m.norm_placement(layer.index) == "sandwich" else 1)
        branches = (layer.mixer is not None) + (layer.ffn != "none")
        total, active = total + branches * hc, active + branches * hc
        matmul_active += branches * hc_matrix
        if layer.mixer is not None:  # its norms, its parameters
            kind = mixer_class(layer.mixer)
            params = branch_norms + kind.param_count(m, layer.mixer)
            total, active = total + params, active + params
            matmul_active += sum(i * o for i, o in kind.matrices(m, layer.mixer).values())
            mixing += kind.mixing_flops_per_token(m, layer.mixer, seq_len)
        if layer.ffn == "moe":
            n_moe += 1
            # at most top_k routed experts compute (fewer where a token picks zero experts)
            k = min(e.top_k, e.num_experts)
            ffn_active = router + latent + k * expert + shared + shared_gate + dense_branch
            total += branch_norms + ffn_active + (e.num_experts - k) * expert
            active += branch_norms + ffn_active
            matmul_active += ffn_active
        elif layer.ffn == "dense":
            dense = branch_norms + dense_ffn
            total, active = total + dense, active + dense
            matmul_active += dense_ffn
    if m.mtp_depth:  # each module: its block (above), enorm, hnorm, head_norm, eh_proj
        extra = 3 * norm + 2 * d * d
        total, active = total + m.mtp_depth * extra, active + m.mtp_depth * extra
        matmul_active += m.mtp_depth * (2 * d * d + m.vocab_size * d)  # + its LM-head matmul
        mtp = total - mtp
    embed = m.vocab_size * d
    head = 0 if m.tie_embeddings else m.vocab_size * d
    head_bias = m.vocab_size if m.lm_head_bias else 0
    total += embed + head + head_bias + norm + hc_head  # + final norm
    active += embed + head + head_bias + norm + hc_head
    matmul_active += hc_head_matrix
    matmul_active += m.vocab_size * d  # LM head matmul (tied or not)
    return ModelNumbers(
        total_params=total,
        active_params=active,
        embedding_params=embed + head,
        expert_params=n_moe * e.num_experts * expert,
        num_moe_layers=n_moe,
        flops_per_token=6.0 * matmul_active + mixing,
        mtp_params=mtp,
    )


def cache_bytes_per_token(cfg: Config, dtype_bytes: int) -> int:
    """Bytes the generation cache takes per token, every decoder layer's mixer state
    (``Transformer.new_cache``)."""
    m = cfg.model
    return sum(
        mixer_class(layer.mixer).cache_bytes_per_token(m, layer.mixer, dtype_bytes)
        for layer in cfg.layer_plan()[: m.n_layers]
        if layer.mixer is not None
    )


def cache_bytes_per_sequence(cfg: Config, dtype_bytes: int) -> int:
    """Bytes the generation cache takes per sequence whatever its length: the recurrent
    mixers' fixed states (``Transformer.new_cache``)."""
    m = cfg.model
    return sum(
        mixer_class(layer.mixer).cache_bytes_per_sequence(m, layer.mixer, dtype_bytes)
        for layer in cfg.layer_plan()[: m.n_layers]
        if layer.mixer is not None
    )


def human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"
