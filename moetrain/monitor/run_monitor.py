"""Everything a training run reports, behind one object: metrics.jsonl, wandb, the console,
throughput and memory, MFU, MoE health (the dead-expert watch and load heatmaps).

Files and the console are written by rank 0 only; every method may be called on every rank.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from moetrain.config import Config
from moetrain.monitor.console import console
from moetrain.monitor.metrics_file import MetricsWriter, set_aside
from moetrain.monitor.mfu import resolve_peak
from moetrain.monitor.moe_health import DeadExpertWatch, load_matrix
from moetrain.monitor.records import (
    layer_stats,
    perplexity,
    progress_line,
    source_metrics,
    step_metrics,
)
from moetrain.monitor.throughput import Throughput, memory_stats
from moetrain.monitor.wandb_run import WandbSink


class RunMonitor:
    """The reporting side of one run (``topo``: a :class:`~moetrain.parallel.topology.Topology`).

    ``resume_wandb_id`` continues the wandb run of the checkpoint a run resumed from.
    """

    def __init__(
        self,
        cfg: Config,
        topo: Any,
        tokens_per_step: int,
        total_steps: int,
        start_step: int,
        resume_wandb_id: str | None = None,
    ) -> None:
        self.cfg, self.topo, self.main = cfg, topo, topo.is_main
        self.total, self.start_step = total_steps, start_step
        run_dir = Path(cfg.run_dir)
        if self.main and start_step == 0 and (earlier := set_aside(run_dir)) is not None:
            console(
                f"metrics: this run starts at step 0; an earlier run's records moved to {earlier}"
            )
        self.writer = MetricsWriter(run_dir, enabled=self.main)
        self.sink = WandbSink(
            cfg.logging.wandb,
            run_dir,
            config=cfg.to_dict(),
            rank=topo.rank,
            resume_id=resume_wandb_id,
        )
        t = cfg.train
        self.peak = (
            resolve_peak(t.precision, cfg.logging.peak_tflops, topo.device) if self.main else None
        )
        self.watch = DeadExpertWatch(patience=max(20, 5 * t.log_every)) if self.main else None
        self.meter = Throughput(cfg, topo.world_size, tokens_per_step)
        self.started = time.perf_counter()
        self._epochs: dict[str, int] | None = None  # completed epochs per source of a blend
        self._no_val: set[str] = set()

    @property
    def wandb_run_id(self) -> str | None:
        return self.sink.run_id

    def say(self, message: str) -> None:
        """A console line, from rank 0."""
        if self.main:
            console(message)

    def step_done(
        self,
        rec: dict[str, Any],
        data_s: float,
        log: bool,
        sources: dict[str, dict[str, float]] | None = None,
    ) -> None:
        """Count a finished step; with ``log``, report it (metrics, wandb, heatmap, console).
        ``sources``: a blend's per-source progress (samples, epochs); a source starting a new
        epoch is announced on the console."""
        self.meter.step()
        if sources:
            self._note_epochs(sources)
        if not log:
            return
        rec.update(self.meter.measure())
        rec.update(memory_stats(self.topo.device))
        rec["time/data_s"] = data_s
        rec["flops_per_token"] = self.meter.flops_per_token
        if not self.main:
            return
        step = rec["step"]
        row = step_metrics(rec, self.cfg, self.peak, self.topo.world_size, self.watch)
        row.update(source_metrics(sources or {}, self.cfg.data.seq_len))
        self.writer.write(row)
        self.sink.log(row, step)
        every = self.cfg.logging.heatmap_every
        if rec.get("moe_layers") and every > 0 and step % every == 0:
            stats = layer_stats(rec, self.cfg)
            self.sink.log_heatmap(load_matrix(stats), step, layer_labels=list(rec["moe_layers"]))
        elapsed = time.perf_counter() - self.started
        eta = elapsed / max(step - self.start_step, 1) * (self.total - step)
        console(progress_line(step, self.total, rec, eta))

    def _note_epochs(self, sources: dict[str, dict[str, float]]) -> None:
        epochs = {name: int(p["epochs"]) for name, p in sources.items()}
        if self._epochs is not None:
            for name, e in epochs.items():
                if e > self._epochs.get(name, e):
                    self.say(f"data: source {name} starts epoch {e + 1} (of its own samples)")
        self._epochs = epochs

    def eval_done(
        self, step: int, loss: float, by_source: dict[str, float | None] | None = None
    ) -> None:
        """Report a validation loss; ``by_source`` adds each source's (``val/loss/<name>``;
        None: the source has no validation sample)."""
        val = {"step": step, "val_loss": loss, "val_perplexity": perplexity(loss)}
        for name, v in (by_source or {}).items():
            if v is not None:
                val[f"val/loss/{name}"] = v
            elif name not in self._no_val:
                self._no_val.add(name)
                self.say(f"warning: data source {name} has no validation sample (not evaluated)")
        self.writer.write(val)
        self.sink.log(val, step)
        per = ", ".join(f"{n} {v:.4f}" for n, v in (by_source or {}).items() if v is not None)
        self.say(f"step {step} val loss {loss:.4f}" + (f" ({per})" if per else ""))

    def summary(self, summary: dict[str, Any]) -> None:
        self.writer.write({"summary": summary})

    def close(self) -> None:
        self.sink.finish()
        self.writer.close()
