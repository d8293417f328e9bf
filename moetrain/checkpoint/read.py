"""Reading weights: a committed moetrain checkpoint (whatever its world / EP size and ZeRO
stage) a few tensors at a time (:class:`CheckpointTensors`), or into a single-device model.

At ZeRO stages 0-2 the weights are DeepSpeed's dense file and one file per expert. At ZeRO-3
they are the fp32 master weights in each rank's partitions (:class:`moetrain.checkpoint.reshard.
SavedOptimizer` reads them, memory-mapped): each tensor is assembled from its partitions alone,
so reading never holds more than what it yields (the dense weights, then one layer's experts).

Only safe paths: every checkpoint file is read with ``torch.load(weights_only=True)``
(DeepSpeed's model files hold only tensors and plain containers), the commit manifest is checked
first, and every expert of every MoE layer must be present exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from moetrain.checkpoint.format import (
    DENSE_FILE,
    EXPERT_FILE_RE,
    EXPERT_KEY_RE,
    CheckpointError,
    TrainerState,
    expert_file,
    read_commit,
    safe_torch_load,
    verify_manifest,
)
from moetrain.checkpoint.reshard import MASTER, SavedOptimizer, is_expert_param
from moetrain.config import Config, config_from_dict
from moetrain.model import param_names
from moetrain.model.moe.experts import EXPERT_WEIGHTS, expert_param_names


def checkpoint_config(ckpt: Path) -> Config:
    """The resolved config stored in the checkpoint."""
    read_commit(ckpt)
    return config_from_dict(TrainerState.read(ckpt).config)


def saved_zero_stage(ckpt: Path) -> int:
    """The ``parallel.zero_stage`` a checkpoint was written at."""
    return int(TrainerState.read(ckpt).layout.get("zero_stage", 0))


def zero3_partitions(ckpt: Path) -> SavedOptimizer | None:
    """The partitions of a checkpoint written at ``parallel.zero_stage=3``; None for another
    stage."""
    state = TrainerState.read(ckpt)
    return SavedOptimizer(ckpt, state) if state.layout.get("zero_stage") == 3 else None


def _expert_names(saved: SavedOptimizer, layer: int) -> list[str]:
    names = [n for n in saved.param_names() if (param_names.parse_experts(n) or (-1,))[0] == layer]
    if not names:
        raise CheckpointError(f"{saved.ckpt}: no expert weights of transformer layer {layer}")
    return names


def _dense_file(ckpt: Path) -> dict[str, torch.Tensor]:
    """A ZeRO-0/1/2 save's non-expert weights and buffers (embedding, attention, norms, routers,
    dense FFNs), mapped from its dense file: each tensor is read where it is used."""
    state = safe_torch_load(Path(ckpt) / DENSE_FILE, mmap=True)
    if not isinstance(state, dict) or "module" not in state:
        raise CheckpointError(f"{Path(ckpt) / DENSE_FILE}: no 'module' state dict inside")
    return dict(state["module"])


def check_experts(ckpt: Path, cfg: Config) -> None:
    """CheckpointError when an expert of an MoE layer is missing (any ZeRO stage)."""
    saved = zero3_partitions(Path(ckpt))
    if saved is None:
        expert_files(ckpt, cfg)
        return
    for layer in cfg.moe.moe_layers(cfg.model.n_blocks):
        for name in _expert_names(saved, layer):
            if (shape := saved.full_shape(name))[0] != cfg.moe.num_experts:
                raise CheckpointError(
                    f"{ckpt}: {name} holds {shape[0]} experts, the config {cfg.moe.num_experts}"
                )


def expert_files(ckpt: Path, cfg: Config) -> dict[int, list[Path]]:
    """Expert files per transformer layer index, in global expert order; refuses gaps."""
    ckpt = Path(ckpt)
    moe_ids = cfg.moe.moe_layers(cfg.model.n_blocks)
    out: dict[int, list[Path]] = {}
    for moe_idx, layer in enumerate(moe_ids):
        files = []
        for e in range(cfg.moe.num_experts):
            f = ckpt / expert_file(moe_idx, e)
            if not f.is_file():
                raise CheckpointError(
                    f"{f}: missing (expert {e} of MoE layer {moe_idx}, transformer layer {layer})"
                )
            files.append(f)
        out[layer] = files
    extra = [
        p.name
        for p in ckpt.iterdir()
        if (m := EXPERT_FILE_RE.match(p.name))
        and (int(m.group(1)) >= len(moe_ids) or int(m.group(2)) >= cfg.moe.num_experts)
    ]
    if extra:
        raise CheckpointError(f"{ckpt}: expert files that this config does not have: {extra}")
    return out


def stacked_experts(
    files: list[Path], layer: int, first: int = 0, names: tuple[str, ...] = EXPERT_WEIGHTS
) -> dict[str, torch.Tensor]:
    """Load one layer's per-expert files (global experts ``first``, ``first + 1``, ...) into
    stacked ``w13 (E,D,2F)``, ``w2 (E,F,D)`` (``names``: those and, with
    ``moe.expert_biases``, the biases: :func:`expert_param_names`)."""
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    prefix = param_names.experts_prefix(layer)
    for e, f in enumerate(files, start=first):
        sd = safe_torch_load(f)
        found = {}
        for key, tensor in sd.items():
            m = EXPERT_KEY_RE.match(key)
            if not m or m.group(1) != prefix or int(m.group(2)) != e:
                raise CheckpointError(
                    f"{f}: unexpected key {key} (expected layer {layer}, expert {e})"
                )
            found[m.group(3)] = tensor
        if set(found) != set(parts):
            old = " (separate w1/w3: written before the packed w13 layout)" if "w1" in found else ""
            raise CheckpointError(f"{f}: has {sorted(found)}, expected {sorted(parts)}{old}")
        for name, tensor in found.items():
            parts[name].append(tensor)
    return {prefix + name: torch.stack(ts) for name, ts in parts.items()}


class CheckpointTensors:
    """A committed checkpoint's model tensors (any ZeRO stage), read a few at a time for the run
    ``cfg`` (the checkpoint's own model): :meth:`dense` the non-expert tensors asked for,
    :meth:`experts` one MoE layer's experts ``[start, stop)``.

    At ZeRO-0/1/2 the dense file is mapped (each tensor read where it is used) and the experts
    come from their own files. At ZeRO-3 each tensor is assembled from the ranks' partitions of
    it (:class:`SavedOptimizer`, its files mapped): a dense tensor from every rank's partition,
    an expert stack from the files of the saved expert-parallel ranks that hold those experts
    only; the buffers are whole in every rank's model file."""

    def __init__(self, ckpt: Path, cfg: Config) -> None:
        self.ckpt, self.cfg = Path(ckpt), cfg
        self.saved = zero3_partitions(self.ckpt)
        self.moe_layers = cfg.moe.moe_layers(cfg.model.n_blocks)
        self._mapped: dict[str, torch.Tensor] | None = None
        if self.saved is None:
            self.files = expert_files(self.ckpt, cfg)

    def dense_names(self) -> list[str]:
        """Every non-expert tensor of the checkpoint (parameters, tied names and buffers)."""
        if self.saved is None:
            return list(self._dense_file())
        saved = self.saved
        params = [n for n in saved.param_names() if not is_expert_param(n)]
        return params + list(saved.aliases) + list(saved.buffers)

    def dense(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The non-expert tensors ``names`` that the checkpoint holds (the others left out)."""
        if self.saved is None:
            dense = self._dense_file()
            return {k: dense[k] for k in names if k in dense}
        saved, out = self.saved, {}
        params = set(saved.param_names())
        for name in names:
            if name in saved.buffers:
                out[name] = saved.buffers[name]
            elif (param := saved.aliases.get(name, name)) in params and not is_expert_param(param):
                out[name] = saved.full(param, MASTER)  # a tied head: one parameter, two names
        return out

    def experts(self, layer: int, start: int, stop: int) -> dict[str, torch.Tensor]:
        """MoE layer ``layer``'s stacked expert tensors, experts ``[start, stop)``; nothing for
        a layer without experts."""
        if layer not in self.moe_layers:
            return {}
        if self.saved is None:
            names = expert_param_names(self.cfg.moe.expert_biases)
            return stacked_experts(self.files[layer][start:stop], layer, start, names)
        saved = self.saved
        return {n: saved.expert_rows(n, MASTER, start, stop) for n in _expert_names(saved, layer)}

    def _dense_file(self) -> dict[str, torch.Tensor]:
        if self._mapped is None:
            self._mapped = _dense_file(self.ckpt)
        return self._mapped


def iter_layer_states(
    ckpt: Path, cfg: Config, experts: tuple[int, int] | None = None
) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """Yield ``("dense", non-expert state)`` then ``("layers.<i>", that layer's experts)``
    (``experts``: the global experts ``[start, stop)`` to read, default all of them).

    Memory stays near the dense weights plus one layer's experts (the converter streams this).
    """
    tensors = CheckpointTensors(ckpt, cfg)
    yield "dense", tensors.dense(tensors.dense_names())
    start, stop = experts or (0, cfg.moe.num_experts)
    for layer in tensors.moe_layers:
        yield f"layers.{layer}", tensors.experts(layer, start, stop)


def load_model(ckpt: Path, cfg: Config | None = None) -> tuple[torch.nn.Module, Config]:
    """Build a single-device ``Transformer`` holding the checkpoint's weights."""
    from moetrain.model.transformer import Transformer

    ckpt = Path(ckpt)
    verify_manifest(ckpt)
    cfg = cfg or checkpoint_config(ckpt)
    model = Transformer(cfg.model, cfg.moe)
    state: dict[str, torch.Tensor] = {}
    for _, part in iter_layer_states(ckpt, cfg):
        state.update(part)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(
            f"{ckpt}: weights do not fit the model: missing {missing}, unexpected {unexpected}"
        )
    return model, cfg
