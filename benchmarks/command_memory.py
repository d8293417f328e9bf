"""Memory and time of ``moetrain train`` per rank, phase by phase, next to the bare step.

    .venv/bin/python benchmarks/command_memory.py [--steps 20] [--shape bench] [--rounds 3] [--ep 1]
    .venv/bin/python benchmarks/command_memory.py --family gemma4_text --ep 2 --steps 6

Runs the real command (``python -m moetrain train`` through ``torchrun``, 2 CPU ranks, one thread
each, the shape and data of ``benchmarks/train_command.py``) with this file as the entry point:
it wraps the run loop's parts to read the process's resident memory (``VmRSS``) and its peak
(``VmHWM``) when each part ends -- imports, process groups, the data loader, the model + engine
(:class:`~moetrain.train.trainer.Trainer`), the monitor, the first step, the remaining steps,
evaluation, the checkpoint save -- and then starts ``moetrain.cli.main``. A second run does
what ``benchmarks/train_throughput.py`` times: the same Trainer stepping over the command's own
batches (read by its loader before the model is built, so both route the same tokens), nothing
else. The two alternate for ``--rounds`` pairs. Reported: each phase's growth of
RSS and of the peak, per rank (rank 0 and the maximum over ranks), both runs' peaks (last
pair), and per pair the wall time of steps 2 to N (end of the first step to end of the last,
the slower rank) of the command over the bare step's, with the median over pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _mem_mib() -> tuple[float, float]:
    rss = hwm = 0.0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
        elif line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) / 1024
    return rss, hwm


class Phases:
    """Memory readings at the end of named phases, written as JSON by every rank at exit."""

    def __init__(self, out: Path) -> None:
        self.out, self.rows = out, []
        self.mark("python")

    def mark(self, name: str) -> None:
        rss, hwm = _mem_mib()
        self.rows.append({"phase": name, "rss_mib": rss, "hwm_mib": hwm, "t": time.time()})

    def write(self) -> None:
        rank = os.environ.get("RANK", "0")
        (self.out / f"phases-rank{rank}.json").write_text(json.dumps(self.rows))


def _wrap(phases: Phases, steps: int) -> None:
    """Mark the phases of moetrain's run loop (the names the loop imports are replaced)."""
    import moetrain.checkpoint.checkpointer as save
    import moetrain.data.splits as loader
    import moetrain.parallel.topology as topology
    import moetrain.train.loop as loop

    phases.mark("imports")

    def after(fn, name):  # noqa: ANN001, ANN202
        def wrapped(*a, **k):  # noqa: ANN002, ANN003, ANN202
            out = fn(*a, **k)
            phases.mark(name)
            return out

        return wrapped

    loop.init_distributed = after(topology.init_distributed, "process groups")
    first = {"loader": True}
    build = loader.build_loader

    def build_loader(*a, **k):  # noqa: ANN002, ANN003, ANN202
        out = build(*a, **k)
        if first.pop("loader", False):
            phases.mark("data loader")
        return out

    loader.build_loader = build_loader
    loop.Trainer = _trainer_class(loop.Trainer, phases, steps)
    loop.RunMonitor = _after_init(loop.RunMonitor, phases, "monitor")
    save.Checkpointer.save = after(save.Checkpointer.save, "checkpoint save")


def _after_init(cls: type, phases: Phases, name: str) -> type:
    class Marked(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **k) -> None:  # noqa: ANN002, ANN003
            super().__init__(*a, **k)
            phases.mark(name)

    return Marked


def _trainer_class(cls: type, phases: Phases, steps: int) -> type:
    class Marked(_after_init(cls, phases, "model + engine")):  # type: ignore[misc]
        def train_step(self, *a, **k):  # noqa: ANN002, ANN003, ANN202
            rec = super().train_step(*a, **k)
            if self.progress.step in (1, steps):
                phases.mark("first step" if self.progress.step == 1 else f"steps 2-{steps}")
            return rec

        def evaluate(self, *a, **k) -> float:  # noqa: ANN002, ANN003
            out = super().evaluate(*a, **k)
            phases.mark("evaluation")
            return out

    return Marked


def rank_main(out: Path, steps: int, argv: list[str]) -> None:
    """Inside each rank: wrap the loop's parts, then run the CLI."""
    phases = Phases(out)
    try:
        if argv[0] == "bare":
            _bare_step(phases, steps, argv[1:])
        else:
            _wrap(phases, steps)
            from moetrain.cli import main

            main(argv)
    finally:
        phases.write()


def _bare_step(phases: Phases, steps: int, overrides: list[str]) -> None:
    """What train_throughput.py times: the Trainer over batches already in memory, nothing
    around it; the batches are the command's own (its loader, read before the model exists), so
    both route the same tokens."""
    import itertools

    from moetrain.config import load_config
    from moetrain.data.splits import build_loader
    from moetrain.parallel.topology import init_distributed, shutdown
    from moetrain.train.loop import set_up_process
    from moetrain.train.trainer import Trainer

    phases.mark("imports")
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", overrides)
    set_up_process(cfg)  # what the command sets for its process
    topo = init_distributed(cfg)
    phases.mark("process groups")
    loader = build_loader(
        cfg.data,
        "train",
        cfg.train.micro_batch_size,
        topo.rank,
        topo.world_size,
        cfg.seed,
        vocab_size=cfg.model.vocab_size,
    )
    batches = list(itertools.islice(iter(loader), steps))
    del loader
    trainer = Trainer(cfg, topo)
    phases.mark("model + engine")
    for step, batch in enumerate(batches):
        trainer.train_step([batch])
        if step + 1 in (1, steps):
            phases.mark("first step" if step == 0 else f"steps 2-{steps}")
    shutdown(topo)


def launch(out: Path, steps: int, argv: list[str]) -> list[list[dict]]:
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("phases-rank*.json"):
        f.unlink()
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, "--standalone", "--nproc_per_node", "2", __file__]
    cmd += ["--rank-main", str(out), str(steps), *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    # DeepSpeed's CPU op in this benchmark's own cache (as train_command.py): a cache shared with
    # other installs is rebuilt by whichever last built it, inside the measured runs
    env.setdefault("TORCH_EXTENSIONS_DIR", str(out.parent / "torch-extensions"))
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    return [json.loads(f.read_text()) for f in sorted(out.glob("phases-rank*.json"))]


def table(title: str, ranks: list[list[dict]]) -> str:
    lines = [
        f"\n{title}",
        "| phase | RSS growth, rank 0 (MiB) | peak growth, max over ranks (MiB) |",
    ]
    lines.append("|---|---:|---:|")
    names = [row["phase"] for row in ranks[0]]
    for i, name in enumerate(names[1:], start=1):
        rss = ranks[0][i]["rss_mib"] - ranks[0][i - 1]["rss_mib"]
        peak = max(r[i]["hwm_mib"] - r[i - 1]["hwm_mib"] for r in ranks if len(r) > i)
        lines.append(f"| {name} | {rss:+.0f} | {peak:+.0f} |")
    final = max(r[-1]["hwm_mib"] for r in ranks)
    lines.append(f"| **peak RSS per rank** | | **{final:.0f}** |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-main":
        rank_main(Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
        return
    sys.path.insert(0, str(HERE))
    from train_command import (
        CONFIG,
        MICRO,
        SHAPES,
        WORK,
        family_overrides,
        prepare,
        shape_overrides,
    )

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    ap.add_argument("--docs", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3, help="command / bare pairs, alternating")
    ap.add_argument("--ep", type=int, default=1, help="parallel.ep_size")
    ap.add_argument(
        "--family",
        help="train_command.py --family's source model instead of the shape (the command "
        "only: the bare step builds the shape's model)",
    )
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    data = prepare(shape, args.docs)
    config, sizes = CONFIG, shape_overrides(shape)
    if args.family:
        config, sizes = family_overrides(args.family, shape["seq"])
    common = [
        *sizes,
        f"data.output_dir={data}",
        f"parallel.ep_size={args.ep}",
        "parallel.zero_stage=2",
        f"train.micro_batch_size={MICRO}",
        f"train.max_steps={args.steps}",
        f"train.eval_every={args.steps}",
        "train.eval_steps=5",
        "train.log_every=5",
        "optim.warmup_steps=0",
        "logging.wandb.mode=disabled",
    ]
    run_dir = WORK / "memory-run"
    command = ["train", str(config), *common, f"run_dir={run_dir}", "checkpoint.resume=none"]
    if args.family:
        shutil.rmtree(run_dir, ignore_errors=True)
        runs = launch(WORK / "memory-phases-family", args.steps, command)
        print(table(f"moetrain train, {args.family} ({args.steps} steps, eval and a save)", runs))
        return
    ratios = []
    for r in range(args.rounds):
        runs = {}
        order = ["command", "bare"] if r % 2 == 0 else ["bare", "command"]
        for side in order:
            argv = command if side == "command" else ["bare", *common]
            shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not over the last one's
            runs[side] = launch(WORK / f"memory-phases-{side}", args.steps, argv)
        times = {side: steps_time(ranks, args.steps) for side, ranks in runs.items()}
        ratios.append(times["command"] / times["bare"])
        print(
            f"round {r}: steps 2-{args.steps} took {times['command']:.2f} s in the command, "
            f"{times['bare']:.2f} s bare: {ratios[-1]:.3f}x"
        )
    cmd, bare = runs["command"], runs["bare"]
    print(table(f"moetrain train ({args.steps} steps, eval and a save at the end)", cmd))
    print(table(f"bare step ({args.steps} steps over in-memory batches)", bare))
    command_peak = max(r[-1]["hwm_mib"] for r in cmd)
    bare_peak = max(r[-1]["hwm_mib"] for r in bare)
    print(f"\ncommand - bare step: {command_peak - bare_peak:+.0f} MiB peak RSS per rank")
    print(
        f"command / bare step, time of steps 2-{args.steps}: median "
        f"{statistics.median(ratios):.3f}x (range {min(ratios):.3f}-{max(ratios):.3f}, "
        f"{len(ratios)} rounds)"
    )


def steps_time(ranks: list[list[dict]], steps: int) -> float:
    """Wall time from the end of the first step to the end of the last, the slowest rank's."""
    out = []
    for rows in ranks:
        t = {row["phase"]: row["t"] for row in rows}
        out.append(t[f"steps 2-{steps}"] - t["first step"])
    return max(out)


if __name__ == "__main__":
    main()
