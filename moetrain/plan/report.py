"""The report ``moetrain plan`` prints (:func:`format_plan`)."""

from __future__ import annotations

from moetrain.model_numbers import human
from moetrain.plan.estimate import Plan
from moetrain.plan.gpus import GiB, MiB
from moetrain.plan.optimizer import optimizer_lines
from moetrain.plan_traffic import format_head_traffic, format_traffic


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
        f"  weights            {_gib(pl.weights_bytes)}"
        + ("  (ZeRO-3 partitions)" if pl.zero_stage == 3 else ""),
        *(
            [f"  gathered weights   {_gib(pl.gathered_bytes)}  (ZeRO-3: largest unit + prefetch)"]
            if pl.zero_stage == 3
            else []
        ),
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
        f"generation cache: {pl.cache_bytes_per_token:,} bytes per token"
        + (
            f" + {pl.cache_bytes_per_sequence:,} per sequence (recurrent state)"
            if pl.cache_bytes_per_sequence
            else ""
        )
        + f" ({pl.precision})",
        f"at MFU {pl.mfu:.0%} of {pl.peak_tflops:g} TFLOP/s per GPU: "
        f"{pl.tokens_per_s:,.0f} tokens/s ({pl.tokens_per_s / pl.gpus:,.0f} per GPU), "
        f"{pl.step_time_s:.3f} s per optimizer step",
        *optimizer_lines(
            pl.optimizer_name,
            pl.optimizer_state,
            pl.master_bytes,
            pl.optimizer_flops,
            pl.gpu.peak_tflops("fp32"),
            pl.mfu,
            pl.step_time_s,
        ),
        *(
            [
                f"ZeRO-3 traffic per GPU and optimizer step: all-gather "
                f"{pl.zero3_gather_bytes_per_step / GiB:,.1f} GiB received, reduce-scatter "
                f"{pl.zero3_reduce_bytes_per_step / GiB:,.1f} GiB sent"
            ]
            if pl.zero_stage == 3
            else []
        ),
        format_traffic(pl.traffic, pl.gpus_per_node),
        format_head_traffic(pl.head_traffic),
    ]
    lines += [f"WARNING: {w}" for w in pl.warnings]
    return "\n".join(lines)
