"""DeepSeek sparse attention (``model.index_topk``, latent attention's option): transformers 5.25's
DeepseekV32 / GlmMoeDsa models computed exactly on sequences longer than the top-k (and not by
dense attention), packed documents, generation through the latent and indexer-key cache, the
two training stages (the warm-up trains the indexers alone; in sparse training the indexers'
KL reaches only them), their metrics, and the config refused by key."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from moetrain.config import ConfigError, read_config_data
from moetrain.convert.formats import config_from_hf, hf_config
from moetrain.generate import generate_ids
from moetrain.init_from.source import resolve_config_data
from moetrain.init_from.weights import build_model
from moetrain.model import Transformer, sparse_index
from moetrain.model.mixers import MixerInputs
from moetrain.model.mixers.mla import LatentCache
from moetrain.model.rope import model_rope_tables
from moetrain.parallel.apply import checkpoint_blocks
from moetrain.plan import attention_bytes_per_token
from tests.helpers.configs import tiny_config
from tests.helpers.convert_models import load_hf, model_for, tiny_cfg
from tests.helpers.hf_models import save_hf_model
from tests.helpers.memory import LargestTensor, saved_storages

transformers = pytest.importorskip("transformers")

FAMILIES = ["deepseek_v32", "glm_moe_dsa"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _sharpened(model: Transformer) -> Transformer:
    """Attention scores of order one (at init they are near zero: every key weighs about the
    same, and which ones are selected would hardly show)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("attn.wq_b.weight", "attn.wkv_b.weight")):
                p.mul_(6.0)
    return model


def _model(fmt: str, **model_keys) -> tuple[Transformer, object]:
    extra = {f"model.{k}": v for k, v in model_keys.items()}
    if model_keys.get("index_stage") == "dense_warmup":  # the indexers alone: no ZeRO optimizer
        extra["parallel.zero_stage"] = 0
    cfg = tiny_cfg(fmt, extra)
    return _sharpened(model_for(cfg)), cfg


def _index_params(model: Transformer) -> set[str]:
    return {n for n, _ in model.named_parameters() if ".attn.indexer." in n}


@pytest.mark.parametrize("fmt", FAMILIES)
def test_logits_equal_transformers_and_differ_from_dense_attention(tmp_path, fmt: str) -> None:
    model, cfg = _model(fmt)
    hf = load_hf(cfg, model, fmt, tmp_path)
    ids = torch.randint(0, 96, (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = hf(input_ids=ids).logits, model(ids).logits
    assert _rel(got, ref) <= 1e-5
    # negative control: the same weights attending densely are far outside the tolerance
    dense_cfg = dataclasses.replace(cfg.model, index_topk=64)
    dense = Transformer(dense_cfg, cfg.moe).eval()
    dense.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert _rel(dense(ids).logits, ref) > 1e-3


def _counting_ties(monkeypatch) -> list[int]:  # noqa: ANN001
    """Every selection from now on appends how many of its queries tie at their k-th score."""
    ties, pick = [], sparse_index._top_k_first_of_ties

    def counting(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        kth = scores.topk(k, dim=-1).values[..., -1:]
        ties.append(int((((scores >= kth).sum(-1) > k) & (kth[..., 0] > float("-inf"))).sum()))
        return pick(scores, k)

    monkeypatch.setattr(sparse_index, "_top_k_first_of_ties", counting)
    return ties


@pytest.mark.parametrize(
    "fmt", [pytest.param("deepseek_v32", marks=pytest.mark.long), "glm_moe_dsa"]
)
def test_the_tiny_transformers_models_import_exactly_without_ties(
    tmp_path, monkeypatch, fmt
) -> None:
    """The families' tiny transformers models as the import tests save them, read by moetrain:
    transformers' logits on rows holding the padding id (the tests' tokenizers' EOS), and no
    query tied at its k-th index score. Where scores tie, which keys transformers keeps is
    torch.topk's internal order (ours keeps the earliest, whatever the layout), so a parity
    model must not tie. Control: transformers' zero padding row, kept, scores every key 0 for
    that token's queries: ties, and other logits."""
    src = save_hf_model(fmt, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    pad = hf.config.pad_token_id
    ids = torch.randint(0, 320, (4, 32), generator=torch.Generator().manual_seed(0))
    ids[:, 9::7] = pad  # (positions 9, 16, 23, 30: past the top-k)
    ties = _counting_ties(monkeypatch)
    rel = _imported_rel(src, hf, ids)
    assert sum(ties) == 0 and rel <= 1e-5, (ties, rel)
    with torch.no_grad():
        hf.get_input_embeddings().weight[pad] = 0.0
    hf.save_pretrained(tmp_path / "zero_pad_row")
    ties.clear()
    rel = _imported_rel(tmp_path / "zero_pad_row", hf, ids)
    assert sum(ties) >= ids.shape[0] and rel > 1e-3, (ties, rel)


def _imported_rel(src: Path, hf, ids: torch.Tensor) -> float:  # noqa: ANN001
    """The relative difference of moetrain's logits, ``src`` read as ``checkpoint.init_from``,
    from transformers' (``hf``)."""
    cfg, source = resolve_config_data(read_config_data(None, [f"checkpoint.init_from={src}"]))
    with torch.no_grad():
        return _rel(build_model(cfg, source).eval()(ids).logits, hf(input_ids=ids).logits)


@pytest.mark.parametrize("fmt", FAMILIES)
def test_a_packed_row_equals_its_documents_alone(fmt: str) -> None:
    model, _ = _model(fmt)
    ids = torch.randint(0, 96, (1, 26), generator=torch.Generator().manual_seed(1))
    doc_ids = torch.tensor([[0] * 9 + [1] * 3 + [2] * 14])
    with torch.no_grad():
        packed = model(ids, doc_ids_BS=doc_ids).logits
        for lo, hi in ((0, 9), (9, 12), (12, 26)):
            assert _rel(packed[:, lo:hi], model(ids[:, lo:hi]).logits) <= 1e-5


@pytest.mark.parametrize(
    "fmt", [pytest.param("deepseek_v32", marks=pytest.mark.long), "glm_moe_dsa"]
)
def test_generation_through_the_cache_equals_full_recomputation(fmt: str) -> None:
    model, cfg = _model(fmt)
    m = cfg.model
    cache = model.new_cache(1, 40)
    assert all(isinstance(state, LatentCache) for state in cache.layers)
    own = sum(layer.mixer.indexer for layer in cfg.layer_plan()[: m.n_layers])
    assert own == (2 if fmt == "glm_moe_dsa" else 3)  # a shared layer caches no indexer keys
    per_layer = m.kv_lora_rank + m.qk_rope_head_dim
    assert cache.bytes_per_token == 4 * (m.n_layers * per_layer + own * m.index_head_dim)
    prompt = [5, 17, 2, 33, 8, 1, 9]
    new = generate_ids(model, prompt, max_new_tokens=8, temperature=0)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert seq[len(prompt) :] == new
        full = model(torch.tensor([seq])).logits
        cache = model.new_cache(1, len(seq))
        first = model(torch.tensor([seq[:9]]), cache=cache).logits  # a prefill past top-k
        rest = [model(torch.tensor([[t]]), cache=cache).logits for t in seq[9:]]
    assert _rel(torch.cat([first, *rest], dim=1), full) <= 1e-5


def _batch(seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (2, 24), generator=g)
    return dict(
        input_ids_BS=ids,
        labels_BS=torch.randint(0, 96, (2, 24), generator=g),
        doc_ids_BS=torch.tensor([[0] * 10 + [1] * 14, [0] * 24]),
    )


def test_the_warmup_stage_trains_the_indexers_alone() -> None:
    model, _ = _model("deepseek_v32", index_stage="dense_warmup")
    model.train()
    index = _index_params(model)
    assert index and {n for n, p in model.named_parameters() if p.requires_grad} == index
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    bias_before = [layer.router.expert_bias.clone() for layer in model.moe_layers()]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], weight_decay=0.1)
    out = model(**_batch())
    assert {own.layer for own in out.mixer_losses} == {0, 1, 2}
    out.loss.backward()
    opt.step()
    for layer in model.moe_layers():  # the aux-loss-free bias of a frozen router stays
        layer.router.update_bias(torch.arange(8.0))
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == index
    for layer, bias in zip(model.moe_layers(), bias_before, strict=True):
        assert torch.equal(layer.router.expert_bias, bias)


def test_the_sparse_stage_indexer_gradient_reaches_only_the_indexers() -> None:
    model, _ = _model("glm_moe_dsa")
    model.train()
    index = _index_params(model)
    out = model(**_batch())
    assert {own.layer for own in out.mixer_losses} == {0, 2}  # layer 1 shares layer 0's
    kl = sum(own.loss for own in out.mixer_losses)
    params = dict(model.named_parameters())
    kl_grads = torch.autograd.grad(kl, list(params.values()), retain_graph=True, allow_unused=True)
    reached = {n for (n, _), g in zip(params.items(), kl_grads, strict=True) if g is not None}
    assert reached == index
    assert all(g.abs().sum() > 0 for g in kl_grads if g is not None)
    main = out.ce_loss + out.moe_loss  # none of it reaches an indexer
    lm_grads = torch.autograd.grad(main, list(params.values()), allow_unused=True)
    assert {n for (n, _), g in zip(params.items(), lm_grads, strict=True) if g is None} == index


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
def test_training_the_indexers_lowers_their_kl_and_raises_their_recall(stage: str) -> None:
    """A few steps of the indexers alone on one batch: their KL to the main attention falls and
    their top-k recall against it rises (the metrics follow what they measure)."""
    model, _ = _model("deepseek_v32", index_stage=stage, index_recall_queries=24)
    model.train()
    if stage == "sparse":  # train only the indexers, so that the target stays put
        for name, p in model.named_parameters():
            p.requires_grad_(".attn.indexer." in name)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    batch = _batch()

    def metrics() -> tuple[float, float]:
        out = model(**batch)
        kl = torch.stack([own.metrics["kl"] for own in out.mixer_losses]).mean()
        recall = torch.stack([own.metrics["recall"] for own in out.mixer_losses]).mean()
        return float(kl), float(recall)

    kl0, recall0 = metrics()
    for _ in range(12):
        opt.zero_grad()
        sum(own.loss for own in model(**batch).mixer_losses).backward()
        opt.step()
    kl1, recall1 = metrics()
    assert kl1 < 0.5 * kl0
    assert recall1 > recall0 + 0.1 and 0 < recall0 < 1


def test_checkpointing_gives_the_same_loss_and_gradients_and_bf16_runs() -> None:
    model, _ = _model("glm_moe_dsa")
    model.train()
    batch = _batch()

    def grads() -> tuple[float, list[torch.Tensor]]:
        model.zero_grad()
        out = model(**batch, return_logits=False)
        out.loss.backward()
        return out.loss.item(), [p.grad.clone() for p in model.parameters()]

    loss, ref = grads()
    checkpoint_blocks(model)
    loss_ckpt, ckpt = grads()
    assert loss_ckpt == pytest.approx(loss, rel=1e-6)
    for a, b in zip(ref, ckpt, strict=True):
        assert _rel(b, a) <= 1e-5
    half, _ = _model("glm_moe_dsa")
    half = half.to(torch.bfloat16).train()
    out = half(**batch, return_logits=False)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(loss, rel=5e-2)
    assert all(torch.isfinite(p.grad).all() for p in half.parameters())


DSA = {
    "model.attention": "mla",
    "model.n_kv_heads": 4,
    "model.q_lora_rank": 12,
    "model.kv_lora_rank": 16,
    "model.qk_nope_head_dim": 8,
    "model.qk_rope_head_dim": 8,
    "model.v_head_dim": 12,
    "model.index_topk": 4,
    "model.index_n_heads": 2,
    "model.index_head_dim": 8,
}


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"model.q_lora_rank": None}, "model.q_lora_rank"),
        ({"model.index_n_heads": None}, "model.index_n_heads"),
        ({"model.index_head_dim": 6}, "model.index_head_dim"),
        ({"model.index_topk": 0}, "model.index_topk"),
        ({"model.indexer_types": ["full", "shared", "full"]}, "model.indexer_types"),
        ({"model.indexer_types": ["shared", "full"]}, "model.indexer_types"),
        ({"model.indexer_types": ["full", "sparse"]}, "model.indexer_types"),
        ({"model.index_topk": None}, "model.index_n_heads"),  # the others need it
        ({"model.index_stage": "warm"}, "model.index_stage"),
        ({"model.index_loss_weight": -1.0}, "model.index_loss_weight"),
        ({"model.attention": "gqa", "model.n_kv_heads": 2}, "model.q_lora_rank"),
    ],
)
def test_unbuildable_sparse_attention_configs_are_refused_by_key(overrides, key) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_config(DSA, overrides)


@pytest.mark.parametrize(
    ("dtype", "sp"), [(torch.float32, 1), (torch.bfloat16, 1), (torch.float32, 2)]
)
@pytest.mark.parametrize("layer", [0, 1], ids=["own-indexer", "shared"])
def test_plan_activation_formula_matches_saved_tensors(
    dtype: torch.dtype, sp: int, layer: int
) -> None:
    """What a sparse layer and its input norm save in training, against ``moetrain plan``'s
    count; a shared layer's selection is its source's (recorded before, not counted). At sp=2
    rank 0 of a sequence-parallel pair (its half of the rows, the whole rows' keys gathered)."""
    from tests.unit.test_plan import _ShapeExchange

    cfg = tiny_config(
        DSA,
        {"model.q_lora_rank": 24, "model.index_topk": 16, "model.max_seq_len": 256},
        {"model.indexer_types": ["full", "shared"], "model.index_recall_queries": 0},
    )
    m = cfg.model
    torch.manual_seed(0)
    model = Transformer(m, cfg.moe).to(dtype).train()
    if sp > 1:
        model.set_head_exchange(_ShapeExchange(sp))
    block = model.layers[layer]
    cos, sin = (t.to(dtype) for t in model_rope_tables(m, 128 // sp))
    x = torch.randn(4, 128 // sp, m.d_model, dtype=dtype, requires_grad=True)
    inputs = MixerInputs(cos, sin)
    if layer:
        model.layers[0].attn(x, inputs)
    owned = [*block.parameters(), cos, sin, *(t for sel in inputs.selections.values() for t in sel)]
    with saved_storages(owned) as seen:
        block.attn(block.attn_norm(x), inputs)
    a = 4 if dtype == torch.float32 else 2
    measured = sum(seen.values()) / x.shape[0] / x.shape[1]
    assert measured == pytest.approx(attention_bytes_per_token(m, a, sp, layer=layer), rel=0.01)


def test_the_warmup_runs_at_zero_stage_0_where_the_model_has_experts() -> None:
    warmup = {"model.index_stage": "dense_warmup"}
    with pytest.raises(ConfigError, match=r"parallel\.zero_stage: sparse attention's dense"):
        tiny_config(DSA, warmup, {"parallel.zero_stage": 2})
    assert tiny_config(DSA, warmup, {"parallel.zero_stage": 0}).model.index_stage == "dense_warmup"
    dense = {"moe.first_k_dense": 2}  # no MoE layer: ZeRO-1/2 hold the indexers alone
    assert tiny_config(DSA, warmup, dense, {"parallel.zero_stage": 2}).parallel.zero_stage == 2


@pytest.mark.parametrize("blocked", [True, False], ids=["blocked", "control-one-block"])
def test_no_s_by_s_tensor_exists_in_a_sparse_training_step(monkeypatch, blocked: bool) -> None:
    """Forward and backward of sparse training at S = 2048 over two documents (index scores,
    masks, selection, KL, gradients): no operator returns a tensor of S * S / 2 values or more.
    Control: with one block of queries for the whole row (no memory bound), the index scores
    are (B, S, Hi, S), which the check catches."""
    s = 2048
    if not blocked:
        monkeypatch.setattr(sparse_index, "BLOCK_VALUES", 1 << 40)
    cfg = tiny_config(DSA, {"model.n_layers": 1, "model.max_seq_len": s, "data.seq_len": s})
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe).train()
    ids = torch.randint(0, 64, (1, s))
    doc_ids = (torch.arange(s) >= s // 3).long()[None]
    with LargestTensor() as largest:
        out = model(ids, labels_BS=ids, doc_ids_BS=doc_ids, return_logits=False)
        out.loss.backward()
    assert out.mixer_losses[0].metrics["kl"] > 0
    if blocked:
        assert largest.numel < s * s // 2, (largest.op, largest.shape)
    else:
        assert largest.numel >= s * s, (largest.op, largest.shape)


GLM5 = Path(__file__).parents[1] / "fixtures" / "released_configs" / "glm_moe_dsa" / "GLM-5.json"


@pytest.mark.parametrize(
    ("keys", "types"),
    [
        ({}, None),  # as released: every layer runs its own indexer
        ({"index_topk_freq": 2}, ["full", "full", "shared", "full", "shared", "full"]),
        ({"index_topk_pattern": "FSSFFS"}, ["full", "shared", "shared", "full", "full", "shared"]),
    ],
    ids=["released", "freq", "pattern"],
)
def test_glm5_indexer_placement_per_layer_imports_and_exports(keys: dict, types) -> None:
    """GLM-MoE-DSA's placement keys (``indexer_types``, or the schedule transformers derives it
    from) become ``model.indexer_types`` and go back out as transformers reads them."""
    hf_dict = {**json.loads(GLM5.read_text()), "num_hidden_layers": 6, **keys}
    cfg = config_from_hf(hf_dict)
    assert cfg.model.indexer_types == types
    out = hf_config(cfg, "glm_moe_dsa")
    assert out.indexer_types == (types or ["full"] * 6)
