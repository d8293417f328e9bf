"""The token mixer protocol (``moetrain.model.mixers``): every registered kind implements all of
it, and its counts from the config (parameters, matrices, cache bytes, the bytes sequence
parallelism exchanges) are what its module really builds, holds and sends."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import ConfigError
from moetrain.config.layer_plan import mixer_spec
from moetrain.config.mixers import MIXER_KINDS, MixerKind
from moetrain.model import Transformer
from moetrain.model.mixers import MIXERS, MixerInputs, TokenMixer, build_mixer
from moetrain.model.rope import model_rope_tables
from moetrain.model_numbers import cache_bytes_per_sequence, cache_bytes_per_token, model_numbers
from tests.helpers.configs import tiny_config

MLA = {
    "model.attention": "mla",
    "model.n_kv_heads": 4,
    "model.kv_lora_rank": 16,
    "model.qk_nope_head_dim": 8,
    "model.qk_rope_head_dim": 8,
    "model.v_head_dim": 12,
}
GDN = {  # two Gated DeltaNet layers, one attention layer
    "model.n_layers": 3,
    "model.full_attention_interval": 3,
    "model.linear_num_key_heads": 4,
    "model.linear_num_value_heads": 8,
    "model.linear_key_head_dim": 8,
    "model.linear_value_head_dim": 6,
}
COMPRESSED = {
    "model.attention": "compressed",
    "model.n_layers": 2,
    "model.n_kv_heads": 1,
    "model.head_dim": 16,
    "model.partial_rotary_factor": 0.5,
    "model.q_lora_rank": 12,
    "model.o_groups": 2,
    "model.o_lora_rank": 6,
    "model.sliding_window": 5,
    "model.compress_rate_hca": 8,
    "model.compress_index_heads": 2,
    "model.compress_index_head_dim": 8,
    "model.compress_index_topk": 3,
}
CASES = {
    "gqa": {},
    "gqa-options": {
        "model.qkv_bias": True,
        "model.o_bias": True,
        "model.attention_sinks": True,
        "model.qk_norm": True,
        "model.head_dim": 16,
    },
    "gqa-projection-norm": {"model.qk_norm": True, "model.qk_norm_scope": "projection"},
    "gqa-one-kv-head": {"model.n_kv_heads": 1},
    "gqa-output-gate": {  # Qwen3-Next's attention
        "model.attention_output_gate": True,
        "model.qk_norm": True,
        "model.zero_centered_norm": True,
        "model.head_dim": 16,
        "model.partial_rotary_factor": 0.25,
    },
    "gqa-gemma4-global": {  # Gemma 4's sliding layer and global layer (its own shape)
        "model.qk_norm": True,
        "model.value_norm": True,
        "model.sliding_window": 3,
        "model.layer_types": ["sliding_attention", "full_attention"],
        "model.global_head_dim": 16,
        "model.global_n_kv_heads": 1,
        "model.global_k_eq_v": True,
        "model.global_rope_theta": 1e5,
        "model.global_rope_proportion": 0.25,
    },
    "mla": MLA,
    "mla-query-lora": {**MLA, "model.q_lora_rank": 24},
    "gated_deltanet": GDN,
    "gated_deltanet-one-head-wide-conv": {
        **GDN,
        "model.linear_num_key_heads": 1,
        "model.linear_num_value_heads": 1,
        "model.linear_conv_kernel_dim": 6,
    },
    "kda": {  # two Kimi Delta Attention layers, one attention layer
        "model.n_layers": 3,
        "model.full_attention_interval": 3,
        "model.linear_attention": "kda",
        "model.linear_num_heads": 2,
        "model.linear_head_dim": 8,
        "model.linear_conv_kernel_dim": 3,
    },
    "kda-ling": {  # Ling 3.0's: full-rank gates, the bounded forget gate
        "model.n_layers": 3,
        "model.full_attention_interval": 3,
        "model.linear_attention": "kda",
        "model.linear_num_heads": 2,
        "model.linear_head_dim": 8,
        "model.kda_full_rank_gates": True,
        "model.kda_gate_lower_bound": -5.0,
    },
    "mla-head-gate": {**MLA, "model.mla_head_gate": True},  # Ling 3.0's
    "mamba2": {  # two Mamba-2 layers (4 heads in 2 groups), one attention layer
        "model.n_layers": 3,
        "model.layer_types": ["linear_attention", "linear_attention", "full_attention"],
        "model.linear_attention": "mamba2",
        "model.mamba_num_heads": 4,
        "model.mamba_head_dim": 8,
        "model.mamba_n_groups": 2,
        "model.mamba_state_dim": 6,
    },
    "mamba2-biases-one-group": {
        "model.n_layers": 2,
        "model.layer_types": ["linear_attention", "full_attention"],
        "model.linear_attention": "mamba2",
        "model.mamba_num_heads": 2,
        "model.mamba_head_dim": 16,
        "model.mamba_state_dim": 4,
        "model.mamba_conv_kernel": 2,
        "model.mamba_conv_bias": False,
        "model.mamba_proj_bias": True,
    },
    "gated_conv": {  # two gated convolution layers (width 3), one attention layer
        "model.n_layers": 3,
        "model.layer_types": ["linear_attention", "linear_attention", "full_attention"],
        "model.linear_attention": "gated_conv",
    },
    "gated_conv-bias-wide": {
        "model.n_layers": 2,
        "model.layer_types": ["linear_attention", "full_attention"],
        "model.linear_attention": "gated_conv",
        "model.gated_conv_kernel": 5,
        "model.gated_conv_bias": True,
    },
    **{  # DeepSeek-V4's attention, each layer type first (the case counts layer 0)
        f"compressed-{name}": {**COMPRESSED, "model.layer_types": types}
        for name, types in (
            ("sliding", ["sliding_attention", "compressed_sparse_attention"]),
            ("csa", ["compressed_sparse_attention", "heavily_compressed_attention"]),
            ("hca", ["heavily_compressed_attention", "compressed_sparse_attention"]),
        )
    },
    "mla-sparse": {  # DeepSeek sparse attention: the indexer's parameters and cached keys
        **MLA,
        "model.q_lora_rank": 24,
        "model.index_topk": 4,
        "model.index_n_heads": 2,
        "model.index_head_dim": 8,
    },
}


def test_every_kind_is_registered_on_both_sides_and_implements_the_protocol() -> None:
    assert (
        set(MIXERS)
        == set(MIXER_KINDS)
        == {
            "gqa",
            "mla",
            "gated_deltanet",
            "kda",
            "mamba2",
            "gated_conv",
            "compressed",
        }
    )
    required = [
        name
        for name, value in vars(TokenMixer).items()
        if callable(getattr(value, "__func__", value)) and _raises_not_implemented(value)
    ]
    assert {"forward", "new_state", "param_shapes", "saved_bytes_per_token"} <= set(required)
    for kind, cls in MIXERS.items():
        assert cls.kind == kind
        missing = [name for name in required if name not in vars(cls)]
        assert not missing, f"{kind} lacks {missing}"
    config_side = ["validate", "head_dim", "rope_dim", "sp_heads"]
    for kind, rules in MIXER_KINDS.items():
        assert rules.name == kind
        for name in config_side:  # implemented by the kind or a kind it extends, not the base
            owner = next(c for c in rules.__mro__ if name in vars(c))
            assert owner is not MixerKind, (kind, name)


def _raises_not_implemented(value: object) -> bool:
    code = getattr(getattr(value, "__func__", value), "__code__", None)
    return code is not None and "NotImplementedError" in code.co_names


@pytest.mark.parametrize("case", CASES)
def test_counts_are_what_the_module_builds_and_holds(case: str) -> None:
    cfg = tiny_config(CASES[case])
    m, spec = cfg.model, mixer_spec(cfg.model, 0)
    mixer = build_mixer(m, spec)
    cls = type(mixer)
    built = {name: tuple(p.shape) for name, p in mixer.named_parameters()}
    assert cls.param_shapes(m, spec) == built
    assert list(cls.param_shapes(m, spec)) == list(built)  # in the module's order
    assert cls.param_count(m, spec) == sum(p.numel() for p in mixer.parameters())
    for name, (n_in, n_out) in cls.matrices(m, spec).items():
        assert built[f"{name}.weight"] == (n_out, n_in)
    for dtype in (torch.float32, torch.bfloat16):
        state = mixer.new_state(2, 8, dtype, torch.device("cpu"))
        size = torch.tensor([], dtype=dtype).element_size()
        assert state.bytes_per_token == cls.cache_bytes_per_token(m, spec, size)
        assert state.bytes_per_sequence == cls.cache_bytes_per_sequence(m, spec, size)
        stored = sum(t.numel() * t.element_size() for t in vars(state).values())
        # batch 2, 8 positions
        assert stored == 2 * (8 * state.bytes_per_token + state.bytes_per_sequence)
    model = Transformer(m, cfg.moe)
    assert model_numbers(cfg).total_params == sum(p.numel() for p in model.parameters())
    cache = model.new_cache(1, 8)
    assert cache_bytes_per_token(cfg, 4) == cache.bytes_per_token
    assert cache_bytes_per_sequence(cfg, 4) == cache.bytes_per_sequence


class _RecordingExchange:
    """Sequence parallelism's shapes on one process (rank 0 of ``size``), counting the bytes
    each exchange is handed."""

    rank = 0

    def __init__(self, size: int) -> None:
        self.size, self.sent = size, 0

    def to_heads(self, x_BsHX: torch.Tensor) -> torch.Tensor:
        self.sent += x_BsHX.numel() * x_BsHX.element_size()
        return x_BsHX[:, :, : x_BsHX.shape[2] // self.size].repeat(1, self.size, 1, 1)

    def to_sequence(self, x_BShX: torch.Tensor) -> torch.Tensor:
        self.sent += x_BShX.numel() * x_BShX.element_size()
        return x_BShX[:, : x_BShX.shape[1] // self.size].repeat(1, 1, self.size, 1)


EXCHANGE_CASES = [
    *((case, sp) for case in ("gqa", "gqa-one-kv-head", "gqa-output-gate") for sp in (2, 4)),
    *((case, sp) for case in ("mla", "gated_deltanet", "mamba2", "gated_conv") for sp in (2, 4)),
    ("kda", 2),
    ("kda-ling", 2),
    ("mamba2-biases-one-group", 2),  # its one group repeated to both ranks
    ("gated_conv-bias-wide", 4),
]


@pytest.mark.parametrize(("case", "sp"), EXCHANGE_CASES)
def test_exchange_bytes_are_what_sequence_parallelism_sends(case: str, sp: int) -> None:
    cfg = tiny_config(CASES[case])
    m, spec = cfg.model, mixer_spec(cfg.model, 0)
    mixer = build_mixer(m, spec)
    ex = _RecordingExchange(sp)
    mixer.set_head_exchange(ex)
    b, s = 2, 8  # this rank's slice
    cos, sin = model_rope_tables(m, s)
    mixer(torch.randn(b, s, m.d_model), MixerInputs(cos, sin))
    off_gpu = ex.sent / (b * s) * (sp - 1) / sp
    assert type(mixer).exchange_bytes_per_token(m, spec, 4, sp) == pytest.approx(off_gpu)
    assert type(mixer).exchange_bytes_per_token(m, spec, 4, 1) == 0


@pytest.mark.parametrize("case", ["gqa", "mla"])
def test_sequence_parallelism_splits_the_heads_each_kind_names(case: str) -> None:
    cfg = tiny_config(CASES[case])
    assert MIXER_KINDS[cfg.model.attention].sp_heads(cfg.model) == (("model.n_heads", 4),)
    with pytest.raises(ConfigError, match=r"parallel\.sp_size: must divide model\.n_heads=4"):
        tiny_config(CASES[case], {"parallel.sp_size": 3, "data.seq_len": 30})


def test_sequence_parallelism_splits_the_linear_heads_with_their_channels() -> None:
    cfg = tiny_config(GDN)
    heads = MIXER_KINDS["gated_deltanet"].sp_heads(cfg.model)
    assert heads == (("model.linear_num_key_heads", 4), ("model.linear_num_value_heads", 8))
    gqa_ok = {"model.n_heads": 8, "model.n_kv_heads": 8, "data.seq_len": 48}
    msg = r"parallel\.sp_size: must divide model\.linear_num_key_heads=4"
    with pytest.raises(ConfigError, match=msg):
        tiny_config(GDN, gqa_ok, {"parallel.sp_size": 3, "model.max_seq_len": 96})
