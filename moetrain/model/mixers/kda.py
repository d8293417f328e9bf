"""Kimi Delta Attention (Kimi Linear, Moonshot AI 2025), the ``kda`` token mixer, as Kimi Linear
computes it in its ``linear_attention`` layers (its keys and rules:
:mod:`moetrain.config.mixers.kda`).

Shape legend: B batch, S sequence, D d_model, H heads, K head dim (keys and values alike),
Ch = 3 H K convolution channels, W the convolution's width.

Per token: ``q_proj``, ``k_proj``, ``v_proj`` give q, k, v (H K channels each); each has its
own causal depthwise convolution of width W with SiLU (``q_conv1d``, ``k_conv1d``,
``v_conv1d``; computed as one over the Ch channels, :func:`moetrain.model.short_conv.short_conv`),
then

    g    = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)   the log decay of each head's K key
                                                           channels (fp32); f_a: D -> K, f_b:
                                                           K -> H K (a low-rank projection)
                                                           (model.kda_gate_lower_bound b:
                                                           b * sigmoid(exp(A_log) * (f +
                                                           dt_bias)), Ling 3.0's safe gate)
    beta = sigmoid(b_proj(x))                              each head's write strength (fp32)
    o    = gated_delta_rule(l2norm(q), l2norm(k), v, g, beta)
    y    = wo(norm(o) * sigmoid(g_b(g_a(x))))              RMSNorm over each head's K dims (a
                                                           weight of K shared by the heads,
                                                           eps norm_eps), gated per channel

With ``model.kda_full_rank_gates`` (Ling 3.0's) the two gates' projections are one each,
``f_proj`` and ``g_proj`` (D -> H K), instead of the low-rank pairs.

(:mod:`moetrain.model.delta_rule`, the per-channel decay path: the chunked form for training
and prefill, the token recurrence for a decode step). Packed documents restart the
convolution's window and the rule's state at every document start, as Gated DeltaNet's do.
On CUDA: fla's ``chunk_kda`` and causal-conv1d (:mod:`moetrain.model.delta_rule_cuda`), as
Gated DeltaNet chooses them.

Numerics: the decay, beta, the rule's state and the gated norm (its weight and gate included)
are fp32, the norm's result rounded once (transformers' ``KimiLinearRMSNormGated``); the
convolution computes in the activations' dtype.

Generation: :class:`~moetrain.model.mixers.gated_deltanet.RecurrentState`, the last W - 1
convolution inputs (B, W - 1, Ch) and the rule's fp32 state (B, H, K, K).

Sequence parallelism (``parallel.sp_size`` = n): each rank projects its slice, exchanges the
pre-convolution q, k, v, the forget gate's input (before ``dt_bias``) and b of its heads to
whole sequences and ``H / n`` heads, convolves those heads' channels with their rows of the
three convolutions, computes their decays and beta and runs the rule, and exchanges the rule's
output back before the gated norm (the output gate never travels), as Gated DeltaNet does.

Parameter names are Kimi Linear's files' (``q_proj`` ... ``o_norm``; ``A_log`` (H,), stored
(1, 1, H, 1) in the files), the output projection ``wo`` (their ``o_proj``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.config import ModelConfig
from moetrain.config.layer_plan import MixerSpec
from moetrain.model.cpu_matmul import Linear
from moetrain.model.head_exchange import HeadExchange, rank_channels
from moetrain.model.mixers.base import MixerInputs, TokenMixer
from moetrain.model.mixers.gated_deltanet import (
    CHUNK,
    RecurrentState,
    conv_and_rule,
    init_dt_bias,
)
from moetrain.model.recurrent_kernels import KernelChoice

A_RANGE = (1.0, 16.0)  # exp(A_log) at initialisation, as Kimi Linear draws it
PROJECTIONS = ("q", "k", "v")  # each with its projection and its convolution


class _SigmoidGatedRMSNorm(torch.autograd.Function):
    """``weight * rmsnorm(o) * sigmoid(gate)`` over the last dim, all in fp32 (fp64 for fp64),
    rounded to o's dtype once; saves o, the gate and the per-row rsqrt."""

    @staticmethod
    def forward(ctx, o, gate, weight, eps):  # noqa: ANN001, ANN205
        wide = torch.promote_types(o.dtype, torch.float32)
        o32 = o.to(wide)
        rstd = torch.rsqrt(o32.pow(2).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(o, gate, weight, rstd)
        return (weight.to(wide) * (o32 * rstd) * torch.sigmoid(gate.to(wide))).to(o.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        o, gate, weight, rstd = ctx.saved_tensors
        wide = rstd.dtype
        g = grad.to(wide)
        sig = torch.sigmoid(gate.to(wide))
        xhat = o.to(wide) * rstd
        normed = weight.to(wide) * xhat
        dgate = g * normed * sig * (1 - sig)
        dnormed = g * sig
        dweight = None
        if ctx.needs_input_grad[2]:
            dweight = (dnormed * xhat).flatten(0, -2).sum(0).to(weight.dtype)
        dxhat = dnormed * weight.to(wide)
        do = (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True)) * rstd
        return do.to(o.dtype), dgate.to(gate.dtype), dweight, None


class SigmoidGatedRMSNorm(nn.Module):
    """Kimi Linear's output norm: a weight (K,) shared by the heads (ones at initialisation)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return _SigmoidGatedRMSNorm.apply(o, gate, self.weight, self.eps)


class KimiDeltaAttention(TokenMixer):
    """Kimi Delta Attention (see the module docstring)."""

    kind = "kda"

    def __init__(self, cfg: ModelConfig, spec: MixerSpec) -> None:
        super().__init__()
        d, self.h, self.dk = cfg.d_model, cfg.linear_num_heads, cfg.linear_head_dim
        self.width = cfg.linear_conv_kernel_dim
        hk = self.h * self.dk
        self.A_log = nn.Parameter(torch.empty(self.h))
        self.dt_bias = nn.Parameter(torch.empty(hk))
        for p in PROJECTIONS:
            setattr(self, f"{p}_proj", Linear(d, hk, bias=False))
        for p in PROJECTIONS:
            setattr(self, f"{p}_conv1d", nn.Conv1d(hk, hk, self.width, groups=hk, bias=False))
        self.full_rank, self.bound = cfg.kda_full_rank_gates, cfg.kda_gate_lower_bound
        for name, (n_in, n_out) in self.gate_matrices(cfg).items():
            setattr(self, name, Linear(n_in, n_out, bias=False))
        self.o_norm = SigmoidGatedRMSNorm(self.dk, cfg.norm_eps)
        self.wo = Linear(hk, d, bias=False)
        self.kernel_choice = KernelChoice("fla chunk_kda + causal_conv1d", ("fla", "causal_conv1d"))

    def forward(
        self, x_BSD: torch.Tensor, inputs: MixerInputs, state: RecurrentState | None = None
    ) -> torch.Tensor:
        """Mix causally, restarting at ``inputs.doc_ids_BS``'s documents; with ``state`` the
        tokens continue the state's and it takes them in."""
        b, s, _ = x_BSD.shape
        qkv = torch.cat([getattr(self, f"{p}_proj")(x_BSD) for p in PROJECTIONS], dim=-1)
        weight_CW = torch.cat([getattr(self, f"{p}_conv1d").weight for p in PROJECTIONS])
        weight_CW = weight_CW.squeeze(1)
        f_raw, b_raw = self._gate_input("f", x_BSD), self.b_proj(x_BSD)
        a_log, dt_bias = self.A_log, self.dt_bias
        ex = self.head_exchange
        if ex is not None:  # whole sequences, this rank's heads
            if state is not None:
                raise ValueError("a recurrent state runs on one device, without a head exchange")
            qkv, f_raw, b_raw = self._to_heads(ex, qkv, f_raw, b_raw)
            hk = self.h * self.dk
            weight_CW = weight_CW[rank_channels(ex, ((0, hk), (hk, hk), (2 * hk, hk)), qkv.device)]
            heads = slice(ex.rank * self.h // ex.size, (ex.rank + 1) * self.h // ex.size)
            a_log = a_log[heads]
            dt_bias = dt_bias.view(self.h, self.dk)[heads].flatten()
        o = self._mix(qkv, f_raw, b_raw, weight_CW, a_log, dt_bias, inputs, state)
        if ex is not None:
            o = ex.to_sequence(o)
        gate = self._gate_input("g", x_BSD).view(b, s, self.h, self.dk)
        return self.wo(self.o_norm(o, gate).reshape(b, s, -1))

    def _mix(
        self,
        qkv: torch.Tensor,
        f_raw: torch.Tensor,
        b_raw: torch.Tensor,
        weight_CW: torch.Tensor,
        a_log: torch.Tensor,
        dt_bias: torch.Tensor,
        inputs: MixerInputs,
        state: RecurrentState | None,
    ) -> torch.Tensor:
        """The decay, beta, the convolution and the rule over whole rows of some heads (all, or
        this rank's): (B, S, h, K) out."""
        b, s, h = b_raw.shape
        shape = (b, s, h, self.dk)
        wide = torch.promote_types(qkv.dtype, torch.float32)  # (fp32, or fp64 for fp64)
        f = (f_raw.to(wide) + dt_bias.to(wide)).view(shape)
        rate = a_log.to(wide).exp()[:, None]
        bounded = self.bound is not None  # Ling 3.0's gate, in (bound, 0)
        g = self.bound * torch.sigmoid(rate * f) if bounded else -rate * F.softplus(f)
        beta = b_raw.to(wide).sigmoid()
        heads = ((h, self.dk),) * 3
        docs = inputs.doc_ids_BS
        return conv_and_rule(qkv, weight_CW, heads, g, beta, docs, state, self.kernel_choice)

    def _to_heads(
        self, ex: HeadExchange, qkv: torch.Tensor, f_raw: torch.Tensor, b_raw: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's slice of every head's pre-convolution q, k, v, its forget gate's input
        and b -> the whole sequences of its ``H / n`` heads, in one exchange."""
        b, s, _ = qkv.shape
        parts = (*qkv.chunk(3, dim=-1), f_raw, b_raw)
        packed = torch.cat([p.reshape(b, s, self.h, -1) for p in parts], dim=-1)
        whole = ex.to_heads(packed)  # (B, S, h, 4K + 1)
        q, k, v, f_raw, b_raw = (p.flatten(2) for p in whole.split([self.dk] * 4 + [1], -1))
        return torch.cat([q, k, v], dim=-1), f_raw, b_raw

    def _gate_input(self, which: str, x_BSD: torch.Tensor) -> torch.Tensor:
        """The forget (``f``) or output (``g``) gate's projection of x: full rank, or through
        K."""
        if self.full_rank:
            return getattr(self, f"{which}_proj")(x_BSD)
        return getattr(self, f"{which}_b_proj")(getattr(self, f"{which}_a_proj")(x_BSD))

    @staticmethod
    def gate_matrices(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        """The gates' projections and b_proj, in the module's order, ``name -> (in, out)``."""
        d, h, k = cfg.d_model, cfg.linear_num_heads, cfg.linear_head_dim
        if cfg.kda_full_rank_gates:
            return {"f_proj": (d, h * k), "b_proj": (d, h), "g_proj": (d, h * k)}
        return {
            "f_a_proj": (d, k),
            "f_b_proj": (k, h * k),
            "b_proj": (d, h),
            "g_a_proj": (d, k),
            "g_b_proj": (k, h * k),
        }

    def new_state(
        self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> RecurrentState:
        conv = (self.width - 1, 3 * self.h * self.dk)
        return RecurrentState(batch, conv, (self.h, self.dk, self.dk), dtype, device)

    @torch.no_grad()
    def init_own_parameters(self) -> None:
        """The convolutions as torch initialises one (uniform within ``1 / sqrt(W)``); ``A``
        uniform in [1, 16] (Kimi Linear's); ``dt_bias`` the inverse softplus of step sizes drawn
        log-uniformly in [1e-3, 0.1] (fla's); the output norm's weight ones."""
        bound = 1 / math.sqrt(self.width)
        for p in PROJECTIONS:
            getattr(self, f"{p}_conv1d").weight.uniform_(-bound, bound)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(*A_RANGE).log())
        init_dt_bias(self.dt_bias)
        self.o_norm.weight.fill_(1.0)

    # counts (the protocol's; checked against the built module and saved-tensor hooks)

    @classmethod
    def param_shapes(cls, cfg: ModelConfig, spec: MixerSpec) -> dict[str, tuple[int, ...]]:
        h, k = cfg.linear_num_heads, cfg.linear_head_dim
        out: dict[str, tuple[int, ...]] = {"A_log": (h,), "dt_bias": (h * k,)}
        matrices = cls.matrices(cfg, spec)
        for name in (f"{p}_proj" for p in PROJECTIONS):
            out[f"{name}.weight"] = matrices[name][::-1]
        for p in PROJECTIONS:
            out[f"{p}_conv1d.weight"] = (h * k, 1, cfg.linear_conv_kernel_dim)
        for name in cls.gate_matrices(cfg):
            out[f"{name}.weight"] = matrices[name][::-1]
        out["o_norm.weight"] = (k,)
        out["wo.weight"] = matrices["wo"][::-1]
        return out

    @classmethod
    def matrices(cls, cfg: ModelConfig, spec: MixerSpec) -> dict[str, tuple[int, int]]:
        d, h, k = cfg.d_model, cfg.linear_num_heads, cfg.linear_head_dim
        return {
            **{f"{p}_proj": (d, h * k) for p in PROJECTIONS},
            **cls.gate_matrices(cfg),
            "wo": (h * k, d),
        }

    @classmethod
    def mixing_flops_per_token(cls, cfg: ModelConfig, spec: MixerSpec, seq_len: int) -> float:
        """The chunked rule as Gated DeltaNet counts it with K = V (chunks of C = 64, per head
        and token, forward ``4CK + 2C^2/3 + 4CK + 2CK + 6K^2``; a per-channel decay costs no
        more products, only exponentials) and the convolution (``2W`` per channel), backward
        twice forward; independent of ``seq_len``."""
        c, k = CHUNK, cfg.linear_head_dim
        rule = 4 * c * k + 2 * c * c / 3 + 4 * c * k + 2 * c * k + 6 * k * k
        conv = 2 * cfg.linear_conv_kernel_dim * 3 * cfg.linear_num_heads * k
        return 3.0 * (cfg.linear_num_heads * rule + conv)

    @classmethod
    def saved_bytes_per_token(
        cls, cfg: ModelConfig, spec: MixerSpec, act_bytes: int, sp: int
    ) -> int:
        """The projections' input ``aD``; the convolution's input, its output before and after
        SiLU ``3a Ch`` (q, k, v are views of the last); the two low-rank projections' middles
        ``2aK`` (none with full-rank gates); the fp32 L2-normalised q and k ``8 H K`` (under
        bf16 also their fp32 copies, ``8 H K``) and their rsqrt ``8 H``; the fp32 decay's
        input, softplus and product ``12 H K`` (the bounded gate's input, sigmoid and product
        alike), beta ``4 H``; the chunked rule's ``U`` ``4 H K``, ``T`` and ``P`` ``8 H C``
        and its chunk-start states ``4 H K^2 / C``; the rule's output and the gate ``2a H K``,
        the gated norm's rsqrt ``4 H`` and its output ``a H K``. Rows a multiple of C = 64,
        without documents."""
        a, d, h, k = act_bytes, cfg.d_model, cfg.linear_num_heads, cfg.linear_head_dim
        ch = 3 * h * k
        qk = 8 * h * k * (1 if a == 4 else 2) + 8 * h
        rule = 4 * h * k + 8 * h * CHUNK + 4 * h * k * k // CHUNK
        middles = 0 if cfg.kda_full_rank_gates else 2 * a * k
        return a * d + 3 * a * ch + middles + qk + 12 * h * k + 4 * h + rule + 3 * a * h * k + 4 * h

    @classmethod
    def cache_bytes_per_token(cls, cfg: ModelConfig, spec: MixerSpec, dtype_bytes: int) -> int:
        """0: the state does not grow (:meth:`cache_bytes_per_sequence`)."""
        return 0

    @classmethod
    def cache_bytes_per_sequence(cls, cfg: ModelConfig, spec: MixerSpec, dtype_bytes: int) -> int:
        """The convolution's ``(W - 1) 3 H K`` inputs in the model's dtype and the rule's
        ``H K K`` fp32 state."""
        h, k = cfg.linear_num_heads, cfg.linear_head_dim
        return (cfg.linear_conv_kernel_dim - 1) * 3 * h * k * dtype_bytes + 4 * h * k * k

    @classmethod
    def exchange_bytes_per_token(
        cls, cfg: ModelConfig, spec: MixerSpec, act_bytes: int, sp: int
    ) -> float:
        """The pre-convolution q, k, v, the forget gate's input and b out (``4 H K + H``
        values), the rule's output back (``H K``); ``(sp - 1) / sp`` of each leaves the GPU."""
        if sp == 1:
            return 0.0
        h, k = cfg.linear_num_heads, cfg.linear_head_dim
        return act_bytes * (5 * h * k + h) * (sp - 1) / sp
