"""``moetrain report RUN_DIR``: PNG plots and a text summary from ``RUN_DIR/metrics.jsonl``.

The JSONL file has one JSON object per line; every row has an integer ``step``. Keys read
(any may be missing: that plot or summary line is skipped, and the summary says so):

    step                              optimizer step (int), on every row
    loss                              training loss (train rows)
    lr                                learning rate
    tokens_per_s                      global training throughput, tokens per second
    val_loss                          validation loss (eval rows; may share a step with a train row)
    moe/layer{i}/tokens_per_expert    list of E numbers: tokens routed to each expert of MoE layer i
    moe/layer{i}/dropped_frac         dropped-assignment fraction of layer i (moe_health)
    moe/dropped_frac                  dropped fraction pooled over layers (moe_health)
    data/tokens/<name>                tokens trained on from source <name> of a mixture
    data/epochs/<name>                passes over source <name>
    val/loss/<name>                   validation loss on source <name> (eval rows)

A step logged twice (a run resumed from an earlier checkpoint logs those steps again) keeps the
later line. The summary record a run writes when it ends (``{"summary": {...}}``) is not a
step row. Malformed lines (e.g. a half-written last line after a crash) are skipped and
counted. Output goes to ``RUN_DIR/report/``: ``loss.png``, ``lr.png``, ``tokens_per_s.png``,
``expert_load.png`` (one panel per layer, time x experts, load / mean per row), for a mixture
``data_tokens.png`` (tokens per source) and ``val_loss_sources.png`` (validation loss per
source), and ``report.txt``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from moetrain.monitor.metrics_file import METRICS_FILE
from moetrain.monitor.plots import new_figure, relative_load

_LOAD_KEY = re.compile(r"^moe/layer(\d+)/tokens_per_expert$")
_SOURCE_KEYS = ("data/tokens/", "data/epochs/", "val/loss/")


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Rows of a metrics JSONL file (objects with an int ``step``) and the count of malformed
    lines skipped (the run summary record, ``{"summary": {...}}``, is neither)."""
    rows, bad = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
            elif not (isinstance(row, dict) and isinstance(row.get("summary"), dict)):
                bad += 1  # (the run's closing summary record has no step and is not counted)
    return rows, bad


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def series(rows: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of a numeric key, sorted by step; the last row wins for a repeated step."""
    by_step = {r["step"]: r[key] for r in rows if _is_number(r.get(key))}
    steps = np.array(sorted(by_step), dtype=np.int64)
    return steps, np.array([by_step[s] for s in steps], dtype=np.float64)


def load_series(rows: list[dict[str, Any]]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """``{layer: (steps (T,), tokens_per_expert (T, E))}`` from the list-valued load keys."""
    layers: dict[int, dict[int, list[float]]] = {}
    for r in rows:
        for key, value in r.items():
            m = _LOAD_KEY.match(key)
            if m and isinstance(value, list) and value and all(map(_is_number, value)):
                layers.setdefault(int(m.group(1)), {})[r["step"]] = value
    out = {}
    for layer, by_step in sorted(layers.items()):
        width = len(by_step[max(by_step)])  # the expert count of the latest row
        steps = sorted(s for s, v in by_step.items() if len(v) == width)
        out[layer] = (np.array(steps), np.array([by_step[s] for s in steps], dtype=np.float64))
    return out


def _line_plot(path: Path, curves: list[tuple[str, np.ndarray, np.ndarray]], ylabel: str) -> Path:
    fig = new_figure(7, 4)
    ax = fig.subplots()
    for label, x, y in curves:
        ax.plot(x, y, label=label, marker="o" if len(x) < 30 else None, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(curves) > 1:
        ax.legend()
    fig.savefig(path)
    return path


def _load_plot(path: Path, loads: dict[int, tuple[np.ndarray, np.ndarray]]) -> Path:
    n = len(loads)
    cols = min(n, 4)
    rows_ = math.ceil(n / cols)
    fig = new_figure(3.2 * cols + 1, 3.0 * rows_ + 0.6)
    axes = np.atleast_1d(fig.subplots(rows_, cols, squeeze=False)).reshape(-1)
    rels = {layer: relative_load(load) for layer, (_, load) in loads.items()}
    finite = np.concatenate([r[np.isfinite(r)] for r in rels.values()])
    vmax = max(2.0, float(np.percentile(finite, 99))) if finite.size else 2.0
    im = None
    for ax, (layer, (steps, load)) in zip(axes, loads.items(), strict=False):
        e = load.shape[1]
        lo, hi = (steps[0], steps[-1]) if len(steps) > 1 else (steps[0] - 0.5, steps[0] + 0.5)
        im = ax.imshow(
            rels[layer],
            aspect="auto",
            cmap="viridis",
            vmin=0,
            vmax=vmax,
            interpolation="nearest",
            extent=(-0.5, e - 0.5, hi, lo),
        )
        ax.set_title(f"layer {layer}")
        ax.set_xlabel("expert")
        ax.set_ylabel("step")
    for ax in axes[n:]:
        ax.set_visible(False)
    fig.suptitle("expert load over time (tokens / mean tokens per expert; 1 = balanced)")
    if im is not None:
        fig.colorbar(im, ax=list(axes[:n]), shrink=0.8)
    fig.savefig(path)
    return path


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _names(rows: list[dict[str, Any]], prefix: str) -> list[str]:
    return sorted({k[len(prefix) :] for r in rows for k in r if k.startswith(prefix)})


def _source_report(
    rows: list[dict[str, Any]], out: Path, written: list[Path], missing: list[str]
) -> list[str]:
    """A mixture's plots (tokens and validation loss per source) and summary lines."""
    lines: list[str] = []
    tokens = {n: series(rows, f"data/tokens/{n}") for n in _names(rows, "data/tokens/")}
    if tokens:
        written.append(
            _line_plot(out / "data_tokens.png", [(n, x, y) for n, (x, y) in tokens.items()],
                       "tokens trained on, per source")
        )  # fmt: skip
        last = {n: y[-1] for n, (_, y) in tokens.items() if len(y)}
        total = sum(last.values()) or 1.0
        epochs = {n: series(rows, f"data/epochs/{n}")[1] for n in tokens}
        lines.append(
            "data sources (share of tokens, epochs): "
            + ", ".join(
                f"{n} {v / total:.1%} ({epochs[n][-1]:.3g})" if len(epochs[n]) else f"{n} {v / total:.1%}"
                for n, v in last.items()
            )
        )  # fmt: skip
    val = {n: series(rows, f"val/loss/{n}") for n in _names(rows, "val/loss/")}
    if val:
        written.append(
            _line_plot(out / "val_loss_sources.png", [(n, x, y) for n, (x, y) in val.items()],
                       "validation loss, per source")
        )  # fmt: skip
        lines.append(
            "val/loss per source (final): "
            + ", ".join(f"{n} {_fmt(y[-1])}" for n, (_, y) in val.items() if len(y))
        )
    if not tokens and any(k.startswith(_SOURCE_KEYS) for r in rows for k in r):
        missing.append("no 'data/tokens/<name>' values (data_tokens.png not drawn)")
    return lines


def make_report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the plots and ``report.txt`` (default ``RUN_DIR/report/``); return the paths written.

    Raises FileNotFoundError when ``RUN_DIR/metrics.jsonl`` does not exist.
    """
    run_dir = Path(run_dir)
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{metrics_path}: no metrics file (is {run_dir} a run directory?)")
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    rows, bad = read_metrics(metrics_path)
    written: list[Path] = []
    lines = [f"run: {run_dir}", f"records: {len(rows)} rows ({bad} malformed lines skipped)"]
    missing: list[str] = []

    steps = sorted({r["step"] for r in rows})
    if steps:
        lines.append(f"steps: {steps[0]} .. {steps[-1]} ({len(steps)} distinct)")

    curves = []
    for key, label in (("loss", "train"), ("val_loss", "validation")):
        x, y = series(rows, key)
        if len(x):
            curves.append((label, x, y))
            best = int(np.argmin(y))
            lines.append(
                f"{key}: final {_fmt(y[-1])} at step {x[-1]}; best {_fmt(y[best])} at step {x[best]}"
            )
        else:
            missing.append(f"no '{key}' values")
    if curves:
        written.append(_line_plot(out / "loss.png", curves, "loss"))
    else:
        missing.append("loss.png not drawn")

    for key, ylabel in (("lr", "learning rate"), ("tokens_per_s", "tokens / s (global)")):
        x, y = series(rows, key)
        if len(x):
            written.append(_line_plot(out / f"{key}.png", [(key, x, y)], ylabel))
            if key == "tokens_per_s":
                lines.append(f"tokens_per_s: mean {_fmt(y.mean())}, last {_fmt(y[-1])}")
            else:
                lines.append(f"lr: max {_fmt(y.max())}, final {_fmt(y[-1])}")
        else:
            missing.append(f"no '{key}' values ({key}.png not drawn)")

    loads = load_series(rows)
    if loads:
        written.append(_load_plot(out / "expert_load.png", loads))
        lines.append("expert load (tokens summed over logged steps):")
        for layer, (_, load) in loads.items():
            total = load.sum(axis=0)
            share = total / total.sum() if total.sum() > 0 else total
            hi, lo = int(np.argmax(total)), int(np.argmin(total))
            e = len(total)
            lines.append(
                f"  layer {layer}: most loaded expert {hi} ({share[hi]:.1%}, "
                f"{share[hi] * e:.2f}x mean), least loaded expert {lo} ({share[lo]:.1%}, "
                f"{share[lo] * e:.2f}x mean)"
            )
    else:
        missing.append("no 'moe/layer{i}/tokens_per_expert' lists (expert_load.png not drawn)")

    lines += _source_report(rows, out, written, missing)

    drop_keys = sorted(
        {k for r in rows for k in r if re.fullmatch(r"moe/layer\d+/dropped_frac", k)},
        key=lambda k: int(re.findall(r"\d+", k)[0]),
    )
    pooled = series(rows, "moe/dropped_frac")[1]
    if drop_keys or len(pooled):
        lines.append("dropped fraction (mean over logged steps):")
        if len(pooled):
            lines.append(f"  all layers: {pooled.mean():.4%} (max {pooled.max():.4%})")
        for key in drop_keys:
            v = series(rows, key)[1]
            lines.append(f"  {key.split('/')[1]}: {v.mean():.4%} (max {v.max():.4%})")
    else:
        missing.append("no dropped-fraction metrics")

    if missing:
        lines.append("missing: " + "; ".join(missing))
    lines.append("files: " + ", ".join(p.name for p in written))
    text = out / "report.txt"
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    written.append(text)
    return written
