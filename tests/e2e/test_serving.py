"""Exports serve in vLLM (opt-in: ``-m serving``; needs ``.venv-serving`` from
``launch/serving-venv.sh``, vLLM's CPU build in a venv of its own).

For every export format, and for a dense Qwen2 upcycled on import (exported as Qwen2-MoE without
a shared expert), DeepSeek-V3 with plain RoPE (Moonlight's) and ERNIE-4.5 without a selection
bias: a tiny random model is made with transformers, imported (``moetrain import``) and
exported (``moetrain convert``), then served by vLLM offline (``vllm.LLM``, one process per
case) and, for Mixtral, by its OpenAI-compatible server over HTTP. vLLM's greedy tokens must be
transformers' greedy tokens on the same export (fp32). Qwen3-Next, whose Gated DeltaNet vLLM's
CPU build runs in bf16 only, is compared in bf16 by log-probabilities on vLLM's tokens
(:func:`function_disagreements`), with a negative control; so is Gemma 4 with tied embeddings in
fp32, whose tiny model repeats one token.

A case that vLLM does not serve is listed in :data:`REFUSED` with vLLM's error, one that it
serves with other tokens in :data:`MISCOMPUTED` with the reason: its test checks that vLLM still
fails that way and reports it as xfailed with the reason, and fails once vLLM serves it right
(then take the case out of the list and out of docs/HUGGING-FACE.md's table). The CPU rotary kernel's
mistake behind two of them (LFM2-MoE, DeepSeek with plain RoPE) is checked on the op itself,
and both are served with transformers' tokens when vLLM takes its PyTorch RoPE instead.

The tiny models are wider than the other tests' (hidden 128, head_dim 32: vLLM's CPU attention
has no head size under 32) and drawn with a larger initializer range so that greedy decoding
walks through many tokens with clear margins. DeepSeek's latent attention takes vLLM's CPU MLA
backend, whose decode kernel has one shape: kv_lora_rank 512 and qk_rope_head_dim 64 (the
sparse-attention and Kimi Linear cases take it too). The dense hybrid sources are exported
upcycled where a MoE class holds them (Qwen3.5, as Qwen3.5-MoE); Olmo-Hybrid's is not exported.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetrain.cli import main as moetrain_cli
from moetrain.convert.families import FORMATS
from tests.helpers.hf_flags import DEEPSEEK_YARN, PHIMOE_ROPE
from tests.helpers.hf_models import SMALL, save_hf_model, save_hf_tokenizer
from tests.helpers.launch import ROOT
from tests.helpers.ports import free_port

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.serving

SERVING_VENV = ROOT / ".venv-serving"
SERVING_PY = SERVING_VENV / "bin" / "python"
GREEDY = ROOT / "tests" / "helpers" / "vllm_greedy.py"
ROTARY_PROBE = ROOT / "tests" / "helpers" / "vllm_rotary_probe.py"
PROMPT = "def f(x):\n    return x"
NEW_TOKENS = 16
VLLM_TIMEOUT = 420  # seconds for one vLLM process: start (imports, engine, worker) and generate

WIDE = dict(hidden_size=128, head_dim=32, initializer_range=0.3)
WIDE_ROPE = SMALL["rope_parameters"]
# DeepSeek's latent attention at the one shape of vLLM's CPU MLA decode kernel, with YaRN as
# DeepSeek-V2 / V3 are released (DEEPSEEK_YARN)
MLA = dict(
    WIDE,
    head_dim=64,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=32,
    qk_head_dim=96,
    v_head_dim=32,
    rope_parameters=dict(DEEPSEEK_YARN),
)
# LongRoPE's factor lists have head_dim / 2 entries
PHIMOE_WIDE_ROPE = dict(
    PHIMOE_ROPE,
    short_factor=[1.0 + 0.01 * i for i in range(16)],
    long_factor=[1.0 + 0.02 * i for i in range(16)],
)

MIMO_SERVED = dict(WIDE, v_head_dim=32, routed_scaling_factor=None)
# vLLM's PyTorch RoPE instead of its CPU kernel, which rotates a [tokens, heads, head_dim] query
# or key wrongly (it takes each head's row for a token of one head: docs/HUGGING-FACE.md)
TORCH_ROPE = {"custom_ops": ["-rotary_embedding"]}
# Gemma 4 with global heads of 64, twice the sliding ones' as released (vLLM's CPU attention has
# no head size under 32: the tiny model's 16 is refused), the released final soft cap of 30
GEMMA4_SERVED = dict(
    WIDE,
    per_layer_config={2: {"head_dim": 64, "num_key_value_heads": 1}},
    final_logit_softcapping=30.0,
)


@dataclass(frozen=True)
class Case:
    source: str  # the transformers family the model is made in
    fields: dict[str, Any]  # its config's changes from the tiny model's
    overrides: tuple[str, ...] = ()  # `moetrain import` settings
    zero_selection_bias: bool = False  # e_score_correction_bias set to zeros
    random_prompt: int = 0  # > 0: a prompt of that many random token ids instead of PROMPT
    max_model_len: int = 64  # vLLM's context (the tiny models' max_position_embeddings)
    compilation_config: dict[str, Any] | None = None  # vLLM's (``LLM(compilation_config=)``)


CASES: dict[str, Case] = {
    **{fmt: Case(fmt, WIDE) for fmt in FORMATS},
    "deepseek_v2": Case("deepseek_v2", MLA),
    "deepseek_v3": Case("deepseek_v3", MLA),
    # plain RoPE, as Moonlight-16B-A3B is released
    "deepseek_v3-plain-rope": Case("deepseek_v3", dict(MLA, rope_parameters=WIDE_ROPE)),
    # the same with vLLM's PyTorch RoPE (the CPU kernel rotates latent attention's per-head
    # rotary query wrongly: deepseek_v3-plain-rope in MISCOMPUTED)
    "deepseek_v3-plain-rope-torch-rope": Case(
        "deepseek_v3", dict(MLA, rope_parameters=WIDE_ROPE), compilation_config=TORCH_ROPE
    ),
    # rotary halves instead of adjacent pairs (moetrain's model.rope_interleave: false)
    "deepseek_v3-rope-halves": Case("deepseek_v3", dict(MLA, rope_interleave=False)),
    "ernie4_5_moe-no-selection-bias": Case("ernie4_5_moe", WIDE, zero_selection_bias=True),
    # vLLM's CPU kernel for gpt-oss's clamped SwiGLU takes expert hidden sizes in multiples of
    # 32 (it pads the others' but not this one's); the released 2880 is one
    "gpt_oss": Case("gpt_oss", dict(WIDE, intermediate_size=32)),
    # the muP scalars (residual branches x 0.22, logits / 6) flatten a model drawn at 0.3
    "granitemoe": Case("granitemoe", dict(WIDE, initializer_range=2.0)),
    "granitemoeshared": Case("granitemoeshared", dict(WIDE, initializer_range=2.0)),
    "phimoe": Case("phimoe", dict(WIDE, rope_parameters=PHIMOE_WIDE_ROPE)),
    # vLLM's chunked attention takes chunks of whole KV-cache blocks (128 positions on the CPU):
    # a prompt long enough that the generated tokens start a new chunk; top-1 as released (vLLM
    # weights an expert's input only at top-1)
    "llama4_text": Case(
        "llama4_text",
        dict(WIDE, attention_chunk_size=128, max_position_embeddings=256, num_experts_per_tok=1),
        random_prompt=150,
        max_model_len=256,
    ),
    "qwen2-upcycled": Case("qwen2", WIDE, ("moe.num_experts=4", "moe.top_k=2")),
    # DeepSeek sparse attention on latent attention at the CPU MLA kernel's shape, its indexer's
    # head dim as released (it rotates qk_rope_head_dim of them); 4 keys per query, so sparse
    "deepseek_v32": Case("deepseek_v32", dict(MLA, index_head_dim=128)),
    "glm_moe_dsa": Case("glm_moe_dsa", dict(MLA, index_head_dim=128)),
    # Kimi Linear's latent attention layers (no RoPE) at the CPU MLA kernel's shape
    "kimi_linear": Case("kimi_linear", {k: v for k, v in MLA.items() if k != "rope_parameters"}),
    # Mamba-2's heads fill its inner width (mamba_expand x hidden = 8 x 32)
    "granitemoehybrid": Case(
        "granitemoehybrid", dict(WIDE, initializer_range=2.0, mamba_n_heads=8, mamba_d_head=32)
    ),
    # value heads as wide as the query/key heads, which vLLM's CPU attention takes (narrower
    # ones take a Triton backend), the routing unscaled as released, a window longer than the
    # 24 positions decoded; then with the tiny model's window of 6 and its routing scale
    "mimo_v2_flash-same-v-head-dim": Case("mimo_v2_flash", dict(MIMO_SERVED, sliding_window=40)),
    "mimo_v2_flash-window-binds": Case("mimo_v2_flash", MIMO_SERVED),
    "mimo_v2_flash-route-scale": Case(
        "mimo_v2_flash", dict(MIMO_SERVED, sliding_window=40, routed_scaling_factor=2.5)
    ),
    # LongCat-Flash's latent attention at the CPU MLA kernel's shape (it rotates head_dim =
    # qk_rope_head_dim channels)
    "longcat_flash": Case("longcat_flash", MLA),
    # LFM2-MoE with vLLM's PyTorch RoPE: its attention hands the rotary op per-head queries and
    # keys after their RMSNorm, which the CPU kernel rotates wrongly (lfm2_moe in MISCOMPUTED)
    "lfm2_moe-torch-rope": Case("lfm2_moe", WIDE, compilation_config=TORCH_ROPE),
    # untied embeddings: tied as released, the tiny model repeats the prompt's last token
    # (compared by its function instead: FUNCTION_CASES)
    "gemma4_text-untied": Case("gemma4_text", dict(GEMMA4_SERVED, tie_word_embeddings=False)),
    # an upcycled Qwen3.5 (dense): Qwen3.5-MoE without a shared expert
    "qwen3_5_text-upcycled": Case("qwen3_5_text", WIDE, ("moe.num_experts=4", "moe.top_k=2")),
}

# case -> the error vLLM gives for its export (a substring of it): vLLM does not serve them
REFUSED: dict[str, str] = {
    # transformers' Qwen2-MoE always has a shared expert, so the export holds one of hidden
    # size 0 (zero-element tensors, as shared_expert_intermediate_size: 0 says); vLLM builds
    # none at size 0 and refuses the file's tensors for it
    "qwen2-upcycled": "There is no module or parameter named 'model.layers.0.mlp.shared_expert' "
    "in Qwen2MoeForCausalLM",
    # Gated DeltaNet's CPU kernels (conv, gating, chunked rule) take bf16 only
    "qwen3_next": "AssertionError: CPU GDN attention requires BF16.",
    # vLLM's Qwen3.5 module imports its vision model, which needs torchvision: the venv has none
    # (the torchvision releases vLLM's CPU build pulls are CUDA builds, which do not import on
    # the CPU torch)
    "qwen3_5_moe_text": "No module named 'torchvision'",
    "qwen3_5_text-upcycled": "No module named 'torchvision'",
    # vLLM's CPU MoE router takes a softmax router unless it is grouped: MiniMax-M2's sigmoid
    # router with its selection bias is neither
    "minimax_m2": 'assert self.scoring_func == "softmax"',
    # vLLM sets Kimi Linear's recurrent cache to prefix-cache blocks, then its CPU platform turns
    # prefix caching off for latent attention, and the two settings are refused together (its
    # Kimi Delta Attention kernels are Triton's, which the CPU build has not either)
    "kimi_linear": "--mamba-block-size can only be set with --enable-prefix-caching",
    # no CPU backend of DeepSeek sparse attention (its indexer and sparse MLA)
    "deepseek_v32": "NotImplementedError: Sparse Attention is not supported on CPU.",
    "glm_moe_dsa": "NotImplementedError: Sparse Attention is not supported on CPU.",
    # Nemotron 3's squared-ReLU experts (as released): vLLM's CPU MoE takes gated experts only
    "nemotron_h": "is_act_and_mul=False is supported only for CUDA, XPU and ROCm for now",
    # the tiny Gemma 4's global layers have heads of 16 (vLLM's CPU attention takes 32 or more;
    # at 64 it serves the model: gemma4_text-untied, gemma4_text-tied)
    "gemma4_text": "Unsupported CPU attention configuration: head_dim=16",
    # value heads narrower than the query/key heads (as released: 128 and 192) take vLLM's
    # Triton attention backend for them, which the CPU build does not run
    "mimo_v2_flash": "module 'triton' has no attribute 'next_power_of_2'",
    # vLLM's LongCat-Flash router calls the CUDA top-k softmax op (its zero experts' routing),
    # which the CPU build does not register
    "longcat_flash": "'_moe_C' object has no attribute 'topk_softmax'",
    # vLLM's transformers (< 5.20) has no bailing_hybrid config: vLLM reads Ling 3.0's released
    # directories through their own configuration module (trust_remote_code), which an export
    # does not carry (its Kimi Delta Attention kernels are Triton's too)
    "bailing_hybrid": "has model type `bailing_hybrid` but Transformers does not recognize",
}
# case -> why vLLM's CPU build serves it with other tokens than transformers (and moetrain)
MISCOMPUTED: dict[str, str] = {
    "ernie4_5_moe": "vLLM's CPU router ignores the selection bias (moe_statics."
    "e_score_correction_bias) of a softmax router that is not grouped: it picks the top-k of "
    "the softmax alone (its GPU router adds the bias)",
    "lfm2_moe": "vLLM's CPU rotary kernel, which plain RoPE takes, rotates LFM2-MoE's "
    "[tokens, heads, head_dim] queries and keys (per-head, after their RMSNorm) wrongly: it "
    "rotates the first `tokens` head rows, by positions 0, 1, 2 ... in row order, and leaves "
    "the others unrotated; with vLLM's PyTorch RoPE (lfm2_moe-torch-rope) the tokens are "
    "transformers'",
    "deepseek_v3-rope-halves": "vLLM's DeepSeek model reads no rope_interleave: it always "
    "rotates adjacent pairs, as the released models do",
    "mimo_v2_flash-window-binds": "vLLM's MiMo-V2-Flash attends sliding_window_size "
    "positions with the query's own, one fewer than transformers (sliding_window_size "
    "earlier positions and the query's, as the reference implementation does)",
    "mimo_v2_flash-route-scale": "vLLM's MiMo-V2-Flash ignores routed_scaling_factor (released "
    "null: 1)",
    "deepseek_v3-plain-rope": "vLLM's CPU rotary kernel, which plain RoPE takes (YaRN takes a "
    "PyTorch path), rotates a [tokens, heads, dim] query wrongly: latent attention's "
    "per-head rotary query (with vLLM's PyTorch RoPE, deepseek_v3-plain-rope-torch-rope, the "
    "tokens are transformers')",
}


@pytest.fixture(scope="module")
def serving_python() -> Path:
    if not SERVING_PY.is_file():
        pytest.skip(
            f"{SERVING_VENV.relative_to(ROOT)} is missing: create it with "
            "`bash launch/serving-venv.sh` (vLLM's CPU build)"
        )
    return SERVING_PY


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    texts = ["def f(x):\n    return x + 1  # the cat sat on the mat", "über 42, tokens"] * 20
    return save_hf_tokenizer(texts, 320, tmp_path_factory.mktemp("tok"))


def export(c: Case, tokenizer: Path, root: Path) -> Path:
    """The case's tiny model made with transformers, imported and exported by the CLI."""
    src = save_hf_model(c.source, root / "src", tokenizer=tokenizer, overrides=c.fields)
    if c.zero_selection_bias:
        model = transformers.AutoModelForCausalLM.from_pretrained(src)
        with torch.no_grad():
            for name, t in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith("e_score_correction_bias"):
                    t.zero_()
        model.save_pretrained(src)
    assert moetrain_cli(["import", str(src), str(root / "ckpt"), *c.overrides]) == 0
    assert moetrain_cli(["convert", str(root / "ckpt"), str(root / "hf")]) == 0
    return root / "hf"


def transformers_greedy(path: Path, ids: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of ``ids`` (fp32, the whole sequence each step, EOS
    ignored) and the margin of each chosen token over the runner-up."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seq, margins = list(ids), []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
            top = torch.topk(logits, 2)
            seq.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
    return seq[len(ids) :], margins


def prompt_ids(path: Path, random_tokens: int = 0) -> list[int]:
    """PROMPT's ids, or ``random_tokens`` token ids drawn from the vocabulary (seeded)."""
    if random_tokens:
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        gen = torch.Generator().manual_seed(0)
        return torch.randint(vocab, (random_tokens,), generator=gen).tolist()
    return transformers.AutoTokenizer.from_pretrained(path)(PROMPT).input_ids


def vllm_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        PATH=f"{SERVING_VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB: the tiny models need a few MiB
        VLLM_NO_USAGE_STATS="1",
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    return env


# wrappers around the root cause that vLLM prints after it
_WRAPPERS = (
    "Engine core initialization failed",
    "Worker failed with error",
    "EngineCore enc",
    "returned non-zero exit status",  # the model class inspected in a subprocess
    "Error raised in subprocess",
)
_ERROR = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.+)$")
_VALIDATION = re.compile(r"\d+ validation errors? for \w+$")  # pydantic's: the reason follows
# an exception without a message (a bare ``assert``), the frame lines above it and the prefix
# of a worker's lines
_RANK = re.compile(r"^\[rank\d+\]:")
_BARE_ERROR = re.compile(r"^(?:\[rank\d+\]:)?\s*([A-Z]\w*(?:Error|Exception))\s*$")
_FRAME = re.compile(r'File ".*?([\w.]+\.py)", line (\d+)')


def root_cause(output: str) -> str:
    """The first exception line of vLLM's output that is not one of its wrappers; for an
    exception without a message, its type, the statement that raised it and where."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        m = _ERROR.search(line)
        if m and not any(w in m.group(2) for w in _WRAPPERS):
            message = m.group(2).strip()
            if _VALIDATION.search(message) and i + 1 < len(lines):
                message += ": " + lines[i + 1].strip().split(" [type=")[0]
            return f"{m.group(1)}: {message}"
        bare = _BARE_ERROR.match(line)
        frames = [j for j in range(i) if _FRAME.search(lines[j])] if bare else []
        if frames:
            where = _FRAME.search(lines[frames[-1]])
            statement = _RANK.sub("", lines[frames[-1] + 1]).strip()
            return f"{bare.group(1)}: {statement} ({where.group(1)}:{where.group(2)})"
    return output[-2000:]


def vllm_greedy(
    python: Path,
    path: Path,
    ids: list[int],
    max_model_len: int,
    dtype: str = "float32",
    top: int = 0,
    compilation_config: dict[str, Any] | None = None,
) -> tuple[list[int] | None, list[dict[int, float]], str]:
    """vLLM's greedy tokens (offline) in ``dtype``, with ``top`` > 0 the log-probabilities of
    the chosen and the ``top`` most likely tokens at each step; or None and the root cause of
    its failure."""
    prompt = ",".join(map(str, ids))
    args = [str(python), str(GREEDY), str(path), str(NEW_TOKENS), prompt, str(max_model_len)]
    args += [dtype, str(top)]
    if compilation_config is not None:
        args.append(json.dumps(compilation_config))
    r = subprocess.run(
        args,
        # vLLM's engine and worker in this one process (by default it starts two more, as the
        # server test below does): half the start time, the same tokens
        env={**vllm_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        cwd=path.parent,
        capture_output=True,
        text=True,
        timeout=VLLM_TIMEOUT,
    )
    found = {
        key: json.loads(value)
        for key, _, value in (line.partition(" ") for line in r.stdout.splitlines())
        if key in ("GREEDY", "LOGPROBS")
    }
    if "GREEDY" not in found:
        return None, [], root_cause(r.stdout + r.stderr)
    steps = [{int(t): p for t, p in step.items()} for step in found.get("LOGPROBS", [])]
    return found["GREEDY"], steps, ""


def same_tokens(got: list[int], want: list[int], margins: list[float]) -> None:
    if got != want:
        i = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
        raise AssertionError(
            f"vLLM {got} != transformers {want}: first at {i}, where transformers' top token "
            f"leads the next by {margins[i]:.3g}"
        )


@pytest.mark.parametrize("case", sorted(CASES))
def test_vllm_serves_the_export_with_transformers_greedy_tokens(
    case: str, serving_python: Path, tokenizer: Path, tmp_path: Path
) -> None:
    c = CASES[case]
    hf = export(c, tokenizer, tmp_path)
    written = json.loads((hf / "config.json").read_text())
    if case == "qwen2-upcycled":  # an upcycled Qwen2: Qwen2-MoE without a shared expert
        assert written["model_type"] == "qwen2_moe"
        assert written["shared_expert_intermediate_size"] == 0
    ids = prompt_ids(hf, c.random_prompt)
    got, _, error = vllm_greedy(
        serving_python, hf, ids, c.max_model_len, compilation_config=c.compilation_config
    )
    # a known failure shows as xfailed with its reason once it is checked to be that failure
    if case in REFUSED:
        assert got is None, f"vLLM now serves {case}: take it out of REFUSED and the docs"
        assert REFUSED[case] in error, error
        pytest.xfail(f"vLLM refuses the export: {error}")
    want, margins = transformers_greedy(hf, ids)
    assert len(set(want)) > 3, want  # a walk through the vocabulary, not one repeated token
    assert got is not None, f"vLLM failed on the {written['architectures'][0]} export: {error}"
    if case in MISCOMPUTED:
        assert got != want, f"vLLM now computes {case}: take it out of MISCOMPUTED and the docs"
        pytest.xfail(f"vLLM's tokens {got} are not transformers' {want}: {MISCOMPUTED[case]}")
    same_tokens(got, want, margins)


def test_vllm_cpu_rotary_kernel_takes_each_head_for_a_token(
    serving_python: Path, tmp_path: Path
) -> None:
    """The cause of lfm2_moe's and deepseek_v3-plain-rope's other tokens (MISCOMPUTED), on the
    op itself: vLLM's CPU rotary kernel rotates ``[tokens, heads * head_dim]`` right, and a
    ``[tokens, heads, head_dim]`` query or key as rows of one head each, the first ``tokens``
    rows by positions 0, 1, 2 ... (tests/helpers/vllm_rotary_probe.py)."""
    r = subprocess.run(
        [str(serving_python), str(ROTARY_PROBE)],
        env=vllm_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=VLLM_TIMEOUT,
    )
    line = next((x for x in r.stdout.splitlines() if x.startswith("ROTARY ")), "")
    assert line, root_cause(r.stdout + r.stderr)
    gaps = json.loads(line.partition(" ")[2])
    assert gaps["flat"] < 1e-5, gaps
    assert gaps["per_head"] > 0.1, (
        f"vLLM's CPU rotary kernel now rotates per-head queries right ({gaps}): serve "
        "lfm2_moe and deepseek_v3-plain-rope without TORCH_ROPE, take them out of MISCOMPUTED "
        "and the docs"
    )
    assert gaps["rows_as_tokens"] < 1e-5, gaps


# Where greedy tokens cannot be compared, vLLM's decoding is checked against transformers'
# function on vLLM's own tokens, teacher forced: at each generated position the
# log-probabilities of vLLM's chosen and TOP most likely tokens within the case's tolerance of
# transformers', and vLLM's token within it of transformers' top one. Gated DeltaNet's CPU
# kernels take bf16 only (and linear head dims of 128, as released): Qwen3-Next is compared in
# bf16, against transformers' bf16 function (the same weights rounded as vLLM's), so that a near
# tie that the rounding flips does not shift every later step. Gemma 4 with tied embeddings (as
# released) repeats the prompt's last token (its scaled embedding dominates the residual
# stream; untied, the greedy case gemma4_text-untied): compared in fp32.
TOP = 5


@dataclass(frozen=True)
class FunctionCase:
    case: Case
    dtype: str  # vLLM's and transformers'
    tol: float  # nats
    wrong_weight: str  # the negative control: this tensor changed in the export vLLM serves
    wrong: Callable[[torch.Tensor], torch.Tensor]  # the change


FUNCTION_CASES: dict[str, FunctionCase] = {
    # measured 0.15 nats (the first Gated DeltaNet layer's decay doubled: 7; docs/HUGGING-FACE.md)
    "qwen3_next-bf16": FunctionCase(
        Case("qwen3_next", dict(WIDE, linear_key_head_dim=128, linear_value_head_dim=128)),
        "bfloat16",
        0.3,
        "model.layers.0.linear_attn.A_log",
        lambda t: t + math.log(2.0),
    ),
    # measured 6e-6 nats (the global layer's router scale doubled: docs/HUGGING-FACE.md)
    "gemma4_text-tied": FunctionCase(
        Case("gemma4_text", GEMMA4_SERVED),
        "float32",
        1e-3,
        "model.layers.2.router.scale",
        lambda t: 2.0 * t,
    ),
}


def function_disagreements(
    path: Path, fc: FunctionCase, ids: list[int], got: list[int], logprobs: list[dict[int, float]]
) -> tuple[list[str], float]:
    """Where vLLM's decoding ``got`` / ``logprobs`` leaves transformers' function (in
    ``fc.dtype``) beyond ``fc.tol``: a log-probability off by more, or a chosen token that
    transformers' top token leads by more; and the largest log-probability gap."""
    dtype = getattr(torch, fc.dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + got])).logits[0]
    ref = torch.log_softmax(logits[len(ids) - 1 : -1].double(), dim=-1)
    problems, worst = [], 0.0
    for i, (token, step) in enumerate(zip(got, logprobs, strict=True)):
        for t, lp in step.items():
            gap = abs(lp - float(ref[i, t]))
            worst = max(worst, gap)
            if gap > fc.tol:
                problems.append(f"step {i}: token {t} vLLM {lp:.6f}, transformers {ref[i, t]:.6f}")
        lead = float(ref[i].max() - ref[i, token])
        if lead > fc.tol:
            problems.append(
                f"step {i}: vLLM chose {token}, transformers' top leads it by {lead:.3g}"
            )
    return problems, worst


@pytest.mark.parametrize("wrong_weight", [False, True], ids=["export", "wrong-weight"])
@pytest.mark.parametrize("case", sorted(FUNCTION_CASES))
def test_vllm_serves_the_export_with_transformers_function(
    case: str, wrong_weight: bool, serving_python: Path, tokenizer: Path, tmp_path: Path
) -> None:
    """vLLM's log-probabilities on its own tokens against transformers' on the same export;
    the check catches an export with one wrong weight."""
    fc = FUNCTION_CASES[case]
    hf = export(fc.case, tokenizer, tmp_path)
    served = hf
    if wrong_weight:
        served = tmp_path / "wrong"
        shutil.copytree(hf, served)
        tensors = load_file(served / "model.safetensors")
        tensors[fc.wrong_weight] = fc.wrong(tensors[fc.wrong_weight])
        save_file(tensors, str(served / "model.safetensors"), metadata={"format": "pt"})
    ids = prompt_ids(hf)
    got, logprobs, error = vllm_greedy(serving_python, served, ids, 64, fc.dtype, TOP)
    assert got is not None, f"vLLM failed on the {case} export: {error}"
    problems, worst = function_disagreements(hf, fc, ids, got, logprobs)
    print(f"largest log-probability gap {worst:.3g} nats")
    if wrong_weight:
        assert problems, f"a changed {fc.wrong_weight} stays within the tolerance: {worst:.3g}"
    else:
        assert not problems, "\n".join(problems)


def _request(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def _wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    end = time.monotonic() + VLLM_TIMEOUT
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(
                f"the server exited ({proc.returncode}): {root_cause(log.read_text())}"
            )
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    raise AssertionError(f"the server did not start in {VLLM_TIMEOUT}s: {log.read_text()[-3000:]}")


def test_openai_server_serves_an_export(serving_python: Path, tokenizer: Path, tmp_path) -> None:
    """`python -m vllm.entrypoints.openai.api_server --model EXPORT`, as the README shows; a
    text prompt, so the exported tokenizer is vLLM's too."""
    hf = export(CASES["mixtral"], tokenizer, tmp_path)
    ids = prompt_ids(hf)
    want, margins = transformers_greedy(hf, ids)
    port, log = free_port(), tmp_path / "server.log"
    cmd = [
        str(serving_python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(hf),
        "--served-model-name",
        "tiny-mixtral",
        "--dtype",
        "float32",
        "--max-model-len",
        "64",
        "--enforce-eager",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            env=vllm_env(),
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its engine and worker processes go with it
        )
    try:
        _wait_ready(proc, url, log)
        models = _request(f"{url}/v1/models")
        assert [m["id"] for m in models["data"]] == ["tiny-mixtral"]
        body = {
            "model": "tiny-mixtral",
            "prompt": PROMPT,
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        (choice,) = _request(f"{url}/v1/completions", body)["choices"]
        assert choice["prompt_token_ids"] == ids
        same_tokens(choice["token_ids"], want, margins)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
