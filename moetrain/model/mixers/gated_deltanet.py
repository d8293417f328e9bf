"""Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024), the ``gated_deltanet`` token mixer, as Qwen3-Next
and Qwen3.5 / Qwen3.6 compute it in their ``linear_attention`` layers (its keys and rules:
:mod:`moetrain.config.mixers.gated_deltanet`).

Shape legend: B batch, S sequence (this call's tokens; under sequence parallelism the whole
rows), s this rank's slice, D d_model, Hk query/key heads, Hv value heads (r = Hv / Hk per
query/key head), K key head dim, V value head dim, Ch = 2 Hk K + Hv V convolution channels,
W the convolution's width.

Per token: ``in_proj_qkv`` gives ``[q | k | v]`` (Hk K, Hk K, Hv V channels, heads in order),
``in_proj_z`` the output gate z (Hv V), ``in_proj_b`` and ``in_proj_a`` one value each per
value head. A causal depthwise convolution of width W with SiLU runs over the q, k, v channels
(:func:`moetrain.model.short_conv.short_conv`), then

    g    = -exp(A_log) * softplus(a + dt_bias)      the log decay of each value head (fp32)
    beta = sigmoid(b)                               its write strength (fp32); x 2, in
                                                    (0, 2), with model.linear_allow_neg_eigval
    o    = gated_delta_rule(l2norm(q), l2norm(k), v, g, beta)      value head h reads q/k
                                                                    head h // r
    y    = wo(norm(o) * silu(z))                    RMSNorm over each head's V dims, a weight
                                                    of V shared by the heads, eps norm_eps
                                                    (or model.linear_norm_eps)

(:mod:`moetrain.model.delta_rule`: the chunked form for training and prefill, the token
recurrence for a decode step). Packed documents restart the convolution's window and the
rule's state at every document start, so a packed row equals its documents one by one. On
CUDA the convolution and the rule can run fla's and causal-conv1d's kernels instead
(:mod:`moetrain.model.delta_rule_cuda`, chosen by ``train.recurrent_kernels``; the mixer's
``kernel_choice`` records what its first call ran).

Numerics: the decay, the gate beta and the rule's state are fp32 under bf16 (transformers takes
``sigmoid(b)`` in the input dtype: bf16 parity differs by beta's rounding); the convolution
computes in the activations' dtype, as transformers does; the gated norm's statistics and its
gate are fp32, the result rounded once.

Generation: :class:`RecurrentState`, the last W - 1 convolution inputs (B, W - 1, Ch) in the
model's dtype and the rule's state (B, Hv, K, V) in fp32: a fixed size whatever the length.

Sequence parallelism (``parallel.sp_size`` = n): each rank projects its slice, exchanges the
pre-convolution q, k, v and b, a of each query/key head's group (its query/key head and its r
value heads) to whole sequences and ``Hk / n`` groups, convolves those groups' channels with
their rows of the convolution, runs the rule on its heads, and exchanges the rule's output back
before the gated norm (z never travels).

Parameter names are transformers' Qwen3.5 ones (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``, ``conv1d`` (Ch, 1, W), ``A_log``, ``dt_bias``, ``norm``), the output projection
``wo`` (transformers' ``out_proj``). Qwen3-Next's files fuse the projections per query/key
head (``in_proj_qkvz``, ``in_proj_ba``), which conversion reorders.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.config import ModelConfig
from moetrain.config.layer_plan import MixerSpec
from moetrain.model.cpu_matmul import Linear
from moetrain.model.delta_rule import gated_delta_rule, gated_delta_rule_recurrent
from moetrain.model.delta_rule_cuda import gated_delta_rule_fla, rule_unsupported
from moetrain.model.head_exchange import HeadExchange, rank_channels
from moetrain.model.mixers.base import MixerInputs, TokenMixer
from moetrain.model.recurrent_kernels import KernelChoice
from moetrain.model.short_conv import short_conv
from moetrain.model.short_conv_cuda import short_conv_cuda

CHUNK = 64  # the chunked rule's chunk length
DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 0.1, 1e-4  # dt_bias's initial step sizes (Mamba's)
A_RANGE = (0.01, 16.0)  # exp(A_log) at initialisation, as transformers draws it


class RecurrentState:
    """One linear-attention layer's generation state: ``conv`` (B, W - 1, Ch), the last
    convolution inputs, in the model's dtype; ``rule`` (B, Hv, K, V), the delta rule's state,
    in fp32. Its size does not depend on the length."""

    bytes_per_token = 0

    def __init__(
        self,
        batch: int,
        conv_shape: tuple[int, int],
        rule_shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        self.conv = torch.zeros(batch, *conv_shape, dtype=dtype, device=device)
        self.rule = torch.zeros(batch, *rule_shape, dtype=torch.float32, device=device)

    @property
    def bytes_per_sequence(self) -> int:
        """Both states of one sequence."""
        per = [t[0].numel() * t.element_size() for t in (self.conv, self.rule)]
        return sum(per)


class _GatedRMSNorm(torch.autograd.Function):
    """``(weight * rmsnorm(o)) * silu(z)`` over the last dim: the statistics and the gate in fp32,
    ``weight * rmsnorm(o)`` rounded to o's dtype first (transformers' order), the product once;
    saves o, z and the per-row rsqrt."""

    @staticmethod
    def forward(ctx, o, z, weight, eps):  # noqa: ANN001, ANN205
        wide = torch.promote_types(o.dtype, torch.float32)
        o32 = o.to(wide)
        rstd = torch.rsqrt(o32.pow(2).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(o, z, weight, rstd)
        normed = weight * (o32 * rstd).to(o.dtype)
        return (normed.to(wide) * F.silu(z.to(wide))).to(o.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        o, z, weight, rstd = ctx.saved_tensors
        wide = rstd.dtype
        g, z32 = grad.to(wide), z.to(wide)
        sig = torch.sigmoid(z32)
        xhat = o.to(wide) * rstd
        normed = (weight * xhat.to(o.dtype)).to(wide)
        dz = g * normed * sig * (1 + z32 * (1 - sig))
        dnormed = g * z32 * sig  # d/d(normed): silu(z)
        dweight = None
        if ctx.needs_input_grad[2]:
            dweight = (dnormed * xhat).flatten(0, -2).sum(0).to(weight.dtype)
        dxhat = dnormed * weight.to(wide)
        do = (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True)) * rstd
        return do.to(o.dtype), dz.to(z.dtype), dweight, None


def gated_rms_norm(
    o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Qwen3-Next's gated RMSNorm ``norm(o) * silu(z)`` (o, z (..., V); weight (V,))."""
    return _GatedRMSNorm.apply(o, z, weight, eps)


class GatedRMSNorm(nn.Module):
    """The output norm's weight (V,), shared by the value heads (ones at initialisation)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(o, z, self.weight, self.eps)


@torch.no_grad()
def init_dt_bias(dt_bias: torch.Tensor) -> None:
    """The inverse softplus of step sizes drawn log-uniformly in [1e-3, 0.1] (Mamba's and
    fla's), in place."""
    log_dt = torch.empty_like(dt_bias).uniform_(math.log(DT_MIN), math.log(DT_MAX))
    dt = log_dt.exp().clamp(min=DT_FLOOR)
    dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))


def conv_and_rule(
    qkv: torch.Tensor,
    weight_CW: torch.Tensor,
    heads: tuple[tuple[int, int], ...],
    g: torch.Tensor,
    beta: torch.Tensor,
    docs: torch.Tensor | None,
    state: RecurrentState | None,
    kernels: KernelChoice,
) -> torch.Tensor:
    """The short convolution with SiLU over ``qkv``'s ``[q | k | v]`` channels, then the gated
    delta rule over L2-normalised q and k (chunked; one recurrence step for a single token with
    a state), both restarting at ``docs``' documents; ``heads``: q's, k's and v's (heads, dim);
    with ``state`` the tokens continue it and it takes them in. (B, S, H, V) out (Gated
    DeltaNet's, and Kimi Delta Attention's with a per-channel ``g``). ``kernels``: the mixer's
    choice of fla and causal-conv1d (:mod:`moetrain.model.delta_rule_cuda`) for the call."""
    b, s, _ = qkv.shape
    decode = state is not None and s == 1  # always the torch recurrence
    why = rule_unsupported(qkv, weight_CW.shape[1], heads[0][1], docs, state is not None)
    fla = not decode and kernels.use_kernels(qkv, why)
    mixed, conv_state = (short_conv_cuda if fla else short_conv)(
        qkv,
        weight_CW,
        activation="silu",
        initial_state=None if state is None else state.conv,
        output_final_state=state is not None,
        doc_ids=docs,
    )
    parts = mixed.split([h * d for h, d in heads], dim=-1)
    q, k, v = (t.view(b, s, h, d) for t, (h, d) in zip(parts, heads, strict=True))
    if fla:
        rule = gated_delta_rule_fla
    else:
        rule = gated_delta_rule_recurrent if decode else gated_delta_rule
    args = (
        {} if rule in (gated_delta_rule_fla, gated_delta_rule_recurrent) else {"chunk_size": CHUNK}
    )
    o, rule_state = rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=None if state is None else state.rule,
        output_final_state=state is not None,
        doc_ids=docs,
        qk_l2norm=True,
        **args,
    )
    if state is not None:
        state.conv.copy_(conv_state)
        state.rule.copy_(rule_state)
    return o


class GatedDeltaNet(TokenMixer):
    """Gated DeltaNet (see the module docstring)."""

    kind = "gated_deltanet"

    def __init__(self, cfg: ModelConfig, spec: MixerSpec) -> None:
        super().__init__()
        d = cfg.d_model
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.width = cfg.linear_conv_kernel_dim
        self.beta_scale = 2.0 if cfg.linear_allow_neg_eigval else 1.0  # beta in (0, 2) or (0, 1)
        ch = self.channels(cfg)
        self.A_log = nn.Parameter(torch.empty(self.hv))
        self.dt_bias = nn.Parameter(torch.empty(self.hv))
        self.in_proj_qkv = Linear(d, ch, bias=False)
        self.in_proj_z = Linear(d, self.hv * self.dv, bias=False)
        self.in_proj_b = Linear(d, self.hv, bias=False)
        self.in_proj_a = Linear(d, self.hv, bias=False)
        self.conv1d = nn.Conv1d(ch, ch, self.width, groups=ch, bias=False)
        eps = cfg.norm_eps if cfg.linear_norm_eps is None else cfg.linear_norm_eps
        self.norm = GatedRMSNorm(self.dv, eps)
        self.wo = Linear(self.hv * self.dv, d, bias=False)
        self._rank_rows: dict[tuple[int, int], torch.Tensor] = {}
        self.kernel_choice = KernelChoice(
            "fla chunk_gated_delta_rule + causal_conv1d", ("fla", "causal_conv1d")
        )

    @staticmethod
    def channels(cfg: ModelConfig) -> int:
        """The convolution's channels ``2 Hk K + Hv V``."""
        keys = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        return 2 * keys + cfg.linear_num_value_heads * cfg.linear_value_head_dim

    def forward(
        self, x_BSD: torch.Tensor, inputs: MixerInputs, state: RecurrentState | None = None
    ) -> torch.Tensor:
        """Mix causally, restarting at ``inputs.doc_ids_BS``'s documents; with ``state`` the
        tokens continue the state's and it takes them in."""
        b, s, _ = x_BSD.shape
        qkv_BsC, b_BsH, a_BsH = (
            self.in_proj_qkv(x_BSD),
            self.in_proj_b(x_BSD),
            self.in_proj_a(x_BSD),
        )
        weight_CW = self.conv1d.weight.squeeze(1)
        a_log, dt_bias = self.A_log, self.dt_bias
        ex = self.head_exchange
        if ex is not None:  # whole sequences, this rank's query/key heads and their values
            if state is not None:
                raise ValueError("a recurrent state runs on one device, without a head exchange")
            qkv_BsC, b_BsH, a_BsH = self._to_heads(ex, qkv_BsC, b_BsH, a_BsH)
            weight_CW = weight_CW[self._rows(ex, weight_CW.device)]
            heads = slice(ex.rank * self.hv // ex.size, (ex.rank + 1) * self.hv // ex.size)
            a_log, dt_bias = a_log[heads], dt_bias[heads]
        o_BShV = self._mix(qkv_BsC, b_BsH, a_BsH, weight_CW, a_log, dt_bias, inputs, state)
        if ex is not None:
            o_BShV = ex.to_sequence(o_BShV)
        z = self.in_proj_z(x_BSD).view(b, s, self.hv, self.dv)
        return self.wo(self.norm(o_BShV, z).reshape(b, s, -1))

    def _mix(
        self,
        qkv: torch.Tensor,
        b_raw: torch.Tensor,
        a_raw: torch.Tensor,
        weight_CW: torch.Tensor,
        a_log: torch.Tensor,
        dt_bias: torch.Tensor,
        inputs: MixerInputs,
        state: RecurrentState | None,
    ) -> torch.Tensor:
        """The convolution and the rule over whole rows of some heads (all, or this rank's):
        (B, S, h V) out."""
        hv = b_raw.shape[2]
        hk = hv * self.hk // self.hv
        g = -a_log.float().exp() * F.softplus(a_raw.float() + dt_bias.float())
        beta = b_raw.float().sigmoid()
        if self.beta_scale != 1.0:
            beta = beta * self.beta_scale
        heads = ((hk, self.dk), (hk, self.dk), (hv, self.dv))
        docs = inputs.doc_ids_BS
        return conv_and_rule(qkv, weight_CW, heads, g, beta, docs, state, self.kernel_choice)

    def _to_heads(
        self, ex: HeadExchange, qkv: torch.Tensor, b_raw: torch.Tensor, a_raw: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's slice of every head's pre-convolution channels and b, a -> the whole
        sequences of its ``Hk / n`` query/key heads' groups, in one exchange."""
        b, s, _ = qkv.shape
        r, keys = self.hv // self.hk, self.hk * self.dk
        q, k, v = qkv.split([keys, keys, self.hv * self.dv], dim=-1)
        parts = (q, k, v, b_raw, a_raw)
        packed = torch.cat([p.reshape(b, s, self.hk, -1) for p in parts], dim=-1)
        whole = ex.to_heads(packed)  # (B, S, hk, X)
        sizes = [self.dk, self.dk, r * self.dv, r, r]
        q, k, v, b_raw, a_raw = (p.flatten(2) for p in whole.split(sizes, dim=-1))
        return torch.cat([q, k, v], dim=-1), b_raw, a_raw

    def _rows(self, ex: HeadExchange, device: torch.device) -> torch.Tensor:
        """The convolution's channels of this rank's heads (q, k, v), in that order."""
        key = (ex.rank, ex.size)
        if key not in self._rank_rows:
            keys, values = self.hk * self.dk, self.hv * self.dv
            blocks = ((0, keys), (keys, keys), (2 * keys, values))
            self._rank_rows[key] = rank_channels(ex, blocks, device)
        return self._rank_rows[key]

    def new_state(
        self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> RecurrentState:
        conv = (self.width - 1, self.conv1d.weight.shape[0])
        return RecurrentState(batch, conv, (self.hv, self.dk, self.dv), dtype, device)

    @torch.no_grad()
    def init_own_parameters(self) -> None:
        """The convolution as torch initialises one (uniform within ``1 / sqrt(W)``); ``A``
        uniform in [0.01, 16] (transformers'); ``dt_bias`` the inverse softplus of step sizes
        drawn log-uniformly in [1e-3, 0.1] (Mamba's and fla's); the output norm's weight
        ones."""
        bound = 1 / math.sqrt(self.width)
        self.conv1d.weight.uniform_(-bound, bound)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(*A_RANGE).log())
        init_dt_bias(self.dt_bias)
        self.norm.weight.fill_(1.0)

    # counts (the protocol's; checked against the built module and saved-tensor hooks)

    @classmethod
    def param_shapes(cls, cfg: ModelConfig, spec: MixerSpec) -> dict[str, tuple[int, ...]]:
        hv, ch = cfg.linear_num_value_heads, cls.channels(cfg)
        out: dict[str, tuple[int, ...]] = {"A_log": (hv,), "dt_bias": (hv,)}
        for name, (n_in, n_out) in cls.matrices(cfg, spec).items():
            if name != "wo":
                out[f"{name}.weight"] = (n_out, n_in)
        out["conv1d.weight"] = (ch, 1, cfg.linear_conv_kernel_dim)
        out["norm.weight"] = (cfg.linear_value_head_dim,)
        out["wo.weight"] = (cfg.d_model, hv * cfg.linear_value_head_dim)
        return out

    @classmethod
    def matrices(cls, cfg: ModelConfig, spec: MixerSpec) -> dict[str, tuple[int, int]]:
        d, hv = cfg.d_model, cfg.linear_num_value_heads
        values = hv * cfg.linear_value_head_dim
        return {
            "in_proj_qkv": (d, cls.channels(cfg)),
            "in_proj_z": (d, values),
            "in_proj_b": (d, hv),
            "in_proj_a": (d, hv),
            "wo": (values, d),
        }

    @classmethod
    def mixing_flops_per_token(cls, cfg: ModelConfig, spec: MixerSpec, seq_len: int) -> float:
        """The chunked rule (chunks of C = 64, per value head and token, forward: ``q k^T`` and
        ``k k^T`` in its chunk ``4CK``, the triangular solve ``2C^2 / 3``, ``T`` times the values
        and the decayed keys ``2C(V + K)``, the intra-chunk output ``2CV``, the state's three
        products ``6KV``) and the convolution (``2W`` per channel), backward twice forward;
        independent of ``seq_len`` (the cost of a token does not grow with the context)."""
        c, k, v = CHUNK, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        rule = 4 * c * k + 2 * c * c / 3 + 2 * c * (v + k) + 2 * c * v + 6 * k * v
        conv = 2 * cfg.linear_conv_kernel_dim * cls.channels(cfg)
        return 3.0 * (cfg.linear_num_value_heads * rule + conv)

    @classmethod
    def saved_bytes_per_token(
        cls, cfg: ModelConfig, spec: MixerSpec, act_bytes: int, sp: int
    ) -> int:
        """The projections' input ``aD``; the convolution's input, its output before and after
        SiLU ``3a Ch`` (q, k, v are views of the last); the fp32 L2-normalised q and k
        ``8 Hk K`` (under bf16 also their fp32 copies before the norm, ``8 Hk K``) and their
        rsqrt ``8 Hk``; per value head the fp32 decay's input, softplus and product, beta and
        the gated norm's rsqrt ``20 Hv``; the chunked rule's ``U`` ``4 Hv V``, ``T`` and ``P``
        ``8 Hv C`` and its chunk-start states ``4 Hv K V / C``; the rule's output, z and the
        norm's output ``3a Hv V``. Rows a multiple of C = 64, without documents (a document
        adds its convolution's W - 1 zeros and an int per token); the same per token of a
        sequence-parallel slice (the heads are split as the tokens are gathered)."""
        a, d, ch = act_bytes, cfg.d_model, cls.channels(cfg)
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        k, v = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        qk = 8 * hk * k * (1 if a == 4 else 2) + 8 * hk
        rule = 4 * hv * v + 8 * hv * CHUNK + 4 * hv * k * v // CHUNK
        return a * d + 3 * a * ch + qk + 20 * hv + rule + 3 * a * hv * v

    @classmethod
    def cache_bytes_per_token(cls, cfg: ModelConfig, spec: MixerSpec, dtype_bytes: int) -> int:
        """0: the state does not grow (:meth:`cache_bytes_per_sequence`)."""
        return 0

    @classmethod
    def cache_bytes_per_sequence(cls, cfg: ModelConfig, spec: MixerSpec, dtype_bytes: int) -> int:
        """The convolution's ``(W - 1) Ch`` inputs in the model's dtype and the rule's
        ``Hv K V`` fp32 state."""
        conv = (cfg.linear_conv_kernel_dim - 1) * cls.channels(cfg) * dtype_bytes
        rule = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
        return conv + 4 * rule

    @classmethod
    def exchange_bytes_per_token(
        cls, cfg: ModelConfig, spec: MixerSpec, act_bytes: int, sp: int
    ) -> float:
        """The pre-convolution q, k, v with b and a out (``Ch + 2 Hv`` values), the rule's
        output back (``Hv V``); ``(sp - 1) / sp`` of each leaves the GPU."""
        if sp == 1:
            return 0.0
        hv = cfg.linear_num_value_heads
        dims = cls.channels(cfg) + 2 * hv + hv * cfg.linear_value_head_dim
        return act_bytes * dims * (sp - 1) / sp
