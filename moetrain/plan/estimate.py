"""`moetrain plan`'s estimate of a layout: parameters, memory per GPU, FLOPs per token and
implied speed.

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
  Where they accumulate in the weights' own dtype (fp32 training) DeepSpeed's ZeRO-1/2 buffer
  holds the parameters a partition cuts whole, and ZeRO-1 holds it beside the whole gradients
  (:mod:`moetrain.plan.zero_grads`).
- optimizer: its state (``optim.name``'s bytes per parameter, dense and expert,
  :mod:`moetrain.plan.optimizer`; AdamW 8 B/param, Muon 4 B on its matrices and 8 B on the rest),
  + 4 B for the fp32 master copy under bf16/fp16 (and under fp32 with
  ``parallel.offload_optimizer``; otherwise fp32 masters share the weights' storage at every
  stage, :mod:`moetrain.parallel.fp32_partitions`), partitioned under ZeRO-1/2 (dense over W, experts
  over X); ``parallel.offload_optimizer`` moves it to CPU.
- activations (:mod:`moetrain.plan.activations`): every block's bytes per token times the
  micro-batch tokens, plus the head and loss (full logits, or one chunk
  of them with ``model.loss_chunk_tokens``, as the trainer computes the loss) and the largest
  parameter's fresh gradient (before accumulation).
- framework: a fixed allowance (CUDA context, allocator slack, NCCL) plus DeepSpeed's reduce and
  all-gather buckets under ZeRO-1/2.
- checkpoint save, host memory (bf16/fp16): the fp32 masters of the weights a rank writes
  (:mod:`moetrain.parallel.master_weights`), at most rank 0's: ``4 * (P_d + P_e / ep)``.

Sequence parallelism (``parallel.sp_size`` = n): each GPU holds ``seq_len / n`` tokens of its
micro-batch's rows, so every per-token term counts those; each mixer adds what its head
exchange keeps. ZeRO partitions over every GPU as
without it (the SP ranks count as data-parallel ranks), and a step's tokens are counted once.

Expert all-to-all and the head all-to-alls of sequence parallelism: :mod:`moetrain.plan_traffic`
(fan-out per token and bytes per step).

Generation cache: every layer's mixer state per token, in ``train.precision``
(:func:`moetrain.model_numbers.cache_bytes_per_token`), and the recurrent layers' fixed state
per sequence (:func:`moetrain.model_numbers.cache_bytes_per_sequence`).

Optimizer step: the FLOPs beyond the elementwise per GPU (Muon's Newton-Schulz,
:mod:`moetrain.plan.optimizer`), reported with their time at the MFU of the fp32 peak.

Speed: ``tokens/s = gpus * peak * mfu / flops_per_token``, the peak from
:data:`moetrain.monitor.mfu.PEAK_TFLOPS` for ``train.precision`` (or ``logging.peak_tflops``),
FLOPs from
:func:`moetrain.model_numbers.model_numbers` (model FLOPs: the recompute of activation checkpointing
is not counted, so the same MFU is harder to reach with it on).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moetrain.config import Config, ConfigError
from moetrain.config.layout import check_layout
from moetrain.model.mixers import mixer_class
from moetrain.model_numbers import (
    ModelNumbers,
    cache_bytes_per_sequence,
    cache_bytes_per_token,
    model_numbers,
)
from moetrain.plan.activations import activation_bytes
from moetrain.plan.gpus import GiB, GPUSpec, MiB, gpu_spec
from moetrain.plan.optimizer import StateBytes, optimizer_step_flops, state_bytes_per_param
from moetrain.plan.zero_grads import keeps_partition_buffer, zero12_grad_bytes
from moetrain.plan_traffic import HeadTraffic, Traffic, expert_traffic, head_traffic

FRAMEWORK_BYTES = 1 * GiB  # CUDA context + cuBLAS workspace + NCCL + allocator slack


def _dtype_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


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
    cache_bytes_per_token: int = 0  # generation: every layer's mixer state, train.precision
    cache_bytes_per_sequence: int = 0  # generation: the recurrent layers' fixed state
    # ZeRO-3 (:func:`zero3_numbers`): weights gathered at once (the largest unit and the
    # prefetch bucket), and the bytes each GPU all-gathers / reduce-scatters per optimizer step
    gathered_bytes: int = 0
    zero3_gather_bytes_per_step: float = 0.0
    zero3_reduce_bytes_per_step: float = 0.0
    optimizer_name: str = "adamw"  # optim.name
    optimizer_state: StateBytes = StateBytes(8.0, 8.0)  # its state's bytes per parameter
    master_bytes: int = 0  # per parameter: the fp32 master copy the optimizer holds (0 or 4)
    optimizer_flops: int = 0  # per GPU and step beyond the elementwise (Muon's Newton-Schulz)

    @property
    def model_state_bytes(self) -> int:
        """Weights + gradients + optimizer states on the GPU."""
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> int:
        return (
            self.model_state_bytes
            + self.gathered_bytes
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
    for layer in cfg.layer_plan():
        if layer.mixer is not None:
            shapes = mixer_class(layer.mixer).param_shapes(m, layer.mixer).values()
            sizes += [math.prod(shape) for shape in shapes]
    if e.moe_layers(m.n_layers):
        sizes.append(e.num_experts // ep * (e.latent_dim or m.d_model) * e.expert_hidden)
    return max(sizes)


def _largest_unit(cfg: Config, ep: int) -> int:
    """Parameters of the largest unit ZeRO-3 gathers whole on a GPU: the embedding, the LM head,
    or a block (its dense weights, on average over the blocks, and one MoE layer's local
    experts)."""
    nums = model_numbers(cfg)
    m = cfg.model
    dense_blocks = nums.total_params - nums.expert_params - nums.embedding_params
    layers = max(1, nums.num_moe_layers)
    block = dense_blocks // max(1, m.n_blocks) + nums.expert_params // layers // ep
    return max(m.vocab_size * m.d_model, block)


def zero3_numbers(cfg: Config, world: int, wb: int, grad_bytes: int) -> tuple[int, float, float]:
    """At ZeRO-3: the bytes of weights gathered at once on a GPU (the largest unit, and the next
    units prefetched: ``stage3_prefetch_bucket_size``, at most ``stage3_max_live_parameters``),
    and the bytes each GPU receives per optimizer step in the weight all-gathers (every
    partitioned weight gathered for the forward and again for the backward, per micro-batch;
    with activation checkpointing once more for the recompute) and sends in the gradient
    reduce-scatters (once per micro-batch, ``train.grad_dtype``). Weights under
    ``stage3_param_persistence_threshold`` elements are neither partitioned nor gathered (not
    counted: they are small)."""
    p, t = cfg.parallel, cfg.train
    ep, xdp = p.ep_size, world // p.ep_size
    nums = model_numbers(cfg)
    dense, expert = nums.total_params - nums.expert_params, nums.expert_params // ep
    prefetch = (
        p.bucket_size(True) if p.zero3_prefetch_elements is None else p.zero3_prefetch_elements
    )
    live = min(_largest_unit(cfg, ep) + prefetch, p.zero3_max_live_elements)
    gathers = 3 if p.activation_checkpointing else 2
    received = dense * (world - 1) / world + expert * (xdp - 1) / xdp
    gather = gathers * t.grad_accum_steps * wb * received
    reduce = t.grad_accum_steps * grad_bytes * received
    return live * wb, gather, reduce


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

    weights = split(wb, z >= 3)
    gb = _dtype_bytes(t.grad_dtype)
    grads = split(gb, z >= 2)
    if keeps_partition_buffer(cfg):  # DeepSpeed's whole-parameter buffer (zero_grads)
        grads = zero12_grad_bytes(cfg, world, split(gb, False), gb)
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
            recompute=ckpt,
        ),
        sp_size=sp,
        gpus_per_node=gpus_per_node,
        grad_dtype=t.grad_dtype,
        cache_bytes_per_token=cache_bytes_per_token(cfg, wb),
        cache_bytes_per_sequence=cache_bytes_per_sequence(cfg, wb),
        optimizer_name=cfg.optim.name,
        optimizer_state=state,
        master_bytes=masters,
        optimizer_flops=optimizer_step_flops(cfg, gpus),
    )
    if z == 3:
        gathered, gather, reduce = zero3_numbers(cfg, world, wb, _dtype_bytes(t.grad_dtype))
        result.gathered_bytes = gathered
        result.zero3_gather_bytes_per_step = gather
        result.zero3_reduce_bytes_per_step = reduce
        result.save_host_bytes = 0  # each rank writes its own partitions
    capacity = spec.memory_mib * MiB
    if not result.fits:
        hints = []
        if not ckpt:
            hints.append("parallel.activation_checkpointing=true")
        if z < 3:
            hints.append(f"parallel.zero_stage={max(z + 1, 2)}")
        if ep < world and cfg.moe.num_experts % (ep * 2) == 0 and world % (ep * 2) == 0:
            hints.append(f"parallel.ep_size={ep * 2}")
        hints.append("a smaller train.micro_batch_size")
        result.warnings.append(
            f"does not fit: needs {result.total_bytes / GiB:.1f} GiB per GPU, {spec.name} has "
            f"{capacity / GiB:.1f} GiB; try {', '.join(hints)}"
        )
    return result
