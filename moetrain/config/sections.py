"""The config tree: one dataclass per section, each validating its own values.

Every error names the dotted key (``moe.top_k``) and says what is allowed. Rules that involve
two sections live in :meth:`Config.validate`; the world / expert-parallel / ZeRO layout rules
belong to :mod:`moetrain.parallel.layout`, which it calls.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from moetrain.config.mixture import SourceConfig, validate_sources


class ConfigError(ValueError):
    """A configuration problem; the message names the dotted key."""


def require(cond: bool, key: str, msg: str) -> None:
    """Raise ``ConfigError("<key>: <msg>")`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def _positive(section: object, prefix: str, *keys: str) -> None:
    for key in keys:
        require(getattr(section, key) > 0, f"{prefix}.{key}", "must be a positive integer")


@dataclass
class ModelConfig:
    """Dense transformer shape."""

    vocab_size: int = 8192
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int | None = None  # default d_model // n_heads
    dense_hidden: int = 1024  # SwiGLU hidden size of dense (non-MoE) FFN layers
    max_seq_len: int = 2048  # RoPE table size and HF max_position_embeddings
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm: bool = False  # RMSNorm on queries and keys (Qwen3-MoE, GLM-4-MoE, OLMoE)
    # what that norm normalises: "head" (each head's vector; Qwen3-MoE, GLM-4-MoE) or
    # "projection" (the whole query / key projection, all heads together; OLMoE)
    qk_norm_scope: Literal["head", "projection"] = "head"
    qkv_bias: bool = False  # biases on the query / key / value projections (Qwen2, Qwen2-MoE)
    tie_embeddings: bool = False
    init_std: float = 0.02
    # training loss: cross-entropy over chunks of this many tokens, never the full fp32 logits;
    # 0 = plain full-logits cross-entropy
    loss_chunk_tokens: int = 1024

    @property
    def attention_head_dim(self) -> int:
        """``head_dim``, or ``d_model // n_heads`` when it is not set."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    def validate(self) -> None:
        _positive(self, "model", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads")
        _positive(self, "model", "max_seq_len", "dense_hidden")
        if self.head_dim is None:
            require(
                self.d_model % self.n_heads == 0,
                "model.n_heads",
                f"must divide model.d_model={self.d_model} (or set model.head_dim); "
                f"got {self.n_heads}",
            )
        else:
            require(self.head_dim > 0, "model.head_dim", "must be a positive integer")
        require(
            self.attention_head_dim % 2 == 0,
            "model.head_dim",
            f"must be even for rotary embeddings; got {self.attention_head_dim}",
        )
        require(
            self.n_heads % self.n_kv_heads == 0,
            "model.n_kv_heads",
            f"must divide model.n_heads={self.n_heads}; got {self.n_kv_heads}",
        )
        require(self.rope_theta > 0, "model.rope_theta", "must be > 0")
        require(self.norm_eps > 0, "model.norm_eps", "must be > 0")
        require(self.init_std > 0, "model.init_std", "must be > 0")
        require(
            self.loss_chunk_tokens >= 0,
            "model.loss_chunk_tokens",
            f"must be >= 0 (0 = full logits); got {self.loss_chunk_tokens}",
        )


@dataclass
class MoEConfig:
    """Mixture-of-Experts FFN: routing, balancing, capacity, placement."""

    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 512
    moe_every: int = 1  # every n-th layer (after first_k_dense) is MoE
    first_k_dense: int = 0  # the first k layers use a dense FFN
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    topk_before_score: bool = False  # True: top-k on logits, then softmax over the k
    renormalize: bool = True  # renormalise the top-k weights to sum to 1
    route_scale: float = 1.0  # multiply combine weights (DeepSeek-V3 style)
    jitter: float = 0.0  # multiplicative uniform noise on router input, training only
    aux_loss_coef: float = 0.01  # Switch/GShard load-balancing loss; 0 disables
    z_loss_coef: float = 0.001  # ST-MoE router z-loss; 0 disables
    bias_update_rate: float = 0.0  # DeepSeek-V3 aux-loss-free balancing; 0 disables
    # which tokens the load-balancing loss's expert fractions come from: micro_batch (this
    # rank's micro-batch), global_micro_batch (every rank's micro-batch of this micro-step),
    # sequence (each sequence on its own, DeepSeek-V3), global_batch (every rank's micro-batches
    # of this optimizer step so far; Megatron-Core's global_aux_loss); README "Load balancing"
    aux_loss_scope: Literal["micro_batch", "global_micro_batch", "sequence", "global_batch"] = (
        "global_micro_batch"
    )
    # 0 = dropless; else each expert keeps at most ceil(cf * T * k / E) of the copies routed to
    # it, T = the tokens of its expert-parallel group's micro-batches, lowest weight dropped first
    capacity_factor: float = 0.0
    # group-limited routing (DeepSeek-V3 / GLM-4.5 n_group, topk_group): experts in n_group
    # equal groups; each token picks its topk_group best groups (sum of each group's two best
    # scores), then its top_k experts inside them. 1 = off
    n_group: int = 1
    topk_group: int = 1
    num_shared_experts: int = 0
    shared_expert_hidden: int | None = None  # default num_shared_experts * expert_hidden
    shared_expert_gate: bool = False  # sigmoid gate on the shared expert (Qwen2-MoE style)
    # compute the shared expert while the expert-parallel all-to-alls are in flight (its
    # projections during the dispatch, its down projection during the combine; same values)
    shared_expert_overlap: bool = True
    grouped_mm: bool = True  # F.grouped_mm for experts; False = per-expert loop
    # experts recompute silu(gate) * up in backward instead of saving it (Megatron-Core's
    # moe_act recompute): 2F values kept per routed copy instead of 3F, ~3% more MoE-block time
    recompute_act: bool = False

    def is_moe_layer(self, layer: int) -> bool:
        """Placement: after ``first_k_dense`` dense layers, every ``moe_every``-th layer is MoE
        (the last of each group of ``moe_every``, as Qwen2-MoE's ``decoder_sparse_step``
        counts)."""
        if layer < self.first_k_dense:
            return False
        return (layer - self.first_k_dense + 1) % self.moe_every == 0

    def moe_layers(self, n_layers: int) -> list[int]:
        """Transformer layer indices of the MoE layers, in order (position = MoE layer index)."""
        return [i for i in range(n_layers) if self.is_moe_layer(i)]

    @property
    def shared_hidden(self) -> int:
        """Hidden size of the (single, merged) shared-expert SwiGLU."""
        return self.shared_expert_hidden or self.num_shared_experts * self.expert_hidden

    def _validate_groups(self) -> None:
        require(
            self.n_group >= 1 and self.num_experts % max(self.n_group, 1) == 0,
            "moe.n_group",
            f"must be >= 1 and divide moe.num_experts={self.num_experts}; got {self.n_group}",
        )
        require(
            1 <= self.topk_group <= self.n_group,
            "moe.topk_group",
            f"must be between 1 and moe.n_group={self.n_group}; got {self.topk_group}",
        )
        reachable = self.topk_group * (self.num_experts // self.n_group)
        require(
            self.top_k <= reachable,
            "moe.topk_group",
            f"moe.top_k={self.top_k} experts must fit in topk_group={self.topk_group} groups of "
            f"{self.num_experts // self.n_group} experts; raise it to at least "
            f"{-(-self.top_k * self.n_group // self.num_experts)}",
        )

    def validate(self) -> None:
        require(self.num_experts >= 1, "moe.num_experts", "must be >= 1")
        require(
            1 <= self.top_k <= self.num_experts,
            "moe.top_k",
            f"must be between 1 and moe.num_experts={self.num_experts}; got {self.top_k}",
        )
        require(self.expert_hidden > 0, "moe.expert_hidden", "must be a positive integer")
        require(self.moe_every >= 1, "moe.moe_every", "must be >= 1")
        require(self.first_k_dense >= 0, "moe.first_k_dense", "must be >= 0")
        require(self.aux_loss_coef >= 0, "moe.aux_loss_coef", "must be >= 0")
        require(self.z_loss_coef >= 0, "moe.z_loss_coef", "must be >= 0")
        require(self.bias_update_rate >= 0, "moe.bias_update_rate", "must be >= 0")
        require(0 <= self.jitter < 1, "moe.jitter", "must be in [0, 1)")
        require(self.route_scale > 0, "moe.route_scale", "must be > 0")
        require(self.capacity_factor >= 0, "moe.capacity_factor", "must be 0 (dropless) or > 0")
        self._validate_groups()
        require(self.num_shared_experts >= 0, "moe.num_shared_experts", "must be >= 0")
        if self.shared_expert_hidden is not None:
            require(self.shared_expert_hidden > 0, "moe.shared_expert_hidden", "must be > 0")
        require(
            not (self.topk_before_score and self.score_func == "sigmoid"),
            "moe.topk_before_score",
            "only applies to moe.score_func=softmax (sigmoid scores are per-expert)",
        )
        require(
            not (self.shared_expert_gate and self.num_shared_experts == 0),
            "moe.shared_expert_gate",
            "needs moe.num_shared_experts >= 1",
        )


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
    prepare_chunk_mb: float = 16.0  # text per tokenizing task of `moetrain prepare` (MB)

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
        need no world size (:func:`moetrain.parallel.layout.check_layout`)."""
        from moetrain.parallel.layout import check_layout

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
