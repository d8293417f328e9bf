"""convert_checkpoint / import_hf_checkpoint: round trips, sharding, refusals, atomicity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moetrain.checkpoint.format import CheckpointError
from moetrain.checkpoint.read import load_model
from moetrain.config import ConfigError
from moetrain.convert.export import convert_checkpoint
from moetrain.convert.families import family
from moetrain.convert.importer import import_hf_checkpoint
from moetrain.data.tokenizer import train_tokenizer
from moetrain.fileio import file_crc32
from tests.helpers.hf_models import MOE_FAMILIES, save_hf_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    text = ["the cat sat on the mat 123", "tokens and more tokens, über 42"] * 30
    return train_tokenizer(text, 320, tmp_path_factory.mktemp("sp")).path


def hf_model_dir(fmt: str, root: Path, sp_model: Path) -> Path:
    out = save_hf_model(fmt, root / f"hf-{fmt}")
    (out / "tokenizer.model").write_bytes(sp_model.read_bytes())
    return out


def hf_state(path: Path) -> dict[str, torch.Tensor]:
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {**m.state_dict(), **dict(m.named_buffers())}


@pytest.mark.parametrize("fmt", MOE_FAMILIES)
def test_hf_to_moetrain_to_hf_identical(tmp_path, sp_model, fmt: str) -> None:
    src = hf_model_dir(fmt, tmp_path, sp_model)
    ckpt = import_hf_checkpoint(src, tmp_path / "ckpt" / "step_00000000")
    model, cfg = load_model(ckpt)  # the trainer's reader accepts it
    assert (ckpt / "layer_1_expert_3_mp_rank_00_model_states.pt").is_file() or fmt != "mixtral"
    out = convert_checkpoint(ckpt, tmp_path / "out", fmt=fmt)
    saved = json.loads((out / "config.json").read_text())
    # the released files' class name (Phi-3.5-MoE's PhiMoEForCausalLM), which transformers
    # loads as its own class by model_type
    assert saved["architectures"] == [family(fmt).config_architecture]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == family(fmt).architecture
    a, b = hf_state(src), hf_state(out)
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ids = torch.randint(0, 320, (1, 11))
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(src).eval()(input_ids=ids).logits
        torch.testing.assert_close(model.eval()(ids).logits, ref, atol=1e-5, rtol=1e-5)


@pytest.fixture()
def ckpt(tmp_path, sp_model) -> Path:
    return import_hf_checkpoint(
        hf_model_dir("mixtral", tmp_path, sp_model), tmp_path / "step_00000007"
    )


def test_sharded_output_index_and_dtype(tmp_path, ckpt) -> None:
    out = convert_checkpoint(ckpt, tmp_path / "sharded", dtype="bf16", max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted({*index["weight_map"].values()})
    assert len(shards) > 2 and all((out / s).is_file() for s in shards)
    assert not (out / "model.safetensors").exists()
    assert "model.layers.2.block_sparse_moe.experts.3.w2.weight" in index["weight_map"]
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (2, 3, 0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert hf.model.embed_tokens.weight.dtype == torch.bfloat16
    ref = load_model(ckpt)[0].state_dict()["embed.weight"]
    assert torch.equal(hf.model.embed_tokens.weight, ref.to(torch.bfloat16))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left


def _assert_nothing_written(out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]


def test_missing_expert_file_refused(tmp_path, ckpt) -> None:
    (ckpt / "layer_1_expert_2_mp_rank_00_model_states.pt").unlink()
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="layer_1_expert_2.*missing"):
        convert_checkpoint(ckpt, out)
    _assert_nothing_written(out)


def test_missing_expert_not_in_manifest_refused(tmp_path, ckpt) -> None:
    commit = json.loads((ckpt / "COMMITTED.json").read_text())
    del commit["files"]["layer_0_expert_1_mp_rank_00_model_states.pt"]
    (ckpt / "COMMITTED.json").write_text(json.dumps(commit))
    (ckpt / "layer_0_expert_1_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match="expert 1 of MoE layer 0"):
        convert_checkpoint(ckpt, tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize(
    "victim", ["mp_rank_00_model_states.pt", "layer_2_expert_0_mp_rank_00_model_states.pt"]
)
def test_truncated_shard_refused(tmp_path, ckpt, victim: str) -> None:
    f = ckpt / victim
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        convert_checkpoint(ckpt, tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")


def test_truncated_shard_with_matching_manifest_refused(tmp_path, ckpt) -> None:
    """Even when the manifest was rewritten to match, the reader refuses a torn file, and the
    half-built output is removed."""
    f = ckpt / "layer_2_expert_3_mp_rank_00_model_states.pt"
    f.write_bytes(f.read_bytes()[:100])
    commit = json.loads((ckpt / "COMMITTED.json").read_text())
    commit["files"][f.name] = 100
    commit["crc32"][f.name] = file_crc32(f)  # the manifest vouches for the torn file
    (ckpt / "COMMITTED.json").write_text(json.dumps(commit))
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        convert_checkpoint(ckpt, tmp_path / "out", max_shard_bytes=1000)
    _assert_nothing_written(tmp_path / "out")


def test_refusals_leave_existing_output_alone(tmp_path, ckpt) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        convert_checkpoint(ckpt, out)
    with pytest.raises(ConfigError, match="model.qk_norm"):
        convert_checkpoint(ckpt, out, fmt="olmoe", overwrite=True)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    convert_checkpoint(ckpt, out, overwrite=True)
    assert (out / "model.safetensors").is_file() and not (out / "keep.txt").exists()


def test_a_tokenizer_less_model_imports_and_converts_with_tokenizer(
    tmp_path, sp_model, capsys
) -> None:
    """import of a model directory without tokenizer files says the checkpoint carries none;
    convert of it is refused naming --tokenizer, and with --tokenizer exports it (the command
    line's own entry point; nothing written by the refusal)."""
    from moetrain.cli import main

    src = save_hf_model("mixtral", tmp_path / "hf")  # weights and config only
    ckpt, out = tmp_path / "ckpt" / "step_00000000", tmp_path / "out"
    assert main(["import", str(src), str(ckpt)]) == 0
    said = capsys.readouterr()
    assert "has no tokenizer" in said.out and "needs --tokenizer" in said.out
    assert main(["convert", str(ckpt), str(out)]) != 0
    said = capsys.readouterr()
    assert "carries no tokenizer" in said.err + said.out and "--tokenizer PATH" in said.err
    assert not out.exists()
    assert main(["convert", str(ckpt), str(out), "--tokenizer", str(sp_model)]) == 0
    assert (out / "tokenizer.model").is_file() and (out / "tokenizer.json").is_file()
    with_tok = tmp_path / "ckpt2" / "step_00000000"
    capsys.readouterr()
    assert main(["import", str(src), str(with_tok), "--tokenizer", str(sp_model)]) == 0
    assert "has no tokenizer" not in capsys.readouterr().out
    assert (with_tok / "tokenizer.model").read_bytes() == sp_model.read_bytes()
