"""`moetrain.plan`: partitioning arithmetic by hand, the activation formula against the tensors
autograd really saves, and the whole estimate against measured peak memory of CPU runs."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moetrain.config import Config, ConfigError, apply_overrides, config_from_dict, load_config
from moetrain.model import Transformer
from moetrain.plan import (
    GiB,
    activation_bytes,
    activation_bytes_per_token,
    format_plan,
    head_bytes_per_token,
    loss_transient_bytes,
    plan,
)
from moetrain.plan.zero_grads import group_sizes, partition_buffer_elements
from tests.helpers.configs import tiny_config
from tests.helpers.memory import saved_storages

PROBE = Path(__file__).with_name("plan_memory_probe.py")

SMALL = {  # on the tiny model
    "model.vocab_size": 512,
    "model.d_model": 64,
    "model.dense_hidden": 1024,
    "model.max_seq_len": 2048,
    "moe.num_experts": 8,
    "moe.expert_hidden": 96,
    "data.seq_len": 64,
    "train.micro_batch_size": 2,
}


def _small(*overrides: dict[str, object], **extra: object) -> Config:
    return tiny_config(SMALL, *overrides, **extra)


def _cfg(base: dict[str, object], **extra: object) -> Config:
    """On the project's defaults, as the memory probe builds its runs."""
    merged = {**base, **{k.replace("__", "."): v for k, v in extra.items()}}
    return config_from_dict(apply_overrides({}, [f"{k}={v}" for k, v in merged.items()]))


def _dense_and_expert_params(cfg: Config) -> tuple[int, int]:
    """Counted on the built model, independently of moetrain.model_numbers."""
    model = Transformer(cfg.model, cfg.moe)
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return sum(p.numel() for p in model.parameters()) - expert, expert


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("grad_dtype", ["fp32", "bf16"])
def test_zero_and_ep_partitioning_by_hand(zero: int, grad_dtype: str) -> None:
    cfg = _small(
        parallel__ep_size=4,
        parallel__zero_stage=zero,
        train__precision="bf16",
        train__grad_dtype=grad_dtype,
    )
    dense, expert = _dense_and_expert_params(cfg)
    pl = plan(cfg, gpus=8, gpu="h100")
    # 8 ranks, EP 4: each rank holds 2 of 8 experts; expert-data-parallel group of 2.
    assert pl.expert_dp == 2
    assert pl.params_per_gpu == dense + expert // 4
    assert pl.weights_bytes == 2 * (dense + expert // 4)
    # gradients accumulate in fp32 by default (4 B): ZeRO-2 reduces into the exact partition,
    # ZeRO-1 (BF16_Optimizer) keeps them whole; in bf16 when asked (2 B), in the weights' dtype:
    # DeepSpeed's buffer of whole parameters (tests/unit/test_plan_zero_grads.py)
    if grad_dtype == "fp32":
        grads = 4 * (dense / 8 + expert / 4 / 2) if zero == 2 else 4 * (dense + expert / 4)
    else:
        grads = 2 * partition_buffer_elements(group_sizes(cfg), 8, 4)
    assert pl.grads_bytes == pytest.approx(grads, abs=2)
    assert f"({grad_dtype} accumulation)" in format_plan(pl)
    # fp32 master copy + two fp32 Adam moments, partitioned
    opt = 12 * (dense / 8 + expert / 4 / 2)
    assert pl.optimizer_bytes == pytest.approx(opt, abs=2)
    # a save: rank 0 holds the fp32 masters of what it writes (dense + its 2 experts), and
    # DeepSpeed copies the dense state, one MoE layer's 2 experts and the expert it writes
    layers = len(cfg.moe.moe_layers(cfg.model.n_layers))
    copies = dense + expert // layers // 4 + expert // layers // 8
    assert pl.save_host_bytes == 4 * (dense + expert // 4 + copies)
    assert "host memory of a checkpoint save" in format_plan(pl)


def test_fp32_world_one_and_offload() -> None:
    cfg = _small(parallel__zero_stage=2)
    dense, expert = _dense_and_expert_params(cfg)
    pl = plan(cfg, gpus=1, gpu="a100")
    assert (pl.weights_bytes, pl.grads_bytes) == (4 * (dense + expert), 4 * (dense + expert))
    # ZeRO's fp32 partition shares the fp32 weights' storage: AdamW's moments only, as stage 0
    assert pl.optimizer_bytes == 8 * (dense + expert)
    assert plan(_small(parallel__zero_stage=0), 1).optimizer_bytes == 8 * (dense + expert)
    assert pl.save_host_bytes == 0  # fp32: the module already holds the masters
    off = plan(_small(parallel__offload_optimizer=True, parallel__ep_size=2), 4, "a100")
    d2, e2 = dense / 4 + expert / 2 / 2, 0
    assert off.optimizer_bytes == e2  # offloaded: the fp32 masters are a copy in host memory
    assert off.optimizer_cpu_bytes == pytest.approx(12 * d2, abs=2)


def test_shadow_experts_add_their_replicas_to_activations() -> None:
    """Each MoE layer keeps up to ``parallel.shadow_experts`` replicas' weights (3 D F values)
    for backward under expert parallelism; one layer's worth with checkpointing; none at EP 1."""
    base = {"parallel__ep_size": 2, "train__precision": "bf16"}
    off, on = (plan(_small(**base, parallel__shadow_experts=s), 4, "h200") for s in (0, 2))
    replicas = 2 * 3 * 2 * 64 * 96  # shadows x (w1, w3, w2) x bf16 bytes x D x F
    assert on.activations_no_ckpt_bytes - off.activations_no_ckpt_bytes == 2 * replicas
    assert on.activations_ckpt_bytes - off.activations_ckpt_bytes in (0, replicas)
    one = _small(parallel__shadow_experts=2)  # EP 1: nothing is replicated
    assert plan(one, 4, "h200").activations_bytes == plan(_small(), 4, "h200").activations_bytes


def test_speed_follows_peak_mfu_and_flops() -> None:
    cfg = _small(train__precision="bf16", train__grad_accum_steps=4)
    pl = plan(cfg, gpus=4, gpu="h200", mfu=0.5)
    flops = pl.numbers.flops_per_token
    assert pl.peak_tflops == pytest.approx(989.4)
    assert pl.tokens_per_s == pytest.approx(4 * 989.4e12 * 0.5 / flops)
    assert pl.tokens_per_step == 2 * 64 * 4 * 4
    assert pl.step_time_s == pytest.approx(pl.tokens_per_step / pl.tokens_per_s)
    assert plan(_small(train__precision="fp32"), 1, "h100").peak_tflops < 100  # no tf32


def test_cannot_fit_warns_and_small_fits() -> None:
    big = {
        "model.vocab_size": 50304,
        "model.d_model": 2048,
        "model.n_layers": 24,
        "model.n_heads": 16,
        "model.n_kv_heads": 4,
        "moe.num_experts": 64,
        "moe.top_k": 8,
        "moe.expert_hidden": 1024,
        "model.max_seq_len": 4096,
        "data.seq_len": 4096,
        "train.micro_batch_size": 8,
        "train.precision": "bf16",
    }
    pl = plan(_small(big), gpus=8, gpu="rtx4090")
    assert not pl.fits
    assert pl.total_bytes > 24 * GiB
    assert any("does not fit" in w and "activation_checkpointing" in w for w in pl.warnings)
    assert "DOES NOT FIT" in format_plan(pl)
    small = plan(_small(), gpus=1, gpu="h100")
    assert small.fits and not small.warnings
    assert "fits" in format_plan(small) and "activations" in format_plan(small)


def test_bad_layouts_raise_config_errors() -> None:
    with pytest.raises(ConfigError, match="parallel.ep_size"):
        plan(_small(parallel__ep_size=2), gpus=3)
    with pytest.raises(ConfigError, match="--gpu"):
        plan(_small(), gpus=1, gpu="tpu-v9")
    with pytest.raises(ConfigError, match=r"parallel\.sp_size: must divide the world size"):
        plan(_small(parallel__sp_size=2), gpus=3)


class _ShapeExchange:
    """Rank 0 of an ``size``-rank head exchange in one process: the real exchange's shapes and
    fresh storages, without communication (what autograd saves depends only on those)."""

    rank = 0

    def __init__(self, size: int) -> None:
        self.size = size

    def to_heads(self, x_BsHX: torch.Tensor) -> torch.Tensor:
        return x_BsHX[:, :, : x_BsHX.shape[2] // self.size].repeat(1, self.size, 1, 1)

    def to_sequence(self, x_BShX: torch.Tensor) -> torch.Tensor:
        return x_BShX[:, : x_BShX.shape[1] // self.size].repeat(1, 1, self.size, 1)


def _saved_bytes_per_token(
    cfg: Config,
    dtype: torch.dtype,
    tokens: int,
    prepare: Callable[[Transformer], None] | None = None,
) -> float:
    """Bytes of distinct non-parameter storages autograd saves in one forward, plus the
    logits the caller holds, per token of this rank's slice (``parallel.sp_size`` > 1: rank 0
    of a sequence-parallel group, through :class:`_ShapeExchange`); ``prepare``: called on
    the model before the forward."""
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe).to(dtype)
    if prepare is not None:
        prepare(model)
    sp = cfg.parallel.sp_size
    if sp > 1:
        model.set_head_exchange(_ShapeExchange(sp))
    b = tokens // cfg.data.seq_len
    ids = torch.randint(0, cfg.model.vocab_size, (b, cfg.data.seq_len // sp))
    labels = torch.randint(0, cfg.model.vocab_size, (b, cfg.data.seq_len // sp))
    tokens //= sp
    with saved_storages([*model.parameters(), *model.buffers()]) as seen:
        out = model(ids, labels_BS=labels, return_logits=False)  # as the trainer calls it
    if out.logits is not None:  # plain loss (model.loss_chunk_tokens=0)
        seen[out.logits.untyped_storage().data_ptr()] = out.logits.untyped_storage().nbytes()
    seen[labels.untyped_storage().data_ptr()] = labels.untyped_storage().nbytes()
    return sum(seen.values()) / tokens


@pytest.mark.parametrize("chunk", [0, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"model.qk_norm": True, "moe.top_k": 1},
        {
            "model.n_layers": 3,
            "moe.first_k_dense": 1,
            "model.dense_hidden": 160,
            "moe.num_shared_experts": 1,
            "moe.shared_expert_gate": True,
        },
        {"moe.recompute_act": True},
        {"model.attention_output_gate": True, "model.qk_norm": True},
        {  # sandwich norms around a dense and an MoE FFN
            "model.block_norms": "sandwich",
            "model.n_layers": 3,
            "moe.first_k_dense": 1,
            "model.dense_hidden": 160,
        },
    ],
)
def test_activation_formula_matches_saved_tensors(
    dtype: torch.dtype, extra: dict, chunk: int
) -> None:
    cfg = _small(extra, {"model.loss_chunk_tokens": chunk})
    a = 4 if dtype == torch.float32 else 2
    tokens = 512
    predicted = sum(activation_bytes_per_token(cfg, i, a) for i in range(cfg.model.n_layers))
    predicted += head_bytes_per_token(cfg, a)
    if chunk:  # the chunked loss also saves its fp32 LM-head weight gradient (not per token)
        predicted += 4 * cfg.model.vocab_size * cfg.model.d_model / tokens
    measured = _saved_bytes_per_token(cfg, dtype, tokens)
    # bf16: the router's fp32 copy of its (E, D) weight is saved too (param-sized, not per token)
    assert measured == pytest.approx(predicted, rel=0.01)


GEGLU = {  # a dense GeGLU layer, GeGLU shared experts and routed experts, Gemma 4's dense branch
    "model.n_layers": 3,
    "moe.first_k_dense": 1,
    "model.dense_hidden": 160,
    "moe.num_shared_experts": 1,
    "model.ffn_activation": "geglu",
    "moe.activation": "geglu",
    "moe.dense_branch": True,
    "model.block_norms": "sandwich",
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "extra",
    [
        GEGLU,
        {**GEGLU, "moe.recompute_act": True},
        {"moe.activation": "geglu", "moe.score_on_input": True},
    ],
    ids=["geglu", "geglu-recompute", "geglu-score-on-input"],
)
def test_geglu_activations_match_saved_tensors(dtype: torch.dtype, extra: dict) -> None:
    """GeGLU is autograd's composition (its GELU's output and, in the routing weights' fp32,
    a widened copy of the gate|up output kept too); counted as SwiGLU's fused node it is
    outside the tolerance (the negative control)."""
    cfg = _small(extra, {"model.loss_chunk_tokens": 128})
    a = 4 if dtype == torch.float32 else 2
    tokens = 512

    def predicted(cfg: Config) -> float:
        layers = sum(activation_bytes_per_token(cfg, i, a) for i in range(cfg.model.n_layers))
        weight_grad = 4 * cfg.model.vocab_size * cfg.model.d_model / tokens  # chunked loss's
        return layers + head_bytes_per_token(cfg, a) + weight_grad

    measured = _saved_bytes_per_token(cfg, dtype, tokens)
    assert measured == pytest.approx(predicted(cfg), rel=0.01)
    as_swiglu = _small(
        extra,
        {"model.loss_chunk_tokens": 128},
        {k: "swiglu" for k in ("model.ffn_activation", "moe.activation") if k in extra},
    )
    assert measured != pytest.approx(predicted(as_swiglu), rel=0.01)


@pytest.mark.parametrize("chunk", [0, 128])
def test_mtp_activations_match_saved_tensors(chunk: int) -> None:
    """What one multi-token-prediction module adds: its block, inputs and head (compared as the
    difference to the same model without it, so the loss's transients cancel)."""
    plain = _small({"model.loss_chunk_tokens": chunk})
    mtp = _small({"model.loss_chunk_tokens": chunk, "model.mtp_depth": 1})
    tokens = 512
    predicted = activation_bytes(mtp, tokens, False, 4) - activation_bytes(plain, tokens, False, 4)
    measured = tokens * (
        _saved_bytes_per_token(mtp, torch.float32, tokens)
        - _saved_bytes_per_token(plain, torch.float32, tokens)
    )
    assert measured == pytest.approx(predicted, rel=0.02)


MLA = {  # v as wide as q/k: the CPU kernel pads neither (attention_bytes_per_token)
    "model.attention": "mla",
    "model.n_kv_heads": 4,
    "model.kv_lora_rank": 16,
    "model.qk_nope_head_dim": 8,
    "model.qk_rope_head_dim": 8,
    "model.v_head_dim": 16,
}


@pytest.mark.parametrize(
    "sp,extra",
    [(2, {}), (4, {}), (2, {"model.n_kv_heads": 1}), (2, MLA), (4, MLA)],
    ids=["gqa-sp2", "gqa-sp4-kv-repeated", "gqa-sp2-one-kv-head", "mla-sp2", "mla-sp4"],
)
def test_sequence_parallel_activations_match_saved_tensors(sp: int, extra: dict) -> None:
    """A rank's saved tensors under sequence parallelism (its slice of the rows, the heads
    exchanged) against the formula, the chunked loss's fp32 weight gradient included."""
    cfg = _small(extra, {"model.loss_chunk_tokens": 128, "parallel.sp_size": sp})
    tokens = 512
    predicted = activation_bytes(cfg, tokens // sp, False, 4)
    predicted -= loss_transient_bytes(cfg, tokens // sp, 4) - 4 * cfg.model.vocab_size * 64
    measured = tokens // sp * _saved_bytes_per_token(cfg, torch.float32, tokens)
    assert measured == pytest.approx(predicted, rel=0.01)
    plain = _small(extra, {"model.loss_chunk_tokens": 128})
    assert activation_bytes_per_token(cfg, 0, 4) > activation_bytes_per_token(plain, 0, 4)


def test_sequence_parallel_plan_by_hand() -> None:
    """sp=2 on 4 GPUs: each GPU holds half of each row, a step's tokens are counted once, ZeRO
    partitions as without SP, and the head all-to-alls are q, k, v and the output."""
    cfg = _small(parallel__sp_size=2, parallel__zero_stage=2)
    one, two = plan(_small(parallel__zero_stage=2), gpus=4), plan(cfg, gpus=4)
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    assert two.tokens_per_step == one.tokens_per_step // 2
    assert (two.optimizer_bytes, two.grads_bytes) == (one.optimizer_bytes, one.grads_bytes)
    assert two.activations_no_ckpt_bytes == activation_bytes(cfg, tokens // 2, False, 4)
    assert two.activations_no_ckpt_bytes < one.activations_no_ckpt_bytes
    m = cfg.model
    dims = m.attention_head_dim * (2 * m.n_heads + 2 * m.n_kv_heads)
    assert two.head_traffic.bytes_per_token_layer == 4 * dims / 2
    assert two.head_traffic.bytes_per_gpu_step == 4 * dims / 2 * 2 * m.n_layers * tokens // 2
    assert one.head_traffic.bytes_per_gpu_step == 0
    text = format_plan(two)
    assert "sequence-parallel 2: 2 groups" in text and "sequence-parallel all-to-all" in text


MEM_BASE = {  # the probe's plain AdamW is what ZeRO stage 0 runs (no fp32 partition copy)
    "parallel.zero_stage": 0,
    "model.vocab_size": 4096,
    "model.d_model": 256,
    "model.n_layers": 2,
    "model.n_heads": 4,
    "model.n_kv_heads": 2,
    "moe.num_experts": 8,
    "moe.top_k": 2,
    "moe.expert_hidden": 512,
    "data.seq_len": 128,
    "train.micro_batch_size": 8,
}
MEM_RUNS = [
    (MEM_BASE, False),
    ({**MEM_BASE, "data.seq_len": 256}, True),  # longer: activations still matter
    ({**MEM_BASE, "model.loss_chunk_tokens": 0}, False),  # full logits
    ({**MEM_BASE, "model.loss_chunk_tokens": 256}, False),  # 4 chunks
    (
        {
            **MEM_BASE,
            "model.n_layers": 3,
            "model.d_model": 192,
            "model.n_heads": 3,
            "model.n_kv_heads": 1,
            "model.qk_norm": True,
            "model.dense_hidden": 768,
            "moe.first_k_dense": 1,
            "moe.top_k": 1,
            "moe.num_shared_experts": 1,
            "moe.shared_expert_gate": True,
        },
        False,
    ),
]


def test_plan_matches_measured_peak_memory_of_cpu_training() -> None:
    """fp32 AdamW steps in a subprocess; peak RSS growth vs weights+grads+optimizer+activations
    (+ the largest parameter's fresh gradient) of plan(..., gpus=1) within 20%."""
    runs = [{"overrides": ov, "checkpointing": ck} for ov, ck in MEM_RUNS]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(PROBE), json.dumps(runs)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    report = []
    for (ov, ck), res in zip(MEM_RUNS, results, strict=True):
        pl = plan(_cfg(ov), gpus=1, gpu="h100", activation_checkpointing=ck)
        predicted = pl.model_state_bytes + pl.activations_bytes + pl.param_grad_transient_bytes
        ratio = predicted / res["peak_bytes"]
        report.append(f"ckpt={ck} measured={res['peak_bytes'] / 2**20:.1f}MiB ratio={ratio:.3f}")
        assert pl.activations_bytes > 0.3 * pl.model_state_bytes  # activations matter here
        assert 0.8 <= ratio <= 1.2, report
    print("; ".join(report))


def test_expert_traffic_by_hand() -> None:
    """Fan-out and rows per token of the expert all-to-all, counted by hand: E=8, top-2."""
    from moetrain.plan_traffic import expert_traffic

    # EP=2, 4 experts per rank: a token's 2 experts share a rank with chance 3/7, so it sends
    # 2 - 3/7 rows, half of them (on average) to the other rank
    t = expert_traffic(_small(parallel__ep_size=2), 1000, 8, 4)
    assert (t.max_ranks, t.max_nodes, t.ep_nodes) == (2, 1, 1)
    assert t.rows_off_rank == pytest.approx((2 - 3 / 7) / 2, abs=0.02)
    assert t.rows_off_node == 0
    # groups = EP ranks, topk_group 1: one row per token, off the rank half the time; bytes:
    # 1000 tokens x 2 MoE layers x 0.5 rows x (2 x 64 x 4 + 8 x 2) bytes x (forward, backward)
    g = expert_traffic(_small(parallel__ep_size=2, moe__n_group=2), 1000, 8, 4)
    assert (g.max_ranks, g.rows_off_rank) == (1, 0.5)
    assert g.bytes_per_gpu_step == 1000 * 2 * 0.5 * (2 * 64 * 4 + 16) * 2
    assert expert_traffic(_small(parallel__ep_size=2, moe__n_group=2), 1000, 8, 4, True) == (
        dataclasses.replace(g, bytes_per_gpu_step=g.bytes_per_gpu_step * 1.5)
    )
    # EP=8 over 2 nodes of 4 GPUs, one expert per rank; groups = nodes: one node per token,
    # and the rows to its 2 ranks leave the node half the time
    n = expert_traffic(_small(parallel__ep_size=8, moe__n_group=2), 1000, 4, 4)
    assert (n.max_ranks, n.max_nodes, n.ep_nodes) == (2, 1, 2)
    assert (n.rows_off_rank, n.rows_off_node) == (2 * 7 / 8, 1.0)
    plain = expert_traffic(_small(parallel__ep_size=8), 1000, 4, 4)
    assert plain.max_nodes == 2 and plain.rows_off_rank == 2 * 7 / 8
    text = format_plan(plan(_small(parallel__ep_size=8, moe__n_group=2), 8, gpus_per_node=4))
    assert "reach at most 2 of 8 EP ranks" in text and "at most 1 per token" in text
    assert "none (parallel.ep_size=1)" in format_plan(plan(_small(), 1))


def test_zero3_partitions_weights_and_counts_gathers_by_hand() -> None:
    from moetrain.plan.estimate import _largest_unit

    kw = {"parallel__ep_size": 4, "train__precision": "bf16", "parallel__bucket_elements": 1000}
    cfg = _small(parallel__zero_stage=3, **kw)
    dense, expert = _dense_and_expert_params(cfg)
    pl, two = plan(cfg, gpus=8, gpu="h100"), plan(_small(parallel__zero_stage=2, **kw), 8)
    # 8 ranks, EP 4: dense weights over 8 ranks, each expert over its group of 2
    assert pl.weights_bytes == pytest.approx(2 * (dense / 8 + expert / 4 / 2), abs=2)
    assert (pl.grads_bytes, pl.optimizer_bytes) == (two.grads_bytes, two.optimizer_bytes)
    # gathered at once: the largest unit and the prefetch bucket (parallel.bucket_elements)
    assert pl.gathered_bytes == 2 * (_largest_unit(cfg, 4) + 1000)
    received = dense * 7 / 8 + expert / 4 / 2
    accum = cfg.train.grad_accum_steps
    assert pl.zero3_gather_bytes_per_step == pytest.approx(2 * accum * 2 * received)
    assert pl.zero3_reduce_bytes_per_step == pytest.approx(accum * 4 * received)
    assert pl.total_bytes - two.total_bytes == (
        pl.weights_bytes - two.weights_bytes + pl.gathered_bytes
    )
    text = format_plan(pl)
    assert "ZeRO-3 partitions" in text and "ZeRO-3 traffic per GPU" in text


def test_zero3_fits_deepseek_v3_on_256_h100() -> None:
    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs" / "deepseek-v3-671b.yaml", [])
    assert not plan(cfg, gpus=256).fits  # 94 GiB per GPU at ZeRO-2
    cfg.parallel.zero_stage = 3
    pl = plan(cfg, gpus=256)
    assert pl.fits and pl.total_bytes < 70 * 2**30
