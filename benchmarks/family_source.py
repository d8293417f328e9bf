"""A released family's architecture at the ``bench`` size of ``train_throughput.py``, for
``train_command.py --family NAME``: a random Hugging Face model of the family saved once
(``save_pretrained``, fp32), which both sides start from, moetrain through
``checkpoint.init_from`` (its architecture read from the directory by the family's adapter), the
peer through ``from_pretrained`` of the family's transformers class. The first step's losses are
thus of the same function on the same weights and batch.

Sizes: the tiny test model of the family (``tests/helpers/hf_models.py``) with the attributes
of :data:`BENCH_SIZES` changed: vocab 8192, d 256, 4 layers, 4 heads / 2 KV heads, 8 experts
top-2 of hidden 512, the family's own pieces at the same scale.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

COMMON = dict(
    vocab_size=8192,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
    num_experts_per_tok=2,
    router_aux_loss_coef=0.01,  # as the bench side's moe.aux_loss_coef
    output_router_logits=True,  # (transformers adds the balancing loss only then)
    use_cache=False,
)
BENCH_SIZES = {
    # 3 Gated DeltaNet layers to 1 attention layer, as released; every layer MoE with the
    # sigmoid-gated shared expert
    "qwen3_next": dict(
        COMMON,
        full_attention_interval=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_experts=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        intermediate_size=1024,
        mlp_only_layers=[],
        layer_types=None,  # (derived from full_attention_interval)
    ),
}


def save_family_source(family: str, out: Path) -> Path:
    """``family``'s model at the bench size, saved at ``out`` once (seeded)."""
    if (out / "config.json").exists():
        return out
    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (the tests' tiny models)
    from tests.helpers.hf_models import hf_config

    config = hf_config(family)
    for key, value in BENCH_SIZES[family].items():
        setattr(config, key, value)
    if "layer_types" in BENCH_SIZES[family]:  # the hybrid pattern of the new layer count
        interval = config.full_attention_interval
        config.layer_types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(config.num_hidden_layers)
        ]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    return out


def family_config(template: Path, out: Path) -> Path:
    """``template`` (a moetrain YAML) without its ``model`` and ``moe`` sections, written to
    ``out``: with ``checkpoint.init_from`` the source's architecture fills them."""
    cfg = yaml.safe_load(template.read_text())
    cfg.pop("model", None)
    cfg.pop("moe", None)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out
