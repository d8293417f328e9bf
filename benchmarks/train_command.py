"""Training throughput and memory through the command users run: ``moetrain train`` under a
launcher (2 CPU ranks, one thread each) against Hugging Face Mixtral + DeepSpeed ZeRO-2 started
by the same launcher (``benchmarks/peer_train.py``), at the shape of ``train_throughput.py``.

    .venv/bin/python benchmarks/train_command.py                 # deepspeed launcher, bench shape
    .venv/bin/python benchmarks/train_command.py --launcher torchrun --rounds 5
    .venv/bin/python benchmarks/train_command.py --shape fine --peer-cpu-buckets
    .venv/bin/python benchmarks/train_command.py --family qwen3_next --rounds 3
    .venv/bin/python benchmarks/train_command.py --family gemma4_text --rounds 3
    .venv/bin/python benchmarks/train_command.py --family deepseek_v4 --rounds 3
    .venv/bin/python benchmarks/train_command.py --family deepseek_v4 --rounds 3 --sliced --slice 20

Data: the built-in corpus (``builtin:stdlib``, first ``--docs`` documents) prepared once per
vocabulary size into ``runs/bench-command/data-<V>``; both sides read the same token shards.
moetrain runs with its defaults around the step (loader, monitors, metrics.jsonl, the checkpoint
at the end; evaluation every 50 steps is not reached), ZeRO-2, EP ``--ep``, and the peer's
optimizer settings (AdamW at a constant ``train_throughput.LR``, clipping 1.0).

Each round runs, for each side, a short (``--short`` steps) and a long (``--long`` steps) run of
the same command, sides and lengths in alternating order, after one warm-up run of each side:

- tokens/s from outside: ``(long - short) x tokens per step / (wall(long) - wall(short))`` --
  start-up, model build and the final save cancel out;
- tokens/s from inside, over the steps after the first two: the median of moetrain's logged
  ``tokens_per_s`` intervals (metrics.jsonl, one every 2 steps); the peer's median step time;
- peak RSS per rank, the same way for both: ``VmHWM`` of every rank process of the launcher,
  sampled from ``/proc`` every 50 ms until it exits; the maximum over ranks.

With ``--family`` both sides start from one saved source model (``family_source.py``) and
train with the balancing loss the peer's class computes (none for Gemma 4 and DeepSeek-V4); the warm-up runs'
first-step cross-entropies, the same weights on the same batch before any update, must agree
within ``SAME_CE_RTOL`` or the benchmark stops: the two sides train one model.

With ``--sliced`` each round runs both sides' short and long runs at once instead, the machine
given to one side at a time in turns of ``--slice`` seconds (the other stopped), so that both
sides are timed under the same machine conditions however its speed moves (``sliced_rounds.py``):
from inside, the median step time of the steps that ran within one turn, until the first side is
done (moetrain logs every step, ``--log-every 1``; the peer records each step's start and end),
with the steps kept of those timed and all rounds' kept steps together; from outside, each run's
active time (its own turns only; under load start-up alone varies by tens of seconds from run to
run, more than 16 steps take: read the inside figure). The ratio still moves with the load
itself (the peer slows more under contention): say which load a figure holds at.

Reported per round and as medians (with the range) of the paired ratios moetrain / peer.
``--torch-matmul`` adds a third side, moetrain with ``train.cpu_matmul=torch`` (torch's own fp32
GEMMs instead of oneDNN's), reported against the peer and, as what the kernel alone gives,
moetrain / that side. ``--shadow-experts N`` likewise adds moetrain with
``parallel.shadow_experts=N`` (hot experts replicated onto every EP rank each forward), reported
against the peer and as moetrain-shadow / moetrain.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from family_source import (  # noqa: E402
    BENCH_SIZES,
    aux_loss_coef,
    family_config,
    save_family_source,
)
from launched import Launched  # noqa: E402
from sliced_rounds import round_figures, take_turns  # noqa: E402
from time_slices import Timed, moetrain_steps, peer_steps  # noqa: E402
from train_throughput import LR, MICRO, SHAPES, architecture_overrides  # noqa: E402

WORK = ROOT / "runs" / "bench-command"
CONFIG = ROOT / "configs" / "tiny-cpu.yaml"
PY = sys.executable
# --family: the sides' first-step cross-entropies (fp32, one function, one batch) agree to
# rounding (Gemma 4: to all 8 printed digits); the peer scoring 255 of a row's 256 targets
# (labels=input_ids) put them 2.0e-5 apart at gemma4_text
SAME_CE_RTOL = 1e-5


def shape_overrides(shape: dict) -> list[str]:
    return [
        f"model.vocab_size={shape['vocab']}",
        f"model.d_model={shape['d']}",
        f"model.n_layers={shape['layers']}",
        f"model.n_heads={shape['heads']}",
        f"model.n_kv_heads={shape['kv_heads']}",
        f"model.dense_hidden={4 * shape['d']}",
        f"model.max_seq_len={shape['seq']}",
        f"moe.num_experts={shape['experts']}",
        f"moe.top_k={shape['top_k']}",
        f"moe.expert_hidden={shape['hidden']}",
        "moe.aux_loss_coef=0.01",
        "moe.z_loss_coef=0",
        f"data.seq_len={shape['seq']}",
        *architecture_overrides(shape),
    ]


def prepare(shape: dict, docs: int) -> Path:
    data = WORK / f"data-{shape['vocab']}"
    ov = [
        *shape_overrides(shape),
        "data.source=builtin:stdlib",
        f"data.output_dir={data}",
        f"data.max_docs={docs}",
    ]
    subprocess.run([PY, "-m", "moetrain", "prepare", str(CONFIG), *ov], cwd=ROOT, check=True)
    return data


def run(cmd: list[str], env: dict[str, str]) -> dict[str, float]:
    """Run one launcher command; wall seconds, peak VmHWM (MiB) over its rank processes, stdout."""
    return Launched(cmd, ROOT, env).wait()


def launcher(kind: str, port: int, target: list[str]) -> list[str]:
    bin_dir = Path(PY).parent
    if kind == "deepspeed":
        head = [str(bin_dir / "deepspeed"), "--num_gpus", "2", "--master_port", str(port)]
        return head + (["--module", *target[1:]] if target[0] == "-m" else target)
    head = [str(bin_dir / "torchrun"), "--standalone", "--nproc_per_node", "2"]
    return head + target


def run_dir_of(steps: int) -> Path:
    """A fresh ``steps``-step moetrain run's directory, one folder per benchmark script: two
    scripts running at once never empty or read each other's runs."""
    return WORK / Path(sys.argv[0]).stem / f"moetrain-{steps}"


def moetrain_cmd(
    args: argparse.Namespace, data: Path, steps: int, port: int, extra: tuple[str, ...] = ()
) -> list[str]:
    """The command of a fresh ``steps``-step moetrain run (``extra``: more overrides); its
    run_dir is emptied here (moetrain refuses to start fresh over an earlier run's
    checkpoints)."""
    run_dir = run_dir_of(steps)
    shutil.rmtree(run_dir, ignore_errors=True)
    config, sizes = CONFIG, shape_overrides(SHAPES[args.shape])
    family = getattr(args, "family", None)
    if family:
        config, sizes = family_overrides(family, SHAPES[args.shape]["seq"])
    ov = [
        *sizes,
        f"data.output_dir={data}",
        f"run_dir={run_dir}",
        "checkpoint.resume=none",
        f"parallel.ep_size={args.ep}",
        "parallel.zero_stage=2",
        f"train.micro_batch_size={MICRO}",
        f"train.max_steps={steps}",
        f"train.log_every={getattr(args, 'log_every', 2)}",
        "train.precision=fp32",
        f"optim.lr={LR}",
        "optim.grad_clip=1.0",
        "optim.warmup_steps=0",
        "optim.schedule=constant",
        "logging.wandb.mode=disabled",
        *extra,
    ]
    target = ["-m", "moetrain", "train", str(config), *ov]
    return launcher(args.launcher, port, target)


def family_overrides(family: str, seq_len: int) -> tuple[Path, list[str]]:
    """``--family``'s moetrain config and overrides: the architecture from the source
    directory, the training keys as for bench, the balancing loss as the peer's class trains."""
    return family_config(CONFIG, WORK / "family.yaml"), [
        f"checkpoint.init_from={family_dir(family)}",
        f"data.seq_len={seq_len}",
        f"moe.aux_loss_coef={aux_loss_coef(family)}",
        "moe.z_loss_coef=0",
    ]


def family_dir(family: str) -> Path:
    """Where ``--family``'s source model lies (both sides start from it)."""
    return save_family_source(family, WORK / f"family-{family}")


def peer_cmd(args: argparse.Namespace, data: Path, steps: int, port: int) -> list[str]:
    target = [str(HERE / "peer_train.py"), "--data", str(data), "--steps", str(steps)]
    target += ["--shape", args.shape] + (["--cpu-buckets"] if args.peer_cpu_buckets else [])
    if args.family:
        target += ["--hf-dir", str(family_dir(args.family))]
    return launcher(args.launcher, port, target)


def metrics_rows(steps: int) -> list[dict]:
    """The records of the ``steps``-step moetrain run's metrics.jsonl."""
    lines = (run_dir_of(steps) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def first_step_ce(side: str, result: dict, steps: int) -> float:
    """The first step's cross-entropy as the run reports it (moetrain logs step 1 always)."""
    if side.startswith("moetrain"):
        for row in metrics_rows(steps):
            if row.get("step") == 1 and "ce_loss" in row:
                return row["ce_loss"]
        raise RuntimeError(f"{side}: no step-1 ce_loss in {run_dir_of(steps)}/metrics.jsonl")
    return _peer_row(result)["first_ce"]


def check_same_model(first_ce: dict[str, float]) -> None:
    """Both sides train one function: their first-step cross-entropies (same weights, same
    batch, before any update) agree within :data:`SAME_CE_RTOL`, or the benchmark stops."""
    for side, ce in first_ce.items():
        if side == "peer":
            continue
        rel = abs(ce - first_ce["peer"]) / abs(first_ce["peer"])
        print(
            f"first-step cross-entropy {side} {ce:.7f} vs peer {first_ce['peer']:.7f}: "
            f"relative difference {rel:.1e}",
            flush=True,
        )
        if rel > SAME_CE_RTOL:
            raise SystemExit(
                f"{side} and the peer do not train the same model "
                f"(first-step cross-entropy {rel:.1e} apart, > {SAME_CE_RTOL})"
            )


def _peer_row(result: dict) -> dict:
    return json.loads([line for line in result["out"].splitlines() if line.startswith("{")][-1])


def inside_tokens_per_s(side: str, result: dict, steps: int, tokens_per_step: int) -> float:
    """The run's own figure over the steps after the first two, the same way for both: the
    median of moetrain's logged tokens/s intervals, the median of the peer's step times."""
    if side.startswith("moetrain"):
        return statistics.median(
            r["tokens_per_s"] for r in metrics_rows(steps) if "tokens_per_s" in r and r["step"] > 2
        )
    return tokens_per_step / _peer_row(result)["step_s"]


def timed_steps(side: str, result: dict, steps: int) -> list[Timed]:
    """The run's own timed steps after the first two (wall-clock start, end, steps)."""
    if side.startswith("moetrain"):
        return moetrain_steps(metrics_rows(steps))
    return peer_steps(_peer_row(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--short", type=int, default=4)
    ap.add_argument("--long", type=int, default=20)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--launcher", choices=["deepspeed", "torchrun"], default="deepspeed")
    ap.add_argument("--peer-cpu-buckets", action="store_true")
    ap.add_argument(
        "--family",
        choices=sorted(BENCH_SIZES),
        help="a released family's architecture at the bench size, both sides from one "
        "source model (family_source.py)",
    )
    ap.add_argument("--docs", type=int, default=4000, help="documents of the built-in corpus")
    ap.add_argument(
        "--torch-matmul",
        action="store_true",
        help="also run moetrain with train.cpu_matmul=torch (torch's own fp32 GEMMs) each round",
    )
    ap.add_argument(
        "--shadow-experts",
        type=int,
        default=0,
        help="also run moetrain with parallel.shadow_experts=N each round (0: not)",
    )
    ap.add_argument(
        "--sliced",
        action="store_true",
        help="run the sides at once, one at a time in turns of --slice seconds (sliced_rounds.py)",
    )
    ap.add_argument(
        "--slice",
        type=float,
        default=20.0,
        help="seconds per turn with --sliced: several step times (a step fits in a turn only "
        "from a turn's start up to its length before the end, so short turns keep few steps, "
        "and more of the fast ones than of the slow)",
    )
    ap.add_argument(
        "--log-every",
        type=int,
        help="moetrain's train.log_every (default: 1 with --sliced, every step timed; else 2)",
    )
    args = ap.parse_args()
    if args.sliced and (args.torch_matmul or args.shadow_experts):
        ap.error(
            "--sliced compares moetrain and the peer only (no --torch-matmul, --shadow-experts)"
        )
    if args.slice <= 0 or (args.log_every is not None and args.log_every < 1):
        ap.error("--slice must be > 0 and --log-every >= 1")
    if args.log_every is None:
        args.log_every = 1 if args.sliced else 2

    shape = SHAPES[args.shape]
    data = args.data = prepare(shape, args.docs)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    # DeepSpeed's CPU op built once, here: a cache shared with other installs is rebuilt by
    # whichever last built it, and a compiler inheriting RANK would count as a rank's memory
    env.setdefault("TORCH_EXTENSIONS_DIR", str(WORK / "torch-extensions"))
    args.tokens_per_step = 2 * MICRO * shape["seq"]
    builders = {"moetrain": moetrain_cmd, "peer": peer_cmd}
    if args.torch_matmul:
        builders["moetrain-torch-matmul"] = functools.partial(
            moetrain_cmd, extra=("train.cpu_matmul=torch",)
        )
    if args.shadow_experts:
        builders["moetrain-shadow"] = functools.partial(
            moetrain_cmd, extra=(f"parallel.shadow_experts={args.shadow_experts}",)
        )
    port = random.randrange(20000, 30000, 100)  # (launchers of other jobs on the machine)
    first_ce = {}
    for side, build in builders.items():  # warm-up: caches, the compiled DeepSpeed op
        port += 1
        first_ce[side] = first_step_ce(
            side, run(build(args, data, args.short, port), env), args.short
        )
        print(f"warm-up {side} done", flush=True)
    if args.family:
        check_same_model(first_ce)
    sides_vs_peer = [side for side in builders if side != "peer"]
    each_round = sliced_round if args.sliced else sequential_round
    if args.sliced:
        sliced_records().unlink(missing_ok=True)
    rounds: list[dict[str, dict]] = []
    for rnd in range(args.rounds):
        sides = list(builders) if rnd % 2 == 0 else list(reversed(builders))
        lengths = [args.short, args.long] if rnd % 2 == 0 else [args.long, args.short]
        res, port = each_round(args, {side: builders[side] for side in sides}, lengths, port, env)
        rounds.append(res)
        for side in sides:
            shown = {k: v for k, v in res[side].items() if k != "kept_s"}
            print(f"round {rnd} {side}: {json.dumps(shown)}", flush=True)
        load = "/".join(f"{x:.1f}" for x in os.getloadavg())
        for side in sides_vs_peer:
            print(
                f"round {rnd}: {side}/peer {ratio(res, side, 'peer', 'outside'):.2f}x tokens/s "
                f"(inside {ratio(res, side, 'peer', 'inside'):.2f}x), peak RSS "
                f"{ratio(res, side, 'peer', 'peak_rss_mib'):.2f}x; load average {load}",
                flush=True,
            )

    what = f"family {args.family} at the bench size" if args.family else f"shape {args.shape}"
    print(f"\n{what}, launcher {args.launcher}, EP {args.ep}, {args.rounds} rounds")
    pairs = [(side, "peer") for side in sides_vs_peer]
    if args.torch_matmul:  # what the kernel alone gives, round by round
        pairs.append(("moetrain", "moetrain-torch-matmul"))
    if args.shadow_experts:  # what the shadows alone give, round by round
        pairs.append(("moetrain-shadow", "moetrain"))
    for a, b in pairs:
        print(f"{a} / {b}:")
        for key, label in (
            ("outside", "tokens/s from outside"),
            ("inside", "tokens/s from the runs' own figures"),
            ("peak_rss_mib", "peak RSS per rank"),
        ):
            xs = [ratio(res, a, b, key) for res in rounds]
            summary = f"median {statistics.median(xs):.2f}x (range {min(xs):.2f}-{max(xs):.2f})"
            print(f"  {label + ':':37s} {summary}")
    if args.sliced:  # every round's kept steps together
        kept = {side: [t for res in rounds for t in res[side]["kept_s"]] for side in builders}
        med = {side: statistics.median(times) for side, times in kept.items()}
        print(
            f"  all rounds' kept steps: moetrain {med['moetrain']:.3f} s ({len(kept['moetrain'])}"
            f" steps), peer {med['peer']:.3f} s ({len(kept['peer'])}): "
            f"{med['peer'] / med['moetrain']:.2f}x tokens/s"
        )


def sequential_round(
    args: argparse.Namespace, builders: dict, lengths: list[int], port: int, env: dict
) -> tuple[dict[str, dict], int]:
    """One round of the sides' runs one after another: each side's ``lengths`` in turn."""
    res: dict[str, dict] = {}
    for side, build in builders.items():
        walls, peak, inner = {}, 0.0, 0.0
        for steps in lengths:
            port += 1
            r = run(build(args, args.data, steps, port), env)
            walls[steps], peak = r["wall_s"], max(peak, r["peak_rss_mib"])
            if steps == args.long:
                inner = inside_tokens_per_s(side, r, steps, args.tokens_per_step)
        tokens = (args.long - args.short) * args.tokens_per_step
        outside = tokens / (walls[args.long] - walls[args.short])
        res[side] = {"outside": outside, "inside": inner, "peak_rss_mib": peak}
    return res, port


def sliced_records() -> Path:
    """Where ``--sliced`` records every round's turns and timed steps (emptied at its start)."""
    return run_dir_of(0).parent / "sliced-rounds.jsonl"


def sliced_round(
    args: argparse.Namespace, builders: dict, lengths: list[int], port: int, env: dict
) -> tuple[dict[str, dict], int]:
    """One round of the sides' runs at once, taking turns of ``--slice`` seconds
    (``sliced_rounds.py``)."""
    ports = iter(range(port + 1, port + 1 + len(builders) * len(lengths)))

    def start(side: str, steps: int) -> Launched:
        return Launched(builders[side](args, args.data, steps, next(ports)), ROOT, env)

    runs = take_turns({side: lengths for side in builders}, start, args.slice)
    record = {
        side: {
            n: {
                "slices": r["slices"],
                "timed": timed_steps(side, r["result"], n),
                "peak_rss_mib": r["result"]["peak_rss_mib"],
            }
            for n, r in side_runs.items()
        }
        for side, side_runs in runs.items()
    }
    with sliced_records().open("a") as f:
        f.write(json.dumps(record) + "\n")  # every turn and timed step, to check the figures by
    res = round_figures(record, args.short, args.long, args.tokens_per_step)
    return res, port + len(builders) * len(lengths)


def ratio(res: dict[str, dict[str, float]], a: str, b: str, key: str) -> float:
    return res[a][key] / res[b][key]


if __name__ == "__main__":
    main()
