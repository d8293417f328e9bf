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
1e5 times)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moetrain.config import ModelConfig
from moetrain.config.layer_plan import mixer_spec
from moetrain.config.mixers import MIXER_KINDS
from moetrain.convert.families import FORMATS
from moetrain.convert.formats import hf_config
from tests.helpers.convert_cases import load_hf, model_for, tiny_cfg

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


# Known defect, open: with attention this far from uniform, DeepSeek-V3.2's export selects other
# keys than transformers' indexer at about 1% of the positions past its top-k (logits up to 0.3
# apart there; equal elsewhere): near-ties of the indexer's scores rounded differently, or a
# real difference in the indexer; not found yet.
KNOWN = {"deepseek_v32": "DSA top-k selection differs from transformers' at ~1% of positions"}


@pytest.mark.parametrize(
    "fmt",
    [
        pytest.param(f, marks=pytest.mark.xfail(reason=KNOWN[f], strict=False)) if f in KNOWN else f
        for f in FORMATS
    ],
)
def test_export_matches_with_attention_far_from_uniform(tmp_path, fmt: str) -> None:
    extra = {"model.init_std": INIT_STD}
    if fmt == "gpt_oss":  # (its released original context is 4096: YaRN's ramp past it here)
        extra["model.rope_original_max_seq_len"] = 16
    cfg = tiny_cfg(fmt, extra)
    model = model_for(cfg)
    hf = load_hf(cfg, model, fmt, tmp_path)
    ids = torch.randint(0, cfg.model.vocab_size, (2, S), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = model(ids).logits
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
