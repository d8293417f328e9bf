"""Loss against tokens: moetrain's MoE, the same model dense at equal active FFN size, Hugging
Face Mixtral trained with the same math (``benchmarks/quality_peer.py``), and the MoE with Muon.

    .venv/bin/python benchmarks/quality.py run --out DIR [--steps 5000] [--seeds 1234 1235]
    .venv/bin/python benchmarks/quality.py sweep --out DIR --kinds moe muon [--steps 1000]
    .venv/bin/python benchmarks/quality.py run --out DIR --kinds moe muon --lr-from-sweep
    .venv/bin/python benchmarks/quality.py report --out DIR     # table (markdown) + quality.png

Every run is ``configs/tiny-cpu.yaml`` on its own corpus (``moetrain prepare`` first) with the
same seed, token stream, optimizer, schedule and clipping, through the command a user runs:
- ``moe``: ``torchrun -m moetrain train`` as configured (8 experts, top-2, expert hidden 256);
- ``dense``: the same with every layer dense at hidden 512 = top_k x expert_hidden, the MoE's
  active FFN size (``moe.first_k_dense=n_layers``);
- ``hf``: ``MixtralForCausalLM`` + DeepSpeed ZeRO from the ``moe`` run's first weights;
- ``muon``: the ``moe`` run with ``optim.name=muon`` (AdamW's learning rate and weight decay
  carry over by Moonlight's rule; the embedding, LM head, router and norms stay on AdamW).
``sweep`` runs each ``--kinds`` at each ``--lrs`` for ``--steps`` (a short cosine schedule, the
first seed); ``run --lr-from-sweep`` then takes each kind's learning rate with the lowest final
validation loss there (``--lr`` gives one to every kind). ``report`` adds the paired
``muon - moe`` difference and the tokens Muon needs to reach AdamW's final validation loss.
``--world`` ranks (default 1 rank with 2 threads and the quickstart's global batch of 16
sequences: the layouts compute the same, see the parity tests, and one rank is faster here).
``--threads 1`` lets the kinds run side by side (one command per ``--kinds``; ``prepare`` first).
Runs go seed by seed; a finished run (its last validation loss written) is skipped, so the
command can be repeated to add seeds. Extra ``key=value`` arguments after ``--`` go to every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "tiny-cpu.yaml"
KINDS = ("moe", "dense", "hf", "muon")
DENSE = ["moe.first_k_dense=4", "model.dense_hidden=512", "parallel.ep_size=1"]
KIND_SETTINGS = {"dense": DENSE, "muon": ["optim.name=muon"]}
SWEEP = "sweep"  # the sweep's runs: DIR/sweep/<kind>-lr<lr>-seed<seed>


def common(steps: int, seed: int, world: int, threads: int) -> list[str]:
    """Overrides every run of one seed shares (global batch 16 x 128 tokens at any world)."""
    return [
        f"seed={seed}",
        f"train.max_steps={steps}",
        f"train.micro_batch_size={16 // world}",
        f"train.threads_per_rank={threads}",
        f"parallel.ep_size={world}",
        "train.eval_every=250",
        "train.eval_steps=18",  # 288 sequences: the whole validation split
        "train.log_every=50",
        "checkpoint.save_every_steps=1000",
    ]


def command(kind: str, out: Path, overrides: list[str], world: int) -> list[str]:
    torchrun = [
        str(Path(sys.executable).parent / "torchrun"),
        "--standalone",
        f"--nproc_per_node={world}",
    ]
    if kind == "hf":
        return [
            *torchrun,
            str(ROOT / "benchmarks" / "quality_peer.py"),
            "--out",
            str(out),
            str(CONFIG),
            *overrides,
        ]
    extra = KIND_SETTINGS.get(kind, [])
    return [*torchrun, "-m", "moetrain", "train", str(CONFIG), f"run_dir={out}", *overrides, *extra]


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finished(run: Path, steps: int) -> bool:
    return any(r.get("step") == steps and "val_loss" in r for r in read_metrics(run))


def train(kind: str, out: Path, overrides: list[str], args: argparse.Namespace) -> None:
    """One run of ``kind`` into ``out`` (its log beside it)."""
    threads = args.threads or 2 // args.world
    log = out.parent / f"{out.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"{out.name}: {log}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    with open(log, "a") as f:
        subprocess.run(
            command(kind, out, overrides, args.world),
            cwd=ROOT,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            check=True,
        )


def run(args: argparse.Namespace) -> None:
    subprocess.run([sys.executable, "-m", "moetrain", "prepare", str(CONFIG)], cwd=ROOT, check=True)
    lrs = best_lrs(args.out) if args.lr_from_sweep else {}
    for seed in args.seeds:
        for kind in args.kinds:
            out = args.out / f"{kind}-seed{seed}"
            if finished(out, args.steps):
                continue
            threads = args.threads or 2 // args.world
            overrides = common(args.steps, seed, args.world, threads) + args.overrides
            lr = args.lr or lrs.get(kind)
            if args.lr_from_sweep and lr is None:
                raise SystemExit(f"no finished sweep run of {kind} in {args.out / SWEEP}")
            train(kind, out, overrides + ([f"optim.lr={lr}"] if lr else []), args)


def sweep(args: argparse.Namespace) -> None:
    """Each kind at each learning rate, ``--steps`` steps (a short cosine), the first seed."""
    subprocess.run([sys.executable, "-m", "moetrain", "prepare", str(CONFIG)], cwd=ROOT, check=True)
    seed, threads = args.seeds[0], args.threads or 2 // args.world
    for kind in args.kinds:
        for lr in args.lrs:
            out = args.out / SWEEP / f"{kind}-lr{lr:g}-seed{seed}"
            if finished(out, args.steps):
                continue
            overrides = common(args.steps, seed, args.world, threads) + [f"optim.lr={lr}"]
            train(kind, out, overrides + args.overrides, args)


def sweep_results(out: Path) -> dict[str, dict[float, float]]:
    """kind -> learning rate -> final validation loss of the finished sweep runs."""
    found: dict[str, dict[float, float]] = {}
    for run_dir in sorted(p for p in (out / SWEEP).glob("*-lr*-seed*") if p.is_dir()):
        kind, _, rest = run_dir.name.partition("-lr")
        vals = [r for r in read_metrics(run_dir) if "val_loss" in r]
        if vals:
            found.setdefault(kind, {})[float(rest.partition("-seed")[0])] = vals[-1]["val_loss"]
    return found


def best_lrs(out: Path) -> dict[str, float]:
    """Each swept kind's learning rate of the lowest final validation loss."""
    return {kind: min(by_lr, key=by_lr.get) for kind, by_lr in sweep_results(out).items()}


def val_curves(out: Path) -> dict[str, dict[int, dict[int, float]]]:
    """kind -> seed -> {step: val_loss}."""
    curves: dict[str, dict[int, dict[int, float]]] = {k: {} for k in KINDS}
    for run_dir in sorted(p for p in out.iterdir() if p.is_dir()):
        kind, _, seed = run_dir.name.partition("-seed")
        if kind in curves and seed.isdigit():
            vals = {r["step"]: r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r}
            if vals:
                curves[kind][int(seed)] = vals
    return curves


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def paired(curves: dict, a: str, b: str, step: int) -> list[float]:
    """``a - b`` val loss at ``step`` for every seed both have."""
    seeds = [
        s for s in curves[a] if s in curves[b] and step in curves[a][s] and step in curves[b][s]
    ]
    return [curves[a][s][step] - curves[b][s][step] for s in seeds]


def tokens_to_reach(curve: dict[int, float], target: float) -> float | None:
    """The first step at which ``curve`` (step -> val loss) reaches ``target``, interpolated
    linearly between evaluations (at most the first evaluation's step); None if it never does."""
    before = None
    for step, value in sorted(curve.items()):
        if value <= target:
            if before is None:
                return float(step)
            (s0, v0) = before
            return s0 + (step - s0) * (v0 - target) / (v0 - value)
        before = (step, value)
    return None


def report(args: argparse.Namespace) -> None:
    curves = val_curves(args.out)
    steps = sorted({s for kind in curves.values() for vals in kind.values() for s in vals})
    shown = [s for s in steps if s in (250, 500, 1000, 2000, 3000, 4000) or s == steps[-1]]
    tokens_per_step = 16 * 128
    seeds = {k: sorted(v) for k, v in curves.items()}
    print(f"seeds: {seeds}")
    print("| step | tokens | moe | dense | hf | muon | moe - dense | moe - hf | muon - moe |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in shown:
        cells = [spread([v[s] for v in curves[k].values() if s in v]) for k in KINDS]
        diffs = [spread(paired(curves, a, b, s)) for a, b in PAIRS]
        print(f"| {s} | {s * tokens_per_step / 1e6:.2f}M | " + " | ".join(cells + diffs) + " |")
    ratios = []
    for seed, adamw in sorted(curves["moe"].items()):
        muon = curves["muon"].get(seed)
        if muon and max(adamw) == max(muon):
            last = max(adamw)
            reach = tokens_to_reach(muon, adamw[last])
            ratios.append(reach / last if reach is not None else float("nan"))
            print(
                f"seed {seed}: Muon reaches AdamW's step-{last} validation loss "
                f"{adamw[last]:.3f} at step {reach if reach is None else round(reach)}"
            )
    if ratios:
        print(f"tokens Muon needs for AdamW's final validation loss: {spread(ratios)} x AdamW's")
    for kind, by_lr in sweep_results(args.out).items():
        cells = ", ".join(f"{lr:g}: {v:.3f}" for lr, v in sorted(by_lr.items()))
        print(f"sweep {kind}: final validation loss by learning rate: {cells}")
    plot(curves, tokens_per_step, args.out / "quality.png")


PAIRS = (("moe", "dense"), ("moe", "hf"), ("muon", "moe"))


def plot(curves: dict, tokens_per_step: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red")
    for kind, color in zip(KINDS, colors, strict=True):
        for i, (_, vals) in enumerate(sorted(curves[kind].items())):
            xs = [s * tokens_per_step / 1e6 for s in sorted(vals)]
            ax.plot(
                xs,
                [vals[s] for s in sorted(vals)],
                color=color,
                alpha=0.8,
                label=kind if i == 0 else None,
                linewidth=1,
            )
    ax.set_xlabel("tokens (M)")
    ax.set_ylabel("validation loss")
    ax.set_ylim(top=5.5)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--steps", type=int, default=5000)
    r.add_argument("--seeds", type=int, nargs="+", default=[1234, 1235])
    r.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    r.add_argument("--world", type=int, choices=(1, 2), default=1)
    r.add_argument("--threads", type=int, help="threads per rank (default 2 / world)")
    r.add_argument("--lr", type=float, help="optim.lr of every run")
    r.add_argument(
        "--lr-from-sweep", action="store_true", help="each kind's best learning rate of `sweep`"
    )
    r.add_argument("overrides", nargs="*")
    w = sub.add_parser("sweep")
    w.add_argument("--out", type=Path, required=True)
    w.add_argument("--steps", type=int, default=1000)
    w.add_argument("--seeds", type=int, nargs="+", default=[1234])
    w.add_argument("--kinds", nargs="+", choices=KINDS, default=["moe", "muon"])
    w.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    w.add_argument("--world", type=int, choices=(1, 2), default=1)
    w.add_argument("--threads", type=int, help="threads per rank (default 2 / world)")
    w.add_argument("overrides", nargs="*")
    p = sub.add_parser("report")
    p.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    {"run": run, "sweep": sweep, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
