"""Continued pretraining and upcycling on 2 ranks, EP=2, ZeRO-2 (real runs, gloo):

- every MoE family (those of :data:`LONG` with -m long): the first step's
  cross-entropy equals transformers' on the same global batch (fp32, 1e-5 relative); after 3
  steps the converted model gives moetrain's logits in transformers (1e-4) and the same greedy
  tokens;
- a dense Llama and Qwen2 upcycled to 8 experts top-2: the first step's cross-entropy is the
  dense model's; training moves the experts apart and spreads the load;
- a restarted run resumes its own checkpoint instead of loading init_from again, and keeps the
  record of what the run started from.

The data is tokenized with the models' own tokenizer.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moetrain.checkpoint.read import load_model
from moetrain.config import read_config_data
from moetrain.convert.export import convert_checkpoint
from moetrain.data import build_loader
from moetrain.data.prepare import prepare
from moetrain.generate import generate_ids
from moetrain.init_from.source import resolve_config_data
from tests.distributed.init_from_jobs import train_runs
from tests.helpers.corpus import write_stdlib_corpus
from tests.helpers.distributed import run_distributed
from tests.helpers.hf_models import MOE_FAMILIES, save_hf_model, save_hf_tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

STEPS = 3
RUN = [
    "parallel.ep_size=2",
    "parallel.zero_stage=2",
    "parallel.timeout_minutes=3",
    "train.precision=fp32",
    f"train.max_steps={STEPS}",
    "train.micro_batch_size=2",
    "train.log_every=1",
    "train.eval_every=0",
    f"checkpoint.save_every_steps={STEPS}",
    "optim.lr=0.01",
    "optim.warmup_steps=1",
    "logging.wandb.mode=disabled",
    "data.seq_len=32",
]
UPCYCLE = {
    "llama": ["moe.num_experts=8", "moe.top_k=2"],
    "qwen2": [
        "moe.num_experts=8",
        "moe.top_k=2",
        "moe.num_shared_experts=1",
        "moe.shared_expert_gate=true",
    ],
}


# families whose runs are left to -m long (the default suite's time budget)
LONG = (
    *("qwen2_moe", "glm4_moe", "olmoe", "glm_moe_dsa", "deepseek_v2", "ernie4_5_moe"),
    *("granitemoe", "granitemoeshared", "qwen3_5_moe_text"),
    "llama4_text",
    "dots1",
    "minimax_m2",
    "hunyuan_v1_moe",
    "afmoe",
    "mimo_v2_flash",
    "gemma4_text",
    "lfm2_moe",
    "longcat_flash",
    "bailing_hybrid",
    "deepseek_v4",
)
FAMILY_CASES = [
    f if f not in LONG else pytest.param(f, marks=pytest.mark.long) for f in MOE_FAMILIES
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The default suite's runs: every MoE family but :data:`LONG`'s, the upcycled ones and the
    restart."""
    return train_families(tmp_path_factory, [f for f in MOE_FAMILIES if f not in LONG], True)


@pytest.fixture(scope="module")
def long_runs(tmp_path_factory) -> dict:
    return train_families(tmp_path_factory, list(LONG), False)


def train_families(tmp_path_factory, families: list[str], upcycle_and_restart: bool) -> dict:
    """Each family's run from its tiny Hugging Face model (and, with ``upcycle_and_restart``,
    the upcycled dense runs and a restarted Mixtral run), all in one 2-rank job."""
    upcycle = UPCYCLE if upcycle_and_restart else {}
    work = tmp_path_factory.mktemp("init_from")
    corpus = write_stdlib_corpus(work / "corpus.txt", n_files=8, max_chars=120_000)
    tok = save_hf_tokenizer([corpus.read_text()[:60_000]], 300, work / "tokenizer")
    data = [
        f"data.source={corpus}",
        "data.source_format=text",
        f"data.output_dir={work / 'data'}",
        f"data.tokenizer={tok}",
        "data.num_proc=1",
        "data.val_fraction=0",
    ]
    hf = {f: save_hf_model(f, work / f"hf-{f}", tokenizer=tok) for f in (*families, *upcycle)}
    overrides = {
        f: [f"checkpoint.init_from={hf[f]}", f"run_dir={work / f'run-{f}'}", *data, *RUN]
        for f in families
    }
    overrides |= {
        f: [f"checkpoint.init_from={hf[f]}", f"run_dir={work / f'run-{f}'}", *data, *RUN, *moe]
        for f, moe in upcycle.items()
    }
    cfgs = {f: resolve_config_data(read_config_data(None, o))[0] for f, o in overrides.items()}
    prepare(cfgs[families[0]])  # one shard set: every family has the same vocabulary size
    jobs = [overrides[f] for f in overrides]
    order = list(overrides)
    if upcycle_and_restart:
        jobs.append([*overrides["mixtral"], f"train.max_steps={STEPS + 1}"])
        order.append("restart")
    summaries = run_distributed(train_runs, 2, jobs, timeout=1200)[0]
    return {"hf": hf, "cfg": cfgs, "summary": dict(zip(order, summaries, strict=True))}


def metrics(run_dir: str) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "step" in r and "loss" in r]


def hf_first_step_ce(cfg, hf_dir: Path) -> float:
    """transformers' cross-entropy on the first global batch (each rank's first micro-batch),
    averaged over the ranks as the trainer averages it."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ces = []
    for rank in range(2):
        batch = next(iter(build_loader(cfg.data, "train", 2, rank, 2, cfg.seed)))
        with torch.no_grad():
            logits = hf(input_ids=batch["input_ids"]).logits
        ces.append(F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item())
    return sum(ces) / len(ces)


def ckpt_of(cfg, step: int = STEPS) -> Path:
    """The run's checkpoint at ``step``."""
    return Path(cfg.run_dir) / "checkpoints" / f"step_{step:08d}"


@pytest.mark.parametrize("family", FAMILY_CASES)
def test_continued_pretraining_matches_transformers(request, tmp_path, family) -> None:
    runs = request.getfixturevalue("long_runs" if family in LONG else "runs")
    cfg, hf_dir = runs["cfg"][family], runs["hf"][family]
    recs = metrics(cfg.run_dir)[:STEPS]  # (the Mixtral run is restarted for one more step)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    ref = hf_first_step_ce(cfg, hf_dir)
    assert abs(recs[0]["ce_loss"] - ref) <= 1e-5 * ref, (recs[0]["ce_loss"], ref)
    state = json.loads((ckpt_of(cfg) / "trainer_state.json").read_text())
    assert state["layout"] == {"world_size": 2, "ep_size": 2, "zero_stage": 2}
    assert state["init"]["from"] == str(hf_dir) and state["init"]["kind"] == "huggingface"
    # trained, converted back: transformers computes what moetrain computes
    model, _ = load_model(ckpt_of(cfg))
    out = convert_checkpoint(ckpt_of(cfg), tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == json.loads((hf_dir / "config.json").read_text())["architectures"][0]
    batch = next(iter(build_loader(cfg.data, "train", 3, 1, 2, 7)))["input_ids"]
    with torch.no_grad():
        got, want = model.eval()(batch).logits, hf(input_ids=batch).logits
        moved = (hf(input_ids=batch).logits - hf_first(hf_dir, batch)).abs().max()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert moved > 1e-3  # training changed the model
    prompt = batch[0, :8].tolist()
    hf.generation_config.eos_token_id = None  # 12 tokens on both sides, EOS or not
    ref_new = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)
    assert generate_ids(model, prompt, 12, temperature=0.0) == ref_new[0, 8:].tolist()


def hf_first(hf_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(input_ids=ids).logits


@pytest.mark.parametrize("family", list(UPCYCLE))
def test_upcycled_training_starts_dense_and_experts_diverge(runs, tmp_path, family) -> None:
    cfg, hf_dir = runs["cfg"][family], runs["hf"][family]
    recs = metrics(cfg.run_dir)
    ref = hf_first_step_ce(cfg, hf_dir)  # the dense model's
    assert abs(recs[0]["ce_loss"] - ref) <= 1e-5 * ref, (recs[0]["ce_loss"], ref)
    state = json.loads((ckpt_of(cfg) / "trainer_state.json").read_text())
    assert state["init"]["upcycled"]["dense_function_at_step_0"] is True
    model, _ = load_model(ckpt_of(cfg))
    for layer in model.moe_layers():
        w = layer.experts.w13.detach().flatten(1)
        gaps = torch.cdist(w, w)[~torch.eye(8, dtype=torch.bool)]
        assert gaps.min() > 1e-4, f"layer {layer.layer}: two experts are still identical"
    for rec in recs:
        for i in cfg.moe.moe_layers(cfg.model.n_layers):
            load = rec[f"moe/layer{i}/tokens_per_expert"]
            assert sum(x > 0 for x in load) >= 2 and max(load) < sum(load), load
    out = convert_checkpoint(ckpt_of(cfg), tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    batch = next(iter(build_loader(cfg.data, "train", 2, 0, 2, 11)))["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(
            model.eval()(batch).logits, hf(input_ids=batch).logits, atol=1e-4, rtol=1e-4
        )


def test_restart_resumes_the_run_not_init_from(runs) -> None:
    cfg = runs["cfg"]["mixtral"]
    summary = runs["summary"]["restart"]
    assert summary["resumed_from"] == str(ckpt_of(cfg))
    assert summary["steps"] == STEPS + 1
    first = json.loads((ckpt_of(cfg) / "trainer_state.json").read_text())["init"]
    later = json.loads((ckpt_of(cfg, STEPS + 1) / "trainer_state.json").read_text())["init"]
    assert later == first and first["from"] == str(runs["hf"]["mixtral"])
    steps = [r["step"] for r in metrics(cfg.run_dir)]
    assert steps == [*range(1, STEPS + 1), STEPS + 1]  # continued, not restarted from step 1
