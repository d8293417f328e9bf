"""DeepSeek-V4's attention as a token mixer (``model.attention: compressed``): its keys refused by
name where they contradict, each layer type's RoPE equal to transformers', generation through
its state equal to a full recomputation, a packed row equal to its documents alone, and its
saved bytes against saved-tensor hooks. Its
function against transformers' is ``test_compressed_attention.py``'s (one layer) and the
deepseek_v4 family's (whole models, both ways)."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import Config, ConfigError
from moetrain.config.layer_plan import mixer_spec
from moetrain.model import Transformer
from moetrain.model.mixers import build_mixer
from moetrain.plan import activation_bytes_per_token
from tests.helpers.configs import tiny_config
from tests.unit.test_mixer_protocol import COMPRESSED
from tests.unit.test_plan import _saved_bytes_per_token

TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
V4 = {**COMPRESSED, "model.n_layers": 3, "model.layer_types": TYPES}


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"model.o_groups": 3}, r"model\.o_groups: must divide model\.n_heads=4"),
        ({"model.n_kv_heads": 2}, r"model\.n_kv_heads: must be 1"),
        ({"model.o_lora_rank": None}, r"model\.o_lora_rank: must be set"),
        ({"model.partial_rotary_factor": 0.03}, r"model\.partial_rotary_factor: must rotate"),
        (
            {"model.layer_types": ["full_attention", *TYPES[1:]]},
            r"model\.layer_types: every layer of this kind attends to a sliding window",
        ),
        (
            {"model.attention": "gqa", "model.n_kv_heads": 4},
            r"model\.layer_types: layer 1 is compressed_sparse_attention: needs "
            r"model\.attention of a kind that compresses \(compressed\)",
        ),
        (
            {"model.layer_types": [TYPES[0], TYPES[2], TYPES[2]]},
            r"model\.compress_index_heads: must be set with compressed_sparse_attention "
            r"layers, and only with them",
        ),
        ({"model.compress_index_topk": None}, r"model\.compress_index_topk: must be set"),
        ({"model.compress_index_head_dim": 4}, r"model\.compress_index_head_dim: must be at"),
        ({"model.mtp_depth": 1}, r"model\.mtp_depth: multi-token-prediction blocks"),
        ({"model.nope_layers": [0]}, r"model\.nope_layers: every layer of this kind has RoPE"),
        (
            {
                "model.rope_scaling": "llama3",
                "model.rope_factor": 2.0,
                "model.rope_original_max_seq_len": 16,
                "model.rope_low_freq_factor": 1.0,
                "model.rope_high_freq_factor": 4.0,
            },
            r"model\.rope_scaling: the compressed layers take YaRN",
        ),
        ({"model.rope_interleave": True}, r"model\.rope_interleave: this kind always rotates"),
        (
            {"parallel.sp_size": 2},
            r"parallel\.sp_size: model\.attention=compressed has no sequence parallelism",
        ),
    ],
)
def test_contradicting_keys_are_refused_by_name(overrides: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        tiny_config(V4, overrides)


def test_keys_of_the_kind_are_refused_without_it() -> None:
    with pytest.raises(ConfigError, match=r"model\.o_groups: only applies with model\.attention"):
        tiny_config({"model.o_groups": 2})


@pytest.mark.parametrize("yarn", [False, True], ids=["plain", "yarn"])
def test_each_layer_type_takes_its_own_rope(yarn: bool) -> None:
    """Sliding layers: model.rope_theta, never scaled; compressed ones compress_rope_theta
    with YaRN's frequencies and cos / sin unscaled: transformers' "main" and "compress"."""
    v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from transformers import DeepseekV4Config

    scaling = {"model.rope_scaling": "yarn", "model.rope_factor": 4.0}
    scaling["model.rope_original_max_seq_len"] = 16
    cfg = tiny_config(V4, {"model.rope_theta": 500.0, "model.compress_rope_theta": 7000.0})
    if yarn:
        cfg = tiny_config(V4, scaling, {"model.rope_theta": 500.0})
    m = cfg.model
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    theirs = v4.DeepseekV4RotaryEmbedding(
        DeepseekV4Config(
            hidden_size=m.d_model, num_attention_heads=m.n_heads, head_dim=m.head_dim,
            partial_rotary_factor=m.partial_rotary_factor, rope_theta=m.rope_theta,
            compress_rope_theta=m.compress_rope_theta, rope_parameters=rope if yarn else None,
            num_hidden_layers=3, layer_types=TYPES,
        )
    )  # fmt: skip
    positions = torch.arange(40)[None]
    for layer, rope_type in enumerate(("main", "compress", "compress")):
        mixer = build_mixer(m, mixer_spec(m, layer))
        cos, sin = theirs(torch.zeros(1), positions, layer_type=rope_type)
        ours = mixer.rope_rows(40, torch.device("cpu"))
        torch.testing.assert_close(ours[0], cos[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(ours[1], sin[0], rtol=0, atol=1e-6)


def test_generation_through_the_state_equals_recomputation() -> None:
    """Past the window (5) and several compressor windows (4 and 8), in three calls."""
    cfg = tiny_config(V4)
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe).eval()
    with torch.no_grad():
        for p in model.parameters():  # sinks and position biases away from their zeros
            p.add_(torch.randn_like(p) * 0.1)
        ids = torch.randint(0, cfg.model.vocab_size, (2, 30))
        full = model(ids).logits
        cache = model.new_cache(2, 30)
        parts = [model(ids[:, a:b], cache=cache).logits for a, b in ((0, 11), (11, 12), (12, 30))]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


def test_a_packed_row_equals_its_documents_alone() -> None:
    """Rows of documents of 13, 1, 14 and 9, 19 tokens (starts off the compressor windows of 4
    and 8; past the window of 5, csa keeping 3 of up to 4 entries): the logits and every
    parameter's gradient (of a fixed random weighting of the logits) equal each document run
    alone, to 1e-5 of their scale (measured: below 1e-6). Control: the same rows without their
    documents are off by 0.3 or more of the scale, in the logits and in every gradient."""
    cfg = tiny_config(V4, {"data.document_mask": True})
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe).eval()
    with torch.no_grad():
        for p in model.parameters():  # sinks and position biases away from their zeros
            p.add_(torch.randn_like(p) * 0.1)
    lengths = [[13, 1, 14], [9, 19]]
    ids = torch.randint(0, cfg.model.vocab_size, (2, 28))
    doc_ids = torch.stack(
        [torch.arange(len(r)).repeat_interleave(torch.tensor(r)) for r in lengths]
    )
    weight = torch.randn(2, 28, cfg.model.vocab_size)

    def run(doc_ids_BS: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        logits = model(ids, doc_ids_BS=doc_ids_BS).logits
        (logits * weight).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                 if p.grad is not None}  # fmt: skip

    packed, packed_grads = run(doc_ids)
    unpacked, unpacked_grads = run(None)
    model.zero_grad()
    alone = []
    for row, row_lengths in enumerate(lengths):
        starts = torch.tensor([0, *row_lengths]).cumsum(0).tolist()
        for start, n in zip(starts, row_lengths, strict=False):
            logits = model(ids[row : row + 1, start : start + n]).logits[0]
            (logits * weight[row, start : start + n]).sum().backward()
            alone.append(logits.detach())
    alone = torch.cat(alone).view_as(packed)
    alone_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    def off(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).abs().max() / b.abs().max()).item()

    assert packed_grads.keys() == alone_grads.keys() == unpacked_grads.keys()
    assert off(packed, alone) < 1e-5 and off(unpacked, alone) > 0.3
    for name, grad in alone_grads.items():
        assert off(packed_grads[name], grad) < 1e-5, name
        assert off(unpacked_grads[name], grad) > 0.3, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bytes_match_saved_tensors(dtype: torch.dtype) -> None:
    """The three layer types at 128 positions (several blocks of queries, 32 csa entries), as the
    difference from the same model with grouped-query attention (the rest of the model's
    saved bytes cancel)."""
    seq = {"model.max_seq_len": 256, "data.seq_len": 128}
    cfg = tiny_config(V4, seq)
    gqa = tiny_config(seq, {"model.n_layers": 3})
    a, tokens, n = (4 if dtype == torch.float32 else 2), 256, cfg.model.n_layers

    def predicted(c: Config) -> float:
        return sum(activation_bytes_per_token(c, i, a) for i in range(n))

    # each layer's RoPE table (fp32 cos and sin of the 128 positions): per position
    tables = n * 2 * 128 * cfg.model.rope_dim // 2 * 4 / tokens
    measured = _saved_bytes_per_token(cfg, dtype, tokens) - _saved_bytes_per_token(
        gqa, dtype, tokens
    )
    assert measured - tables == pytest.approx(predicted(cfg) - predicted(gqa), abs=1.0)
