"""The parity tests' every-expert-routed check (tests/helpers/routed.py) fails by name where an
expert is never reached, and what it guards holds: in every format's conversion parity case, a
zeroed expert moves the logits past the test's tolerance in the families whose tiny models, at
the usual router init, left experts unrouted (where a broken one passed), and by a few
tolerances in granite's, whose muP scalars shrank its effect below one at the usual init."""

from __future__ import annotations

import pytest
import torch

from moetrain.model import Transformer
from tests.helpers.convert_models import model_for, tiny_cfg
from tests.helpers.routed import assert_every_expert_routed, routed_counts

ATOL = RTOL = 1e-5  # (test_convert_logits.py's)


def parity_ids() -> torch.Tensor:
    """test_convert_logits.py's batch."""
    return torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(0))


def in_tolerances(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest ``|got - ref| / (atol + rtol |ref|)``: above 1, assert_close fails."""
    return float(((got - ref).abs() / (ATOL + RTOL * ref.abs())).max())


@torch.no_grad()
def least_moved(model: Transformer, ids: torch.Tensor) -> tuple[float, str]:
    """Over every expert of every MoE layer zeroed in turn: the least movement of the logits
    (in tolerances) and the expert that gave it."""
    intact = model(ids).logits
    least = (float("inf"), "")
    for moe in model.moe_layers():
        w2 = moe.experts.w2
        for e in range(w2.shape[0]):
            kept = w2[e].clone()
            w2[e].zero_()
            moved = in_tolerances(model(ids).logits, intact)
            w2[e].copy_(kept)
            least = min(least, (moved, f"layer {moe.layer} expert {e}"))
    return least


# the families whose parity cases left experts unrouted at the usual router init (either
# side: this case or the import's); glm4_moe's, the quickest, runs in the default suite
BLIND_BEFORE = (
    *("dots1", "glm4_moe", "minimax_m2", "afmoe", "deepseek_v32", "glm_moe_dsa", "deepseek_v3"),
    *("ernie4_5_moe", "gpt_oss", "phimoe", "kimi_linear", "lfm2_moe", "mimo_v2_flash"),
    *("longcat_flash", "bailing_hybrid"),
)


# the families whose muP scalars (residual branches x 0.22, logits / 6) shrank a zeroed
# expert's effect below the tolerance at the usual init (0.8 tolerances for granitemoe): their
# cases draw their weights wider (tests/helpers/convert_cases.py); granitemoe's in the default
# suite
WEAK_BEFORE = ("granitemoe", "granitemoeshared", "granitemoehybrid")
DEFAULT = ("glm4_moe", "granitemoe")


@pytest.mark.parametrize(
    "fmt",
    [
        pytest.param(f, marks=[] if f in DEFAULT else [pytest.mark.long])
        for f in (*BLIND_BEFORE, *WEAK_BEFORE)
    ],
)
def test_a_zeroed_expert_is_caught_by_the_parity_case(fmt: str) -> None:
    model = model_for(tiny_cfg(fmt))
    moved, where = least_moved(model, parity_ids())
    least = 3 if fmt in WEAK_BEFORE else 1  # (these, a few tolerances at least)
    assert moved > least, f"{fmt}: zeroing {where} moves the logits {moved:.2f} tolerances only"


def test_an_expert_no_token_reaches_is_named() -> None:
    model = model_for(tiny_cfg("deepseek_v3"))
    with torch.no_grad(), routed_counts(model) as counts:
        model(parity_ids())
    assert_every_expert_routed("deepseek_v3", counts)
    last = model.moe_layers()[-1]
    last.router.expert_bias[5] = -1e3  # (selection only: expert 5 is never picked, nor its
    # group of two, 4 and 5, whose score is their sum: group-limited routing)
    with torch.no_grad(), routed_counts(model) as counts:
        model(parity_ids())
    with pytest.raises(
        AssertionError, match=rf"deepseek_v3: .*layer {last.layer}: experts \[4, 5\]"
    ):
        assert_every_expert_routed("deepseek_v3", counts)
