"""The weight layouts between moetrain and each Hugging Face format, through the one weight
mapper: every tensor in exactly one entry, a token mixer's names found by what the model's
parameter names say, any range of experts read alone, and the tensors a format cannot hold
refused by name."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from moetrain.config import ConfigError
from moetrain.convert import weight_map
from moetrain.convert.families import FORMATS
from moetrain.convert.hf import to_hf_state_dict
from moetrain.convert.weight_entries import InMemory
from moetrain.convert.weight_map import WeightMap
from moetrain.model import param_names as pn
from tests.helpers.convert_models import model_for, tiny_cfg

transformers = pytest.importorskip("transformers")


def test_softmax_with_nonzero_bias_tensor_is_refused() -> None:
    cfg = tiny_cfg("mixtral")
    sd = model_for(cfg).state_dict()
    sd["layers.1.ffn.router.expert_bias"] = torch.full((4,), 0.5)
    with pytest.raises(ConfigError, match=r"layers\.1\.ffn\.router\.expert_bias"):
        to_hf_state_dict(sd, cfg, "mixtral")


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_tensor_has_one_entry_and_one_name_in_the_files(fmt: str) -> None:
    """Each moetrain tensor (a tied head aside) is in exactly one entry; each file tensor has
    one name; what is written is what the export plans, with the planned shapes."""
    extra = {"model.mtp_depth": 1} if fmt == "deepseek_v3" else {}
    cfg = tiny_cfg(fmt, extra)
    sd = model_for(cfg).state_dict()
    weights = WeightMap(cfg, fmt)
    ours = Counter(k for e in weights.entries for k in e.ours)
    tied = {pn.LM_HEAD} if cfg.model.tie_embeddings else set()
    assert set(ours) == set(sd) - tied and max(ours.values()) == 1
    planned = [
        (n, s) for part in (None, *weights.moe_layers) for n, s, _ in weights.hf_tensors(part)
    ]
    assert len({n for n, _ in planned}) == len(planned)
    written = to_hf_state_dict(sd, cfg, fmt)
    assert {n: tuple(t.shape) for n, t in written.items()} == dict(planned)


@pytest.mark.parametrize("fmt", FORMATS)
def test_any_range_of_experts_reads_alone(fmt: str) -> None:
    """An expert-parallel rank's experts [1, 3) from the files' layout (per expert, fused or
    stacked): the rows of the whole, read from their tensors only."""
    cfg = tiny_cfg(fmt)
    sd = model_for(cfg).state_dict()
    files = InMemory(to_hf_state_dict(sd, cfg, fmt))
    weights = WeightMap(cfg, fmt, present=files.tensors)
    for layer in weights.moe_layers:
        part = weights.read_experts(files, layer, (1, 3))
        assert set(part) == {k for k in sd if k.startswith(pn.experts_prefix(layer))}
        for name, t in part.items():
            assert torch.equal(t, sd[name][1:3]), name


def test_a_mixers_names_come_from_its_parameter_names(monkeypatch) -> None:
    """The same moetrain name maps by the table that names all of its block's mixer weights
    (``attn.q_norm``: grouped-query attention's q_norm, latent attention's q_a_layernorm); a
    mixer no table names is refused by its first tensor."""
    gqa = WeightMap(tiny_cfg("qwen3_moe"), "qwen3_moe")
    assert gqa.hf_name("layers.0.attn.q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    mla_cfg = tiny_cfg("deepseek_v3")
    mla = WeightMap(mla_cfg, "deepseek_v3")
    name = "model.layers.0.self_attn.q_a_layernorm.weight"
    assert mla.hf_name("layers.0.attn.q_norm.weight") == name
    monkeypatch.setattr(weight_map, "MIXER_NAMES", weight_map.MIXER_NAMES[:1])
    with pytest.raises(ConfigError, match=r"layers\.0\.attn\.wq_a\.weight: no deepseek_v3"):
        WeightMap(mla_cfg, "deepseek_v3")
