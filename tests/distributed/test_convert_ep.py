"""Proof for every supported format: a tiny model trained by the real trainer with EP=2 on two
ranks (torchrun, gloo), converted; transformers loads it, its logits equal moetrain's to 1e-4
(fp32) on a batch of text, and greedy generation gives the same tokens. The DeepSeek-V3 run
trains a multi-token-prediction module, exported after the decoder layers. One Mixtral run trains
in bf16: its checkpoint holds the fp32 master weights, which the conversion exports (or rounds
to the requested ``--dtype``). DeepSeek-V3.2 trains sparse attention with an MTP module, GLM-5's
indexers (one layer sharing another's selection) train in bf16."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moetrain.checkpoint.read import load_model
from moetrain.convert.export import convert_checkpoint
from moetrain.convert.hf_files import HFWeights
from moetrain.generate import generate_ids, generate_text
from tests.helpers.corpus import prepare_stdlib_config

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
CONFIG = {  # on the tiny model
    "seed": 5,
    "model.vocab_size": 384,
    "model.n_layers": 3,
    "moe.expert_hidden": 32,
    "data.source_format": "text",
    "data.seq_len": 32,
    "data.num_proc": 1,
    "data.val_fraction": 0.05,
    "parallel.ep_size": 2,
    "parallel.zero_stage": 2,
    "optim.lr": 1.0e-2,
    "optim.warmup_steps": 1,
    "train.max_steps": 2,
    "train.micro_batch_size": 2,
    "train.eval_every": 0,
    "train.log_every": 1,
    "checkpoint.save_every_steps": 2,
}
# latent attention (with the query LoRA) and sparse attention's indexer at the tiny size
MLA = [
    "model.attention=mla",
    "model.n_kv_heads=4",
    "model.q_lora_rank=16",
    "model.kv_lora_rank=16",
    "model.qk_nope_head_dim=8",
    "model.qk_rope_head_dim=8",
    "model.v_head_dim=8",
    "model.rope_interleave=true",
]
DSA = ["model.index_topk=8", "model.index_n_heads=8", "model.index_head_dim=16"]
FORMATS = {
    "mixtral": [],
    "qwen2_moe": ["moe.first_k_dense=1", "moe.num_shared_experts=1", "moe.shared_expert_gate=true"],
    "qwen3_moe": ["model.qk_norm=true", "moe.moe_every=2", "moe.renormalize=false"],
    "glm4_moe": [
        "model.qk_norm=true",
        "moe.score_func=sigmoid",
        "moe.num_shared_experts=1",
        "moe.first_k_dense=1",
        "moe.bias_update_rate=0.05",
        "moe.route_scale=2.0",
    ],
    "deepseek_v3": [
        "model.attention=mla",
        "model.n_kv_heads=4",
        "model.q_lora_rank=16",
        "model.kv_lora_rank=16",
        "model.qk_nope_head_dim=8",
        "model.qk_rope_head_dim=8",
        "model.v_head_dim=8",
        "model.rope_interleave=true",
        "model.rope_scaling=yarn",
        "model.rope_factor=2.0",
        "model.rope_original_max_seq_len=32",
        "moe.num_experts=8",
        "moe.n_group=4",
        "moe.topk_group=2",
        "moe.score_func=sigmoid",
        "moe.num_shared_experts=1",
        "moe.first_k_dense=1",
        "moe.bias_update_rate=0.05",
        "moe.route_scale=2.5",
        "model.mtp_depth=1",  # trained with an MTP module, exported in the released layout
        "train.max_steps=3",  # two steps move this bias there and back to zero
        "checkpoint.save_every_steps=3",
    ],
    "deepseek_v32": [  # DeepSeek sparse attention: 8 of up to 48 keys, an MTP module
        *MLA,
        "model.rope_scaling=yarn",
        "model.rope_factor=2.0",
        "model.rope_original_max_seq_len=32",
        *DSA,
        "moe.num_experts=8",
        "moe.n_group=4",
        "moe.topk_group=2",
        "moe.score_func=sigmoid",
        "moe.num_shared_experts=1",
        "moe.first_k_dense=1",
        "moe.bias_update_rate=0.05",
        "moe.route_scale=2.5",
        "model.mtp_depth=1",
        "train.max_steps=3",
        "checkpoint.save_every_steps=3",
    ],
    "glm_moe_dsa_bf16": [  # GLM-5's indexer (pairs, a shared layer), trained in bf16
        *MLA,
        *DSA,
        "model.index_rope_interleave=true",
        "model.indexer_types=[full,shared,full]",
        "moe.num_experts=8",
        "moe.score_func=sigmoid",
        "moe.num_shared_experts=1",
        "moe.first_k_dense=1",
        "moe.route_scale=2.5",
        "train.precision=bf16",
    ],
    "phimoe": [  # Phi-3.5-MoE's pieces: LayerNorm, every bias, sparsemixer, LongRoPE
        "model.norm=layernorm",
        "model.qkv_bias=true",
        "model.o_bias=true",
        "model.lm_head_bias=true",
        "moe.router_type=sparsemixer",
        "moe.renormalize=false",
        "model.rope_scaling=longrope",
        "model.rope_original_max_seq_len=64",
        "model.rope_short_factor=[1.0,1.5,2.0,4.0]",
        "model.rope_long_factor=[2.0,3.0,4.0,8.0]",
        "model.rope_attention_factor=1.25",
        "model.rope_long_regime=short",
    ],
    "ernie4_5_moe": [  # ERNIE-4.5's pieces: interleaved pairs, selection bias, tied embeddings
        "model.rope_interleave=true",
        "model.tie_embeddings=true",
        "moe.first_k_dense=1",
        "moe.num_shared_experts=2",
        "moe.bias_update_rate=0.05",
        "moe.renormalize_min=1e-12",
        "train.max_steps=3",  # two steps move the selection bias there and back to zero
        "checkpoint.save_every_steps=3",
    ],
    "granitemoe": [  # Granite's muP-style scalars, top-k then softmax, q/k/v/o biases
        "model.tie_embeddings=true",
        "model.embedding_multiplier=12.0",
        "model.residual_multiplier=0.22",
        "model.attention_scale=0.015625",
        "model.logits_scaling=6.0",
        "model.qkv_bias=true",
        "model.o_bias=true",
        "moe.topk_before_score=true",
    ],
    "gpt_oss": [  # gpt-oss's pieces, the window binding at this sequence length
        "model.qkv_bias=true",
        "model.o_bias=true",
        "model.attention_sinks=true",
        "model.sliding_window=8",
        "model.layer_types=[sliding_attention,full_attention,sliding_attention]",
        "model.rope_scaling=yarn",
        "model.rope_factor=4.0",
        "model.rope_original_max_seq_len=64",
        "model.rope_truncate=false",
        "moe.topk_before_score=true",
        "moe.router_bias=true",
        "moe.expert_biases=true",
        "moe.activation=clamped_swiglu",
        "moe.swiglu_alpha=1.702",
        "moe.swiglu_limit=7.0",
    ],
    "llama4_text": [  # Llama 4's pieces, chunks and temperature binding at this length
        "model.rope_interleave=true",
        "model.attention_chunk_size=8",
        "model.layer_types=[chunked_attention,chunked_attention,full_attention]",
        "model.nope_layers=[2]",
        "model.qk_norm_after_rope=true",
        "model.attn_temperature_floor=8",
        "model.attn_temperature_scale=0.5",
        "model.rope_scaling=llama3",
        "model.rope_factor=16.0",
        "model.rope_original_max_seq_len=16",
        "model.rope_low_freq_factor=1.0",
        "model.rope_high_freq_factor=1.0",
        "moe.score_func=sigmoid",
        "moe.topk_before_score=true",
        "moe.renormalize=false",
        "moe.score_on_input=true",
        "moe.top_k=1",
        "moe.num_shared_experts=1",
        "moe.moe_every=2",
    ],
    "mixtral_bf16": ["train.precision=bf16"],
}
ARCH = {
    "mixtral": "MixtralForCausalLM",
    "mixtral_bf16": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm_moe_dsa_bf16": "GlmMoeDsaForCausalLM",
    "phimoe": "PhiMoEForCausalLM",  # the released config.json's name (transformers: Phimoe)
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
}


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(PY).parent}:{env.get('PATH', '')}"
    return env


# the default suite's share (the other formats with -m long)
QUICK = ("mixtral", "deepseek_v3", "mixtral_bf16")
CASES = [f if f in QUICK else pytest.param(f, marks=pytest.mark.long) for f in FORMATS]


@pytest.fixture(scope="module")
def trained(request, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """One 2-step EP=2 training run per format the session's selected tests use, all launched
    at once; -> (checkpoint, corpus)."""
    # this module's tests that run (the -m long cases, skipped in the default suite, stay in
    # session.items, and other modules have parameters named fmt too)
    running = [
        it
        for it in request.session.items
        if getattr(it, "module", None) is request.module and it.get_closest_marker("skip") is None
    ]
    selected = {
        item.callspec.params["fmt"]
        for item in running
        if "fmt" in getattr(getattr(item, "callspec", None), "params", {})
    }
    if any(item.name == "test_bf16_run_exports_its_fp32_masters" for item in running):
        selected.add("mixtral_bf16")
    work = tmp_path_factory.mktemp("convert_ep")
    cfg = prepare_stdlib_config(work, CONFIG, n_files=12, max_chars=150_000)
    corpus = work / "corpus.txt"
    torchrun = str(Path(PY).parent / "torchrun")
    procs = {}
    for fmt, overrides in FORMATS.items():
        if fmt not in selected:
            continue
        run_dir = work / f"run-{fmt}"
        cmd = [
            torchrun,
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "moetrain",
            "train",
            str(cfg),
            f"run_dir={run_dir}",
            *overrides,
        ]
        log = open(work / f"{fmt}.log", "w")  # noqa: SIM115
        procs[fmt] = (
            subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT),
            run_dir,
            log,
        )
    out = {}
    for fmt, (proc, run_dir, log) in procs.items():
        rc = proc.wait(timeout=600)
        log.close()
        text = (work / f"{fmt}.log").read_text()
        assert rc == 0, text[-4000:]
        (ckpt,) = (run_dir / "checkpoints").glob("step_*")
        out[fmt] = (ckpt, corpus)
    return out


@pytest.mark.parametrize("fmt", CASES)
def test_trained_ep2_checkpoint_converts_exactly(tmp_path, trained, fmt: str) -> None:
    ckpt, corpus = trained[fmt]
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["layout"]["world_size"] == 2 and state["layout"]["ep_size"] == 2
    model, cfg = load_model(ckpt)
    model.eval()
    if fmt in (
        "glm4_moe",
        "deepseek_v3",
        "deepseek_v32",
        "ernie4_5_moe",
    ):  # the bias moved: HF's selection bias is exercised
        assert any(m.router.expert_bias.abs().sum() > 0 for m in model.moe_layers())
    out = convert_checkpoint(ckpt, tmp_path / "hf", fmt="auto")
    assert json.loads((out / "config.json").read_text())["architectures"] == [ARCH[fmt]]
    metrics = (ckpt.parents[1] / "metrics.jsonl").read_text()
    if cfg.model.mtp_depth:  # trained with its loss; transformers skips the layer on load
        assert '"mtp_loss/depth1"' in metrics
        assert "model.layers.3.eh_proj.weight" in HFWeights(out).names()
    if cfg.model.index_topk:  # the indexers trained on their KL, measured against dense
        assert '"index/kl"' in metrics and '"index/layer0/recall"' in metrics
        assert "model.layers.0.self_attn.indexer.wq_b.weight" in HFWeights(out).names()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    text = corpus.read_text()
    batch = [text[i : i + 400] for i in (1000, 20_000, 60_000)]
    ids = torch.tensor([tok(t)["input_ids"][:48] for t in batch])
    with torch.no_grad():
        ref, got = hf(input_ids=ids).logits, model(ids).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    # greedy: transformers' generate == moetrain's KV-cache generation, from both directories
    prompt = "def __init__(self"
    prompt_ids = tok(prompt)["input_ids"]
    hf_new = hf.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=16)
    hf_new = hf_new[0, len(prompt_ids) :].tolist()
    assert generate_ids(model, prompt_ids, 16, temperature=0.0, eos_id=tok.eos_token_id) == hf_new
    text_ckpt = generate_text(ckpt, prompt, 16, temperature=0.0)
    assert text_ckpt == generate_text(out, prompt, 16, temperature=0.0)
    expected = hf_new[:-1] if hf_new and hf_new[-1] == tok.eos_token_id else hf_new
    assert tok.decode(prompt_ids + expected) == prompt + text_ckpt


def test_bf16_run_exports_its_fp32_masters(tmp_path, trained) -> None:
    """The bf16 run's checkpoint holds fp32 weights finer than bf16 (the masters, not the bf16
    module upcast); `--dtype fp32` exports them as they are, `--dtype bf16` rounds them."""
    from safetensors.torch import load_file

    from moetrain.checkpoint.read import iter_layer_states

    ckpt, _ = trained["mixtral_bf16"]
    model, cfg = load_model(ckpt)
    assert cfg.train.precision == "bf16"
    weights = dict(model.named_parameters())
    assert all(p.dtype == torch.float32 for p in weights.values())
    finer = sum(int((p != p.bfloat16().float()).sum()) for p in weights.values())
    assert finer > 0.5 * sum(p.numel() for p in weights.values())
    dense = next(iter_layer_states(ckpt, cfg))[1]
    fp32 = load_file(convert_checkpoint(ckpt, tmp_path / "fp32", fmt="auto") / "model.safetensors")
    bf16 = load_file(
        convert_checkpoint(ckpt, tmp_path / "bf16", fmt="auto", dtype="bf16") / "model.safetensors"
    )
    ours, theirs = dense["layers.0.attn.wq.weight"], "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(fp32[theirs], ours)
    assert bf16[theirs].dtype == torch.bfloat16 and torch.equal(bf16[theirs], ours.bfloat16())
