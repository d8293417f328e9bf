"""The zero-centred RMSNorm (``model.zero_centered_norm``, Qwen3-Next's and Qwen3.5's): its weight
an offset from 1, computed as transformers' ``Qwen3NextRMSNorm`` computes it (in fp32, rounded
once), zeros at initialisation, and every norm of the model but latent attention's and Gated
DeltaNet's output norm built so."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

from moetrain.config import ConfigError
from moetrain.model import RMSNorm, Transformer
from tests.helpers.configs import tiny_config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_is_transformers_qwen3_next_norm_values_and_gradients(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    ours, theirs = RMSNorm(48, 1e-6, offset=1.0), Qwen3NextRMSNorm(48, eps=1e-6)
    assert torch.equal(ours.weight, torch.zeros(48))  # the identity scale
    with torch.no_grad():
        ours.weight.uniform_(-0.5, 0.5)
        theirs.weight.copy_(ours.weight)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x = (torch.randn(3, 7, 48) * 3).to(dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), theirs(xb)
    assert torch.equal(ya, yb)  # the same operations in the same order
    g = torch.randn_like(ya)
    (ya.float() * g.float()).sum().backward()
    (yb.float() * g.float()).sum().backward()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(xa.grad, xb.grad, rtol=tol, atol=tol * float(xb.grad.abs().max()))
    wa, wb = ours.weight.grad.float(), theirs.weight.grad.float()
    torch.testing.assert_close(wa, wb, rtol=tol, atol=tol * float(wb.abs().max()))
    # the plain norm with weight 1 + w computes the same in fp32
    if dtype == torch.float32:
        plain = RMSNorm(48, 1e-6)
        with torch.no_grad():
            plain.weight.copy_(1 + ours.weight)
        torch.testing.assert_close(plain(x), ya, rtol=1e-6, atol=1e-6)


def test_model_builds_every_block_final_mtp_and_qk_norm_zero_centred() -> None:
    cfg = tiny_config(
        {"model.zero_centered_norm": True, "model.qk_norm": True, "model.mtp_depth": 1}
    )
    model = Transformer(cfg.model, cfg.moe)
    norms = {n: m for n, m in model.named_modules() if isinstance(m, RMSNorm)}
    assert len(norms) == 3 * 2 + 2 * 2 + 1 + 3 + 2  # blocks (3 incl. MTP): 2 + q/k; final; MTP's
    assert all(m.offset == 1.0 and not m.weight.any() for m in norms.values())
    with pytest.raises(ConfigError, match=r"model\.zero_centered_norm"):
        tiny_config({"model.zero_centered_norm": True, "model.norm": "layernorm"})
