"""Multi-head latent attention (``model.attention=mla``): its config refused by key where it
cannot be built, transformers 5.25's DeepseekV3 / DeepseekV2 attention and a whole DeepseekV3
decoder computed exactly, generation from a cache of latents, and the counts of
``model_numbers`` and ``moetrain plan`` against the built model."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

from moetrain.config import ConfigError, ModelConfig, MoEConfig
from moetrain.config.layer_plan import MixerSpec
from moetrain.generate import generate_ids
from moetrain.model import RMSNorm, Transformer
from moetrain.model.mixers import MixerInputs
from moetrain.model.mixers.mla import LatentCache, MLAttention
from moetrain.model.rope import model_rope_tables
from moetrain.model_numbers import model_numbers
from moetrain.parallel.apply import checkpoint_blocks
from moetrain.plan import attention_bytes_per_token
from tests.helpers.configs import tiny_config
from tests.helpers.memory import saved_storages

# moetrain's name -> transformers' name of each MLA weight
HF_NAMES = {
    "wq": "q_proj",
    "wq_a": "q_a_proj",
    "q_norm": "q_a_layernorm",
    "wq_b": "q_b_proj",
    "wkv_a": "kv_a_proj_with_mqa",
    "kv_norm": "kv_a_layernorm",
    "wkv_b": "kv_b_proj",
    "wo": "o_proj",
}
DIMS = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=12)
YARN_HF = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 1024,
    "beta_fast": 24.0,
    "beta_slow": 2.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}
YARN = dict(
    rope_scaling="yarn",
    rope_factor=4.0,
    rope_original_max_seq_len=1024,
    rope_beta_fast=24.0,
    rope_beta_slow=2.0,
    rope_mscale=1.0,
    rope_mscale_all_dim=0.8,
)
MLA = {
    "model.attention": "mla",
    "model.n_kv_heads": 4,
    "model.kv_lora_rank": 16,
    "model.qk_nope_head_dim": 8,
    "model.qk_rope_head_dim": 16,
    "model.v_head_dim": 12,
}


def _model_cfg(q_lora_rank: int | None, interleave: bool, yarn: bool, **extra) -> ModelConfig:
    keys = dict(vocab_size=64, d_model=48, n_layers=2, n_heads=4, n_kv_heads=4, dense_hidden=40)
    keys.update(max_seq_len=64, norm_eps=1e-6, attention="mla", q_lora_rank=q_lora_rank)
    keys.update(rope_interleave=interleave, **DIMS, **(YARN if yarn else {}))
    cfg = ModelConfig(**{**keys, **extra})
    cfg.validate()
    return cfg


def _hf_config(cls: type, q_lora_rank: int | None, interleave: bool, yarn: bool):
    rope = {"rope_theta": 10000.0, **(YARN_HF if yarn else {"rope_type": "default"})}
    extra = {"rope_interleave": interleave} if cls is DeepseekV3Config else {}
    cfg = cls(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_parameters=rope,
        first_k_dense_replace=2,  # every layer dense: the attention is what is compared
        tie_word_embeddings=False,
        **DIMS,
        **extra,
    )
    cfg._attn_implementation = "eager"
    return cfg


@torch.no_grad()
def _randomise(module: torch.nn.Module) -> None:
    """Weights of order one (norm weights around one), so that every path shows in the output."""
    for name, p in module.named_parameters():
        p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _causal_mask(s: int) -> torch.Tensor:
    return torch.full((s, s), float("-inf")).triu(1)[None, None]


def _attention_pair(version: int, q_lora_rank, interleave, yarn):
    hf_mod, cls = (hf_v3, DeepseekV3Config) if version == 3 else (hf_v2, DeepseekV2Config)
    hc = _hf_config(cls, q_lora_rank, interleave, yarn)
    attn_cls = hf_mod.DeepseekV3Attention if version == 3 else hf_mod.DeepseekV2Attention
    rotary_cls = (
        hf_mod.DeepseekV3RotaryEmbedding if version == 3 else hf_mod.DeepseekV2RotaryEmbedding
    )
    ref = attn_cls(hc, 0).eval()
    ours = MLAttention(_model_cfg(q_lora_rank, interleave, yarn), MixerSpec("mla")).eval()
    _randomise(ours)
    state = {}
    for key, value in ours.state_dict().items():
        module, param = key.split(".")
        state[f"{HF_NAMES[module]}.{param}"] = value
    ref.load_state_dict(state)
    return ours, ref, rotary_cls(hc)


@pytest.mark.parametrize("yarn", [False, True])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_attention_matches_transformers_deepseek_v3(q_lora_rank, interleave, yarn) -> None:
    torch.manual_seed(0)
    ours, ref, rotary = _attention_pair(3, q_lora_rank, interleave, yarn)
    x = torch.randn(2, 24, 48)
    pos = torch.arange(24)[None].expand(2, -1)
    cos, sin = model_rope_tables(_model_cfg(q_lora_rank, interleave, yarn))
    with torch.no_grad():
        expected, _ = ref(x, rotary(x, pos), _causal_mask(24))
        got = ours(x, MixerInputs(cos, sin))
    assert ours.scale == pytest.approx(ref.scaling, rel=1e-12)
    assert _rel(got, expected) <= 1e-5


@pytest.mark.parametrize("yarn", [False, True])
def test_attention_matches_transformers_deepseek_v2(yarn: bool) -> None:
    """DeepSeek-V2 (-Lite: no query LoRA) rotates interleaved pairs in complex form, and keeps
    them interleaved; moetrain's interleaved layout gives the same attention."""
    torch.manual_seed(1)
    ours, ref, rotary = _attention_pair(2, None, True, yarn)
    x = torch.randn(2, 20, 48)
    freqs_cis = rotary(x, torch.arange(20)[None].expand(2, -1))
    cos, sin = model_rope_tables(_model_cfg(None, True, yarn))
    with torch.no_grad():
        expected, _ = ref(x, _causal_mask(20), position_embeddings=freqs_cis)
        got = ours(x, MixerInputs(cos, sin))
    assert _rel(got, expected) <= 1e-5


def _hf_to_moetrain(key: str) -> str:
    key = key.removeprefix("model.").replace("embed_tokens", "embed")
    key = key.replace("input_layernorm", "attn_norm").replace(
        "post_attention_layernorm", "ffn_norm"
    )
    key = key.replace("mlp.gate_proj", "ffn.w1").replace("mlp.up_proj", "ffn.w3")
    key = key.replace("mlp.down_proj", "ffn.w2").replace("self_attn.", "attn.")
    for ours, theirs in HF_NAMES.items():
        key = key.replace(f"attn.{theirs}.", f"attn.{ours}.")
    return key


@pytest.mark.parametrize(
    ("q_lora_rank", "interleave", "yarn"), [(24, True, True), (None, False, False)]
)
def test_decoder_matches_transformers_deepseek_v3(q_lora_rank, interleave, yarn) -> None:
    """A whole (dense) DeepseekV3 decoder: embeddings, blocks, norm and head give the same
    logits, with a document mask against transformers' on each document alone."""
    torch.manual_seed(2)
    hc = _hf_config(DeepseekV3Config, q_lora_rank, interleave, yarn)
    ref = hf_v3.DeepseekV3ForCausalLM(hc).eval()
    cfg = _model_cfg(q_lora_rank, interleave, yarn)
    ours = Transformer(cfg, MoEConfig(first_k_dense=cfg.n_layers)).eval()
    _randomise(ours)
    ours_state = ours.state_dict()
    ref.load_state_dict({k: ours_state[_hf_to_moetrain(k)] for k in ref.state_dict()})
    ids = torch.randint(0, 64, (2, 30))
    with torch.no_grad():
        expected = ref(ids).logits
        assert _rel(ours(ids).logits, expected) <= 1e-5
        doc_ids = torch.tensor([[0] * 12 + [1] * 18] * 2)
        got = ours(ids, doc_ids_BS=doc_ids).logits
        second = ref(ids[:, 12:]).logits  # alone, from position 0 (RoPE is relative)
    assert _rel(got[:, :12], expected[:, :12]) <= 1e-5
    assert _rel(got[:, 12:], second) <= 1e-5


YARN_OVERRIDES = {
    "model.rope_scaling": "yarn",
    "model.rope_factor": 4.0,
    "model.rope_original_max_seq_len": 16,
    "model.rope_mscale_all_dim": 1.0,
}


def _mla_model(*overrides: dict) -> Transformer:
    cfg = tiny_config(MLA, {"model.q_lora_rank": 24, "model.max_seq_len": 48}, *overrides)
    torch.manual_seed(3)
    model = Transformer(cfg.model, cfg.moe).eval()
    _randomise(model)
    return model


def test_generation_caches_latents_and_matches_full_recomputation() -> None:
    model = _mla_model(YARN_OVERRIDES)
    cache = model.new_cache(1, 40)
    m = model.cfg
    assert all(isinstance(state, LatentCache) for state in cache.layers)
    assert cache.bytes_per_token == m.n_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * 4
    prompt = [5, 17, 2, 33, 8, 1]
    new = generate_ids(model, prompt, max_new_tokens=20, temperature=0)
    assert len(new) == 20
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(20):  # greedy by full recomputation, no cache
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert seq[len(prompt) :] == new
        full = model(torch.tensor([seq])).logits
        cache = model.new_cache(1, len(seq))
        first = model(torch.tensor([seq[:7]]), cache=cache).logits  # a prefill of 7
        rest = [model(torch.tensor([[t]]), cache=cache).logits for t in seq[7:]]
    assert _rel(torch.cat([first, *rest], dim=1), full) <= 1e-5
    assert cache.pos == len(seq)


def test_checkpointing_chunked_loss_and_bf16_work_unchanged() -> None:
    model = _mla_model()
    ids = torch.randint(0, 64, (2, 32))
    labels = torch.randint(0, 64, (2, 32))
    doc_ids = torch.tensor([[0] * 10 + [1] * 22, [0] * 32])

    def grads(m: Transformer, **kw) -> tuple[torch.Tensor, list[torch.Tensor]]:
        m.zero_grad()
        loss = m(ids, doc_ids_BS=doc_ids, labels_BS=labels, **kw).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.parameters()]

    loss, ref_grads = grads(model)  # full logits
    loss_chunked, chunked = grads(model, return_logits=False)
    checkpoint_blocks(model)
    loss_ckpt, ckpt = grads(model, return_logits=False)
    assert loss_chunked == pytest.approx(loss.item(), rel=1e-6)
    assert loss_ckpt == pytest.approx(loss.item(), rel=1e-6)
    for a, b, c in zip(ref_grads, chunked, ckpt, strict=True):
        assert _rel(b, a) <= 1e-5 and _rel(c, a) <= 1e-5
    half = _mla_model().to(torch.bfloat16)
    loss_bf16 = half(ids, doc_ids_BS=doc_ids, labels_BS=labels, return_logits=False).loss
    loss_bf16.backward()
    assert loss_bf16.item() == pytest.approx(loss.item(), rel=2e-2)
    assert all(torch.isfinite(p.grad).all() for p in half.parameters())


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_parameter_count_and_flops_follow_the_built_model(q_lora_rank) -> None:
    cfg = tiny_config(MLA, {"model.q_lora_rank": q_lora_rank})
    model = Transformer(cfg.model, cfg.moe)
    nums = model_numbers(cfg)
    assert nums.total_params == sum(p.numel() for p in model.parameters())
    m = cfg.model
    scores = 6 * m.n_layers * m.n_heads * (24 + 12) * cfg.data.seq_len
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    routed_inactive = expert * (1 - cfg.moe.top_k / cfg.moe.num_experts)
    matmul = sum(p.numel() for n, p in model.named_parameters() if "norm" not in n)
    matmul -= m.vocab_size * m.d_model  # the embedding is a lookup
    assert nums.flops_per_token == pytest.approx(6 * (matmul - routed_inactive) + scores)
    assert model.layers[0].attn.wkv_a.weight.shape == (16 + 16, m.d_model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_plan_activation_formula_matches_saved_tensors(q_lora_rank, dtype) -> None:
    """v_head_dim = qk_nope + qk_rope here: no head-dim padding, so CPU saves what the
    formula counts."""
    cfg = _model_cfg(q_lora_rank, False, False, max_seq_len=256)
    cfg.v_head_dim = cfg.attention_head_dim
    norm, attn = RMSNorm(cfg.d_model).to(dtype), MLAttention(cfg, MixerSpec("mla")).to(dtype)
    cos, sin = (t.to(dtype) for t in model_rope_tables(cfg))  # per position, not per token
    x = torch.randn(4, 256, cfg.d_model, dtype=dtype, requires_grad=True)
    owned = [*attn.parameters(), *norm.parameters(), cos, sin]
    with saved_storages(owned) as seen:
        attn(norm(x), MixerInputs(cos, sin))
    a = 4 if dtype == torch.float32 else 2
    assert "flash" in attn.sdpa_kernel and "padded" not in attn.sdpa_kernel
    assert sum(seen.values()) / x.shape[0] / x.shape[1] == pytest.approx(
        attention_bytes_per_token(cfg, a), rel=0.01
    )


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"model.qk_rope_head_dim": 7}, "model.qk_rope_head_dim"),
        ({"model.kv_lora_rank": None}, "model.kv_lora_rank"),
        ({"model.v_head_dim": 0}, "model.v_head_dim"),
        ({"model.q_lora_rank": -1}, "model.q_lora_rank"),
        ({"model.n_kv_heads": 2}, "model.n_kv_heads"),
        ({"model.head_dim": 8}, "model.head_dim"),
        ({"model.qk_norm": True}, "model.qk_norm"),
        ({"model.qkv_bias": True}, "model.qkv_bias"),
        ({"model.attention": "gqa"}, "model.kv_lora_rank"),  # an MLA key on GQA
        ({"model.attention": "latent"}, "model.attention"),
    ],
)
def test_unbuildable_mla_configs_are_refused_by_key(overrides: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_config(MLA, overrides)


def test_mla_config_needs_no_divisible_d_model() -> None:
    """MLA's head dims are its own keys: d_model need not split into n_heads."""
    cfg = tiny_config(MLA, {"model.d_model": 30, "model.n_heads": 4})
    assert cfg.model.attention_head_dim == 24 and cfg.model.rope_dim == 16
