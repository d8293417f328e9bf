"""Choosing a Hugging Face format for a moetrain model, and the configs between the two, for
any family of the registry (:mod:`moetrain.convert.families`, where each family's rules are).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moetrain.config import Config, ConfigError, ModelConfig, MoEConfig
from moetrain.convert.families import DENSE, FAMILIES, FORMATS, family, of_hf_config, unwrap
from moetrain.convert.quantized import quantization_of


def problems(fmt: str, model: ModelConfig, moe: MoEConfig) -> list[tuple[str, str]]:
    """``(dotted setting, why)`` for every setting ``fmt`` cannot represent (empty = exact)."""
    fam = family(fmt)
    if fam.dense:
        raise ConfigError(f"--format: {fmt} is a dense family; choose auto or one of {FORMATS}")
    return fam.problems(model, moe)


def check_format(fmt: str, model: ModelConfig, moe: MoEConfig) -> None:
    """Raise ConfigError naming the first setting ``fmt`` cannot represent."""
    found = problems(fmt, model, moe)
    if found:
        key, why = found[0]
        raise ConfigError(f"{key}: cannot convert to {family(fmt).architecture}: {why}")


def choose_format(cfg: Config, fmt: str = "auto", prefer: str | None = None) -> str:
    """``fmt`` itself when it fits the model, or for ``auto`` the format ``prefer`` (the family a
    run started from) where it fits, else the first fitting one."""
    if fmt != "auto":
        check_format(fmt, cfg.model, cfg.moe)
        return fmt
    reasons = []
    if prefer in FORMATS and not problems(prefer, cfg.model, cfg.moe):
        return prefer
    for cand in FORMATS:
        found = problems(cand, cfg.model, cfg.moe)
        if not found:
            return cand
        reasons.append(f"{family(cand).architecture}: {found[0][0]} ({found[0][1]})")
    depth = cfg.model.mtp_depth
    plain = dataclasses.replace(cfg.model, mtp_depth=0)
    fits = [f for f in FORMATS if depth and not problems(f, plain, cfg.moe)]
    if fits:
        raise ConfigError(
            f"model.mtp_depth={depth}: {family(fits[0]).architecture} computes this model's "
            "function, but its files hold no multi-token-prediction layers; pass --drop-mtp to "
            f"export the model without its {depth} MTP module(s) (they do not change its function)"
        )
    raise ConfigError("no Hugging Face class computes this model's function: " + "; ".join(reasons))


def hf_config(cfg: Config, fmt: str, **extra: Any):  # noqa: ANN201 (a transformers config)
    """The transformers config of ``fmt`` equivalent to ``cfg`` (``extra`` passes through,
    e.g. token ids). Raises ConfigError when ``fmt`` cannot represent the model."""
    import transformers

    check_format(fmt, cfg.model, cfg.moe)
    fields = family(fmt).to_hf(cfg) | extra  # (extra's token ids over a family's unset ones)
    return transformers.AutoConfig.for_model(fmt, **fields)


def transformers_config(hf_dict: dict[str, Any], model_type: str) -> Any:
    """The transformers config object of a ``config.json`` dict (attribute aliases resolved;
    infinities as transformers writes them, ``{"__float__": "Infinity"}``, read back)."""
    import transformers

    fields = {k: v for k, v in hf_dict.items() if k != "model_type"}
    fields = transformers.PreTrainedConfig._decode_special_floats(fields)
    return transformers.AutoConfig.for_model(model_type, **fields)


def family_of_architecture(architecture: str | None) -> str | None:
    """The registered family whose class (or wrapper, or released name) is ``architecture``."""
    fam = of_hf_config({"architectures": [architecture]}) if architecture else None
    return fam.name if fam is not None else None


def not_supported(hf_dict: dict[str, Any]) -> str:
    """Why a ``config.json`` dict of no registered family cannot be imported."""
    arch = (hf_dict.get("architectures") or [None])[0]
    return (
        f"architecture {arch!r} (model_type {hf_dict.get('model_type')!r}) is not supported; "
        f"MoE: {[FAMILIES[f].architecture for f in FORMATS]}, dense (upcycled): "
        f"{[FAMILIES[f].architecture for f in DENSE]}"
    )


def config_from_hf(hf_dict: dict[str, Any]) -> Config:
    """A moetrain Config equivalent to a Hugging Face ``config.json`` (as a dict) of any
    registered family (a dense family's: every layer dense; a family's wrapper's: the family's
    model inside it).

    Raises ConfigError naming the Hugging Face field that moetrain cannot represent (a
    ``quantization_config`` other than block-scaled fp8, :mod:`moetrain.convert.quantized`).
    """
    fam = of_hf_config(hf_dict)
    if fam is None:
        raise ConfigError(f"architectures: {not_supported(hf_dict)}")
    inner = unwrap(hf_dict)
    quantization_of(hf_dict, inner)  # (a format moetrain does not read: refused by key)
    return fam.from_hf(transformers_config(inner, fam.name))
