"""The per-head largest attention logit (model/logit_max.py) against a dense reference under
every mask the training forward uses, and QK-clip (MuonClip): it fires on a head whose largest
logit is forced over the threshold, brings that head's logits to the threshold, and changes no
other head's logits and no other weight."""

from __future__ import annotations

import pytest
import torch

from moetrain.model.attention import document_mask
from moetrain.model.doc_attention import Documents
from moetrain.model.logit_max import logit_max
from moetrain.model.transformer import Transformer
from moetrain.optim.registry import build_optimizer
from moetrain.train.attention_logits import AttentionLogits, clip_factors
from tests.helpers.configs import tiny_config
from tests.unit.test_muon import MLA


def _dense(q, k, scale, allowed_B1SS):
    h, g = q.shape[1], k.shape[1]
    k = k.repeat_interleave(h // g, dim=1)
    scores = (q.double() @ k.double().mT) * scale
    scores = scores.masked_fill(~allowed_B1SS, float("-inf"))
    return scores.amax(dim=(0, 2, 3)).float()


@pytest.mark.parametrize("case", ["causal", "documents", "window", "chunk", "documents+window"])
def test_logit_max_matches_the_dense_reference(case: str, monkeypatch) -> None:
    import moetrain.model.logit_max as lm

    monkeypatch.setattr(lm, "QUERY_BLOCK", 5)  # several blocks of queries
    gen = torch.Generator().manual_seed(0)
    b, h, g, s, d = 2, 4, 2, 13, 8
    q, k = torch.randn(b, h, s, d, generator=gen), torch.randn(b, g, s, d, generator=gen)
    doc_ids = torch.tensor([[0] * 4 + [1] * 6 + [2] * 3, [5] * 13])
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (j <= i)[None, None].expand(b, 1, s, s)
    docs, window, chunk = None, None, None
    if "documents" in case:
        docs = Documents.from_ids(doc_ids)
        allowed = document_mask(doc_ids)
    if "window" in case:
        window = 3
        allowed = allowed & (j > i - window)
    if case == "chunk":
        chunk = 4
        allowed = allowed & (j // chunk == i // chunk)
    got = logit_max(q, k, 0.5, docs, window, chunk)
    torch.testing.assert_close(got, _dense(q, k, 0.5, allowed), rtol=1e-6, atol=1e-6)


def _tracked_maxima(model, ids) -> torch.Tensor:
    logits = AttentionLogits(model, world_size=1)
    logits.track(True)
    with torch.no_grad():
        model(ids)
    maxima = logits.reduce(torch.device("cpu"))
    logits.track(False)
    return maxima


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_qk_clip_fires_where_forced_and_nowhere_else(attention: str) -> None:
    settings = {"optim.name": "muon", "optim.muon.qk_clip": 1.0}
    if attention == "mla":
        settings |= MLA
    cfg = tiny_config(settings)
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe)
    attn = model.layers[0].attn
    head, heads = 1, cfg.model.n_heads
    wq = attn.wq if attention == "gqa" else attn.wq_b
    rows = wq.weight.shape[0] // heads
    with torch.no_grad():
        wq.weight[head * rows : (head + 1) * rows] *= 30.0  # this head's logits grow 30x
    ids = torch.randint(
        0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)
    )
    before = _tracked_maxima(model, ids)
    others = before.clone()
    others[0, head] = -torch.inf
    threshold = float(others.max()) * 1.5
    assert float(before[0, head]) > 2 * threshold  # forced over; every other head under
    scales = AttentionLogits(model, 1).row_scales(before, threshold)
    assert set(scales) == {
        f"layers.0.attn.{n}"
        for n in (
            ("wq.weight", "wk.weight") if attention == "gqa" else ("wq_b.weight", "wkv_b.weight")
        )
    }
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    for group in opt.param_groups:
        group["lr"] = 0.0  # only the clip changes weights
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.set_row_scales(scales)
    opt.step()
    after = _tracked_maxima(model, ids)
    assert float(after[0, head]) == pytest.approx(threshold, rel=1e-5)
    # the layer's other heads see the same input: their logits are unchanged (a later layer's
    # input changes with this head's attention); no other weight moved
    keep = [h for h in range(heads) if h != head]
    torch.testing.assert_close(after[0, keep], before[0, keep], rtol=1e-5, atol=1e-6)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, weights[n])}
    assert changed == set(scales)
    assert clip_factors(torch.tensor([0.5, 2.0, float("-inf")]), 1.0).tolist() == [1.0, 0.5, 1.0]


def test_qk_clip_is_refused_with_sparse_attention() -> None:
    """Sparse attention's layers track no largest logit: MuonClip there would never clip."""
    from moetrain.config import ConfigError

    sparse = {**MLA, "model.index_topk": 4, "model.index_n_heads": 2, "model.index_head_dim": 16}
    tiny_config(sparse, {"optim.name": "muon"})  # sparse attention under Muon is fine
    with pytest.raises(ConfigError, match=r"optim\.muon\.qk_clip: cannot bound .* sparse"):
        tiny_config(sparse, {"optim.name": "muon", "optim.muon.qk_clip": 1.0})
