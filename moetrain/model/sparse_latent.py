"""DeepSeek sparse attention (DSA; DeepSeek-V3.2, GLM-5) as latent attention's option
``model.index_topk``: the pieces of a layer's forward that :class:`~moetrain.model.mixers.mla.
MLAttention` calls when its layer plan entry has an indexer source (``MixerSpec.index_from``).

Shape legend: B batch, S queries, T key positions, H heads, N / R / C / Vd latent attention's
non-rotary, rotary, latent and value dims, K = C + R, k = ``model.index_topk``, Q the query
latent.

A layer with its own indexer (:class:`~moetrain.model.indexer.LightningIndexer`) selects each
query's top-k keys (causal, within its document: :func:`~moetrain.model.sparse_index.
select_keys`) and records the selection in ``MixerInputs.selections`` under its index; a
"shared" layer (GLM-MoE-DSA) attends to the selection of ``index_from``. The indexer reads the
block's input and latent attention's query latent detached from the main graph: its training
signal is its KL divergence only, the main model's is the language-modelling loss only.

Training stages (``model.index_stage``): ``sparse`` attends to the selected keys
(:func:`~moetrain.model.sparse_attention.sparse_latent_attention`) and trains the indexer on
the KL over them; ``dense_warmup`` attends densely (latent attention's own path) and trains the
indexer on the KL over every key, the rest of the model frozen (:meth:`Transformer.__init__`
reads :meth:`MLAttention.trains_alone`). Each own-indexer layer reports its KL, weighted by
``model.index_loss_weight``, as a :class:`~moetrain.model.mixers.base.MixerLoss` named
``index`` with the metrics ``kl`` and ``recall`` (the share of the ``k`` keys dense attention
weighs most, its heads' mean, that the indexer selects, on the last
``model.index_recall_queries`` positions of every row).

Sequence parallelism (a head exchange attached): each rank keeps its queries, every head of
them, and gathers the whole rows' keys (:func:`whole_keys`: latent attention's shared
``[latent | k_rope]``; :func:`run_indexer`: the indexer's) from every rank; it selects, attends
and computes the KL for its queries over them (:func:`row_queries`: its slice of the whole rows'
documents), and reports the recall as its share (:func:`recall_share`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moetrain.model.doc_attention import Documents
from moetrain.model.head_exchange import HeadExchange, gather_sequence
from moetrain.model.indexer import LightningIndexer
from moetrain.model.mixers.base import MixerInputs, MixerLoss
from moetrain.model.sparse_index import (
    Keys,
    causal_keys,
    dense_index_kl,
    document_keys,
    index_scores_at,
    select_keys,
    selected_kl,
    top_k_hits,
)

if TYPE_CHECKING:
    from moetrain.config import ModelConfig
    from moetrain.config.layer_plan import MixerSpec


@dataclass
class Absorbed:
    """Latent attention in its shared-key form: ``q_BSHK`` each head's query ``[q_nope @ W_UK
    | q_rope]``, ``kv_BTK`` every key position's ``[latent | k_rope]``, ``w_uv_HVC`` each
    head's value slice of ``wkv_b`` (the output is ``o_C @ W_UV^T``)."""

    q_BSHK: torch.Tensor
    kv_BTK: torch.Tensor
    w_uv_HVC: torch.Tensor

    @classmethod
    def of(
        cls,
        q_nope_BSHN: torch.Tensor,
        q_rope_BSHR: torch.Tensor,
        latent_BTC: torch.Tensor,
        k_rope_BTR: torch.Tensor,
        wkv_b_weight: torch.Tensor,
    ) -> Absorbed:
        h, n = q_nope_BSHN.shape[2], q_nope_BSHN.shape[3]
        w_HXC = wkv_b_weight.view(h, -1, latent_BTC.shape[-1])
        q_abs_BSHC = torch.einsum("bshn,hnc->bshc", q_nope_BSHN, w_HXC[:, :n])
        return cls(
            torch.cat((q_abs_BSHC, q_rope_BSHR), dim=-1),
            torch.cat((latent_BTC, k_rope_BTR), dim=-1),
            w_HXC[:, n:],
        )

    def values(self, out_BSHC: torch.Tensor) -> torch.Tensor:
        """Every head's output (B, S, H, Vd) from its latent output."""
        return torch.einsum("bshc,hvc->bshv", out_BSHC, self.w_uv_HVC)

    def detached(self) -> Absorbed:
        return Absorbed(self.q_BSHK.detach(), self.kv_BTK.detach(), self.w_uv_HVC.detach())


@dataclass
class Queries:
    """Which keys this call's queries may see: those of the whole rows (``whole``), of which
    this call holds ``[first, first + s)`` (under sequence parallelism this rank's slice of
    ``ranks``; else all of them)."""

    whole: Keys
    first: int
    s: int
    ranks: int

    @property
    def own(self) -> Keys:
        return self.whole.rows(self.first, self.first + self.s)


def row_queries(
    inputs: MixerInputs, b: int, s: int, device: torch.device, ex: HeadExchange | None
) -> Queries:
    """This call's queries: of the packed documents of whole rows, or causal from
    ``inputs.pos`` (a cache's queries); with ``ex`` (sequence parallelism) this rank's slice
    of the whole rows."""
    rank, ranks = (ex.rank, ex.size) if ex is not None else (0, 1)
    if isinstance(inputs.mask, Documents):
        if inputs.doc_ids_BS is None or inputs.doc_ids_BS.shape[1] != s * ranks:
            raise ValueError("sparse attention over packed documents needs the rows' doc ids")
        whole = document_keys(inputs.doc_ids_BS.to(device))
    elif inputs.mask is not None:
        raise ValueError("sparse attention takes packed documents or causal rows, not a mask")
    else:
        whole = causal_keys(b, s * ranks, inputs.pos, device)
    return Queries(whole, rank * s, s, ranks)


def whole_keys(absorbed: Absorbed, ex: HeadExchange | None) -> Absorbed:
    """``absorbed`` with every rank's keys (:func:`gather_sequence`) under sequence
    parallelism: each rank attends from its queries to the whole rows."""
    if ex is None:
        return absorbed
    return Absorbed(absorbed.q_BSHK, gather_sequence(ex, absorbed.kv_BTK), absorbed.w_uv_HVC)


@dataclass
class IndexerOutput:
    """One call of an indexer: queries, weights (fp32) and every key position's keys (fp32)."""

    qi_BSHD: torch.Tensor
    w_BSH: torch.Tensor
    ki_BTD: torch.Tensor


def run_indexer(
    indexer: LightningIndexer,
    x_BSD: torch.Tensor,
    q_latent_BSQ: torch.Tensor,
    inputs: MixerInputs,
    state: object | None,
    ex: HeadExchange | None = None,
) -> IndexerOutput:
    """The indexer on the detached inputs; with a cache (``state.append_index``) its keys join
    the cached ones; under sequence parallelism (``ex``) every rank's keys are gathered."""
    x_BSD, q_latent_BSQ = x_BSD.detach(), q_latent_BSQ.detach()
    ki_BSD = indexer.keys(x_BSD, inputs.cos, inputs.sin)
    if state is not None:
        ki_BSD = state.append_index(inputs.pos, ki_BSD)
    if ex is not None:
        ki_BSD = gather_sequence(ex, ki_BSD)
    qi_BSHD, w_BSH = indexer.queries(x_BSD, q_latent_BSQ, inputs.cos, inputs.sin)
    return IndexerOutput(qi_BSHD, w_BSH, ki_BSD.float())


def selection(
    out: IndexerOutput | None, keys: Keys, topk: int, inputs: MixerInputs, source: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx_BSk, valid_BSk)``: this layer's own selection (``out``: its indexer's), recorded
    under ``source``, or the recorded selection of layer ``source``."""
    if out is None:
        if source not in inputs.selections:
            raise ValueError(f"sparse attention: layer {source}'s selection is not recorded")
        return inputs.selections[source]
    chosen = select_keys(out.qi_BSHD, out.w_BSH, out.ki_BTD, keys, topk)
    inputs.selections[source] = chosen
    return chosen


def recall_share(
    queries: Queries, n: int, topk: int, hits: Callable[[int, Keys], torch.Tensor]
) -> torch.Tensor | None:
    """The top-k recall on the last ``n`` positions of the whole rows, as this call's share:
    ``hits(i, keys)`` of its queries from its ``i``-th on (``keys`` theirs) over the whole
    rows' :meth:`Keys.wanted`, times ``queries.ranks`` (so that the ranks' mean, which the
    step's metrics take, is the recall; on one rank, the recall). None where ``n`` is 0."""
    rows = queries.whole.pos.shape[0]
    n = min(n, rows)
    if not n:
        return None
    wanted = queries.whole.rows(rows - n, rows).wanted(topk).clamp_min(1)
    lo, end = max(rows - n, queries.first), queries.first + queries.s
    if lo >= end:  # none of this rank's queries is among them
        return wanted.new_zeros((), dtype=torch.float32)
    return hits(lo - queries.first, queries.whole.rows(lo, end)) * queries.ranks / wanted


def report_loss(
    inputs: MixerInputs,
    layer: int,
    kl_BS: torch.Tensor,
    weight: float,
    recall: torch.Tensor | None,
) -> None:
    """Record an indexer's KL (mean over queries), weighted, with its metrics."""
    kl = kl_BS.mean()
    metrics = {"kl": kl.detach()}
    if recall is not None:
        metrics["recall"] = recall
    inputs.losses.append(MixerLoss("index", layer, weight * kl, metrics))


def sparse_index_loss(
    out: IndexerOutput,
    idx_BSk: torch.Tensor,
    valid_BSk: torch.Tensor,
    p_BSk: torch.Tensor,
    absorbed: Absorbed,
    scale: float,
    queries: Queries,
    recall_queries: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sparse stage: each query's KL over its selected keys (B, S), from the main attention's
    probabilities there (``p_BSk``) to the indexer's; and its recall (:func:`recall_share`)."""
    scores_BSk = index_scores_at(out.qi_BSHD, out.w_BSH, out.ki_BTD, idx_BSk)
    kl_BS = selected_kl(p_BSk, scores_BSk, valid_BSk)
    a = absorbed.detached()

    def hits(i: int, keys: Keys) -> torch.Tensor:
        idx, valid = idx_BSk[:, i:], valid_BSk[:, i:]
        return top_k_hits(idx, valid, a.q_BSHK[:, i:], a.kv_BTK, scale, keys)

    return kl_BS, recall_share(queries, recall_queries, idx_BSk.shape[-1], hits)


def warmup_index_loss(
    out: IndexerOutput,
    absorbed: Absorbed,
    scale: float,
    queries: Queries,
    topk: int,
    recall_queries: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dense warm-up: each query's KL over every key it may see (B, S), from the main
    attention's distribution to the indexer's; and the recall of its top-k
    (:func:`recall_share`)."""
    a = absorbed.detached()
    keys = queries.own
    kl_BS = dense_index_kl(out.qi_BSHD, out.w_BSH, out.ki_BTD, a.q_BSHK, a.kv_BTK, scale, keys)

    def hits(i: int, keys: Keys) -> torch.Tensor:
        qi, w = out.qi_BSHD[:, i:].detach(), out.w_BSH[:, i:].detach()
        idx, valid = select_keys(qi, w, out.ki_BTD.detach(), keys, topk)
        return top_k_hits(idx, valid, a.q_BSHK[:, i:], a.kv_BTK, scale, keys)

    return kl_BS, recall_share(queries, recall_queries, topk, hits)


def sparse_exchange_bytes(cfg: ModelConfig, spec: MixerSpec, a: int, sp: int) -> int:
    """Bytes a sparse-attention layer sends off the GPU per token of its rank's slice in one
    forward under sequence parallelism: its keys (``C + R``, and an own indexer's ``Di``) to
    each of the ``sp - 1`` other ranks; in the dense warm-up only an own indexer's layer, for
    its KL (the dense attention's exchange is latent attention's)."""
    if cfg.index_stage == "dense_warmup" and not spec.indexer:
        return 0
    index = cfg.index_head_dim if spec.indexer else 0
    return (sp - 1) * a * (cfg.kv_lora_rank + cfg.qk_rope_head_dim + index)


def sparse_mixing_flops(cfg: ModelConfig, spec: MixerSpec, seq_len: int) -> float:
    """Training FLOPs per token of a sparse-attention layer beyond its matrices (causal masks
    not discounted, recomputation in backward not counted, as for dense attention).

    ``sparse`` stage: attention over ``k = min(index_topk, seq_len)`` keys in the shared-key
    form, ``6 H (2C + R) k`` (scores ``C + R`` and values ``C`` wide; the absorbed ``W_UK`` /
    ``W_UV`` products are ``wkv_b``'s count); a layer with its own indexer adds its scores over
    the whole sequence, forward only, ``2 Hi (Di + 1) seq_len``, and its KL over the selected
    keys, ``6 Hi (Di + 1) k``. ``dense_warmup``: dense attention, and for an own indexer its KL
    over every key, ``(6 Hi (Di + 1) + 4 H (C + R)) seq_len`` (the main attention's scores
    again, forward and in the backward pass)."""
    h, c, r = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    index = cfg.index_n_heads * (cfg.index_head_dim + 1) if spec.indexer else 0
    if cfg.index_stage == "dense_warmup":
        dense = 6 * h * (cfg.attention_head_dim + cfg.v_head_dim) * seq_len
        kl = (6 * index + 4 * h * (c + r)) * seq_len if spec.indexer else 0
        return dense + kl
    k = min(cfg.index_topk, seq_len)
    return 6 * h * (2 * c + r) * k + 2 * index * seq_len + 6 * index * k


def sparse_saved_bytes(cfg: ModelConfig, spec: MixerSpec, a: int, sp: int = 1) -> int:
    """Bytes a sparse-attention layer saves for backward per token (``a`` per activation
    value; checked against saved-tensor hooks). ``sparse`` stage: the projections' inputs
    ``aD`` and ``2aQ + 4`` (the query latent and its norm's output), the ``wkv_a`` output
    ``a(C + R) + 4``, the query projection's output ``aH(N + R)`` (its non-rotary part is
    absorbed into ``q_abs``), the absorbed queries ``aH(C + R)`` and the keys ``a(C + R)``, the
    latent outputs ``aHC`` and log-sum-exp ``4H``, the ``wo`` input ``aHVd``; a layer with its
    own indexer also the selection ``9k`` (int64 positions, which are valid), the indexer's
    key norm ``4Di + 8``, its fp32 queries, weights and keys ``4(Hi Di + Hi + Di)`` and its KL
    over the selection ``9k`` (the target and log-probabilities, the mask), and a layer that
    shares another's selection nothing of it (the same tensors). ``dense_warmup``: latent
    attention's (``dense``) plus an own indexer's KL inputs, ``8Di + 8 + 4(Hi Di + Hi)`` and
    the absorbed queries and keys; an upper bound, as the frozen main model saves nothing.
    Under sequence parallelism (``sp`` ranks) the keys, and an own indexer's fp32 keys, are the
    whole rows' (:func:`whole_keys`, :func:`run_indexer`): ``(sp - 1)`` times theirs more."""
    h, c, r = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    hi, di, k = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    index = 8 * di + 8 + 4 * (hi * di + hi) if spec.indexer else 0
    absorbed = a * h * (c + r) + a * (c + r)
    absorbed += (sp - 1) * (a * (c + r) + (4 * di if spec.indexer else 0))
    if cfg.index_stage == "dense_warmup":
        return index + absorbed if spec.indexer else 0
    projections = a * cfg.d_model + 2 * a * cfg.q_lora_rank + 4 + a * (c + r) + 4
    queries = a * h * (cfg.qk_nope_head_dim + r)
    attention = absorbed + a * h * c + 4 * h + a * h * cfg.v_head_dim
    selection = 18 * k + index if spec.indexer else 0
    return projections + queries + attention + selection
