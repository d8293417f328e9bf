"""`moetrain plan`: parameters, memory per GPU, FLOPs per token and implied speed of a layout.

:mod:`.estimate` (the memory and speed model, :func:`plan`), :mod:`.activations` (the bytes a
forward keeps for backward; each token mixer counts its own), :mod:`.gpus` (the GPUs it knows),
:mod:`.optimizer` (the optimizer state's bytes per parameter and its step's FLOPs),
:mod:`.zero_grads` (the gradient buffers of DeepSpeed's ZeRO-1/2 optimizer),
:mod:`.report` (what it prints); the expert and sequence-parallel all-to-alls are
:mod:`moetrain.plan_traffic`'s.
"""

from moetrain.plan.activations import (
    activation_bytes,
    activation_bytes_per_token,
    attention_bytes_per_token,
    ffn_bytes_per_token,
    head_bytes_per_token,
    loss_transient_bytes,
)
from moetrain.plan.estimate import FRAMEWORK_BYTES, Plan, plan
from moetrain.plan.gpus import GPUS, GiB, GPUSpec, MiB, gpu_spec
from moetrain.plan.report import format_plan

__all__ = [
    "FRAMEWORK_BYTES",
    "GPUS",
    "GPUSpec",
    "GiB",
    "MiB",
    "Plan",
    "activation_bytes",
    "activation_bytes_per_token",
    "attention_bytes_per_token",
    "ffn_bytes_per_token",
    "format_plan",
    "gpu_spec",
    "head_bytes_per_token",
    "loss_transient_bytes",
    "plan",
]
