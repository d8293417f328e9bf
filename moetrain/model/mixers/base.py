"""The token mixer protocol: what every mixer kind's module provides, and what a forward hands it.

Shape legend: B batch, S sequence (this call's positions), D d_model.

A token mixer is the part of a block that moves information between positions (attention, a
recurrence). Each kind is one module of this package, a :class:`TokenMixer` subclass whose
``kind`` is its name in :data:`moetrain.config.mixers.MIXER_KINDS` (its keys and rules) and
:data:`moetrain.model.mixers.MIXERS`. It owns:

- its parameters and their names relative to the mixer (``wq``, ``wkv_a``, ...: the block holds
  it as ``attn``, so ``layers.<i>.attn.<name>``; ``model/param_names.py`` spells the model's
  names). The transformer initialises every ``Linear`` (normal, ``init_std``; the output
  projection, which must be called ``wo``, scaled by ``1 / sqrt(2 * n_layers)``), every norm
  (ones) and every bias (zeros); :meth:`TokenMixer.init_own_parameters` does the rest;
- its forward, ``forward(x_BSD, inputs, state) -> y_BSD``, with :class:`MixerInputs` (RoPE rows,
  the packed documents, the position of the first token) and its inference state or None;
- its inference state (:meth:`TokenMixer.new_state`: a KV cache, a latent cache, a recurrent
  state), which :class:`moetrain.model.cache.InferenceCache` keeps per layer;
- how sequence parallelism reaches it (:meth:`TokenMixer.set_head_exchange`): with an exchange
  attached, its input is this rank's slice of every sequence and it exchanges its per-head
  tensors to whole sequences and ``1 / size`` of its heads (:mod:`moetrain.model.head_exchange`)
  and back before its output projection;
- if it has per-head query-key logits (attention; :attr:`TokenMixer.query_key_logits`): it
  reports each head's largest one when asked (:mod:`moetrain.model.logit_max`) and says which
  query / key rows scale a head's logits (:meth:`TokenMixer.qk_clip_scales`, MuonClip's QK-clip);
- its counts from the config alone, for ``model_numbers`` and ``moetrain plan``: parameters
  (:meth:`TokenMixer.param_shapes`), matrices and FLOPs, bytes saved for backward, cache bytes
  and the bytes sequence parallelism exchanges, per token.

Nothing outside a kind's modules compares its name (``tests/unit/test_mixer_names.py``); docs/
ARCHITECTURE.md, "Adding a token mixer", lists what a new kind touches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
from torch import nn

from moetrain.model.doc_attention import Documents
from moetrain.model.local_attention import chunk_segments

if TYPE_CHECKING:
    from moetrain.config import ModelConfig
    from moetrain.config.layer_plan import MixerSpec
    from moetrain.model.head_exchange import HeadExchange


@dataclass(eq=False)
class MixerLoss:
    """A mixer's own training loss in one forward (DeepSeek sparse attention's indexer KL,
    weighted), added to the model's loss, with its metrics (detached scalars), reported as
    ``<name>/<metric>`` (the mean over the layers) and ``<name>/layer<i>/<metric>``."""

    name: str
    layer: int
    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


@dataclass(eq=False)
class MixerInputs:
    """What a forward hands every mixer besides its input (one object per forward)."""

    cos: torch.Tensor  # (S, rope_dim) RoPE rows of this call's positions
    sin: torch.Tensor
    # the packed documents of the whole rows (doc_attention.py), or an explicit (B, 1, S, S)
    # mask (boolean, True = may attend; or additive); None: causal over each row
    mask: Documents | torch.Tensor | None = None
    doc_ids_BS: torch.Tensor | None = None  # the whole rows' document ids, when documents
    pos: int = 0  # tokens already in the inference state (the first token's row position)
    # the sliding layers' RoPE rows (cos, sin) where model.sliding_rope_theta is set
    local_rope: tuple[torch.Tensor, torch.Tensor] | None = None
    # this call's token ids (B, S): what a hash-routed MoE layer selects by (moe.hash_layers)
    token_ids_BS: torch.Tensor | None = None
    # what the mixers report back: their own training losses (added to the model's loss) and,
    # under sparse attention, each indexer layer's selection (idx_BSk, valid_BSk), which the
    # layers that share it read
    losses: list[MixerLoss] = field(default_factory=list)
    selections: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _cut: dict[int, Documents] = field(default_factory=dict, repr=False)

    def chunk_documents(self, chunk: int) -> Documents:
        """The documents cut at every multiple of ``chunk`` (what a chunked layer's queries may
        see; :func:`moetrain.model.local_attention.chunk_segments`), computed once per
        forward (it needs ``doc_ids_BS``)."""
        if self.doc_ids_BS is None:
            raise ValueError("chunks of packed documents need MixerInputs.doc_ids_BS")
        if chunk not in self._cut:
            segments_BS = chunk_segments(self.doc_ids_BS, chunk)
            self._cut[chunk] = Documents.from_ids(segments_BS).to(self.cos.device)
        return self._cut[chunk]


class MixerState(Protocol):
    """One layer's inference state (its kind's: keys and values, a latent, a recurrence)."""

    @property
    def bytes_per_token(self) -> int:
        """Bytes the state grows by per cached token (0 for a fixed-size state)."""
        ...

    @property
    def bytes_per_sequence(self) -> int:
        """Bytes the state takes per sequence whatever its length (a recurrent state; 0 for a
        cache of keys and values)."""
        ...


class TokenMixer(nn.Module):
    """The protocol every mixer kind implements (see the module docstring). The methods that
    raise NotImplementedError here are required; a test checks every registered kind."""

    kind: ClassVar[str]  # its name in MIXER_KINDS and MIXERS
    # per-head query-key logits: observe_logits on the forward, qk_clip_scales (attention)
    query_key_logits: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        # sequence parallelism: set from outside (set_head_exchange); None = one device
        self.head_exchange: HeadExchange | None = None

    def forward(
        self, x_BSD: torch.Tensor, inputs: MixerInputs, state: MixerState | None = None
    ) -> torch.Tensor:
        """The mixed sequence (B, S, D). With ``state`` (inference, one device) the tokens
        continue the ``inputs.pos`` ones the state holds, and the state takes them in."""
        raise NotImplementedError

    def new_state(
        self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> MixerState:
        """An empty inference state for ``batch`` sequences of up to ``max_len`` tokens."""
        raise NotImplementedError

    def set_head_exchange(self, ex: HeadExchange | None) -> None:
        """Attach sequence parallelism's exchange (None: one device again)."""
        self.head_exchange = ex

    def init_own_parameters(self) -> None:
        """Initialise the parameters that are not a ``Linear``'s or a norm's (the transformer
        initialises those); by default there are none."""

    def qk_clip_scales(self, gamma_H: torch.Tensor) -> dict[str, torch.Tensor]:
        """Multipliers of rows of its query and key parameters (``name relative to the mixer ->
        (out rows,)``) by which head h's logits scale by ``gamma_H[h]`` (QK-clip); only a kind
        with :attr:`query_key_logits`."""
        raise TypeError(f"the {self.kind} mixer has no query-key logits to clip")

    def trains_alone(self) -> list[nn.Module]:
        """Its parts that a training stage trains alone, every other parameter of the model
        frozen (sparse attention's dense warm-up: the indexer); by default none."""
        return []

    # counts from the config alone (classmethods: no module is built)

    @classmethod
    def param_shapes(cls, cfg: ModelConfig, spec: MixerSpec) -> dict[str, tuple[int, ...]]:
        """Every parameter of the mixer, ``name relative to the mixer -> shape`` (a
        ``Linear``'s weight as ``(out, in)``), exactly as the module builds them."""
        raise NotImplementedError

    @classmethod
    def matrices(cls, cfg: ModelConfig, spec: MixerSpec) -> dict[str, tuple[int, int]]:
        """Its weight matrices applied to every token, ``module name -> (in, out)``; 6 training
        FLOPs per entry and token each."""
        raise NotImplementedError

    @classmethod
    def mixing_flops_per_token(cls, cfg: ModelConfig, spec: MixerSpec, seq_len: int) -> float:
        """Training FLOPs per token beyond its matrices (attention's scores and values, a
        recurrence), forward and backward, for sequences of ``seq_len`` tokens."""
        raise NotImplementedError

    @classmethod
    def saved_bytes_per_token(
        cls, cfg: ModelConfig, spec: MixerSpec, act_bytes: int, sp: int
    ) -> int:
        """Bytes it saves for backward per token (``act_bytes`` per activation value, 4 or 2),
        its input (the block norm's output) included; ``sp``: ``parallel.sp_size``, the
        tokens being this rank's slice. Checked against saved-tensor hooks."""
        raise NotImplementedError

    @classmethod
    def cache_bytes_per_token(cls, cfg: ModelConfig, spec: MixerSpec, dtype_bytes: int) -> int:
        """Bytes its inference state grows by per token (:attr:`MixerState.bytes_per_token`)."""
        raise NotImplementedError

    @classmethod
    def cache_bytes_per_sequence(cls, cfg: ModelConfig, spec: MixerSpec, dtype_bytes: int) -> int:
        """Bytes its inference state takes per sequence whatever its length
        (:attr:`MixerState.bytes_per_sequence`): 0 unless the kind keeps a recurrent state."""
        return 0

    @classmethod
    def exchange_bytes_per_token(
        cls, cfg: ModelConfig, spec: MixerSpec, act_bytes: int, sp: int
    ) -> float:
        """Bytes sequence parallelism sends off the GPU per token of its slice in one forward
        (to whole sequences and back); 0 at ``sp`` 1."""
        raise NotImplementedError

    @classmethod
    def param_count(cls, cfg: ModelConfig, spec: MixerSpec) -> int:
        """Its parameters (:meth:`param_shapes`)."""
        return sum(math.prod(shape) for shape in cls.param_shapes(cfg, spec).values())
