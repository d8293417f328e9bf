"""Layout parity through a real DeepSpeed engine on gloo: every layout = one plain process.

Layouts (same global batch, seed, accumulation 2, clipping active every step):
world 1 (DeepSpeed, ZeRO 0/2), dp=2 (world 2, ep 1), dp=1 x ep=2 (world 2), dp=2 x ep=2
(world 4), each for ZeRO stages 0, 1, 2 where listed, and dp=1 x ep=2 ZeRO-2 with activation
checkpointing (blocks recomputed in backward, all-to-alls included), dp=1 x ep=2 ZeRO-1 and
dp=2 x ep=2 ZeRO-2 with shadow experts (hot experts replicated per forward onto every EP rank;
with recompute at ZeRO-1, where the replication runs again in backward), and dp=2 ZeRO-2 with
DeepSpeed's overlap_comm (on CPU the engine's reduction stream is a no-op, so this proves the
configuration path, not the overlap). Two routing variants (``parity_jobs.VARIANTS``) run on
dp=2, ep=2 and dp=2 x ep=2, which between them use ZeRO stages 0, 1 and 2: ``routing`` (sigmoid scores with the aux-loss-free
bias, group-limited routing across the EP ranks, a dense first layer, per-sequence balance loss)
and ``capacity`` (capacity factor 1 with drops, top-k before softmax, step-wide balance
statistics); ``mtp`` (two multi-token-prediction modules, MoE blocks, whose loss weight changes
phase at step 3) runs on dp=2 ZeRO-2, ep=2 ZeRO-0 and dp=2 x ep=2 ZeRO-1; ``gptoss`` (attention
sinks, a sliding-window and a full layer, q/k/v/o, router and expert biases, the clamped SwiGLU
where it binds) on dp=2 ZeRO-2, ep=2 ZeRO-0 and dp=2 x ep=2 ZeRO-1; ``phimoe`` (LayerNorm, the
LM-head bias, sparsemixer routing) on dp=2 ZeRO-0, ep=2 ZeRO-2 and dp=2 x ep=2 ZeRO-1;
``llama4`` (chunked attention, a NoPE layer with its query temperature, the post-RoPE norm,
top-k on the logits with sigmoid weights on the experts' inputs) on dp=2 ZeRO-0, ep=2 ZeRO-2 and
dp=2 x ep=2 ZeRO-1; ``hybrid`` (Qwen3-Next's: a Gated DeltaNet layer and a gated-attention
layer, zero-centred norms) on dp=2 ZeRO-0, ep=2 ZeRO-2 and dp=2 x ep=2 ZeRO-1; ``kda`` (Kimi Linear's: a Kimi Delta Attention layer and an attention
layer) on dp=2 ZeRO-2 and dp=2 x ep=2 ZeRO-1; ``mamba`` (Granite 4.0-H's: a Mamba-2 layer over
several chunks per row, an attention layer) on dp=2 ZeRO-2 and dp=2 x ep=2 ZeRO-1; ``gated_conv``
(LFM2-MoE's: a short gated convolution layer with its bias, an attention layer, sigmoid routing
renormalised with its epsilon) on dp=2 ZeRO-2 and dp=2 x ep=2 ZeRO-1; ``dsa`` (DeepSeek
sparse attention's sparse stage on latent attention, the second layer sharing the first's
selection, the indexer's KL in the loss) on dp=2 ZeRO-2, ep=2 ZeRO-0 with activation
checkpointing and dp=2 x ep=2 ZeRO-1, and ``dsa_warmup`` (its dense warm-up: only the indexers
train, every other parameter frozen, the routers' bias too) on dp=2 ZeRO-0 and dp=2 x ep=2
ZeRO-0 (the stage it runs at with MoE layers); ``dsv4`` (DeepSeek-V4's: two hyper-connection
streams, sqrt(softplus) scores, a hash-routed first layer, the clamped SwiGLU without its offset)
on dp=2 ZeRO-2 and dp=2 x ep=2 ZeRO-1; ``zero_experts`` (LongCat-Flash's identity
experts among the routed ones: their copies never cross ranks) on dp=2 ZeRO-2 and dp=2 x ep=2
ZeRO-1, and ``zero_capacity`` (zero experts with a capacity factor that drops routed copies,
decided per EP group; the zero experts' copies take no slot) on dp=2 x ep=2 ZeRO-1 with -m long
(sp=2 x ep=2 in the default suite: test_sp_parity_pieces.py). The default suite runs each
variant on its dp=2 x ep=2 layout (both axes at once), the variants' world-2 layouts (and
``gemma4``'s and ``zero_capacity``'s) with -m long; the token mixers the other way round
(:data:`MIXERS`). The base configuration has a gated shared expert. The reference is plain torch in
one process with the per-expert loop (no DeepSpeed, no dispatcher swap); for capacity it decides
capacity in world / ep_size parts of each global micro-batch, one per EP group, as the layout does.

This proves: no EP-scaled expert gradients, the step's largest attention logit (a metric for
every optimizer) as one process sees it, a correct global clipping norm under EP at every
stage (moetrain's own at stage 0, where DeepSpeed's is wrong: the control run shows it), global
aux-loss statistics, the same dropped copies, and an identical aux-loss-free bias on every rank.

Rounding and systematic errors told apart: fp32 kernels round differently at different batch
splits and summation orders, so every per-step loss, norm and gradient differs from the
reference by rounding (about 1e-7 of it here; more on some hosts) under the per-step bound
``REL`` (or ``TWIN_FACTOR`` times the twin's difference, below, where a configuration's own
trajectory amplifies rounding beyond that: multi-token prediction's, in Adam's epsilon regime).
A systematic error of 1e-6 (a balancing loss over a slightly wrong scope, a token missed in a
reduction) would hide there. It cannot hide in the statistics that rounding
averages out of: the mean relative difference over the steps (losses, norms) and the first
step's gradient bias (each tensor's least-squares relative scale against the reference). These
are held to what this host's rounding can explain, measured in the same run. The means of the
losses and norms: ``FLOOR_FACTOR`` times the reference against its twin, the same function with
every micro-batch's rows in reverse order (every sum over tokens in another order, nothing
else). The gradient bias, tensor by tensor: ``GRAD_Z`` standard errors of the scale, estimated
from the layout's own residual against the reference (a twin's rounding is smaller than a
layout's, which splits the batch and its GEMMs, by about 3x; the residual is the layout's own),
at least ``MIN_TOL``. The negative controls shift a layout's losses, norms and gradients by
1e-6, and the noisiest tensor of all the layouts alone by +-1e-6: each must be caught; where a
tensor's rounding cannot resolve 1e-6, the test fails saying so rather than passing blind.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.parity_checks import (
    BIAS_MIN_ELEMENTS,
    REL,
    SYSTEMATIC,
    check_gradient_bias,
    check_no_systematic_difference,
    check_steps,
    rounding_floor,
    scale_fit,
    step_bounds,
)
from tests.distributed.parity_jobs import (
    layout_key,
    layouts_job,
    parity_config,
    reference_key,
)
from tests.distributed.parity_variants import STEPS, VARIANTS
from tests.helpers.distributed import run_distributed_concurrently

pytestmark = pytest.mark.slow

JOBS = {
    1: [(1, 0), (1, 2)],
    2: [
        (1, 0),
        (1, 1),
        (1, 2),
        (1, 2, "overlap"),
        (2, 0),
        (2, 1),
        (2, 2),
        (2, 2, "ckpt"),
        (2, 1, "shadow", "ckpt"),
        (1, 1, "routing"),
        (2, 0, "routing"),
        (1, 0, "capacity"),
        (2, 1, "capacity"),
        (1, 2, "mtp"),
        (2, 0, "mtp"),
        (1, 2, "gptoss"),
        (2, 0, "gptoss"),
        (1, 0, "phimoe"),
        (2, 2, "phimoe"),
        (1, 0, "llama4"),
        (2, 2, "llama4"),
        (1, 0, "hybrid"),
        (2, 2, "hybrid"),
        (1, 2, "kda"),
        (1, 2, "mamba"),
        (1, 2, "gated_conv"),
        (1, 2, "dsa"),
        (2, 0, "dsa", "ckpt"),
        (1, 0, "dsa_warmup"),
        (1, 2, "dsv4"),
        (1, 2, "zero_experts"),
        (1, 2, "gemma4"),
    ],
    4: [
        (2, 0),
        (2, 1),
        (2, 2),
        (2, 2, "routing"),
        (2, 2, "capacity"),
        (2, 2, "shadow"),
        (2, 1, "mtp"),
        (2, 1, "gptoss"),
        (2, 1, "phimoe"),
        (2, 1, "llama4"),
        (2, 1, "hybrid"),
        (2, 1, "kda"),
        (2, 1, "mamba"),
        (2, 1, "gated_conv"),
        (2, 1, "dsa"),
        (2, 0, "dsa_warmup"),
        (2, 1, "dsv4"),
        (2, 1, "zero_experts"),
        (2, 1, "zero_capacity"),
        # Gemma 4's global layers and its other pieces (parity_jobs.VARIANTS["gemma4"])
        (2, 1, "gemma4"),
    ],
}


# token mixers work on each rank's rows alone, sending nothing new across ranks: 2 show what 4 do
MIXERS = {"hybrid": (2, 2, "hybrid"), **{v: (1, 2, v) for v in ("kda", "mamba", "gated_conv")}}


def _long(world: int, layout: tuple) -> bool:
    """Whether a layout runs with -m long only (the module docstring says which; :data:`MIXERS`)."""
    variants = [v for v in layout[2:] if v in VARIANTS]
    if variants and variants[0] in MIXERS:
        return (world, layout) != (2, MIXERS[variants[0]])
    return bool(variants) and (world == 2 or variants[0] in ("gemma4", "zero_capacity"))


QUICK_JOBS = {w: [lay for lay in lays if not _long(w, lay)] for w, lays in JOBS.items()}


def _marks(world: int, layout: tuple) -> list:
    return [pytest.mark.long] if _long(world, layout) else []


LAYOUTS = [
    pytest.param(w, lay, marks=_marks(w, lay), id=f"w{w}-{layout_key(lay)}")
    for w, lays in JOBS.items()
    for lay in lays
]


def _key(layout: tuple) -> str:
    return layout_key(layout)


@pytest.fixture(scope="module")
def results(request) -> dict[int, list[dict]]:
    """world -> per-rank results; the three process groups run at the same time."""
    jobs = JOBS if "long" in (request.config.getoption("markexpr") or "") else QUICK_JOBS
    # every layout of a world runs in its one process group, the three groups side by side:
    # minutes on 2 cores, under pytest's 600 s for the test that sets this fixture up
    # the twins of the references these layouts are compared with (not capacity's one-group
    # reference's by default: only -m long's layouts use it)
    twins = {reference_key(w, lay) for w, lays in jobs.items() for lay in lays}
    runs = [(layouts_job, 1, jobs[1], None, twins)]
    runs += [(layouts_job, w, lays) for w, lays in jobs.items() if w != 1]
    done = run_distributed_concurrently(runs, timeout=540.0)
    return dict(zip(jobs, done, strict=True))


@pytest.fixture(scope="module")
def reference(results: dict[int, list[dict]]) -> dict:
    return results[1][0]["reference"]


def _reference(results: dict[int, list[dict]], world: int, layout: tuple) -> dict:
    return results[1][0][reference_key(world, layout)]


@pytest.mark.parametrize("key", ["reference", "reference_routing", "reference_capacity_g2"])
def test_reference_clips_every_step(results, key: str) -> None:
    reference = results[1][0][key]
    clip = parity_config(1, 1, 0).optim.grad_clip
    assert len(reference["norms"]) == STEPS
    assert min(reference["norms"]) > 1.5 * clip  # the proof below covers real clipping
    assert reference["losses"][0] != reference["losses"][-1]


def test_capacity_variant_drops_and_depends_on_the_groups(results) -> None:
    """Copies are really dropped, and deciding capacity per EP group (data-parallel layouts)
    differs from deciding it over the whole global batch: the references are not the same."""
    one, two = (results[1][0][f"reference_capacity_g{g}"] for g in (1, 2))
    assert one["dropped"] > 0 and two["dropped"] > 0
    assert one["losses"] != two["losses"]
    assert results[1][0]["reference"]["dropped"] == 0


def test_shadow_layouts_replicate_experts(results) -> None:
    """The shadow layouts' parity is not vacuous: their plans replicated experts."""
    for world, layouts in JOBS.items():
        for layout in layouts:
            if _key(layout) not in results[world][0]:
                continue  # (a -m long layout)
            replicas = [res[_key(layout)]["replicas"] for res in results[world]]
            if "shadow" in layout:
                assert all(r > 0 for r in replicas), layout
            else:
                assert all(r == 0 for r in replicas), layout


def test_zero_expert_layouts_route_to_zero_experts(results) -> None:
    """The zero_experts layouts' parity is not vacuous: copies went to zero experts, as many
    as in one process (the share every step reports, summed)."""
    for world, layouts in JOBS.items():
        for layout in (lay for lay in layouts if {"zero_experts", "zero_capacity"} & set(lay)):
            if _key(layout) not in results[world][0]:
                continue  # (a -m long layout)
            reference = _reference(results, world, layout)["zero_share"]
            assert reference > 0
            for res in results[world]:
                assert res[_key(layout)]["zero_share"] == pytest.approx(reference, rel=1e-9)


@pytest.mark.parametrize("world,layout", LAYOUTS)
def test_losses_and_norms_match_reference(results, world: int, layout: tuple) -> None:
    check_losses_and_norms(results, world, layout)


def _twin(results: dict[int, list[dict]], world: int, layout: tuple) -> dict:
    """The rows-reversed twin of the reference a layout is compared with."""
    return results[1][0][f"twin_{reference_key(world, layout)}"]


def check_losses_and_norms(results: dict[int, list[dict]], world: int, layout: tuple) -> None:
    reference, twin = _reference(results, world, layout), _twin(results, world, layout)
    for rank, res in enumerate(results[world]):
        run = res[_key(layout)]
        assert run["ds_moe"], "DeepSpeed did not recognise the model as MoE"
        for q in ("losses", "norms"):
            check_steps(run[q], reference[q], twin[q], f"rank {rank} {q}")
        assert run["dropped"] == reference["dropped"], rank


@pytest.mark.parametrize("world,layout", LAYOUTS)
def test_gradients_after_first_step_match(results, world: int, layout: tuple) -> None:
    check_first_step_gradients(results, world, layout)


def check_first_step_gradients(results: dict[int, list[dict]], world: int, layout: tuple) -> None:
    reference = _reference(results, world, layout)
    num_experts = parity_config(1, 1, 0, **VARIANTS.get(layout[-1], {})).moe.num_experts
    assert any(".experts." in name for name in reference["grads"]) or "dsa_warmup" in layout
    for rank, res in enumerate(results[world]):
        run = res[_key(layout)]
        lo, hi = run["experts"]
        assert hi - lo == num_experts // layout[0]
        assert run["grads"].keys() == reference["grads"].keys()
        for name in reference["grads"]:
            want = reference["grads"][name]
            if ".experts." in name:
                want = want[lo:hi]  # this rank's experts only
            got = run["grads"][name]
            assert got.shape == want.shape, (name, got.shape, want.shape)
            err = float((got - want).abs().max() / want.abs().max())
            assert err < REL, f"rank {rank} {name}: max rel err {err:.2e}"


@pytest.mark.parametrize("world,layout", LAYOUTS)
def test_bias_identical_on_every_rank(results, world: int, layout: tuple) -> None:
    check_biases(results, world, layout)


@pytest.mark.parametrize("world,layout", LAYOUTS)
def test_largest_attention_logit_matches(results, world: int, layout: tuple) -> None:
    check_max_logit(results, world, layout)


def check_max_logit(results: dict[int, list[dict]], world: int, layout: tuple) -> None:
    """Every step's ``attn/max_logit`` (the maximum over every head, micro-batch and rank) is
    the reference's within :func:`step_bounds`: ``REL`` until the twin's own has drifted."""
    want = _reference(results, world, layout)["max_logits"]
    twin = _twin(results, world, layout)["max_logits"]
    assert len(want) == STEPS
    for rank, res in enumerate(results[world]):
        got = res[_key(layout)]["max_logits"]
        if want[0] == float("-inf"):  # no layer tracks one (sparse attention's do not yet)
            assert got == want, (rank, got, want)
            continue
        check_steps(got, want, twin, f"rank {rank} largest attention logit")


def check_biases(results: dict[int, list[dict]], world: int, layout: tuple) -> None:
    reference = _reference(results, world, layout)
    biases = [res[_key(layout)]["biases"] for res in results[world]]
    assert all(b == biases[0] for b in biases), "expert_bias differs between ranks"
    # (sparsemixer routes without the selection bias; the warm-up's routers are frozen)
    moves = "phimoe" not in layout and "dsa_warmup" not in layout
    assert moves == any(abs(v) > 0 for layer in biases[0] for v in layer), "bias moved or not"
    assert torch.allclose(torch.tensor(biases[0]), torch.tensor(reference["biases"]), atol=1e-7)


@pytest.mark.parametrize("world,ep", [(2, 1), (2, 2), (4, 2)])
def test_deepspeed_stage0_norm_is_wrong_under_ep(results, reference, world: int, ep: int) -> None:
    """Control (DeepSpeed issue #8475): the norm DeepSpeed's stage-0 clipping would use is right
    without EP and wrong with it, while moetrain's own norm (checked above) is right in both."""
    for res in results[world]:
        ds_norm = res[_key((ep, 0))]["deepspeed_stage0_norm"]
        err = abs(ds_norm - reference["norms"][0]) / reference["norms"][0]
        if ep == 1:
            assert err < REL
        else:
            # deterministic: about 2e-4 here (dense gradients dominate the norm), i.e. far
            # outside the parity tolerance that moetrain's own norm meets
            assert err > 10 * REL, f"DeepSpeed's stage-0 norm {ds_norm} unexpectedly right"


@pytest.fixture(scope="module")
def floor(results) -> dict[str, dict[str, float]]:
    """This host's rounding floor of each reference (:func:`rounding_floor`)."""
    return rounding_floor(results[1][0])


@pytest.mark.parametrize("world,layout", LAYOUTS)
def test_no_systematic_difference(results, floor, world: int, layout: tuple) -> None:
    reference, own = _reference(results, world, layout), floor[reference_key(world, layout)]
    for rank, res in enumerate(results[world]):
        try:
            check_no_systematic_difference(res[_key(layout)], reference, own)
        except AssertionError as e:
            raise AssertionError(f"rank {rank}: {e} (floor {own})") from None


def test_a_systematic_error_of_1e6_is_caught(results, floor) -> None:
    """Negative control: dp=2 x ep=2 ZeRO-2's losses, norms or first-step gradients shifted by
    1e-6 (each alone) fail the check that the unshifted run passes, on this host's floor."""
    run, reference = results[4][0][_key((2, 2))], results[1][0]["reference"]
    floor = floor["reference"]
    check_no_systematic_difference(run, reference, floor)
    shifted = {
        "losses": [x * (1 + SYSTEMATIC) for x in run["losses"]],
        "norms": [x * (1 + SYSTEMATIC) for x in run["norms"]],
        "grads": {k: g * (1 + SYSTEMATIC) for k, g in run["grads"].items()},
    }
    for q, value in shifted.items():
        with pytest.raises(AssertionError, match=q if q != "grads" else "first-step gradient bias"):
            check_no_systematic_difference({**run, q: value}, reference, floor)


def test_a_systematic_error_in_the_noisiest_gradient_is_caught(results) -> None:
    """Negative control of the gradient bias where it is hardest: in the tensor whose rounding
    is largest over every layout run (Kimi Delta Attention's ``f_b_proj`` at dp=2 x ep=2 here,
    whose rounding alone gives a scale of 2.8e-7), a scale error of +-1e-6 in that tensor alone
    fails the check that the unshifted run passes."""
    fits = []
    for world, layouts in JOBS.items():
        for layout in (lay for lay in layouts if _key(lay) in results[world][0]):
            run, reference = results[world][0][_key(layout)], _reference(results, world, layout)
            lo, hi = run["experts"]
            for name, want in reference["grads"].items():
                if want.numel() >= BIAS_MIN_ELEMENTS:
                    r = want[lo:hi] if ".experts." in name else want
                    fits.append((scale_fit(run["grads"][name], r)[1], name, run, reference))
    _, name, run, reference = max(fits, key=lambda fit: fit[0])
    check_gradient_bias(run, reference)
    for sign in (1, -1):
        grads = {**run["grads"], name: run["grads"][name] * (1 + sign * SYSTEMATIC)}
        with pytest.raises(AssertionError, match="first-step gradient bias"):
            check_gradient_bias({**run, "grads": grads}, reference)


@pytest.mark.long
def test_gemma4_largest_logit_bounds_still_catch_a_real_difference(results) -> None:
    """Negative control where Gemma 4's twin widens the largest logit's bounds (docs/NUMERICS.md):
    the run passes, its logits 2 x ``REL`` off at every step fail at the first step."""
    world, layout = 2, (1, 2, "gemma4")
    reference, twin = _reference(results, world, layout), _twin(results, world, layout)
    assert step_bounds(twin["max_logits"], reference["max_logits"])[0] == REL
    check_max_logit(results, world, layout)
    shifted = [{**res, _key(layout): dict(res[_key(layout)])} for res in results[world]]
    for run in (res[_key(layout)] for res in shifted):
        run["max_logits"] = [x * (1 + 2 * REL) for x in run["max_logits"]]
    with pytest.raises(AssertionError, match="largest attention logit at step 0"):
        check_max_logit({**results, world: shifted}, world, layout)


def test_the_widest_twin_bounds_still_catch_real_bugs(results, floor) -> None:
    """Negative control where the twin widens the per-step bounds most: ``mtp`` at dp=2 x ep=2
    ZeRO-1 (its trajectory amplifies rounding, docs/NUMERICS.md). Its first step is still held
    to ``REL``, it passes every check unchanged, and each of these fails: the multi-token-
    prediction modules' gradients dropped; one of their gradients scaled by 1e-6; the losses
    shifted by 1e-6."""
    layout = (2, 1, "mtp")
    reference, twin = _reference(results, 4, layout), _twin(results, 4, layout)
    assert step_bounds(twin["norms"], reference["norms"])[0] == REL
    check_losses_and_norms(results, 4, layout)
    check_max_logit(results, 4, layout)
    check_first_step_gradients(results, 4, layout)
    own = floor[reference_key(4, layout)]
    run = results[4][0][_key(layout)]
    check_no_systematic_difference(run, reference, own)

    def with_grads(change) -> dict:
        ranks = [{**res, _key(layout): {**res[_key(layout)]}} for res in results[4]]
        for res in ranks:
            res[_key(layout)]["grads"] = {
                k: change(k, g) for k, g in res[_key(layout)]["grads"].items()
            }
        return {**results, 4: ranks}

    n_layers = parity_config(1, 1, 0, **VARIANTS["mtp"]).model.n_layers
    mtp = [k for k in run["grads"] if k.startswith("layers.") and int(k.split(".")[1]) >= n_layers]
    assert mtp, "no multi-token-prediction gradient recorded"
    dropped = with_grads(lambda k, g: torch.zeros_like(g) if k in mtp else g)
    with pytest.raises(AssertionError, match="max rel err"):
        check_first_step_gradients(dropped, 4, layout)
    scaled = with_grads(lambda k, g: g * (1 + SYSTEMATIC) if k == mtp[0] else g)
    with pytest.raises(AssertionError, match="first-step gradient bias"):
        check_gradient_bias(scaled[4][0][_key(layout)], reference)
    shifted = [x * (1 + SYSTEMATIC) for x in run["losses"]]
    with pytest.raises(AssertionError, match="losses"):
        check_no_systematic_difference({**run, "losses": shifted}, reference, own)
