"""The weights of a ``checkpoint.init_from`` source, streamed, and a model built from them.

:func:`source_parts` yields what :func:`moetrain.checkpoint.read.iter_layer_states` yields for a
checkpoint (``("dense", non-expert state)``, then ``("layers.<i>", stacked experts)`` per MoE
layer), for any source, reading only the experts ``[start, stop)`` that are asked for: an
expert-parallel rank reads its own experts from the safetensors files, nothing else, and holds
at most the dense weights plus one layer of experts besides the model. A dense source is
upcycled on the fly (:mod:`moetrain.init_from.upcycle`).

:func:`build_model` builds the run's model on the meta device (no random init), allocates it
and fills every parameter and buffer from the source; :func:`check_source_tensors` checks every
tensor's name and shape against the model before anything is read.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from typing import Any

import torch

from moetrain.checkpoint.format import CheckpointError
from moetrain.checkpoint.read import iter_layer_states
from moetrain.config import Config, MoEConfig
from moetrain.convert.families import family, unwrap
from moetrain.convert.families.base import declared_mtp_layers
from moetrain.convert.hf_files import HFWeights
from moetrain.convert.weight_map import ZERO_ONLY, WeightMap, decoder_layer
from moetrain.init_from.source import HF_CONFIG, InitSource
from moetrain.init_from.upcycle import inexact_reasons, upcycled_dense_part, upcycled_experts
from moetrain.model import param_names as pn
from moetrain.model.transformer import Transformer

Part = tuple[str, dict[str, torch.Tensor]]
# tensors a file may hold that the model does not read: rotary tables (and ZERO_ONLY's)
_ROTARY = re.compile(r"rotary_emb\.inv_freq$")
# multi-token-prediction modules as ERNIE-4.5's released checkpoints store them:
# model.mtp_block.<k>.*, model.mtp_emb_norm.<k>, model.mtp_hidden_norm.<k>,
# model.mtp_linear_proj.<k>
_MTP_NAME = re.compile(r"^(model\.mtp_\w+\.\d+\.|model\.mtp\.|mtp\.)")


def _read_config(source: InitSource, mtp_depth: int) -> Config:
    """The source's config with the ``mtp_depth`` multi-token-prediction modules a run reads."""
    src = source.config
    return dataclasses.replace(src, model=dataclasses.replace(src.model, mtp_depth=mtp_depth))


def source_map(source: InitSource, files: HFWeights, mtp_depth: int = 0) -> WeightMap:
    """The weight map of a Hugging Face source's model with ``mtp_depth`` multi-token-prediction
    modules, in the names its ``files`` hold (an MoE source's: its files', or transformers v5's
    in-memory ones)."""
    present = None if source.upcycle else files.weight_map
    return WeightMap(_read_config(source, mtp_depth), source.family, present)


def expected_hf_shapes(source: InitSource, mtp_depth: int = 0) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor the source must hold for a model with ``mtp_depth``
    multi-token-prediction modules -> its shape (the zeros a family's class always holds where
    the source has them: they are not read)."""
    files = source.weights()
    weights = source_map(source, files, mtp_depth)
    return {
        name: shape
        for part in (None, *weights.moe_layers)
        for name, shape, _ in weights.hf_tensors(part)
        if name not in weights.fillers or name in files.shapes
    }


def unread_tensors(source: InitSource, expected: set[str]) -> list[str]:
    """The tensors of a Hugging Face source that the model would not read, apart from the
    tolerated ones (rotary tables, attention biases read only to check that they are zero, a
    tied head, and the multi-token-prediction layers, after the last decoder layer or under
    ``model.mtp_*``, ``model.mtp.`` (MiMo-V2-Flash's) or ``mtp.`` names, when config.json
    declares them (or the family holds them undeclared, ``Layout.mtp_unread``), which
    transformers ignores too)."""
    hf = json.loads((source.path / HF_CONFIG).read_text())
    layout = family(source.family).layout
    mtp = declared_mtp_layers(unwrap(hf), layout) > 0 or layout.mtp_unread
    n_layers, tied = source.config.model.n_layers, source.config.model.tie_embeddings
    out = []
    for name in source.weights().names():
        tolerated = _ROTARY.search(name) or ZERO_ONLY.search(name)
        if name in expected or tolerated or (tied and name == "lm_head.weight"):
            continue
        if mtp and decoder_layer(name) >= n_layers:
            continue
        if mtp and _MTP_NAME.match(name):
            continue
        out.append(name)
    return out


def check_source_tensors(source: InitSource, mtp_depth: int = 0) -> None:
    """Every tensor a model with ``mtp_depth`` multi-token-prediction modules needs is in the
    source with the right shape, and every tensor of the source is read (:func:`unread_tensors`);
    reads headers only. CheckpointError naming the tensor (and both shapes), or a deeper
    ``mtp_depth`` than the source has."""
    have = source.config.model.mtp_depth
    if mtp_depth > have:
        raise CheckpointError(
            f"model.mtp_depth={mtp_depth}: {source.path} has {have} multi-token-prediction "
            f"module(s); set model.mtp_depth <= {have} (0 leaves them unread)"
        )
    if source.kind != "huggingface":
        return  # a checkpoint's files are checked by its manifest and against its own config
    weights = source.weights()
    expected = expected_hf_shapes(source, mtp_depth)
    unread = unread_tensors(source, set(expected))
    if unread:
        more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
        raise CheckpointError(
            f"{source.path}: tensor {unread[0]}{more} is not part of the model its config.json "
            f"describes ({source.describe()}); moetrain would drop it"
        )
    for name, shape in expected.items():
        if name not in weights.shapes:
            raise CheckpointError(f"{source.path}: tensor {name} is missing")
        if weights.shapes[name] != shape:
            raise CheckpointError(
                f"{source.path}: tensor {name} has shape {list(weights.shapes[name])}; its "
                f"config.json ({source.describe()}) needs {list(shape)}"
            )


def _moe_hf_parts(
    source: InitSource,
    experts: tuple[int, int],
    into: dict[str, torch.Tensor] | None,
    mtp_depth: int,
) -> Iterator[Part]:
    files = source.weights()
    weights = source_map(source, files, mtp_depth)
    yield "dense", weights.read_dense(files)
    for layer in weights.moe_layers:
        yield f"layers.{layer}", weights.read_experts(files, layer, experts, into)


def dense_source_map(source: InitSource, cfg: Config) -> WeightMap:
    """The weight map of a dense source upcycled into ``cfg``'s MoE (read as the dense model)."""
    return WeightMap(
        Config(model=cfg.model, moe=MoEConfig(first_k_dense=cfg.model.n_layers)), source.family
    )


def upcycled_ffns(cfg: Config) -> set[str]:
    """The dense FFN weights of the layers ``cfg`` makes MoE (read only to be upcycled)."""
    return {
        pn.dense_ffn(layer, w)
        for layer in cfg.moe.moe_layers(cfg.model.n_layers)
        for w in pn.SWIGLU_WEIGHTS
    }


def dense_ffn(weights: WeightMap, files: HFWeights, layer: int) -> list[torch.Tensor]:
    """A dense source's FFN gate, up and down weights of ``layer`` (HF layout)."""
    names = [weights.hf_name(pn.dense_ffn(layer, w)) for w in pn.SWIGLU_WEIGHTS]
    t = files.load(names)
    return [t[n] for n in names]


def _upcycled_parts(source: InitSource, cfg: Config, experts: tuple[int, int]) -> Iterator[Part]:
    """A dense source's weights as is, but the FFNs of the layers ``cfg`` makes MoE: those
    upcycled, a layer at a time."""
    weights, files = dense_source_map(source, cfg), source.weights()
    moe_layers = cfg.moe.moe_layers(cfg.model.n_layers)
    state = weights.read_dense(files, upcycled_ffns(cfg))
    for layer in moe_layers:
        state |= upcycled_dense_part(*dense_ffn(weights, files, layer), cfg, layer)
    yield "dense", state
    del state
    for layer in moe_layers:
        yield (
            f"layers.{layer}",
            upcycled_experts(*dense_ffn(weights, files, layer), cfg, layer, experts),
        )


def source_parts(
    source: InitSource,
    cfg: Config,
    experts: tuple[int, int] | None = None,
    into: dict[str, torch.Tensor] | None = None,
) -> Iterator[Part]:
    """The run's weights from ``source`` in parts (see the module docstring); ``experts``:
    the global experts to read, default all of them. ``into``: a model's state dict whose
    expert tensors a Hugging Face MoE source may fill in place (the parts then hold them).
    The source's multi-token-prediction modules beyond ``model.mtp_depth`` are left out
    (:func:`check_source_tensors` refuses a deeper one)."""
    experts = experts or (0, cfg.moe.num_experts)
    have, want = source.config.model.mtp_depth, cfg.model.mtp_depth
    if source.upcycle:
        return _upcycled_parts(source, cfg, experts)
    if source.kind == "huggingface":
        return _moe_hf_parts(source, experts, into, want)
    parts = iter_layer_states(source.path, source.config, experts)
    return parts if want == have else _first_blocks(parts, cfg.model.n_blocks)


def _first_blocks(parts: Iterator[Part], n: int) -> Iterator[Part]:
    """``parts`` without the blocks from ``n`` on (MTP modules the run switched off)."""
    for where, part in parts:
        if where == "dense" or _block(where + ".") < n:
            yield where, {k: v for k, v in part.items() if _block(k) < n}


def init_record(source: InitSource, cfg: Config) -> dict[str, Any]:
    """What was loaded from where: written into every checkpoint's trainer state."""
    record: dict[str, Any] = {
        "from": str(source.path),
        "requested": source.requested,
        "kind": source.kind,
        "architecture": source.architecture,
        "step": source.step,
        "upcycled": None,
    }
    unread = source.config.model.mtp_depth - cfg.model.mtp_depth
    if unread > 0:
        record["mtp_modules_not_read"] = unread
    if source.not_taken:
        record["not_taken"] = source.not_taken
    if source.quantization is not None:
        record["dequantized"] = source.quantization.describe()
    if source.upcycle:
        reasons = inexact_reasons(cfg)
        record["upcycled"] = {
            "granularity": cfg.checkpoint.upcycle_granularity,
            "noise": cfg.checkpoint.upcycle_noise,
            "router_init": "normal(0, model.init_std), one row per virtual group",
            "dense_function_at_step_0": not reasons,
            "inexact_because": reasons,
        }
    return record


def _block(name: str) -> int:
    """The block index of a moetrain tensor name (-1 outside ``layers``)."""
    m = re.match(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def build_model(
    cfg: Config, source: InitSource, local_experts: tuple[int, int] | None = None
) -> Transformer:
    """The run's model holding ``source``'s weights (only ``local_experts`` of each MoE layer
    when given), in fp32. No random init: built on the meta device, then every parameter and
    persistent buffer is filled from the source (CheckpointError naming what is missing,
    unexpected or of the wrong shape)."""
    check_source_tensors(source, cfg.model.mtp_depth)
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.moe, local_experts=local_experts)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty unties a shared head
    model.reset_rope()
    targets = model.state_dict(keep_vars=True)
    filled: set[str] = set()
    for where, part in source_parts(source, cfg, local_experts, into=targets):
        filled |= copy_part(part, targets, f"{source.path} ({where})")
        del part
    check_filled(targets, filled, source.path)
    return model


@torch.no_grad()
def copy_part(
    part: dict[str, torch.Tensor], targets: dict[str, torch.Tensor], where: str
) -> set[str]:
    """Copy a part of the source's weights into the model's ``targets`` (tensors the source
    filled in place are left as they are); -> the names copied. CheckpointError naming a
    tensor the model has none of or one of the wrong shape (``where``: the part)."""
    for name, tensor in part.items():
        target = targets.get(name)
        if target is None:
            raise CheckpointError(f"{where}: unexpected tensor {name}")
        if target.shape != tensor.shape:
            raise CheckpointError(
                f"{where}: {name} has shape {list(tensor.shape)}; the model needs "
                f"{list(target.shape)}"
            )
        if tensor is not target:
            target.copy_(tensor)
    return set(part)


def check_filled(targets: dict[str, torch.Tensor], filled: set[str], path: Any) -> None:
    """CheckpointError naming the first tensors of ``targets`` the source had no weights for."""
    missing = sorted(set(targets) - filled)
    if missing:
        raise CheckpointError(f"{path}: no weights for {missing[:5]}")
