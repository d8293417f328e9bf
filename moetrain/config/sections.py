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
from moetrain.config.layer_plan import LayerSpec, layer_plan
from moetrain.config.mixers import MIXER_KINDS
from moetrain.config.mixture import SourceConfig, SourceFormat, validate_sources
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.ranges import above, at_least, between, check_tree_ranges


@dataclass
class DataConfig:
    """Corpus, tokenizer and token shards."""

    source: str = "builtin:stdlib"  # builtin:stdlib | local file/glob | hf:NAME[:CONFIG]
    source_format: SourceFormat | None = None  # inferred from the extension when unset
    text_field: str = "text"
    split: str = "train"  # split of a Hub dataset
    streaming: bool = False
    output_dir: str = "data/stdlib"  # tokenizer + shards are written here
    tokenizer_model: str | None = None  # reuse this SentencePiece .model instead of training
    # or any existing tokenizer: a Hugging Face tokenizer directory / tokenizer.json (a model's
    # own tokenizer), or a SentencePiece .model; its vocabulary may be smaller than the model's
    tokenizer: str | None = None
    # documents sampled to train the tokenizer
    tokenizer_sample_docs: int = field(default=200_000, metadata=at_least(1))
    # tokenizer worker processes; 0 = all CPU cores
    num_proc: int = field(default=0, metadata=at_least(0, "0 = all cores"))
    seq_len: int = field(default=256, metadata=at_least(1))
    val_fraction: float = field(default=0.01, metadata=between(0, 1, high_open=True))
    shard_tokens: int = field(default=50_000_000, metadata=at_least(1))  # tokens per shard file
    document_mask: bool = False  # restrict attention to one document inside packed sequences
    # cap on documents read (quick experiments)
    max_docs: int | None = field(default=None, metadata=at_least(1))
    # a mixture instead of data.source: sources with weights (moetrain/config/mixture.py); the
    # settings above are the defaults of every entry
    sources: list[SourceConfig] = field(default_factory=list)
    sources_dir: str | None = None  # the sources' shard sets; default: sources/ beside output_dir
    # the most text per tokenizing task of `moetrain prepare` (MB)
    prepare_chunk_mb: float = field(default=16.0, metadata=above(0))

    @property
    def tokenizer_source(self) -> tuple[str, str] | None:
        """``(dotted key, path)`` of the existing tokenizer to use, None to train one."""
        if self.tokenizer:
            return "data.tokenizer", self.tokenizer
        if self.tokenizer_model:
            return "data.tokenizer_model", self.tokenizer_model
        return None

    def validate(self) -> None:
        require(
            not (self.tokenizer and self.tokenizer_model),
            "data.tokenizer",
            "set data.tokenizer or data.tokenizer_model, not both",
        )
        validate_sources(self.sources, self.source, DataConfig.source)


GPU_BUCKET_ELEMENTS = 50_000_000
CPU_BUCKET_ELEMENTS = 2_000_000


@dataclass
class ParallelConfig:
    """Process layout and DeepSpeed engine settings."""

    ep_size: int = field(default=1, metadata=at_least(1))
    # sequence parallelism (Ulysses): each rank of a group of sp_size consecutive ranks holds
    # seq_len / sp_size consecutive tokens of the same sequences; each token mixer exchanges
    # heads for sequence (an all-to-all) so each rank mixes whole sequences for 1 / sp_size of
    # its heads (attention: n_heads / sp_size; moetrain/parallel/sequence_parallel.py)
    sp_size: int = field(default=1, metadata=at_least(1))
    # 3: weights partitioned too (dense over every rank, each expert over its expert-data-
    # parallel group), gathered module by module for forward and backward
    zero_stage: int = field(default=2, metadata=between(0, 3))
    activation_checkpointing: bool = False
    offload_optimizer: bool = False
    # ZeRO-1/2/3: reduce gradient buckets while backward continues, and at ZeRO-3 gather the
    # next modules' weights while this one computes (DeepSpeed overlap_comm); None = on with
    # CUDA, off on CPU
    overlap_comm: bool | None = None
    # ZeRO-1/2 reduce and all-gather bucket, in elements; None = 50M with CUDA, 2M on CPU
    # (DeepSpeed allocates the reduce bucket afresh every micro-step: small on CPU saves RSS)
    bucket_elements: int | None = field(default=None, metadata=above(0))
    # expert parallelism: per MoE layer and forward, replicate up to this many of the most
    # loaded experts onto every EP rank, each rank computing its own tokens' copies of them
    # (the owner's weights broadcast, their gradients summed back); 0 = off; dropless only
    shadow_experts: int = field(default=0, metadata=at_least(0, "0 = off"))
    timeout_minutes: float = field(default=30.0, metadata=above(0))
    # ZeRO-3 (parallel/zero3.py, docs/CONFIG.md): elements of the coming modules' weights
    # gathered ahead of their use (DeepSpeed stage3_prefetch_bucket_size); None = bucket_size
    zero3_prefetch_elements: int | None = field(default=None, metadata=at_least(0))
    # weights of at most this many elements are not partitioned (every rank keeps them whole,
    # no gather): DeepSpeed stage3_param_persistence_threshold
    zero3_persistence_elements: int = field(default=100_000, metadata=at_least(0))
    # the most gathered weight elements alive at once (stage3_max_live_parameters)
    zero3_max_live_elements: int = field(default=1_000_000_000, metadata=above(0))
    # a gathered weight used again within this many elements of other gathers stays gathered
    # (stage3_max_reuse_distance)
    zero3_max_reuse_elements: int = field(default=1_000_000_000, metadata=at_least(0))

    def bucket_size(self, cuda: bool) -> int:
        """ZeRO-1/2 reduce / all-gather bucket in elements: ``bucket_elements``, else 50M with
        CUDA (few large collectives) or 2M on CPU. DeepSpeed allocates the reduce bucket afresh
        every micro-step; on CPU a 200 MB one goes through mmap and page-faults each step, while
        8 MB stays in the allocator's heap (less peak RSS per rank, no slower)."""
        if self.bucket_elements is not None:
            return self.bucket_elements
        return GPU_BUCKET_ELEMENTS if cuda else CPU_BUCKET_ELEMENTS


MUON_MATRIX_KINDS = Literal[
    "embedding",
    "lm_head",
    "router",
    "shared_gate",
    "attention",
    "experts",
    "mtp_projection",
    "ffn",
]


@dataclass
class MuonConfig:
    """Muon's settings (``optim.name: muon``, moetrain/optim/muon.py): the update of the matrices;
    every other parameter takes AdamW with the ``optim`` settings, and so do the kinds of matrix
    listed in ``adamw_matrices``."""

    momentum: float = field(default=0.95, metadata=between(0, 1, high_open=True))
    nesterov: bool = True
    ns_steps: int = field(default=5, metadata=between(1, 20))  # Newton-Schulz iterations
    # each matrix's orthogonalised update times update_scale * sqrt(max(rows, cols)) (Moonlight):
    # an RMS of about update_scale, as AdamW's, so optim.lr and optim.weight_decay carry over
    update_scale: float = field(default=0.2, metadata=above(0))
    # the kinds of matrix that take AdamW instead (moetrain/optim/kinds.py)
    adamw_matrices: list[MUON_MATRIX_KINDS] = field(
        default_factory=lambda: ["embedding", "lm_head", "router", "shared_gate"]
    )
    # MuonClip (Kimi K2's QK-clip): after each step, a head whose largest pre-softmax logit
    # exceeded this has its query and key weights rescaled to bring it back; 0 = off (K2: 100)
    qk_clip: float = field(default=0.0, metadata=at_least(0, "0 = off"))


@dataclass
class OptimConfig:
    """The optimizer (``name``: moetrain/optim/registry.py) and the learning-rate schedule."""

    name: Literal["adamw", "muon"] = "adamw"
    lr: float = field(default=3e-4, metadata=above(0))
    min_lr_ratio: float = field(default=0.1, metadata=between(0, 1))
    weight_decay: float = field(default=0.1, metadata=at_least(0))
    beta1: float = field(default=0.9, metadata=between(0, 1, high_open=True))
    beta2: float = field(default=0.95, metadata=between(0, 1, high_open=True))
    eps: float = field(default=1e-8, metadata=above(0))
    grad_clip: float = field(default=1.0, metadata=at_least(0, "0 disables clipping"))
    schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    warmup_steps: int = field(default=10, metadata=at_least(0))
    # if set, overrides warmup_steps
    warmup_tokens: int | None = field(default=None, metadata=at_least(0))
    # WSD: fraction of training spent decaying
    decay_fraction: float = field(default=0.2, metadata=between(0, 1, low_open=True))
    decay_embeddings: bool = False  # apply weight decay to embeddings
    muon: MuonConfig = field(default_factory=MuonConfig)


@dataclass
class TrainConfig:
    """The training loop."""

    max_steps: int = field(default=200, metadata=at_least(1))
    # if set, max_steps = max_tokens // tokens per step
    max_tokens: int | None = field(default=None, metadata=at_least(1))
    micro_batch_size: int = field(default=4, metadata=at_least(1))
    grad_accum_steps: int = field(default=1, metadata=at_least(1))
    # sequences per optimizer step; checked if set
    global_batch_size: int | None = field(default=None, metadata=at_least(1))
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # gradient accumulation over micro-batches and data-parallel reduction: fp32 (default), or
    # under bf16/fp16 the weights' dtype (half the gradient memory and reduce traffic, but each
    # sum keeps only 8 (bf16) or 11 (fp16) significant bits)
    grad_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    eval_every: int = field(default=50, metadata=at_least(0, "0 disables evaluation"))
    eval_steps: int = field(default=10, metadata=at_least(1))  # validation batches per evaluation
    # stop after this many skipped (non-finite) steps in a row
    max_nonfinite_in_a_row: int = field(default=5, metadata=at_least(1))
    log_every: int = field(default=10, metadata=at_least(1))
    # torch.set_num_threads on CPU
    threads_per_rank: int | None = field(default=None, metadata=at_least(1))
    # CPU training on Linux/glibc (train/host_allocator.py): keep = one malloc arena for every
    # thread and, after the first step, freed memory kept on the heap (no page faults per step;
    # the run's lasting buffers mapped apart); one_arena = the arena only (a little less memory,
    # slower); system = glibc's defaults
    host_allocator: Literal["keep", "one_arena", "system"] = "keep"
    # fp32 matrix multiplies on CPU (model/cpu_matmul.py): onednn = oneDNN's kernels, which use
    # AVX-512 where the CPU has it (torch's MKL runs AVX2 kernels on AMD CPUs); torch = torch's
    # own; auto = onednn on an AVX-512 CPU, torch elsewhere (oneDNN is slower on AVX2)
    cpu_matmul: Literal["auto", "onednn", "torch"] = "auto"

    def validate(self) -> None:
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

    save_every_steps: int = field(default=100, metadata=at_least(0, "0 disables"))
    save_every_minutes: float = field(default=0.0, metadata=at_least(0, "0 disables"))
    keep_last: int = field(default=3, metadata=at_least(1))
    resume: str = "auto"  # auto | none | PATH
    # start from these weights (fresh optimizer, schedule and data position) unless run_dir
    # already has a complete checkpoint to resume: a Hugging Face model directory (an MoE
    # family, or a dense one to upcycle with the moe settings), a moetrain checkpoint or a run
    # dir; the model shape comes from it
    init_from: str | None = None
    # upcycling a dense model: the dense FFN is cut into this many slices per virtual group of
    # experts (1 = every expert a copy of the whole FFN)
    upcycle_granularity: int = field(default=1, metadata=at_least(1))
    # upcycled experts' weights times (1 + noise * N(0, 1))
    upcycle_noise: float = field(default=0.0, metadata=at_least(0))

    def validate(self) -> None:
        require(self.init_from != "", "checkpoint.init_from", "must be a path or null")


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
    # the expert-load heatmap every this many steps; 0 = never
    heatmap_every: int = field(default=100, metadata=at_least(0, "0 = never"))
    # override the device peak used for MFU
    peak_tflops: float | None = field(default=None, metadata=above(0))


@dataclass
class Config:
    """The whole run."""

    run_dir: str = "runs/default"
    seed: int = field(default=1234, metadata=between(0, 2**63 - 1))
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def layer_plan(self) -> tuple[LayerSpec, ...]:
        """Every block's mixer and FFN (:func:`moetrain.config.layer_plan.layer_plan`)."""
        return layer_plan(self.model, self.moe)

    def _validate_layer_plan(self) -> None:
        """The plan's rules between the sections: one FFN entry per decoder layer, and no block
        without both a mixer and an FFN."""
        ffns, n = self.moe.layer_ffns, self.model.n_layers
        require(
            ffns is None or len(ffns) == n,
            "moe.layer_ffns",
            f"must list model.n_layers={n} FFN kinds; got {ffns!r}",
        )
        empty = [s.index for s in self.layer_plan() if s.mixer is None and s.ffn == "none"]
        require(
            not empty,
            "model.layer_types",
            f"layers {empty} have neither a mixer nor an FFN (moe.layer_ffns)",
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def validate(self) -> None:
        """Every key's declared range (:mod:`moetrain.config.ranges`), every section's own checks, the rules between sections, and the layout rules that
        need no world size (:func:`moetrain.config.layout.check_layout`)."""
        from moetrain.config.layout import check_layout

        check_tree_ranges(self)
        for section in (self.model, self.moe, self.data, self.train, self.checkpoint):
            section.validate()
        require(
            self.moe.first_k_dense <= self.model.n_layers,
            "moe.first_k_dense",
            f"must be between 0 and model.n_layers={self.model.n_layers}",
        )
        self._validate_layer_plan()
        require(
            self.model.ffn_activation != "clamped_swiglu" or self.moe.swiglu_clamp() is not None,
            "model.ffn_activation",
            "clamped_swiglu takes its constants from moe.swiglu_alpha and moe.swiglu_limit: "
            "set them (with moe.activation=clamped_swiglu)",
        )
        hashed = self.moe.hash_layers or []
        require(
            all(self.moe.is_moe_layer(i) for i in hashed)
            and all(0 <= i < self.model.n_layers for i in hashed)
            and len(set(hashed)) == len(hashed),
            "moe.hash_layers",
            f"must list distinct MoE layers (below model.n_layers={self.model.n_layers}); "
            f"got {hashed}",
        )
        require(
            not self.moe.dense_branch
            or all(
                self.model.norm_placement(layer.index) == "sandwich"
                for layer in self.layer_plan()
                if layer.ffn == "moe"
            ),
            "moe.dense_branch",
            "normalises the dense and the expert outputs before their sum: needs "
            "model.block_norms=sandwich on the MoE layers",
        )
        self._check_shortcut()
        self._check_documents()
        require(
            self.data.seq_len <= self.model.max_seq_len,
            "data.seq_len",
            f"must be <= model.max_seq_len={self.model.max_seq_len}; got {self.data.seq_len}",
        )
        self._check_qk_clip()
        require(
            self.optim.name != "muon" or self.parallel.zero_stage < 3,
            "optim.name",
            "muon orthogonalises whole matrices, which it finds in ZeRO-1/2 partitions only; "
            "ZeRO-3's are not read yet: use parallel.zero_stage 0, 1 or 2 with muon",
        )
        require(
            self.optim.name != "muon" or self.moe.gated,
            "moe.activation",
            "muon orthogonalises each expert's gate and up projection apart, and relu2 experts "
            "have one projection: not with optim.name=muon yet",
        )
        check_layout(self)

    def _check_documents(self) -> None:
        """Packed documents kept apart only where every mixer kind in use can."""
        if not self.data.document_mask:
            return
        for name in {s.mixer.kind for s in self.layer_plan() if s.mixer is not None}:
            why = MIXER_KINDS[name].documents_refused(self.model)
            require(why is None, "data.document_mask", str(why))

    def _check_shortcut(self) -> None:
        """A shortcut MoE's output joins the next block, a dense one: the layers pair up."""
        if not self.moe.shortcut:
            return
        n = self.model.n_layers
        pairs = ["moe", "dense"] * (n // 2)
        require(
            self.moe.layer_ffns == pairs and n % 2 == 0,
            "moe.shortcut",
            f"needs moe.layer_ffns alternating moe, dense over model.n_layers={n} (an even "
            f"number; the experts' output joins the next, dense block); got "
            f"{self.moe.layer_ffns!r}",
        )
        for key, bad in (
            ("moe.dense_branch", self.moe.dense_branch),
            ("model.mtp_depth", self.model.mtp_depth > 0),
            ("model.hc_streams", self.model.hc_streams > 1),
        ):
            require(not bad, key, "does not apply with moe.shortcut")

    def _check_qk_clip(self) -> None:
        """QK-clip rescales query and key projections: a norm after them would undo it."""
        if self.optim.muon.qk_clip <= 0:
            return
        require(
            self.optim.name == "muon",
            "optim.muon.qk_clip",
            f"is MuonClip's, for optim.name=muon; got optim.name={self.optim.name}",
        )
        for key, on in (
            ("model.qk_norm", self.model.qk_norm),
            ("model.qk_norm_after_rope", self.model.qk_norm_after_rope),
        ):
            require(
                not on,
                "optim.muon.qk_clip",
                f"cannot bound the logits with {key}=true (the norm undoes a rescaled "
                "projection; the norm itself bounds them): set one of the two",
            )
        require(
            self.model.index_topk is None,
            "optim.muon.qk_clip",
            "cannot bound the logits with sparse attention (model.index_topk): its layers do "
            "not track their largest attention logit yet; set optim.muon.qk_clip=0",
        )
