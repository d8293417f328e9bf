"""Matplotlib figures shared by the report and the wandb sink.

Figures are built with ``matplotlib.figure.Figure`` on an Agg canvas, never through pyplot, so
no global backend is switched and nothing needs closing.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def new_figure(width: float, height: float) -> Any:
    """A matplotlib Figure with an Agg canvas attached."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def relative_load(load: np.ndarray) -> np.ndarray:
    """Load divided by each row's mean (1 = fair share); rows without tokens become NaN."""
    load = np.asarray(load, dtype=np.float64)
    mean = load.mean(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mean > 0, load / np.where(mean > 0, mean, 1.0), np.nan)


def load_heatmap_figure(load_LE: Any, title: str = "expert load", layer_labels: Any = None) -> Any:
    """Figure of a (layers x experts) tokens-per-expert matrix as load / mean per layer."""
    rel = relative_load(np.atleast_2d(np.asarray(load_LE, dtype=np.float64)))
    n_layers, n_experts = rel.shape
    fig = new_figure(min(3 + 0.35 * n_experts, 14), 1.5 + 0.4 * n_layers)
    ax = fig.subplots()
    im = ax.imshow(rel, aspect="auto", cmap="viridis", vmin=0, interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    labels = list(layer_labels) if layer_labels is not None else list(range(n_layers))
    ax.set_yticks(range(n_layers), [str(x) for x in labels])
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="tokens / mean tokens per expert")
    return fig


def figure_to_rgb(fig: Any) -> np.ndarray:
    """Render a figure to an (H, W, 3) uint8 array."""
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
