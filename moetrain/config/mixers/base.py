"""The config side of a token mixer kind: what a kind's keys mean and what they must satisfy,
without torch (the module that computes it is its namesake in :mod:`moetrain.model.mixers`).

A kind is a :class:`MixerKind` subclass registered in :data:`moetrain.config.mixers.MIXER_KINDS`
under its ``name``, the value of the key that selects it (``model.attention`` for attention
layers). Its own keys are fields of a dataclass that :class:`moetrain.config.ModelConfig`
inherits, so they are flat ``model.<key>`` keys like the others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import TYPE_CHECKING, ClassVar

from moetrain.config.checks import require

if TYPE_CHECKING:
    from moetrain.config.layer_plan import MixerSpec
    from moetrain.config.model import ModelConfig


class MixerKind:
    """A token mixer kind's config rules (class-level; never instantiated)."""

    name: ClassVar[str]  # its value of the key that selects it, e.g. "gqa"
    selected_by: ClassVar[str] = "model.attention"  # that key, for messages
    keys: ClassVar[tuple[str, ...]] = ()  # its own keys: at their defaults unless it is used
    # whether it builds the compressed layer types (layer_plan.COMPRESSED_TYPES)
    compresses: ClassVar[bool] = False

    @classmethod
    def validate(cls, model: ModelConfig, specs: list[MixerSpec]) -> None:
        """Refuse (ConfigError naming the key) what this kind cannot build, given the layers
        that use it (``specs``, at least one, with their per-layer options)."""
        raise NotImplementedError

    @classmethod
    def head_dim(cls, model: ModelConfig) -> int:
        """The dims of one query / key head (what RoPE tables and converters call head_dim)."""
        raise NotImplementedError

    @classmethod
    def rope_dim(cls, model: ModelConfig) -> int:
        """How many dims of a query / key head RoPE rotates (0: no RoPE)."""
        raise NotImplementedError

    @classmethod
    def sp_heads(cls, model: ModelConfig) -> tuple[tuple[str, int], ...]:
        """The head counts sequence parallelism splits over ``parallel.sp_size`` ranks, as
        ``(dotted key, count)``: each must be a multiple of it. A mixer whose heads carry more
        than attention (a short convolution's channels, a recurrent state) names the heads
        those travel with."""
        raise NotImplementedError

    @classmethod
    def documents_refused(cls, model: ModelConfig) -> str | None:
        """Why it cannot keep packed documents apart (``data.document_mask``), None when it
        can (a packed row then equals its documents alone)."""
        return None

    @classmethod
    def refuse_own_keys(cls, model: ModelConfig, shared: Collection[str] = ()) -> None:
        """Where no layer uses the kind: every one of its keys must keep its default, but those
        in ``shared`` (keys a kind in use has too)."""
        defaults = {f.name: f.default for f in dataclasses.fields(model)}
        for key in (k for k in cls.keys if k not in shared):
            require(
                getattr(model, key) == defaults[key],
                f"model.{key}",
                f"only applies with {cls.selected_by}={cls.name}",
            )
