"""What a resume may change, and what it may not: the run's config against the checkpoint's.

A resume continues the function the checkpoint's model computes, on the data position it
saved. It is refused, naming each key with both values, when the config changes:

- a key that defines the model's function (the fields marked ``function`` in their metadata,
  :func:`function_keys`, the keys a ``checkpoint.init_from`` source decides) or the number of
  multi-token-prediction modules (``model.mtp_depth``, whose weights the checkpoint holds);
- a key the saved data position depends on (:data:`DATA_POSITION_KEYS`: the loader continues
  the same permutation of the same sequences);
- a key whose optimizer files cannot be read on another setting (:data:`UNRESHARDABLE_KEYS`:
  the precision, and ``optim.name``, whose state another optimizer cannot continue; both may
  change with ``--reset-optimizer``, which reads no optimizer file);
- the tokenizer the data was tokenized with (its sha256).

Everything else may change between a save and a resume (CHECKPOINTS.md lists them): the
schedule, learning rate and steps, logging, evaluation and checkpoint cadence, data mixture
weights, the MoE's training settings (capacity factor, balancing loss weights, bias update
rate), and the layout: world size, ``parallel.ep_size``, ``parallel.zero_stage`` and
``parallel.sp_size`` (the optimizer state is re-partitioned, :mod:`moetrain.checkpoint.reshard`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moetrain.config import Config, ModelConfig, MoEConfig
from moetrain.model.mtp import MTP_CHAIN

DATA_POSITION_KEYS = ("seed", "data.seq_len")
UNRESHARDABLE_KEYS = ("train.precision", "optim.name")


def function_keys(section: type) -> tuple[str, ...]:
    """The fields of a config section that define the function the model computes (marked
    ``function`` in their metadata)."""
    return tuple(f.name for f in dataclasses.fields(section) if f.metadata.get("function"))


def fixed_keys() -> tuple[str, ...]:
    """Every dotted key a resume may not change (the module docstring)."""
    model = [f"model.{k}" for k in (*function_keys(ModelConfig), "mtp_depth")]
    moe = [f"moe.{k}" for k in function_keys(MoEConfig)]
    return (*model, *moe, *DATA_POSITION_KEYS, *UNRESHARDABLE_KEYS)


_MISSING = object()


def _value(tree: dict[str, Any], key: str) -> Any:
    """The value of dotted ``key`` in a config dict, :data:`_MISSING` when it has none."""
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def resume_conflicts(
    cfg: Config,
    saved: dict[str, Any],
    saved_tokenizer: str | None,
    tokenizer: str | None,
) -> list[str]:
    """``"key: the checkpoint has A, the config sets B"`` for every key of :func:`fixed_keys`
    on which ``cfg`` and the checkpoint's resolved config ``saved`` (its dict) disagree, and
    the tokenizer's sha256 when both are known and differ."""
    ours, defaults = cfg.to_dict(), Config().to_dict()
    out = []
    for key in fixed_keys():
        theirs, mine = _value(saved, key), _value(ours, key)
        if theirs is _MISSING:  # a key the checkpoint's moetrain did not have yet
            theirs = _value(defaults, key)
        if theirs != mine:
            out.append(f"{key}: the checkpoint has {theirs!r}, the config sets {mine!r}")
    if saved_tokenizer and tokenizer and saved_tokenizer != tokenizer:
        out.append(
            f"the tokenizer: the checkpoint's data was tokenized with sha256 {saved_tokenizer}, "
            f"this run's data with {tokenizer}"
        )
    return out


def mtp_chain_note(saved: dict[str, Any], chain: str | None) -> str | None:
    """What changed for a checkpoint whose multi-token-prediction modules were trained with
    another chaining than :data:`~moetrain.model.mtp.MTP_CHAIN` (``chain``: the checkpoint's
    record, None before it was recorded); None when nothing did (fewer than 2 depths)."""
    depth = saved.get("model", {}).get("mtp_depth", 0)
    if depth < 2 or chain == MTP_CHAIN:
        return None
    return (
        f"its {depth} multi-token-prediction depths were trained handing each depth the "
        "previous one's hidden state before its head norm; this moetrain hands it the state "
        "after that norm (shared_head.norm), as transformers' MtpModel does: depths 2 to "
        f"{depth} compute another function from here on (the main model and depth 1 do not "
        "change), and their loss may rise for a while"
    )
