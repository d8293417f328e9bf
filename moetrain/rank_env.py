"""The launcher's rank environment, read here and nowhere else.

torchrun, the ``deepspeed`` launcher and ``accelerate launch`` announce a process's place in the
job as ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (and ``LOCAL_WORLD_SIZE``, or the deepspeed
launcher's ``LOCAL_SIZE``; torchrun's agent as ``GROUP_RANK``). A task of an ``srun`` step has
``SLURM_PROCID`` / ``SLURM_STEP_NUM_TASKS`` instead, which only commands that need no process
group accept (``srun=True``). Without any of them a process is the only rank.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


class RankEnvError(ValueError):
    """A rank variable that is not an integer, or a rank outside its world."""


@dataclass(frozen=True)
class RankEnv:
    """This process's rank among ``world_size`` ranks; ``local_rank`` among the
    ``local_world_size`` of its node; ``agent``: its launcher agent (torchrun's ``GROUP_RANK``,
    empty otherwise); ``announced_by``: the variables that said so (empty: a plain process)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    agent: str = ""
    announced_by: str = ""


def _int(env: Mapping[str, str], name: str, default: str) -> int:
    value = env.get(name, default)
    try:
        return int(value)
    except ValueError:
        raise RankEnvError(f"environment variable {name}={value!r} is not an integer") from None


def read_rank_env(env: Mapping[str, str] | None = None, *, srun: bool = False) -> RankEnv:
    """The rank the launcher announces in ``env`` (default: this process's environment);
    ``srun``: also a task of an ``srun`` step. Raises :class:`RankEnvError` on bad values."""
    env = os.environ if env is None else env
    agent = env.get("GROUP_RANK", "")
    if "RANK" in env or "WORLD_SIZE" in env:
        rank, world = _int(env, "RANK", "0"), _int(env, "WORLD_SIZE", "1")
        local_rank = _int(env, "LOCAL_RANK", "0")
        local_world = _int(env, "LOCAL_WORLD_SIZE", env.get("LOCAL_SIZE", "1"))
        names = "RANK / WORLD_SIZE"
    elif srun and "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        rank, world = _int(env, "SLURM_PROCID", "0"), _int(env, "SLURM_STEP_NUM_TASKS", "1")
        local_rank, local_world = 0, 1  # srun gives each task its own cores (its affinity mask)
        names = "SLURM_PROCID / SLURM_STEP_NUM_TASKS"
    else:
        return RankEnv(local_rank=_int(env, "LOCAL_RANK", "0"), agent=agent)
    if world < 1 or not 0 <= rank < world:
        raise RankEnvError(f"{names}: rank {rank} is not in [0, {world})")
    return RankEnv(rank, world, local_rank, max(1, local_world), agent, names)
