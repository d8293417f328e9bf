"""``checkpoint.init_from`` at ZeRO-3 with expert parallelism (2 ranks, EP 2, gloo): the weights
read into the partitions as the model is built (moetrain/train/zero3_build.py), no rank holding
or reading the whole model.

- DeepSeek-V3's tiny model (latent attention, a dense first layer, a shared expert, the
  routers' selection biases as buffers; every weight partitioned,
  ``parallel.zero3_persistence_elements=0``) and a dense Llama upcycled to 8 experts (small
  weights kept whole, the default threshold): the first step's cross-entropy at ZeRO-3 equals
  ZeRO-2's and transformers' on the same global batch (fp32, 1e-5 relative).
- What each rank read: at ZeRO-3 every tensor of the source once over both ranks (rank 0 the
  dense weights and its experts, rank 1 its experts only; the selection biases, buffers that
  DeepSpeed does not broadcast, by both), a unit at a time, the largest unit well under half
  the model; at ZeRO-2 each rank reads every dense weight.

- A moetrain checkpoint written at ZeRO-2 (DeepSeek-V3's tiny model after one step from its
  Hugging Face directory): the first step's cross-entropy at ZeRO-3 equals ZeRO-2's from the
  same checkpoint; at ZeRO-3 rank 1 read no dense weight (the selection biases apart), a unit at
  a time.

- A checkpoint written at ZeRO-3 (the ZeRO-2 checkpoint above resumed at ZeRO-3 and saved
  again: the same fp32 weights): the first step's cross-entropy at ZeRO-2 and ZeRO-3 equals
  the ZeRO-2 checkpoint's; at ZeRO-3 each tensor is assembled from the partition files, rank 1
  assembling no dense tensor and its experts from the files of saved EP rank 1 only, a unit at a
  time. Negative control: the same read with each rank handed the other's experts.

Negative control for 1e-5: the same model with the two ranks' experts swapped (a rank reading
the other's experts) moves transformers' cross-entropy by far more (checked here); so does the
checkpoint's step (its cross-entropy against the Hugging Face source's: a reader that took the
source's weights, or the checkpoint's before its step, is caught).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from moetrain.model import param_names as pn
from tests.distributed.zero3_init_jobs import checkpoint_init_job, rank_batch
from tests.helpers.distributed import run_distributed
from tests.helpers.hf_models import save_hf_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

REL = 1e-5
RUN = [
    "parallel.ep_size=2",
    "parallel.timeout_minutes=3",
    "train.precision=fp32",
    "train.micro_batch_size=2",
    "logging.wandb.mode=disabled",
    f"data.seq_len={16}",
]
EXPERT = re.compile(r"\.experts\.")
BUFFER = re.compile(r"e_score_correction_bias$")


def hf_ce(model) -> float:  # noqa: ANN001
    """transformers' cross-entropy on the first global batch, averaged over the 2 ranks."""
    ces = []
    for rank in range(2):
        batch = rank_batch(rank, model.config.vocab_size)
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"]).logits
        ces.append(F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item())
    return sum(ces) / 2


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * abs(b)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("zero3_init")
    hf = {f: save_hf_model(f, work / f) for f in ("deepseek_v3", "llama")}
    overrides = {
        "deepseek_v3": [
            f"checkpoint.init_from={hf['deepseek_v3']}",
            "parallel.zero3_persistence_elements=0",
        ],
        "llama": [f"checkpoint.init_from={hf['llama']}", "moe.num_experts=8", "moe.top_k=2"],
    }
    jobs = {k: [*v, *RUN, f"run_dir={work / k}"] for k, v in overrides.items()}
    # a step that moves the weights well past the tolerance (the negative control)
    step = ["optim.lr=0.01", "optim.warmup_steps=0"]
    first = [*overrides["deepseek_v3"], *RUN, *step, f"run_dir={work / 'saved'}"]
    run = [*RUN, "parallel.zero3_persistence_elements=0", f"run_dir={work / 'checkpoint'}"]
    resave = [*RUN, "parallel.zero3_persistence_elements=0", f"run_dir={work / 'saved3'}"]
    out = run_distributed(checkpoint_init_job, 2, jobs, first, run, resave, timeout=900)
    return {"hf": hf, "ranks": out}


def test_zero3_init_from_a_checkpoint_matches_zero2(runs) -> None:
    for rank, rank_out in enumerate(runs["ranks"]):
        two, three = rank_out["checkpoint/zero2"]["ce"], rank_out["checkpoint/zero3"]["ce"]
        assert _close(three, two), (rank, three, two)
        hf = rank_out["deepseek_v3/zero2"]["ce"]  # the source before the checkpoint's step
        assert abs(two - hf) > 10 * REL * hf, (rank, two, hf)
    r0, r1 = (r["checkpoint/zero3"] for r in runs["ranks"])
    dense1 = [n for n in r1["names"] if not EXPERT.search(n) and not pn.is_expert_bias(n)]
    assert not dense1, dense1  # rank 1: its experts and the buffers only
    assert any(not EXPERT.search(n) for n in r0["names"])
    whole = sum(r0["units"]) + sum(r1["units"])
    assert max(r0["units"]) < whole / 2, (r0["units"], whole)


def test_init_from_a_zero3_checkpoint_matches_its_zero2_original(runs) -> None:
    for rank, rank_out in enumerate(runs["ranks"]):
        ref = rank_out["checkpoint/zero3"]["ce"]  # the same weights, from the ZeRO-2 checkpoint
        assert _close(rank_out["checkpoint/zero2"]["ce"], ref), rank
        for stage in (2, 3):
            got = rank_out[f"checkpoint3/zero{stage}"]["ce"]
            assert _close(got, ref), (rank, stage, got, ref)
        swapped = rank_out["swapped/zero3"]["ce"]  # negative control: the other rank's experts
        assert abs(swapped - ref) > 10 * REL * abs(ref), (rank, swapped, ref)
    r0, r1 = (r["checkpoint3/zero3"] for r in runs["ranks"])
    # rank 1 assembled no dense tensor, and its experts from saved EP rank 1's files only
    assert r1["partitions"] and {ep for _, ep in r1["partitions"]} == {1}, r1["partitions"]
    assert {ep for _, ep in r0["partitions"]} == {None, 0}, r0["partitions"]
    dense1 = [n for n in r1["names"] if not EXPERT.search(n) and not pn.is_expert_bias(n)]
    assert not dense1, dense1  # (the selection biases apart: buffers, read by every rank)
    whole = sum(r0["units"]) + sum(r1["units"])
    assert max(r0["units"]) < whole / 2, (r0["units"], whole)  # a unit at a time


@pytest.mark.parametrize("source", ["deepseek_v3", "llama"])
def test_zero3_init_from_matches_zero2_and_transformers(runs, source) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(runs["hf"][source], dtype=torch.float32)
    ref = hf_ce(hf.eval())
    for rank, rank_out in enumerate(runs["ranks"]):
        two, three = rank_out[f"{source}/zero2"]["ce"], rank_out[f"{source}/zero3"]["ce"]
        assert _close(two, ref), (rank, two, ref)
        assert _close(three, ref), (rank, three, ref)
    if source == "deepseek_v3":  # negative control: the ranks' experts swapped
        with torch.no_grad():
            for layer in hf.model.layers[1:]:
                for p in layer.mlp.experts.parameters():
                    p.copy_(p.roll(p.shape[0] // 2, dims=0))
        assert abs(hf_ce(hf) - ref) > 10 * REL * ref


def _read(rank_out: dict, key: str, pattern: re.Pattern | None = None) -> dict[str, int]:
    tensors = rank_out[key]["tensors"]
    return {n: b for n, b in tensors.items() if pattern is None or pattern.search(n)}


@pytest.mark.parametrize("source", ["deepseek_v3", "llama"])
def test_zero3_init_from_reads_each_tensor_once(runs, source) -> None:
    from moetrain.convert.hf_files import HFWeights

    files = HFWeights(runs["hf"][source])
    source_bytes = files.load(files.names())
    total = sum(t.numel() * t.element_size() for t in source_bytes.values())
    r0, r1 = (r[f"{source}/zero3"] for r in runs["ranks"])
    # rank 1: its experts (or, upcycled, the dense FFNs it upcycles into them) and buffers only
    dense1 = {n for n in r1["tensors"] if not EXPERT.search(n) and not BUFFER.search(n)}
    if source == "llama":
        assert all(".mlp." in n for n in dense1), dense1
    else:
        assert not dense1, dense1
        both = set(r0["tensors"]) & set(r1["tensors"])
        assert both and all(BUFFER.search(n) for n in both), both
        buffers = sum(b for n, b in r1["tensors"].items() if BUFFER.search(n))
        read = sum(r0["tensors"].values()) + sum(r1["tensors"].values())
        assert read == total + buffers, (read, total, buffers)  # every tensor read once
        assert set(r0["tensors"]) | set(r1["tensors"]) == set(files.names())
    whole = sum(r0["units"]) + sum(r1["units"])  # the model's weights, each read once
    for r in (r0, r1):  # a unit at a time: never the whole model, nor half of it
        assert r["units"] and max(r["units"]) < whole / 2, (r["units"], whole)
    for rank_out in runs["ranks"]:  # ZeRO-2: every rank reads every dense weight
        two = rank_out[f"{source}/zero2"]["tensors"]
        assert {n for n in files.names() if not EXPERT.search(n)} <= set(two)
