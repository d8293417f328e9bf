"""Data pipeline: sources -> tokenizer -> token shards -> packed loader.

``moetrain.data.prepare.prepare`` builds a data directory; the names below are imported on first
use, so that a training process, which imports only the loader, does not pay for ``datasets``
(about 100 MiB of resident memory per rank, with pyarrow), and the tokenizer worker processes of
``moetrain prepare`` do not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from moetrain.data.errors import DataError

if TYPE_CHECKING:
    from moetrain.data.loader import PackedLoader
    from moetrain.data.shards import read_index
    from moetrain.data.splits import build_loader
    from moetrain.data.tokenizer import Tokenizer, load_tokenizer

_LAZY = {
    "PackedLoader": "loader",
    "build_loader": "splits",
    "read_index": "shards",
    "Tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
}

__all__ = [
    "DataError",
    "PackedLoader",
    "Tokenizer",
    "build_loader",
    "load_tokenizer",
    "read_index",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"moetrain.data.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
