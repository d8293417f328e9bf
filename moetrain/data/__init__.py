"""Data pipeline: sources -> SentencePiece tokenizer -> token shards -> packed loader.

The loader (which needs torch) is imported lazily so that tokenizer worker processes and
``moetrain prepare`` do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from moetrain.data.errors import DataError
from moetrain.data.prepare import prepare
from moetrain.data.shards import read_index
from moetrain.data.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from moetrain.data.loader import PackedLoader, build_loader

__all__ = [
    "DataError",
    "PackedLoader",
    "Tokenizer",
    "build_loader",
    "load_tokenizer",
    "prepare",
    "read_index",
]


def __getattr__(name: str):
    if name in ("PackedLoader", "build_loader"):
        return getattr(importlib.import_module("moetrain.data.loader"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
