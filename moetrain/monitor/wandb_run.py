"""A wandb sink through the real ``wandb`` library that never stops a training run.

Only global rank 0 creates a run; on every other rank the sink does nothing and never imports
wandb. The run directory is ``RUN_DIR/wandb/`` (wandb's ``dir=RUN_DIR``).

Mode (``logging.wandb.mode``: online | offline | disabled): when ``respect_env_mode`` is true
(the default) and ``WANDB_MODE`` is set in the environment, the environment wins (``dryrun`` =
offline, ``run`` = online); ``WANDB_DISABLED=true`` likewise means disabled. With
``respect_env_mode: false`` the config's mode is passed to ``wandb.init(mode=...)``, which takes
precedence over the environment inside wandb too.

Failure handling, said once on the console and never raised: wandb missing (ImportError) ->
no wandb; online without credentials (``WANDB_API_KEY``, ``wandb login``/netrc; never an
interactive prompt) or an online ``wandb.init`` failure (no network: wandb waits up to its
``init_timeout``, 90 s by default) -> falls back to an offline run under ``RUN_DIR/wandb/`` that
``wandb sync`` can upload later; if that fails too -> no wandb. A failing ``log`` disables the
sink for the rest of the run. Metrics still reach ``metrics.jsonl`` either way (the trainer's).

Resume: store :attr:`WandbSink.run_id` with each checkpoint and pass it back as ``resume_id``;
the sink calls ``wandb.init(id=resume_id, resume="allow")``. Steps never go backwards: a step
lower than the last logged one (or than the resumed run's next step) is dropped with a
one-time warning; logging the same step again adds keys to that step.

The logged config has secrets removed: any key that looks like a key/token/secret/password/
credential (``api_key``, ``hf_token``, ``password``; not ``max_tokens``) and any string value
containing the value of ``WANDB_API_KEY`` or of another secret-looking environment variable is
replaced by ``"<redacted>"``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moetrain.config import WandbConfig
from moetrain.monitor.console import Printer, console
from moetrain.rank_env import read_rank_env
from moetrain.redact import REDACTED, is_secret_key, redact, secret_env_values  # noqa: F401

_ENV_MODES = {
    "online": "online",
    "run": "online",
    "offline": "offline",
    "dryrun": "offline",
    "disabled": "disabled",
}


def resolve_mode(cfg: WandbConfig, environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(mode, why): the effective mode and where it came from (for the console line)."""
    env = os.environ if environ is None else environ
    if cfg.respect_env_mode:
        raw = env.get("WANDB_MODE", "").strip().lower()
        if raw in _ENV_MODES:
            return _ENV_MODES[raw], f"WANDB_MODE={raw} in the environment"
        if env.get("WANDB_DISABLED", "").strip().lower() in ("true", "1", "yes"):
            return "disabled", "WANDB_DISABLED in the environment"
    return cfg.mode, f"logging.wandb.mode={cfg.mode}"


def _scalar(value: Any) -> float | int | None:
    if hasattr(value, "detach"):  # torch tensor
        if value.numel() != 1:
            return None
        value = value.detach().cpu().item()
    elif hasattr(value, "item") and getattr(value, "size", 0) == 1:  # numpy scalar / 1-array
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    return None


class WandbSink:
    """Rank-0 wandb run; ``log(metrics, step)``, ``log_heatmap(load_LE, step)``, ``finish()``.

    ``config``: the resolved config as a dict (``cfg.to_dict()``, plus anything derived), logged
    after :func:`redact`. ``rank``: global rank (default: ``$RANK`` or 0). ``printer``: the
    console channel.
    """

    def __init__(
        self,
        cfg: WandbConfig,
        run_dir: str | Path,
        *,
        config: Mapping[str, Any] | None = None,
        rank: int | None = None,
        resume_id: str | None = None,
        printer: Printer = console,
    ) -> None:
        self.rank = read_rank_env().rank if rank is None else rank
        self.run_dir = Path(run_dir)
        self.printer = printer
        self.mode = "disabled"
        self.dropped_steps = 0
        self._resume_id = resume_id
        self._run_id = resume_id
        self._run: Any = None
        self._wandb: Any = None
        self._last_step: int | None = None
        self._min_step = 0
        self._warned_old_step = False
        if self.rank != 0:
            return
        mode, why = resolve_mode(cfg)
        if mode == "disabled":
            self.printer(f"wandb: disabled ({why}); metrics go to {self.run_dir}/metrics.jsonl")
            return
        try:
            import wandb
        except Exception as e:  # ImportError, or a broken install
            self.printer(f"wandb: unavailable ({type(e).__name__}: {e}); continuing without it")
            return
        self._wandb = wandb
        if mode == "online" and not self._has_credentials():
            self.printer(
                "wandb: no API key (set WANDB_API_KEY or run `wandb login`); logging offline "
                f"instead, upload later with `wandb sync {self.run_dir}/wandb/offline-run-*`"
            )
            mode = "offline"
        self._start(cfg, mode, why, config)

    def _has_credentials(self) -> bool:
        try:
            return bool(self._wandb.login(prompt=False, verify=False))
        except Exception:
            return False

    def _start(
        self, cfg: WandbConfig, mode: str, why: str, config: Mapping[str, Any] | None
    ) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        kwargs: dict[str, Any] = dict(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name,
            group=cfg.group,
            tags=list(cfg.tags) or None,
            dir=str(self.run_dir),
            config=redact(dict(config)) if config is not None else None,
        )
        if self._resume_id:
            kwargs.update(id=self._resume_id, resume="allow")
        for attempt in [mode] + (["offline"] if mode == "online" else []):
            try:
                self._run = self._wandb.init(mode=attempt, **kwargs)
            except Exception as e:
                msg = f"wandb: {attempt} init failed ({type(e).__name__}: {e})"
                if attempt == "online":
                    self.printer(f"{msg}; trying offline")
                    continue
                self.printer(f"{msg}; continuing without wandb")
                return
            self.mode = attempt
            self._run_id = self._run.id
            self._min_step = int(getattr(self._run, "step", 0) or 0)
            resumed = f", resuming id {self._resume_id}" if self._resume_id else ""
            where = getattr(self._run, "dir", self.run_dir)
            self.printer(f"wandb: {attempt} run {self._run.id} ({why}{resumed}) in {where}")
            return

    @property
    def active(self) -> bool:
        """True when a wandb run is live on this rank."""
        return self._run is not None

    @property
    def run_id(self) -> str | None:
        """The wandb run id to store with checkpoints (the given ``resume_id`` when no run was
        created here, so the id survives a run without wandb); still set after :meth:`finish`."""
        return self._run_id

    def _accept_step(self, step: int) -> bool:
        floor = self._min_step if self._last_step is None else self._last_step
        if step < floor:
            self.dropped_steps += 1
            if not self._warned_old_step:
                self._warned_old_step = True
                self.printer(
                    f"wandb: dropping step {step} (< last logged step {floor}); wandb steps "
                    "must not go backwards (warned once; count in WandbSink.dropped_steps)"
                )
            return False
        self._last_step = step
        return True

    def _safe_log(self, data: dict[str, Any], step: int) -> bool:
        try:
            self._run.log(data, step=step)
            return True
        except Exception as e:
            self.printer(f"wandb: log failed ({type(e).__name__}: {e}); wandb logging stops here")
            self._run = None
            return False

    def log(self, metrics: Mapping[str, Any], step: int) -> bool:
        """Log the scalar entries of ``metrics`` at ``step`` (numbers, bools, 1-element tensors
        and arrays; NaN/inf pass through so divergence shows; lists, strings and None are
        skipped, so the JSONL record can be passed as is). Returns True when something was
        logged."""
        if self._run is None:
            return False
        data = {}
        for k, v in metrics.items():
            x = _scalar(v)
            if k != "step" and x is not None:
                data[k] = x
        if not data or not self._accept_step(int(step)):
            return False
        return self._safe_log(data, int(step))

    def log_heatmap(
        self,
        load_LE: Any,
        step: int,
        key: str = "moe/expert_load_heatmap",
        layer_labels: Any = None,
    ) -> bool:
        """Log a (layers x experts) tokens-per-expert matrix as a ``wandb.Image`` heatmap
        (load / mean per layer, one row per MoE layer)."""
        if self._run is None or not self._accept_step(int(step)):
            return False
        from moetrain.monitor.plots import figure_to_rgb, load_heatmap_figure

        fig = load_heatmap_figure(load_LE, f"expert load, step {step}", layer_labels)
        image = self._wandb.Image(figure_to_rgb(fig), caption=f"tokens / mean, step {step}")
        return self._safe_log({key: image}, int(step))

    def finish(self, exit_code: int = 0) -> None:
        """Close the run (flushes the offline files); safe to call more than once."""
        run, self._run = self._run, None
        if run is None:
            return
        try:
            run.finish(exit_code=exit_code)
        except Exception as e:
            self.printer(f"wandb: finish failed ({type(e).__name__}: {e})")


def offline_run_dirs(run_dir: str | Path) -> list[Path]:
    """The offline run directories wandb wrote under ``RUN_DIR/wandb/``, oldest first."""
    return sorted((Path(run_dir) / "wandb").glob("offline-run-*"))


def read_run_records(run_path: str | Path) -> list[dict[str, Any]]:
    """Records of a wandb run directory (or its ``run-ID.wandb`` file), read with wandb's own
    reader (``wandb leet inspect --json``): dicts with ``type`` (run, history, summary, ...).
    Use ``wandb sync PATH`` to upload an offline run."""
    import json
    import subprocess
    import sys

    path = Path(run_path)
    if path.is_dir():
        files = sorted(path.glob("run-*.wandb"))
        if not files:
            raise FileNotFoundError(f"{path}: no run-*.wandb file")
        path = files[0]

    def run(cmd: list[str]) -> str:
        return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120).stdout

    try:  # wandb-core's reader directly, as `wandb leet inspect` calls it (no Python start-up)
        from wandb.util import get_core_path

        core = [get_core_path(), "leet", "inspect", "--no-observability", "--json"]
        out = run([*core, "--run-file", str(path), str(path.parent.parent)])
    except Exception:  # the documented command line
        out = run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)])
    return [json.loads(line) for line in out.splitlines() if line.strip()]
