"""Resuming on another layout (world size, EP size, ZeRO stage) with the optimizer state.

DeepSpeed's own loader only reloads optimizer shards on the layout that wrote them, and its
universal checkpoint knows only its own (AutoEP) expert layers. moetrain re-partitions instead:

1. Read, per parameter, the fp32 master weight and the optimizer's state tensors (named by the
   optimizer that wrote them, ``OptimizerSpec.state_keys`` of each param group: AdamW's two
   moments, Muon's momentum) from the saved layout's files (:class:`SavedOptimizer`). ZeRO-1/2
   files hold each rank's flat partition of every
   parameter group plus DeepSpeed's map of which slice of the partition belongs to which named
   parameter (``param_slice_mappings``); a parameter is its slices, in partition order, over the
   ranks that partitioned its group: every rank for dense groups, the expert-data-parallel
   ranks ``e, e + ep, ...`` of expert-parallel rank ``e`` for expert groups. Expert stacks of the
   EP ranks are concatenated into the global (E, ...) stack. ZeRO-3 files hold, per optimizer
   sub-group, each rank's partition of every parameter in turn (names and shapes in the rank's
   model file, the ranks it is partitioned over in DeepSpeed's ``ds_zero_partition_groups``):
   a parameter is its partitions in rank order, less the padding. Stage-0 files hold the torch
   optimizer's per-parameter state of each EP rank, named through ``TrainerState.optimizer_params``.
2. Write them into the new engine (:func:`restore_optimizer`; a ZeRO-3 engine:
   :func:`moetrain.checkpoint.zero3_restore.restore_zero3_optimizer`), whose model weights were
   loaded from the per-expert files: ZeRO-1/2 (and DeepSpeed's bf16 optimizer) get, for every
   parameter slice this rank now owns, the master weight copied into its flat fp32 partition
   and the state tensors into flat buffers of the partition's size; stage 0 gets the torch
   optimizer's per-parameter state. Every rank gets only its own experts (its slice of the stack).

The step count is the same for every group and is restored with the state, so Adam's bias
correction continues where it stopped. The optimizer (``optim.name``) must be the one that
wrote the checkpoint (a resume that changes it is refused before it starts,
:mod:`moetrain.checkpoint.compat`): another one starts from the weights with
``--reset-optimizer``. The files
are read with ``weights_only=True`` (three DeepSpeed classes allowed: the slice map, the loss
scaler and the stage enum).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from moetrain.checkpoint.format import (
    DENSE_FILE,
    CheckpointError,
    TrainerState,
    stage0_optimizer_file,
    zero3_model_file,
    zero_optimizer_file,
)
from moetrain.model import param_names
from moetrain.optim.registry import OptimizerSpec, optimizer_spec

MASTER = "fp32"


def saved_optimizer_name(state: TrainerState) -> str:
    """``optim.name`` of the run that wrote a checkpoint (AdamW before the name was recorded)."""
    return (state.config.get("optim") or {}).get("name", "adamw")


def is_expert_param(name: str) -> bool:
    """A stacked expert weight (``layers.<i>.ffn.experts.<w>``): partitioned per EP rank."""
    return param_names.parse_experts(name) is not None


def optimizer_param_names(engine: Any) -> list[list[str]] | None:
    """Names of each optimizer param group's parameters, in order, when the checkpoint itself
    will not name them (a plain torch optimizer, ZeRO stage 0); None under ZeRO-1/2."""
    if hasattr(engine.optimizer, "_param_slice_mappings"):
        return None
    names = {id(p): n for n, p in engine.module.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in engine.optimizer.param_groups]


def _load(path: Path) -> Any:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    if not path.is_file():
        raise CheckpointError(f"{path}: optimizer file of the saved layout is missing")
    with torch.serialization.safe_globals([fragment_address, LossScaler, ZeroStageEnum]):
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # not a zip archive: mmap unsupported
            return torch.load(path, map_location="cpu", weights_only=True)


class SavedOptimizer:
    """The optimizer state of one checkpoint, per parameter name (any saved layout)."""

    def __init__(self, ckpt: Path, state: TrainerState) -> None:
        self.ckpt, self.layout = Path(ckpt), state.layout
        self.spec: OptimizerSpec = optimizer_spec(saved_optimizer_name(state))
        world, self.ep = self.layout["world_size"], self.layout["ep_size"]
        stage3 = self.layout["zero_stage"] == 3
        dense = _load(zero3_model_file(self.ckpt, 0) if stage3 else self.ckpt / DENSE_FILE)
        self.counters = {
            k: dense.get(k) for k in ("global_steps", "global_samples", "skipped_steps")
        }
        # (name, ep rank or None) -> [(tensor source, group, start, numel)] in partition order
        self._pieces: dict[tuple[str, int | None], list[tuple[Any, int, int, int]]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.step: torch.Tensor | None = None
        # at ZeRO-3: the buffers (whole in every rank's model file) and tied names (alias: name)
        self.buffers: dict[str, torch.Tensor] = {}
        self.aliases: dict[str, str] = {}
        if stage3:
            names = set(dense.get("buffer_names") or [])
            self.buffers = {k: v for k, v in dense["module"].items() if k in names}
            self.aliases = dict(dense.get("shared_params") or {})
            for rank in range(world):
                self._add_zero3_rank(rank)
        elif self.layout["zero_stage"] > 0:
            for group in dense.get("param_shapes") or []:
                self._shapes.update({n: tuple(s) for n, s in group.items()})
            for rank in range(world):
                self._add_zero_rank(rank, _load(zero_optimizer_file(self.ckpt, rank)))
        else:
            if not state.optimizer_params:
                raise CheckpointError(
                    f"{self.ckpt}: a ZeRO stage 0 checkpoint without the names of its optimizer "
                    "parameters (written before moetrain recorded them): resume it on the layout "
                    "that wrote it, or with --reset-optimizer"
                )
            for ep_rank in range(self.ep):
                self._add_stage0_rank(ep_rank, _load(stage0_optimizer_file(self.ckpt, ep_rank)))
                self._add_stage0_names(ep_rank, state.optimizer_params)
        if self.step is None:
            raise CheckpointError(f"{self.ckpt}: the optimizer state holds no step count")

    # ---------------------------------------------------------------- reading the saved files
    def _set_step(self, step: Any, where: str) -> None:
        step = torch.as_tensor(step).detach().clone()
        if self.step is not None and not torch.equal(step, self.step):
            raise CheckpointError(f"{where}: step {step} differs from {self.step} elsewhere")
        self.step = step

    def _add_zero_rank(self, rank: int, sd: Any) -> None:
        where = f"{zero_optimizer_file(self.ckpt, rank)}"
        try:
            osd = sd["optimizer_state_dict"]
            mappings, masters = osd["param_slice_mappings"], osd["single_partition_of_fp32_groups"]
            base = osd["base_optimizer_state"]
            states, groups = base["state"], base["param_groups"]
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{where}: not a ZeRO-1/2 optimizer file ({e})") from None
        for g, mapping in enumerate(mappings):
            keys = self.spec.state_keys(groups[g])
            sources = {MASTER: masters[g], **{k: states[g][k] for k in keys}}
            self._set_step(states[g]["step"], where)
            ep_rank = rank % self.ep if groups[g].get("moe") else None
            for name, address in mapping.items():
                self._pieces.setdefault((name, ep_rank), []).append(
                    (sources, g, address.start, address.numel)
                )

    def _add_zero3_rank(self, rank: int) -> None:
        """Rank ``rank``'s ZeRO-3 partitions: sub-group ``i`` of its optimizer file is the flat
        run of the partitions of the parameters named in ``param_shapes[i]`` of its model
        file, each ``ceil(numel / partition count)`` long (the last one padded), over the
        sub-group's ``partition_ranks`` in rank order."""
        where = f"{zero_optimizer_file(self.ckpt, rank)}"
        try:
            shapes = _load(zero3_model_file(self.ckpt, rank))["param_shapes"]
            osd = _load(zero_optimizer_file(self.ckpt, rank))["optimizer_state_dict"]
            flats, base = osd["fp32_flat_groups"], osd["optimizer_state_dict"]
            meta = osd.get("ds_zero_partition_groups") or [
                {"partition_count": osd["partition_count"], "partition_rank": rank,
                 "partition_ranks": list(range(osd["partition_count"])), "families": []}
                for _ in flats
            ]  # fmt: skip
            states, groups = base["state"], base["param_groups"]
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{where}: not a ZeRO-3 optimizer file ({e})") from None
        group_of = {i: g for g in groups for i in g["params"]}
        for i, (names, flat, part) in enumerate(zip(shapes, flats, meta, strict=True)):
            count, prank, ranks = (
                part["partition_count"],
                part["partition_rank"],
                part["partition_ranks"],
            )
            if ranks != sorted(ranks) or ranks[prank] != rank:
                raise CheckpointError(
                    f"{where}: sub-group {i} partitioned over {ranks} out of order"
                )
            sources = {MASTER: flat, **{k: states[i][k] for k in self.spec.state_keys(group_of[i])}}
            self._set_step(states[i]["step"], where)
            expert = "autoep_expert" in part["families"]
            start = 0
            for name, shape in names.items():
                numel, size = torch.Size(shape).numel(), -(-torch.Size(shape).numel() // count)
                piece = max(0, min(size, numel - prank * size))
                self._shapes[name] = tuple(shape)
                key = (name, rank % self.ep if expert else None)
                self._pieces.setdefault(key, []).append((sources, i, start, piece))
                start += size
            if start > flat.numel():
                raise CheckpointError(
                    f"{where}: sub-group {i} holds {flat.numel()} values, its "
                    f"parameters need {start}"
                )

    def _add_stage0_rank(self, ep_rank: int, sd: Any) -> None:
        self._stage0 = getattr(self, "_stage0", {})
        try:
            self._stage0[ep_rank] = sd["optimizer"]
        except (KeyError, TypeError):
            raise CheckpointError(
                f"{stage0_optimizer_file(self.ckpt, ep_rank)}: no 'optimizer' state inside"
            ) from None

    def _add_stage0_names(self, ep_rank: int, names: list[list[str]]) -> None:
        opt = self._stage0[ep_rank]
        where = stage0_optimizer_file(self.ckpt, ep_rank)
        if [len(g["params"]) for g in opt["param_groups"]] != [len(g) for g in names]:
            raise CheckpointError(f"{where}: its param groups do not match the recorded names")
        for group, group_names in zip(opt["param_groups"], names, strict=True):
            keys = self.spec.state_keys(group)
            for index, name in zip(group["params"], group_names, strict=True):
                state = opt["state"][index]
                self._set_step(state["step"], str(where))
                key = (name, ep_rank if is_expert_param(name) else None)
                if key not in self._pieces:  # dense state: identical in every EP rank's file
                    first = state[keys[0]]
                    self._shapes[name] = tuple(first.shape)
                    sources = {k: state[k].reshape(-1) for k in keys}
                    self._pieces[key] = [(sources, 0, 0, first.numel())]

    # ---------------------------------------------------------------- per-parameter values
    def has_master(self) -> bool:
        """Whether the saved files hold fp32 master weights (ZeRO-1/2/3) or only moments."""
        return self.layout["zero_stage"] > 0

    def param_names(self) -> list[str]:
        """Every parameter the saved optimizer holds, in a stable order."""
        return sorted({name for name, _ in self._pieces})

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The shape of :meth:`full`'s tensor (an expert weight: the global stack's)."""
        shape = self._shapes[name]
        return (shape[0] * self.ep, *shape[1:]) if is_expert_param(name) else shape

    def _one(self, name: str, ep_rank: int | None, key: str) -> torch.Tensor:
        pieces = self._pieces.get((name, ep_rank))
        if not pieces:
            raise CheckpointError(f"{self.ckpt}: no optimizer state for parameter {name}")
        flat = torch.cat(
            [src[key].reshape(-1)[start : start + numel] for src, _, start, numel in pieces]
        )
        shape = self._shapes.get(name)
        if shape is None or flat.numel() != torch.Size(shape).numel():
            raise CheckpointError(
                f"{self.ckpt}: optimizer state of {name} has {flat.numel()} values, its shape "
                f"is {shape}"
            )
        return flat.view(shape)

    def full(self, name: str, key: str) -> torch.Tensor:
        """``key`` (``fp32``, or a state key of the optimizer: ``exp_avg``, ...) of parameter
        ``name``; an expert weight as the global stack of every expert, (E, ...)."""
        if not is_expert_param(name):
            return self._one(name, None, key)
        return self.expert_rows(name, key, 0, self.full_shape(name)[0])

    def expert_rows(self, name: str, key: str, start: int, stop: int) -> torch.Tensor:
        """Experts ``[start, stop)`` of the stacked expert weight ``name``'s ``key``, read from
        the saved EP ranks that hold them only."""
        per = self._shapes[name][0]  # experts per saved EP rank
        first, last = start // per, (stop - 1) // per
        stack = torch.cat([self._one(name, e, key) for e in range(first, last + 1)])
        return stack[start - first * per : stop - first * per]


# ------------------------------------------------------------------------- writing them back


def _value(saved: SavedOptimizer, name: str, key: str, experts: tuple[int, int]) -> torch.Tensor:
    if is_expert_param(name):
        return saved.expert_rows(name, key, *experts)
    return saved.full(name, key)


@torch.no_grad()
def restore_optimizer(engine: Any, saved: SavedOptimizer, experts: tuple[int, int]) -> None:
    """Put ``saved``'s optimizer state into ``engine`` (built for the new layout, model weights
    already loaded); ``experts``: the global experts ``[start, stop)`` this rank holds."""
    params = dict(engine.module.named_parameters())
    step, spec = saved.step, saved.spec
    if hasattr(engine.optimizer, "_param_slice_mappings"):  # ZeRO-1/2, DeepSpeed's bf16
        inner = engine.optimizer.optimizer
        flats = [group["params"][0] for group in inner.param_groups]
        moments = {
            i: {k: torch.zeros_like(f) for k in spec.state_keys(group)}
            for i, (f, group) in enumerate(zip(flats, inner.param_groups, strict=True))
        }
        for name, p in params.items():
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:  # no slice of this parameter in this rank's partition
                continue
            lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
            group_keys = list(moments[mapping.param_group_index])
            keys = ([MASTER] if saved.has_master() else []) + group_keys
            for key in keys:
                src = _value(saved, name, key, experts).reshape(-1)[lp.start : lp.start + lp.numel]
                dst = (
                    mapping.hp_fragment
                    if key == MASTER
                    else moments[mapping.param_group_index][key][hp.start : hp.start + hp.numel]
                )
                dst.copy_(src)
        for i, flat in enumerate(flats):
            inner.state[flat] = {"step": step.to(flat.device).clone(), **moments[i]}
    else:  # ZeRO stage 0: the torch optimizer, one state per parameter
        names = {id(p): n for n, p in params.items()}
        for group in engine.optimizer.param_groups:
            keys = spec.state_keys(group)
            for p in group["params"]:
                name = names[id(p)]
                state = {k: _value(saved, name, k, experts).to(p).clone() for k in keys}
                engine.optimizer.state[p] = {"step": step.to(p.device).clone(), **state}
    for attr, value in saved.counters.items():
        if value is not None:
            setattr(engine, attr, value)
