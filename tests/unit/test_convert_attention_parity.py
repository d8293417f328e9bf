"""Every format's export gives moetrain's logits in transformers on a model whose attention is far
from uniform, and the comparison catches a wrong positional setting in the export.

Weights drawn with ``model.init_std`` 0.3 (attention logits of order one: at 0.02 attention is
nearly uniform and a doubled ``rope_theta`` moves some formats' logits by 1e-8), 48 positions:
past YaRN's original context (16), gpt-oss's sliding window and Llama 4's chunks (6). The
logits must agree to 1e-5 of their scale (measured: at most 2.5e-6 of it); each format's
negative controls export the same weights under a config with one positional setting changed
-- ``rope_theta`` doubled for every format, and where the format has them YaRN's
``mscale_all_dim``, the sliding window, the chunk size, LongRoPE's attention factor -- and
transformers' logits must then move by at least 20 times that tolerance (measured: 125 to
1e5 times). With sparse attention (DeepSeek-V3.2, GLM-5) each of transformers' indexers must
select moetrain's keys except where index scores tie (its ReLU makes exact zeros, and each
``topk`` orders ties its own way: one query of 96 in one layer here); it then attends to
moetrain's selection, so that one tie does not decide the comparison."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moetrain.config import ModelConfig
from moetrain.config.layer_plan import mixer_spec
from moetrain.config.mixers import MIXER_KINDS
from moetrain.convert.families import FORMATS
from moetrain.convert.formats import hf_config
from tests.helpers.convert_models import load_hf, model_for, tiny_cfg

transformers = pytest.importorskip("transformers")

S, INIT_STD, REL_TOL, CONTROL_FACTOR = 48, 0.3, 1e-5, 20


def _controls(model: ModelConfig) -> list[dict]:
    """The exported settings each format's comparison must be sensitive to (no RoPE setting
    where no layer rotates: Kimi Linear's)."""
    specs = [mixer_spec(model, i) for i in range(model.n_layers)]
    rotates = any(s and s.rope and MIXER_KINDS[s.kind].rope_dim(model) for s in specs)
    out = [{"rope_theta": model.rope_theta * 2}] if rotates else []
    if model.rope_mscale_all_dim is not None:
        out.append({"rope_mscale_all_dim": model.rope_mscale_all_dim + 0.2})
    if model.sliding_window is not None:
        out.append({"sliding_window": model.sliding_window + 1})
    if model.attention_chunk_size is not None:
        out.append({"attention_chunk_size": model.attention_chunk_size + 1})
    if model.rope_attention_factor is not None:
        out.append({"rope_attention_factor": model.rope_attention_factor * 1.05})
    return out


TIE_REL = 1e-5  # index scores this close decide a selection by rounding, not by the model


def _moetrain_selections(monkeypatch, model, ids: torch.Tensor) -> list[tuple]:
    """Run ``model`` on ``ids``; -> each indexer's ``(idx_BSk, valid_BSk, scores_BST)`` in layer
    order (its selection, and its index scores over every key a query may see, -inf elsewhere)."""
    from moetrain.model import sparse_index, sparse_latent

    recorded = []
    real = sparse_latent.select_keys

    def spy(qi, w, ki, keys, topk):  # noqa: ANN001, ANN202
        idx, valid = real(qi, w, ki, keys, topk)
        b, s, t = qi.shape[0], qi.shape[1], ki.shape[1]
        scores = sparse_index._index_scores(qi, w, ki)
        scores = scores.masked_fill(~keys.allowed(0, s, 0, t).expand(b, s, t), float("-inf"))
        recorded.append((idx, valid, scores))
        return idx, valid

    monkeypatch.setattr(sparse_latent, "select_keys", spy)
    with torch.no_grad():
        model(ids)
    monkeypatch.undo()
    return recorded


def _same_selection_unless_tied(hf, recorded: list[tuple]) -> list[int]:
    """Hooks that make each of ``hf``'s indexers use moetrain's selection, after checking that
    its own selects the same keys wherever moetrain's index scores do not tie: transformers'
    ``topk`` breaks exact ties (the indexer's ReLU makes exact zeros) in an order of its own,
    ours in another, and either is the released model's function. -> the count of queries
    decided by ties (filled in by the forward)."""
    indexers = [m for m in hf.modules() if type(m).__name__.endswith("Indexer")]
    assert len(indexers) == len(recorded), (len(indexers), len(recorded))
    tied = [0]

    def hook(i: int):  # noqa: ANN202
        idx, valid, scores = recorded[i]

        def replace(module, args, output):  # noqa: ANN001, ANN202
            allowed = torch.isfinite(scores)
            for b, t in torch.cartesian_prod(*map(torch.arange, idx.shape[:2])).tolist():
                theirs = {j for j in output[b, t].tolist() if allowed[b, t, j]}
                ours = set(idx[b, t][valid[b, t]].tolist())
                if theirs == ours:
                    continue
                a, o = (scores[b, t, sorted(x)].sort().values for x in (theirs, ours))
                torch.testing.assert_close(a, o, rtol=TIE_REL, atol=0, msg=f"{i}:{b},{t}")
                tied[0] += 1
            return idx.masked_fill(~valid, 0).to(output.dtype)

        return replace

    for i, module in enumerate(indexers):
        module.register_forward_hook(hook(i))
    return tied


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_matches_with_attention_far_from_uniform(tmp_path, monkeypatch, fmt: str) -> None:
    extra = {"model.init_std": INIT_STD}
    if fmt == "gpt_oss":  # (its released original context is 4096: YaRN's ramp past it here)
        extra["model.rope_original_max_seq_len"] = 16
    cfg = tiny_cfg(fmt, extra)
    model = model_for(cfg)
    hf = load_hf(cfg, model, fmt, tmp_path)
    ids = torch.randint(0, cfg.model.vocab_size, (2, S), generator=torch.Generator().manual_seed(0))
    tied = None
    if cfg.model.index_topk:  # sparse attention: the same keys wherever the scores decide
        tied = _same_selection_unless_tied(hf, _moetrain_selections(monkeypatch, model, ids))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = model(ids).logits
    if tied is not None:  # (ties are exceptions: at most a few queries of the 2 x 48 per layer)
        assert tied[0] <= 2, tied
    tol = REL_TOL * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    weights = hf.state_dict()
    for change in _controls(cfg.model):
        wrong = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **change))
        other = transformers.AutoModelForCausalLM.from_config(
            hf_config(wrong, fmt), dtype=torch.float32
        )
        other.load_state_dict(weights)
        with torch.no_grad():
            moved = float((other.eval()(input_ids=ids).logits - want).abs().max())
        assert moved > CONTROL_FACTOR * tol, (change, moved, tol)


def test_a_wrongly_scored_indexer_fails_the_tie_check(tmp_path, monkeypatch) -> None:
    """Negative control of the sparse-attention selection check: moetrain's selections taken
    from a model whose first indexer's key projection is perturbed (transformers keeps the
    exported, correct weights) are not explained by ties, and the check says so."""
    cfg = tiny_cfg("deepseek_v32", {"model.init_std": INIT_STD})
    model = model_for(cfg)
    hf = load_hf(cfg, model, "deepseek_v32", tmp_path)
    ids = torch.randint(0, cfg.model.vocab_size, (2, S), generator=torch.Generator().manual_seed(0))
    wk = next(p for n, p in model.named_parameters() if n.endswith("indexer.wk.weight"))
    with torch.no_grad():
        wk.add_(0.1 * torch.randn(wk.shape, generator=torch.Generator().manual_seed(1)))
    _same_selection_unless_tied(hf, _moetrain_selections(monkeypatch, model, ids))
    with torch.no_grad(), pytest.raises(AssertionError, match=r"^\d+:\d+,\d+"):
        hf(input_ids=ids)
