"""ERNIE-4.5-MoE (Ernie4_5_MoeForCausalLM; ERNIE-4.5-21B-A3B): softmax scores over
all experts, selection shifted by ``moe_statics.e_score_correction_bias`` (moetrain's
``expert_bias``, stored as one row (1, E)), weights from the unbiased scores, always
renormalised by max(sum, ``moe_norm_min``) (``moe.renormalize_min``), ungated shared experts
sized ``moe_num_shared_experts`` x ``moe_intermediate_size``, rotary embeddings on adjacent
pairs (``model.rope_interleave``: transformers rotates them in place, moetrain gathers each
head's pairs first; queries and keys are permuted alike, so attention is the same), and the
MoE layers ``moe_layer_start_index`` .. ``moe_layer_end_index`` whose ``layer + 1`` is a
multiple of ``moe_layer_interval`` (moetrain's ``first_k_dense`` / ``moe_every`` where they
give the same layers). ``use_bias`` puts biases on every projection and the head, which
moetrain has not: refused. The multi-token-prediction layer of a released checkpoint
(``num_nextn_predict_layers``, ``model.mtp_*`` tensors) is not part of transformers' model and
is not imported; exports declare none."""

from __future__ import annotations

from typing import Any

from moetrain.config import Config, ConfigError, ModelConfig, MoEConfig
from moetrain.convert.families import hf_config
from moetrain.convert.families.base import Family
from moetrain.convert.families.holds import SHARED_SIZED_BY_COUNT, free, only, refused_when
from moetrain.convert.families.layout import Layout

NAME = "Ernie4_5_MoeForCausalLM"
_PLACEMENT = "moe_layer_start_index/moe_layer_end_index/moe_layer_interval"


def moe_layers(n_layers: int, start: int, end: int, interval: int) -> list[int]:
    """The MoE layers transformers' ERNIE builds (its decoder layer's rule)."""
    return [i for i in range(n_layers) if (i + 1) % interval == 0 and start <= i <= end]


def _misplaced(model: ModelConfig, moe: MoEConfig) -> bool:
    n = model.n_layers
    return moe_layers(n, moe.first_k_dense, n - 1, moe.moe_every) != moe.moe_layers(n)


HOLDS = {
    "model.rope_interleave": only(True),
    "model.qkv_bias": only(
        False,
        why="{name}'s use_bias puts biases on every projection (attention output, FFNs, head "
        "too); moetrain has q/k/v biases only: must be false",
    ),
    "moe.renormalize": only(True),
    **free(
        "moe.renormalize_min", "moe.bias_update_rate", "moe.num_shared_experts", "moe.first_k_dense"
    ),
    "moe.shared_expert_hidden": SHARED_SIZED_BY_COUNT,
    "moe.moe_every": refused_when(
        _misplaced,
        "{name} places MoE in the layers whose index + 1 is a multiple of moe_layer_interval; "
        "moe.first_k_dense must be a multiple of moe.moe_every",
    ),
}
LAYOUT = Layout(
    shared_expert="shared_experts",
    selection_bias="moe_statics.e_score_correction_bias",
    selection_bias_row=True,
    in_memory={"moe_statics.e_score_correction_bias": "gate.moe_statics.e_score_correction_bias"},
)


def to_hf(cfg: Config) -> dict[str, Any]:
    model, moe = cfg.model, cfg.moe
    fields = hf_config.hf_common(cfg)
    del fields["num_experts_per_tok"]  # (its own name below)
    return dict(
        fields,
        intermediate_size=model.dense_hidden,
        moe_intermediate_size=moe.expert_hidden,
        moe_num_experts=moe.num_experts,
        moe_k=moe.top_k,
        moe_num_shared_experts=moe.num_shared_experts,
        moe_layer_start_index=moe.first_k_dense,
        moe_layer_end_index=model.n_layers - 1,
        moe_layer_interval=moe.moe_every,
        moe_norm_min=moe.renormalize_min,
        use_bias=False,
    )


def from_hf(hf: Any) -> Config:
    def get(name: str, default: Any = None) -> Any:
        return getattr(hf, name, default)

    if get("use_bias", False):
        raise ConfigError(
            "use_bias: biases on every projection and the head; moetrain has q/k/v biases only"
        )
    model, moe = hf_config.model_from_hf(hf), hf_config.moe_from_hf(hf)
    hf_config.refuse_partial_rotary(model, NAME)
    model.rope_interleave = True
    start, end, interval = (
        hf_config.hf_number(hf, k, NAME, integer=True, minimum=-1) for k in _PLACEMENT.split("/")
    )
    n = model.n_layers
    end = n - 1 if end == -1 else end  # (transformers' rule for -1)
    try:
        moe.first_k_dense, moe.moe_every = hf_config.placement(
            moe_layers(n, start, end, interval), n
        )
    except ConfigError:
        raise ConfigError(
            f"{_PLACEMENT}: MoE layers {moe_layers(n, start, end, interval)} of {n} are not "
            "expressible as moe.first_k_dense + moe.moe_every"
        ) from None
    norm_min = hf_config.hf_number(hf, "moe_norm_min", NAME)
    moe.num_experts, moe.expert_hidden = hf.moe_num_experts, hf.moe_intermediate_size
    moe.score_func, moe.renormalize = "softmax", True
    moe.renormalize_min = float(norm_min)
    moe.num_shared_experts = int(get("moe_num_shared_experts") or 0)
    return hf_config.finish(model, moe)


FAMILY = Family("ernie4_5_moe", NAME, from_hf, to_hf, holds=HOLDS, layout=LAYOUT)
