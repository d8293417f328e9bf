"""Multi-token prediction against a hand-written reference of DeepSeek-V3's equations (report
section 2.2): each depth on the sequence shortened by its offset, documents one at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetrain.config import ConfigError
from moetrain.model import Transformer
from moetrain.model import param_names as pn
from moetrain.model.mixers import MixerInputs
from tests.helpers.configs import tiny_config


def build(depth: int = 2, seed: int = 0, **kw) -> Transformer:
    """The tiny model with ``depth`` MTP modules; norms not 1 (with unit weights a norm of a
    normed state is the norm of the state, and the chaining would not show)."""
    cfg = tiny_config(model__mtp_depth=depth, model__loss_chunk_tokens=0, **kw)
    torch.manual_seed(seed)
    model = Transformer(cfg.model, cfg.moe)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def reference_depth_sums(model: Transformer, ids_S: torch.Tensor, labels_S: torch.Tensor):
    """Per depth k: (summed cross-entropy, count) over one document, the equations as written:
    h'_i = M_k [RMSNorm(h^{k-1}_i) ; RMSNorm(Emb(t_{i+k}))] for i < S - k (embedding first in
    M_k's columns, as the released weights), h^k = TRM_k(h') after the shared head's norm (as
    transformers' MtpModel chains it), P = OutHead(h^k) against t_{i+k+1}, which is
    labels[i + k]."""
    n = model.cfg.n_layers
    s = ids_S.shape[0]
    emb_SD = model.embed(ids_S)
    cos, sin = model.rope_cos[:s], model.rope_sin[:s]
    x = emb_SD[None]
    for block in model.layers[:n]:
        x, _ = block(x, MixerInputs(cos, sin))
    h_SD = model.norm(x)[0]
    out = []
    for k, block in enumerate(model.layers[n:], start=1):
        m = s - k
        if m <= 0:
            out.append((torch.zeros(()), 0))
            continue
        joined = torch.cat([block.enorm(emb_SD[k:]), block.hnorm(h_SD[:m])], dim=-1)
        x_MD = joined @ block.eh_proj.weight.T
        y, _ = block(x_MD[None], MixerInputs(cos[:m], sin[:m]))
        h_SD = block.head_norm(y[0])
        logits = h_SD @ model.lm_head.weight.T
        loss = F.cross_entropy(logits.float(), labels_S[k:], reduction="sum")
        out.append((loss, m))
    return out


def test_mtp_loss_equals_the_equations_one_sequence():
    model = build(depth=2).eval()
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (2, 17))
    labels = torch.randint(0, 64, (2, 17))
    out = model(ids, labels_BS=labels)
    for k in range(2):
        sums = [reference_depth_sums(model, ids[b], labels[b])[k] for b in range(2)]
        want = sum(loss for loss, _ in sums) / sum(c for _, c in sums)
        torch.testing.assert_close(out.mtp_losses[k], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.mtp_loss, torch.stack(out.mtp_losses).mean())
    want_total = out.ce_loss + out.moe_loss + 0.3 * out.mtp_loss
    torch.testing.assert_close(out.loss, want_total)


def test_mtp_targets_never_cross_a_document_boundary():
    """Packed documents: each depth equals the reference run on every document alone (its
    labels include the token after its EOS, which the main loss predicts too)."""
    model = build(depth=2).eval()
    torch.manual_seed(2)
    ids = torch.randint(0, 64, (1, 20))
    labels = torch.randint(0, 64, (1, 20))
    doc_ids = torch.tensor([[0] * 7 + [1] * 2 + [2] * 11])
    out = model(ids, doc_ids_BS=doc_ids, labels_BS=labels)
    bounds = [(0, 7), (7, 9), (9, 20)]
    for k in range(2):
        sums = [reference_depth_sums(model, ids[0, a:b], labels[0, a:b])[k] for a, b in bounds]
        want = sum(loss for loss, _ in sums) / sum(c for _, c in sums)
        torch.testing.assert_close(out.mtp_losses[k], want, rtol=1e-5, atol=1e-6)


def test_chunked_loss_and_full_logits_agree_with_mtp():
    torch.manual_seed(3)
    ids, labels = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    model = build(depth=1).eval()
    full = model(ids, labels_BS=labels)
    cfg = tiny_config(model__mtp_depth=1, model__loss_chunk_tokens=5)
    chunked_model = Transformer(cfg.model, cfg.moe).eval()
    chunked_model.load_state_dict(model.state_dict())
    chunked = chunked_model(ids, labels_BS=labels, return_logits=False)
    torch.testing.assert_close(chunked.mtp_losses[0], full.mtp_losses[0], rtol=1e-6, atol=1e-6)


def test_mtp_trains_the_main_model_and_leaves_inference_alone():
    model = build(depth=1)
    plain_cfg = tiny_config(model__loss_chunk_tokens=0)
    plain = Transformer(plain_cfg.model, plain_cfg.moe)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all(k.startswith("layers.2.") for k in unexpected)
    torch.manual_seed(4)
    ids, labels = torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 12))
    torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=0, atol=0)
    out = model(ids, labels_BS=labels, mtp_weight=1.0)
    out.mtp_loss.backward()
    grads = {k: p.grad for k, p in model.named_parameters()}
    for name in (pn.mtp_projection(2), pn.mtp_norm(2, "enorm"), pn.EMBED, pn.attn(0, "wq")):
        assert grads[name] is not None and grads[name].abs().sum() > 0, name
    assert grads[pn.FINAL_NORM].abs().sum() > 0  # h^0 is the main output after its final norm
    assert len(out.moe) == 3  # two decoder layers and the MTP block are MoE


def test_no_position_past_the_row_end_reaches_an_mtp_moe():
    """Depth k's MoE routes the S - k positions whose input token is in the row: its loads,
    balancing loss and capacity count no padding (the depth's loss is unchanged)."""
    model = build(depth=2).eval()
    torch.manual_seed(5)
    ids, labels = torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 12))
    out = model(ids, labels_BS=labels)
    top_k = model.moe_cfg.top_k
    loads = [int(stats.tokens_per_expert_E.sum()) for stats in out.moe]
    assert loads == [2 * 12 * top_k] * 2 + [2 * 11 * top_k, 2 * 10 * top_k]


def test_mtp_weight_per_phase_and_its_keys():
    cfg = tiny_config(
        model__mtp_depth=1, model__mtp_loss_weight_final=0.1, model__mtp_loss_weight_final_step=5
    )
    assert [cfg.model.mtp_weight(s) for s in (1, 4, 5, 9)] == [0.3, 0.3, 0.1, 0.1]
    with pytest.raises(ConfigError, match="model.mtp_loss_weight_final"):
        tiny_config(model__mtp_depth=1, model__mtp_loss_weight_final=0.1)
    with pytest.raises(ConfigError, match="model.mtp_depth"):
        tiny_config(model__mtp_depth=-1)
    # the final weight weights nothing without MTP modules
    with pytest.raises(ConfigError, match=r"model\.mtp_loss_weight_final: .*model\.mtp_depth > 0"):
        tiny_config(model__mtp_loss_weight_final=0.1, model__mtp_loss_weight_final_step=5)
