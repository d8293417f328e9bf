"""fp32 CPU matrix multiplies through oneDNN: the same products and gradients as torch's own
kernels, a bounded set of GEMM shapes whatever the expert row counts, and the kernel choice."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from moetrain.config import ConfigError
from moetrain.model import Transformer, cpu_matmul
from moetrain.model.cpu_matmul import TILE_ROWS, Linear, grouped_mm, linear, mm, use_cpu_matmul
from tests.helpers.configs import tiny_config

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)

# fp32 products of both kernels against float64 (sums of at most a few hundred terms)
TOL = dict(rtol=1e-5, atol=1e-4)


@pytest.fixture(autouse=True)
def kernel():
    """Runs the test body on oneDNN (the module's default, whatever an earlier test in the
    process set) or a kernel it chooses; restores the default after."""
    use_cpu_matmul("onednn")
    yield use_cpu_matmul
    use_cpu_matmul("onednn")


def per_group(a: torch.Tensor, b: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The reference of the rows form: one ``@`` per group, zeros after the last group."""
    out = a.new_zeros(a.shape[0], b.shape[2])
    start = 0
    for group, count in enumerate(counts):
        out[start : start + count] = a[start : start + count] @ b[group]
        start += count
    return out


def per_group_weight_grad(a_KN: torch.Tensor, g_NO: torch.Tensor, counts: list[int]):
    out, start = [], 0
    for count in counts:
        out.append(a_KN[:, start : start + count] @ g_NO[start : start + count])
        start += count
    return torch.stack(out)


def test_linear_matches_f_linear_forward_and_backward_on_onednn() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 37, 24, generator=g, requires_grad=True)
    w = torch.randn(40, 24, generator=g, requires_grad=True)
    b = torch.randn(40, generator=g, requires_grad=True)
    assert cpu_matmul.onednn_runs(x, w, b)
    grad = torch.randn(3, 37, 40, generator=g)
    y = linear(x, w, b)
    y.backward(grad)
    got = [y.detach(), x.grad, w.grad, b.grad]
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = F.linear(x64, w64, b64)
    ref.backward(grad.double())
    for mine, theirs in zip(got, [ref.detach(), x64.grad, w64.grad, b64.grad], strict=True):
        torch.testing.assert_close(mine.double(), theirs, **TOL)
    assert linear(x, w).shape == (3, 37, 40)  # no bias


def test_mm_and_the_linear_module_keep_nn_linears_parameters() -> None:
    a, b = torch.randn(50, 30), torch.randn(30, 20)
    torch.testing.assert_close(mm(a, b), a @ b, **TOL)
    torch.testing.assert_close(mm(a, b[:, :0]), a @ b[:, :0])  # no columns
    layer = Linear(30, 20, bias=False)
    assert list(layer.state_dict()) == ["weight"]
    torch.testing.assert_close(layer(a), F.linear(a, layer.weight), **TOL)


@pytest.mark.parametrize(
    "counts",
    [
        [0, 3 * TILE_ROWS + 5, 7, TILE_ROWS],  # several tiles, a padded tail, an empty group
        [2 * TILE_ROWS + 1, 0, 0, 0],
        [1, 1, 1, 1],  # fewer rows than a tile
        [TILE_ROWS - 1, TILE_ROWS + 1],
    ],
)
@pytest.mark.parametrize("extra_rows", [0, 9])  # rows after the last group
def test_grouped_mm_matches_a_gemm_per_group_with_gradients(
    counts: list[int], extra_rows: int
) -> None:
    g = torch.Generator().manual_seed(len(counts) + extra_rows)
    n, k, o = sum(counts) + extra_rows, 24, 40
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    a = torch.randn(n, k, generator=g, requires_grad=True)
    b = torch.randn(len(counts), k, o, generator=g, requires_grad=True)
    grad = torch.randn(n, o, generator=g)
    y = grouped_mm(a, b, offs)
    y.backward(grad)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ref = per_group(a64, b64, counts)
    ref.backward(grad.double())
    torch.testing.assert_close(y.detach().double(), ref.detach(), **TOL)
    torch.testing.assert_close(a.grad.double(), a64.grad, **TOL)
    torch.testing.assert_close(b.grad.double(), b64.grad, **TOL)
    # the weight-gradient form on its own, as the experts' down projection calls it
    h = torch.randn(n, k, generator=g)
    torch.testing.assert_close(
        grouped_mm(h.t(), grad, offs).double(),
        per_group_weight_grad(h.t().double(), grad.double(), counts),
        **TOL,
    )


def test_expert_gemms_use_a_fixed_set_of_shapes_whatever_the_row_counts(monkeypatch) -> None:
    """oneDNN builds and keeps a kernel per GEMM shape: expert row counts change every step,
    the shapes handed to it must not (also when there are fewer rows than a tile, as a shadow
    experts' group often has)."""
    shapes = set()
    inner = cpu_matmul._inner_product

    def spy(x, w, b=None):  # noqa: ANN001, ANN202
        shapes.add((tuple(x.shape), x.stride(), tuple(w.shape), w.stride()))
        return inner(x, w, b)

    monkeypatch.setattr(cpu_matmul, "_inner_product", spy)
    g = torch.Generator().manual_seed(0)
    n, k, o, groups = 6 * TILE_ROWS, 16, 24, 4
    a = torch.randn(n, k, requires_grad=True)
    b = torch.randn(groups, k, o, requires_grad=True)
    for _ in range(12):
        cuts = torch.randint(0, n + 1, (groups - 1,), generator=g).sort().values
        counts = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([n])]))
        offs = counts.cumsum(0).to(torch.int32)
        grouped_mm(a, b, offs).sum().backward()
        rows = int(torch.randint(1, TILE_ROWS, (1,), generator=g))  # fewer rows than a tile
        small = torch.tensor([0, rows // 2, rows - rows // 2, 0]).cumsum(0).to(torch.int32)
        grouped_mm(a[:rows], b, small).sum().backward()
    # forward, input gradient, weight gradient: one shape each
    assert len(shapes) == 3, shapes
    assert all(TILE_ROWS in x_shape for x_shape, _, _, _ in shapes)


def test_memory_stays_flat_while_gemm_shapes_change() -> None:
    """A fresh process: 80 steps of changing expert row counts, and linears over 80
    different row counts, grow it by a few MiB, not by the ~1 MiB per distinct shape oneDNN
    keeps by default (80 MiB and more: over the bound)."""
    script = textwrap.dedent(
        """
        import torch
        from moetrain.model.cpu_matmul import grouped_mm, linear
        torch.manual_seed(0)
        a = torch.randn(1024, 64, requires_grad=True)
        b = torch.randn(4, 64, 128, requires_grad=True)
        def rss():
            text = open("/proc/self/status").read()
            return int(text.split("VmRSS:")[1].split()[0]) / 1024
        w = torch.randn(96, 64)
        def step(i):
            j = i % 100
            counts = torch.tensor([100 + j, 300 - j, 250 + 2 * j, 374 - 3 * j])
            grouped_mm(a, b, counts.cumsum(0).to(torch.int32)).sum().backward()
            linear(a[: 200 + i], w).sum().backward()
        for i in range(10):
            step(i)
        before = rss()
        for i in range(10, 90):
            step(i)
        print(rss() - before)
        """
    )
    env = {k: v for k, v in os.environ.items() if "CACHE_CAPACITY" not in k}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    assert float(out.stdout.split()[-1]) < 30, out.stdout


def test_torch_kernels_when_chosen_and_a_bad_choice_is_refused(kernel) -> None:
    x, w = torch.randn(33, 24), torch.randn(40, 24)
    kernel("torch")
    assert not cpu_matmul.onednn_runs(x, w)
    assert torch.equal(linear(x, w), F.linear(x, w))
    kernel("onednn")
    assert cpu_matmul.onednn_runs(x, w)
    assert not cpu_matmul.onednn_runs(x.bfloat16(), w.bfloat16())  # fp32 only
    with pytest.raises(ValueError, match="cpu_matmul must be one of"):
        kernel("mkl")
    with pytest.raises(ConfigError, match="train.cpu_matmul"):
        tiny_config(train__cpu_matmul="mkl")


def test_a_model_trains_the_same_on_both_kernels(kernel) -> None:
    """Loss and every gradient of a tiny MoE model agree between the kernels (fp32 rounding)."""
    cfg = tiny_config()
    results = []
    for choice in ("torch", "onednn"):
        kernel(choice)
        torch.manual_seed(0)
        model = Transformer(cfg.model, cfg.moe)
        model.init_weights()
        ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len + 1))
        out = model(ids[:, :-1], labels_BS=ids[:, 1:])
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.loss.detach(), grads))
    (loss_t, grads_t), (loss_o, grads_o) = results
    torch.testing.assert_close(loss_o, loss_t, rtol=1e-5, atol=1e-6)
    assert grads_o.keys() == grads_t.keys()
    for name in grads_t:
        torch.testing.assert_close(grads_o[name], grads_t[name], rtol=1e-3, atol=1e-5, msg=name)


def test_process_set_up_applies_the_configured_kernel(kernel):
    """What ``moetrain train`` sets for its process (and the in-process benchmarks reuse):
    ``train.cpu_matmul`` reaches the kernel choice."""
    from moetrain.config import load_config
    from moetrain.model.cpu_matmul import cpu_matmul_choice
    from moetrain.train.loop import set_up_process

    for choice in ("torch", "onednn"):
        set_up_process(
            load_config(None, [f"train.cpu_matmul={choice}", "train.host_allocator=system"])
        )
        assert cpu_matmul_choice() == choice
    set_up_process(load_config(None, ["train.host_allocator=system"]))  # the default, auto
    assert cpu_matmul_choice() == cpu_matmul.preferred_kernel()


def test_auto_picks_onednn_only_on_an_avx512_cpu(kernel, monkeypatch) -> None:
    """``auto``: oneDNN where torch reports AVX-512 (its gain), torch's kernels elsewhere."""
    for capability, expected in (("AVX512", "onednn"), ("AVX2", "torch"), ("DEFAULT", "torch")):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        kernel("auto")
        assert cpu_matmul.cpu_matmul_choice() == expected
