"""`make_report` on synthetic metrics.jsonl files."""

import json
import math

import numpy as np
import pytest
from matplotlib.image import imread

from moetrain.monitor.metrics_file import MetricsWriter
from moetrain.monitor.report import make_report, read_metrics


def _write_run(run_dir, steps=40):
    rng = np.random.default_rng(0)
    lines = []
    for s in range(1, steps + 1):
        row = {
            "step": s,
            "loss": 6.0 * math.exp(-s / 15) + 2.0,
            "lr": 3e-4 * min(1.0, s / 10),
            "tokens_per_s": 1000.0 + 10 * s,
            "moe/dropped_frac": 0.01,
            "moe/layer0/dropped_frac": 0.02,
            "moe/layer1/dropped_frac": 0.0,
        }
        for layer in (0, 1):
            load = rng.poisson(100, size=8).astype(float)
            load[0] *= 3  # expert 0 always hot
            if layer == 1:
                load[7] *= max(0.0, 1 - s / 20)  # expert 7 of layer 1 dies at step 20
            row[f"moe/layer{layer}/tokens_per_expert"] = load.tolist()
        lines.append(json.dumps(row))
        if s % 10 == 0:
            lines.append(json.dumps({"step": s, "val_loss": 6.0 * math.exp(-s / 15) + 2.3}))
    lines.append(json.dumps({"step": 35, "loss": 1.5}))  # resumed run re-logs step 35
    lines.append('{"step": 41, "loss": 2.')  # half-written line after a crash
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_report_writes_nonempty_pngs_and_summary(tmp_path):
    _write_run(tmp_path)
    paths = make_report(tmp_path)
    names = sorted(p.name for p in paths)
    assert names == ["expert_load.png", "loss.png", "lr.png", "report.txt", "tokens_per_s.png"]
    for p in paths:
        assert p.parent == tmp_path / "report" and p.stat().st_size > 0
        if p.suffix == ".png":
            img = imread(p)
            assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 200
            assert img[..., :3].std() > 0.05  # not a blank canvas
    text = (tmp_path / "report" / "report.txt").read_text()
    assert "1 malformed lines skipped" in text
    assert "steps: 1 .. 40 (40 distinct)" in text
    assert "loss: final 2.417 at step 40; best 1.5 at step 35" in text  # later line wins
    assert "val_loss: final 2.717 at step 40" in text
    assert "layer 0: most loaded expert 0" in text
    assert "layer 1: most loaded expert 0" in text and "least loaded expert 7" in text
    assert "all layers: 1.0000%" in text and "layer0: 2.0000%" in text
    assert "missing" not in text


def test_report_tolerates_missing_keys(tmp_path):
    rows = [{"step": s, "loss": 5.0 - 0.1 * s} for s in range(5)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    paths = make_report(tmp_path)
    assert sorted(p.name for p in paths) == ["loss.png", "report.txt"]
    text = paths[-1].read_text()
    assert "no 'val_loss' values" in text and "lr.png not drawn" in text
    assert "expert_load.png not drawn" in text and "no dropped-fraction metrics" in text


def test_report_errors_clearly_without_metrics(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        make_report(tmp_path)


def test_read_metrics_skips_rows_without_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2}\n[1, 2]\n{"loss": 3}\n\n{"step": 2}\n')
    rows, bad = read_metrics(path)
    assert [r["step"] for r in rows] == [1, 2] and bad == 2


def test_the_run_summary_record_is_not_a_malformed_line(tmp_path):
    """What a finished run writes (step records, then its summary) reads without a skip."""
    writer = MetricsWriter(tmp_path, enabled=True)
    for s in range(1, 4):
        writer.write({"step": s, "loss": 3.0 - s / 10})
    writer.write({"summary": {"steps": 3, "final_loss": 2.7}})
    writer.close()
    rows, bad = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and bad == 0
    make_report(tmp_path)
    assert "(0 malformed lines skipped)" in (tmp_path / "report" / "report.txt").read_text()


def test_report_of_a_mixture_plots_each_source(tmp_path):
    """data/tokens/<name> and val/loss/<name> of a data mixture: one curve per source."""
    lines = []
    for s in range(1, 21):
        row = {"step": s, "loss": 3.0 - s / 20}
        for name, share, size in (("web", 0.6, 500), ("code", 0.3, 100), ("math", 0.1, 5)):
            row[f"data/tokens/{name}"] = int(share * s * 64) * 32
            row[f"data/epochs/{name}"] = share * s * 64 / size
        lines.append(json.dumps(row))
        if s % 5 == 0:
            val = {"step": s, "val_loss": 2.5, "val/loss/web": 2.4, "val/loss/code": 2.6}
            lines.append(json.dumps(val | {"val/loss/math": 2.0 + s / 100}))
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    names = {p.name for p in make_report(tmp_path)}
    assert {"data_tokens.png", "val_loss_sources.png", "loss.png"} <= names
    for name in ("data_tokens.png", "val_loss_sources.png"):
        img = imread(tmp_path / "report" / name)
        assert img[..., :3].std() > 0.05
    text = (tmp_path / "report" / "report.txt").read_text()
    assert "data sources (share of tokens, epochs): code 30.0% (3.84), math 10.0% (25.6)" in text
    assert "web 60.0% (1.54)" in text
    assert "val/loss per source (final): code 2.6, math 2.2, web 2.4" in text
