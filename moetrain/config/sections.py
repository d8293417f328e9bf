"""The config tree: one dataclass per section, each validating its own values.

Every error names the dotted key (``moe.top_k``) and says what is allowed. Rules that involve
two sections live in :meth:`Config.validate`; the world / expert-parallel / ZeRO layout rules
belong to :mod:`moetrain.config.layout`, which it calls.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from moetrain.config.checks import require
from moetrain.config.mixture import SourceConfig, validate_sources
from moetrain.config.model import ModelConfig, MoEConfig


@dataclass
class DataConfig:
    """Corpus, tokenizer and token shards."""

    source: str = "builtin:stdlib"  # builtin:stdlib | local file/glob | hf:NAME[:CONFIG]
    source_format: str | None = None  # text|json|parquet|csv; inferred from the extension
    text_field: str = "text"
    split: str = "train"  # split of a Hub dataset
    streaming: bool = False
    output_dir: str = "data/stdlib"  # tokenizer + shards are written here
    tokenizer_model: str | None = None  # reuse this SentencePiece .model instead of training
    # or any existing tokenizer: a Hugging Face tokenizer directory / tokenizer.json (a model's
    # own tokenizer), or a SentencePiece .model; its vocabulary may be smaller than the model's
    tokenizer: str | None = None
    tokenizer_sample_docs: int = 200_000  # documents sampled to train the tokenizer
    num_proc: int = 0  # tokenizer worker processes; 0 = all CPU cores
    seq_len: int = 256
    val_fraction: float = 0.01
    shard_tokens: int = 50_000_000  # tokens per shard file
    document_mask: bool = False  # restrict attention to one document inside packed sequences
    max_docs: int | None = None  # cap on documents read (quick experiments)
    # a mixture instead of data.source: sources with weights (moetrain/config/mixture.py); the
    # settings above are the defaults of every entry
    sources: list[SourceConfig] = field(default_factory=list)
    sources_dir: str | None = None  # the sources' shard sets; default: sources/ beside output_dir
    prepare_chunk_mb: float = 16.0  # the most text per tokenizing task of `moetrain prepare` (MB)

    @property
    def tokenizer_source(self) -> tuple[str, str] | None:
        """``(dotted key, path)`` of the existing tokenizer to use, None to train one."""
        if self.tokenizer:
            return "data.tokenizer", self.tokenizer
        if self.tokenizer_model:
            return "data.tokenizer_model", self.tokenizer_model
        return None

    def validate(self) -> None:
        require(self.seq_len > 0, "data.seq_len", "must be a positive integer")
        require(0 <= self.val_fraction < 1, "data.val_fraction", "must be in [0, 1)")
        require(self.num_proc >= 0, "data.num_proc", "must be >= 0 (0 = all cores)")
        require(self.shard_tokens > 0, "data.shard_tokens", "must be > 0")
        require(self.tokenizer_sample_docs > 0, "data.tokenizer_sample_docs", "must be > 0")
        require(self.max_docs is None or self.max_docs > 0, "data.max_docs", "must be > 0 or null")
        require(
            not (self.tokenizer and self.tokenizer_model),
            "data.tokenizer",
            "set data.tokenizer or data.tokenizer_model, not both",
        )
        if self.source_format is not None:
            allowed = ("text", "json", "parquet", "csv")
            require(
                self.source_format in allowed, "data.source_format", f"must be one of {allowed}"
            )
        require(self.prepare_chunk_mb > 0, "data.prepare_chunk_mb", "must be > 0")
        validate_sources(self.sources, self.source, DataConfig.source)


GPU_BUCKET_ELEMENTS = 50_000_000
CPU_BUCKET_ELEMENTS = 2_000_000


@dataclass
class ParallelConfig:
    """Process layout and DeepSpeed engine settings."""

    ep_size: int = 1
    zero_stage: int = 2
    activation_checkpointing: bool = False
    offload_optimizer: bool = False
    # ZeRO-1/2: reduce gradient buckets while backward continues (DeepSpeed overlap_comm);
    # None = on with CUDA, off on CPU
    overlap_comm: bool | None = None
    # ZeRO-1/2 reduce and all-gather bucket, in elements; None = 50M with CUDA, 2M on CPU
    # (DeepSpeed allocates the reduce bucket afresh every micro-step: small on CPU saves RSS)
    bucket_elements: int | None = None
    # expert parallelism: per MoE layer and forward, replicate up to this many of the most
    # loaded experts onto every EP rank, each rank computing its own tokens' copies of them
    # (the owner's weights broadcast, their gradients summed back); 0 = off; dropless only
    shadow_experts: int = 0
    timeout_minutes: float = 30.0

    def bucket_size(self, cuda: bool) -> int:
        """ZeRO-1/2 reduce / all-gather bucket in elements: ``bucket_elements``, else 50M with
        CUDA (few large collectives) or 2M on CPU. DeepSpeed allocates the reduce bucket afresh
        every micro-step; on CPU a 200 MB one goes through mmap and page-faults each step, while
        8 MB stays in the allocator's heap (less peak RSS per rank, no slower)."""
        if self.bucket_elements is not None:
            return self.bucket_elements
        return GPU_BUCKET_ELEMENTS if cuda else CPU_BUCKET_ELEMENTS

    def validate(self) -> None:
        require(self.ep_size >= 1, "parallel.ep_size", "must be >= 1")
        require(
            self.bucket_elements is None or self.bucket_elements > 0,
            "parallel.bucket_elements",
            f"must be > 0 (or null for the default); got {self.bucket_elements}",
        )
        require(self.shadow_experts >= 0, "parallel.shadow_experts", "must be >= 0 (0 = off)")
        require(self.timeout_minutes > 0, "parallel.timeout_minutes", "must be > 0")


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule."""

    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    warmup_steps: int = 10
    warmup_tokens: int | None = None  # if set, overrides warmup_steps
    decay_fraction: float = 0.2  # WSD: fraction of training spent decaying
    decay_embeddings: bool = False  # apply weight decay to embeddings

    def validate(self) -> None:
        require(self.lr > 0, "optim.lr", "must be > 0")
        require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
        require(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        require(0 <= self.beta1 < 1, "optim.beta1", "must be in [0, 1)")
        require(0 <= self.beta2 < 1, "optim.beta2", "must be in [0, 1)")
        require(self.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 disables)")
        require(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        require(0 < self.decay_fraction <= 1, "optim.decay_fraction", "must be in (0, 1]")


@dataclass
class TrainConfig:
    """The training loop."""

    max_steps: int = 200
    max_tokens: int | None = None  # if set, max_steps = max_tokens // tokens per step
    micro_batch_size: int = 4
    grad_accum_steps: int = 1
    global_batch_size: int | None = None  # sequences per optimizer step; checked if set
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # gradient accumulation over micro-batches and data-parallel reduction: fp32 (default), or
    # under bf16/fp16 the weights' dtype (half the gradient memory and reduce traffic, but each
    # sum keeps only 8 (bf16) or 11 (fp16) significant bits)
    grad_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    eval_every: int = 50
    eval_steps: int = 10
    log_every: int = 10
    max_nonfinite_in_a_row: int = 5
    threads_per_rank: int | None = None  # torch.set_num_threads on CPU
    # CPU training on Linux/glibc (train/host_allocator.py): keep = one malloc arena for every
    # thread and freed memory kept on the heap (no page faults per step); one_arena = the arena
    # only (a little less memory, slower); system = glibc's defaults
    host_allocator: Literal["keep", "one_arena", "system"] = "keep"
    # fp32 matrix multiplies on CPU (model/cpu_matmul.py): onednn = oneDNN's kernels, which use
    # AVX-512 where the CPU has it (torch's MKL runs AVX2 kernels on AMD CPUs); torch = torch's own
    cpu_matmul: Literal["onednn", "torch"] = "onednn"

    def validate(self) -> None:
        require(self.max_steps >= 1, "train.max_steps", "must be >= 1")
        require(self.micro_batch_size >= 1, "train.micro_batch_size", "must be >= 1")
        require(self.grad_accum_steps >= 1, "train.grad_accum_steps", "must be >= 1")
        require(self.eval_every >= 0, "train.eval_every", "must be >= 0 (0 disables)")
        require(self.log_every >= 1, "train.log_every", "must be >= 1")
        allowed = ("fp32",) if self.precision == "fp32" else ("fp32", self.precision)
        require(
            self.grad_dtype in allowed,
            "train.grad_dtype",
            f"must be one of {allowed} with train.precision={self.precision}; got "
            f"{self.grad_dtype}",
        )


@dataclass
class CheckpointConfig:
    """Sharded checkpoints and resume."""

    save_every_steps: int = 100
    save_every_minutes: float = 0.0
    keep_last: int = 3
    resume: str = "auto"  # auto | none | PATH
    # start from these weights (fresh optimizer, schedule and data position) unless run_dir
    # already has a complete checkpoint to resume: a Hugging Face model directory (an MoE
    # family, or a dense one to upcycle with the moe settings), a moetrain checkpoint or a run
    # dir; the model shape comes from it
    init_from: str | None = None
    # upcycling a dense model: the dense FFN is cut into this many slices per virtual group of
    # experts (1 = every expert a copy of the whole FFN)
    upcycle_granularity: int = 1
    upcycle_noise: float = 0.0  # upcycled experts' weights times (1 + noise * N(0, 1))

    def validate(self) -> None:
        require(
            self.save_every_steps >= 0, "checkpoint.save_every_steps", "must be >= 0 (0 disables)"
        )
        require(self.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")
        require(self.init_from != "", "checkpoint.init_from", "must be a path or null")
        require(self.upcycle_granularity >= 1, "checkpoint.upcycle_granularity", "must be >= 1")
        require(self.upcycle_noise >= 0, "checkpoint.upcycle_noise", "must be >= 0")


@dataclass
class WandbConfig:
    mode: Literal["online", "offline", "disabled"] = "disabled"
    project: str = "moetrain"
    entity: str | None = None
    name: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    respect_env_mode: bool = True  # an explicit WANDB_MODE in the environment wins


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    heatmap_every: int = 100
    peak_tflops: float | None = None  # override the device peak used for MFU


@dataclass
class Config:
    """The whole run."""

    run_dir: str = "runs/default"
    seed: int = 1234
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def validate(self) -> None:
        """Every section's own checks, the rules between sections, and the layout rules that
        need no world size (:func:`moetrain.config.layout.check_layout`)."""
        from moetrain.config.layout import check_layout

        for section in (self.model, self.moe, self.data, self.parallel, self.optim, self.train):
            section.validate()
        self.checkpoint.validate()
        require(
            self.moe.first_k_dense <= self.model.n_layers,
            "moe.first_k_dense",
            f"must be between 0 and model.n_layers={self.model.n_layers}",
        )
        require(
            self.data.seq_len <= self.model.max_seq_len,
            "data.seq_len",
            f"must be <= model.max_seq_len={self.model.max_seq_len}; got {self.data.seq_len}",
        )
        check_layout(self)
