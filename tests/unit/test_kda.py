"""Kimi Delta Attention (``linear_attention`` layers of ``model.linear_attention: kda``): the layer
against transformers' Kimi Linear layer (values and gradients, over several chunks with strong
per-channel decays), its chunked rule against the token recurrence in fp64 (values and
gradients, packed documents), packed documents and generation through a hybrid model, its saved
tensors against the plan's count, and its config refused by key."""

from __future__ import annotations

import pytest
import torch
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

from moetrain.config import ConfigError
from moetrain.config.layer_plan import mixer_spec
from moetrain.model import Transformer
from moetrain.model import delta_rule as rules
from moetrain.model.mixers import MixerInputs, build_mixer
from moetrain.model.mixers import gated_deltanet as gdn_module
from moetrain.model.mixers.gated_deltanet import RecurrentState
from moetrain.model.mixers.kda import KimiDeltaAttention
from tests.helpers.configs import tiny_config
from tests.helpers.recurrent_models import (
    check_family_both_ways,
    check_generation,
    check_packed_documents,
    check_plan_saved_tensors,
)
from tests.unit.test_gated_deltanet import randomise, torch_matmul  # noqa: F401 (a fixture)

# a hybrid model: layers 0, 1 Kimi Delta Attention, 2 full attention
HYBRID = {
    "model.n_layers": 3,
    "model.full_attention_interval": 3,
    "model.linear_attention": "kda",
    "model.linear_num_heads": 4,
    "model.linear_head_dim": 8,
    "model.max_seq_len": 256,
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _inputs(s: int, docs: torch.Tensor | None = None) -> MixerInputs:
    return MixerInputs(torch.zeros(s, 0), torch.zeros(s, 0), doc_ids_BS=docs)


def hf_names(name: str) -> str:
    """A KDA layer's parameter name -> transformers' in-memory one (the convolutions are
    joined apart)."""
    for p in ("f_a_proj", "f_b_proj", "dt_bias", "A_log"):
        if name.startswith(p):
            return f"forget_gate.{name}"
    return name.replace("wo.", "o_proj.")


def _our_layer(seed: int = 0) -> KimiDeltaAttention:
    cfg = tiny_config(HYBRID).model
    torch.manual_seed(seed)
    ours = build_mixer(cfg, mixer_spec(cfg, 0))
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.3)
    randomise(ours, seed)
    with torch.no_grad():  # weak to strong decays per channel: exp(g) from ~0.9 to ~e^-10
        ours.A_log.copy_(torch.tensor([-2.0, 0.0, 1.0, 1.5]))
        ours.dt_bias.copy_(torch.linspace(-1.0, 2.0, 32))
    return ours


def _layer_pair(seed: int = 0) -> tuple[KimiDeltaAttention, KimiLinearDeltaAttention]:
    ours = _our_layer(seed)
    cfg = tiny_config(HYBRID).model
    hf = KimiLinearConfig(
        hidden_size=cfg.d_model,
        num_hidden_layers=3,
        linear_attn_config={"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 4},
        rms_norm_eps=cfg.norm_eps,
    )
    theirs = KimiLinearDeltaAttention(hf, 0)
    state = {hf_names(k): v for k, v in ours.state_dict().items() if "conv1d" not in k}
    state["forget_gate.A_log"] = state["forget_gate.A_log"].view(1, 1, -1, 1)
    convs = [ours.get_parameter(f"{p}_conv1d.weight") for p in "qkv"]
    state["conv1d.weight"] = torch.cat(convs).detach()
    theirs.load_state_dict(state)
    return ours, theirs


def test_layer_equals_transformers_values_and_gradients(torch_matmul) -> None:  # noqa: F811
    """200 tokens (four chunks, the last partial), per-channel decays per step from ~0.9 to
    ~e^-10 and beyond: values within 1e-5 of the largest, every gradient within 5e-5; the
    decay's bias 1e-3 off fails the gradients, the gate's activation silu instead of sigmoid
    the values."""
    ours, theirs = _layer_pair()
    x = torch.randn(2, 200, 32, generator=torch.Generator().manual_seed(1))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa, _inputs(200)), theirs(xb)
    assert _rel(ya, yb) <= 1e-5
    w = torch.randn_like(ya)
    (ya * w).sum().backward()
    (yb * w).sum().backward()
    assert _rel(xa.grad, xb.grad) <= 5e-5
    named = dict(theirs.named_parameters())
    convs = torch.cat([ours.get_parameter(f"{p}_conv1d.weight").grad for p in "qkv"])
    assert _rel(convs, named["conv1d.weight"].grad) <= 5e-5
    for name, p in ours.named_parameters():
        if "conv1d" not in name:
            theirs_grad = named[hf_names(name)].grad.view(p.shape)
            assert _rel(p.grad, theirs_grad) <= 5e-5, name
    with torch.no_grad():  # controls
        theirs.forget_gate.dt_bias.add_(1e-3)
    theirs.zero_grad()
    (theirs(xb.detach()) * w).sum().backward()
    assert _rel(ours.A_log.grad, theirs.forget_gate.A_log.grad.view(-1)) > 5e-5
    with torch.no_grad():
        theirs.forget_gate.dt_bias.sub_(1e-3)
    theirs.o_norm.activation = "silu"
    assert _rel(theirs(x), ours(x, _inputs(200))) > 1e-2


def test_chunked_equals_recurrent_in_fp64_values_and_gradients(monkeypatch) -> None:
    """The layer in fp64 over a packed row (documents of 70, 1 and 129 tokens: several chunks,
    one starting mid-chunk) with the chunked rule and with the token recurrence in its place:
    the output and every gradient within 1e-12 of the largest; a 1e-9 change of one head's
    decay fails it."""
    ours = _our_layer().double()
    x = torch.randn(2, 200, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate([70, 1, 129])]).expand(2, -1)
    w = torch.randn(2, 200, 32, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        ours.zero_grad()
        xg = x.clone().requires_grad_()
        y = ours(xg, _inputs(200, docs))
        (y * w).sum().backward()
        return y.detach(), [xg.grad, *(p.grad.clone() for p in ours.parameters())]

    chunked, chunked_grads = run()
    monkeypatch.setattr(gdn_module, "gated_delta_rule", rules.gated_delta_rule_recurrent)
    recurrent, grads = run()
    assert _rel(chunked, recurrent) <= 1e-12
    for a, b in zip(chunked_grads, grads, strict=True):
        assert _rel(a, b) <= 1e-12
    with torch.no_grad():
        ours.dt_bias[9] += 1e-8
    assert _rel(run()[0], chunked) > 1e-12


def test_packed_documents_equal_each_document_alone_through_the_hybrid_model() -> None:
    """A row of three documents through two KDA layers and a full-attention layer: logits and
    every gradient equal those of the documents one by one; without document ids they do
    not."""
    cfg = tiny_config(HYBRID, {"model.loss_chunk_tokens": 0})
    check_packed_documents(cfg, randomise, [70, 1, 57])


def test_generation_from_the_recurrent_state_equals_full_recomputation() -> None:
    cfg = tiny_config(HYBRID)
    torch.manual_seed(3)
    model = Transformer(cfg.model, cfg.moe).eval()
    randomise(model)
    cache = model.new_cache(1, 100)
    assert sum(isinstance(s, RecurrentState) for s in cache.layers) == 2
    assert cache.bytes_per_sequence == 2 * (3 * 3 * 32 * 4 + 4 * 8 * 8 * 4)
    check_generation(model, 66, (60, 70))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plan_activation_formula_matches_saved_tensors(dtype: torch.dtype) -> None:
    cfg = tiny_config(HYBRID, {"data.seq_len": 128, "model.loss_chunk_tokens": 128})
    check_plan_saved_tensors(cfg, dtype)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"model.linear_head_dim": None}, "model.linear_head_dim"),
        ({"model.linear_conv_kernel_dim": 0}, "model.linear_conv_kernel_dim"),
        ({"model.nope_layers": [0]}, "model.nope_layers"),
        ({"model.linear_num_key_heads": 2}, "model.linear_num_key_heads"),
        ({"model.attention": "kda"}, "model.attention"),
        (
            {"parallel.sp_size": 3, "data.seq_len": 48},
            "parallel.sp_size: must divide model.linear_num_heads",
        ),
    ],
)
def test_unbuildable_configs_are_refused_by_key(overrides: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_config(HYBRID, overrides)


def test_the_shared_convolution_width_is_kept_with_kda_alone() -> None:
    """``linear_conv_kernel_dim`` (declared by Gated DeltaNet) sets KDA's width too."""
    cfg = tiny_config(HYBRID, {"model.linear_conv_kernel_dim": 2}).model
    assert build_mixer(cfg, mixer_spec(cfg, 0)).q_conv1d.weight.shape == (32, 1, 2)


MLA_NOPE = {  # Kimi Linear's latent attention: no RoPE in any layer
    "model.attention": "mla",
    "model.n_kv_heads": 4,
    "model.kv_lora_rank": 16,
    "model.qk_nope_head_dim": 8,
    "model.qk_rope_head_dim": 4,
    "model.v_head_dim": 6,
    "model.nope_layers": [0, 1],
}


def test_latent_attention_without_rope_equals_kimi_linears() -> None:
    """A NoPE latent attention layer (``model.nope_layers``) equals transformers'
    ``KimiLinearAttention`` (its rope part computed, never rotated); the same layer with RoPE
    does not."""
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

    cfg = tiny_config(MLA_NOPE).model
    torch.manual_seed(0)
    ours = build_mixer(cfg, mixer_spec(cfg, 0))
    hf = KimiLinearConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
    )
    hf._attn_implementation = "eager"
    theirs = KimiLinearAttention(hf, 0)
    names = {"wq": "q_proj", "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm"}
    names |= {"wkv_b": "kv_b_proj", "wo": "o_proj"}
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(torch.randn(p.shape) * 0.3 + (1 if "norm" in name else 0))
            theirs.get_parameter(names[name.split(".")[0]] + ".weight").copy_(p)
    x = torch.randn(2, 20, 32)
    mask = torch.full((20, 20), float("-inf")).triu(1)[None, None]
    cos, sin = torch.randn(20, 2), torch.randn(20, 2)
    expected = theirs(x, mask)[0]
    assert _rel(ours(x, MixerInputs(cos, sin)), expected) <= 1e-5
    rotated = build_mixer(
        cfg, mixer_spec(tiny_config(MLA_NOPE, {"model.nope_layers": [1]}).model, 0)
    )
    rotated.load_state_dict(ours.state_dict())
    assert _rel(rotated(x, MixerInputs(cos, sin)), expected) > 1e-2


def test_latent_attention_without_rope_refuses_sparse_attention_by_key() -> None:
    sparse = {"model.index_topk": 4, "model.index_n_heads": 2, "model.index_head_dim": 8}
    with pytest.raises(ConfigError, match=r"model\.nope_layers"):
        tiny_config(MLA_NOPE, sparse | {"model.q_lora_rank": 24})


def test_kimi_linear_family_over_several_chunks_and_packed_both_ways(
    tmp_path,
    torch_matmul,  # noqa: F811
) -> None:
    """The tiny Kimi Linear case (two KDA layers, NoPE latent attention, group-limited sigmoid
    routing) over 200 tokens (four chunks of the rule): moetrain's logits equal transformers'
    on moetrain's export, and moetrain's import of transformers' own weights equals it too
    (1e-5 of the logits' scale, fp32); a packed row of three documents equals each document
    through transformers alone."""
    from tests.helpers.convert_cases import load_hf, model_for, tiny_cfg

    cfg = tiny_cfg("kimi_linear", {"model.max_seq_len": 256})
    model = model_for(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):  # decays per step from ~0.9 to ~e^-10
                p.uniform_(-1.0, 1.5)
    hf = load_hf(cfg, model, "kimi_linear", tmp_path)
    ids = torch.randint(0, 96, (2, 200), generator=torch.Generator().manual_seed(0))

    _, alone = check_family_both_ways(cfg, model, hf, "kimi_linear", ids, [70, 1, 129])
    with torch.no_grad():
        assert _rel(model(ids[:1]).logits, alone) > 1e-2  # (no documents)


@pytest.mark.parametrize(
    ("fmt", "changes", "key"),
    [
        ("kimi_linear", {"model.nope_layers": None}, "model.nope_layers"),
        ("kimi_linear", {"moe.score_func": "softmax"}, "moe.score_func"),
        ("qwen3_next", None, "model.linear_attention"),  # (KDA beside grouped-query attention)
        ("deepseek_v3", {}, "model.linear_attention"),
    ],
)
def test_formats_refuse_what_they_cannot_hold_by_key(fmt: str, changes: dict, key: str) -> None:
    """Kimi Linear's class holds NoPE latent attention only; the other classes no KDA."""
    from moetrain.convert.formats import choose_format
    from tests.helpers.convert_cases import tiny_cfg

    cfg = tiny_config(HYBRID) if changes is None else tiny_cfg("kimi_linear", changes)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        choose_format(cfg, fmt)


@pytest.mark.parametrize(
    ("field", "value"),
    [("mla_use_nope", False), ("moe_router_activation_func", "softmax")],
)
def test_kimi_linear_configs_it_cannot_represent_are_refused_by_field(field, value) -> None:
    from moetrain.convert.families import kimi_linear
    from tests.helpers.convert_cases import tiny_cfg

    fields = kimi_linear.to_hf(tiny_cfg("kimi_linear")) | {field: value}
    with pytest.raises(ConfigError, match=field):
        kimi_linear.from_hf(KimiLinearConfig(**fields))
