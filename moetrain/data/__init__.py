"""Data pipeline: sources -> SentencePiece tokenizer -> token shards -> packed loader."""

from moetrain.data.errors import DataError
from moetrain.data.loader import PackedLoader, build_loader
from moetrain.data.prepare import prepare
from moetrain.data.shards import read_index
from moetrain.data.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "DataError",
    "PackedLoader",
    "Tokenizer",
    "build_loader",
    "load_tokenizer",
    "prepare",
    "read_index",
]
