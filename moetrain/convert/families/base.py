"""What a model family is: one :class:`Family` per adapter module of this package, listed in its
registry.

A family says what its transformers class holds beyond :data:`~.holds.BASELINE` (``holds``:
the settings it represents otherwise, checked by the one shared check,
:func:`~.holds.refusals`), how a moetrain config becomes its transformers config (``to_hf``)
and back (``from_hf``; the fields several families share are
:mod:`~moetrain.convert.families.hf_config`), and how its files name and shape the weights
(``layout``, :class:`~.layout.Layout`). Imports neither torch nor transformers, so the registry
is cheap to read (the command line builds ``--format`` from it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from moetrain.config import Config, ModelConfig, MoEConfig
from moetrain.convert.families.holds import ANY, BASELINE, Rule, refusals
from moetrain.convert.families.layout import Layout, Wrapper

# config.json's count of the multi-token-prediction layers stored after the decoder layers
MTP_CONFIG_KEYS = ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers")


def declared_mtp_layers(hf: dict[str, Any], layout: Layout | None = None) -> int:
    """How many multi-token-prediction layers a ``config.json`` (a family's own, unwrapped)
    says its files hold; where it says nothing, what ``layout``'s family holds then
    (:attr:`~.layout.MtpNames.undeclared`)."""
    declared = [int(hf[key] or 0) for key in MTP_CONFIG_KEYS if key in hf]
    if declared:
        return max(declared)
    return layout.mtp.undeclared if layout is not None and layout.mtp is not None else 0


@dataclass(frozen=True)
class Family:
    """One Hugging Face model family. ``to_hf`` is None for a dense family (a source that is
    upcycled, never an export target)."""

    name: str  # transformers' model_type, and the --format name
    architecture: str  # the transformers class (config.json's ``architectures``)
    from_hf: Callable[[Any], Config]  # a transformers config object -> moetrain Config
    to_hf: Callable[[Config], dict[str, Any]] | None = None  # -> transformers config kwargs
    # the settings it holds otherwise than BASELINE (keys: BASELINE's)
    holds: Mapping[str, Rule] = field(default_factory=dict)
    layout: Layout = field(default_factory=Layout)
    # a larger class whose directories hold this family's model (imported, never exported)
    wrapper: Wrapper | None = None
    # config.json's ``architectures`` where the released files name the class otherwise than
    # transformers does (Phi-3.5-MoE's PhiMoEForCausalLM, the name vLLM registers): exports
    # write it; transformers' Auto classes go by model_type and load either
    released_architecture: str | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.holds) - set(BASELINE))
        if unknown:
            raise ValueError(f"family {self.name}: holds settings no rule knows: {unknown}")

    @property
    def config_architecture(self) -> str:
        """The class name an export writes in ``config.json``'s ``architectures``."""
        return self.released_architecture or self.architecture

    @property
    def dense(self) -> bool:
        """A dense family: imported and upcycled, not exported."""
        return self.to_hf is None

    @property
    def rules(self) -> dict[str, Rule]:
        """What it holds of every setting: :data:`BASELINE` with its own over it (and any
        number of multi-token-prediction modules where its files hold them)."""
        mtp = {"model.mtp_depth": ANY} if self.layout.mtp is not None else {}
        return {**BASELINE, **mtp, **self.holds}

    def problems(self, model: ModelConfig, moe: MoEConfig) -> list[tuple[str, str]]:
        """``(dotted setting, why)`` for every setting it cannot represent (empty = exact)."""
        return refusals(self.architecture, self.rules, model, moe)

    def can_hold(self, key: str, value: Any) -> bool:
        """Whether some config with the dotted setting ``key`` at ``value`` converts."""
        return self.rules[key].can_hold(value)
