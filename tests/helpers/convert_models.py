"""What the conversion tests build from a format's case (``tests.helpers.convert_cases.CASES``):
its config, the model with no tensor left constant, its export loaded in transformers."""

from __future__ import annotations

import dataclasses

import torch
from safetensors.torch import save_file

from moetrain.config import Config, ModelConfig
from moetrain.convert.formats import hf_config
from moetrain.convert.hf import to_hf_state_dict
from moetrain.model import Transformer
from moetrain.model import param_names as pn
from tests.helpers.configs import tiny_config
from tests.helpers.convert_cases import CASES
from tests.helpers.random_constants import randomise_constants
from tests.helpers.routed import spread_routers


def tiny_cfg(fmt: str, extra: dict | None = None) -> Config:
    """The tiny model with 3 layers and what format ``fmt`` represents (and ``extra``)."""
    return tiny_config(
        {
            "model.vocab_size": 96,
            "model.n_layers": 3,
            "model.head_dim": 16,
            "model.rope_theta": 5000.0,
            "model.norm_eps": 1e-6,
            "moe.expert_hidden": 24,
        },
        {f"model.{k}": v for k, v in CASES[fmt]["model"].items()},
        {f"moe.{k}": v for k, v in CASES[fmt]["moe"].items()},
        extra or {},
    )


def stored_model(cfg: Config) -> ModelConfig:
    """``cfg.model`` as a format's config stores it: without a dense layer, the formats that
    have none store no ``model.dense_hidden`` (an import takes the experts' size)."""
    if any(not cfg.moe.is_moe_layer(i) for i in range(cfg.model.n_layers)):
        return cfg.model
    if cfg.moe.dense_branch:  # (the dense FFN beside the experts: Gemma 4's)
        return cfg.model
    return dataclasses.replace(cfg.model, dense_hidden=cfg.moe.expert_hidden)


def model_for(cfg: Config) -> Transformer:
    """The model of ``cfg`` with random weights and no tensor left constant (norms, biases,
    sinks; the selection bias where the model moves one, ``moe.bias_update_rate`` > 0, as the
    families that store one hold), so that a swapped or dropped tensor shows."""
    torch.manual_seed(0)
    m = Transformer(cfg.model, cfg.moe).eval()
    no_bias = cfg.moe.bias_update_rate == 0
    # (a hash-routed layer's selection bias is never read: the files have no place for it)
    hashed = {pn.expert_bias(i) for i in cfg.moe.hash_layers or ()}
    randomise_constants(
        m, keep=lambda name: (no_bias and pn.is_expert_bias(name)) or name in hashed
    )
    spread_routers(m, cfg.model.d_model)  # every expert routed (routed.py)
    return m


def load_hf(cfg: Config, model: Transformer, fmt: str, path):
    """``model`` exported as ``fmt`` into ``path`` and loaded by transformers (nothing missing or
    unexpected)."""
    import transformers

    hf_config(cfg, fmt).save_pretrained(path)
    save_file(to_hf_state_dict(model.state_dict(), cfg, fmt), str(path / "model.safetensors"))
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    return hf.eval()


def sharpened(model: Transformer, factor: float = 8.0) -> Transformer:
    """``model`` with its query and key projections as if drawn at ``factor`` times the default
    init std (0.02): attention scores that matter (at init they are near zero, and the softmax
    scale would hardly show); a model initialised wider is scaled less."""
    scale = factor * 0.02 / model.cfg.init_std
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".wq.weight", ".wk.weight")):
                p.mul_(scale)
    return model
