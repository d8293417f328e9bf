"""Mamba-2 (Dao & Gu 2024), the ``mamba2`` token mixer, as Granite 4.0-H and Nemotron-H compute
it in their recurrent layers (its keys and rules: :mod:`moetrain.config.mixers.mamba2`).

Shape legend: B batch, S sequence, D d_model, H heads, P head dim, I = H P, G groups, N state
dim, Ch = I + 2 G N convolution channels, W the convolution's width.

Per token: ``in_proj`` gives ``[z | x B C | dt]`` (I, Ch, H channels); a causal depthwise
convolution of width W with a bias and SiLU runs over x, B, C
(:func:`moetrain.model.short_conv.short_conv`), then

    dt = clamp(softplus(dt + dt_bias), mamba_dt_min, mamba_dt_max)    per head (fp32)
    A  = -exp(A_log)
    y  = ssd(x, dt, A, B, C) + D x           the selective scan, head h reads group h // (H/G)
    out = wo(norm(y * silu(z)))              RMSNorm over each group's I / G channels (fp32),
                                             a weight of I

(:mod:`moetrain.model.ssd_scan`: the chunked form for training and prefill, the token
recurrence for a decode step). Packed documents restart the convolution's window and the
scan's state at every document start, so a packed row equals its documents one by one. On
CUDA the convolution and the scan can run causal-conv1d's and mamba-ssm's kernels instead
(:mod:`moetrain.model.ssd_cuda`, chosen by ``train.recurrent_kernels``; ``kernel_choice``
records what the first call ran).

Numerics: dt, the scan and the gated norm compute in fp32 under bf16, the result rounded
once; the convolution in the activations' dtype.

Generation: :class:`~moetrain.model.mixers.gated_deltanet.RecurrentState`, the last W - 1
convolution inputs (B, W - 1, Ch) in the model's dtype and the scan's state (B, H, P, N) in
fp32.

Sequence parallelism (``parallel.sp_size`` = n, which must divide H): each rank projects its
slice and exchanges the pre-convolution x and dt of its ``H / n`` heads with the B and C of the
groups they read to whole sequences (the G groups repeated to ``lcm(G, n)`` first where n does
not divide G, as attention repeats key/value heads), convolves those channels with their rows
of the convolution, runs the scan on its heads, and exchanges the scan's output back before the
gated norm, whose groups then hold every head again (z never travels).

Parameter names are transformers' (``in_proj``, ``conv1d`` (Ch, 1, W) with its bias,
``dt_bias``, ``A_log``, ``D``, ``norm``), the output projection ``wo`` (``out_proj``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.config import ModelConfig
from moetrain.config.layer_plan import MixerSpec
from moetrain.model.cpu_matmul import Linear
from moetrain.model.head_exchange import HeadExchange, kv_repeats, rank_channels
from moetrain.model.mixers.base import MixerInputs, TokenMixer
from moetrain.model.mixers.gated_deltanet import DT_FLOOR, DT_MAX, DT_MIN, RecurrentState
from moetrain.model.recurrent_kernels import KernelChoice
from moetrain.model.short_conv import short_conv
from moetrain.model.short_conv_cuda import conv_unsupported, short_conv_cuda
from moetrain.model.ssd_cuda import ssd_scan_cuda
from moetrain.model.ssd_scan import ssd_recurrent, ssd_scan

A_RANGE = (1.0, 16.0)  # -A at initialisation (Mamba-2's)


def gated_group_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float
) -> torch.Tensor:
    """Mamba-2's gated norm ``weight * rmsnorm(y * silu(z))``, the statistics over each of
    ``groups`` equal groups of the last dim, in fp32; y, z (..., I), weight (I,)."""
    wide = torch.promote_types(y.dtype, torch.float32)
    gated = y.to(wide) * F.silu(z.to(wide))
    grouped = gated.unflatten(-1, (groups, -1))
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(wide) * normed.flatten(-2)).to(z.dtype)


class GatedGroupNorm(nn.Module):
    """The gated norm's weight (I,) (ones at initialisation)."""

    def __init__(self, dim: int, groups: int, eps: float) -> None:
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_group_norm(y, z, self.weight, self.groups, self.eps)


class Mamba2(TokenMixer):
    """Mamba-2 (see the module docstring)."""

    kind = "mamba2"

    def __init__(self, cfg: ModelConfig, spec: MixerSpec) -> None:
        super().__init__()
        d = cfg.d_model
        self.heads, self.head_dim = cfg.mamba_num_heads, cfg.mamba_head_dim
        self.groups, self.state_dim = cfg.mamba_n_groups, cfg.mamba_state_dim
        self.width, self.chunk = cfg.mamba_conv_kernel, cfg.mamba_chunk_size
        self.dt_limit = (cfg.mamba_dt_min, cfg.mamba_dt_max)
        inner, ch = self.heads * self.head_dim, self.channels(cfg)
        self.in_proj = Linear(d, inner + ch + self.heads, bias=cfg.mamba_proj_bias)
        self.conv1d = nn.Conv1d(ch, ch, self.width, groups=ch, bias=cfg.mamba_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(self.heads))
        self.A_log = nn.Parameter(torch.empty(self.heads))
        self.D = nn.Parameter(torch.empty(self.heads))
        self.norm = GatedGroupNorm(inner, self.groups, cfg.norm_eps)
        self.wo = Linear(inner, d, bias=cfg.mamba_proj_bias)
        self.kernel_choice = KernelChoice(
            "mamba_ssm mamba_chunk_scan_combined + causal_conv1d", ("mamba_ssm", "causal_conv1d")
        )

    @staticmethod
    def channels(cfg: ModelConfig) -> int:
        """The convolution's channels ``I + 2 G N``."""
        return cfg.mamba_num_heads * cfg.mamba_head_dim + 2 * cfg.mamba_n_groups * (
            cfg.mamba_state_dim
        )

    def forward(
        self, x_BSD: torch.Tensor, inputs: MixerInputs, state: RecurrentState | None = None
    ) -> torch.Tensor:
        """Mix causally, restarting at ``inputs.doc_ids_BS``'s documents; with ``state`` the
        tokens continue the state's and it takes them in."""
        b, s, _ = x_BSD.shape
        h, p = self.heads, self.head_dim
        z, xbc, dt = self.in_proj(x_BSD).split([h * p, self.conv1d.weight.shape[0], h], dim=-1)
        weight_CW, bias = self.conv1d.weight.squeeze(1), self.conv1d.bias
        per_head = (self.dt_bias, self.A_log, self.D)
        groups = self.groups
        ex = self.head_exchange
        if ex is not None:  # whole sequences, this rank's heads with the groups they read
            if state is not None:
                raise ValueError("a recurrent state runs on one device, without a head exchange")
            xbc, dt = self._to_heads(ex, xbc, dt)
            rows = self._rows(ex, xbc.device)
            weight_CW, bias = weight_CW[rows], None if bias is None else bias[rows]
            heads = slice(ex.rank * h // ex.size, (ex.rank + 1) * h // ex.size)
            per_head = tuple(t[heads] for t in per_head)
            groups = self._rank_groups(ex)
        y = self._mix(xbc, dt, weight_CW, bias, per_head, groups, inputs, state)
        if ex is not None:
            y = ex.to_sequence(y)
        return self.wo(self.norm(y.reshape(b, s, h * p), z))

    def _mix(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        weight_CW: torch.Tensor,
        bias: torch.Tensor | None,
        per_head: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        groups: int,
        inputs: MixerInputs,
        state: RecurrentState | None,
    ) -> torch.Tensor:
        """The convolution, the step and the scan over whole rows of some heads (all, or this
        rank's) and the ``groups`` groups they read: (B, S, h, P) out."""
        b, s, h = dt.shape
        p, n = self.head_dim, self.state_dim
        dt_bias, a_log, d_skip = per_head
        docs = inputs.doc_ids_BS
        decode = state is not None and s == 1  # always the torch recurrence
        cuda = not decode and self.kernel_choice.use_kernels(
            xbc, conv_unsupported(xbc, self.width, docs, state is not None)
        )
        xbc, conv_state = (short_conv_cuda if cuda else short_conv)(
            xbc,
            weight_CW,
            bias,
            activation="silu",
            initial_state=None if state is None else state.conv,
            output_final_state=state is not None,
            doc_ids=docs,
        )
        xs, B, C = xbc.split([h * p, groups * n, groups * n], dim=-1)
        dt = F.softplus(dt.float() + dt_bias.float())
        low, high = self.dt_limit
        if low > 0 or high is not None:
            dt = dt.clamp(min=low, max=high)
        A = -a_log.float().exp()
        args = dict(
            initial_state=None if state is None else state.rule,
            output_final_state=state is not None,
            doc_ids=docs,
        )
        if not decode:
            args["chunk_size"] = self.chunk
        scan = ssd_scan_cuda if cuda else ssd_recurrent if decode else ssd_scan
        B, C = B.view(b, s, groups, n), C.view(b, s, groups, n)
        y, ssm_state = scan(xs.view(b, s, h, p), dt, A, B, C, d_skip, **args)
        if state is not None:
            state.conv.copy_(conv_state)
            state.rule.copy_(ssm_state)
        return y

    def _rank_groups(self, ex: HeadExchange) -> int:
        """The groups of B and C a rank receives: ``lcm(G, n) / n``, each group repeated
        ``lcm(G, n) / G`` times first (:func:`kv_repeats`) so that every rank's heads find
        theirs."""
        return self.groups * kv_repeats(self.groups, ex.size) // ex.size

    def _to_heads(
        self, ex: HeadExchange, xbc: torch.Tensor, dt: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the pre-convolution x, B, C and dt -> the whole sequences of its
        ``H / n`` heads and the groups they read, in one exchange: the L = lcm(G, n) repeated
        groups each travel with their ``H / L`` heads."""
        b, s, _ = xbc.shape
        h, p, g, n = self.heads, self.head_dim, self.groups, self.state_dim
        units = g * kv_repeats(g, ex.size)
        xs, B, C = xbc.split([h * p, g * n, g * n], dim=-1)

        def repeated(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, g, n).repeat_interleave(units // g, dim=2)

        parts = (xs.reshape(b, s, units, -1), repeated(B), repeated(C), dt.view(b, s, units, -1))
        whole = ex.to_heads(torch.cat(parts, dim=-1))  # (B, S, L / n, X)
        per = h // units
        xs, B, C, dt = (t.flatten(2) for t in whole.split([per * p, n, n, per], dim=-1))
        return torch.cat([xs, B, C], dim=-1), dt

    def _rows(self, ex: HeadExchange, device: torch.device) -> torch.Tensor:
        """The convolution's channels of this rank's heads (x) and of the groups they read (B,
        then C, repeated as :meth:`_to_heads` sends them)."""
        inner, g, n = self.heads * self.head_dim, self.groups, self.state_dim
        x_rows = rank_channels(ex, ((0, inner),), device)
        local = self._rank_groups(ex)
        units = local * ex.size  # lcm(G, n)
        group = (ex.rank * local + torch.arange(local, device=device)) // (units // g)
        within = (group[:, None] * n + torch.arange(n, device=device)).flatten()
        return torch.cat([x_rows, inner + within, inner + g * n + within])

    def new_state(
        self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> RecurrentState:
        conv = (self.width - 1, self.conv1d.weight.shape[0])
        shape = (self.heads, self.head_dim, self.state_dim)
        return RecurrentState(batch, conv, shape, dtype, device)

    @torch.no_grad()
    def init_own_parameters(self) -> None:
        """The convolution as torch initialises one (uniform within ``1 / sqrt(W)``); ``-A``
        uniform in [1, 16] and ``dt_bias`` the inverse softplus of step sizes drawn
        log-uniformly in [1e-3, 0.1] (Mamba-2's); ``D`` and the norm's weight ones."""
        bound = 1 / math.sqrt(self.width)
        self.conv1d.weight.uniform_(-bound, bound)
        if self.conv1d.bias is not None:
            self.conv1d.bias.uniform_(-bound, bound)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(*A_RANGE).log())
        log_dt = torch.empty_like(self.dt_bias).uniform_(math.log(DT_MIN), math.log(DT_MAX))
        dt = log_dt.exp().clamp(min=DT_FLOOR)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.D.fill_(1.0)
        self.norm.weight.fill_(1.0)

    # counts (the protocol's; checked against the built module and saved-tensor hooks)

    @classmethod
    def param_shapes(cls, cfg: ModelConfig, spec: MixerSpec) -> dict[str, tuple[int, ...]]:
        d, h, ch = cfg.d_model, cfg.mamba_num_heads, cls.channels(cfg)
        inner = h * cfg.mamba_head_dim
        out: dict[str, tuple[int, ...]] = {"dt_bias": (h,), "A_log": (h,), "D": (h,)}
        out["in_proj.weight"] = (inner + ch + h, d)
        if cfg.mamba_proj_bias:
            out["in_proj.bias"] = (inner + ch + h,)
        out["conv1d.weight"] = (ch, 1, cfg.mamba_conv_kernel)
        if cfg.mamba_conv_bias:
            out["conv1d.bias"] = (ch,)
        out["norm.weight"] = (inner,)
        out["wo.weight"] = (d, inner)
        if cfg.mamba_proj_bias:
            out["wo.bias"] = (d,)
        return out

    @classmethod
    def matrices(cls, cfg: ModelConfig, spec: MixerSpec) -> dict[str, tuple[int, int]]:
        d, h = cfg.d_model, cfg.mamba_num_heads
        inner = h * cfg.mamba_head_dim
        return {"in_proj": (d, inner + cls.channels(cfg) + h), "wo": (inner, d)}

    @classmethod
    def mixing_flops_per_token(cls, cfg: ModelConfig, spec: MixerSpec, seq_len: int) -> float:
        """The chunked scan (chunks of Q = ``mamba_chunk_size``, forward: per group ``C B^T`` in
        its chunk ``2QN``; per head the masked scores times the values ``2QP``, its chunk
        state ``2PN`` and the entering state's output ``2PN``) and the convolution (``2W`` per
        channel), backward twice forward; independent of ``seq_len``."""
        q, p, n = cfg.mamba_chunk_size, cfg.mamba_head_dim, cfg.mamba_state_dim
        scan = cfg.mamba_n_groups * 2 * q * n + cfg.mamba_num_heads * (2 * q * p + 4 * p * n)
        conv = 2 * cfg.mamba_conv_kernel * cls.channels(cfg)
        return 3.0 * (scan + conv)

    @classmethod
    def saved_bytes_per_token(
        cls, cfg: ModelConfig, spec: MixerSpec, act_bytes: int, sp: int
    ) -> int:
        """Its input ``aD``; the convolution's padded input and its output before SiLU
        ``2a Ch``; its output after SiLU, whose x, B and C the scan keeps, ``a Ch``; z kept for
        the gated norm: under fp32 the projection's whole output ``4(I + Ch + H)``, under bf16
        an fp32 copy ``4I``; the step's softplus in and out ``8H``; the gated norm's scan
        output, gate, product, normalised values and rsqrt ``16I + 4G`` and its output ``aI``;
        the chunked scan's states entering its chunks ``4HPN / Q`` (it recomputes the rest).
        Rows a multiple of Q, without documents. Under sequence parallelism the same per token
        of a slice, but that from the convolution to the scan a rank holds ``lcm(G, sp)``
        groups (the repeated ones) where it holds G without: Ch counts those."""
        a, d, ch = act_bytes, cfg.d_model, cls.channels(cfg)
        h, p, g = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_n_groups
        n, q, inner = cfg.mamba_state_dim, cfg.mamba_chunk_size, h * p
        ch_seen = inner + 2 * math.lcm(g, sp) * n  # the channels the convolution and scan see
        z = 4 * (inner + ch + h) if a == 4 else 4 * inner
        norm = 16 * inner + 4 * g + a * inner
        scan = 4 * h * p * n // q
        return a * d + 3 * a * ch_seen + z + 8 * h + norm + scan

    @classmethod
    def cache_bytes_per_token(cls, cfg: ModelConfig, spec: MixerSpec, dtype_bytes: int) -> int:
        """0: the state does not grow (:meth:`cache_bytes_per_sequence`)."""
        return 0

    @classmethod
    def cache_bytes_per_sequence(cls, cfg: ModelConfig, spec: MixerSpec, dtype_bytes: int) -> int:
        """The convolution's ``(W - 1) Ch`` inputs in the model's dtype and the scan's
        ``H P N`` fp32 state."""
        conv = (cfg.mamba_conv_kernel - 1) * cls.channels(cfg) * dtype_bytes
        return conv + 4 * cfg.mamba_num_heads * cfg.mamba_head_dim * cfg.mamba_state_dim

    @classmethod
    def exchange_bytes_per_token(
        cls, cfg: ModelConfig, spec: MixerSpec, act_bytes: int, sp: int
    ) -> float:
        """The pre-convolution x, B and C of the ``lcm(G, sp)`` repeated groups and dt out
        (``I + 2 lcm(G, sp) N + H`` values), the scan's output back (``I``); ``(sp - 1) / sp``
        of each leaves the GPU."""
        if sp == 1:
            return 0.0
        inner = cfg.mamba_num_heads * cfg.mamba_head_dim
        units = math.lcm(cfg.mamba_n_groups, sp)
        dims = 2 * inner + 2 * units * cfg.mamba_state_dim + cfg.mamba_num_heads
        return act_bytes * dims * (sp - 1) / sp
