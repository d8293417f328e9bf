"""Write a committed checkpoint from streamed weights, without a training job (import from
Hugging Face, upcycling): the same files the trainer writes, read by
:func:`moetrain.checkpoint.read.load_model` and resumable as weights."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

import moetrain
from moetrain.checkpoint.format import (
    COMMIT_FILE,
    DENSE_FILE,
    STATE_FILE,
    TOKENIZER_FILE,
    TOKENIZER_FILES,
    TrainerState,
    deepspeed_expert_key,
    dense_file_content,
    expert_file,
    manifest_of,
    tokenizer_path,
)
from moetrain.config import Config
from moetrain.fileio import building_dir, file_sha256, write_json_atomic
from moetrain.model import param_names
from moetrain.model.moe.experts import expert_param_names
from moetrain.model.mtp import MTP_CHAIN


def write_checkpoint(
    ckpt_dir: str | Path,
    cfg: Config,
    parts: Iterable[tuple[str, dict[str, torch.Tensor]]],
    tokenizer: str | Path | Iterable[str | Path] | None = None,
    step: int = 0,
    extra: dict | None = None,
    init: dict | None = None,
) -> Path:
    """Write the trainer's checkpoint layout at ``ckpt_dir`` (must not exist) from ``parts`` as
    :func:`~moetrain.checkpoint.read.iter_layer_states` yields them: ``("dense", non-expert
    state)``, then ``("layers.<i>", {"layers.<i>.ffn.experts.w13": (E, D, 2F), ...})`` per MoE
    layer. ``tokenizer``: a SentencePiece ``.model``, or a Hugging Face tokenizer's files
    (``tokenizer.json`` first); ``init``: what the weights came from (``TrainerState.init``).
    Built in a temporary directory, committed (``COMMITTED.json`` last), renamed."""
    ckpt = Path(ckpt_dir)
    if ckpt.exists():
        raise FileExistsError(f"{ckpt}: already exists")
    moe_index = {layer: n for n, layer in enumerate(cfg.moe.moe_layers(cfg.model.n_blocks))}
    with building_dir(ckpt) as tmp:
        for where, part in parts:
            if where == "dense":
                module = {k: v for k, v in part.items() if not param_names.parse_experts(k)}
                torch.save(dense_file_content(module), tmp / DENSE_FILE)
                continue
            layer = int(where.split(".")[1])
            prefix = param_names.experts_prefix(layer)
            for e in range(cfg.moe.num_experts):
                sd = {
                    deepspeed_expert_key(prefix, e, n): part[prefix + n][e].clone()
                    for n in expert_param_names(cfg.moe.expert_biases)
                }
                torch.save(sd, tmp / expert_file(moe_index[layer], e))
        files = [tokenizer] if isinstance(tokenizer, (str, Path)) else list(tokenizer or [])
        for f in map(Path, files):
            name = f.name if f.name in TOKENIZER_FILES else TOKENIZER_FILE  # any .model name
            shutil.copyfile(f, tmp / name)
        identity = tokenizer_path(tmp)
        sha = file_sha256(identity) if identity else None
        state = TrainerState(
            step=step,
            tokens_seen=0,
            skipped_steps=0,
            loader=None,
            schedule=None,
            layout={"world_size": 1, "ep_size": 1, "zero_stage": cfg.parallel.zero_stage},
            config=cfg.to_dict(),
            tokenizer_sha256=sha,
            extra=extra or {},
            init=init,
            moetrain_version=moetrain.__version__,
            mtp_chain=MTP_CHAIN,
        )
        write_json_atomic(tmp / STATE_FILE, state.to_json())
        write_json_atomic(tmp / COMMIT_FILE, manifest_of(tmp, step))
    return ckpt
