"""`moetrain plan`: parameters, memory per GPU, FLOPs per token and implied speed of a layout.

Memory per GPU (bytes), with P_d dense and P_e routed-expert parameters, W = world = data-parallel
size, ep = parallel.ep_size, X = W / ep the expert-data-parallel group:

- parameters held: ``P_d + P_e / ep`` (dense replicated over W; experts split over ep, then
  replicated over X).
- weights: 4 B/param in fp32; 2 B in bf16/fp16 (the fp32 master copy belongs to the optimizer).
- gradients: accumulated in ``train.grad_dtype``: 4 B/param (fp32, the default in every
  precision), or 2 B with ``train.grad_dtype`` bf16/fp16; ZeRO-2 partitions them (dense over W,
  experts over X). Under bf16/fp16 DeepSpeed adds each micro-batch's low-precision gradient to
  the fp32 buffer as soon as it is ready (ZeRO-1) or reduces it into the fp32 partition
  (ZeRO-2), so the low-precision gradients are transient (the largest one is counted below).
- optimizer: its state (``optim.name``'s bytes per parameter, dense and expert:
  :func:`moetrain.optim.summary.state_bytes_per_param`; AdamW 8 B/param), + 4 B for the fp32
  master copy under bf16/fp16 (and under fp32 with ``parallel.offload_optimizer``; otherwise
  fp32 masters share the weights' storage,
  :mod:`moetrain.parallel.fp32_partitions`), partitioned under ZeRO-1/2 (dense over W, experts
  over X); ``parallel.offload_optimizer`` moves it to CPU.
- activations: :func:`activation_bytes_per_token` times the micro-batch tokens, plus the head
  and loss (:func:`head_bytes_per_token`, :func:`loss_transient_bytes`: full logits, or one chunk
  of them with ``model.loss_chunk_tokens``, as the trainer computes the loss) and the largest
  parameter's fresh gradient (before accumulation).
- framework: a fixed allowance (CUDA context, allocator slack, NCCL) plus DeepSpeed's reduce and
  all-gather buckets under ZeRO-1/2.
- checkpoint save, host memory (bf16/fp16): the fp32 masters of the weights a rank writes
  (:mod:`moetrain.parallel.master_weights`), at most rank 0's: ``4 * (P_d + P_e / ep)``.

Sequence parallelism (``parallel.sp_size`` = n): each GPU holds ``seq_len / n`` tokens of its
micro-batch's rows, so every per-token term counts those; attention (grouped-query) adds what
the head exchange keeps (:func:`attention_bytes_per_token`). ZeRO partitions over every GPU as
without it (the SP ranks count as data-parallel ranks), and a step's tokens are counted once.

Expert all-to-all and the head all-to-alls of sequence parallelism: :mod:`moetrain.plan_traffic`
(fan-out per token and bytes per step).

Optimizer: its state's bytes per parameter and, for Muon, its Newton-Schulz FLOPs per step
and GPU (:mod:`moetrain.optim.summary`), reported with their time at the MFU of the fp32 peak.

Speed: ``tokens/s = gpus * peak * mfu / flops_per_token``, the peak from
:data:`moetrain.monitor.mfu.PEAK_TFLOPS` for ``train.precision`` (or ``logging.peak_tflops``),
FLOPs from
:func:`moetrain.model_numbers.model_numbers` (model FLOPs: the recompute of activation checkpointing
is not counted, so the same MFU is harder to reach with it on).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moetrain.config import Config, ConfigError, ModelConfig
from moetrain.config.layout import check_layout
from moetrain.model.head_exchange import kv_repeats
from moetrain.model_numbers import ModelNumbers, attention_matrices, human, model_numbers
from moetrain.monitor.mfu import lookup_peak_tflops, math_type
from moetrain.optim.summary import (
    optimizer_flops_line,
    optimizer_step_flops,
    state_bytes_per_param,
)
from moetrain.plan_traffic import (
    HeadTraffic,
    Traffic,
    expert_traffic,
    format_head_traffic,
    format_traffic,
    head_traffic,
)

GiB = 1024**3
MiB = 1024**2


@dataclass(frozen=True)
class GPUSpec:
    """A GPU: its row in :data:`moetrain.monitor.mfu.PEAK_TFLOPS` and memory as the driver
    reports it (MiB)."""

    name: str
    table_key: str
    memory_mib: int

    def peak_tflops(self, precision: str) -> float:
        """Dense peak for ``train.precision`` (bf16/fp16 tensor cores; fp32 without tf32)."""
        value = lookup_peak_tflops(self.table_key, math_type(precision))
        if value is None:  # e.g. bf16 on a V100: its fp16 tensor peak
            value = lookup_peak_tflops(self.table_key, "fp16")
        assert value is not None, self.table_key
        return value


GPUS: dict[str, GPUSpec] = {
    "h100": GPUSpec("NVIDIA H100 SXM 80GB", "H100 SXM", 81559),
    "h100-pcie": GPUSpec("NVIDIA H100 PCIe 80GB", "H100 PCIe", 81559),
    "h200": GPUSpec("NVIDIA H200 141GB", "H200", 143771),
    "a100": GPUSpec("NVIDIA A100 80GB", "A100", 81920),
    "a100-40gb": GPUSpec("NVIDIA A100 40GB", "A100", 40960),
    "a10g": GPUSpec("NVIDIA A10G 24GB", "A10G", 23028),
    "l4": GPUSpec("NVIDIA L4 24GB", "L4", 23034),
    "l40s": GPUSpec("NVIDIA L40S 48GB", "L40S", 46068),
    "v100": GPUSpec("NVIDIA V100 SXM2 32GB", "V100 SXM2", 32768),
    "mi300x": GPUSpec("AMD Instinct MI300X 192GB", "MI300X", 196592),
    "rtx4090": GPUSpec("NVIDIA GeForce RTX 4090 24GB", "RTX 4090", 24564),
}

FRAMEWORK_BYTES = 1 * GiB  # CUDA context + cuBLAS workspace + NCCL + allocator slack


def gpu_spec(name: str) -> GPUSpec:
    """Look up a GPU by its short name (case-insensitive)."""
    key = name.lower().replace("_", "-")
    if key not in GPUS:
        raise ConfigError(f"--gpu: unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return GPUS[key]


def _dtype_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def _rmsnorm_bytes(d: int, a: int) -> int:
    """RMSNorm saves its input (in dtype) and the fp32 rsqrt of each row."""
    return a * d + 4


def attention_bytes_per_token(m: ModelConfig, a: int, sp: int = 1) -> int:
    """Bytes one layer's attention (and its input norm) saves for backward per token
    (a = activation bytes) of this GPU's slice. Grouped-query: see
    :func:`activation_bytes_per_token`; under sequence parallelism (``sp`` > 1) also the
    output exchanged back to sequence order (the output projection's input, ``aHq``), and the
    extra copies of key/value heads repeated so that they split over ``sp`` ranks
    (``2aHkv(r - 1)``, r = :func:`moetrain.model.head_exchange.kv_repeats`); both measured with
    saved-tensor hooks.

    Multi-head latent attention: the RMSNorm ``aD + 4``, the projection input ``aD``, with
    ``q_lora_rank`` Q the query latent ``aQ + 4`` and its norm's output ``aQ``; the ``wkv_a``
    output ``a(C + R) + 4`` (its latent normalised), the normalised latent ``aC``, the ``wkv_b``
    output ``aH(N + Vd)`` (the values are a view of it), the assembled q and k ``2aH(N + R)``,
    the SDPA output ``aHVd`` and logsumexp ``4H``. That is the memory-efficient kernel's
    (a GPU's); where torch's kernels want equal q/k and v head dims (CPU flash attention) the
    smaller side is zero-padded, which saves somewhat more. Under sequence parallelism the
    exchanged q, k and v take the places of the ones above, and the values are saved
    exchanged (``aHVd``) with the output in sequence order (``aHVd``) instead of the ``wkv_b``
    output: ``aH(Vd - N)`` more."""
    d, h = m.d_model, m.n_heads
    norm_in = _rmsnorm_bytes(d, a) + a * d
    if m.attention == "mla":
        qk, c = m.attention_head_dim, m.kv_lora_rank
        q_latent = 2 * a * m.q_lora_rank + 4 if m.q_lora_rank else 0
        latent = a * (c + m.qk_rope_head_dim) + 4 + a * c
        kv = a * h * (m.qk_nope_head_dim + m.v_head_dim) + 2 * a * h * qk
        exchanged = a * h * (m.v_head_dim - m.qk_nope_head_dim) if sp > 1 else 0
        return norm_in + q_latent + latent + kv + a * h * m.v_head_dim + 4 * h + exchanged
    hd = m.attention_head_dim
    hq, hkv = h * hd, m.n_kv_heads * hd
    attn = norm_in + 2 * a * hq + 2 * a * hkv + 4 * h
    if sp > 1:
        attn += a * hq + 2 * a * hkv * (kv_repeats(m.n_kv_heads, sp) - 1)
    if m.qk_norm:  # RMSNorm of q and k: their input and an rsqrt per head (or per projection)
        rows = h + m.n_kv_heads if m.qk_norm_scope == "head" else 2
        attn += a * (hq + hkv) + 4 * rows
    return attn


def activation_bytes_per_token(cfg: Config, layer: int, act_bytes: int) -> int:
    """Bytes saved for backward per token by layer ``layer`` (a = ``act_bytes``, 4 or 2).

    Counted from what moetrain's modules save (checked with saved-tensor hooks):

    - attention: RMSNorm ``aD + 4``, projection input ``aD``, RoPE'd q ``aHq``, k and v
      ``2aHkv``, SDPA (flash kernel) output ``aHq`` (also the wo input) and logsumexp ``4H``.
    - MoE FFN: RMSNorm ``aD + 4``; router input in fp32 ``4D``, logits and probabilities
      ``8E``, top-k ids, gathered and renormalised weights, z-loss logsumexp ``12K + 8``;
      permutation indices (int64) ``16K`` (token and inverse dropless, token and slot with
      capacity); per routed copy (K per token) the expert input ``aD``, the packed gate|up
      output ``2aF`` and the routing weight ``a`` the SwiGLU applies (+ the weighted SwiGLU
      product ``aF`` unless ``moe.recompute_act``); the combine keeps only indices; shared
      expert ``aD + 3aF_s`` (+ gate ``aD + a``).
    - dense FFN: RMSNorm, its output ``aD``, SwiGLU intermediates ``3aF_dense``.

    With ``capacity_factor`` < 1 only that fraction of the K copies reaches the experts.
    Expert-parallel ranks see T*K copies on average; routing imbalance raises it.
    """
    m, e = cfg.model, cfg.moe
    a, d = act_bytes, m.d_model
    attn = attention_bytes_per_token(m, a, cfg.parallel.sp_size)
    if not e.is_moe_layer(layer):
        return attn + _rmsnorm_bytes(d, a) + a * d + 3 * a * m.dense_hidden
    k = e.top_k
    kept = k * min(e.capacity_factor, 1.0) if e.capacity_factor > 0 else k
    ffn = _rmsnorm_bytes(d, a) + 4 * d + 8 * e.num_experts + 12 * k + 8 + 16 * k
    swiglu = (2 if e.recompute_act else 3) * a * e.expert_hidden
    ffn += kept * (a * d + swiglu + a)
    if e.num_shared_experts:
        fs = e.shared_expert_hidden or e.num_shared_experts * e.expert_hidden
        ffn += (a * d if a != 4 else 0) + 3 * a * fs  # fp32: input shared with the router
        if e.shared_expert_gate:
            ffn += a * d + a
    return attn + int(ffn)


def head_bytes_per_token(cfg: Config, act_bytes: int) -> int:
    """Final norm, input ids and labels (int64), then the loss: plain (``model.loss_chunk_tokens``
    = 0) the LM-head input, logits (held by the caller, dtype) and fp32 log-softmax; chunked the
    gradient wrt the LM-head input (dtype), computed in forward."""
    d, v, a = cfg.model.d_model, cfg.model.vocab_size, act_bytes
    loss = a * d if cfg.model.loss_chunk_tokens > 0 else a * d + a * v + 4 * v
    return _rmsnorm_bytes(d, a) + 16 + loss


def loss_transient_bytes(cfg: Config, tokens: int, act_bytes: int) -> int:
    """The loss's peak beyond :func:`head_bytes_per_token`, alive while every activation is.

    Plain: backward's fp32 gradients of the log-softmax output and the logits (+ the cast back
    to dtype under bf16/fp16). Chunked: the fp32 gradient wrt the LM-head weight, kept from
    forward to backward, plus the larger of one chunk in forward (fp32 logits; under bf16/fp16
    also their dtype original, then their gradient in dtype and the chunk's weight gradient) and
    backward's scaled copies (input gradient; under bf16/fp16 the fp32 weight gradient too).
    """
    d, v, a = cfg.model.d_model, cfg.model.vocab_size, act_bytes
    chunk = cfg.model.loss_chunk_tokens
    if chunk == 0:
        return tokens * (8 * v + (a * v if a != 4 else 0))
    rows = min(chunk, tokens)
    low = a != 4
    forward = max(rows * v * (4 + a), rows * v * a + a * v * d) if low else rows * v * 4
    backward = tokens * a * d + (4 * v * d if low else 0)
    return 4 * v * d + max(forward, backward)


def activation_bytes(cfg: Config, tokens: int, checkpointing: bool, act_bytes: int) -> int:
    """Peak activation bytes of one micro-batch of ``tokens`` tokens on a GPU (its slice of
    the rows under sequence parallelism).

    Without checkpointing: every layer's saved tensors + the head + the loss's transient
    (multi-token-prediction modules: their blocks are layers, their inputs and heads the head's). With
    checkpointing of every block: each block keeps only its input ``aD``; the peak is those plus
    the larger of (head + loss transient) and one block's recomputed set. Shadow experts
    (``parallel.shadow_experts`` under expert parallelism) add, per MoE layer whose saved set is
    alive, the most replicas' weights its experts keep for backward (``3aDF`` each).
    """
    m, e, n = cfg.model, cfg.moe, cfg.model.n_blocks
    layers = [activation_bytes_per_token(cfg, i, act_bytes) for i in range(n)]
    head = tokens * head_bytes_per_token(cfg, act_bytes)
    head += loss_transient_bytes(cfg, tokens, act_bytes)
    if m.mtp_depth:
        # each module: enorm and hnorm (their inputs and rsqrt), [emb | h], head_norm, then
        # its loss (chunked: the gradient wrt the head's input and an fp32 LM-head weight
        # gradient; plain: the fp32 log-softmax and the int64 targets)
        a, d, v = act_bytes, m.d_model, m.vocab_size
        chunked = m.loss_chunk_tokens > 0
        per_token = 3 * _rmsnorm_bytes(d, a) + 2 * a * d + (a * d if chunked else 4 * v + 8)
        head += m.mtp_depth * (tokens * per_token + (4 * v * d if chunked else 0))
    replicas = 0
    if cfg.parallel.ep_size > 1:
        replicas = cfg.parallel.shadow_experts * 3 * act_bytes * m.d_model * e.expert_hidden
    moe_layers = len(e.moe_layers(n))
    if not checkpointing:
        return tokens * sum(layers) + head + moe_layers * replicas
    kept = n * act_bytes * m.d_model
    return tokens * kept + max(head, tokens * max(layers, default=0) + replicas)


@dataclass
class Plan:
    """Everything ``moetrain plan`` reports; byte counts are per GPU."""

    gpu: GPUSpec
    gpus: int
    ep_size: int
    expert_dp: int
    zero_stage: int
    precision: str
    offload_optimizer: bool
    activation_checkpointing: bool
    micro_batch_size: int
    seq_len: int
    grad_accum_steps: int
    numbers: ModelNumbers
    params_per_gpu: int
    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int  # on the GPU (0 with offload)
    optimizer_cpu_bytes: int  # per rank, in host memory, with offload
    activations_bytes: int  # with the chosen checkpointing setting
    activations_no_ckpt_bytes: int
    activations_ckpt_bytes: int
    param_grad_transient_bytes: int  # the largest parameter's fresh gradient in backward
    framework_bytes: int
    save_host_bytes: int  # host memory of a checkpoint save on rank 0 (the largest)
    mfu: float
    peak_tflops: float
    traffic: Traffic
    head_traffic: HeadTraffic
    sp_size: int = 1
    gpus_per_node: int = 8
    warnings: list[str] = field(default_factory=list)
    grad_dtype: str = "fp32"  # gradient accumulation and reduction (train.grad_dtype)
    optimizer_flops: int = 0  # per GPU and step beyond the elementwise (Muon's Newton-Schulz)

    @property
    def model_state_bytes(self) -> int:
        """Weights + gradients + optimizer states on the GPU."""
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> int:
        return (
            self.model_state_bytes
            + self.activations_bytes
            + self.param_grad_transient_bytes
            + self.framework_bytes
        )

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.gpu.memory_mib * MiB

    @property
    def tokens_per_step(self) -> int:
        """Each token once: an SP group of ``sp_size`` GPUs shares its rows."""
        rows = self.micro_batch_size * self.grad_accum_steps * self.gpus // self.sp_size
        return rows * self.seq_len

    @property
    def tokens_per_s(self) -> float:
        """Whole-job tokens/s at the assumed MFU."""
        return self.gpus * self.peak_tflops * 1e12 * self.mfu / self.numbers.flops_per_token

    @property
    def step_time_s(self) -> float:
        return self.tokens_per_step / self.tokens_per_s


def _largest_param(cfg: Config, ep: int) -> int:
    m, e = cfg.model, cfg.moe
    sizes = [m.vocab_size * m.d_model, m.d_model * m.dense_hidden]
    sizes += [i * o for i, o in attention_matrices(m).values()]
    if e.moe_layers(m.n_layers):
        sizes.append(e.num_experts // ep * m.d_model * e.expert_hidden)
    return max(sizes)


def _save_copies(cfg: Config, ep: int) -> int:
    """fp32 bytes DeepSpeed 0.19 copies while rank 0 writes a save (``engine._save_checkpoint``,
    ``_save_moe_checkpoint``): the dense state dict once (``clone_tensors_for_torch_save``), one
    MoE layer's local experts at a time, and the one expert being written once more."""
    nums = model_numbers(cfg)
    dense = nums.total_params - nums.expert_params
    layers = max(1, nums.num_moe_layers)
    layer_experts = nums.expert_params // layers // ep
    one_expert = nums.expert_params // layers // max(1, cfg.moe.num_experts)
    return 4 * (dense + layer_experts + one_expert) if nums.expert_params else 4 * dense


def plan(
    cfg: Config,
    gpus: int,
    gpu: str = "h100",
    mfu: float = 0.4,
    activation_checkpointing: bool | None = None,
    gpus_per_node: int = 8,
) -> Plan:
    """Estimate memory per GPU and speed of ``cfg`` on ``gpus`` GPUs of type ``gpu``, and its
    expert all-to-all with ``gpus_per_node`` GPUs in a node.

    ``activation_checkpointing`` None takes ``cfg.parallel.activation_checkpointing``.
    Raises ConfigError (naming ``parallel.ep_size``) when the layout is invalid.
    """
    if gpus < 1:
        raise ConfigError(f"--gpus: must be >= 1; got {gpus}")
    if not 0 < mfu <= 1:
        raise ConfigError(f"--mfu: must be in (0, 1]; got {mfu}")
    if gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node: must be >= 1; got {gpus_per_node}")
    spec = gpu_spec(gpu)
    check_layout(cfg, gpus)
    p, t = cfg.parallel, cfg.train
    ckpt = (
        p.activation_checkpointing
        if activation_checkpointing is None
        else bool(activation_checkpointing)
    )
    ep, world = p.ep_size, gpus
    xdp = world // ep
    nums = model_numbers(cfg)
    dense, expert = nums.total_params - nums.expert_params, nums.expert_params // ep
    wb = _dtype_bytes(t.precision)
    z = p.zero_stage

    def split(per_param: float, partitioned: bool, expert_per_param: float | None = None) -> int:
        per_expert = per_param if expert_per_param is None else expert_per_param
        if partitioned:
            return int(per_param * dense / world + per_expert * expert / xdp)
        return int(per_param * dense + per_expert * expert)

    weights = split(wb, False)
    grads = split(_dtype_bytes(t.grad_dtype), z >= 2)
    masters = 4 if t.precision != "fp32" or (z >= 1 and p.offload_optimizer) else 0
    state = state_bytes_per_param(cfg)  # optim.name's state (AdamW: two fp32 moments)
    opt = split(state.dense + masters, z >= 1, state.expert + masters)
    opt_gpu, opt_cpu = (0, opt) if p.offload_optimizer else (opt, 0)

    sp = p.sp_size
    tokens = t.micro_batch_size * cfg.data.seq_len // sp  # this GPU's slice of its rows
    act_no = activation_bytes(cfg, tokens, False, wb)
    act_ck = activation_bytes(cfg, tokens, True, wb)
    framework = FRAMEWORK_BYTES + (2 * cfg.parallel.bucket_size(True) * wb if z >= 1 else 0)
    peak = cfg.logging.peak_tflops or spec.peak_tflops(t.precision)
    result = Plan(
        gpu=spec,
        gpus=gpus,
        ep_size=ep,
        expert_dp=xdp,
        zero_stage=z,
        precision=t.precision,
        offload_optimizer=p.offload_optimizer,
        activation_checkpointing=ckpt,
        micro_batch_size=t.micro_batch_size,
        seq_len=cfg.data.seq_len,
        grad_accum_steps=t.grad_accum_steps,
        numbers=nums,
        params_per_gpu=dense + expert,
        weights_bytes=weights,
        grads_bytes=grads,
        optimizer_bytes=opt_gpu,
        optimizer_cpu_bytes=opt_cpu,
        activations_bytes=act_ck if ckpt else act_no,
        activations_no_ckpt_bytes=act_no,
        activations_ckpt_bytes=act_ck,
        param_grad_transient_bytes=_largest_param(cfg, ep) * wb,
        framework_bytes=framework,
        save_host_bytes=0
        if t.precision == "fp32"
        else 4 * (dense + expert) + _save_copies(cfg, ep),
        mfu=mfu,
        peak_tflops=peak,
        traffic=expert_traffic(cfg, tokens * t.grad_accum_steps, gpus_per_node, wb, recompute=ckpt),
        head_traffic=head_traffic(
            cfg,
            tokens * t.grad_accum_steps,
            gpus_per_node,
            wb,
            kv_repeats(cfg.model.n_kv_heads, sp),
            recompute=ckpt,
        ),
        sp_size=sp,
        gpus_per_node=gpus_per_node,
        grad_dtype=t.grad_dtype,
        optimizer_flops=optimizer_step_flops(cfg, gpus),
    )
    capacity = spec.memory_mib * MiB
    if not result.fits:
        hints = []
        if not ckpt:
            hints.append("parallel.activation_checkpointing=true")
        if z < 2:
            hints.append("parallel.zero_stage=2")
        if ep < world and cfg.moe.num_experts % (ep * 2) == 0 and world % (ep * 2) == 0:
            hints.append(f"parallel.ep_size={ep * 2}")
        hints.append("a smaller train.micro_batch_size")
        result.warnings.append(
            f"does not fit: needs {result.total_bytes / GiB:.1f} GiB per GPU, {spec.name} has "
            f"{capacity / GiB:.1f} GiB; try {', '.join(hints)}"
        )
    return result


def _gib(n: float) -> str:
    return f"{n / GiB:8.2f} GiB"


def format_plan(pl: Plan) -> str:
    """Human-readable report of a :class:`Plan`."""
    n = pl.numbers
    ck = "on" if pl.activation_checkpointing else "off"
    lines = [
        f"layout: {pl.gpus} x {pl.gpu.name}, data-parallel {pl.gpus}"
        + (
            f" (sequence-parallel {pl.sp_size}: {pl.gpus // pl.sp_size} groups)"
            if pl.sp_size > 1
            else ""
        )
        + ", expert-parallel "
        f"{pl.ep_size} (expert-data-parallel {pl.expert_dp}), ZeRO-{pl.zero_stage}, "
        f"{pl.precision}{', optimizer offload' if pl.offload_optimizer else ''}",
        f"parameters: total {human(n.total_params)} ({n.total_params}), active per token "
        f"{human(n.active_params)}, experts {human(n.expert_params)}, held per GPU "
        f"{human(pl.params_per_gpu)}",
        f"micro-batch: {pl.micro_batch_size} x {pl.seq_len} tokens"
        + (f" ({pl.seq_len // pl.sp_size} of each row per GPU)" if pl.sp_size > 1 else "")
        + "; "
        f"{pl.tokens_per_step} tokens per optimizer step",
        "memory per GPU:",
        f"  weights            {_gib(pl.weights_bytes)}",
        f"  gradients          {_gib(pl.grads_bytes)}  ({pl.grad_dtype} accumulation)",
        f"  optimizer states   {_gib(pl.optimizer_bytes)}"
        + (
            f"  (+{_gib(pl.optimizer_cpu_bytes).strip()} in CPU memory)"
            if pl.offload_optimizer
            else ""
        ),
        f"  activations        {_gib(pl.activations_bytes)}  (checkpointing {ck}; "
        f"off {pl.activations_no_ckpt_bytes / GiB:.2f} GiB, on "
        f"{pl.activations_ckpt_bytes / GiB:.2f} GiB)",
        f"  grad transient     {_gib(pl.param_grad_transient_bytes)}",
        f"  framework/buffers  {_gib(pl.framework_bytes)}",
        f"  total              {_gib(pl.total_bytes)}  of {pl.gpu.memory_mib * MiB / GiB:.1f} "
        f"GiB -> {'fits' if pl.fits else 'DOES NOT FIT'}",
        "host memory of a checkpoint save: "
        + (
            f"{pl.save_host_bytes / GiB:.2f} GiB on rank 0 (the fp32 masters of the weights it "
            "writes and DeepSpeed's copies of them while writing; other ranks: those of their "
            "own experts, or none)"
            if pl.save_host_bytes
            else "none beyond the weights (fp32)"
        ),
        f"FLOPs per token (training): {n.flops_per_token:.4g}",
        f"at MFU {pl.mfu:.0%} of {pl.peak_tflops:g} TFLOP/s per GPU: "
        f"{pl.tokens_per_s:,.0f} tokens/s ({pl.tokens_per_s / pl.gpus:,.0f} per GPU), "
        f"{pl.step_time_s:.3f} s per optimizer step",
        *optimizer_flops_line(
            pl.optimizer_flops, pl.gpu.peak_tflops("fp32"), pl.mfu, pl.step_time_s
        ),
        format_traffic(pl.traffic, pl.gpus_per_node),
        format_head_traffic(pl.head_traffic),
    ]
    lines += [f"WARNING: {w}" for w in pl.warnings]
    return "\n".join(lines)
