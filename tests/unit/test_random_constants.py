"""The conversion tests' models hold no constant tensor (``tests/helpers/random_constants.py``):
whatever transformers or moetrain initialise to one value (norms, biases, selection biases,
sinks, a zero router) is drawn at random, so that an import or export that drops or swaps it
changes the logits. Checked for every family's tiny transformers model and every format's
moetrain case; and the negative control: putting one drawn tensor back to its initial constant
changes transformers' logits."""

from __future__ import annotations

import re

import pytest
import torch

from moetrain.convert.families import DENSE, FORMATS
from moetrain.model import param_names as pn
from tests.helpers.convert_models import model_for, tiny_cfg
from tests.helpers.hf_models import hf_config
from tests.helpers.random_constants import constant_tensors, randomise_constants

transformers = pytest.importorskip("transformers")


def _hf_model(family: str):
    torch.manual_seed(1)
    return transformers.AutoModelForCausalLM.from_config(hf_config(family)).eval()


def test_no_tiny_transformers_model_keeps_a_constant_tensor() -> None:
    for family in (*FORMATS, *DENSE):
        model = _hf_model(family)
        assert constant_tensors(model), family  # (each has norms at 1 before)
        randomise_constants(model)
        assert not constant_tensors(model), (family, sorted(constant_tensors(model)))


def _bias_unused(cfg, name: str) -> bool:
    """A selection bias a format cannot store: none moves it, or its layer routes by hash."""
    layer = re.match(r"layers\.(\d+)\.", name)
    return cfg.moe.bias_update_rate == 0 or bool(layer and cfg.moe.is_hash_layer(int(layer[1])))


def test_no_moetrain_case_keeps_a_constant_tensor_but_a_selection_bias_it_cannot_store() -> None:
    for fmt in FORMATS:
        cfg = tiny_cfg(fmt)
        left = set(constant_tensors(model_for(cfg)))
        kept = {n for n in left if pn.is_expert_bias(n) and _bias_unused(cfg, n)}
        assert left == kept, (fmt, sorted(left - kept))


def test_a_drawn_tensor_put_back_to_its_constant_changes_the_logits() -> None:
    """GLM-4.5's selection bias (zeros at init): back at zero, other experts and logits."""
    model = _hf_model("glm4_moe")
    randomise_constants(model)
    ids = torch.randint(0, 320, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        drawn = model(input_ids=ids).logits
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
        assert (model(input_ids=ids).logits - drawn).abs().max() > 1e-4
