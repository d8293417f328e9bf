"""What a parity run is held to against its reference: rounding told apart from a systematic
error (the reasoning is test_parity.py's docstring; docs/NUMERICS.md says it for users).

A run is a dict of ``losses`` and ``norms`` (one per step), ``grads`` (first-step gradients by
name; expert stacks this rank's ``experts`` range) and ``max_logit``; a twin is its reference's
run with every micro-batch's rows in reverse order (rounding alone).
"""

from __future__ import annotations

import torch

REL = 1e-5
TWIN_FACTOR = 10.0  # (see step_bounds)
FLOOR_FACTOR, MIN_TOL, SYSTEMATIC = 3.0, 1e-7, 1e-6
GRAD_Z = 4.0  # (see check_gradient_bias)
BIAS_MIN_ELEMENTS = 128  # (see check_gradient_bias)


def max_rel(a: list[float], b: list[float]) -> float:
    """The largest relative difference of ``a`` from ``b``, element by element."""
    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(((ta - tb).abs() / tb.abs()).max())


def step_bounds(twin: list[float], reference: list[float]) -> list[float]:
    """Each step's bound on a layout's relative difference from the reference: ``REL``, or
    ``TWIN_FACTOR`` times the largest relative difference of the twin (the same function with
    every sum over tokens in another order: rounding alone) up to that step, where this
    configuration's own trajectory amplifies rounding beyond ``REL`` / ``TWIN_FACTOR`` (Adam's
    epsilon regime: docs/NUMERICS.md). A layout rounds about three times more than the twin."""
    bounds, drift = [], 0.0
    for x, y in zip(twin, reference, strict=True):
        drift = max(drift, abs(x - y) / abs(y))
        bounds.append(max(REL, TWIN_FACTOR * drift))
    return bounds


def check_steps(got: list[float], reference: list[float], twin: list[float], what: str) -> None:
    """Every step of ``got`` within :func:`step_bounds` of the reference."""
    bounds = step_bounds(twin, reference)
    for step, (x, y, bound) in enumerate(zip(got, reference, bounds, strict=True)):
        err = abs(x - y) / abs(y)
        assert err <= bound, f"{what} at step {step}: relative difference {err:.2e} > {bound:.2e}"


def _signed(a: list[float], b: list[float]) -> list[float]:
    return [(x - y) / abs(y) for x, y in zip(a, b, strict=True)]


def scale_fit(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """The least-squares relative scale ``b = <g - r, r> / <r, r>`` of ``got`` against ``want``
    and its standard error, estimated from the fit's own residual ``u = g - r - b r`` clustered
    by rows (vectors along the last dimension; elements of a 1-D tensor): ``sqrt(sum over rows
    of <r_row, u_row>^2) / <r, r>``. Rounding makes ``b`` a few standard errors at most, with
    the size of this run's own rounding in this tensor; a systematic scale error ``s`` makes it
    ``s``."""
    r = want.double()
    e = got.double() - r
    rr = (r * r).sum()
    b = (e * r).sum() / rr
    rows = (lambda t: t.reshape(-1, t.shape[-1])) if r.dim() > 1 else (lambda t: t.reshape(-1, 1))
    se = (rows(r) * rows(e - b * r)).sum(1).square().sum().sqrt() / rr
    return float(b), float(se)


def check_gradient_bias(run: dict, reference: dict) -> None:
    """Each tensor's first-step gradient scale (this rank's experts of the expert tensors) within
    ``GRAD_Z`` standard errors of its rounding (at least ``MIN_TOL``), over tensors of at least
    ``BIAS_MIN_ELEMENTS`` (a scale fitted to a few elements averages no rounding out; those are
    held element by element to ``REL``: test_parity.py's test_gradients_after_first_step_match). And the check
    resolves ``SYSTEMATIC``: a scale error of that size in the tensor, of either sign, would
    fail it; where this run's rounding is too large for that, it fails saying so."""
    lo, hi = run["experts"]
    for name, want in reference["grads"].items():
        if want.numel() < BIAS_MIN_ELEMENTS:
            continue
        b, se = scale_fit(run["grads"][name], want[lo:hi] if ".experts." in name else want)
        tol = max(GRAD_Z * se, MIN_TOL)
        assert abs(b) <= tol, (
            f"{name}: first-step gradient bias {b:.2e} > {tol:.2e} "
            f"({GRAD_Z:g} x its rounding's standard error {se:.2e}, at least {MIN_TOL:g})"
        )
        assert min(abs(b + SYSTEMATIC), abs(b - SYSTEMATIC)) > tol, (
            f"{name}: rounding (standard error {se:.2e}) too large to resolve a gradient "
            f"bias of {SYSTEMATIC:g}"
        )


def rounding_floor(runs: dict[str, dict]) -> dict[str, dict[str, float]]:
    """This host's rounding floor of each reference in ``runs`` (by its key, for each
    ``twin_<key>``): against its rows-reversed twin, the RMS over the steps of the relative
    difference of the losses and of the norms. Each layout is held to its own reference's floor:
    a variant whose function rounds more (a top-k selection, a recurrence) does not loosen the
    others'."""
    out = {}
    for key in [k for k in runs if k.startswith("twin_")]:
        twin, ref = runs[key], runs[key.removeprefix("twin_")]
        out[key.removeprefix("twin_")] = {
            q: _rms(_signed(twin[q], ref[q])) for q in ("losses", "norms")
        }
    return out


def _rms(values: list[float]) -> float:
    return (sum(x * x for x in values) / len(values)) ** 0.5


def check_no_systematic_difference(run: dict, reference: dict, floor: dict[str, float]) -> None:
    """The mean relative difference over the steps (losses, norms) within ``FLOOR_FACTOR`` x the
    rounding floor (at least ``MIN_TOL``), and the first step's gradient bias
    (:func:`check_gradient_bias`)."""
    for q in ("losses", "norms"):
        mean = sum(_signed(run[q], reference[q])) / len(reference[q])
        tol = max(FLOOR_FACTOR * floor[q], MIN_TOL)
        assert abs(mean) <= tol, f"{q}: mean relative difference {mean:.2e} > {tol:.2e}"
    check_gradient_bias(run, reference)
