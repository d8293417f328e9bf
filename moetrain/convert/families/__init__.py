"""The Hugging Face model families moetrain converts to and from: one adapter module each, and
this registry, which ``moetrain convert`` / ``import``, ``checkpoint.init_from``, the command
line's ``--format`` choices and the tests read.

A format is accepted only when its transformers class computes the same function as moetrain's
``Transformer`` (checked against transformers' modeling code); otherwise conversion is refused
with a ConfigError naming the moetrain setting that has no equivalent (each module's
``holds``, checked by :func:`~moetrain.convert.families.holds.refusals`). MoE families convert
both ways; dense families are sources that are upcycled.
"""

from __future__ import annotations

from typing import Any

from moetrain.config import ConfigError
from moetrain.convert.families import (
    afmoe,
    bailing_hybrid,
    deepseek_v2,
    deepseek_v3,
    deepseek_v4,
    deepseek_v32,
    dots1,
    ernie4_5_moe,
    gemma4_text,
    glm4_moe,
    glm_moe_dsa,
    gpt_oss,
    granitemoe,
    granitemoehybrid,
    hunyuan_v1_moe,
    kimi_linear,
    lfm2_moe,
    llama,
    llama4_text,
    longcat_flash,
    mimo_v2_flash,
    minimax_m2,
    mistral,
    mixtral,
    nemotron_h,
    olmo_hybrid,
    olmoe,
    phimoe,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_5_moe_text,
    qwen3_5_text,
    qwen3_moe,
    qwen3_next,
)
from moetrain.convert.families.base import Family
from moetrain.convert.families.layout import Layout, Wrapper

# MoE families in the order ``--format auto`` tries them, then the dense sources
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        mixtral.FAMILY,
        qwen3_moe.FAMILY,
        qwen2_moe.FAMILY,
        dots1.FAMILY,  # (before GLM-4.5's class, which holds its models but the window)
        glm4_moe.FAMILY,
        olmoe.FAMILY,
        minimax_m2.FAMILY,
        afmoe.FAMILY,
        deepseek_v32.FAMILY,
        glm_moe_dsa.FAMILY,
        deepseek_v3.FAMILY,
        deepseek_v2.FAMILY,
        ernie4_5_moe.FAMILY,
        granitemoe.FAMILY,
        granitemoe.SHARED_FAMILY,
        granitemoehybrid.FAMILY,
        nemotron_h.FAMILY,
        hunyuan_v1_moe.FAMILY,
        gpt_oss.FAMILY,
        phimoe.FAMILY,
        llama4_text.FAMILY,
        gemma4_text.FAMILY,
        qwen3_5_moe_text.FAMILY,
        qwen3_next.FAMILY,
        kimi_linear.FAMILY,
        lfm2_moe.FAMILY,
        mimo_v2_flash.FAMILY,
        longcat_flash.FAMILY,
        deepseek_v4.FAMILY,
        bailing_hybrid.FAMILY,
        llama.FAMILY,
        mistral.FAMILY,
        qwen2.FAMILY,
        qwen3.FAMILY,
        qwen3_5_text.FAMILY,
        olmo_hybrid.FAMILY,
    )
}
FORMATS = tuple(name for name, f in FAMILIES.items() if not f.dense)  # export targets
DENSE = tuple(name for name, f in FAMILIES.items() if f.dense)

__all__ = [
    "DENSE",
    "FAMILIES",
    "FORMATS",
    "Family",
    "Layout",
    "Wrapper",
    "family",
    "of_hf_config",
    "unwrap",
    "wrapper_of",
]


def family(name: str) -> Family:
    """The registered family ``name`` (ConfigError naming the choices otherwise)."""
    if name not in FAMILIES:
        raise ConfigError(f"--format: unknown format {name!r}; choose auto or one of {FORMATS}")
    return FAMILIES[name]


def of_hf_config(hf_dict: dict[str, Any]) -> Family | None:
    """The family of a ``config.json`` dict (by ``architectures``, else ``model_type``; a
    family's :class:`Wrapper` gives the family), None when none is registered."""
    arch = (hf_dict.get("architectures") or [None])[0]
    wrapped = [f for f in FAMILIES.values() if f.wrapper is not None]
    by_arch = {f.architecture: f for f in FAMILIES.values()}
    by_arch |= {f.wrapper.architecture: f for f in wrapped}
    by_arch |= {f.released_architecture: f for f in FAMILIES.values() if f.released_architecture}
    by_type = dict(FAMILIES) | {f.wrapper.model_type: f for f in wrapped}
    return by_arch.get(arch) or by_type.get(hf_dict.get("model_type"))


def wrapper_of(hf_dict: dict[str, Any]) -> Wrapper | None:
    """The :class:`Wrapper` a ``config.json`` dict is (a family's model inside a larger one),
    None when it is a family's own."""
    fam = of_hf_config(hf_dict)
    w = fam.wrapper if fam is not None else None
    arch = (hf_dict.get("architectures") or [None])[0]
    if w is not None and (
        arch == w.architecture or (arch is None and hf_dict.get("model_type") == w.model_type)
    ):
        return w
    return None


def unwrap(hf_dict: dict[str, Any]) -> dict[str, Any]:
    """The family's own ``config.json`` dict: a wrapper's inner config (its ``config_key``,
    with the family's architecture and model_type), else ``hf_dict`` itself."""
    w = wrapper_of(hf_dict)
    if w is None:
        return hf_dict
    inner = hf_dict.get(w.config_key)
    if not isinstance(inner, dict):
        raise ConfigError(
            f"{w.config_key}: a {w.architecture} config.json holds its text model's config "
            f"there; got {inner!r}"
        )
    fam = of_hf_config(hf_dict)
    return {**inner, "architectures": [fam.architecture], "model_type": fam.name}
