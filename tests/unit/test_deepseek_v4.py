"""The deepseek_v4 family's own checks (its logits both ways, weight layouts, released config,
init_from and EP=2 continued pretraining are the generic tests', on the case of
``tests/helpers/convert_cases.py``): that the parity case's 19 tokens make the compression
and the indexer's selection matter, its refusals by key both ways, and the compressed mixer's
tracked logit maxima."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import ConfigError
from moetrain.convert.families import family
from moetrain.convert.formats import choose_format
from moetrain.model import compressed_kernel
from tests.helpers.convert_models import model_for, tiny_cfg

v4 = pytest.importorskip("transformers.models.deepseek_v4")


def _logits(cfg, ids: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    with torch.no_grad():
        return model_for(cfg)(ids).logits


def test_the_parity_case_binds_compression_and_selection() -> None:
    """19 tokens, window 3: keeping every entry, or no entries at all, moves the logits."""
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(0))
    base = _logits(tiny_cfg("deepseek_v4"), ids)
    every = _logits(tiny_cfg("deepseek_v4", {"model.compress_index_topk": 9}), ids)
    types = {"model.layer_types": ["sliding_attention"] * 3}
    none = {**types, **{f"model.compress_index_{k}": None for k in ("heads", "head_dim", "topk")}}
    sliding = _logits(tiny_cfg("deepseek_v4", none), ids)
    assert (base - every).abs().max() > 1e-3
    assert (base[:, 4:] - sliding[:, 4:]).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"model.hc_streams": 1}, "model.hc_streams"),
        ({"moe.score_func": "sigmoid"}, "moe.score_func"),
        ({"moe.swiglu_up_offset": 1.0}, "moe.swiglu_up_offset"),
        ({"moe.num_shared_experts": 2, "moe.shared_expert_hidden": 48}, "moe.num_shared_experts"),
        ({"model.ffn_activation": "swiglu"}, "model.ffn_activation"),
    ],
)
def test_settings_its_class_cannot_hold_are_refused_by_key(changes: dict, key: str) -> None:
    cfg = tiny_cfg("deepseek_v4", changes)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        choose_format(cfg, "deepseek_v4")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("n_shared_experts", 2, r"n_shared_experts: DeepseekV4ForCausalLM has one shared"),
        ("scoring_func", "softmax", r"scoring_func: DeepseekV4ForCausalLM routes with sqrt"),
    ],
)
def test_sources_it_cannot_hold_are_refused_by_field(field: str, value, match: str) -> None:  # noqa: ANN001
    from tests.helpers.hf_models import hf_config

    hf = hf_config("deepseek_v4")
    setattr(hf, field, value)
    with pytest.raises(ConfigError, match=match):
        family("deepseek_v4").from_hf(hf)


def test_yarn_with_an_attention_factor_is_refused() -> None:
    from tests.helpers.hf_models import hf_config

    hf = hf_config("deepseek_v4")
    hf.rope_parameters["compress"]["attention_factor"] = 1.2
    with pytest.raises(ConfigError, match=r"rope_parameters\.compress\.attention_factor"):
        family("deepseek_v4").from_hf(hf)


def test_tracked_logit_maxima_are_the_window_and_entry_logits(monkeypatch) -> None:  # noqa: ANN001
    """The sliding layer's against a dense reference; every layer's alike at blocks of 4 and
    64 queries."""
    cfg = tiny_cfg("deepseek_v4")
    model = model_for(cfg)
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(1))
    seen, captured = {}, {}
    for block in (4, 64):
        monkeypatch.setattr(compressed_kernel, "BLOCK", block)
        for layer in model.layers:
            layer.attn.track_logits, layer.attn.logit_max_H = True, None
        hook = model.layers[0].attn.register_forward_hook(
            lambda m, args, out: captured.setdefault("x", args[0])
        )
        with torch.no_grad():
            model(ids)
        hook.remove()
        seen[block] = torch.stack([layer.attn.logit_max_H for layer in model.layers])
    torch.testing.assert_close(seen[4], seen[64], rtol=1e-6, atol=1e-6)
    attn = model.layers[0].attn
    x = captured["x"]
    cos, sin = attn.rope_rows(19, x.device)
    with torch.no_grad():
        q = attn.wq_b(attn.q_norm(attn.wq_a(x))).view(2, 19, 4, 16).transpose(1, 2)
        q = compressed_kernel_rotate(q, attn, cos, sin)
        kv = compressed_kernel_rotate(attn.kv_norm(attn.wkv(x)), attn, cos, sin)
    logits = torch.matmul(q, kv.unsqueeze(1).transpose(-1, -2)) * 16**-0.5
    lag = torch.arange(19)[:, None] - torch.arange(19)[None, :]
    logits = logits.masked_fill(~((lag >= 0) & (lag < 3)), float("-inf"))
    torch.testing.assert_close(seen[4][0], logits.amax(dim=(0, 2, 3)), rtol=1e-6, atol=1e-6)


def compressed_kernel_rotate(x: torch.Tensor, attn, cos, sin) -> torch.Tensor:  # noqa: ANN001
    """The layer's queries (per head, normalised) or key, rotated as its forward does."""
    from moetrain.model.attention import unit_rms
    from moetrain.model.compressed_attention import rotate_pairs

    if x.dim() == 4:
        x = unit_rms(x, attn.shape.norm_eps)
    return rotate_pairs(x, cos, sin)
