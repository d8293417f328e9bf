"""Two implementations measured side by side at several sequence lengths: alternating rounds
(each round runs both, the order reversed from round to round) and the table of their times,
peak memory and per-round ratios (median over rounds, with the range)."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

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


def measure_step(step: Callable[[], None], repeats: int) -> dict:
    """In a fresh process (glibc's mmap threshold set to 64 KiB before torch is imported, so
    that RSS follows live tensors): one warm-up ``step``, the peak RSS of one step over the RSS
    just before it (peak reset through /proc/self/clear_refs), then under the allocator
    ``moetrain train`` sets on CPU one warm-up step and the median CPU time of ``repeats``."""
    import time
    from pathlib import Path

    from moetrain.train.host_allocator import tune_host_allocator

    def rss_kib(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise RuntimeError(field)

    step()
    Path("/proc/self/clear_refs").write_text("5")
    base = rss_kib("VmRSS")
    step()
    mib = (rss_kib("VmHWM") - base) / 1024
    tune_host_allocator("keep")
    step()
    times = []
    for _ in range(repeats):
        c0 = time.process_time()
        step()
        times.append(time.process_time() - c0)
    return {"mib": mib, "s": statistics.median(times)}


def run_child(script: str, args: list[str]) -> dict:
    """``script --child ...args`` in a fresh one-thread process; its ``RESULT {json}`` line."""
    import json
    import os
    import subprocess
    from pathlib import Path

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = str(Path(script).resolve().parents[1])
    proc = subprocess.run(
        [sys.executable, script, *args], env=env, capture_output=True, text=True, check=False
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        raise RuntimeError(f"{args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[0][len("RESULT ") :])
