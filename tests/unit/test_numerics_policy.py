"""The bf16 numerics policy (docs/NUMERICS.md) where one process can check it: which
dtype each part of the model computes in, what moetrain asks DeepSpeed for, and what it refuses.

The engine side (fp32 accumulation and reduction, masters, exact skips) is proven on real gloo
ranks in tests/distributed/test_precision.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetrain.config import ConfigError
from moetrain.model import Transformer
from moetrain.model.moe.router import Router
from moetrain.parallel.deepspeed import check_precision_supported, deepspeed_config
from tests.helpers.configs import tiny_config


def _bf16_model(**settings: object) -> Transformer:
    """The tiny model as a bf16 engine holds it: bf16 weights, fp32 aux-loss-free biases."""
    cfg = tiny_config(moe__bias_update_rate=0.01, **settings)
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe).to(torch.bfloat16)
    for layer in model.moe_layers():  # what parallel.deepspeed.initialize_engine restores
        layer.router.expert_bias = layer.router.expert_bias.float()
    return model


def test_router_computes_in_fp32_from_the_bf16_weights() -> None:
    """Router logits, softmax, top-k weights, aux and z losses and the entropy come out fp32 and
    equal (exactly) an fp32 router holding the same (bf16-representable) weights."""
    cfg = tiny_config().moe
    torch.manual_seed(1)
    router = Router(cfg, d_model=32)
    router.expert_bias = torch.linspace(-0.01, 0.01, cfg.num_experts)
    fp32 = Router(cfg, d_model=32)
    fp32.load_state_dict(router.state_dict())
    router.gate.to(torch.bfloat16)
    with torch.no_grad():
        fp32.gate.weight.copy_(router.gate.weight.float())
    x = torch.randn(40, 32).to(torch.bfloat16)
    out, ref = router(x), fp32(x.float())
    for name in ("weights_TK", "aux_loss", "z_loss", "entropy", "tokens_per_expert_E"):
        got, want = getattr(out, name), getattr(ref, name)
        assert got.dtype == torch.float32, name
        assert torch.equal(got, want), name
    assert torch.equal(out.ids_TK, ref.ids_TK)
    router.update_bias(torch.arange(cfg.num_experts, dtype=torch.float64))
    assert router.expert_bias.dtype == torch.float32


def test_bf16_model_matmuls_in_bf16_losses_in_fp32() -> None:
    """Attention, expert and head matmuls run in bf16; the cross-entropy (chunked or on full
    logits) and the MoE losses in fp32, and the loss the engine backpropagates is fp32."""
    model = _bf16_model(model__loss_chunk_tokens=16)
    seen: dict[str, torch.dtype] = {}

    def record(name: str):  # noqa: ANN202
        def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
            seen.setdefault(name, out.dtype)

        return hook

    model.layers[0].attn.wq.register_forward_hook(record("wq"))
    model.moe_layers()[0].experts.register_forward_hook(record("experts"))
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    labels = ids.roll(-1, 1)
    out = model(ids, labels_BS=labels, return_logits=False)  # the trainer's call: chunked CE
    assert out.loss.dtype == out.ce_loss.dtype == out.moe_loss.dtype == torch.float32
    assert all(m.aux_loss.dtype == m.z_loss.dtype == torch.float32 for m in out.moe)
    # (the head's chunked call returns the fp32 loss itself: its logits are recorded below)
    model.lm_head.register_forward_hook(record("lm_head"))
    full = model(ids, labels_BS=labels)  # full bf16 logits, cross-entropy in fp32
    assert full.logits.dtype == torch.bfloat16 and full.ce_loss.dtype == torch.float32
    assert seen == {"wq": torch.bfloat16, "experts": torch.bfloat16, "lm_head": torch.bfloat16}
    want = F.cross_entropy(full.logits.float().flatten(0, 1), labels.flatten())
    torch.testing.assert_close(full.ce_loss, want, rtol=1e-6, atol=1e-6)
    # the chunked loss computes the same logits chunk by chunk (bf16 matmul, fp32 softmax)
    torch.testing.assert_close(out.ce_loss, want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_deepspeed_is_asked_for_fp32_accumulation_and_reduction(precision: str) -> None:
    cfg = tiny_config(train__precision=precision, parallel__zero_stage=1)
    ds = deepspeed_config(cfg, 2)
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"}
    assert ds["communication_data_type"] == "fp32"
    assert ds[precision]["enabled"]
    if precision == "bf16":
        assert ds["bf16"]["check_grad_overflow"] and ds["bf16"]["immediate_grad_update"]
    low = deepspeed_config(tiny_config(train__precision=precision, train__grad_dtype=precision), 2)
    assert low["data_types"] == {"grad_accum_dtype": precision}
    assert low["communication_data_type"] == precision


def test_grad_dtype_is_fp32_or_the_weights_dtype() -> None:
    with pytest.raises(ConfigError, match=r"train\.grad_dtype: must be one of \('fp32',\)"):
        tiny_config(train__grad_dtype="bf16")  # fp32 training
    with pytest.raises(ConfigError, match=r"train\.grad_dtype: .*train\.precision=fp16"):
        tiny_config(train__precision="fp16", train__grad_dtype="bf16")
    assert tiny_config(train__precision="bf16").train.grad_dtype == "fp32"  # the default


def _accelerator_has_fp16() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


@pytest.mark.skipif(_accelerator_has_fp16(), reason="this machine's accelerator has fp16")
def test_fp16_refused_before_any_process_group(tmp_path) -> None:
    """On a machine whose accelerator has no fp16 (DeepSpeed's own test), `moetrain train`
    stops before it starts a process group, naming the key and suggesting bf16."""
    import torch.distributed as dist

    from moetrain.train.loop import run_training

    with pytest.raises(ConfigError, match=r"train\.precision: fp16 is not supported") as err:
        check_precision_supported("fp16")
    assert "train.precision=bf16" in str(err.value)
    check_precision_supported("fp32")
    cfg = tiny_config(train__precision="fp16", run_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"train\.precision: fp16"):
        run_training(cfg)
    assert not dist.is_initialized()
    assert not (tmp_path / "run").exists()  # nothing written


def test_routed_outputs_combine_in_fp32_rounded_once() -> None:
    """bf16 experts with fp32 routing weights: the weighted SwiGLU product and the sum over a
    token's K copies are computed in fp32 and rounded to bf16 once, and the weights' gradient
    stays fp32. The reference is that math written out; rounding the weight or a partial sum
    to bf16 first gives other bits."""
    from moetrain.model.moe.dispatch import sum_copies
    from moetrain.model.moe.experts import GroupedExperts

    torch.manual_seed(3)
    experts = GroupedExperts(4, 32, 48, grouped_mm=False)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.2)
    experts.to(torch.bfloat16)
    counts_L = torch.tensor([40, 30, 20, 38])
    x_ND = torch.randn(128, 32).to(torch.bfloat16)
    w_N = torch.rand(128, requires_grad=True)
    y_ND = experts(x_ND, counts_L, w_N)
    want, row = [], 0
    for i, n in enumerate(counts_L.tolist()):
        h = x_ND[row : row + n] @ experts.w13[i]
        a, b = h.float().chunk(2, -1)
        act = (F.silu(a) * b * w_N[row : row + n, None]).to(torch.bfloat16)
        want.append(act @ experts.w2[i])
        row += n
    assert torch.equal(y_ND, torch.cat(want))
    y_ND.float().sum().backward()
    assert w_N.grad is not None and w_N.grad.dtype == torch.float32

    k, t = 4, 32  # every token's 4 copies, summed
    token_N = torch.arange(t).repeat_interleave(k)
    inverse_N = torch.arange(t * k)
    y_TD = sum_copies(y_ND, token_N, inverse_N, t, k)
    exact = y_ND.float().view(t, k, -1).sum(1).to(torch.bfloat16)
    assert y_TD.dtype == torch.bfloat16 and torch.equal(y_TD, exact)


def test_the_weighted_product_is_the_same_in_blocks_of_rows(monkeypatch) -> None:
    """The fp32 weighted SwiGLU runs a block of rows at a time (bounded temporaries): ragged
    blocks give the same bits, forward and backward, as one block."""
    from moetrain.model import layers, row_blocks

    torch.manual_seed(0)
    h = torch.randn(500, 64).to(torch.bfloat16).requires_grad_(True)
    w = torch.rand(500, requires_grad=True)
    g = torch.randn(500, 32).to(torch.bfloat16)
    runs = []
    for elements in (64 * 7, 1 << 30):  # 72 blocks, the last ragged; one block
        monkeypatch.setattr(row_blocks, "BLOCK_ELEMENTS", elements)
        h.grad = w.grad = None
        y = layers.silu_mul_packed(h, w)
        y.backward(g)
        runs.append((y.detach(), h.grad, w.grad))
    for blocked, whole in zip(*runs, strict=True):
        assert torch.equal(blocked, whole)
