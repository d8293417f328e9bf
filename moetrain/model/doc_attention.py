"""Document-masked causal attention whose memory is linear in the sequence length.

Shape legend: B batch, S sequence, H query heads, G key/value heads, Hd head dim, N documents of
one length bucket, L that bucket's length.

Packed rows hold whole documents one after another, and a token attends to the earlier tokens
of its own document only. Instead of an (S, S) mask, every document is cut out of its row and
attended on its own with a plain causal kernel: documents are grouped by length, rounded up to
the next power of two, and each group is one batched ``scaled_dot_product_attention`` call, so
there are at most ``log2(S)`` calls whatever the number of documents. A document shorter than
its bucket is padded at its end: causal attention never lets a real token see the padding
after it, so the result is exact; the padded rows' outputs are dropped. Nothing of size S x S
is built or saved; the gathers copy q, k and v once.

:class:`Documents` holds the layout (host integers, computed once per forward from the row's
document ids and shared by every layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moetrain.model.local_attention import local_attention

MIN_BUCKET = 16  # shorter documents share one bucket of this length


@dataclass(frozen=True)
class Documents:
    """The documents of a packed batch, grouped by padded length: for each bucket length L,
    ``index_NL`` (N, L), the flat ``b * S + s`` position of each document's tokens (``B * S``,
    a zero row, where a document is shorter than L), and ``real_NL``, which entries are real.
    """

    batch: int
    seq_len: int
    buckets: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    @classmethod
    def from_ids(cls, doc_ids_BS: torch.Tensor) -> Documents:
        """The layout of ``doc_ids_BS`` (B, S): equal ids that are neighbours form one document
        (ids need not be unique across rows)."""
        b, s = doc_ids_BS.shape
        ids = doc_ids_BS.detach().cpu()
        starts_BS = torch.ones(b, s, dtype=torch.bool)
        starts_BS[:, 1:] = ids[:, 1:] != ids[:, :-1]
        flat_starts = starts_BS.reshape(-1).nonzero().squeeze(1)
        stops = torch.cat([flat_starts[1:], torch.tensor([b * s])])
        row_ends = (torch.div(flat_starts, s, rounding_mode="floor") + 1) * s
        lengths = torch.minimum(stops, row_ends) - flat_starts
        bucket_of = torch.clamp(lengths, min=MIN_BUCKET)
        bucket_of = 2 ** torch.ceil(torch.log2(bucket_of.double())).long()
        buckets = []
        for size in torch.unique(bucket_of).tolist():
            pick = bucket_of == size
            first, n = flat_starts[pick], lengths[pick]
            offsets_L = torch.arange(size)
            real_NL = offsets_L[None, :] < n[:, None]
            index_NL = torch.where(real_NL, first[:, None] + offsets_L[None, :], b * s)
            buckets.append((index_NL, real_NL))
        return cls(b, s, tuple(buckets))

    def to(self, device: torch.device) -> Documents:
        moved = tuple((i.to(device), r.to(device)) for i, r in self.buckets)
        return Documents(self.batch, self.seq_len, moved)


def _flat_with_zero_row(x_BHSHd: torch.Tensor) -> torch.Tensor:
    """(B, heads, S, Hd) -> (B * S + 1, heads, Hd): token-major, plus a zero row for padding."""
    b, h, s, hd = x_BHSHd.shape
    flat = x_BHSHd.transpose(1, 2).reshape(b * s, h, hd)
    return torch.cat([flat, flat.new_zeros(1, h, hd)])


def document_attention(
    q_BHSHd: torch.Tensor,
    k_BGSHd: torch.Tensor,
    v_BGSHd: torch.Tensor,
    docs: Documents,
    enable_gqa: bool = False,
    scale: float | None = None,
    window: int | None = None,
    sinks_H: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention within each document of ``docs``: (B, H, S, value head dim), equal to
    ``scaled_dot_product_attention`` with the block-causal (B, 1, S, S) document mask; with
    ``window`` / ``sinks_H``, each document is attended with that sliding window and those
    sinks (:func:`~moetrain.model.local_attention.local_attention`)."""
    b, h, s, _ = q_BHSHd.shape
    vd = v_BGSHd.shape[-1]
    q, k, v = (_flat_with_zero_row(t) for t in (q_BHSHd, k_BGSHd, v_BGSHd))
    outs, where = [], []
    for index_NL, real_NL in docs.buckets:
        n, length = index_NL.shape
        flat = index_NL.reshape(-1)

        def cut(x: torch.Tensor, flat: torch.Tensor = flat, n: int = n) -> torch.Tensor:
            return x.index_select(0, flat).view(n, -1, x.shape[1], x.shape[2]).transpose(1, 2)

        if window is None and sinks_H is None:
            out_NHLV = F.scaled_dot_product_attention(
                cut(q), cut(k), cut(v), is_causal=True, enable_gqa=enable_gqa, scale=scale
            )
        else:
            out_NHLV = local_attention(cut(q), cut(k), cut(v), window, sinks_H, enable_gqa, scale)
        real = real_NL.reshape(-1)
        outs.append(out_NHLV.transpose(1, 2).reshape(n * length, h, vd)[real])
        where.append(flat[real])
    out = v.new_zeros(b * s, h, vd).index_copy(0, torch.cat(where), torch.cat(outs))
    return out.view(b, s, h, vd).transpose(1, 2)
