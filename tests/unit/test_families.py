"""The family registry: what every registered family must have, and what reads it."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch

from moetrain.cli import build_parser
from moetrain.config import ConfigError, ModelConfig, MoEConfig
from moetrain.convert.families import DENSE, FAMILIES, FORMATS, Family, family, of_hf_config
from moetrain.convert.families.holds import ANY
from moetrain.init_from.source import MODEL_KEYS, MOE_KEYS
from moetrain.model import Transformer
from tests.helpers.configs import tiny_config
from tests.helpers.hf_models import tiny_configs

transformers = pytest.importorskip("transformers")


def test_every_family_is_a_transformers_class_with_a_tiny_model() -> None:
    assert set(tiny_configs()) == set(FAMILIES)
    assert set(FORMATS) | set(DENSE) == set(FAMILIES) and not set(FORMATS) & set(DENSE)
    for name, fam in FAMILIES.items():
        config = tiny_configs()[name]()
        assert config.model_type == name
        assert hasattr(transformers, fam.architecture), fam.architecture
        assert fam.dense == (fam.to_hf is None), name
        assert of_hf_config({"architectures": [fam.architecture]}) is fam
        assert of_hf_config({"architectures": [fam.config_architecture]}) is fam
        assert of_hf_config({"model_type": name}) is fam
    assert of_hf_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}) is None
    with pytest.raises(ConfigError, match="unknown format"):
        family("gpt2")


def test_cli_format_choices_are_the_registry() -> None:
    convert = build_parser()._subparsers._group_actions[0].choices["convert"]
    (action,) = [a for a in convert._actions if a.dest == "format"]
    assert action.choices == ["auto", *FORMATS]


def _others(hint: object, value: object) -> list[object]:
    """Other values of a field's type to try."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value * 2, value + 1]
    if isinstance(value, float):
        return [value * 0.5 + 0.01]
    if isinstance(value, str):  # a Literal
        return [v for v in typing.get_args(hint) if v != value]
    return []


def _block_from(name: str, first: int) -> bool:
    """Whether ``name`` is a tensor of block ``first`` or later."""
    parts = name.split(".")
    return parts[0] == "layers" and int(parts[1]) >= first


def _shapes(cfg) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in Transformer(cfg.model, cfg.moe).state_dict().items()}


@pytest.mark.parametrize(("section", "keys"), [("model", MODEL_KEYS), ("moe", MOE_KEYS)])
def test_a_field_that_changes_the_weights_is_marked_function(section, keys) -> None:
    """Any setting that changes the model's tensors defines its function: a source must decide
    it (the ``function`` metadata); the settings not marked leave every name and shape, except
    ``model.mtp_depth``, which adds blocks after the decoder layers that a run may read from a
    source or switch off: it leaves the main model's names and shapes."""
    base = tiny_config({"model.n_layers": 4, "moe.num_shared_experts": 1})
    ref = _shapes(base)
    tried = 0
    hints = typing.get_type_hints(type(getattr(base, section)))
    for f in dataclasses.fields(getattr(base, section)):
        if f.name in keys:
            continue
        value = getattr(getattr(base, section), f.name)
        for other in _others(hints[f.name], value):
            cfg = dataclasses.replace(
                base, **{section: dataclasses.replace(getattr(base, section), **{f.name: other})}
            )
            try:
                cfg.validate()
            except ConfigError:
                continue
            tried += 1
            shapes = _shapes(cfg)
            if f.name == "mtp_depth":
                n = cfg.model.n_layers
                shapes = {k: v for k, v in shapes.items() if not _block_from(k, n)}
            assert shapes == ref, f"{section}.{f.name}={other!r} changes the weights"
    assert tried >= 5


def test_a_family_declares_only_settings_the_shared_check_knows() -> None:
    """A family's ``holds`` overrides rules of BASELINE; a setting it does not know would be
    checked by nothing, so the family is refused where it is defined."""
    with pytest.raises(ValueError, match=r"model\.no_such_setting"):
        Family("x", "XForCausalLM", lambda hf: hf, holds={"model.no_such_setting": ANY})


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_refusal_says_why_in_the_familys_name(fmt: str) -> None:
    """Every rule a family checks gives a reason that names its class, fully formatted."""
    fam, model, moe = family(fmt), ModelConfig(), MoEConfig()
    for key, rule in fam.rules.items():
        if rule == ANY:
            continue
        why = rule.reason(key, fam.architecture, model, moe)
        assert why.startswith(fam.architecture) and "{" not in why, (key, why)
        assert "holds no other value" not in why, (key, why)  # (a phrase for every value)
