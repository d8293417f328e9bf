"""The checkpoint format, spelled here and nowhere else.

``<run_dir>/checkpoints/step_<N>/`` holds:

- ``mp_rank_00_model_states.pt``: DeepSpeed's dense file, ``{"module": state dict}`` of the
  non-expert weights and buffers (the aux-loss-free biases included). Model weights are the
  fp32 master weights in every precision (under bf16/fp16 the module's low-precision copy is
  what a resume rounds them to).
- ``layer_<M>_expert_<G>_mp_rank_00_model_states.pt``: one file per global expert ``G`` of MoE
  layer ``M`` (counted over MoE layers only), with DeepSpeed's per-expert keys
  ``layers.<i>.ffn.experts.deepspeed_moe.experts.deepspeed_experts.<local>.<w13|w2>``; written
  once whatever the EP size, so model weights reshard.
- ``*zero_pp_rank_<r>_mp_rank_00_optim_states.pt``: the ZeRO-1/2 optimizer shard of each rank
  (``bf16_`` prefix under DeepSpeed's bf16 optimizer);
  ``expp_rank_<e>_mp_rank_00_optim_states.pt``: at ZeRO stage 0, the optimizer state of each
  expert-parallel rank.
- at ZeRO-3 (``parallel.zero_stage=3``) there are no dense or per-expert files:
  ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` holds rank ``r``'s buffers and the parameter
  names and shapes of each optimizer sub-group, and its ``..._optim_states.pt`` the rank's
  partition of every parameter (fp32 master weights and optimizer state) with the ranks each
  sub-group is partitioned over (:mod:`moetrain.checkpoint.reshard` reads them).
- ``rank_<r>.pt``: that rank's RNG states (tensors only).
- the tokenizer the data was tokenized with: ``tokenizer.model`` (SentencePiece), or a Hugging
  Face tokenizer's ``tokenizer.json`` with the files that configure it (``TOKENIZER_FILES``).
- ``trainer_state.json``: :class:`TrainerState`.
- ``COMMITTED.json``, written last: the manifest, ``{"step": N, "files": {name: size},
  "crc32": {name: CRC-32}, "writers": {name: rank}}``, built from the list of files each rank
  wrote (checkpoints before the checksums have only ``files``; their sizes are still checked).
"""

from __future__ import annotations

import json
import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from moetrain.fileio import file_crc32

CHECKPOINTS_DIR = "checkpoints"
COMMIT_FILE = "COMMITTED.json"
STATE_FILE = "trainer_state.json"
TOKENIZER_FILE = "tokenizer.model"
HF_TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_FILES = (
    TOKENIZER_FILE,
    HF_TOKENIZER_FILE,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
DENSE_FILE = "mp_rank_00_model_states.pt"
EXPERT_FILE_RE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt$")
DS_EXPERT_PREFIX = "deepspeed_moe.experts.deepspeed_experts."
# DeepSpeed's per-expert key: groups module prefix (``...ffn.experts.``), local expert, weight
EXPERT_KEY_RE = re.compile(r"^(.+\.)deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(\w+)$")
_TAG_RE = re.compile(r"^step_(\d{8})$")
FORMAT_VERSION = 1
# the fields of TrainerState that hold a run's progress (moetrain.train.progress.Progress)
PROGRESS_FIELDS = ("step", "tokens_seen", "skipped_steps", "loss_scale_overflows", "init")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit this run."""


def checkpoint_root(run_dir: str | Path) -> Path:
    """Where a run keeps its checkpoints."""
    return Path(run_dir) / CHECKPOINTS_DIR


def tag_for_step(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> int | None:
    """The step of a ``step_<N>`` directory, None for any other name."""
    m = _TAG_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def tokenizer_path(ckpt: Path) -> Path | None:
    """The checkpoint's tokenizer identity file: ``tokenizer.json`` (Hugging Face) or
    ``tokenizer.model`` (SentencePiece); None when it carries neither."""
    for name in (HF_TOKENIZER_FILE, TOKENIZER_FILE):
        if (Path(ckpt) / name).is_file():
            return Path(ckpt) / name
    return None


def rank_file(rank: int) -> str:
    """Per-rank RNG states."""
    return f"rank_{rank:05d}.pt"


def zero_optimizer_file(ckpt: Path, rank: int) -> Path:
    """DeepSpeed's ZeRO-1/2 optimizer file of ``rank`` in ``ckpt`` (plain or bf16 name)."""
    name = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    bf16 = Path(ckpt) / f"bf16_{name}"
    return bf16 if bf16.is_file() else Path(ckpt) / name


def zero3_model_file(ckpt: Path, rank: int) -> Path:
    """DeepSpeed's ZeRO-3 model file of ``rank``: its module's buffers (the weights are empty
    there) and the names and shapes of the parameters of each optimizer sub-group."""
    return Path(ckpt) / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def stage0_optimizer_file(ckpt: Path, ep_rank: int) -> Path:
    """DeepSpeed's ZeRO stage 0 optimizer file of expert-parallel rank ``ep_rank``."""
    return Path(ckpt) / f"expp_rank_{ep_rank}_mp_rank_00_optim_states.pt"


def expert_file(moe_index: int, expert: int) -> str:
    """DeepSpeed's file of global expert ``expert`` of the ``moe_index``-th MoE layer."""
    return f"layer_{moe_index}_expert_{expert}_mp_rank_00_model_states.pt"


def deepspeed_expert_key(module_prefix: str, local_expert: int, weight: str) -> str:
    """DeepSpeed's per-expert key under ``module_prefix`` (``...ffn.experts.``)."""
    return f"{module_prefix}{DS_EXPERT_PREFIX}{local_expert}.{weight}"


def dense_file_content(module: dict[str, Any]) -> dict[str, Any]:
    """What DeepSpeed's dense file holds for a single-rank, single-model-parallel writer."""
    return {"module": module, "dp_world_size": 1, "mp_world_size": 1}


@dataclass
class TrainerState:
    """``trainer_state.json``: everything but tensors that a resume or a reader needs.

    ``layout`` is ``{"world_size", "ep_size", "zero_stage"}`` at save time (plus ``sp_size``
    when it is > 1); ``loader`` and
    ``schedule`` are None in a checkpoint that was not written by training (import).
    ``optimizer_params``: the names of each optimizer param group's parameters, in order, where
    DeepSpeed's files do not name them (ZeRO stage 0), so that the optimizer state reshards.
    ``skipped_steps`` counts non-finite steps, ``loss_scale_overflows`` fp16 loss-scale
    calibration skips; ``loss_scaler`` is the fp16 dynamic loss scaler's state (``cur_scale``,
    ``cur_iter``, ``last_overflow_iter``, ``cur_hysteresis``), None in bf16/fp32.
    :data:`PROGRESS_FIELDS` are the run's progress (a training ``Progress``'s state dict).
    """

    step: int
    tokens_seen: int
    skipped_steps: int
    loader: dict[str, Any] | None
    schedule: dict[str, Any] | None
    layout: dict[str, int]
    config: dict[str, Any]
    tokenizer_sha256: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    optimizer_params: list[list[str]] | None = None
    # what the run's first weights were loaded from (checkpoint.init_from), carried by every
    # later checkpoint of the run; None for a run started from random weights
    init: dict[str, Any] | None = None
    moetrain_version: str = ""
    loss_scale_overflows: int = 0
    loss_scaler: dict[str, float] | None = None
    # how the multi-token-prediction depths were chained (moetrain.model.mtp.MTP_CHAIN);
    # None: written before it was recorded (each depth got the previous one's state before
    # its head norm)
    mtp_chain: str | None = None
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def progress(self) -> dict[str, Any]:
        """The progress fields, the state dict of the run's ``Progress``."""
        return {name: getattr(self, name) for name in PROGRESS_FIELDS}

    @classmethod
    def read(cls, ckpt: str | Path) -> TrainerState:
        """Load and check ``<ckpt>/trainer_state.json``; errors name the file and the key."""
        path = Path(ckpt) / STATE_FILE
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: unreadable: {e}") from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{path}: expected a JSON object")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"{path}: unsupported checkpoint format {version}; this moetrain reads "
                f"format {FORMAT_VERSION}"
            )
        known = {f.name for f in fields(cls)}
        required = {
            f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
        }
        missing = sorted(required - set(data))
        if missing:
            raise CheckpointError(f"{path}: missing {missing}")
        return cls(**{k: v for k, v in data.items() if k in known})


# ----------------------------------------------------------------------------- manifest


FileEntry = tuple[int, int]  # (size in bytes, CRC-32)


def file_entry(path: Path) -> FileEntry:
    """What the manifest records of one file: its size and CRC-32."""
    return Path(path).stat().st_size, file_crc32(path)


def manifest_from(step: int, written: list[dict[str, FileEntry]]) -> dict[str, Any]:
    """The commit manifest from each rank's own list of the files it wrote (index = rank).

    A file claimed by two ranks is an error: two writers of one name would race.
    """
    files: dict[str, int] = {}
    crcs: dict[str, int] = {}
    writers: dict[str, int] = {}
    for rank, entries in enumerate(written):
        for name, (size, crc) in entries.items():
            if name in writers:
                raise CheckpointError(
                    f"checkpoint step {step}: {name} written by rank {writers[name]} and rank {rank}"
                )
            files[name], crcs[name], writers[name] = size, crc, rank
    order = sorted(files)
    return {
        "step": step,
        "files": {n: files[n] for n in order},
        "crc32": {n: crcs[n] for n in order},
        "writers": {n: writers[n] for n in order},
    }


def manifest_of(directory: Path, step: int) -> dict[str, Any]:
    """The commit manifest of every file in ``directory`` (one writer: rank 0)."""
    files = sorted(p for p in Path(directory).iterdir() if p.is_file())
    return manifest_from(step, [{f.name: file_entry(f) for f in files}])


def is_complete(ckpt: Path) -> bool:
    return (Path(ckpt) / COMMIT_FILE).is_file()


def read_commit(ckpt: Path) -> dict[str, Any]:
    """The commit marker's contents; a clear error when it is missing or unreadable."""
    marker = Path(ckpt) / COMMIT_FILE
    if not marker.is_file():
        raise CheckpointError(f"{ckpt}: not a complete checkpoint (no {COMMIT_FILE})")
    try:
        return json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{marker}: unreadable commit marker: {e}") from None


def manifest_names(ckpt: Path) -> list[str]:
    """The files the commit marker lists, sorted."""
    return sorted(read_commit(ckpt).get("files", {}))


def verify_manifest(ckpt: Path, names: list[str] | None = None, crc: bool = True) -> None:
    """Every file listed in the commit marker (or only ``names`` of them) exists with the size
    and, where recorded (and ``crc``), the CRC-32 it had at commit. Reads nothing but the
    bytes; ``crc=False`` reads none of them."""
    commit = read_commit(ckpt)
    sizes, crcs = commit.get("files", {}), commit.get("crc32", {})
    for name in sizes if names is None else names:
        f = Path(ckpt) / name
        if not f.is_file():
            raise CheckpointError(f"{f}: file listed in {COMMIT_FILE} is missing")
        if f.stat().st_size != sizes[name]:
            raise CheckpointError(
                f"{f}: size {f.stat().st_size} != {sizes[name]} recorded at commit (truncated "
                "or overwritten)"
            )
        if crc and name in crcs and file_crc32(f) != crcs[name]:
            raise CheckpointError(
                f"{f}: contents changed since the commit (CRC-32 {file_crc32(f):08x} != "
                f"{crcs[name]:08x} recorded in {COMMIT_FILE})"
            )


def safe_torch_load(path: str | Path, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` with errors that name the file; ``mmap``: its tensors
    map the file (each read where it is first touched) instead of being read whole.

    Refuses pickles that would run code (anything beyond tensors and plain containers), and
    reports truncated or corrupt files instead of a deep torch traceback.
    """
    import pickle

    import torch

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint file is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: refused to load: it holds objects other than tensors and plain "
            f"containers (weights_only=True): {str(e).splitlines()[0]}"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: corrupt or truncated checkpoint file: {e}") from None
