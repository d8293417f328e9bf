"""The recurrent mixers' kernel choice (``train.recurrent_kernels``): on the CPU every mixer runs
its torch path and records why; the choice is validated by key; a package that is missing or
too old, or a call the kernels do not take, falls back with its reason (an error under
``cuda``). The kernel paths' argument mapping runs against stand-ins written from the packages'
documented APIs (``kernel_fakes``): a mixer on the kernel path equals its torch path with
packed documents and with a generation state, values and gradients. The CUDA kernels
themselves are compared in ``test_recurrent_kernels_cuda.py`` (GPU only)."""

from __future__ import annotations

import sys

import pytest
import torch

from moetrain.config import ConfigError
from moetrain.config.layer_plan import mixer_spec
from moetrain.model import Transformer, recurrent_kernels
from moetrain.model.delta_rule_cuda import cu_seqlens_of, rule_unsupported
from moetrain.model.document_starts import document_starts
from moetrain.model.mixers import MixerInputs, build_mixer
from moetrain.model.recurrent_kernels import (
    KEY,
    KernelChoice,
    recurrent_report,
    sequence_index,
    use_recurrent_kernels,
)
from moetrain.model.short_conv_cuda import conv_unsupported
from tests.helpers.configs import tiny_config
from tests.unit import kernel_fakes, test_gated_deltanet, test_kda, test_mamba2

# the mixers' own tests' hybrid models (2 linear layers, then full attention)
GDN, KDA, MAMBA2 = test_gated_deltanet.HYBRID, test_kda.HYBRID, test_mamba2.HYBRID
KINDS = {"gated_deltanet": GDN, "kda": KDA, "mamba2": MAMBA2}


@pytest.fixture(autouse=True)
def _auto():
    """Every test starts and ends with the default choice."""
    use_recurrent_kernels("auto")
    yield
    use_recurrent_kernels("auto")


class _OnCuda:
    """A tensor's stand-in that says it lives on a CUDA device (the choice reads only that)."""

    is_cuda = True
    device = torch.device("cuda", 0)


def _mixer(kind: str, seed: int = 0, overrides: dict | None = None) -> torch.nn.Module:
    """One layer of ``kind`` (KINDS' shapes, then ``overrides``), weights away from their
    initialisation."""
    cfg = tiny_config(KINDS[kind], overrides or {}).model
    torch.manual_seed(seed)
    mixer = build_mixer(cfg, mixer_spec(cfg, 0))
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0, 0.3)
        mixer.A_log.uniform_(-1.0, 1.5)  # decays per step from ~0.7 to ~e^-5
    return mixer


def _inputs(s: int, docs: torch.Tensor | None = None, pos: int = 0) -> MixerInputs:
    return MixerInputs(torch.zeros(s, 0), torch.zeros(s, 0), doc_ids_BS=docs, pos=pos)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_cpu_runs_torch_and_records_why(kind: str) -> None:
    """On the CPU each recurrent mixer runs its torch path and its record says why; with
    ``torch`` chosen it says that; the model's report names the mixer kind."""
    mixer = _mixer(kind)
    x = torch.randn(1, 12, 32)
    mixer(x, _inputs(12))
    assert mixer.kernel_choice.first == "torch (tensors on cpu)"
    use_recurrent_kernels("torch")
    fresh = _mixer(kind)
    fresh(x, _inputs(12))
    assert fresh.kernel_choice.first == f"torch ({KEY} = torch)"
    cfg = tiny_config(KINDS[kind])
    model = Transformer(cfg.model, cfg.moe)
    model(torch.randint(0, cfg.model.vocab_size, (1, 8)))
    assert recurrent_report(model) == f"{kind}: torch ({KEY} = torch)"


def test_choice_refused_by_key() -> None:
    """An unknown choice and ``cuda`` without a CUDA device are refused naming the key, in the
    config and when set."""
    with pytest.raises(ValueError, match=rf"{KEY} must be one of"):
        use_recurrent_kernels("fla")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=rf"{KEY} = cuda needs a CUDA device"):
            use_recurrent_kernels("cuda")
    with pytest.raises(ConfigError, match=KEY):
        tiny_config({KEY: "fla"})
    assert tiny_config({KEY: "torch"}).train.recurrent_kernels == "torch"


def test_missing_or_old_package_falls_back_or_refuses(monkeypatch) -> None:
    """A package that does not import, or is older than the API this code calls, sends a CUDA
    call to the torch path with the reason (warned once); under ``cuda`` it is an error that
    names the package and how to install it."""
    kernel_fakes.install(monkeypatch, {"fla": "0.5.1"})
    choice = KernelChoice("fla chunk_gated_delta_rule + causal_conv1d", ("fla", "causal_conv1d"))
    with pytest.warns(UserWarning, match="older than 0.6.0"):
        assert not choice.use_kernels(_OnCuda())
    assert choice.first == "torch (fla 0.5.1 is older than 0.6.0, the API this code calls)"
    kernel_fakes.install(monkeypatch)
    monkeypatch.setitem(sys.modules, "mamba_ssm", None)  # import fails
    monkeypatch.setattr(recurrent_kernels, "_choice", "cuda")
    mamba = KernelChoice("mamba_ssm + causal_conv1d", ("mamba_ssm", "causal_conv1d"))
    with pytest.raises(ValueError, match=r"cuda, but .*mamba_ssm does not import.*moetrain\["):
        mamba.use_kernels(_OnCuda())
    fla = KernelChoice("fla", ("fla", "causal_conv1d"))
    assert fla.use_kernels(_OnCuda()) and fla.first == "fla"
    with pytest.raises(ValueError, match="fla cannot run this call: causal-conv1d takes"):
        fla.use_kernels(_OnCuda(), conv_unsupported(torch.zeros(1, 4, 12), 4, None, False))


def test_unsupported_calls_say_why() -> None:
    """What the kernels do not take, each with its reason; what they take, None."""
    x = torch.zeros(2, 10, 56)
    docs = torch.zeros(2, 10, dtype=torch.long)
    assert rule_unsupported(x, 4, 128, docs, False) is None
    assert conv_unsupported(x, 4, None, True) is None
    assert "width of 2 to 4, not 5" in rule_unsupported(x, 5, 8, None, False)
    assert "multiple of 8 channels, not 12" in conv_unsupported(x[..., :12], 4, None, False)
    assert "documents or a state" in rule_unsupported(x, 4, 8, docs, True)
    assert "key head dims up to 256, not 512" in rule_unsupported(x, 4, 512, None, False)
    assert "not torch.float64" in rule_unsupported(x.double(), 4, 8, None, False)
    assert "fewer tokens (2)" in rule_unsupported(x[:, :2], 4, 8, None, True)


def test_sequence_numbers_and_offsets() -> None:
    """``seq_idx`` numbers each row's documents from 0; ``cu_seqlens`` starts a sequence at
    every row and document start of the flattened rows."""
    docs = torch.tensor([[5, 5, 6, 6, 6, 9], [1, 1, 1, 1, 2, 2]])
    assert sequence_index(docs).tolist() == [[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1]]
    assert sequence_index(docs).dtype == torch.int32
    assert cu_seqlens_of(docs).tolist() == [0, 2, 5, 6, 10, 12]
    starts = document_starts(docs, None, 2, 6)
    assert (sequence_index(docs).diff(dim=1) == starts[:, 1:]).all()


def _on_cuda_choice(monkeypatch) -> None:
    """Let CPU calls take the kernel path (through the stand-ins)."""
    why_not = KernelChoice.why_not
    monkeypatch.setattr(KernelChoice, "why_not", lambda self, x, u: why_not(self, _OnCuda(), u))


def _grads(mixer: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    return torch.autograd.grad((y * w).sum(), [x, *mixer.parameters()])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_kernel_path_equals_torch_path(kind: str, monkeypatch) -> None:
    """Through the stand-ins, each mixer's kernel path equals its torch path: two packed rows of
    documents (values and every gradient), and a prefill, a continuation and a decode step from
    the generation state (values and both states)."""
    mixer = _mixer(kind)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 40, 32, generator=gen, requires_grad=True)
    docs = torch.tensor([[0] * 13 + [1] * 20 + [2] * 7, [3] * 40])
    # a prefill, a continuation, a decode step (the torch recurrence on either path)
    parts = ((x[:, :9].detach(), 0), (x[:, 9:25].detach(), 9), (x[:, 25:26].detach(), 25))
    ref = mixer(x, _inputs(40, docs))
    ref_grads = _grads(mixer, x, ref)
    ref_steps = _steps(mixer, parts)
    kernel_fakes.install(monkeypatch)
    _on_cuda_choice(monkeypatch)
    kernel = _mixer(kind)
    kernel.load_state_dict(mixer.state_dict())
    out = kernel(x, _inputs(40, docs))
    assert kernel.kernel_choice.first == kernel.kernel_choice.kernels
    assert _rel(out, ref) <= 1e-5
    for got, want in zip(_grads(kernel, x, out), ref_grads, strict=True):
        assert _rel(got, want) <= 1e-4
    for got, want in zip(_steps(kernel, parts), ref_steps, strict=True):
        assert _rel(got, want) <= 1e-5


@torch.no_grad()
def _steps(mixer: torch.nn.Module, parts) -> list[torch.Tensor]:
    """Each part's output from the generation state, then the state's two tensors."""
    state = mixer.new_state(2, 64, torch.float32, torch.device("cpu"))
    outs = [mixer(part, _inputs(part.shape[1], pos=pos), state) for part, pos in parts]
    return [*outs, state.conv, state.rule]


def test_documents_ignored_by_the_kernel_fail(monkeypatch) -> None:
    """Negative control: a stand-in fla that drops ``cu_seqlens`` (documents not restarted in
    the rule) makes the kernel path miss the torch path by far more than the tolerance."""
    mixer = _mixer("gated_deltanet")
    x = torch.randn(1, 40, 32, generator=torch.Generator().manual_seed(1))
    docs = torch.tensor([[0] * 13 + [1] * 27])
    ref = mixer(x, _inputs(40, docs))
    kernel_fakes.install(monkeypatch)
    _on_cuda_choice(monkeypatch)
    fla = sys.modules["fla.ops.gated_delta_rule"]

    def no_documents(*args, cu_seqlens=None, **kwargs):  # the row as one sequence
        return kernel_fakes.chunk_gated_delta_rule(*args, **kwargs)

    monkeypatch.setattr(fla, "chunk_gated_delta_rule", no_documents)
    assert _rel(mixer(x, _inputs(40, docs)), ref) > 1e-2
