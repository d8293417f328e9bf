"""The token mixer modules, one per kind, behind one protocol (:mod:`.base`): grouped-query
attention with its local variants (:mod:`.gqa`), multi-head latent attention (:mod:`.mla`), Gated
DeltaNet (:mod:`.gated_deltanet`), Kimi Delta Attention (:mod:`.kda`), Mamba-2 (:mod:`.mamba2`), the gated short convolution
(:mod:`.gated_conv`) and DeepSeek-V4's compressed attention (:mod:`.compressed`).
Registered here by their ``kind``, the names :data:`moetrain.config.mixers.MIXER_KINDS` knows
(the same set, checked by a test)."""

from __future__ import annotations

from moetrain.config import ModelConfig
from moetrain.config.layer_plan import MixerSpec
from moetrain.model.mixers.base import MixerInputs, MixerLoss, MixerState, TokenMixer
from moetrain.model.mixers.compressed import CompressedMixer
from moetrain.model.mixers.gated_conv import GatedConv
from moetrain.model.mixers.gated_deltanet import GatedDeltaNet
from moetrain.model.mixers.gqa import Attention
from moetrain.model.mixers.kda import KimiDeltaAttention
from moetrain.model.mixers.mamba2 import Mamba2
from moetrain.model.mixers.mla import MLAttention

MIXERS: dict[str, type[TokenMixer]] = {
    cls.kind: cls
    for cls in (
        Attention,
        MLAttention,
        GatedDeltaNet,
        KimiDeltaAttention,
        Mamba2,
        GatedConv,
        CompressedMixer,
    )
}

__all__ = [
    "MIXERS",
    "MixerInputs",
    "MixerLoss",
    "MixerState",
    "TokenMixer",
    "attention_matrices",
    "build_mixer",
    "mixer_class",
]


def mixer_class(spec: MixerSpec) -> type[TokenMixer]:
    """The module class of ``spec``'s kind."""
    return MIXERS[spec.kind]


def build_mixer(cfg: ModelConfig, spec: MixerSpec) -> TokenMixer:
    """One layer's mixer, as ``spec`` says."""
    return mixer_class(spec)(cfg, spec)


def attention_matrices(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """The weight matrices of a full-attention layer of ``model.attention``'s kind (what a
    converter maps), ``name -> (in, out)``."""
    spec = MixerSpec(cfg.attention)
    return mixer_class(spec).matrices(cfg, spec)
