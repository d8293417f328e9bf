"""MiMo-V2-Flash's attention pieces, each a grouped-query attention option any family may use:
value heads narrower than the query/key heads (``model.v_head_dim``), the value scale, more
key/value heads, sinks and another RoPE theta on the sliding layers. Each against attention
written out here (values and gradients, with negative controls), the KV cache against
transformers, the config rules, the family's refusals and every other family's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetrain.config import ConfigError
from moetrain.config.layer_plan import layer_types
from moetrain.convert.families import FORMATS, family
from moetrain.convert.formats import choose_format
from moetrain.init_from.source import resolve_config_data
from moetrain.model.mixers import MixerInputs
from tests.helpers.configs import tiny_config
from tests.helpers.convert_models import load_hf, model_for, sharpened, tiny_cfg
from tests.helpers.decoding import generation_matches
from tests.helpers.hf_models import save_hf_model

transformers = pytest.importorskip("transformers")

S = 13  # positions: the window (6) binds


def written_out(attn, x_BSD, *, theta, window, sinks, value_scale):  # noqa: ANN001, ANN201
    """Causal attention of ``attn``'s weights, every step spelled out: per-head projections,
    half-split rotation of the first rotary dims by ``theta``, key/value heads repeated, the
    window's band, a sink column per head, the softmax, the values scaled, the output
    projection."""
    b, s, _ = x_BSD.shape
    h, g, hd, vd = attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.v_head_dim
    q = (x_BSD @ attn.wq.weight.T).view(b, s, h, hd).transpose(1, 2)
    k = (x_BSD @ attn.wk.weight.T).view(b, s, g, hd).transpose(1, 2)
    v = (x_BSD @ attn.wv.weight.T).view(b, s, g, vd).transpose(1, 2) * value_scale
    r = math.floor(hd * 0.334)
    inv = theta ** -(torch.arange(0, r, 2, dtype=torch.float32) / r)
    ang = torch.arange(s, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = ang.cos(), ang.sin()

    def rotate(t: torch.Tensor) -> torch.Tensor:
        a, c, rest = t[..., : r // 2], t[..., r // 2 : r], t[..., r:]
        return torch.cat([a * cos - c * sin, c * cos + a * sin, rest], dim=-1)

    q, k = rotate(q), rotate(k)
    k, v = k.repeat_interleave(h // g, dim=1), v.repeat_interleave(h // g, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (j <= i) & ((i - j < window) if window is not None else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, h, 1, 1).expand(b, h, s, 1)], dim=-1)
    p = torch.softmax(scores, dim=-1)[..., :s]
    return (p @ v).transpose(1, 2).reshape(b, s, h * vd) @ attn.wo.weight.T


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    return sharpened(model_for(tiny_cfg("mimo_v2_flash")))


def _run(model, layer: int, x_BSD: torch.Tensor, **changes) -> tuple:  # noqa: ANN001
    """Block ``layer``'s attention against the written-out reference (``changes``: a wrong
    reference, for the controls): outputs, and the gradients of the input, sinks and values."""
    cfg, attn = model.cfg, model.layers[layer].attn
    sliding = layer > 0
    ref = dict(
        theta=cfg.sliding_rope_theta if sliding else cfg.rope_theta,
        window=cfg.sliding_window if sliding else None,
        sinks=attn.sinks,
        value_scale=cfg.attention_value_scale,
    )
    ref |= changes
    inputs = MixerInputs(model.rope_cos[:S], model.rope_sin[:S])
    inputs.local_rope = (model.rope_local_cos[:S], model.rope_local_sin[:S])
    outs = []
    for fn in (lambda x: attn(x, inputs), lambda x: written_out(attn, x, **ref)):
        x = x_BSD.clone().requires_grad_(True)
        model.zero_grad()
        out = fn(x)
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        params = [attn.wv.weight] + ([attn.sinks] if attn.sinks is not None else [])
        outs.append(
            (
                out.detach(),
                x.grad,
                *[torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params],
            )
        )
    return outs


def test_layers_hold_their_types_pieces(model) -> None:
    """Layer 0 full: 1 key/value head, no sinks, the model's theta; layers 1, 2 sliding: 2
    heads, sinks, the sliding theta; value heads of 8 beside query/key heads of 12."""
    full, sliding = model.layers[0].attn, model.layers[1].attn
    assert (full.n_kv_heads, full.sinks, full.local_rope) == (1, None, False)
    assert (sliding.n_kv_heads, sliding.sinks.shape, sliding.local_rope) == (2, (4,), True)
    assert sliding.wv.weight.shape == (2 * 8, 32) and sliding.wo.weight.shape == (32, 4 * 8)
    assert not torch.equal(model.rope_cos, model.rope_local_cos)


@pytest.mark.parametrize("layer", [0, 1])
def test_attention_equals_the_written_out_reference(model, layer: int) -> None:
    x = torch.randn(2, S, 32, generator=torch.Generator().manual_seed(layer))
    got, want = _run(model, layer, x)
    for a, b in zip(got, want, strict=True):  # (1e-5 of each tensor's scale)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


# each piece left out of the reference: the module's output leaves the tolerance far behind
CONTROLS = {
    "the full layer's theta": (1, dict(theta=5000.0)),
    "the sliding layer's theta": (0, dict(theta=500.0)),
    "no value scale": (1, dict(value_scale=1.0)),
    "no sinks": (1, dict(sinks=None)),
    "no window": (1, dict(window=None)),
}


@pytest.mark.parametrize("control", list(CONTROLS))
def test_a_reference_without_a_piece_is_caught(model, control: str) -> None:
    layer, changes = CONTROLS[control]
    x = torch.randn(2, S, 32, generator=torch.Generator().manual_seed(layer))
    got, want = _run(model, layer, x, **changes)
    for a, b in zip(got[:2], want[:2], strict=True):  # outputs and input gradients
        gap = (a - b).abs().max() / b.abs().max()
        assert gap > 100 * 1e-5, (control, gap)


def test_generation_through_the_cache_matches_transformers(tmp_path) -> None:
    """Greedy tokens and every cached step's logits: the narrower values and the sliding
    layers' heads in the cache, their sinks and theta at the cache's positions."""
    cfg = tiny_cfg("mimo_v2_flash")
    model = sharpened(model_for(cfg))
    generation_matches(model, load_hf(cfg, model, "mimo_v2_flash", tmp_path), 6)


LONGROPE = {
    "model.rope_scaling": "longrope",
    "model.rope_original_max_seq_len": 64,
    "model.rope_short_factor": [1.0] * 4,
    "model.rope_long_factor": [2.0] * 4,
}
SLIDING = {
    "model.n_layers": 3,
    "model.sliding_window": 6,
    "model.layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
}


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"model.sliding_n_kv_heads": 2}, "model.sliding_n_kv_heads"),  # no sliding layers
        ({"model.sliding_rope_theta": 500.0}, "model.sliding_rope_theta"),
        ({**SLIDING, "model.sliding_n_kv_heads": 3}, "model.sliding_n_kv_heads"),  # 4 % 3
        ({"model.attention_sinks_layers": "sliding"}, "model.attention_sinks_layers"),
        (
            {"model.attention_output_gate": True, "model.v_head_dim": 4},
            "model.v_head_dim",
        ),
        (
            {**SLIDING, "model.sliding_rope_theta": 500.0, **LONGROPE},
            "model.sliding_rope_theta",
        ),
    ],
)
def test_config_refuses_what_the_options_cannot_mean(settings: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_config(settings)


PIECES = {
    "model.v_head_dim": {"model.v_head_dim": 8},
    "model.attention_value_scale": {"model.attention_value_scale": 0.7},
    "model.sliding_n_kv_heads": {**SLIDING, "model.sliding_n_kv_heads": 4},
    "model.sliding_rope_theta": {**SLIDING, "model.sliding_rope_theta": 500.0},
    "model.attention_sinks_layers": {
        **SLIDING,
        "model.attention_sinks": True,
        "model.attention_sinks_layers": "sliding",
    },
}


@pytest.mark.parametrize("setting", list(PIECES))
def test_families_without_the_pieces_refuse_them_by_key(setting: str) -> None:
    """(A gated family's config refuses narrower value heads itself; latent attention
    families refuse grouped-query attention's keys at validation.)"""
    for fmt in FORMATS:
        if fmt == "mimo_v2_flash" or family(fmt).can_hold("model.attention", "mla"):
            continue
        piece = PIECES[setting]
        types = set(layer_types(tiny_cfg(fmt).model))
        if "model.layer_types" in piece and types != {"full_attention"}:
            if "sliding_attention" not in types:
                continue  # (a hybrid: its own layer pattern)
            piece = {k: v for k, v in piece.items() if k not in SLIDING}  # (its own windows)
        try:
            cfg = tiny_cfg(fmt, piece)
        except ConfigError as e:
            assert str(e).split(":")[0] in piece, (fmt, e)  # (by one of the piece's keys)
            continue
        assert setting in [k for k, _ in family(fmt).problems(cfg.model, cfg.moe)], fmt


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"model.sliding_n_kv_heads": 1}, "model.sliding_n_kv_heads"),
        ({"model.attention_sinks_layers": "all"}, "model.attention_sinks_layers"),
        ({"model.rope_scaling": "yarn", "model.rope_factor": 2.0}, "model.rope_scaling"),
        ({"moe.first_k_dense": 0, "moe.layer_ffns": ["moe", "none", "moe"]}, "moe.layer_ffns"),
    ],
)
def test_mimo_refuses_what_its_class_lacks_by_key(changes: dict, key: str) -> None:
    extra = dict(changes)
    if key == "model.rope_scaling":
        extra["model.rope_original_max_seq_len"] = 64
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        choose_format(tiny_cfg("mimo_v2_flash", extra), "mimo_v2_flash")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        (
            "rope_parameters",
            {
                "full_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
            "rope_parameters.full_attention.rope_type",
        ),
        (
            "rope_parameters",
            {
                "full_attention": {"rope_theta": 1e4, "partial_rotary_factor": 0.5},
                "sliding_attention": {"rope_theta": 1e4, "partial_rotary_factor": 0.25},
            },
            "partial_rotary_factor",
        ),
        ("mlp_layer_types", ["dense", "shared", "sparse"], "mlp_layer_types"),
    ],
)
def test_configs_moetrain_cannot_compute_are_refused(field: str, value, match: str) -> None:  # noqa: ANN001
    from moetrain.convert.families.mimo_v2_flash import from_hf
    from tests.helpers.hf_models import hf_config

    hf = hf_config("mimo_v2_flash")
    setattr(hf, field, value)
    with pytest.raises(ConfigError, match=match):
        from_hf(hf)


def test_an_irregular_ffn_pattern_round_trips(tmp_path) -> None:
    """mlp_layer_types that are not dense first layers: moe.layer_ffns, both ways."""
    cfg = tiny_cfg(
        "mimo_v2_flash", {"moe.first_k_dense": 0, "moe.layer_ffns": ["moe", "dense", "moe"]}
    )
    model = model_for(cfg)
    hf = load_hf(cfg, model, "mimo_v2_flash", tmp_path)
    ids = torch.randint(0, 96, (2, S))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(input_ids=ids).logits)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["mlp_layer_types"] == ["sparse", "dense", "sparse"]
    assert written["moe_layer_freq"] == [1, 0, 1]


def test_released_mtp_layers_are_left_unread_as_transformers_does(tmp_path) -> None:
    """The released files' ``model.mtp.*`` tensors (which transformers' class does not load)
    are not read where config.json declares them, refused where it does not; the model cannot
    export multi-token-prediction modules."""
    src = save_hf_model("mimo_v2_flash", tmp_path / "src")
    tensors = load_file(src / "model.safetensors")
    tensors["model.mtp.layers.0.input_layernorm.weight"] = torch.ones(32)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    spec = [f"checkpoint.init_from={src}"]
    from moetrain.checkpoint.format import CheckpointError
    from moetrain.config import read_config_data
    from moetrain.init_from.weights import check_source_tensors

    cfg, source = resolve_config_data(read_config_data(None, spec))
    with pytest.raises(CheckpointError, match=r"model\.mtp\.layers\.0"):
        check_source_tensors(source)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    cfg, source = resolve_config_data(read_config_data(None, spec))
    check_source_tensors(source)
    assert cfg.model.mtp_depth == 0
    with pytest.raises(ConfigError, match=r"model\.mtp_depth"):
        choose_format(tiny_cfg("mimo_v2_flash", {"model.mtp_depth": 1}), "mimo_v2_flash")


RELEASED = Path(__file__).parents[1] / "fixtures" / "released_configs" / "mimo_v2_flash"
# released keys an export does not take from the model: written by save_pretrained / the
# tokenizer's side, or not read by either engine; transformers reads sliding_window as the
# window with the query (sliding_window_size + 1), which the export writes
NOT_FROM_THE_MODEL = {
    "architectures",
    "attention_dropout",
    "bos_token_id",
    "dtype",
    "eos_token_id",
    "model_type",
    "sliding_window",
    "use_cache",
}


def test_the_export_writes_the_released_keys_serving_engines_read() -> None:
    """Imported from the released config.json and exported, every released key comes back with
    its value: the keys transformers does not read (vLLM's MiMo-V2-Flash model reads
    ``layernorm_epsilon``, ``hybrid_layer_pattern``, ``swa_*``, ...) included."""
    from moetrain.convert.families.mimo_v2_flash import FAMILY

    released = json.loads((RELEASED / "MiMo-V2-Flash.json").read_text())
    written = FAMILY.to_hf(FAMILY.from_hf(transformers.MiMoV2FlashConfig(**released)))
    differ = {
        k: (v, written.get(k, "missing"))
        for k, v in released.items()
        if k not in NOT_FROM_THE_MODEL and written.get(k, "missing") != v
    }
    assert not differ, differ
    assert written["sliding_window"] == released["sliding_window_size"] + 1
