"""Rank functions for the mixed-precision tests (importable by spawned processes).

They drive the real Trainer (DeepSpeed engine, expert parallelism) on the parity tests' tiny
model and synthetic global batches (:mod:`tests.distributed.parity_jobs`), in bf16.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.distributed.parity_jobs import global_batches, parity_config, rank_slice
from tests.distributed.parity_variants import GRAD_NAMES, STEPS

BF16 = {"train.precision": "bf16"}


def _trainer(cfg: Any) -> Any:
    from moetrain.parallel.topology import init_distributed
    from moetrain.train.trainer import Trainer

    return Trainer(cfg, init_distributed(cfg))


def _biases(trainer: Any) -> list[torch.Tensor]:
    return [r.expert_bias.detach().clone() for r in trainer.routers]


# ----------------------------------------------------------------------------- layout parity


def bf16_run(
    rank: int, world: int, ep: int, stage: int, steps: int = STEPS, **extra: Any
) -> dict[str, Any]:
    """``steps`` bf16 steps of the parity model at (world, ep, stage) (``extra``: more dotted
    settings); losses, norms, the first step's reduced gradients (fp32, full), biases and a
    record of the numerics that ran."""
    from deepspeed.utils import safe_get_full_grad

    cfg = parity_config(world, ep, stage, **BF16, **extra)
    trainer = _trainer(cfg)
    grads: dict[str, torch.Tensor] = {}
    outs: list[Any] = []

    def capture(tr: Any) -> None:
        params = dict(tr.model.named_parameters())
        for name in (n for n in GRAD_NAMES if n in params):  # this model's of the parity names
            grads[name] = safe_get_full_grad(params[name]).detach().clone().float()

    def keep_output(module: Any, args: Any, out: Any) -> None:  # the dtypes of what ran
        if not outs:
            outs.append(out)

    trainer.model.register_forward_hook(keep_output)
    losses, norms, replicas = [], [], 0.0
    for step in range(steps):
        micro = [rank_slice(b, rank, world) for b in global_batches(step)]
        rec = trainer.train_step(micro, before_step=capture if step == 0 else None)
        losses.append(rec["loss"])
        norms.append(rec["grad_norm"])
        replicas += rec.get("comm/a2a_replicas", 0.0)
    out = outs[0]
    result = {
        "replicas": replicas,
        "losses": losses,
        "norms": norms,
        "grads": grads,
        "biases": [b.tolist() for b in _biases(trainer)],
        "experts": trainer.topo.local_experts(cfg.moe.num_experts),
        "optimizer": type(trainer.engine.optimizer).__name__,
        "dtypes": {
            "weights": str(trainer.model.layers[0].attn.wq.weight.dtype),
            "loss": str(out.loss.dtype),
            "ce_loss": str(out.ce_loss.dtype),
            "aux_loss": str(out.moe[0].aux_loss.dtype),
            "z_loss": str(out.moe[0].z_loss.dtype),
            "expert_bias": str(trainer.routers[0].expert_bias.dtype),
        },
    }
    del trainer
    return result


def bf16_layouts_job(
    rank: int, world: int, layouts: list[tuple], repeat: bool = False
) -> dict[str, Any]:
    """:func:`bf16_run` for every ``(ep, stage[, "shadow"])`` in ``layouts`` on this process
    group (``"shadow"``: up to 2 shadow experts per layer), keyed by :func:`bf16_key`; with
    ``repeat`` the last layout twice (a repeat must give identical losses)."""
    out: dict[str, Any] = {}
    for layout in layouts:
        out[bf16_key(layout)] = _bf16_layout_run(rank, world, layout)
    if repeat:
        out["repeat"] = _bf16_layout_run(rank, world, layouts[-1])
    if world == 1:
        from tests.distributed.parity_jobs import reference_run

        out["fp32_reference"] = reference_run()
    return out


def bf16_key(layout: tuple) -> str:
    """``(ep, stage[, "shadow"])`` -> ``ep2_zero1`` or ``ep2_zero2_shadow``."""
    return "_".join([f"ep{layout[0]}", f"zero{layout[1]}", *layout[2:]])


def _bf16_layout_run(rank: int, world: int, layout: tuple) -> dict[str, Any]:
    ep, stage, *variant = layout
    extra = {"parallel.shadow_experts": 2} if "shadow" in variant else {}
    return bf16_run(rank, world, ep, stage, **extra)


# ----------------------------------------------------------------------------- skipped steps


def _optimizer_state(trainer: Any) -> dict[str, Any]:
    """Everything a skipped step must leave alone, as this rank holds it: the module's weights,
    the optimizer's parameters (under ZeRO its fp32 master partitions, at stage 0 the fp32
    module weights themselves) and their Adam state (moments and step count), the
    aux-loss-free biases, the schedule and the learning rates."""
    engine = trainer.engine
    base = engine.optimizer.optimizer if trainer.cfg.parallel.zero_stage else engine.optimizer
    params = [p for group in base.param_groups for p in group["params"]]
    adam = [{k: v.detach().clone() for k, v in base.state.get(p, {}).items()} for p in params]
    assert any(adam), "no Adam state yet: take a step first"
    return {
        "weights": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        "masters": [p.detach().clone() for p in params],
        "adam": adam,
        "biases": _biases(trainer),
        "schedule": dict(trainer.schedule.state_dict()),
        "lr": [g["lr"] for g in engine.optimizer.param_groups],
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return bool(torch.equal(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _differing(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return [k for k in a if not _same(a[k], b[k])]


POISON = "layers.0.ffn.experts.w2"  # rank 1's own experts: reduced with no other rank at ep=world


def skip_job(rank: int, world: int, precision: str, stage: int, poison_step: int = 2) -> dict:
    """Four steps at world=ep=2; at ``poison_step`` rank 1 alone makes the gradient of its own
    experts' ``w2`` NaN (expert weights of an expert-parallel rank are reduced over their
    expert-data-parallel group, here rank 1 alone; the all-to-all carries activations and
    their gradients, not weight gradients: no other rank ever receives the NaN). Records what
    every rank decided and which state the skipped step changed."""
    cfg = parity_config(world, 2, stage, **{"train.precision": precision})
    trainer = _trainer(cfg)
    records, changed_by_skip, changed_by_next = [], None, None
    param = dict(trainer.model.named_parameters())[POISON]
    for step in range(4):
        before = _optimizer_state(trainer) if step else None  # Adam's state exists after step 1
        handle = None
        if rank == 1 and step == poison_step:
            handle = param.register_hook(lambda g: torch.full_like(g, float("nan")))
        try:
            rec = trainer.train_step([rank_slice(b, rank, world) for b in global_batches(step)])
        finally:
            if handle is not None:
                handle.remove()
        records.append({k: rec[k] for k in ("step", "loss", "skipped", "skipped_steps", "lr")})
        if before is not None:
            after = _optimizer_state(trainer)
            if step == poison_step:
                changed_by_skip = _differing(before, after)
            if step == poison_step + 1:
                changed_by_next = _differing(before, after)
    return {
        "records": records,
        "changed_by_skip": changed_by_skip,
        "changed_by_next": changed_by_next,
        "schedule": trainer.schedule.state_dict(),
        "optimizer": type(trainer.engine.optimizer).__name__,
        "skipped_in_trainer": trainer.progress.skipped_steps,
    }


def skip_jobs(rank: int, world: int, scenarios: list[tuple[str, int]]) -> list[dict]:
    """:func:`skip_job` for every ``(precision, stage)``, one process group for all."""
    return [skip_job(rank, world, precision, stage) for precision, stage in scenarios]


# ----------------------------------------------------------------------------- fp32 accumulation

ACCUM_NAMES = ("lm_head.weight", "layers.0.attn.wq.weight", "layers.1.ffn.experts.w13")


def _accumulation_case(rank: int, world: int, stage: int, grad_dtype: str, accum: int) -> dict:
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    settings = {
        "train.grad_dtype": grad_dtype,
        "train.grad_accum_steps": accum,
        "train.micro_batch_size": 2,
        "optim.grad_clip": 0.0,
    }
    cfg = parity_config(world, 1, stage, **BF16, **settings)
    trainer = _trainer(cfg)
    params = dict(trainer.model.named_parameters())
    exact = {n: torch.zeros(params[n].shape, dtype=torch.float64) for n in ACCUM_NAMES}

    def catch(name: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            assert grad.dtype == torch.bfloat16, grad.dtype
            exact[name].add_(grad.double())

        return hook

    handles = [params[n].register_hook(catch(n)) for n in ACCUM_NAMES]
    got: dict[str, torch.Tensor] = {}

    def capture(tr: Any) -> None:
        for n in ACCUM_NAMES:
            got[n] = safe_get_full_grad(params[n]).detach().double().clone()

    g = torch.Generator().manual_seed(5)
    micro = []
    for _ in range(accum):  # every rank its own rows of one global micro-batch
        seq = torch.randint(0, cfg.model.vocab_size, (world * 2, 17), generator=g)
        mine = seq[rank * 2 : (rank + 1) * 2]
        micro.append({"input_ids": mine[:, :-1], "labels": mine[:, 1:]})
    trainer.train_step(micro, before_step=capture)
    for h in handles:
        h.remove()
    errors = {}
    for n in ACCUM_NAMES:
        dist.all_reduce(exact[n])
        mean = exact[n] / world
        errors[n] = float((got[n] - mean).abs().max() / mean.abs().max())
    del trainer
    return {"case": (stage, grad_dtype), "errors": errors}


def accumulation_job(rank: int, world: int, cases: list[tuple[int, str]], accum: int) -> list:
    """For each ``(stage, grad_dtype)``: one bf16 step of ``accum`` micro-batches at ep=1 on
    ``world`` ranks. Every micro-batch's bf16 gradient of a few weights is caught as autograd
    hands it to the weight, summed in float64 and all-reduced: the exact mean. Returns, per
    weight, the largest error of DeepSpeed's accumulated and reduced gradient relative to the
    largest entry of the exact mean."""
    return [_accumulation_case(rank, world, stage, dt, accum) for stage, dt in cases]


# ----------------------------------------------------------------------------- fp32 masters on disk


def _save_after_three_steps(rank: int, world: int, run_dir: str, stage: int) -> dict[str, Any]:
    from deepspeed.utils import safe_get_full_fp32_param

    from moetrain.checkpoint.checkpointer import Checkpointer
    from moetrain.parallel.master_weights import fp32_masters_in_module
    from tests.distributed.checkpoint_jobs import StreamPosition

    cfg = parity_config(world, 2, stage, **BF16, run_dir=str(Path(run_dir) / f"zero{stage}"))
    trainer = _trainer(cfg)
    ckpt = Checkpointer(cfg, trainer.topo)
    pos = StreamPosition()
    for step in range(3):
        trainer.train_step([rank_slice(b, rank, world) for b in global_batches(step)])
        pos.consumed += 1
    params = dict(trainer.model.named_parameters())
    masters = {n: safe_get_full_fp32_param(p).clone() for n, p in params.items()}
    module = {n: p.detach().clone() for n, p in params.items()}
    with fp32_masters_in_module(trainer.model) as swapped:  # what a save holds in host memory
        held_fp32 = sorted(n for n, p in params.items() if p.dtype == torch.float32)
    path = ckpt.save(trainer.run_state(pos))
    unchanged = all(torch.equal(module[n], p.detach()) for n, p in params.items())
    losses = [
        trainer.train_step([rank_slice(b, rank, world) for b in global_batches(s)])["loss"]
        for s in range(3, 5)
    ]
    result = {
        "path": str(path),
        "masters": masters,
        "module": module,
        "module_unchanged_by_save": unchanged,
        "held_fp32_in_save": held_fp32,
        "swapped_in_save": swapped,
        "experts": trainer.topo.local_experts(cfg.moe.num_experts),
        "losses_after_save": losses,
    }
    del trainer
    return result


def masters_job(rank: int, world: int, run_dir: str, stages: list[int]) -> dict[int, dict]:
    """Per ZeRO stage: three bf16 steps at ep=2, a checkpoint, two more steps; then a fresh
    Trainer loads the checkpoint and runs the same two steps. Returns the fp32 masters at the
    save (full; experts: this rank's own), the module's bf16 weights, whether the save left the
    module alone, the checkpoint, and both runs' losses after it."""
    from moetrain.checkpoint.checkpointer import Checkpointer
    from tests.distributed.checkpoint_jobs import StreamPosition

    out = {}
    for stage in stages:
        out[stage] = _save_after_three_steps(rank, world, run_dir, stage)
        cfg = parity_config(world, 2, stage, **BF16, run_dir=str(Path(run_dir) / f"resume{stage}"))
        trainer = _trainer(cfg)
        path = Path(out[stage]["path"])
        state = Checkpointer(cfg, trainer.topo).load(path, trainer.run_state(StreamPosition()))
        out[stage]["losses_resumed"] = [
            trainer.train_step([rank_slice(b, rank, world) for b in global_batches(s)])["loss"]
            for s in range(state.step, state.step + 2)
        ]
        del trainer
    return out


# ----------------------------------------------------------------------------- bf16 vs fp32 curve

CURVE_STEPS = 60


def markov_batches(step: int, vocab: int = 96, rows: int = 4, seq: int = 16) -> list[dict]:
    """Learnable data: sequences of a fixed random Markov chain whose next token is one of two
    successors of the current one (entropy ln 2), so the loss falls far within a few dozen
    steps (random tokens would stay near ln(vocab))."""
    table = torch.randint(0, vocab, (vocab, 2), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(5000 + step)
    out = []
    for _ in range(2):  # the parity config's accumulation
        tok = torch.randint(0, vocab, (rows,), generator=g)
        cols = [tok]
        for _ in range(seq):
            pick = torch.randint(0, 2, (rows,), generator=g)
            tok = table[tok, pick]
            cols.append(tok)
        ids = torch.stack(cols, 1)
        out.append({"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()})
    return out


def curve_job(rank: int, world: int, steps: int = CURVE_STEPS) -> dict[str, list[float]]:
    """The same run (world 1, ZeRO-1, clipping, accumulation 2) in fp32 and in bf16."""
    curves = {}
    for precision in ("fp32", "bf16"):
        cfg = parity_config(world, 1, 1, **{"train.precision": precision, "train.max_steps": steps})
        trainer = _trainer(cfg)
        curves[precision] = [trainer.train_step(markov_batches(s))["loss"] for s in range(steps)]
        del trainer
    return curves


# ----------------------------------------------------------------------------- fp16 accounting


def _zero_fp16_scaler() -> Any:
    """DeepSpeed's dynamic loss scaler exactly as its fp16 ZeRO-1/2 optimizer builds it from
    moetrain's DeepSpeed config (``CreateLossScaler`` with the engine's dynamic loss args)."""
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    from moetrain.parallel.deepspeed import deepspeed_config
    from tests.helpers.configs import tiny_config

    fp16 = DeepSpeedFP16Config(**deepspeed_config(tiny_config(train__precision="fp16"), 1)["fp16"])
    return CreateLossScaler(
        dtype=torch.float16,
        static_loss_scale=fp16.loss_scale,
        dynamic_scaling=fp16.loss_scale == 0,
        dynamic_loss_args=fp16.dynamic_loss_scale_args(),
    )


class ZeroOptimizerScaler:
    """The one attribute of DeepSpeed's fp16 ZeRO optimizer that moetrain reads: its
    ``loss_scaler`` (the optimizer itself needs an fp16 device)."""

    def __init__(self, scaler: Any) -> None:
        self.loss_scaler = scaler


def _drive(optimizer: Any, counter: Any, outcomes: list[tuple[bool, float]]) -> dict[str, Any]:
    """Feed ``(overflow, loss)`` steps through the scaler (as DeepSpeed's step does: update the
    scale with the overflow flag) and moetrain's accounting; stop at its error."""
    from moetrain.train.nonfinite import read_loss_scale

    scales, calibration, error = [], [], None
    for step, (overflow, loss) in enumerate(outcomes, start=1):
        before = read_loss_scale(optimizer)
        optimizer.loss_scaler.update_scale(overflow)
        after = read_loss_scale(optimizer)
        scales.append(after.scale)
        try:
            calibration.append(
                counter.update(overflow, step, loss, float("inf"), True, before, after.scale)
            )
        except FloatingPointError as e:
            error = (step, str(e))
            break
    return {"scales": scales, "calibration": calibration, "error": error}


def loss_scale_job(rank: int, world: int, limit: int) -> dict[str, Any]:
    """fp16 skip accounting against DeepSpeed's own DynamicLossScaler (built without a device;
    its messages need DeepSpeed's communication backend, hence a process group)."""
    import deepspeed

    from moetrain.train.nonfinite import SkipCounter, load_loss_scaler_state, loss_scaler_state

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    messages: list[str] = []
    out: dict[str, Any] = {}

    def fresh() -> tuple[ZeroOptimizerScaler, SkipCounter]:
        return ZeroOptimizerScaler(_zero_fp16_scaler()), SkipCounter(limit, messages.append)

    opt, counter = fresh()
    out["initial"] = {
        "scale": opt.loss_scaler.cur_scale,
        "min": opt.loss_scaler.min_scale,
        "hysteresis": opt.loss_scaler.delayed_shift,
    }
    # the case: overflows in a row from the start, as many as the limit
    out["start"] = _drive(opt, counter, [(True, 2.5)] * limit)
    out["start_overflows"] = counter.overflows
    # on down to the minimum scale, then overflows there count until the limit stops the run
    opt, counter = fresh()
    out["to_min"] = _drive(opt, counter, [(True, 2.5)] * 60)
    out["to_min_overflows"] = counter.overflows
    # a non-finite loss is not calibration, however high the scale
    opt, counter = fresh()
    out["nan_loss"] = _drive(opt, counter, [(True, float("nan"))] * limit)
    # finite steps in between reset the run of non-finite ones
    opt, counter = fresh()
    opt.loss_scaler.cur_scale = opt.loss_scaler.min_scale
    pattern = ([(True, 2.5)] * (limit - 1) + [(False, 2.5)]) * 3
    out["interrupted"] = _drive(opt, counter, pattern)
    # the scaler's state through JSON into a fresh scaler: same state, same next decisions
    opt, _ = fresh()
    _drive(opt, SkipCounter(10**6, messages.append), [(True, 2.5)] * 7 + [(False, 2.5)] * 3)
    import json

    saved = json.loads(json.dumps(loss_scaler_state(opt)))
    restored, _ = fresh()
    load_loss_scaler_state(restored, saved)
    out["state_saved"] = saved
    out["state_restored"] = loss_scaler_state(restored)
    more = [(True, 2.5), (False, 2.5), (True, 2.5), (True, 2.5)]
    out["after_restore"] = [
        _drive(o, SkipCounter(10**6, messages.append), more)["scales"] for o in (opt, restored)
    ]
    out["messages"] = messages
    return out
