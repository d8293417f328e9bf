"""The weight layouts between moetrain and each Hugging Face format: the tensors a format
cannot hold are refused by name."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import ConfigError
from moetrain.convert.hf import to_hf_state_dict
from tests.helpers.convert_cases import (
    model_for,
    tiny_cfg,
)

transformers = pytest.importorskip("transformers")


def test_softmax_with_nonzero_bias_tensor_is_refused() -> None:
    cfg = tiny_cfg("mixtral")
    sd = model_for(cfg).state_dict()
    sd["layers.1.ffn.router.expert_bias"] = torch.full((4,), 0.5)
    with pytest.raises(ConfigError, match=r"layers\.1\.ffn\.router\.expert_bias"):
        to_hf_state_dict(sd, cfg, "mixtral")
