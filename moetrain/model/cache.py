"""The generation cache: every layer's inference state, kept by the transformer for its mixers.

Each layer's state is its mixer's (:meth:`moetrain.model.mixers.TokenMixer.new_state`: keys
and values, a latent, a recurrent state); the cache holds them in layer order (None for a
block without a mixer) with the number of tokens they hold, ``pos``, which
``Transformer.forward(..., cache=c)`` advances.
"""

from __future__ import annotations

from moetrain.model.mixers import MixerState


class InferenceCache:
    """Every layer's inference state for ``max_len`` tokens; ``pos``: tokens cached so far (the
    position of the next token)."""

    def __init__(self, layers: list[MixerState | None], max_len: int) -> None:
        self.layers = layers
        self.max_len = max_len
        self.pos = 0

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token takes, all layers."""
        return sum(state.bytes_per_token for state in self.layers if state is not None)

    @property
    def bytes_per_sequence(self) -> int:
        """Cache bytes one sequence takes whatever its length (recurrent states), all layers."""
        return sum(state.bytes_per_sequence for state in self.layers if state is not None)
