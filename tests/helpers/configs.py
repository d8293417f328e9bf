"""The tests' tiny model, defined once: a validated ``Config`` for in-process tests
(:func:`tiny_config`) and the same model as command-line overrides for tests that start
``python -m moetrain ...`` (:func:`tiny_args`, :func:`cli_args`).

All three take the same arguments, applied left to right after :data:`TINY`:

- positional ``"key=value"`` strings, parsed as on the command line (``"moe.top_k=1"``), or
  mappings of dotted keys to Python values (``{"moe.top_k": 1}``);
- keyword settings, with ``__`` for the dot (``moe__top_k=1``, ``seed=7``).

Tests pass only what differs from :data:`TINY` and rely on the rest (shapes they spell out,
tolerances chosen for this size): changing a value of :data:`TINY` changes those tests too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moetrain.config import Config, apply_overrides, config_from_dict

# The tiny model most tests use. On top of the project's defaults; it names every model and moe
# key that configs/tiny-cpu.yaml sets to a non-default value, so that tiny_args() gives this
# model on top of that file too (tests/unit/test_helpers.py checks it).
TINY: dict[str, Any] = {
    "model.vocab_size": 64,
    "model.d_model": 32,
    "model.n_layers": 2,
    "model.n_heads": 4,
    "model.n_kv_heads": 2,
    "model.dense_hidden": 48,
    "model.max_seq_len": 64,
    "moe.num_experts": 4,
    "moe.top_k": 2,
    "moe.expert_hidden": 16,
    "data.seq_len": 32,  # the default (256) would exceed model.max_seq_len
}

# The model of the tests that train through the real CLI on a prepared corpus: a vocabulary a
# SentencePiece tokenizer trained on the generated corpus fills (byte fallback and specials
# alone take 261 pieces), and configs/tiny-cpu.yaml's 8 experts and RoPE table.
CLI_MODEL: dict[str, Any] = {
    "model.vocab_size": 512,
    "model.d_model": 64,
    "model.dense_hidden": 128,
    "model.max_seq_len": 256,
    "moe.num_experts": 8,
    "moe.expert_hidden": 64,
    "data.seq_len": 64,
}

# Settings of every CLI run: one tokenizer process, quick failure, a log line and a loss record
# every step, no evaluation, no wandb.
CLI_RUN: dict[str, Any] = {
    "data.num_proc": 1,
    "parallel.timeout_minutes": 2,
    "optim.warmup_steps": 2,
    "train.log_every": 1,
    "train.eval_every": 0,
    "logging.wandb.mode": "disabled",
}

Override = str | Mapping[str, Any]


class _Text(str):
    """The value of a ``key=value`` string: parsed with the command line's rules."""


def _merged(overrides: tuple[Override, ...], settings: dict[str, Any]) -> dict[str, Any]:
    """TINY, then ``overrides``, then ``settings`` -> dotted key -> value. Values of ``"k=v"``
    strings stay text (:class:`_Text`) until they are parsed as the command line parses them."""
    out: dict[str, Any] = dict(TINY)
    for item in overrides:
        if isinstance(item, str):
            if "=" not in item:
                raise ValueError(f"override {item!r}: expected KEY=VALUE, e.g. moe.top_k=1")
            key, text = item.split("=", 1)
            out.pop(key.strip(), None)  # a later value moves its key last, as on a command line
            out[key.strip()] = _Text(text)
        else:
            for key, value in item.items():
                out.pop(key, None)
                out[key] = value
    for key, value in settings.items():
        key = key.replace("__", ".")
        out.pop(key, None)
        out[key] = value
    return out


def _as_text(value: Any) -> str:
    if isinstance(value, _Text):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


def tiny_config(*overrides: Override, **settings: Any) -> Config:
    """The tiny model (:data:`TINY` on the project's defaults) with ``overrides`` and
    ``settings`` applied in order, validated like a config file.

    ``tiny_config("moe.top_k=1", seed=7)``, ``tiny_config({"model.d_model": 64}, moe__top_k=1)``.
    """
    data: dict[str, Any] = {}
    for key, value in _merged(overrides, settings).items():
        if isinstance(value, _Text):
            apply_overrides(data, [f"{key}={value}"])
        else:
            node = data
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
    return config_from_dict(data)


def tiny_args(*overrides: Override, **settings: Any) -> list[str]:
    """The same model as :func:`tiny_config` with the same arguments, as ``key=value``
    command-line overrides (on the defaults, or on configs/tiny-cpu.yaml for the model)."""
    return [f"{k}={_as_text(v)}" for k, v in _merged(overrides, settings).items()]


def cli_args(*overrides: Override, **settings: Any) -> list[str]:
    """:func:`tiny_args` for the tests that train through the CLI: :data:`CLI_MODEL` and
    :data:`CLI_RUN`, then ``overrides`` and ``settings``."""
    return tiny_args(CLI_MODEL, CLI_RUN, *overrides, **settings)
