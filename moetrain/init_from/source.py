"""``checkpoint.init_from``: where a run's first weights come from, and the config they imply.

A source is a Hugging Face model directory (``config.json`` + safetensors) of a registered
family (:mod:`moetrain.convert.families`: an MoE family, or a dense one, which is upcycled into
the configured MoE), a committed moetrain checkpoint, or a run directory (its newest complete
checkpoint). Opening a source checks everything that can be checked without reading a tensor:
the path exists, the architecture is supported, every weight file is present and as long as its
header (or the checkpoint's manifest) says. A checkpoint's CRC-32s are checked once per start,
each file by one rank (:func:`moetrain.train.start.open_start`).

The model shape comes from the source: :func:`resolve_config_data` fills the ``model`` keys
(and for an MoE source the ``moe`` keys) that define the function (the config fields marked
``function`` in their metadata) from it, and refuses a config that sets one of them to something
else, naming the key and both values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetrain.checkpoint.catalog import latest_complete
from moetrain.checkpoint.compat import function_keys
from moetrain.checkpoint.format import (
    STATE_FILE,
    CheckpointError,
    TrainerState,
    checkpoint_root,
    is_complete,
    verify_manifest,
)
from moetrain.checkpoint.read import check_experts, checkpoint_config
from moetrain.config import Config, ConfigError, ModelConfig, MoEConfig, config_from_dict
from moetrain.convert.families import of_hf_config, unwrap, wrapper_of
from moetrain.convert.families.base import declared_mtp_layers
from moetrain.convert.formats import config_from_hf, not_supported
from moetrain.convert.hf_files import HFWeights
from moetrain.convert.quantized import Quantization, quantization_of
from moetrain.convert.stored_mtp import stored_mtp_depth
from moetrain.init_from.upcycle import check_upcycle

MODEL_KEYS = function_keys(ModelConfig)
MOE_KEYS = function_keys(MoEConfig)
# Taken from the source unless the config sets them (the RoPE table size, the init scale).
MODEL_DEFAULTS = ("max_seq_len", "init_std")
HF_CONFIG = "config.json"


@dataclass
class InitSource:
    """An opened ``checkpoint.init_from``; ``config`` is the source model's own config."""

    requested: str
    path: Path
    kind: str  # "huggingface" | "checkpoint"
    config: Config
    family: str | None = None  # a registered Hugging Face family
    architecture: str | None = None
    upcycle: bool = False  # a dense model, upcycled into the configured MoE
    step: int | None = None  # a checkpoint's step
    # a family's model inside a larger class's directory (a Wrapper): its tensors' name prefixes
    # there -> the family's own, and what of the directory is not taken
    renames: dict[str, str] = field(default_factory=dict)
    not_taken: str | None = None
    quantization: Quantization | None = None  # its quantization_config (read dequantized)

    def describe(self) -> str:
        """What the source is, e.g. ``Hugging Face MixtralForCausalLM (MoE)``."""
        if self.kind == "checkpoint":
            return f"moetrain checkpoint, step {self.step}"
        kind = "dense, upcycled" if self.upcycle else "MoE"
        if self.quantization is not None:
            kind += f"; {self.quantization.describe()}, read dequantized"
        if self.not_taken:
            kind += f"; {self.not_taken}"
        return f"Hugging Face {self.architecture} ({kind})"

    def weights(self) -> HFWeights:
        """A Hugging Face source's weight files (the family's tensors, named as its own
        directory names them; quantized ones dequantized)."""
        return HFWeights(self.path, self.renames, self.quantization)


def _hf_source(spec: str, path: Path) -> InitSource:
    try:
        hf = json.loads((path / HF_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path / HF_CONFIG}: unreadable ({e})") from None
    fam = of_hf_config(hf)
    if fam is None:
        raise ConfigError(f"checkpoint.init_from={spec}: {not_supported(hf)}")
    cfg = config_from_hf(hf)
    wrapper = wrapper_of(hf)
    renames = dict(wrapper.tensors) if wrapper is not None else {}
    quantization = quantization_of(hf, unwrap(hf))
    weights = HFWeights(path, renames, quantization)  # every file present, every scale too
    not_taken = None
    if wrapper is not None:  # the family's model; the rest must be what the wrapper adds
        foreign = [n for n in weights.others if not n.startswith(wrapper.left_out)]
        if foreign:
            ours = ", ".join(p + "*" for p in renames)
            raise CheckpointError(
                f"{path}: tensor {foreign[0]} is neither {wrapper.architecture}'s text model "
                f"({ours}) nor {wrapper.what} ({', '.join(p + '*' for p in wrapper.left_out)})"
            )
        not_taken = (
            f"the text model of a {wrapper.architecture} directory; {wrapper.what} "
            f"({', '.join(p + '*' for p in wrapper.left_out)}, {len(weights.others)} tensors) "
            "is not taken"
        )
    if fam.layout.mtp is not None:  # the MTP modules its files hold (a run reads some or all)
        n, declared = cfg.model.n_layers, declared_mtp_layers(unwrap(hf), fam.layout)
        try:
            cfg.model.mtp_depth = stored_mtp_depth(fam.layout, weights.names(), n, declared)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
    return InitSource(
        spec,
        path,
        "huggingface",
        cfg,
        fam.name,
        fam.architecture,
        fam.dense,
        renames=renames,
        not_taken=not_taken,
        quantization=quantization,
    )


def _checkpoint_source(spec: str, path: Path) -> InitSource:
    verify_manifest(path, crc=False)  # complete, nothing missing or truncated
    cfg = checkpoint_config(path)
    check_experts(path, cfg)  # every expert of every MoE layer present (any ZeRO stage)
    step = TrainerState.read(path).step
    return InitSource(spec, path, "checkpoint", cfg, step=step)


def open_init_source(spec: str) -> InitSource:
    """Open and check ``checkpoint.init_from`` (see the module docstring)."""
    path = Path(spec).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint.init_from={spec}: does not exist")
    if (path / HF_CONFIG).is_file():
        return _hf_source(spec, path)
    if (path / STATE_FILE).is_file() or is_complete(path):
        return _checkpoint_source(spec, path)
    root = checkpoint_root(path)
    if root.is_dir():
        latest = latest_complete(root)
        if latest is None:
            raise CheckpointError(
                f"checkpoint.init_from={spec}: run directory has no complete checkpoint"
            )
        return _checkpoint_source(spec, latest)
    raise CheckpointError(
        f"checkpoint.init_from={spec}: neither a Hugging Face model directory ({HF_CONFIG}), "
        f"a moetrain checkpoint ({STATE_FILE}) nor a run directory (checkpoints/)"
    )


def source_settings(source: InitSource, cfg: Config) -> dict[str, Any]:
    """Dotted key -> value for every key the source decides, given the run's ``cfg`` (an
    upcycled model's expert sizes follow ``checkpoint.upcycle_granularity`` and
    ``moe.num_shared_experts``)."""
    src = source.config
    fixed = {f"model.{k}": getattr(src.model, k) for k in MODEL_KEYS}
    every_moe = len(src.moe.moe_layers(src.model.n_layers)) == src.model.n_layers
    if every_moe and not src.moe.dense_branch:
        del fixed["model.dense_hidden"]  # no dense FFN: the value means nothing
    if not source.upcycle:
        return fixed | {f"moe.{k}": getattr(src.moe, k) for k in MOE_KEYS}
    hidden, g = src.model.dense_hidden, cfg.checkpoint.upcycle_granularity
    if hidden % g == 0:
        fixed["moe.expert_hidden"] = hidden // g
    if cfg.moe.num_shared_experts:
        fixed["moe.shared_expert_hidden"] = hidden
    return fixed


def _given(data: dict[str, Any], prefix: str = "") -> set[str]:
    """The dotted keys a raw config dict sets."""
    out: set[str] = set()
    for k, v in data.items():
        out |= _given(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}"}
    return out


def _set(cfg: Config, key: str, value: Any) -> None:
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, value)


def _conflict(key: str, ours: Any, theirs: Any, source: InitSource) -> ConfigError:
    return ConfigError(
        f"{key}: the config sets {ours!r}, but checkpoint.init_from={source.requested} "
        f"({source.describe()}) has {theirs!r}; remove the setting or make them agree"
    )


def resolve_config_data(data: dict[str, Any]) -> tuple[Config, InitSource | None]:
    """The run's Config from its raw YAML + overrides ``data``. With ``checkpoint.init_from``
    the source decides the model: keys the config leaves out are taken from it (and
    ``data.seq_len`` is capped at its context), a key set to another value is a ConfigError
    naming the key and both values. Returns (validated config, opened source or None)."""
    spec = (data.get("checkpoint") or {}).get("init_from")
    if not spec:
        return config_from_dict(data), None
    source = open_init_source(str(spec))
    given = _given(data)
    cfg = config_from_dict(data, validate=False)
    for key in MODEL_DEFAULTS:
        if f"model.{key}" not in given:
            _set(cfg, f"model.{key}", getattr(source.config.model, key))
    for key, value in source_settings(source, cfg).items():
        if key not in given:
            _set(cfg, key, value)
    if "data.seq_len" not in given:
        cfg.data.seq_len = min(cfg.data.seq_len, cfg.model.max_seq_len)
    check_config_fits(cfg, source)
    cfg.validate()
    return cfg, source


def resolve_resumed_config_data(data: dict[str, Any], ckpt: Path) -> Config:
    """The Config of a run that will resume ``ckpt`` although it names a
    ``checkpoint.init_from``: the model keys the config leaves out come from the checkpoint's
    own resolved config (what the source gave the first start), so the source is not opened."""
    saved = checkpoint_config(ckpt)
    given = _given(data)
    cfg = config_from_dict(data, validate=False)
    keys = [f"model.{k}" for k in (*MODEL_KEYS, *MODEL_DEFAULTS)] + [f"moe.{k}" for k in MOE_KEYS]
    for key in keys:
        if key not in given:
            section, name = key.split(".")
            _set(cfg, key, getattr(getattr(saved, section), name))
    if "data.seq_len" not in given:
        cfg.data.seq_len = min(cfg.data.seq_len, cfg.model.max_seq_len)
    cfg.validate()
    return cfg


def check_config_fits(cfg: Config, source: InitSource) -> None:
    """Refuse a config whose model differs from the source's (ConfigError naming the key and
    both values), or an MoE that an upcycled dense model cannot become."""
    for key, value in source_settings(source, cfg).items():
        section, name = key.split(".")
        ours = getattr(getattr(cfg, section), name)
        if ours != value:
            raise _conflict(key, ours, value, source)
    if source.upcycle:
        check_upcycle(cfg, source.config.model.dense_hidden)
