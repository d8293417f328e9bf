"""The token mixer kinds the config knows, by the name that selects them (torch-free): each
kind's keys, rules and numbers in a module of its own (:mod:`.gqa`, :mod:`.mla`,
:mod:`.gated_deltanet`, :mod:`.kda`, :mod:`.mamba2`, :mod:`.gated_conv`, :mod:`.compressed`); their
modules are :mod:`moetrain.model.mixers`' (the same names, checked by a test)."""

from __future__ import annotations

from moetrain.config.checks import ConfigError
from moetrain.config.mixers.base import MixerKind
from moetrain.config.mixers.compressed import Compressed, CompressedKeys
from moetrain.config.mixers.gated_conv import GatedConv, GatedConvKeys
from moetrain.config.mixers.gated_deltanet import GatedDeltaNet, GatedDeltaNetKeys
from moetrain.config.mixers.gqa import GQA, GQAKeys
from moetrain.config.mixers.kda import KDA, KDAKeys
from moetrain.config.mixers.mamba2 import Mamba2, Mamba2Keys
from moetrain.config.mixers.mla import MLA, MLAKeys

MIXER_KINDS: dict[str, type[MixerKind]] = {
    kind.name: kind for kind in (GQA, MLA, GatedDeltaNet, KDA, Mamba2, GatedConv, Compressed)
}

__all__ = [
    "MIXER_KINDS",
    "CompressedKeys",
    "GQAKeys",
    "GatedConvKeys",
    "GatedDeltaNetKeys",
    "KDAKeys",
    "MLAKeys",
    "Mamba2Keys",
    "MixerKind",
    "mixer_kind",
]


def mixer_kind(name: str, key: str = "model.attention") -> type[MixerKind]:
    """The kind called ``name``; ConfigError naming ``key`` for an unknown one."""
    if name not in MIXER_KINDS:
        raise ConfigError(f"{key}: knows {', '.join(MIXER_KINDS)}; got {name!r}")
    return MIXER_KINDS[name]
