"""The gated short convolution, the ``gated_conv`` token mixer, as LFM2 and LFM2-MoE compute it
in their ``conv`` layers (its keys and rules: :mod:`moetrain.config.mixers.gated_conv`).

Shape legend: B batch, S sequence, D d_model (the channels), W the convolution's width.

Per token: ``in_proj`` gives ``[B | C | x]`` (D channels each), then

    u = B * x                                 the input gate
    h = conv(u)                               a causal depthwise convolution of width W
                                              (:func:`moetrain.model.short_conv.short_conv`,
                                              no activation; a bias with gated_conv_bias)
    y = wo(C * h)                             the output gate, then the output projection

Packed documents restart the convolution's window at every document start (a document's first
positions see zeros, never the previous document), so a packed row equals its documents one
by one. Everything computes in the activations' dtype, as transformers does.

Sequence parallelism (``parallel.sp_size`` = n, which must divide D): each rank projects its
slice, exchanges the gated input ``B * x`` to whole sequences and ``D / n`` channels, convolves
them with their rows of the convolution (the window and the documents of whole rows) and
exchanges the result back before the output gate (C never travels).

Generation: :class:`ConvState`, the last W - 1 convolution inputs (B, W - 1, D) in the model's
dtype: a fixed size whatever the length.

Parameter names are transformers' (``in_proj``, ``conv`` (D, 1, W)), the output projection
``wo`` (transformers' ``out_proj``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moetrain.config import ModelConfig
from moetrain.config.layer_plan import MixerSpec
from moetrain.model.cpu_matmul import Linear
from moetrain.model.head_exchange import rank_channels
from moetrain.model.mixers.base import MixerInputs, TokenMixer
from moetrain.model.short_conv import short_conv


class ConvState:
    """One gated convolution layer's generation state: ``conv`` (B, W - 1, D), the last
    convolution inputs, in the model's dtype."""

    bytes_per_token = 0

    def __init__(
        self, batch: int, width: int, channels: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.conv = torch.zeros(batch, width - 1, channels, dtype=dtype, device=device)

    @property
    def bytes_per_sequence(self) -> int:
        return self.conv[0].numel() * self.conv.element_size()


class GatedConv(TokenMixer):
    """The gated short convolution (see the module docstring)."""

    kind = "gated_conv"

    def __init__(self, cfg: ModelConfig, spec: MixerSpec) -> None:
        super().__init__()
        d, bias = cfg.d_model, cfg.gated_conv_bias
        self.width = cfg.gated_conv_kernel
        self.in_proj = Linear(d, 3 * d, bias=bias)
        self.conv = nn.Conv1d(d, d, self.width, groups=d, bias=bias)
        self.wo = Linear(d, d, bias=bias)

    def forward(
        self, x_BSD: torch.Tensor, inputs: MixerInputs, state: ConvState | None = None
    ) -> torch.Tensor:
        """Mix causally, restarting at ``inputs.doc_ids_BS``'s documents; with ``state`` the
        tokens continue the state's and it takes them in."""
        b_BSD, c_BSD, x_BSD = self.in_proj(x_BSD).chunk(3, dim=-1)
        u_BSD, weight_CW, bias = b_BSD * x_BSD, self.conv.weight.squeeze(1), self.conv.bias
        ex = self.head_exchange
        if ex is not None:  # whole sequences, this rank's 1 / n of the channels
            if state is not None:
                raise ValueError("a convolution state runs on one device, without a head exchange")
            b, s, d = u_BSD.shape
            u_BSD = ex.to_heads(u_BSD.view(b, s, ex.size, d // ex.size)).flatten(2)
            rows = rank_channels(ex, ((0, d),), u_BSD.device)
            weight_CW, bias = weight_CW[rows], None if bias is None else bias[rows]
        h_BSD, last = short_conv(
            u_BSD,
            weight_CW,
            bias,
            activation=None,
            initial_state=None if state is None else state.conv,
            output_final_state=state is not None,
            doc_ids=inputs.doc_ids_BS,
        )
        if state is not None:
            state.conv.copy_(last)
        if ex is not None:
            h_BSD = ex.to_sequence(h_BSD.unsqueeze(2)).flatten(2)
        return self.wo(c_BSD * h_BSD)

    def new_state(
        self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> ConvState:
        return ConvState(batch, self.width, self.conv.weight.shape[0], dtype, device)

    @torch.no_grad()
    def init_own_parameters(self) -> None:
        """The convolution as torch initialises one (uniform within ``1 / sqrt(W)``, its bias
        too)."""
        bound = 1 / math.sqrt(self.width)
        self.conv.weight.uniform_(-bound, bound)
        if self.conv.bias is not None:
            self.conv.bias.uniform_(-bound, bound)

    # counts (the protocol's; checked against the built module and saved-tensor hooks)

    @classmethod
    def param_shapes(cls, cfg: ModelConfig, spec: MixerSpec) -> dict[str, tuple[int, ...]]:
        d, bias = cfg.d_model, cfg.gated_conv_bias
        shapes = {
            "in_proj.weight": (3 * d, d),
            "in_proj.bias": (3 * d,),
            "conv.weight": (d, 1, cfg.gated_conv_kernel),
            "conv.bias": (d,),
            "wo.weight": (d, d),
            "wo.bias": (d,),
        }
        return {k: v for k, v in shapes.items() if bias or not k.endswith(".bias")}

    @classmethod
    def matrices(cls, cfg: ModelConfig, spec: MixerSpec) -> dict[str, tuple[int, int]]:
        d = cfg.d_model
        return {"in_proj": (d, 3 * d), "wo": (d, d)}

    @classmethod
    def mixing_flops_per_token(cls, cfg: ModelConfig, spec: MixerSpec, seq_len: int) -> float:
        """The convolution (``2W`` per channel) and the two gates (``2`` per channel),
        backward twice forward; independent of ``seq_len``."""
        return 3.0 * (2 * cfg.gated_conv_kernel + 2) * cfg.d_model

    @classmethod
    def saved_bytes_per_token(
        cls, cfg: ModelConfig, spec: MixerSpec, act_bytes: int, sp: int
    ) -> int:
        """Its input ``aD``; the projection's output (B, C and x, kept by the gates) ``3aD``;
        the convolution's padded input ``aD``, its output ``aD`` and the gated product
        ``aD`` (the output projection's input). Without documents (a document adds its
        convolution's W - 1 zeros)."""
        return 7 * act_bytes * cfg.d_model

    @classmethod
    def cache_bytes_per_token(cls, cfg: ModelConfig, spec: MixerSpec, dtype_bytes: int) -> int:
        """0: the state does not grow (:meth:`cache_bytes_per_sequence`)."""
        return 0

    @classmethod
    def cache_bytes_per_sequence(cls, cfg: ModelConfig, spec: MixerSpec, dtype_bytes: int) -> int:
        """The convolution's ``(W - 1) D`` inputs in the model's dtype."""
        return (cfg.gated_conv_kernel - 1) * cfg.d_model * dtype_bytes

    @classmethod
    def exchange_bytes_per_token(
        cls, cfg: ModelConfig, spec: MixerSpec, act_bytes: int, sp: int
    ) -> float:
        """The gated input ``B * x`` out and the convolution's output back (``2D`` values);
        ``(sp - 1) / sp`` of each leaves the GPU."""
        return 0.0 if sp == 1 else act_bytes * 2 * cfg.d_model * (sp - 1) / sp
