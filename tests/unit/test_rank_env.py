"""The launcher's rank environment, read in one place (moetrain.rank_env)."""

from __future__ import annotations

import pytest

from moetrain.rank_env import RankEnv, RankEnvError, read_rank_env

SRUN = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "6"}


def test_torchrun_environment() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert read_rank_env({**env, "GROUP_RANK": "1"}) == RankEnv(
        3, 8, 1, 4, "1", "RANK / WORLD_SIZE"
    )


def test_srun_tasks_only_where_asked_and_a_launcher_wins() -> None:
    assert read_rank_env(SRUN) == RankEnv()
    got = read_rank_env(SRUN, srun=True)
    assert (got.rank, got.world_size, got.announced_by) == (
        5,
        6,
        "SLURM_PROCID / SLURM_STEP_NUM_TASKS",
    )
    both = read_rank_env({**SRUN, "RANK": "1", "WORLD_SIZE": "2"}, srun=True)
    assert (both.rank, both.world_size) == (1, 2)


def test_plain_process_is_the_only_rank() -> None:
    assert read_rank_env({}) == RankEnv()
    assert read_rank_env({"LOCAL_RANK": "2"}).local_rank == 2


@pytest.mark.parametrize(
    "env, match",
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, r"rank 4 is not in \[0, 4\)"),
        ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ],
)
def test_bad_values_name_the_variable(env: dict[str, str], match: str) -> None:
    with pytest.raises(RankEnvError, match=match):
        read_rank_env(env)
