"""Open a prepared split for training: one source's :class:`~moetrain.data.loader.PackedLoader`,
or a mixture's :class:`~moetrain.data.blend.BlendedLoader` over every source's."""

from __future__ import annotations

from pathlib import Path

from moetrain.config import DataConfig
from moetrain.data.blend import BlendedLoader, build_blended_loader
from moetrain.data.errors import DataError
from moetrain.data.loader import PackedLoader, check_tokenizer
from moetrain.data.shards import INDEX_FILE, read_index
from moetrain.data.source_sets import read_mixture_index


def build_loader(
    data_cfg: DataConfig,
    split: str,
    micro_batch_size: int,
    dp_rank: int,
    dp_world: int,
    seed: int,
    *,
    vocab_size: int | None = None,
) -> PackedLoader | BlendedLoader:
    """Open the prepared shards of ``split`` ("train" or "val") in ``data_cfg.output_dir``: one
    source's, or with ``data.sources`` the blend of every source's (:mod:`moetrain.data.blend`).

    Checks that the shards exist and match their index and were built with the configured
    tokenizer (:func:`check_tokenizer`). The loader's ``tokenizer_files`` are the tokenizer
    copy's files (checkpoints carry them).
    """

    def open_split(directory: Path, index: dict, stream_key: tuple[int, ...] = ()) -> PackedLoader:
        return PackedLoader(
            directory,
            index,
            split,
            data_cfg.seq_len,
            micro_batch_size,
            dp_rank,
            dp_world,
            seed,
            data_cfg.document_mask,
            stream_key,
        )

    if data_cfg.sources:
        return build_blended_loader(data_cfg, split, open_split, vocab_size=vocab_size)
    out = Path(data_cfg.output_dir)
    index = read_index(out)
    files = check_tokenizer(data_cfg, out / INDEX_FILE, index["tokenizer"], vocab_size)
    loader = open_split(out, index)
    loader.tokenizer_files = files
    return loader


def prepared_tokenizer_sha256(data_cfg: DataConfig) -> str | None:
    """The sha256 of the tokenizer ``data_cfg``'s prepared shards were tokenized with (a
    mixture's: its one tokenizer); None where nothing is prepared yet."""
    out = Path(data_cfg.output_dir)
    read = read_mixture_index if data_cfg.sources else read_index
    try:
        return read(out)["tokenizer"]["sha256"]
    except (OSError, KeyError, TypeError, DataError):
        return None
