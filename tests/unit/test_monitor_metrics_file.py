"""metrics.jsonl across runs: a resumed run appends, a run from step 0 sets an earlier file aside."""

from pathlib import Path
from types import SimpleNamespace

import torch

from moetrain.config import load_config
from moetrain.monitor.metrics_file import METRICS_FILE, set_aside
from moetrain.monitor.run_monitor import RunMonitor


def _monitor(run_dir: Path, start_step: int) -> RunMonitor:
    cfg = load_config(None, [f"run_dir={run_dir}", "logging.wandb.mode=disabled"])
    topo = SimpleNamespace(is_main=True, rank=0, world_size=1, device=torch.device("cpu"))
    return RunMonitor(cfg, topo, tokens_per_step=8, total_steps=10, start_step=start_step)


def test_set_aside_takes_the_first_free_number(tmp_path):
    assert set_aside(tmp_path) is None  # no file
    (tmp_path / METRICS_FILE).write_text("")
    assert set_aside(tmp_path) is None  # empty: nothing to keep
    for n in (1, 2):
        (tmp_path / METRICS_FILE).write_text(f'{{"step": {n}}}\n')
        assert set_aside(tmp_path) == tmp_path / f"metrics.{n}.jsonl"
        assert not (tmp_path / METRICS_FILE).exists()
    assert (tmp_path / "metrics.1.jsonl").read_text() == '{"step": 1}\n'


def test_a_run_from_step_0_does_not_append_to_an_earlier_runs_records(tmp_path, capsys):
    earlier = '{"step": 7, "loss": 1.0}\n'
    (tmp_path / METRICS_FILE).write_text(earlier)
    resumed = _monitor(tmp_path, start_step=7)  # a resume continues the same file
    resumed.writer.write({"step": 8, "loss": 0.9})
    resumed.writer.close()
    assert (tmp_path / METRICS_FILE).read_text().splitlines()[0] == earlier.strip()
    assert len((tmp_path / METRICS_FILE).read_text().splitlines()) == 2

    fresh = _monitor(tmp_path, start_step=0)
    fresh.writer.write({"step": 1, "loss": 9.0})
    fresh.writer.close()
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert len(lines) == 1 and '"step": 1' in lines[0]
    assert (tmp_path / "metrics.1.jsonl").read_text().startswith(earlier)
    assert "metrics.1.jsonl" in capsys.readouterr().out
