"""Keeping secrets (WANDB_API_KEY, tokens, passwords) out of logs, configs and checkpoints."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

REDACTED = "<redacted>"
_SECRET_WORDS = {
    "key",
    "apikey",
    "token",
    "secret",
    "password",
    "passwd",
    "credential",
    "credentials",
    "auth",
    "authorization",
    "passphrase",
}


def is_secret_key(key: str) -> bool:
    """True for names like ``api_key``, ``WANDB_API_KEY``, ``hfToken``, ``db-password``."""
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(key)).lower()
    parts = [p for p in re.split(r"[^a-z0-9]+", words) if p]
    return any(p in _SECRET_WORDS for p in parts) or "apikey" in words.replace("_", "")


def secret_env_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values (8+ characters) of environment variables whose names look secret."""
    env = os.environ if environ is None else environ
    return [v for k, v in env.items() if is_secret_key(k) and len(v) >= 8]


def redact(obj: Any, secrets: list[str] | None = None) -> Any:
    """A copy of a nested dict/list with secret-looking keys and secret values replaced. A
    number or a boolean is kept under any key: a size or a switch (``model.linear_key_head_dim``),
    never a credential."""
    secrets = secret_env_values() if secrets is None else secrets
    if isinstance(obj, Mapping):
        return {
            k: REDACTED if is_secret_key(k) and _may_hold_a_secret(v) else redact(v, secrets)
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return [redact(v, secrets) for v in obj]
    if isinstance(obj, str) and any(s in obj for s in secrets):
        return REDACTED
    return obj


def _may_hold_a_secret(value: Any) -> bool:
    return value is not None and not isinstance(value, (bool, int, float))
