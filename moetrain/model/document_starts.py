"""Where packed documents restart a recurrent mixer's state (the gated delta rule, the short
convolution): one (B, S) bool mask, True at every position that begins a document after the
row's first one. Position 0 is never a start: whatever state the row begins with (zero, or a
cached / previous slice's state) belongs to its first document.
"""

from __future__ import annotations

import torch


def document_starts(
    doc_ids: torch.Tensor | None, cu_seqlens: torch.Tensor | None, batch: int, seq_len: int
) -> torch.Tensor | None:
    """(B, S) bool from ``doc_ids`` (B, S) (equal neighbouring ids are one document) or
    ``cu_seqlens`` (D + 1,) (the offsets 0, ..., S of D documents packed in one row; B = 1);
    None when neither is given."""
    if doc_ids is not None and cu_seqlens is not None:
        raise ValueError("give doc_ids or cu_seqlens, not both")
    if doc_ids is not None:
        if tuple(doc_ids.shape) != (batch, seq_len):
            raise ValueError(
                f"doc_ids has shape {tuple(doc_ids.shape)}; expected (B, S) = {(batch, seq_len)}"
            )
        starts = torch.zeros(batch, seq_len, dtype=torch.bool, device=doc_ids.device)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        return starts
    if cu_seqlens is None:
        return None
    cu = cu_seqlens.tolist() if cu_seqlens.dim() == 1 else []
    if batch != 1 or len(cu) < 2 or cu[0] != 0 or cu[-1] != seq_len or cu != sorted(cu):
        raise ValueError(
            f"cu_seqlens must be the non-decreasing offsets 0, ..., S = {seq_len} of the "
            f"documents of one row (B = 1); got {cu_seqlens.tolist()} for B = {batch}"
        )
    starts = torch.zeros(1, seq_len, dtype=torch.bool, device=cu_seqlens.device)
    inner = cu_seqlens[1:-1]
    starts[0, inner[(inner > 0) & (inner < seq_len)]] = True
    return starts
