"""Muon's layout parity through the real DeepSpeed engine on gloo: every layout = one plain
process (moetrain's Muon on whole matrices, itself checked against a written-out float64
reference in tests/unit/test_muon.py), as for AdamW in test_parity.py.

Layouts (same global batch, seed, accumulation 2, gradient clipping active every step, 10
steps): world 1 (DeepSpeed, ZeRO 0 and 2), dp=2, ep=2 and dp=2 x ep=2, each at ZeRO 0, 1 and
2; MuonClip (QK-clip firing on some heads and steps) at dp=2 ZeRO-2 and dp=2 x ep=2 ZeRO-1.
Sequence parallelism with Muon is in test_sp_parity.py. ZeRO-1/2 cut matrices at partition
boundaries here (checked: the exchange is not empty), so the parity covers the exchange; the
control runs dp=2 ZeRO-2 without it and must not match. The default suite runs the world-4
layouts, the ZeRO-2 world-2 ones and the control; the rest with -m long.
"""

from __future__ import annotations

import pytest

from tests.distributed.muon_jobs import bf16_job, without_exchange_job
from tests.distributed.parity_checks import max_rel
from tests.distributed.parity_jobs import layout_key, layouts_job, reference_key
from tests.distributed.test_parity import (
    check_biases,
    check_first_step_gradients,
    check_losses_and_norms,
    check_max_logit,
)
from tests.helpers.distributed import run_distributed_concurrently

pytestmark = pytest.mark.slow
REL = 1e-5  # the layout-parity tolerance (test_parity.py)
WEIGHT_FLOOR_FACTOR = 10.0  # weights after 10 steps: see test_weights_after_the_last_step_match

JOBS = {
    1: [(1, 0, "muon"), (1, 2, "muon")],
    2: [
        (1, 0, "muon"),
        (1, 1, "muon"),
        (1, 2, "muon"),
        (2, 0, "muon"),
        (2, 1, "muon"),
        (2, 2, "muon"),
        (1, 2, "muonclip"),
    ],
    4: [(2, 0, "muon"), (2, 1, "muon"), (2, 2, "muon"), (2, 1, "muonclip")],
}
QUICK = {
    1: [],
    2: [(1, 2, "muonclip")],
    4: [(2, 1, "muon"), (2, 2, "muon")],
}
CONTROL = (1, 2, "muon")  # dp=2 ZeRO-2, without the exchange


def _long(world: int, layout: tuple) -> bool:
    return layout not in QUICK[world]


LAYOUTS = [
    pytest.param(
        w, lay, marks=pytest.mark.long if _long(w, lay) else (), id=f"w{w}-{layout_key(lay)}"
    )
    for w, lays in JOBS.items()
    for lay in lays
]


@pytest.fixture(scope="module")
def results(request) -> dict:
    """world -> per-rank results (and ``"control"``); the process groups run at the same
    time."""
    jobs = JOBS if "long" in (request.config.getoption("markexpr") or "") else QUICK
    refs = ("muon", "muonclip")
    runs = [(layouts_job, 1, jobs[1], refs, True)] + [(layouts_job, w, jobs[w]) for w in (2, 4)]
    runs.append((without_exchange_job, 2, [CONTROL]))
    one, two, four, control = run_distributed_concurrently(runs, timeout=900)
    return {1: one, 2: two, 4: four, "control": control}


@pytest.mark.parametrize("world,layout", LAYOUTS)
def test_losses_and_norms_match_reference(results, world: int, layout: tuple) -> None:
    check_losses_and_norms(results, world, layout)


@pytest.mark.parametrize("world,layout", LAYOUTS)
def test_gradients_after_first_step_match(results, world: int, layout: tuple) -> None:
    check_first_step_gradients(results, world, layout)


def weights_errors(reference: dict, run: dict) -> dict[str, float]:
    """Each weight's largest error after the last step against the reference's, relative to its
    largest value (expert stacks: this rank's experts)."""
    lo, hi = run["experts"]
    out = {}
    for name, want in reference["weights"].items():
        want = want[lo:hi] if ".experts." in name else want
        out[name] = float((run["weights"][name] - want).abs().max() / want.abs().max())
    return out


def weight_bounds(results: dict, key: str) -> dict[str, float]:
    """Each weight's bound after the last step: ``WEIGHT_FLOOR_FACTOR`` times its rounding floor
    (the reference ``key`` against its rows-reversed twin, the same run with every sum over
    tokens in another order), at least ``REL``."""
    reference, twin = results[1][0][key], results[1][0][f"twin_{key}"]
    floor = weights_errors(reference, {**twin, "experts": (None, None)})
    return {name: max(REL, WEIGHT_FLOOR_FACTOR * f) for name, f in floor.items()}


@pytest.mark.parametrize("world,layout", LAYOUTS)
def test_weights_after_the_last_step_match(results, world: int, layout: tuple) -> None:
    """Sharper than the losses: every update shows in the weights. Ten steps amplify rounding:
    the twin differs from the reference by 2e-6 to 4e-5 of a weight (most in the embedding and
    the LM head, whose entries with gradients near zero AdamW scales up to whole steps), and
    dp=2 x ep=2 by about 3 times that in every weight alike, AdamW's and Muon's (measured), so
    the bound is the floor times ``WEIGHT_FLOOR_FACTOR``; the control without Muon's exchange
    is far over it."""
    key = reference_key(world, layout)
    reference, bounds = results[1][0][key], weight_bounds(results, key)
    for rank, res in enumerate(results[world]):
        for name, err in weights_errors(reference, res[layout_key(layout)]).items():
            assert err < bounds[name], f"rank {rank} {name}: rel err {err:.2e} > {bounds[name]:.2e}"


@pytest.mark.parametrize("world,layout", LAYOUTS)
def test_largest_attention_logit_matches(results, world: int, layout: tuple) -> None:
    check_max_logit(results, world, layout)


@pytest.mark.parametrize("world,layout", LAYOUTS)
def test_bias_identical_on_every_rank(results, world: int, layout: tuple) -> None:
    check_biases(results, world, layout)


def test_zero_partitions_cut_matrices(results) -> None:
    """Not vacuous: at ZeRO-1/2 over 2 data-parallel ranks, partitions cut Muon's matrices
    (the dense ones at dp=2, the experts' over their expert-data-parallel pair at dp=2 x ep=2);
    stage 0 cuts none."""
    for world, ranks in ((2, results[2]), (4, results[4])):
        for key, run in ranks[0].items():
            assert (run["cut"] > 0) == ("zero0" not in key), (world, key)


def test_qk_clip_fires_on_some_heads_and_steps(results) -> None:
    reference = results[1][0]["reference_muonclip"]
    heads = 2 * 4 * 10  # layers x heads x steps
    assert 0 < reference["clipped"] < heads
    clipped = [
        run["clipped"]
        for world in (2, 4)
        for res in results[world]
        for key, run in res.items()
        if key.endswith("muonclip")
    ]
    assert clipped and all(c == reference["clipped"] for c in clipped)
    plain = results[1][0]["reference_muon"]
    changed = [
        float(
            (reference["weights"][n] - plain["weights"][n]).abs().max()
            / plain["weights"][n].abs().max()
        )
        for n in ("layers.0.attn.wq.weight", "layers.1.attn.wq.weight")
    ]
    assert max(changed) > 100 * REL  # the clip changed the run


def test_control_without_the_exchange_does_not_match(results) -> None:
    """Orthogonalising only a rank's part of a cut matrix is caught by the tolerance."""
    for res in results["control"]:
        run = res[layout_key(CONTROL)]
        assert run["cut"] > 0
        key = reference_key(2, CONTROL)
        bounds = weight_bounds(results, key)
        errors = weights_errors(results[1][0][key], run)
        assert max(errors[name] / bounds[name] for name in errors) > 10  # far over the bound


BF16 = {1: [(1, 1)], 2: [(1, 1), (2, 2)]}  # world 1 ZeRO-1: the reference


@pytest.fixture(scope="module")
def bf16() -> dict:
    runs = run_distributed_concurrently([(bf16_job, w, lays) for w, lays in BF16.items()], 900)
    return dict(zip(BF16, runs, strict=True))


@pytest.mark.long
def test_bf16_layouts_within_the_bf16_bound(bf16) -> None:
    """dp=2 ZeRO-1 (DeepSpeed's BF16_Optimizer) and ep=2 ZeRO-2 against world 1, held to the
    bound of test_precision.py, whose premise (bf16 within half of it from fp32) is checked for
    Muon too."""
    from tests.distributed.test_precision import LOSS_BOUND, NORM_BOUND

    reference = bf16[1][0]["ep1_zero1"]
    fp32 = bf16[1][0]["fp32_reference"]
    assert max_rel(reference["losses"], fp32["losses"]) <= LOSS_BOUND / 2
    assert max_rel(reference["norms"], fp32["norms"]) <= NORM_BOUND / 2
    assert reference["losses"] != fp32["losses"]  # bf16 really ran
    for res in bf16[2]:
        for key in ("ep1_zero1", "ep2_zero2"):
            run = res[key]
            assert max_rel(run["losses"], reference["losses"]) <= LOSS_BOUND, key
            assert max_rel(run["norms"], reference["norms"]) <= NORM_BOUND, key
        assert res["ep1_zero1"]["optimizer"] == "BF16_Optimizer"
