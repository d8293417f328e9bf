"""moetrain.train.host_allocator, each case in a fresh interpreter (this process's allocator is
left alone): one arena for every thread; ``keep`` maps large blocks on their own until it is
settled, then reuses freed buffers without page faults; an environment setting wins."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

from moetrain.train.host_allocator import tune_host_allocator

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc on Linux")
PAGES_64MIB = 64 * 2**20 // 4096

PROBE = """
import ctypes, json, sys, threading
import torch
from moetrain.train.host_allocator import settle_host_allocator, tune_host_allocator

def minor_faults():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])

note = tune_host_allocator(sys.argv[1])
faults, settled = [], []
for i in range(20):  # a step's pattern: 64 MiB (above glibc's largest mmap threshold) and others
    before = minor_faults()
    x, h = torch.ones(4 * 2**20), torch.ones(16 * 2**20)
    y = (h * 2).sum() + (torch.ones(9 * 2**20) * x.sum()).sum()
    del x, h, y
    faults.append(minor_faults() - before)
    if i == 2:  # (the trainer settles after its first step)
        settled += [settle_host_allocator(), settle_host_allocator()]
threads = [threading.Thread(target=lambda: torch.ones(2**16).sum()) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({"note": note, "faults": faults, "settled": settled}), flush=True)
ctypes.CDLL("libc.so.6").malloc_stats()  # per arena, on stderr
"""


@functools.cache
def _probe(mode: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environ.pop("GLIBC_TUNABLES", None)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        env={**environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["arenas"] = out.stderr.count("Arena ")
    return result


@LINUX
def test_one_arena_for_every_thread() -> None:
    system, one = _probe("system"), _probe("one_arena")
    assert system["note"] is None and system["arenas"] > 1  # the threads made arenas
    assert one["note"] == "host allocator: one malloc arena for every thread"
    assert one["arenas"] == 1


@LINUX
def test_keep_reuses_freed_buffers_without_page_faults() -> None:
    system, kept = _probe("system"), _probe("keep")
    assert min(system["faults"][5:]) > PAGES_64MIB  # mapped and faulted in again every time
    assert kept["arenas"] == 1 and "kept on the heap" in kept["note"]
    # until settled, large blocks are mapped on their own (and given back when freed)
    assert min(kept["faults"][1:3]) > PAGES_64MIB
    assert kept["settled"] == [True, False] and system["settled"] == [False, False]
    # once the heap holds the pattern's blocks (a few rounds; how many varies) they are reused
    # as they are: the last ten rounds together fault fewer pages than two rounds by default
    assert sum(kept["faults"][10:]) < 2 * PAGES_64MIB


@LINUX
def test_an_environment_setting_wins() -> None:
    kept = _probe("keep", MALLOC_ARENA_MAX="2")
    assert (
        kept["note"] == "host allocator: left as it is (MALLOC_ARENA_MAX is set in the environment)"
    )
    assert min(kept["faults"][5:]) > PAGES_64MIB


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="one_arena"):
        tune_host_allocator("jemalloc")
