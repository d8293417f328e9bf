"""Gated DeltaNet (``linear_attention`` layers of ``model.linear_attention: gated_deltanet``): the
layer against transformers' Qwen3.5 layer both ways (values and gradients, over several chunks
with strong decays), packed documents through the whole hybrid model, generation from its
recurrent state, bf16, activation checkpointing, its saved tensors against the plan's count,
and its config refused by key."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from moetrain.config import ConfigError
from moetrain.config.layer_plan import LINEAR, mixer_spec
from moetrain.model import Transformer
from moetrain.model.cpu_matmul import use_cpu_matmul
from moetrain.model.mixers import MixerInputs, build_mixer
from moetrain.model.mixers.gated_deltanet import GatedDeltaNet, RecurrentState
from tests.helpers.configs import tiny_config
from tests.helpers.recurrent_models import (
    check_checkpointing_and_bf16,
    check_generation,
    check_packed_documents,
    check_plan_saved_tensors,
)

# a hybrid model: layers 0, 1 Gated DeltaNet, 2 full attention
HYBRID = {
    "model.n_layers": 3,
    "model.full_attention_interval": 3,
    "model.linear_num_key_heads": 2,
    "model.linear_num_value_heads": 4,
    "model.linear_key_head_dim": 8,
    "model.linear_value_head_dim": 6,
    "model.max_seq_len": 256,
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter away from its constant initialisation: norms, the output norm, the decay
    (``A_log`` in [-1, 1.5]: per-step decays down to e^-20) and its bias."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.rand(p.shape, generator=gen) * 2.5 - 1)
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn(p.shape, generator=gen))
        elif "norm" in name:
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)


def _layer_pair(seed: int = 0) -> tuple[GatedDeltaNet, Qwen3_5GatedDeltaNet]:
    cfg = tiny_config(HYBRID).model
    torch.manual_seed(seed)
    ours = build_mixer(cfg, mixer_spec(cfg, 0))
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.3)
    randomise(ours, seed)
    with torch.no_grad():  # weak to strong decays: exp(g) from ~0.9 to ~e^-10 at a = 0
        ours.A_log.copy_(torch.tensor([-2.0, 0.0, 1.0, 1.5]))
        ours.dt_bias.copy_(torch.tensor([-1.0, 0.5, 1.0, 2.0]))
    hf = Qwen3_5TextConfig(
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        rms_norm_eps=cfg.norm_eps,
    )
    theirs = Qwen3_5GatedDeltaNet(hf, 0)
    state = {k.replace("wo.", "out_proj."): v for k, v in ours.state_dict().items()}
    theirs.load_state_dict(state)
    return ours, theirs


def _inputs(s: int) -> MixerInputs:
    return MixerInputs(torch.zeros(s, 0), torch.zeros(s, 0))


@pytest.fixture
def torch_matmul():
    """transformers' matrix kernel (torch's) for the projections: the oneDNN inner product
    moetrain uses on CPU by default sums in another order (its weight gradients here are
    ~2e-5 off an fp64 run, torch's ~3e-6)."""
    use_cpu_matmul("torch")
    yield
    use_cpu_matmul("onednn")


def test_layer_equals_transformers_values_and_gradients(torch_matmul) -> None:
    """200 tokens (four chunks, the last partial), decays per step from ~0.9 to ~e^-10 and
    beyond: values within 1e-5 of the largest, every gradient within 5e-5 (sums over 400
    tokens with cancellation: each side is up to ~1.5e-5 off an fp64 run in A_log's); the
    heads grouped the other way round fails it, and the decay's bias 1e-3 off fails the
    gradients."""
    ours, theirs = _layer_pair()
    decays = -ours.A_log.exp() * torch.nn.functional.softplus(ours.dt_bias)
    assert decays.min() < -9 and decays.max() > -0.1  # strong and weak heads both
    x = torch.randn(2, 200, 32, generator=torch.Generator().manual_seed(1))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa, _inputs(200)), theirs(xb)
    assert _rel(ya, yb) <= 1e-5
    w = torch.randn_like(ya)
    (ya * w).sum().backward()
    (yb * w).sum().backward()
    assert _rel(xa.grad, xb.grad) <= 5e-5
    named = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert _rel(p.grad, named[name.replace("wo.", "out_proj.")].grad) <= 5e-5, name
    # controls: the decay's bias 1e-3 off moves the gradients past the tolerance; value head
    # h reading q/k head h % Hk instead of h // r moves the values
    with torch.no_grad():
        theirs.dt_bias.add_(1e-3)
    theirs.zero_grad()
    (theirs(xb.detach()) * w).sum().backward()
    assert _rel(ours.A_log.grad, theirs.A_log.grad) > 5e-5
    with torch.no_grad():
        theirs.dt_bias.sub_(1e-3)
        qk = ours.in_proj_qkv.weight[:32].view(2, 2, 8, 32)
        theirs.in_proj_qkv.weight[:32] = qk[:, [1, 0]].reshape(32, 32)
        assert _rel(theirs(x), ours(x, _inputs(200))) > 1e-2


def test_packed_documents_equal_each_document_alone_through_the_hybrid_model() -> None:
    """A row of three documents (one spanning a chunk boundary, one a single token) through two
    Gated DeltaNet layers and a full-attention layer: logits and every parameter's gradient
    equal those of the documents run one by one; without document ids they do not."""
    cfg = tiny_config(HYBRID, {"model.loss_chunk_tokens": 0})
    check_packed_documents(cfg, randomise, [70, 1, 57])


def test_generation_from_the_recurrent_state_equals_full_recomputation() -> None:
    cfg = tiny_config(HYBRID)
    torch.manual_seed(3)
    model = Transformer(cfg.model, cfg.moe).eval()
    randomise(model)
    cache = model.new_cache(1, 100)
    assert sum(isinstance(s, RecurrentState) for s in cache.layers) == 2
    assert cache.bytes_per_token == 2 * 2 * 8 * 4  # the attention layer's keys and values
    ch = 2 * 2 * 8 + 4 * 6
    assert cache.bytes_per_sequence == 2 * (3 * ch * 4 + 4 * 8 * 6 * 4)
    check_generation(model, 66, (60, 70))


def test_checkpointing_and_bf16_work_unchanged() -> None:
    check_checkpointing_and_bf16(tiny_config(HYBRID), randomise)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plan_activation_formula_matches_saved_tensors(dtype: torch.dtype) -> None:
    """The whole hybrid model's saved tensors against the plan's per-layer counts (rows a
    multiple of the rule's chunk)."""
    cfg = tiny_config(HYBRID, {"data.seq_len": 128, "model.loss_chunk_tokens": 128})
    check_plan_saved_tensors(cfg, dtype)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"model.linear_num_value_heads": 3}, "model.linear_num_value_heads"),
        ({"model.linear_conv_kernel_dim": 0}, "model.linear_conv_kernel_dim"),
        ({"model.linear_key_head_dim": None}, "model.linear_key_head_dim"),
        ({"model.full_attention_interval": 4}, "model.full_attention_interval"),
        (
            {"model.full_attention_interval": None, "model.layer_types": [LINEAR] * 4},
            "model.layer_types",
        ),
        ({"model.nope_layers": [0]}, "model.nope_layers"),
        ({"model.linear_attention": "gqa"}, "model.linear_attention"),
        ({"model.attention": "gated_deltanet"}, "model.attention"),
        ({"model.full_attention_interval": None}, "model.linear_num_key_heads"),
        ({"parallel.sp_size": 4, "data.seq_len": 64}, "parallel.sp_size"),
    ],
)
def test_unbuildable_configs_are_refused_by_key(overrides: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_config(HYBRID, overrides)
