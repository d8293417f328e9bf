"""Multi-token prediction against transformers' own implementation: a DeepSeek-V3 model with
three MTP depths, exported by ``moetrain convert``; transformers loads the main model as
``DeepseekV3ForCausalLM`` and the MTP layers as ``MtpModel`` (what ``generate(use_mtp=True)``
drafts with), and each depth's logits equal moetrain's.

transformers runs depth ``k`` on the tokens shifted by ``k`` at their own positions (what it
drafts from), moetrain at the main model's positions: RoPE depends only on the distance between
positions, so the two agree up to rounding. The norms are drawn away from 1: with unit weights
a norm of a normed state equals the norm of the state, and handing the next depth the state
before or after ``shared_head.norm`` would give the same logits (the negative control shows
the test tells the two apart)."""

from __future__ import annotations

import pytest
import torch

from moetrain.checkpoint.write import write_checkpoint
from moetrain.convert.export import convert_checkpoint
from moetrain.model import param_names as pn
from tests.helpers.convert_models import model_for, tiny_cfg
from tests.helpers.hf_models import save_hf_tokenizer

transformers = pytest.importorskip("transformers")
from transformers.modeling_layers import MtpModel  # noqa: E402

VOCAB, DEPTH, S = 300, 3, 24  # YaRN's original context is 16: positions past it


def _parts(model, cfg):
    state = model.state_dict()
    yield "dense", {k: v for k, v in state.items() if not pn.parse_experts(k)}
    for layer in cfg.moe.moe_layers(cfg.model.n_blocks):
        yield (
            f"layers.{layer}",
            {pn.experts(layer, w): state[pn.experts(layer, w)] for w in ("w13", "w2")},
        )


def _moetrain_depth_logits(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each depth's logits over the positions whose input token is in the row (its
    ``head_norm``'s output, captured, through the shared head)."""
    n, normed = model.cfg.n_layers, []
    hooks = [
        block.head_norm.register_forward_hook(lambda _m, _i, out: normed.append(out))
        for block in model.layers[n:]
    ]
    try:
        model(ids, labels_BS=ids)
    finally:
        for h in hooks:
            h.remove()
    return [model.head(h[:, : S - k]) for k, h in enumerate(normed, start=1)]


def _transformers_depth_logits(hf, mtp, ids: torch.Tensor, raw_chain: bool) -> list[torch.Tensor]:
    """transformers' logits of each depth; ``raw_chain``: the next depth gets the state before
    ``shared_head.norm`` (vLLM's DeepSeek MTP chaining) instead of after it."""
    h = hf.model(input_ids=ids).last_hidden_state
    out = []
    for k in range(1, DEPTH + 1):
        layer = mtp.layers[k - 1]
        layer.use_post_norm = not raw_chain
        pos = torch.arange(k, S)[None]
        h = mtp.forward_layer(k - 1, h[:, : S - k], pos, None, input_ids=ids[:, k:])
        out.append(mtp._project_to_logits(layer.post_norm(h) if raw_chain else h))
        layer.use_post_norm = True
    return out


def test_mtp_depths_equal_transformers_mtp_model(tmp_path) -> None:
    cfg = tiny_cfg("deepseek_v3", {"model.mtp_depth": DEPTH, "model.vocab_size": VOCAB})
    cfg.model.init_std = 0.08  # attention far from uniform
    model = model_for(cfg)
    tok = save_hf_tokenizer(["the cat sat on the mat"] * 20, VOCAB, tmp_path / "tok")
    ckpt = write_checkpoint(tmp_path / "ckpt", cfg, _parts(model, cfg), sorted(tok.iterdir()))
    out = convert_checkpoint(ckpt, tmp_path / "hf", fmt="deepseek_v3")

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    # transformers finds the MTP layers by the released layout's pattern (model.layers.61.*,
    # after DeepSeek-V3's 61 decoder layers); here they follow the shrunk model's 3
    n = cfg.model.n_layers
    mtp_layers = "|".join(str(n + k) for k in range(DEPTH))
    hf._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.({mtp_layers})\..*"]
    mtp = MtpModel.from_pretrained(hf).float().eval()
    assert len(mtp.layers) == DEPTH
    for k, layer in enumerate(mtp.layers):  # the export's MTP weights, loaded
        mine = model.layers[n + k]
        assert torch.equal(layer.eh_proj.weight, mine.eh_proj.weight)
        assert torch.equal(layer.post_norm.weight, mine.head_norm.weight)

    ids = torch.randint(0, VOCAB, (2, S), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = _moetrain_depth_logits(model.eval(), ids)
        theirs = _transformers_depth_logits(hf, mtp, ids, raw_chain=False)
        raw = _transformers_depth_logits(hf, mtp, ids, raw_chain=True)
    for k, (got, want, other) in enumerate(zip(ours, theirs, raw, strict=True), start=1):
        scale = float(want.abs().max())
        assert scale > 0.1, k
        tol = 1e-5 * scale
        torch.testing.assert_close(got, want, rtol=0, atol=tol, msg=f"depth {k}")
        # negative control: the other chaining is another function from depth 2 on
        apart = float((other - want).abs().max())
        assert apart < tol if k == 1 else apart > 100 * tol, (k, apart, tol)
