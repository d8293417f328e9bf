"""Checkpoints through the real DeepSpeed engine on gloo ranks: completeness, resharding,
non-finite steps, barrier timeouts.

- Expert completeness: after a save at ep=2 on 4 ranks, every expert of every MoE layer is on
  disk exactly once, equals the live weights, and each file holds only its own tensors.
- Reshard: a checkpoint saved at world=4/ep=4 loads, optimizer state re-partitioned, at
  world=2/ep=2 and world=1/ep=1, and at one plain process through moetrain's own safe reader;
  logits on a fixed batch match (the optimizer state's match over several steps is in
  test_resume_layouts.py).
- NaN on one rank: every rank skips the same step, weights are unchanged by it, training goes
  on; too many in a row stops every rank with the same error (no hang).
- Every process group, DeepSpeed's included, has parallel.timeout_minutes as its timeout.
- A barrier that times out names what it waited for and which rank did not arrive.
- Multi-token prediction (two MoE modules) at ep=2, ZeRO-2: a run stopped, saved and resumed
  logs the uninterrupted run's losses, MTP losses, learning rates and biases bit for bit.
"""

from __future__ import annotations

import re

import pytest
import torch

from moetrain.checkpoint.format import safe_torch_load
from moetrain.checkpoint.read import checkpoint_config, load_model
from tests.distributed.checkpoint_jobs import (
    GROUP_TIMEOUT_MIN,
    fixed_batch,
    nan_jobs,
    reshard_job,
    resume_job,
    save_job,
    timeout_job,
)
from tests.helpers.distributed import run_distributed, run_distributed_concurrently

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return run_distributed(save_job, 4, str(tmp_path_factory.mktemp("ckpt-save")))


def test_every_expert_saved_once_equal_to_live_weights(saved):
    info = saved[0]["ep2"]
    from pathlib import Path

    path = Path(info["path"])
    cfg = checkpoint_config(path)
    files = sorted(p.name for p in path.glob("layer_*_expert_*_mp_rank_00_model_states.pt"))
    n_moe, n_exp = cfg.model.n_layers, cfg.moe.num_experts  # every layer is MoE here
    assert len(files) == n_moe * n_exp
    pattern = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt")
    assert {tuple(map(int, pattern.match(f).groups())) for f in files} == {
        (layer, e) for layer in range(n_moe) for e in range(n_exp)
    }
    for rank_result in saved:  # each rank's live local experts equal the files
        r = rank_result["ep2"]
        lo, hi = r["range"]
        for name, live in r["experts"].items():
            layer = int(name.split(".")[1])
            wname = name.rsplit(".", 1)[1]
            for local, e in enumerate(range(lo, hi)):
                f = path / f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt"
                sd = safe_torch_load(f)
                (key,) = [k for k in sd if k.endswith(f".{e}.{wname}")]
                assert torch.equal(sd[key], live[local]), (f, wname)
    for f in files:  # no shared-storage bloat: the file is its three tensors plus a little
        sd = safe_torch_load(path / f)
        tensor_bytes = sum(t.numel() * t.element_size() for t in sd.values())
        size = (path / f).stat().st_size
        assert tensor_bytes <= size <= tensor_bytes + 4096, (f, size, tensor_bytes)


def test_single_process_reader_gives_the_live_logits(saved):
    for ep in ("ep2", "ep4"):
        info = saved[0][ep]
        model, _ = load_model(info["path"])
        model.eval()
        with torch.no_grad():
            logits = model(fixed_batch()).logits
        torch.testing.assert_close(logits, info["logits"], rtol=1e-5, atol=1e-5)
        live = saved[0][ep]["dense"]
        for name, p in model.named_parameters():
            if name in live:
                assert torch.equal(p, live[name]), name


RESHARD_WORLDS = (2, 1)


@pytest.fixture(scope="module")
def resharded(saved, tmp_path_factory) -> dict[int, list[dict]]:
    """world -> per-rank results of loading the ep=4 checkpoint; both worlds at the same time."""
    ckpt = saved[0]["ep4"]["path"]
    jobs = [
        (reshard_job, world, ckpt, str(tmp_path_factory.mktemp(f"reshard-w{world}")))
        for world in RESHARD_WORLDS
    ]
    return dict(zip(RESHARD_WORLDS, run_distributed_concurrently(jobs), strict=True))


@pytest.mark.parametrize("world", RESHARD_WORLDS)
def test_reshard_to_a_smaller_layout(saved, resharded, world):
    results = resharded[world]
    for r in results:
        assert r["step"] == 2 and r["consumed"] == 4
        torch.testing.assert_close(r["logits"], saved[0]["ep4"]["logits"], rtol=1e-5, atol=1e-5)
        assert all(torch.isfinite(torch.tensor(r["losses"])))
    assert len({tuple(r["losses"]) for r in results}) == 1  # every rank agrees on the loss


# (zero_stage, steps at which rank 1's loss is NaN); the one that stops training runs last
NAN_SCENARIOS = {
    "stage0": (0, [2]),
    "stage2": (2, [2]),
    "stage3": (3, [2]),
    "too_many": (2, [1, 2, 3]),
}


@pytest.fixture(scope="module")
def nan_runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Every NaN scenario, one after another in one 2-rank process group; name -> per rank."""
    run_dir = str(tmp_path_factory.mktemp("ckpt-nan"))
    per_rank = run_distributed(nan_jobs, 2, run_dir, list(NAN_SCENARIOS.values()))
    runs = {name: [r["scenarios"][i] for r in per_rank] for i, name in enumerate(NAN_SCENARIOS)}
    runs["group_timeouts"] = [r["group_timeouts"] for r in per_rank]
    return runs


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_nan_on_one_rank_is_skipped_everywhere(nan_runs, stage):
    results = nan_runs[f"stage{stage}"]
    for r in results:
        skipped = [rec["skipped"] for rec in r["records"]]
        assert skipped == [False, False, True, False, False]
        assert r["unchanged"] == [False, False, True, False, False]
        assert r["records"][-1]["skipped_steps"] == 1
        assert r["error"] is None and r["finite"]
    same = [
        [(r["step"], r["skipped"], r["skipped_steps"], str(r["loss"])) for r in res["records"]]
        for res in results
    ]
    assert same[0] == same[1]  # every rank took the same decisions and saw the same loss


def test_too_many_nonfinite_steps_stop_every_rank(nan_runs):
    results = nan_runs["too_many"]
    for r in results:
        assert r["error"] and "2 optimizer steps in a row" in r["error"]
        assert [rec["skipped"] for rec in r["records"]] == [False, True]


def test_every_process_group_honours_timeout_minutes(nan_runs):
    """The groups moetrain creates through DeepSpeed and those DeepSpeed's engine and ZeRO
    optimizer create themselves (no timeout argument) all take parallel.timeout_minutes, not
    torch's default of 30 minutes (the jobs of the NaN tests above set it)."""
    for groups in nan_runs["group_timeouts"]:
        assert len(groups) >= 2, groups  # the expert and expert-data groups at least
        assert set(groups.values()) == {GROUP_TIMEOUT_MIN * 60}, groups


def test_barrier_timeout_names_what_it_waited_for(tmp_path):
    msg = run_distributed(timeout_job, 2, str(tmp_path / "rank0-done"))[0]
    assert "checkpoint step_00000007: write shards" in msg, msg
    assert "1" in msg.split("write shards", 1)[1]  # gloo's monitored barrier names rank 1


def test_resume_with_gated_deltanet_layers_is_bit_exact(tmp_path):
    """A hybrid model (a Gated DeltaNet layer, a gated full-attention layer, zero-centred
    norms): its decays, gates, convolution and norms resume with the rest."""
    from tests.distributed.parity_variants import VARIANTS

    results = run_distributed(resume_job, 2, [(2, 2)], str(tmp_path), 4, 2, VARIANTS["hybrid"])
    for rank, res in enumerate(results):
        run = res["ep2_zero2"]
        assert run["resumed"] == run["uninterrupted"], f"rank {rank}"


def test_resume_with_mtp_is_bit_exact(tmp_path):
    mtp = {"model.mtp_depth": 2, "model.mtp_loss_weight_final": 0.1}
    mtp["model.mtp_loss_weight_final_step"] = 3  # the weight changes phase after the resume
    results = run_distributed(resume_job, 2, [(2, 2)], str(tmp_path), 4, 2, mtp)
    for rank, res in enumerate(results):
        run = res["ep2_zero2"]
        assert run["resumed"] == run["uninterrupted"], f"rank {rank}"
        assert all("mtp_loss" in r for r in run["resumed"])
        assert len(run["resumed"][0]["bias"]) == 4  # the MTP modules' MoE layers are balanced
