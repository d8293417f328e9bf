"""`moetrain plan`'s model-state terms against a real DeepSpeed ZeRO engine (2 gloo ranks).

After one optimizer step of the real Trainer, each rank's model weights, its ZeRO fp32
partition and AdamW's moments are counted tensor by tensor and compared with
``plan(cfg, gpus=2)``: the formula must hold for what DeepSpeed actually allocates (fp32 and
bf16, ZeRO-1 and ZeRO-2, EP 1 and 2; fp32 masters that share the weights' storage count as
weights only; at ZeRO-3 the weights are this rank's partitions). Under bf16 the gradients are
counted too, after the last backward of the step: DeepSpeed's fp32 accumulation buffers (ZeRO-1:
whole, in its BF16_Optimizer; ZeRO-2: this rank's partition) and no bf16 gradient left alive.
Under fp32 at ZeRO-1/2, the most gradient memory a rank held at once in the step
(tests/helpers/zero_state.py: DeepSpeed's buffers, and at ZeRO-1 autograd's gradients it holds
until its reduce) against ``plan``'s (moetrain/plan/zero_grads.py: the partition buffer of whole
parameters, twice with gradient accumulation at ZeRO-2, beside the gradients still held at
ZeRO-1's first reduce), the largest rank's; with the gradients in flight, at most ``plan``'s
fresh-gradient term more. The partition alone (``plan``'s former term) is outside the
tolerance (the negative control)."""

from __future__ import annotations

import pytest

from tests.helpers.configs import tiny_config
from tests.helpers.distributed import run_distributed
from tests.helpers.zero_state import GradientPeak

pytestmark = pytest.mark.slow

SHAPE = {
    "model.vocab_size": 512,
    "model.d_model": 64,
    "model.dense_hidden": 1024,
    "model.max_seq_len": 32,
    "moe.expert_hidden": 96,
    "data.seq_len": 32,
    "train.micro_batch_size": 2,
    "run_dir": "/tmp/moetrain-plan-zero-unused",
}
LAYOUTS = [  # (ep_size, zero_stage, precision, other settings)
    (2, 2, "fp32", {}),
    (2, 2, "fp32", {"train.grad_accum_steps": 2}),  # the earlier micro-batch's buffer beside
    # ZeRO-1 reduces after the backward (overlap_comm off, as on CPU; plan takes a GPU's on) in
    # buckets smaller than the model: the gradients beyond the first bucket are still held when
    # the partition buffer is allocated
    (1, 1, "fp32", {"parallel.bucket_elements": 4096, "parallel.overlap_comm": False}),
    (2, 1, "bf16", {}),
    (2, 2, "bf16", {}),
    (1, 3, "fp32", {}),  # ZeRO-3: every weight partitioned (none kept whole: persistence 0)
    (2, 3, "bf16", {}),
]


def _nbytes(tensors) -> int:  # noqa: ANN001
    return sum(t.numel() * t.element_size() for t in tensors)


def _grad_bytes(trainer) -> dict:  # noqa: ANN001
    """Gradient memory after the last backward: DeepSpeed's fp32 buffers (storages counted
    once) and the module's own ``.grad`` tensors."""
    opt = trainer.engine.optimizer
    if hasattr(opt, "fp32_groups_gradients_flat"):  # BF16_Optimizer (ZeRO-1)
        buffers = list(opt.fp32_groups_gradients_flat)
    elif hasattr(opt, "grad_partitions_flat_buffer"):  # ZeRO-3: this rank's partitions
        buffers = [opt.grad_partitions_flat_buffer]
    else:  # ZeRO-2: the partition this rank reduces into
        buffers = [t for ts in opt.averaged_gradients.values() if ts for t in ts]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in buffers}
    dtypes = {str(t.dtype) for t in buffers}
    live = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    return {"buffers": sum(storages.values()), "dtypes": dtypes, "module_grads": _nbytes(live)}


def _job(rank: int, world: int) -> list[dict]:
    import torch

    from moetrain.parallel.topology import init_distributed
    from moetrain.plan import plan
    from moetrain.train.trainer import Trainer

    out = []
    for ep, zero, precision, other in LAYOUTS:

        def config(precision: str, ep: int = ep, zero: int = zero, other: dict = other):  # noqa: ANN202
            return tiny_config(
                SHAPE,
                other,
                parallel__ep_size=ep,
                parallel__zero_stage=zero,
                train__precision=precision,
                parallel__zero3_persistence_elements=0,
            )

        cfg = config(precision)
        trainer = Trainer(cfg, init_distributed(cfg))
        g = torch.Generator().manual_seed(rank)
        micro = cfg.train.grad_accum_steps
        ids = torch.randint(0, 512, (micro, 2, 33), generator=g)
        grads: dict = {}
        peak = GradientPeak(trainer)

        def count(tr, grads: dict = grads, precision: str = precision, peak=peak) -> None:  # noqa: ANN001
            peak.sample()
            if precision == "bf16":
                grads.update(_grad_bytes(tr))

        batches = [{"input_ids": b[:, :-1], "labels": b[:, 1:]} for b in ids]
        trainer.train_step(batches, before_step=count)
        zero_opt = trainer.engine.optimizer
        params = list(trainer.model.parameters())
        weights = _nbytes(params)
        if zero == 3:  # the partitions this rank holds, their fp32 masters (shared in fp32)
            weights = _nbytes(p.ds_tensor for p in params)
            masters = list(zero_opt.fp32_partitioned_groups_flat)
        elif hasattr(zero_opt, "single_partition_of_fp32_groups"):
            masters = zero_opt.single_partition_of_fp32_groups
        else:  # BF16_Optimizer
            masters = zero_opt.fp32_groups_flat_partition
        moments = [
            t for state in zero_opt.optimizer.state.values() for t in state.values() if t.dim()
        ]
        held = [p.ds_tensor for p in params] if zero == 3 else [p for p in params if p.numel()]
        weight_storages = {t.untyped_storage().data_ptr() for t in held}
        # fp32: the masters are slices of the weights' flat buffer (not memory of their own)
        masters = [m for m in masters if m.untyped_storage().data_ptr() not in weight_storages]
        pl = plan(cfg, gpus=world)
        out.append(
            {
                "layout": (ep, zero, precision),
                "weights": weights,
                "plan_weights": pl.weights_bytes,
                "optimizer": _nbytes(masters) + _nbytes(moments),
                "plan_optimizer": pl.optimizer_bytes,
                "grads": grads,
                "grad_peak": peak.peak,
                "grad_buffers": peak.buffers,
                "plan_fresh_grad": pl.param_grad_transient_bytes,
                "plan_grads": pl.grads_bytes,
                # plan's former term: fp32 gradients as bf16 weights take them (ZeRO-2 the exact
                # partition, ZeRO-1 whole)
                "former_grads": plan(config("bf16"), gpus=world).grads_bytes,
            }
        )
        del trainer, zero_opt, moments, masters, params
    return out


def test_plan_model_state_equals_deepspeed_zero_allocations() -> None:
    ranks = run_distributed(_job, 2, timeout=600.0)
    for layout, *by_rank in zip(LAYOUTS, *ranks, strict=True):
        if layout[1] in (1, 2) and layout[2] == "fp32":  # plan's is the largest rank's
            # ZeRO-1 holds autograd's gradients whole until its reduce; at ZeRO-2 they are in
            # flight to their bucket (at most the largest one: plan's separate term)
            key = "grad_peak" if layout[1] == 1 else "grad_buffers"
            held = max(r[key] for r in by_rank)
            plan_grads = by_rank[0]["plan_grads"]
            assert held == pytest.approx(plan_grads, rel=1e-3), by_rank
            assert held != pytest.approx(by_rank[0]["former_grads"], rel=0.1), by_rank
            fresh = by_rank[0]["plan_fresh_grad"]
            assert max(r["grad_peak"] for r in by_rank) <= plan_grads + fresh, by_rank
    for rank_results in ranks:
        for r in rank_results:
            if r["layout"][1] == 3:  # each partition ceil(numel / group): a few elements
                assert r["weights"] == pytest.approx(r["plan_weights"], rel=1e-3), r
            else:
                assert r["weights"] == r["plan_weights"], r
            # ZeRO pads each flat group to a multiple of the world size: a few elements
            assert r["optimizer"] == pytest.approx(r["plan_optimizer"], rel=1e-3), r
            if r["layout"][2] == "bf16":  # fp32 accumulation, the bf16 gradients already freed
                assert r["grads"]["dtypes"] == {"torch.float32"}, r
                assert r["grads"]["module_grads"] == 0, r
                assert r["grads"]["buffers"] == pytest.approx(r["plan_grads"], rel=1e-3), r
