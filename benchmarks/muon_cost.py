"""Muon against AdamW through ``moetrain train``: tokens/s and peak RSS per rank in alternating
rounds, and where Muon's step time goes (Newton-Schulz, its exchange all-reduce).

    .venv/bin/python benchmarks/muon_cost.py --rounds 3                 # EP 1 and EP 2, bench
    .venv/bin/python benchmarks/muon_cost.py --rounds 3 --ep 2 --micro 16
    .venv/bin/python benchmarks/muon_cost.py --no-command --interleaved 12 --micro 4 16
    .venv/bin/python benchmarks/muon_cost.py --no-command --interleaved 6 --accum 8

Cost: the measurement of ``benchmarks/train_command.py`` (2 CPU ranks, one thread each, ZeRO-2,
fp32, the built-in corpus, AdamW's constant learning rate and clipping 1.0; each round a short
and a long run of each side, sides and lengths alternating; tokens/s from outside = the steps
between the two runs over their wall-time difference, from inside = the median of the runs'
logged ``tokens_per_s`` after step 2; peak RSS = ``VmHWM`` of every rank, the maximum), with
the sides ``adamw`` and ``muon`` (``optim.name=muon``, everything else equal), for each
``--ep``. Reported per round and as the median (range) of muon / adamw.

Shares: one more Muon run (``--profile-steps`` steps) with this file as every rank's entry
point (as ``benchmarks/command_memory.py``), which times each Newton-Schulz call and each
exchange all-reduce of the optimizer and each training step; reported, over the steps after the
first, as the share of the step time, the slower rank's.

``--memory``: each side's run with ``benchmarks/command_memory.py``'s phase marks (the peak
RSS's growth phase by phase), ``--rounds`` alternating pairs, and muon / adamw of the peaks.

``--interleaved N``: an AdamW and a Muon Trainer built side by side in one 2-rank process group
step in turn over the command's own first N batches (the order swapped every step, each step
timed between barriers): the step-time ratio with whatever else loads the machine shared alike
step by step, and Newton-Schulz's and the exchange's shares of Muon's step (``--no-command``
runs only this).
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
sys.path.insert(0, str(HERE))

from train_command import WORK, inside_tokens_per_s, moetrain_cmd, prepare, run  # noqa: E402
from train_throughput import SHAPES  # noqa: E402

SIDES = {"adamw": ("optim.name=adamw",), "muon": ("optim.name=muon",)}


def cost_rounds(args: argparse.Namespace, data: Path, env: dict[str, str]) -> list[dict]:
    """Alternating rounds of both sides at ``args.ep``; each round's figures per side."""
    tokens_per_step = 2 * args.micro * args.accum * SHAPES[args.shape]["seq"]
    port = 29700 + 100 * args.ep
    extra = batch_overrides(args)
    for side, settings in SIDES.items():  # warm-up: caches, the compiled DeepSpeed op
        port += 1
        run(moetrain_cmd(args, data, args.short, port, settings + extra), env)
        print(f"EP {args.ep}: warm-up {side} done", flush=True)
    rounds = []
    for rnd in range(args.rounds):
        order = list(SIDES) if rnd % 2 == 0 else list(reversed(SIDES))
        res: dict[str, dict[str, float]] = {}
        for side in order:
            walls, peak, inner = {}, 0.0, 0.0
            lengths = (args.short, args.long) if rnd % 2 == 0 else (args.long, args.short)
            for steps in lengths:
                port += 1
                r = run(moetrain_cmd(args, data, steps, port, SIDES[side] + extra), env)
                walls[steps], peak = r["wall_s"], max(peak, r["peak_rss_mib"])
                if steps == args.long:
                    inner = inside_tokens_per_s("moetrain", r, steps, tokens_per_step)
            outside = (
                (args.long - args.short) * tokens_per_step / (walls[args.long] - walls[args.short])
            )
            res[side] = {"outside": outside, "inside": inner, "peak_rss_mib": peak}
            print(f"EP {args.ep} round {rnd} {side}: {json.dumps(res[side])}", flush=True)
        rounds.append(res)
    return rounds


def batch_overrides(args: argparse.Namespace) -> tuple[str, ...]:
    """The micro-batch and the accumulation of every run of ``args``."""
    return (f"train.micro_batch_size={args.micro}", f"train.grad_accum_steps={args.accum}")


def summary(rounds: list[dict]) -> list[str]:
    lines = []
    for key, label, invert in (
        ("outside", "step time, from outside", True),
        ("inside", "step time, the runs' own figures", True),
        ("peak_rss_mib", "peak RSS per rank", False),
    ):
        xs = [
            (r["adamw"][key] / r["muon"][key]) if invert else (r["muon"][key] / r["adamw"][key])
            for r in rounds
        ]
        lines.append(
            f"  muon / adamw {label + ':':34s} median {statistics.median(xs):.2f}x "
            f"(range {min(xs):.2f}-{max(xs):.2f}x)"
        )
    peaks = [r[s]["peak_rss_mib"] for r in rounds for s in SIDES]
    lines.append(f"  peak RSS per rank: {min(peaks):.0f}-{max(peaks):.0f} MiB")
    return lines


# ----------------------------------------------------------------------------- the shares


def _timed(fn, totals: dict[str, float], key: str):  # noqa: ANN001, ANN202
    def wrapped(*a, **k):  # noqa: ANN002, ANN003, ANN202
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            totals[key] += time.perf_counter() - t0

    return wrapped


def rank_main(out: Path, argv: list[str]) -> None:
    """Inside each rank: time Newton-Schulz, the exchange and every step, then run the CLI."""
    import moetrain.optim.muon_update as muon_update
    import moetrain.train.loop as loop
    from moetrain.optim.partitions import Exchange

    totals = {"newton_schulz": 0.0, "exchange": 0.0, "step": 0.0, "optimizer": 0.0}
    steps: list[dict[str, float]] = []
    muon_update.orthogonalize_into = _timed(muon_update.orthogonalize_into, totals, "newton_schulz")
    Exchange.gather = _timed(Exchange.gather, totals, "exchange")

    class Timed(loop.Trainer):  # type: ignore[misc, valid-type]
        def train_step(self, *a, **k):  # noqa: ANN002, ANN003, ANN202
            before = dict(totals)
            t0 = time.perf_counter()
            rec = super().train_step(*a, **k)
            row = {key: totals[key] - before[key] for key in totals}
            row["step"] = time.perf_counter() - t0
            row["optimizer"] = rec["time/optimizer_s"]
            steps.append(row)
            return rec

    loop.Trainer = Timed
    from moetrain.cli import main

    try:
        main(argv)
    finally:
        rank = os.environ.get("RANK", "0")
        (out / f"muon-times-rank{rank}.json").write_text(json.dumps(steps))


def shares(args: argparse.Namespace, data: Path, env: dict[str, str]) -> list[str]:
    """The profile run: Newton-Schulz's, the exchange's and the optimizer's shares."""
    out = WORK / f"muon-times-ep{args.ep}"
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("*.json"):
        f.unlink()
    cmd = moetrain_cmd(
        args, data, args.profile_steps, 29699, ("optim.name=muon", *batch_overrides(args))
    )
    target = cmd[cmd.index("train") :]  # (the moetrain arguments, without the launcher)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    launch = [torchrun, "--standalone", "--nproc_per_node", "2", __file__, "--rank-main"]
    r = subprocess.run(
        [*launch, str(out), *target], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if r.returncode != 0:
        raise RuntimeError(f"profile run failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    ranks = [json.loads(f.read_text())[1:] for f in sorted(out.glob("*.json"))]
    lines = [f"  Muon's step, steps 2-{args.profile_steps}, slower rank:"]
    step = max(sum(s["step"] for s in rank) for rank in ranks)
    for key, label in (
        ("newton_schulz", "Newton-Schulz"),
        ("exchange", "the exchange all-reduce of cut matrices"),
        ("optimizer", "the whole optimizer step (DeepSpeed's reductions included)"),
    ):
        part = max(sum(s[key] for s in rank) for rank in ranks)
        lines.append(
            f"    {label + ':':60s} {part / step:6.1%}  ({part / len(ranks[0]):.3f} s/step)"
        )
    lines.append(f"    step time: {step / len(ranks[0]):.3f} s")
    return lines


def interleaved_main(out: Path, steps: int, overrides: list[str]) -> None:
    """Inside each rank: an AdamW and a Muon Trainer side by side, stepping in turn (the order
    swapped every step) over the command's own batches (``train.grad_accum_steps`` micro-batches
    a step), each step timed between barriers, with Newton-Schulz and the exchange timed inside
    Muon's."""
    import itertools

    import torch.distributed as dist

    import moetrain.optim.muon_update as muon_update
    from moetrain.config import load_config
    from moetrain.data.splits import build_loader
    from moetrain.optim.partitions import Exchange
    from moetrain.parallel.topology import init_distributed, shutdown
    from moetrain.train.loop import set_up_process
    from moetrain.train.trainer import Trainer

    totals = {"newton_schulz": 0.0, "exchange": 0.0}
    muon_update.orthogonalize_into = _timed(muon_update.orthogonalize_into, totals, "newton_schulz")
    Exchange.gather = _timed(Exchange.gather, totals, "exchange")
    cfgs = {
        side: load_config(ROOT / "configs" / "tiny-cpu.yaml", overrides + list(extra))
        for side, extra in SIDES.items()
    }
    set_up_process(cfgs["adamw"])
    topo = init_distributed(cfgs["adamw"])
    c = cfgs["adamw"]
    loader = build_loader(
        c.data,
        "train",
        c.train.micro_batch_size,
        topo.rank,
        topo.world_size,
        c.seed,
        vocab_size=c.model.vocab_size,
    )
    accum = c.train.grad_accum_steps
    micro = list(itertools.islice(iter(loader), steps * accum))
    batches = [micro[i : i + accum] for i in range(0, len(micro), accum)]
    trainers = {side: Trainer(cfg, topo) for side, cfg in cfgs.items()}
    rows = []
    for i, batch in enumerate(batches):
        row = {}
        for side in SIDES if i % 2 == 0 else reversed(list(SIDES)):
            before = dict(totals)
            dist.barrier()
            t0 = time.perf_counter()
            trainers[side].train_step(batch)
            dist.barrier()
            row[side] = time.perf_counter() - t0
            if side == "muon":
                row.update({k: totals[k] - before[k] for k in totals})
        rows.append(row)
    rank = os.environ.get("RANK", "0")
    (out / f"interleaved-rank{rank}.json").write_text(json.dumps(rows))
    shutdown(topo)


def interleaved(args: argparse.Namespace, data: Path, env: dict[str, str]) -> list[str]:
    """Both optimizers in one process group, step by step in turn: the step-time ratio with the
    machine's load shared alike, and Muon's Newton-Schulz and exchange shares."""
    out = WORK / f"muon-interleaved-ep{args.ep}"
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("*.json"):
        f.unlink()
    cmd = moetrain_cmd(args, data, args.interleaved, 29698, batch_overrides(args))
    overrides = cmd[cmd.index("train") + 2 :]  # (the overrides after the config)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    launch = [torchrun, "--standalone", "--nproc_per_node", "2", __file__, "--interleaved"]
    r = subprocess.run(
        [*launch, str(out), str(args.interleaved), *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise RuntimeError(f"interleaved run failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    ranks = [json.loads(f.read_text())[2:] for f in sorted(out.glob("*.json"))]  # from step 3
    n = len(ranks[0])
    ratios = [ranks[0][i]["muon"] / ranks[0][i]["adamw"] for i in range(n)]  # (barrier-timed)
    muon = max(sum(row["muon"] for row in rank) for rank in ranks)
    lines = [
        f"  interleaved, steps 3-{n + 2} (barrier to barrier): muon / adamw step time median "
        f"{statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f}x); "
        f"adamw {statistics.median(r['adamw'] for r in ranks[0]):.3f} s, muon "
        f"{statistics.median(r['muon'] for r in ranks[0]):.3f} s per step"
    ]
    for key, label in (("newton_schulz", "Newton-Schulz"), ("exchange", "exchange all-reduce")):
        part = max(sum(row[key] for row in rank) for rank in ranks)
        lines.append(f"    {label} share of Muon's step: {part / muon:.1%} (slower rank)")
    return lines


def memory_phases(args: argparse.Namespace, data: Path) -> list[str]:
    """Each side's ``moetrain train`` with ``benchmarks/command_memory.py``'s phase marks (the
    growth of the peak RSS per phase, per rank), the sides alternating over ``--rounds``."""
    from command_memory import launch, table
    from train_command import shape_overrides

    command = [
        "train",
        str(ROOT / "configs" / "tiny-cpu.yaml"),
        *shape_overrides(SHAPES[args.shape]),
        f"data.output_dir={data}",
        f"parallel.ep_size={args.ep}",
        "parallel.zero_stage=2",
        *batch_overrides(args),
        f"train.max_steps={args.long}",
        "train.eval_every=0",
        "train.log_every=5",
        "optim.warmup_steps=0",
        "logging.wandb.mode=disabled",
        "checkpoint.resume=none",
    ]
    peaks: dict[str, list[float]] = {side: [] for side in SIDES}
    lines = []
    for rnd in range(args.rounds):
        for side in list(SIDES) if rnd % 2 == 0 else list(reversed(SIDES)):
            run_dir = WORK / f"memory-{side}"
            shutil.rmtree(run_dir, ignore_errors=True)
            argv = [*command, f"run_dir={run_dir}", *SIDES[side]]
            ranks = launch(WORK / f"muon-memory-{side}", args.long, argv)
            peaks[side].append(max(r[-1]["hwm_mib"] for r in ranks))
            if rnd == args.rounds - 1:
                lines.append(table(f"{side}: moetrain train, {args.long} steps", ranks))
    ratios = [m / a for m, a in zip(peaks["muon"], peaks["adamw"], strict=True)]
    lines.append(
        f"  peak RSS per rank, muon / adamw: median {statistics.median(ratios):.2f}x "
        f"(range {min(ratios):.2f}-{max(ratios):.2f}x); adamw {peaks['adamw']}, muon "
        f"{peaks['muon']} MiB"
    )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--short", type=int, default=4)
    ap.add_argument("--long", type=int, default=20)
    ap.add_argument("--profile-steps", type=int, default=12)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    ap.add_argument("--ep", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--micro", type=int, nargs="+", default=[4], help="train.micro_batch_size")
    ap.add_argument(
        "--accum", type=int, default=1, help="train.grad_accum_steps (tokens per optimizer step)"
    )
    ap.add_argument("--docs", type=int, default=4000, help="documents of the built-in corpus")
    ap.add_argument(
        "--interleaved", type=int, default=0, help="also the in-process A/B over this many steps"
    )
    ap.add_argument("--no-command", action="store_true", help="skip the command's rounds")
    ap.add_argument(
        "--memory", action="store_true", help="also the phase-by-phase peak RSS of each side"
    )
    args = ap.parse_args()
    args.launcher = "deepspeed"
    data = prepare(SHAPES[args.shape], args.docs)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    # DeepSpeed's CPU op in this benchmark's own cache (as train_command.py): a cache shared with
    # other installs is rebuilt by whichever last built it, inside the timed runs
    env.setdefault("TORCH_EXTENSIONS_DIR", str(WORK / "torch-extensions"))
    report = []
    for ep in args.ep:
        for micro in args.micro:
            one = argparse.Namespace(**{**vars(args), "ep": ep, "micro": micro})
            report += [f"\nshape {args.shape}, micro-batch {micro} x {args.accum}, EP {ep}"]
            if not args.no_command:
                report += [f"  the command, {args.rounds} rounds:"]
                report += summary(cost_rounds(one, data, env)) + shares(one, data, env)
            if args.interleaved:
                report += interleaved(one, data, env)
            if args.memory:
                report += memory_phases(one, data)
    print("\n".join(report))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--rank-main":
        rank_main(Path(sys.argv[2]), sys.argv[3:])
    elif len(sys.argv) > 3 and sys.argv[1] == "--interleaved":
        interleaved_main(Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
    else:
        main()
