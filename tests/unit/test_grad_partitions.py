"""contiguous_span: a flat view only of tensors that are one run of memory, in order."""

from __future__ import annotations

import torch

from moetrain.parallel.grad_partitions import contiguous_span


def test_span_of_consecutive_views_is_a_view_of_the_buffer() -> None:
    buffer = torch.arange(20, dtype=torch.float32)
    parts = [buffer[2:5], buffer[5:11].view(2, 3), buffer[11:14]]
    span = contiguous_span(parts, 12)
    assert span is not None and span.data_ptr() == buffer[2:].data_ptr()
    assert torch.equal(span, torch.cat([p.reshape(-1) for p in parts]))
    span[0] = -1.0
    assert buffer[2] == -1.0


def test_no_span_where_a_concatenation_is_needed() -> None:
    buffer = torch.arange(20, dtype=torch.float32)
    assert contiguous_span([buffer[5:8], buffer[2:5]], 6) is None  # out of order
    assert contiguous_span([buffer[2:5], buffer[6:9]], 6) is None  # a gap
    assert contiguous_span([buffer[2:5], buffer[5:8]], 7) is None  # not the partition's size
    assert contiguous_span([buffer[2:5], torch.zeros(3)], 6) is None  # another allocation
    assert contiguous_span([buffer.view(4, 5)[:, :2]], 8) is None  # not contiguous
    halves = torch.zeros(8, dtype=torch.float16)
    assert contiguous_span([halves[:4], halves[4:].float()], 8) is None  # mixed dtypes
    assert contiguous_span([], 0) is None
