"""DeepSeek-V4's attention as a token mixer (``model.attention: compressed``; keys and rules in
:mod:`moetrain.config.mixers.compressed`): :class:`moetrain.model.compressed_attention.
CompressedAttention` with the layer's RoPE rows, its inference state and its counts.

Each layer computes its own RoPE rows (adjacent pairs): the sliding layers' of base
``model.rope_theta``, the compressed layers' of ``model.compress_rope_theta`` with YaRN's
frequencies under ``model.rope_scaling: yarn`` (cos / sin unscaled), so the model's own tables
are not read. Packed documents (``data.document_mask``) are cut out of their rows and run as a
batch of their own, grouped by padded length as :mod:`moetrain.model.doc_attention` groups them
(padding after a document's end, which none of its tokens sees): every document's positions,
window and compressor windows count from its own start, so a packed row equals its documents
alone. Sequence parallelism is refused by the config.

Its inference state keeps the layer's inputs (``d_model`` values per token) and a forward with it
recomputes the layer over the whole prefix, returning the new positions: exact (the same
computation as without a state), at the price of the prefix's attention per step.

Shape legend: B batch, S sequence, D d_model, T cached positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetrain.config import ModelConfig
from moetrain.config.layer_plan import MixerSpec
from moetrain.config.mixers.compressed import RATE_KEYS
from moetrain.model.compressed_attention import (
    CompressedAttention,
    CompressedAttentionShape,
    pair_rope_rows,
)
from moetrain.model.doc_attention import Documents
from moetrain.model.mixers.base import MixerInputs, TokenMixer


def attention_shape(cfg: ModelConfig, spec: MixerSpec) -> CompressedAttentionShape:
    """The layer's :class:`CompressedAttentionShape` from the config."""
    sparse = spec.compress == "csa"
    return CompressedAttentionShape(
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        head_dim=cfg.head_dim,
        rope_dim=int(cfg.head_dim * cfg.partial_rotary_factor),
        q_lora_rank=cfg.q_lora_rank,
        o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank,
        window=spec.window,
        kind=spec.compress or "sliding",
        rate=getattr(cfg, RATE_KEYS[spec.compress]) if spec.compress else 4,
        index_heads=cfg.compress_index_heads if sparse else 0,
        index_head_dim=cfg.compress_index_head_dim if sparse else 0,
        index_topk=cfg.compress_index_topk if sparse else 0,
        norm_eps=cfg.norm_eps,
    )


@dataclass(eq=False)
class InputCache:
    """A layer's inputs so far (B, T, D), recomputed over at every step."""

    x_BTD: torch.Tensor

    @property
    def bytes_per_token(self) -> int:
        return self.x_BTD.shape[-1] * self.x_BTD.element_size()

    @property
    def bytes_per_sequence(self) -> int:
        return 0


class CompressedMixer(CompressedAttention, TokenMixer):
    """DeepSeek-V4's attention behind the token mixer protocol (module docstring)."""

    kind = "compressed"
    query_key_logits = True  # (each head's largest logit, for the step record)

    def __init__(self, cfg: ModelConfig, spec: MixerSpec) -> None:
        super().__init__(attention_shape(cfg, spec))
        self.init_std = cfg.init_std
        self.n_heads = cfg.n_heads
        yarn = None
        if spec.compress and cfg.rope_scaling == "yarn":
            yarn = (cfg.rope_factor, cfg.rope_original_max_seq_len, *cfg.yarn_betas)
        theta = cfg.compress_rope_theta if spec.compress else cfg.rope_theta
        self._rope_args = (self.shape.rope_dim, theta, yarn)
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def init_own_parameters(self) -> None:
        super().init_own_parameters(self.init_std)

    def qk_clip_scales(self, gamma_H: torch.Tensor) -> dict[str, torch.Tensor]:
        """Refused: each query head and the key are RMS-normalised after their projections,
        which would undo any scaling of their rows."""
        raise TypeError(
            "model.attention=compressed normalises every query head and the key after their "
            "projections: QK-clip (optim.muon.qk_clip) cannot scale its logits"
        )

    def rope_rows(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin (n, rope_dim / 2) of positions ``0 .. n - 1``: the layer's table, kept
        for the next call and recomputed where it is too short (backward keeps it: per
        position, not per token)."""
        rows = self._rows
        if rows is None or rows[0].shape[0] < n or rows[0].device != device:
            cos, sin = pair_rope_rows(n, *self._rope_args)
            self._rows = rows = (cos.to(device), sin.to(device))
        return rows[0][:n], rows[1][:n]

    def forward(
        self, x_BSD: torch.Tensor, inputs: MixerInputs, state: InputCache | None = None
    ) -> torch.Tensor:
        docs = inputs.mask
        if self.head_exchange is not None or not (docs is None or isinstance(docs, Documents)):
            raise ValueError(
                "model.attention=compressed: no sequence parallelism and no explicit masks "
                "(refused by parallel.sp_size)"
            )
        if docs is not None:
            if state is not None:
                raise ValueError("model.attention=compressed: no packed documents with a state")
            return self._by_documents(x_BSD, docs)
        if state is None:
            return super().forward(x_BSD, *self.rope_rows(x_BSD.shape[1], x_BSD.device))
        end = inputs.pos + x_BSD.shape[1]
        state.x_BTD[:, inputs.pos : end] = x_BSD.to(state.x_BTD.dtype)
        prefix = state.x_BTD[:, :end].to(x_BSD.dtype)
        return super().forward(prefix, *self.rope_rows(end, x_BSD.device))[:, inputs.pos :]

    def _by_documents(self, x_BSD: torch.Tensor, docs: Documents) -> torch.Tensor:
        """The layer over each document of ``docs`` on its own (module docstring): the
        documents of a length bucket (N, L) as one batch, positions ``0 .. L - 1``."""
        b, s, d = x_BSD.shape
        flat = torch.cat([x_BSD.reshape(b * s, d), x_BSD.new_zeros(1, d)])
        outs, where = [], []
        for index_NL, real_NL in docs.buckets:
            n, length = index_NL.shape
            x_NLD = flat.index_select(0, index_NL.reshape(-1)).view(n, length, d)
            y_NLD = super().forward(x_NLD, *self.rope_rows(length, x_BSD.device))
            real = real_NL.reshape(-1)
            outs.append(y_NLD.reshape(n * length, -1)[real])
            where.append(index_NL.reshape(-1)[real])
        out = outs[0].new_zeros(b * s, outs[0].shape[-1])
        return out.index_copy(0, torch.cat(where), torch.cat(outs)).view(b, s, -1)

    def new_state(
        self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> InputCache:
        return InputCache(
            torch.zeros(batch, max_len, self.shape.d_model, dtype=dtype, device=device)
        )

    # counts from the config alone

    @classmethod
    def param_shapes(cls, cfg: ModelConfig, spec: MixerSpec) -> dict[str, tuple[int, ...]]:
        sh = attention_shape(cfg, spec)
        d, h, k, ql = sh.d_model, sh.n_heads, sh.head_dim, sh.q_lora_rank
        shapes = {
            "wo_a": (sh.o_groups * sh.o_lora_rank, h * k // sh.o_groups),
            "sinks": (h,),
            "wq_a.weight": (ql, d),
            "q_norm.weight": (ql,),
            "wq_b.weight": (h * k, ql),
            "wkv.weight": (k, d),
            "kv_norm.weight": (k,),
            "wo.weight": (d, sh.o_groups * sh.o_lora_rank),
        }
        if sh.kind != "sliding":
            shapes |= _compressor_shapes("compressor.", d, k, sh.rate, sh.kind == "csa")
        if sh.kind == "csa":
            hi, ki = sh.index_heads, sh.index_head_dim
            shapes |= _compressor_shapes("indexer.compressor.", d, ki, sh.rate, True)
            shapes |= {"indexer.wq_b.weight": (hi * ki, ql), "indexer.weights_proj.weight": (hi, d)}
        return shapes

    @classmethod
    def matrices(cls, cfg: ModelConfig, spec: MixerSpec) -> dict[str, tuple[int, int]]:
        """The projections (the indexer's too, as latent attention counts its indexer's); the
        grouped ``wo_a`` is :meth:`mixing_flops_per_token`'s."""
        sh = attention_shape(cfg, spec)
        out = _main_matrices(sh)
        d, k = sh.d_model, sh.head_dim
        if sh.kind != "sliding":
            width = 2 * k if sh.kind == "csa" else k
            out |= {"compressor.wkv": (d, width), "compressor.wgate": (d, width)}
        if sh.kind == "csa":
            hi, ki = sh.index_heads, sh.index_head_dim
            out |= {
                "indexer.compressor.wkv": (d, 2 * ki),
                "indexer.compressor.wgate": (d, 2 * ki),
                "indexer.wq_b": (sh.q_lora_rank, hi * ki),
                "indexer.weights_proj": (d, hi),
            }
        return out

    @classmethod
    def mixing_flops_per_token(cls, cfg: ModelConfig, spec: MixerSpec, seq_len: int) -> float:
        """The grouped ``wo_a`` ``6 H K O`` (O: o_lora_rank); scores and values over the window
        and every entry of the sequence (``seq_len / rate``; the csa kernel scores them all,
        masked to the picks) ``12 H K (window + seq_len / rate)``, masks not discounted; the
        indexer's scores over every entry, forward only, ``2 Hi (Ki + 1) seq_len / rate``."""
        sh = attention_shape(cfg, spec)
        h, k = sh.n_heads, sh.head_dim
        entries = seq_len // sh.rate if sh.kind != "sliding" else 0
        flops = 6 * h * k * sh.o_lora_rank + 12 * h * k * (min(sh.window, seq_len) + entries)
        if sh.kind == "csa":
            flops += 2 * sh.index_heads * (sh.index_head_dim + 1) * entries
        return flops

    @classmethod
    def saved_bytes_per_token(
        cls, cfg: ModelConfig, spec: MixerSpec, act_bytes: int, sp: int
    ) -> int:
        """Per token (a = ``act_bytes``): the input ``aD``; the query latent and its norm
        ``2aQ + 4``; the heads' fp32 copy for their weightless norm ``4HK + 4H``; the key's norm
        ``aK + 4``; the attention's scaled queries, key and output ``2aHK + aK`` (csa: its picks
        ``9k``); the grouped projection's input in group order ``aHK`` and
        ``wo``'s ``aGO``. A compressed layer of window m and width c (K; csa 2K, two series)
        adds the compressor's keys and fp32 softmax ``(a + 4)c`` (under bf16 the weights'
        rounded copy ``ac``) and its entries, normalised and rotated, ``(2aK + 4) / m``. The
        RoPE rows are the layer's own table, not per token."""
        sh = attention_shape(cfg, spec)
        a, h, k, ql = act_bytes, sh.n_heads, sh.head_dim, sh.q_lora_rank
        total = a * sh.d_model + 2 * a * ql + 4 + 4 * h * k + 4 * h + a * k + 4
        total += 3 * a * h * k + a * k + a * sh.o_groups * sh.o_lora_rank
        if sh.kind != "sliding":
            width = 2 * k if sh.kind == "csa" else k
            total += (a + 4) * width + (a * width if a != 4 else 0)
            total += (2 * a * k + 4) // sh.rate
        if sh.kind == "csa":
            total += 9 * sh.index_topk
        return total

    @classmethod
    def cache_bytes_per_token(cls, cfg: ModelConfig, spec: MixerSpec, dtype_bytes: int) -> int:
        return cfg.d_model * dtype_bytes

    @classmethod
    def exchange_bytes_per_token(
        cls, cfg: ModelConfig, spec: MixerSpec, act_bytes: int, sp: int
    ) -> float:
        """0: the kind has no sequence parallelism (refused by ``parallel.sp_size``)."""
        return 0.0


def _main_matrices(sh: CompressedAttentionShape) -> dict[str, tuple[int, int]]:
    d, h, k, ql = sh.d_model, sh.n_heads, sh.head_dim, sh.q_lora_rank
    return {
        "wq_a": (d, ql),
        "wq_b": (ql, h * k),
        "wkv": (d, k),
        "wo": (sh.o_groups * sh.o_lora_rank, d),
    }


def _compressor_shapes(
    prefix: str, d: int, dim: int, rate: int, overlap: bool
) -> dict[str, tuple[int, ...]]:
    width = 2 * dim if overlap else dim
    return {
        f"{prefix}position_bias": (rate, width),
        f"{prefix}wkv.weight": (width, d),
        f"{prefix}wgate.weight": (width, d),
        f"{prefix}kv_norm.weight": (dim,),
    }
