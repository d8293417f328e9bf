"""How far a broken expert moves each family's logits in the import parity test, in tolerances.

    .venv/bin/python benchmarks/parity_sensitivity.py                  # every MoE family
    .venv/bin/python benchmarks/parity_sensitivity.py deepseek_v3 phimoe --std 0.1
    .venv/bin/python benchmarks/parity_sensitivity.py granitemoe --convert

The logits-parity test (tests/unit/test_init_from.py) loads a family's tiny transformers model
(tests/helpers/hf_models.py) into moetrain and compares the logits of 4 x 13 tokens at
atol = rtol = 1e-5. Here the same comparison with moetrain's model broken on purpose:
``activation`` every expert's activation swapped (SwiGLU or the clamped SwiGLU -> GeGLU, GeGLU
-> SwiGLU, squared ReLU -> ReLU), ``expert L.E`` expert E of MoE layer L's output zeroed, one
at a time. Printed in units of the tolerance (the largest ``|got - ref| / (atol + rtol |ref|)``:
above 1 the test fails, so the break is caught): the intact model, the activation swap, the
least-caught expert, and the experts no token of the test reaches (``blind``: a break there
cannot show). ``--std`` overrides the tiny model's ``initializer_range``. ``--convert``: the
export parity test's case instead (tests/unit/test_convert_logits.py: moetrain's tiny model of
the format's case, tests/helpers/convert_models.py, against its export loaded in transformers,
2 x 19 tokens; ``--std`` overrides ``model.init_std``): the least-caught expert.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from moetrain.config import read_config_data
from moetrain.init_from.source import resolve_config_data
from moetrain.init_from.weights import build_model
from moetrain.model.layers import geglu_packed, relu2_packed, silu_mul_packed


def swapped(act):  # noqa: ANN001, ANN201
    """Another activation of the same packing."""
    if act is geglu_packed:
        return silu_mul_packed
    if act is relu2_packed:
        return lambda h, w=None: torch.relu(h) * (1 if w is None else w.unsqueeze(-1))
    return geglu_packed


def in_tolerances(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((got - ref).abs() / (1e-5 + 1e-5 * ref.abs())).max())


@torch.no_grad()
def sensitivity(family: str, root: Path, std: float | None) -> str:
    import transformers

    from tests.helpers.hf_models import save_hf_model

    overrides = {} if std is None else {"initializer_range": std}
    src = save_hf_model(family, root / family, overrides=overrides)
    cfg, source = resolve_config_data(read_config_data(None, [f"checkpoint.init_from={src}"]))
    ids = torch.randint(0, 320, (4, 13), generator=torch.Generator().manual_seed(0))
    model = build_model(cfg, source).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ref = hf(input_ids=ids).logits
    intact = in_tolerances(model(ids).logits, ref)
    experts = [m for m in model.modules() if hasattr(m, "act_fn") and hasattr(m, "w2")]
    for e in experts:
        e.act_fn, e.kept_act = swapped(e.act_fn), e.act_fn
    activation = in_tolerances(model(ids).logits, ref)
    for e in experts:
        e.act_fn = e.kept_act
    caught, blind = [], []
    for layer, e in enumerate(experts):
        for i in range(e.w2.shape[0]):
            kept = e.w2[i].clone()
            e.w2[i].zero_()
            moved = in_tolerances(model(ids).logits, ref)
            e.w2[i].copy_(kept)
            (caught if moved > 1 else blind).append((moved, f"{layer}.{i}"))
    least = min(caught)[0] if caught else float("nan")
    std_used = getattr(hf.config, "initializer_range", None)
    return (
        f"{family:18s} std {std_used}: intact {intact:.3f}, activation {activation:.0f}, "
        f"least-caught expert {least:.1f}, blind {len(blind)}/{len(caught) + len(blind)} "
        f"{' '.join(name for _, name in blind)}"
    )


@torch.no_grad()
def convert_sensitivity(fmt: str, std: float | None) -> str:
    """The least a zeroed expert moves the export case's logits (its own intact model's: the
    export's are those within the tolerance, which the test checks)."""
    from tests.helpers.convert_models import model_for, tiny_cfg

    cfg = tiny_cfg(fmt, {} if std is None else {"model.init_std": std})
    model = model_for(cfg)
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(0))
    intact = model(ids).logits
    moved = []
    for moe in model.moe_layers():
        w2 = moe.experts.w2
        for i in range(w2.shape[0]):
            kept = w2[i].clone()
            w2[i].zero_()
            moved.append((in_tolerances(model(ids).logits, intact), f"{moe.layer}.{i}"))
            w2[i].copy_(kept)
    least, where = min(moved)
    return f"{fmt:18s} init_std {cfg.model.init_std}: least-caught expert {least:.1f} ({where})"


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (the tests' tiny models)
    from tests.helpers.hf_models import MOE_FAMILIES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", default=list(MOE_FAMILIES))
    parser.add_argument("--std", type=float, default=None)
    parser.add_argument("--convert", action="store_true", help="the export parity case")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.convert:
        for fmt in args.families:
            print(convert_sensitivity(fmt, args.std), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            print(sensitivity(family, Path(tmp), args.std), flush=True)


if __name__ == "__main__":
    main()
