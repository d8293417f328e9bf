"""A released family's architecture at the ``bench`` size of ``train_throughput.py``, for
``train_command.py --family NAME``: a random Hugging Face model of the family saved once
(``save_pretrained``, fp32), which both sides start from, moetrain through
``checkpoint.init_from`` (its architecture read from the directory by the family's adapter), the
peer through ``from_pretrained`` of the family's transformers class. The first step's losses are
thus of the same function on the same weights and batch (``train_command.py`` checks them).

Sizes: the tiny test model of the family (``tests/helpers/hf_models.py``) with the attributes
of :data:`BENCH_SIZES` changed: vocab 8192, d 256, 4 heads / 2 KV heads of 64, 8 experts top-2
of hidden 512, the family's own pieces at the same scale and its released layer pattern.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

COMMON = dict(
    vocab_size=8192,
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
    use_cache=False,
)
# transformers' balancing loss at bench's moe.aux_loss_coef, for the classes that compute one
BALANCING = dict(
    router_aux_loss_coef=0.01,
    output_router_logits=True,  # (transformers adds the balancing loss only then)
)
BENCH_SIZES = {
    # 3 Gated DeltaNet layers to 1 attention layer, as released; every layer MoE with the
    # sigmoid-gated shared expert
    "qwen3_next": dict(
        COMMON,
        **BALANCING,
        num_hidden_layers=4,
        full_attention_interval=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        intermediate_size=1024,
        mlp_only_layers=[],
    ),
    # Gemma 4 26B-A4B's flags (hf_flags.GEMMA4_FLAGS) at the released 5 sliding layers to 1
    # global: global layers of twice the head dim with one key/value head read as keys and
    # values, a GeGLU dense MLP beside the GeGLU experts in every layer, final-logit
    # soft-capping at 30, tied embeddings, the RoPE as released; the window half the sequence.
    # Gemma4ForCausalLM computes no balancing loss, so neither side has one
    "gemma4_text": dict(
        COMMON,
        num_hidden_layers=6,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        sliding_window=128,
        global_head_dim=128,
        num_global_key_value_heads=1,
        final_logit_softcapping=30.0,
        rope_parameters={  # as released
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
            },
        },
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=512,
        intermediate_size=1024,
        vocab_size_per_layer_input=8192,  # (as released: the vocabulary; unused without them)
    ),
    # DeepSeek-V4-Flash's flags (hf_flags.DEEPSEEK_V4_FLAGS) as released where the bench size
    # allows: one key/value head read as keys and values, an eighth of each head rotated (YaRN
    # x16 on the compressed layers), a query LoRA and grouped output LoRA, window 128, compress
    # rates 4 and 128, 4 hyper-connection streams (20 Sinkhorn iterations), sqrt(softplus)
    # routing x1.5 with one shared expert, the SwiGLU clamped at 10; one layer of each attention
    # type after a sliding one, the first hash-routed (released: 3 of 43); the indexer keeping
    # 16 of the 64 compressed entries (released 512, which would keep all at this length).
    # Aux-loss-free as released: neither side trains a balancing loss
    "deepseek_v4": dict(
        COMMON,
        num_hidden_layers=4,
        num_key_value_heads=1,
        partial_rotary_factor=1 / 8,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 16,
        },
        compress_rope_theta=160000.0,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=64,
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        sliding_window=128,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        index_n_heads=4,
        index_head_dim=32,
        index_topk=16,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        mlp_layer_types=["hash_moe"] + ["moe"] * 3,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=512,
        routed_scaling_factor=1.5,
        swiglu_limit=10.0,
        num_nextn_predict_layers=0,
    ),
}


def aux_loss_coef(family: str) -> float:
    """The balancing loss's weight ``family``'s transformers class trains with (0: none)."""
    return BENCH_SIZES[family].get("router_aux_loss_coef", 0.0)


def save_family_source(family: str, out: Path) -> Path:
    """``family``'s model at the bench size, saved at ``out`` once (seeded)."""
    if (out / "config.json").exists():
        return out
    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (the tests' tiny models)
    from tests.helpers.hf_models import hf_config

    tiny = hf_config(family)
    # built anew from its fields: a config derives some at construction (Gemma 4 its global
    # layers' per-layer settings), which setting attributes afterwards would leave stale
    fields = {**tiny.to_dict(), **BENCH_SIZES[family]}
    fields.pop("per_layer_config", None)
    config = type(tiny).from_dict(fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _spread_hash_tables(model, torch.Generator().manual_seed(0))
    model.save_pretrained(out)
    return out


def _spread_hash_tables(model, gen) -> None:
    """Hash-routed layers' token -> experts tables (DeepSeek-V4's ``tid2eid``, which the class
    initialises to zeros, every token to expert 0) filled as released: each token a fixed
    random set of ``top_k`` distinct experts."""
    import torch

    for name, table in model.named_buffers():
        if name.endswith("tid2eid"):
            vocab, top_k = table.shape
            experts = model.config.n_routed_experts
            table.copy_(torch.rand(vocab, experts, generator=gen).argsort(dim=1)[:, :top_k])


def family_config(template: Path, out: Path) -> Path:
    """``template`` (a moetrain YAML) without its ``model`` and ``moe`` sections, written to
    ``out``: with ``checkpoint.init_from`` the source's architecture fills them."""
    cfg = yaml.safe_load(template.read_text())
    cfg.pop("model", None)
    cfg.pop("moe", None)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out
