"""Continued pretraining from DeepSeek's quantized releases on 2 ranks, EP=2, ZeRO-2 (real runs,
gloo; -m long: the default suite reads the same releases in one process, each expert-parallel
rank's experts alone, in tests/unit/test_quantized_weights.py): the first step's cross-entropy
equals transformers' on the model dequantized by the written-out reference (fp32, 1e-5
relative)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moetrain.config import read_config_data
from moetrain.data import build_loader
from moetrain.data.prepare import prepare
from moetrain.init_from.source import resolve_config_data
from tests.distributed.init_from_jobs import train_runs
from tests.helpers.corpus import write_stdlib_corpus
from tests.helpers.distributed import run_distributed
from tests.helpers.hf_models import save_hf_model, save_hf_tokenizer
from tests.helpers.quantized_release import write_dequantized, write_release

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.long]

FAMILIES = ("deepseek_v3", "deepseek_v4")
RUN = [
    "parallel.ep_size=2",
    "parallel.zero_stage=2",
    "parallel.timeout_minutes=3",
    "train.precision=fp32",
    "train.max_steps=1",
    "train.micro_batch_size=2",
    "train.log_every=1",
    "train.eval_every=0",
    "checkpoint.save_every_steps=0",
    "logging.wandb.mode=disabled",
    "data.seq_len=32",
]


def test_quantized_releases_train_at_ep2_from_the_dequantized_model(tmp_path) -> None:
    corpus = write_stdlib_corpus(tmp_path / "corpus.txt", n_files=4, max_chars=60_000)
    tok = save_hf_tokenizer([corpus.read_text()[:60_000]], 300, tmp_path / "tokenizer")
    data = [
        f"data.source={corpus}",
        "data.source_format=text",
        f"data.output_dir={tmp_path / 'data'}",
        f"data.tokenizer={tok}",
        "data.num_proc=1",
        "data.val_fraction=0",
    ]
    jobs, plain = [], {}
    for family in FAMILIES:
        fp4 = {"moe_intermediate_size": 32} if family == "deepseek_v4" else None
        src = save_hf_model(family, tmp_path / f"src-{family}", tokenizer=tok, overrides=fp4)
        reference = write_release(src, tmp_path / f"release-{family}", family)
        plain[family] = write_dequantized(src, tmp_path / f"plain-{family}", reference)
        release = f"checkpoint.init_from={tmp_path / f'release-{family}'}"
        jobs.append([release, f"run_dir={tmp_path / f'run-{family}'}", *data, *RUN])
    cfgs = [resolve_config_data(read_config_data(None, job))[0] for job in jobs]
    prepare(cfgs[0])
    run_distributed(train_runs, 2, jobs, timeout=900)
    for family, cfg in zip(FAMILIES, cfgs, strict=True):
        lines = (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()
        first = next(r for r in map(json.loads, lines) if r.get("step") == 1 and "ce_loss" in r)
        hf = transformers.AutoModelForCausalLM.from_pretrained(plain[family], dtype=torch.float32)
        ces = []
        for rank in range(2):
            batch = next(iter(build_loader(cfg.data, "train", 2, rank, 2, cfg.seed)))
            with torch.no_grad():
                logits = hf.eval()(input_ids=batch["input_ids"]).logits
            ces.append(F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item())
        ref = sum(ces) / 2
        assert abs(first["ce_loss"] - ref) <= 1e-5 * ref, (family, first["ce_loss"], ref)
