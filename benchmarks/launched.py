"""A launcher command (``deepspeed`` / ``torchrun`` and the rank processes it starts) run as one
unit: started in its own session, its ranks' peak resident memory sampled from ``/proc`` until
it exits, and its whole process tree stopped (SIGSTOP), continued (SIGCONT) or killed at once
(``torchrun`` starts each rank in a session of its own, so the launcher's process group alone
does not hold them)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

SAMPLE_S = 0.05  # how often the ranks' VmHWM is read


def _stat_fields(pid: int) -> list[str]:
    """``/proc/<pid>/stat`` after the command name (field 3, the state, first)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def descendants(root: int) -> dict[int, str]:
    """Every live descendant of ``root``, with its start time (``stat`` field 22: a pid that
    was reused by another process later has another)."""
    children: dict[int, list[tuple[int, str]]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = _stat_fields(int(d.name))
            except (OSError, IndexError):
                continue
            children.setdefault(int(fields[1]), []).append((int(d.name), fields[19]))
    out, todo = {}, [root]
    while todo:
        for child, started in children.get(todo.pop(), []):
            out[child] = started
            todo.append(child)
    return out


def vm_hwm_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def rank_pids(root: int) -> list[int]:
    """Descendants of ``root`` whose environment holds RANK (the launcher's workers)."""
    out = []
    for pid in descendants(root):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(b"RANK=") for e in env):
            out.append(pid)
    return out


class Launched:
    """One launcher command, running from construction; :meth:`wait` for its result."""

    def __init__(self, cmd: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.cmd = cmd
        self._out = tempfile.TemporaryFile()  # noqa: SIM115 (read and closed in wait)
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=self._out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        self._tree: dict[int, str] = {}  # every process of the command seen so far
        self._peaks: dict[int, int] = {}
        self._running, self._done = threading.Event(), threading.Event()
        self._running.set()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._done.is_set():
            if self._running.is_set():  # (a stopped process's VmHWM does not move)
                for pid in rank_pids(self.proc.pid):
                    hwm = vm_hwm_kib(pid)
                    if hwm is not None:
                        self._peaks[pid] = max(self._peaks.get(pid, 0), hwm)
            self._done.wait(SAMPLE_S)

    def send(self, sig: int) -> None:
        """``sig`` to the launcher's process group, then to each of its other processes (and
        to any seen before that outlived the launcher: the same pid and start time)."""
        # (a group's id is not given to a new process while the group has members)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        if self.proc.returncode is None:  # (once reaped, its pid may be another's)
            self._tree.update(descendants(self.proc.pid))
        for pid, started in list(self._tree.items()):
            try:
                fields = _stat_fields(pid)
                if fields[19] != started:
                    raise ProcessLookupError
                if int(fields[2]) != self.proc.pid:  # (field 5, the group: signalled above)
                    os.kill(pid, sig)
            except (OSError, IndexError):
                del self._tree[pid]

    def stop(self) -> None:
        self._running.clear()
        self.send(signal.SIGSTOP)

    def resume(self) -> None:
        self.send(signal.SIGCONT)
        self._running.set()

    def kill(self) -> None:
        """End the whole command now; a stopped process is continued first, so that none is
        left behind stopped."""
        self.send(signal.SIGCONT)
        self.send(signal.SIGKILL)
        self.proc.wait()
        self._finish()

    def _finish(self) -> None:
        self._done.set()
        self._sampler.join()

    def wait(self) -> dict:
        """Wall seconds since the start, peak VmHWM (MiB) over the rank processes, the output;
        an error with the output's tail where the command failed (any process of it left
        behind is killed, as is the whole command where the wait is interrupted)."""
        try:
            self.proc.wait()
        except BaseException:
            self.kill()
            raise
        wall = time.perf_counter() - self.started
        self._finish()
        self._out.seek(0)
        text = self._out.read().decode(errors="replace")
        self._out.close()
        if self.proc.returncode != 0:
            self.kill()
            raise RuntimeError(
                f"{' '.join(self.cmd)} failed ({self.proc.returncode}):\n{text[-4000:]}"
            )
        peak = max(self._peaks.values(), default=0) / 1024
        return {"wall_s": wall, "peak_rss_mib": peak, "out": text}
