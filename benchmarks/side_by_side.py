"""Two implementations measured side by side at several sequence lengths: alternating rounds
(each round runs both, the order reversed from round to round) and the table of their times,
peak memory and per-round ratios (median over rounds, with the range); and the measurement of
one fwd+bwd step in a fresh process (:func:`measure_step`, :func:`run_child`); the command line
of a layer's benchmark (:func:`layer_main`)."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

_M_MMAP_THRESHOLD = -3

Runs = dict[str, list[dict]]  # name -> one result per round: {"s": seconds, "mib": peak MiB}


def alternating_rounds(
    names: tuple[str, str], seq_lens: list[int], rounds: int, run: Callable[[str, int], dict]
) -> list[tuple[int, Runs]]:
    """``run(name, s)`` of both names, ``rounds`` times per sequence length, alternating."""
    rows = []
    for s in seq_lens:
        runs: Runs = {n: [] for n in names}
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                runs[name].append(run(name, s))
                print(f"  S={s} round {r} {name}: {runs[name][-1]}", file=sys.stderr)
        rows.append((s, runs))
    return rows


def print_table(rows: list[tuple[int, Runs]], names: tuple[str, str]) -> None:
    """One line per sequence length: each side's median time and memory, the speed-up of the
    first over the second and its memory ratio."""
    a_name, b_name = names
    print(
        f"| S | {a_name} s | {b_name} s | speed-up (range) | {a_name} MiB | {b_name} MiB | "
        "memory ratio (range) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for s, runs in rows:
        ours, peer = runs[a_name], runs[b_name]
        t = sorted(b["s"] / a["s"] for a, b in zip(ours, peer, strict=True))
        m = sorted(a["mib"] / b["mib"] for a, b in zip(ours, peer, strict=True))

        def med(xs: list[dict], key: str) -> float:
            return statistics.median(x[key] for x in xs)

        print(
            f"| {s} | {med(ours, 's'):.2f} | {med(peer, 's'):.2f} | "
            f"{statistics.median(t):.2f}x ({t[0]:.2f}-{t[-1]:.2f}x) | {med(ours, 'mib'):.0f} | "
            f"{med(peer, 'mib'):.0f} | {statistics.median(m):.2f}x ({m[0]:.2f}-{m[-1]:.2f}x) |"
        )


def map_large_blocks() -> None:
    """glibc serves allocations >= 64 KiB by mmap, so that RSS follows live tensors (call first
    in a measuring child)."""
    ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, 65536)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def measure_step(step: Callable[[], None], repeats: int) -> dict:
    """One warm-up ``step``, then the peak RSS of one over the RSS just before it (peak reset
    through /proc/self/clear_refs); then, under ``moetrain train``'s CPU allocator setting
    (``keep``), one warm-up and the median CPU time of ``repeats`` steps."""
    from moetrain.train.host_allocator import tune_host_allocator

    step()
    Path("/proc/self/clear_refs").write_text("5")
    base = _rss_kib("VmRSS")
    step()
    mib = (_rss_kib("VmHWM") - base) / 1024
    tune_host_allocator("keep")
    step()
    times = []
    for _ in range(repeats):
        c0 = time.process_time()
        step()
        times.append(time.process_time() - c0)
    return {"mib": mib, "s": statistics.median(times)}


def run_child(script: str, args: list[str], what: str) -> dict:
    """``script --child ...args`` in a fresh process, one thread; its ``RESULT {json}`` line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[0][len("RESULT ") :])


def layer_main(
    script: str,
    doc: str,
    paths: tuple[str, str],
    child: Callable[[str, int, int], dict],
    header: Callable[[int, int], str],
) -> None:
    """A layer benchmark's command line (``--seq-lens``, ``--rounds``, ``--repeats``): as
    ``--child PATH``, ``child(PATH, s, repeats)``'s result line; else alternating rounds of
    ``paths``, each run a fresh ``script --child``, and their table under
    ``header(rounds, repeats)``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.seq_lens[0], args.repeats)))
        return

    def run(path: str, s: int) -> dict:
        cmd = ["--child", path, "--seq-lens", str(s), "--repeats", str(args.repeats)]
        return run_child(script, cmd, f"{path} at S={s}")

    rows = alternating_rounds(paths, args.seq_lens, args.rounds, run)
    print(f"\n{header(args.rounds, args.repeats)}\n")
    print_table(rows, paths)
