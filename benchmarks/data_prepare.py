"""Prepare throughput: one process vs two, and two loopback "nodes" vs one process.

    .venv/bin/python benchmarks/data_prepare.py [--rounds 3] [--nodes] [--work DIR]

Every case prepares the same source with the same trained tokenizer (``configs/tiny-cpu.yaml``:
``builtin:stdlib``, vocab 4096) into a fresh directory, end to end (reading the corpus, the
plan, tokenizing, packing the shards, fsync and rename), and the outputs are checked to be the
same bytes. Cases run interleaved round by round, and the speed-ups are the medians of the
paired per-round ratios (the machine may be shared):

- ``1 proc``: one process, ``data.num_proc=1``;
- ``pool 2``: one process with a pool of 2 tokenizing workers (``data.num_proc=2``);
- ``2 ranks``: two rank processes (``RANK``/``WORLD_SIZE``), one worker each; both are started
  and have imported everything before the clock starts, as ``pool 2``'s pool is part of its run;
- with ``--nodes``: ``1 CLI`` (``python -m moetrain prepare``, one process) vs ``2 nodes``: two
  ``launch/multinode-torchrun.sh`` agents (``COMMAND=prepare``) of one rank each, meeting on
  127.0.0.1; both timed as whole commands, start-up included.

It first prints the first full prepare of tiny-cpu.yaml (builtin corpus build + tokenizer
training + shards), the README's first step. For the in-process cases it also reads the phase
times ``prepare`` prints (reading the source, the plan, tokenizing, packing) and reports the
serial part of the one-process run: everything but tokenizing, which is all that more processes
share, and the speed-up that bound allows (Amdahl), next to the tokenizing phase's own speed-up.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moetrain.config import load_config
from moetrain.data import read_index
from moetrain.data.builtin import builtin_cache_path
from moetrain.data.prepare import prepare
from moetrain.data.ranks import Ranks

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs/tiny-cpu.yaml"


def _config(out: Path, *overrides: str):
    return load_config(CONFIG, [f"data.output_dir={out}", *overrides])


PHASES: dict[str, list[dict[str, float]]] = {}  # case -> per round: phase -> seconds


def in_process(out: Path, overrides: list[str], case: str = "") -> float:
    cfg = _config(out, *overrides)
    printed = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(printed):
        prepare(cfg)
    wall = time.perf_counter() - t0
    line = re.search(r"times of rank 0: (.*)", printed.getvalue())
    if case and line:
        phases = {
            k.strip(): float(v) for k, v in re.findall(r"([a-z ]+?) ([0-9.]+)s", line.group(1))
        }
        PHASES.setdefault(case, []).append(phases | {"wall": wall})
    return wall


def _rank_main(cfg, rank: int, world: int, go) -> None:
    go.wait()
    prepare(cfg, Ranks(rank, world, world))


def ranks(out: Path, overrides: list[str], world: int) -> float:
    """``world`` forked rank processes, released together once started."""
    cfg = _config(out, *overrides)
    ctx = multiprocessing.get_context("fork")
    go = ctx.Event()
    procs = [ctx.Process(target=_rank_main, args=(cfg, r, world, go)) for r in range(world)]
    for p in procs:
        p.start()
    time.sleep(1.0)
    t0 = time.perf_counter()
    go.set()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"a rank failed: {[p.exitcode for p in procs]}")
    return time.perf_counter() - t0


def cli(out: Path, overrides: list[str]) -> float:
    cmd = [sys.executable, "-m", "moetrain", "prepare", str(CONFIG), f"data.output_dir={out}"]
    t0 = time.perf_counter()
    subprocess.run([*cmd, *overrides], cwd=REPO, check=True, capture_output=True)
    return time.perf_counter() - t0


def two_nodes(out: Path, overrides: list[str]) -> float:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(
        COMMAND="prepare", NNODES="2", NPROC="1", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), LOCAL_ADDR="127.0.0.1", RDZV_ID="bench", MAX_RESTARTS="0",
        GPUS="0", PYTHON=sys.executable,
    )  # fmt: skip
    cmd = [
        "bash",
        "launch/multinode-torchrun.sh",
        str(CONFIG),
        f"data.output_dir={out}",
        *overrides,
    ]
    t0 = time.perf_counter()
    first = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)  # fmt: skip
    second = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)  # fmt: skip
    if first.wait() or second.wait():
        raise RuntimeError("a node failed")
    return time.perf_counter() - t0


def same_bytes(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    if names != sorted(p.name for p in b.iterdir()):
        return False
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nodes", action="store_true", help="also 2 loopback nodes vs 1 process")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"cpus={os.cpu_count()} loadavg={os.getloadavg()}")

    had_cache = builtin_cache_path(work).is_file()
    dt = in_process(work / "full", [])
    index = read_index(work / "full")
    n = sum(index["splits"][s]["num_tokens"] for s in ("train", "val"))
    print(
        f"RESULT first prepare of tiny-cpu.yaml (corpus cached before: {had_cache}): {dt:.1f}s, {n:,} tokens"
    )
    tok = [f"data.tokenizer_model={work / 'full' / 'tokenizer.model'}"]
    cases = {
        "1 proc": lambda out: in_process(out, [*tok, "data.num_proc=1"], "1 proc"),
        "pool 2": lambda out: in_process(out, [*tok, "data.num_proc=2"], "pool 2"),
        "2 ranks": lambda out: ranks(out, [*tok, "data.num_proc=1"], 2),
    }
    if args.nodes:
        cases["1 CLI"] = lambda out: cli(out, [*tok, "data.num_proc=1"])
        cases["2 nodes"] = lambda out: two_nodes(out, [*tok, "data.num_proc=1"])
    times: dict[str, list[float]] = {name: [] for name in cases}
    first_out = None
    for r in range(args.rounds):
        for name, run in cases.items():
            out = work / f"r{r}-{name.replace(' ', '-')}"
            times[name].append(run(out))
            first_out = first_out or out
            assert same_bytes(out, first_out), f"{name}: output differs from {first_out}"
            shutil.rmtree(out) if out != first_out else None
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
    for name, ts in times.items():
        print(
            f"RESULT {name}: median {statistics.median(ts):.2f}s, {n / statistics.median(ts):,.0f} tokens/s ({', '.join(f'{t:.2f}' for t in ts)})"
        )

    def ratio(slow: str, fast: str) -> None:
        per_round = [a / b for a, b in zip(times[slow], times[fast], strict=True)]
        print(
            f"RESULT speed-up {fast} vs {slow}: median {statistics.median(per_round):.2f}x (rounds: {', '.join(f'{x:.2f}' for x in per_round)})"
        )

    ratio("1 proc", "pool 2")
    ratio("1 proc", "2 ranks")
    for case, rounds in PHASES.items():
        names = [k for k in rounds[0] if k != "wall"]
        print(f"RESULT phases {case}, median s: " + ", ".join(f"{k} {statistics.median(r.get(k, 0) for r in rounds):.2f}" for k in [*names, "wall"]))  # fmt: skip
    if "1 proc" in PHASES and "pool 2" in PHASES:
        serial = [r["wall"] - r["tokenize"] for r in PHASES["1 proc"]]
        frac = [s / r["wall"] for s, r in zip(serial, PHASES["1 proc"], strict=True)]
        f = statistics.median(frac)
        tok_up = [a["tokenize"] / b["tokenize"] for a, b in zip(PHASES["1 proc"], PHASES["pool 2"], strict=True)]  # fmt: skip
        print(
            f"RESULT serial part of 1 proc (all but tokenizing): median {statistics.median(serial):.2f}s = {f:.1%} "
            f"(rounds: {', '.join(f'{x:.1%}' for x in frac)}); Amdahl bound for 2 processes {1 / (f + (1 - f) / 2):.2f}x"
        )
        print(
            f"RESULT tokenizing phase, pool 2 vs 1 proc: median {statistics.median(tok_up):.2f}x (rounds: {', '.join(f'{x:.2f}' for x in tok_up)})"
        )
    if args.nodes:
        ratio("1 CLI", "2 nodes")
    print(f"loadavg at the end={os.getloadavg()}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
