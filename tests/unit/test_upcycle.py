"""Sparse upcycling of dense Hugging Face models: at step 0 the MoE computes the dense model
(<= 1e-5) wherever the module docstring of moetrain.init_from.upcycle says it does, in moetrain
and, after `moetrain import` + `moetrain convert`, in transformers."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from moetrain.checkpoint.read import load_model
from moetrain.cli import main
from moetrain.config import ConfigError, read_config_data
from moetrain.convert.export import convert_checkpoint
from moetrain.init_from.source import resolve_config_data
from moetrain.init_from.weights import build_model, init_record
from tests.helpers.hf_models import DENSE_FAMILIES, save_hf_model, save_hf_tokenizer

transformers = pytest.importorskip("transformers")
IDS = torch.randint(0, 320, (2, 21), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dense")
    tok = save_hf_tokenizer(["def f(x):\n    return x + 1  # ü"] * 20, 300, root / "tok")
    return {f: save_hf_model(f, root / f, tokenizer=tok) for f in DENSE_FAMILIES}


@functools.cache
def dense_logits(path: Path) -> torch.Tensor:
    """The dense model's logits on IDS, in transformers."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(input_ids=IDS).logits


def upcycled(path: Path, *overrides: str):
    data = read_config_data(None, [f"checkpoint.init_from={path}", *overrides])
    cfg, source = resolve_config_data(data)
    assert source.upcycle
    model = build_model(cfg, source).eval()
    with torch.no_grad():
        return model(IDS).logits, cfg, source, model


EXACT = {
    "copies": ["moe.num_experts=8", "moe.top_k=2"],
    "fine-grained G=2": ["moe.num_experts=8", "moe.top_k=2", "checkpoint.upcycle_granularity=2"],
    "fine-grained G=4, top-8": [
        "moe.num_experts=16",
        "moe.top_k=8",
        "checkpoint.upcycle_granularity=4",
    ],
    "gated shared expert": ["moe.num_shared_experts=1", "moe.shared_expert_gate=true"],
    "shared expert, sigmoid router": [
        "moe.num_shared_experts=1",
        "moe.score_func=sigmoid",
        "moe.route_scale=2.5",
    ],
    "every other layer, top-k before softmax": [
        "moe.moe_every=2",
        "moe.topk_before_score=true",
        "moe.renormalize=false",
    ],
}


@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_upcycled_copies_compute_the_dense_model(dense, family) -> None:
    got, cfg, source, model = upcycled(dense[family], *EXACT["copies"])
    assert cfg.moe.expert_hidden == 48 and len(model.moe_layers()) == 3
    torch.testing.assert_close(got, dense_logits(dense[family]), atol=1e-5, rtol=1e-5)
    assert init_record(source, cfg)["upcycled"]["dense_function_at_step_0"]


def test_llama_3_2_style_source_upcycles_exactly(tmp_path) -> None:
    """Llama 3.2's flags (llama3 RoPE scaling, tied embeddings): the upcycled MoE computes the
    dense model at step 0, in moetrain and, after import and convert, in transformers."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 5000.0,
        "factor": 32.0,
        "original_max_position_embeddings": 16,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    }
    tok = save_hf_tokenizer(["def f(x):\n    return x + 1"] * 20, 300, tmp_path / "tok")
    overrides = {"rope_parameters": rope, "tie_word_embeddings": True}
    src = save_hf_model("llama", tmp_path / "llama32", tokenizer=tok, overrides=overrides)
    got, cfg, _, _ = upcycled(src, *EXACT["copies"])
    assert (cfg.model.rope_scaling, cfg.model.rope_factor, cfg.model.tie_embeddings) == (
        "llama3",
        32.0,
        True,
    )
    ref = dense_logits(src)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert main(["import", str(src), str(tmp_path / "ckpt"), *EXACT["copies"]]) == 0
    out = convert_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=IDS).logits, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(EXACT)[1:])
def test_upcycled_variants_compute_the_dense_model(dense, case) -> None:
    got, cfg, _, model = upcycled(dense["qwen2"], *EXACT[case])
    torch.testing.assert_close(got, dense_logits(dense["qwen2"]), atol=1e-5, rtol=1e-5)
    g = cfg.checkpoint.upcycle_granularity
    router = model.moe_layers()[0].router.gate.weight
    assert torch.equal(router, router[::g].repeat_interleave(g, 0))  # one row per virtual group
    assert len(set(map(tuple, router.tolist()))) == cfg.moe.num_experts // g


def test_inexact_settings_are_allowed_and_said(dense) -> None:
    ref = dense_logits(dense["llama"])
    for extra, reason in (
        (["moe.renormalize=false"], "moe.renormalize=false"),
        (["checkpoint.upcycle_noise=0.05"], "checkpoint.upcycle_noise"),
    ):
        got, cfg, source, model = upcycled(dense["llama"], *EXACT["copies"], *extra)
        assert (got - ref).abs().max() > 1e-3
        record = init_record(source, cfg)["upcycled"]
        assert not record["dense_function_at_step_0"] and reason in record["inexact_because"][0]
    w13 = model.moe_layers()[0].experts.w13
    assert not torch.equal(w13[0], w13[1])  # noise differs per expert


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["checkpoint.upcycle_granularity=5"], "checkpoint.upcycle_granularity"),
        (["checkpoint.upcycle_granularity=2", "moe.top_k=3"], "moe.top_k"),
        (["checkpoint.upcycle_granularity=4", "moe.num_experts=6"], "moe.num_experts"),
        (["moe.expert_hidden=24"], "moe.expert_hidden"),
        (["moe.num_shared_experts=1", "moe.shared_expert_hidden=24"], "moe.shared_expert_hidden"),
    ],
)
def test_impossible_upcycling_is_refused_by_name(dense, overrides, key) -> None:
    data = read_config_data(None, [f"checkpoint.init_from={dense['llama']}", *overrides])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        resolve_config_data(data)


@pytest.mark.parametrize(
    ("family", "overrides", "arch"),
    [
        ("llama", [], "MixtralForCausalLM"),
        ("qwen2", [], "Qwen2MoeForCausalLM"),  # q/k/v biases, no shared expert
        (
            "qwen2",
            ["moe.num_shared_experts=1", "moe.shared_expert_gate=true"],
            "Qwen2MoeForCausalLM",
        ),
    ],
)
def test_import_upcycles_and_transformers_agrees(dense, tmp_path, family, overrides, arch) -> None:
    """`moetrain import DENSE OUT moe.num_experts=8 moe.top_k=2` then `moetrain convert`."""
    ckpt = tmp_path / "ckpt"
    args = ["import", str(dense[family]), str(ckpt), *EXACT["copies"], *overrides]
    assert main(args) == 0
    ref = dense_logits(dense[family])
    model, cfg = load_model(ckpt)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(IDS).logits, ref, atol=1e-5, rtol=1e-5)
    assert cfg.moe.num_experts == 8 and cfg.moe.top_k == 2
    out = convert_checkpoint(ckpt, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == arch
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=IDS).logits, ref, atol=1e-5, rtol=1e-5)
    assert main(["import", str(out), str(tmp_path / "again")]) == 0  # the export imports back
    back, back_cfg = load_model(tmp_path / "again")
    assert back_cfg.moe.num_shared_experts == cfg.moe.num_shared_experts
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(IDS).logits, ref, atol=1e-5, rtol=1e-5)
    # the model's own tokenizer went along: AutoTokenizer on the converted model gives the ids
    # the tokenizers library gives (what `moetrain prepare` trains on)
    from tokenizers import Tokenizer

    text = "def f(x):\n    return x + 1  # ü"
    raw = Tokenizer.from_file(str(dense[family] / "tokenizer.json")).encode(text).ids
    assert transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"] == raw


def test_inexact_reasons_name_exactly_the_settings_that_break_step_0() -> None:
    """Weights that sum to 1 keep the upcycled model the dense one: renormalised top-k, or a
    softmax over the k chosen logits (top-k before the score); anything else is named."""
    from moetrain.init_from.upcycle import inexact_reasons
    from tests.helpers.configs import tiny_config

    assert inexact_reasons(tiny_config()) == []
    assert inexact_reasons(tiny_config(moe__renormalize=False, moe__topk_before_score=True)) == []
    (why,) = inexact_reasons(tiny_config(moe__renormalize=False))
    assert why.startswith("moe.renormalize=false")
    # ERNIE's moe_norm_min: harmless below a softmax's least top-k sum (k / E), not above
    assert inexact_reasons(tiny_config(moe__renormalize_min=1e-12)) == []
    (why,) = inexact_reasons(tiny_config(moe__renormalize_min=0.9))
    assert why.startswith("moe.renormalize_min=0.9")
    (why,) = inexact_reasons(tiny_config(moe__renormalize_min=1e-12, moe__score_func="sigmoid"))
    assert why.startswith("moe.renormalize_min=1e-12")
    # weights on the inputs (Llama 4's rule): exact only where the one weight is 1
    assert inexact_reasons(tiny_config(moe__score_on_input=True, moe__top_k=1)) == []
    (why,) = inexact_reasons(tiny_config(moe__score_on_input=True))
    assert why.startswith("moe.score_on_input=true")
    (why,) = inexact_reasons(tiny_config(moe__route_scale=2.5))
    assert why.startswith("moe.route_scale=2.5")
    cfg = tiny_config(moe__capacity_factor=1.0, moe__jitter=0.1, checkpoint__upcycle_noise=0.1)
    assert [w.split(" ")[0] for w in inexact_reasons(cfg)] == [
        "moe.capacity_factor",
        "moe.jitter",
        "checkpoint.upcycle_noise",
    ]
