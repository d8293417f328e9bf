"""checkpoint.init_from in one process: every source gives the model transformers computes; the
config takes the source's shape and refuses contradictions; bad sources are refused, named,
before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moetrain.checkpoint.format import COMMIT_FILE, CheckpointError, TrainerState
from moetrain.config import ConfigError, read_config_data
from moetrain.convert.importer import import_hf_checkpoint
from moetrain.init_from.source import open_init_source, resolve_config_data
from moetrain.init_from.weights import build_model
from moetrain.parallel.topology import Topology
from moetrain.train.start import check_start, open_start, will_resume
from tests.helpers.configs import tiny_args
from tests.helpers.hf_models import MOE_FAMILIES, hf_config, save_hf_model
from tests.helpers.routed import assert_every_expert_routed, routed_counts

transformers = pytest.importorskip("transformers")
SOLO = Topology(
    rank=0, world_size=1, local_rank=0, ep_size=1, backend="gloo", device=torch.device("cpu")
)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {f: save_hf_model(f, root / f) for f in (*MOE_FAMILIES, "llama")}


def resolved(*overrides: str):
    return resolve_config_data(read_config_data(None, list(overrides)))


def hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(input_ids=ids).logits


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_source_gives_transformers_logits_and_local_experts(hf_dirs, family) -> None:
    cfg, source = resolved(f"checkpoint.init_from={hf_dirs[family]}")
    assert source.kind == "huggingface" and not source.upcycle
    layers = hf_config(family).num_hidden_layers  # (3; Nemotron-H's are one sublayer each)
    assert (cfg.model.vocab_size, cfg.model.d_model, cfg.model.n_layers) == (320, 32, layers)
    ids = torch.randint(0, 320, (4, 13), generator=torch.Generator().manual_seed(0))
    model = build_model(cfg, source).eval()
    with torch.no_grad(), routed_counts(model) as counts:
        got = model(ids).logits
    assert_every_expert_routed(family, counts)  # (else a broken expert could not show)
    ref = hf_logits(hf_dirs[family], ids)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert ref.abs().max() > 1e-2
    # an expert-parallel rank reads only its experts, and they are the full model's
    half = build_model(cfg, source, local_experts=(2, 4))
    full, part = model.state_dict(), half.state_dict()
    for name, t in part.items():
        want = full[name][2:4] if ".experts." in name else full[name]
        assert torch.equal(t, want), name


def test_group_limited_source_keeps_its_expert_groups(tmp_path) -> None:
    """GLM-4-MoE with expert groups: the routing rule (n_group / topk_group) comes from the
    source, so the model computes transformers' logits, not plain top-k routing's."""
    src = save_hf_model("glm4_moe", tmp_path / "glm", overrides={"n_group": 2, "topk_group": 1})
    cfg, source = resolved(f"checkpoint.init_from={src}")
    assert (cfg.moe.n_group, cfg.moe.topk_group) == (2, 1)
    ids = torch.randint(0, 320, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = build_model(cfg, source).eval()(ids).logits
    torch.testing.assert_close(got, hf_logits(src, ids), atol=1e-5, rtol=1e-5)


def test_a_qwen2_moe_source_without_qkv_biases(tmp_path) -> None:
    """Qwen2-MoE with ``qkv_bias: false`` (no bias tensors in its files) imports without them
    and computes transformers' logits."""
    src = save_hf_model("qwen2_moe", tmp_path / "q", overrides={"qkv_bias": False})
    cfg, source = resolved(f"checkpoint.init_from={src}")
    assert not cfg.model.qkv_bias
    ids = torch.randint(0, 320, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = build_model(cfg, source).eval()(ids).logits
    torch.testing.assert_close(got, hf_logits(src, ids), atol=1e-5, rtol=1e-5)


def test_shape_comes_from_the_source_and_contradictions_are_refused(hf_dirs) -> None:
    src = hf_dirs["mixtral"]
    cfg, _ = resolved(f"checkpoint.init_from={src}", "moe.aux_loss_coef=0.02", "data.seq_len=32")
    assert cfg.moe.num_experts == 4 and cfg.moe.expert_hidden == 24 and cfg.model.head_dim == 8
    assert cfg.moe.aux_loss_coef == 0.02 and cfg.data.seq_len == 32  # training choices stay
    assert (
        cfg.model.max_seq_len == 64
        and resolved(f"checkpoint.init_from={src}")[0].data.seq_len == 64
    )
    for key, ours, theirs in (
        ("model.d_model", "64", "32"),
        ("moe.num_experts", "8", "4"),
        ("model.qk_norm", "true", "False"),
    ):
        shown = "True" if ours == "true" else ours
        with pytest.raises(ConfigError, match=rf"{key}: the config sets {shown}.* has {theirs}"):
            resolved(f"checkpoint.init_from={src}", f"{key}={ours}")
    # the same values given explicitly are fine
    resolved(f"checkpoint.init_from={src}", "model.d_model=32", "moe.num_experts=4")


def test_checkpoint_and_run_dir_sources(hf_dirs, tmp_path) -> None:
    ckpt = import_hf_checkpoint(
        hf_dirs["qwen3_moe"], tmp_path / "run" / "checkpoints" / "step_00000005", step=5
    )
    state = TrainerState.read(ckpt)
    assert state.init["kind"] == "huggingface" and state.init["from"] == str(hf_dirs["qwen3_moe"])
    ids = torch.randint(0, 320, (1, 9))
    ref = hf_logits(hf_dirs["qwen3_moe"], ids)
    for spec in (ckpt, tmp_path / "run"):
        cfg, source = resolved(f"checkpoint.init_from={spec}")
        assert source.kind == "checkpoint" and source.step == 5 and source.path == ckpt
        with torch.no_grad():
            got = build_model(cfg, source, local_experts=None).eval()(ids).logits
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_bad_sources_are_refused_by_name(hf_dirs, tmp_path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointError, match=f"checkpoint.init_from={missing}: does not exist"):
        open_init_source(str(missing))
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2)
    ).save_pretrained(gpt2)
    with pytest.raises(ConfigError, match="architecture 'GPT2LMHeadModel'.*not supported"):
        open_init_source(str(gpt2))
    with pytest.raises(CheckpointError, match="neither a Hugging Face model directory"):
        open_init_source(str(tmp_path))
    # a sharded directory with one shard gone, and one cut short
    sharded = tmp_path / "sharded"
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs["mixtral"])
    model.save_pretrained(sharded, max_shard_size="60KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 2
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=f"{shards[1]}: truncated or corrupt"):
        open_init_source(str(sharded))
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=f"{shards[1]}: weight file is missing"):
        open_init_source(str(sharded))
    # a tensor of the wrong shape: named, with both shapes
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((hf_dirs["mixtral"] / "config.json").read_text())
    from safetensors.torch import load_file, save_file

    tensors = load_file(hf_dirs["mixtral"] / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    tensors[name] = torch.zeros(32, 20)
    save_file(tensors, bad / "model.safetensors")
    cfg, source = resolved(f"checkpoint.init_from={bad}")
    with pytest.raises(
        CheckpointError, match=rf"tensor {name} has shape \[32, 20\].* needs \[32, 24\]"
    ):
        build_model(cfg, source)
    del tensors[name]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"tensor {name} is missing"):
        build_model(cfg, source)


def test_tensors_the_model_would_drop_are_refused(hf_dirs, tmp_path) -> None:
    """A tensor the config does not describe is refused by name (it would be dropped); the
    multi-token-prediction layers of a DeepSeek-V3 checkpoint, after its last decoder layer,
    are not read when config.json declares them, as transformers does."""
    from safetensors.torch import load_file, save_file

    def with_extra(family: str, extra: dict, **config) -> Path:
        out = tmp_path / f"{family}-{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        hf = json.loads((hf_dirs[family] / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**hf, **config}))
        tensors = load_file(hf_dirs[family] / "model.safetensors")
        save_file({**tensors, **extra}, out / "model.safetensors")
        return out

    stray = {"model.layers.0.mlp.extra_proj.weight": torch.zeros(4, 4)}
    src = with_extra("mixtral", stray)
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.0\.mlp\.extra_proj"):
        import_hf_checkpoint(src, tmp_path / "ckpt-stray")
    mtp = {
        "model.layers.3.eh_proj.weight": torch.zeros(32, 64),
        "model.layers.3.enorm.weight": torch.ones(32),
    }
    undeclared = with_extra("deepseek_v3", mtp)
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.3\.eh_proj.*1 more"):
        import_hf_checkpoint(undeclared, tmp_path / "ckpt-undeclared")
    declared = with_extra("deepseek_v3", mtp, num_nextn_predict_layers=1)
    ids = torch.randint(0, 320, (1, 9))
    cfg, source = resolved(f"checkpoint.init_from={declared}")
    with torch.no_grad():
        got = build_model(cfg, source).eval()(ids).logits
    torch.testing.assert_close(got, hf_logits(hf_dirs["deepseek_v3"], ids), atol=1e-5, rtol=1e-5)


def test_an_ernie_directory_as_released(hf_dirs, tmp_path) -> None:
    """ERNIE-4.5-21B-A3B as released: bf16 weights saved by transformers (the router and the
    (1, E) selection bias kept fp32), the legacy config.json, and the tensors of the MTP layer
    it declares (``model.mtp_*``, not read, as transformers does not read them): the model
    transformers loads from the directory, imported as well; undeclared, the MTP tensors are
    refused by name."""
    from safetensors.torch import load_file, save_file

    from tests.helpers.hf_flags import ERNIE_RELEASED_CONFIG

    src = tmp_path / "released"
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dirs["ernie4_5_moe"], dtype=torch.bfloat16
    )
    bf16.save_pretrained(src)
    (src / "config.json").write_text(json.dumps(ERNIE_RELEASED_CONFIG))
    tensors = load_file(src / "model.safetensors")
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    bias = tensors["model.layers.1.mlp.moe_statics.e_score_correction_bias"]
    assert bias.shape == (1, 4) and bias.dtype == torch.float32 and bias.abs().max() > 0
    g = torch.Generator().manual_seed(3)
    mtp = {
        "model.mtp_emb_norm.0.weight": torch.ones(32),
        "model.mtp_hidden_norm.0.weight": torch.ones(32),
        "model.mtp_linear_proj.0.weight": torch.randn(32, 64, generator=g),
        "model.mtp_block.0.input_layernorm.weight": torch.ones(32),
        "model.mtp_block.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g),
        "model.mtp_block.0.mlp.gate.weight": torch.randn(4, 32, generator=g),
    }
    mtp = {k: v.to(torch.bfloat16) for k, v in mtp.items()}
    save_file({**tensors, **mtp}, src / "model.safetensors", metadata={"format": "pt"})
    cfg, source = resolved(f"checkpoint.init_from={src}")
    m, moe = cfg.model, cfg.moe
    assert (m.rope_theta, m.rope_interleave, m.tie_embeddings) == (500000.0, True, True)
    assert (moe.first_k_dense, moe.num_shared_experts, moe.renormalize_min) == (1, 2, 1e-12)
    ids = torch.randint(0, 320, (2, 13), generator=torch.Generator().manual_seed(0))
    ref = hf_logits(src, ids)
    with torch.no_grad():
        got = build_model(cfg, source).eval()(ids).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    ckpt = import_hf_checkpoint(src, tmp_path / "ckpt")
    resolved_ckpt, ckpt_source = resolved(f"checkpoint.init_from={ckpt}")
    with torch.no_grad():
        again = build_model(resolved_ckpt, ckpt_source).eval()(ids).logits
    torch.testing.assert_close(again, ref, atol=1e-5, rtol=1e-5)
    undeclared = dict(ERNIE_RELEASED_CONFIG)
    del undeclared["num_nextn_predict_layers"]
    (src / "config.json").write_text(json.dumps(undeclared))
    with pytest.raises(CheckpointError, match=r"tensor model\.mtp_.*5 more"):
        import_hf_checkpoint(src, tmp_path / "ckpt-undeclared")


def test_a_granite_directory_as_released(hf_dirs, tmp_path) -> None:
    """granite-3.0-1b-a400m as released: bf16 weights saved by transformers (its files' own
    names: each layer's experts fused as ``block_sparse_moe.input_linear`` / ``output_linear``,
    the router ``block_sparse_moe.router.layer``; the head tied) and the legacy config.json
    (top-level rope_theta, rope_scaling null, attention dropout): the model transformers loads
    from the directory, imported as well, and exported back to the same tensors bit for bit."""
    from safetensors.torch import load_file

    from moetrain.convert.hf import to_hf_state_dict
    from moetrain.convert.importer import load_hf_state_dict
    from tests.helpers.hf_flags import GRANITE_RELEASED_CONFIG

    src = tmp_path / "released"
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dirs["granitemoe"], dtype=torch.bfloat16
    )
    bf16.save_pretrained(src)
    (src / "config.json").write_text(json.dumps(GRANITE_RELEASED_CONFIG))
    tensors = load_file(src / "model.safetensors")
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert "lm_head.weight" not in tensors  # tied
    layer = "model.layers.1.block_sparse_moe."
    assert tensors[layer + "input_linear.weight"].shape == (4, 48, 32)  # (E, 2F, D)
    assert tensors[layer + "output_linear.weight"].shape == (4, 32, 24)  # (E, D, F)
    assert tensors[layer + "router.layer.weight"].shape == (4, 32)
    cfg, source = resolved(f"checkpoint.init_from={src}")
    m, moe = cfg.model, cfg.moe
    assert (m.embedding_multiplier, m.residual_multiplier) == (12.0, 0.22)
    assert (m.attention_scale, m.logits_scaling, m.tie_embeddings) == (0.015625, 6.0, True)
    assert (moe.topk_before_score, moe.num_experts, moe.expert_hidden) == (True, 4, 24)
    ids = torch.randint(0, 320, (2, 13), generator=torch.Generator().manual_seed(0))
    ref = hf_logits(src, ids)
    assert ref.abs().max() > 1e-2
    with torch.no_grad():
        got = build_model(cfg, source).eval()(ids).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # an expert-parallel rank reads its rows of the fused tensors only
    half = build_model(cfg, source, local_experts=(2, 4)).state_dict()
    whole = build_model(cfg, source).state_dict()
    for name, t in half.items():
        assert torch.equal(t, whole[name][2:4] if ".experts." in name else whole[name]), name
    ckpt = import_hf_checkpoint(src, tmp_path / "ckpt")
    resolved_ckpt, ckpt_source = resolved(f"checkpoint.init_from={ckpt}")
    with torch.no_grad():
        again = build_model(resolved_ckpt, ckpt_source).eval()(ids).logits
    torch.testing.assert_close(again, ref, atol=1e-5, rtol=1e-5)
    state, state_cfg = load_hf_state_dict(src)
    back = to_hf_state_dict(state, state_cfg, "granitemoe")
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(back[name].to(torch.bfloat16), t), name


def test_a_granite_source_in_transformers_in_memory_names(hf_dirs, tmp_path) -> None:
    """A Granite-MoE file saved from transformers v5's state dict (``block_sparse_moe.experts.
    gate_up_proj`` / ``down_proj``, ``block_sparse_moe.router.weight``): the same logits."""
    from safetensors.torch import save_file

    src = hf_dirs["granitemoe"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tensors = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert "model.layers.0.block_sparse_moe.router.weight" in tensors
    assert "model.layers.0.block_sparse_moe.experts.gate_up_proj" in tensors
    v5 = tmp_path / "v5"
    v5.mkdir()
    (v5 / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, v5 / "model.safetensors", metadata={"format": "pt"})
    ids = torch.randint(0, 320, (2, 9), generator=torch.Generator().manual_seed(1))
    cfg, source = resolved(f"checkpoint.init_from={v5}")
    with torch.no_grad():
        got = build_model(cfg, source).eval()(ids).logits
    torch.testing.assert_close(got, hf_logits(src, ids), atol=1e-5, rtol=1e-5)


def test_run_dir_checkpoint_wins_and_bad_init_from_writes_nothing(hf_dirs, tmp_path) -> None:
    """Precedence is read without touching run_dir; a bad source fails in run_training before
    run_dir exists."""
    from moetrain.config import config_from_dict
    from moetrain.train.loop import run_training

    run_dir = tmp_path / "run"
    cfg, _ = resolved(f"checkpoint.init_from={hf_dirs['mixtral']}", f"run_dir={run_dir}")
    assert not will_resume(cfg) and open_start(cfg, SOLO) is not None
    import_hf_checkpoint(hf_dirs["mixtral"], run_dir / "checkpoints" / "step_00000003", step=3)
    assert will_resume(cfg) and open_start(cfg, SOLO) is None  # resume wins: not opened
    for bad in (tmp_path / "gone", hf_dirs["llama"]):
        data = read_config_data(None, tiny_args(run_dir=str(tmp_path / "fresh")))
        data["checkpoint"] = {"init_from": str(bad)}
        bad_cfg = config_from_dict(data)
        with pytest.raises((CheckpointError, ConfigError)):
            run_training(bad_cfg)
        assert not (tmp_path / "fresh").exists()


def test_import_writes_what_it_loaded(hf_dirs, tmp_path) -> None:
    ckpt = import_hf_checkpoint(
        hf_dirs["olmoe"], tmp_path / "ckpt", overrides=["moe.z_loss_coef=0.0"]
    )
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["config"]["model"]["qk_norm_scope"] == "projection"
    assert state["init"]["architecture"] == "OlmoeForCausalLM" and state["init"]["upcycled"] is None
    with pytest.raises(ConfigError, match="moe.top_k: the config sets 1"):
        import_hf_checkpoint(hf_dirs["olmoe"], tmp_path / "ckpt2", overrides=["moe.top_k=1"])
    assert not (tmp_path / "ckpt2").exists()


def test_a_fresh_start_over_an_earlier_runs_checkpoints_is_refused(hf_dirs, tmp_path) -> None:
    """``checkpoint.resume=none`` where run_dir holds a complete checkpoint: a clear error before
    anything is written (its saves would mix with the earlier run's, retention would delete
    them)."""
    from moetrain.train.loop import run_training

    run_dir = tmp_path / "run"
    import_hf_checkpoint(hf_dirs["mixtral"], run_dir / "checkpoints" / "step_00000003", step=3)
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    cfg, _ = resolved("checkpoint.resume=none", f"run_dir={run_dir}")
    with pytest.raises(ConfigError, match=r"checkpoint.resume=none: .*\(newest step_00000003\)"):
        check_start(cfg)
    with pytest.raises(ConfigError, match="checkpoint.resume=none"):
        run_training(cfg)
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before
    cfg, _ = resolved("checkpoint.resume=none", f"run_dir={tmp_path / 'other'}")
    check_start(cfg)  # an empty run_dir starts fresh


def test_a_resuming_run_does_not_open_its_init_from(hf_dirs, tmp_path) -> None:
    """A restarted job whose source has gone resumes: the config comes from the checkpoint it
    resumes (the shape the source gave the first start), and nothing opens the source."""
    import shutil

    from moetrain.cli import load_config

    source = tmp_path / "source"
    shutil.copytree(hf_dirs["qwen3_moe"], source)
    run_dir = tmp_path / "run"
    args = [f"run_dir={run_dir}", f"checkpoint.init_from={source}"]
    first = load_config(None, args)
    assert first.model.d_model == 32 and first.moe.num_experts == 4  # the source's shape
    import_hf_checkpoint(source, run_dir / "checkpoints" / "step_00000002", step=2)
    shutil.rmtree(source)
    again = load_config(None, args)
    assert again.model == first.model and again.moe == first.moe
    assert open_start(again, SOLO) is None


def test_a_checkpoint_source_is_crc_checked_once_per_start(hf_dirs, tmp_path, monkeypatch) -> None:
    """Resolving the config reads headers and sizes only; the start reads every file once (each
    by one rank) and refuses a changed byte, naming the file."""
    import moetrain.checkpoint.format as fmt
    from moetrain.cli import load_config

    ckpt = import_hf_checkpoint(
        hf_dirs["olmoe"], tmp_path / "src" / "checkpoints" / "step_00000004", step=4
    )
    read = []
    real = fmt.file_crc32
    monkeypatch.setattr(fmt, "file_crc32", lambda p: read.append(Path(p).name) or real(p))
    args = [f"run_dir={tmp_path / 'run'}", f"checkpoint.init_from={ckpt}"]
    cfg = load_config(None, args)
    assert read == []  # the config's resolution read no file's bytes
    assert open_start(cfg, SOLO) is not None
    files = sorted(json.loads((ckpt / COMMIT_FILE).read_text())["crc32"])
    assert sorted(read) == files  # each file once
    victim = ckpt / files[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    cfg = load_config(None, args)  # sizes still agree: resolving does not notice
    with pytest.raises(CheckpointError, match=f"{victim}: contents changed since the commit"):
        open_start(cfg, SOLO)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "ernie4_5_moe"])
def test_a_source_saved_in_the_fused_expert_layout(hf_dirs, tmp_path, family) -> None:
    """transformers v5 holds experts fused (``mlp.experts.gate_up_proj`` (E, 2F, D),
    ``down_proj`` (E, D, F)) and some files are saved that way, in its in-memory names (ERNIE's
    selection bias under ``mlp.gate.``): the same model from such a file gives the same
    logits, and an expert-parallel rank reads only its rows."""
    import re

    from safetensors.torch import load_file, save_file

    src = hf_dirs[family]
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    names = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up"}
    names["down_proj"] = "down"
    per_expert = re.compile(
        r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$"
    )
    experts: dict[int, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for name, t in tensors.items():
        m = per_expert.match(name)
        if m is None:
            v5 = name.replace("block_sparse_moe.gate.", "mlp.gate.")
            out[v5.replace(".mlp.moe_statics.", ".mlp.gate.moe_statics.")] = t
            continue
        layer, e, w = int(m.group(1)), int(m.group(2)), names[m.group(3)]
        experts.setdefault(layer, {}).setdefault(w, {})[e] = t
    assert experts, "the source has per-expert tensors to fuse"
    for layer, ws in experts.items():
        n = len(ws["gate"])
        gate_up = [torch.cat([ws["gate"][e], ws["up"][e]], 0) for e in range(n)]
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(
            [ws["down"][e] for e in range(n)]
        )
    save_file(out, fused / "model.safetensors")
    ids = torch.randint(0, 320, (2, 9), generator=torch.Generator().manual_seed(1))
    cfg, source = resolved(f"checkpoint.init_from={fused}")
    with torch.no_grad():
        got = build_model(cfg, source).eval()(ids).logits
    torch.testing.assert_close(got, hf_logits(src, ids), atol=1e-5, rtol=1e-5)
    whole = build_model(cfg, source).state_dict()
    for name, t in build_model(cfg, source, local_experts=(2, 4)).state_dict().items():
        assert torch.equal(t, whole[name][2:4] if ".experts." in name else whole[name]), name


def test_a_tied_head_stays_one_parameter(hf_dirs) -> None:
    """A model built from a source with tied embeddings trains one matrix for both (the meta
    build's ``to_empty`` gives each module its own Parameter; the build ties them again)."""
    cfg, source = resolved(f"checkpoint.init_from={hf_dirs['granitemoe']}")
    assert cfg.model.tie_embeddings
    model = build_model(cfg, source)
    assert model.lm_head.weight is model.embed.weight
    names = [n for n, _ in model.named_parameters()]
    assert "embed.weight" in names and "lm_head.weight" not in names


def _llama4_released_layout(out: Path) -> Path:
    """The tiny Llama 4 text model inside a Llama4ForConditionalGeneration with a one-layer
    vision tower, saved as the releases are (text_config, language_model.* tensors)."""
    from tests.helpers.hf_models import hf_config

    vision = dict(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        image_size=28,
        patch_size=14,
        vision_output_dim=16,
        projector_input_dim=16,
        projector_output_dim=16,
    )
    text = hf_config("llama4_text").to_dict()
    cfg = transformers.Llama4Config(text_config=text, vision_config=vision)
    torch.manual_seed(3)
    model = transformers.Llama4ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    return out


def test_llama4_conditional_generation_directory_gives_its_text_model(tmp_path, capsys) -> None:
    """A released Llama 4 layout: the text model is taken (transformers' logits without
    images, an expert-parallel rank's rows), the vision tower is not, and both the source's
    description and `moetrain import` say so."""
    from moetrain.cli import main

    src = _llama4_released_layout(tmp_path / "vlm")
    cfg, source = resolved(f"checkpoint.init_from={src}")
    assert (source.architecture, source.renames) == ("Llama4ForCausalLM", {"language_model.": ""})
    assert "the vision tower (vision_model.*, multi_modal_projector.*" in source.describe()
    ids = torch.randint(0, 320, (2, 19), generator=torch.Generator().manual_seed(0))
    model = build_model(cfg, source).eval()
    hf = transformers.Llama4ForConditionalGeneration.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        ref, got = hf.eval()(input_ids=ids).logits, model(ids).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    half = build_model(cfg, source, local_experts=(2, 4)).state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(half[name], t[2:4] if ".experts." in name else t), name
    assert main(["import", str(src), str(tmp_path / "ckpt")]) == 0
    printed = capsys.readouterr().out
    assert "text model of a Llama4ForConditionalGeneration directory" in printed
    assert "the vision tower" in printed and "is not taken" in printed
    init = TrainerState.read(tmp_path / "ckpt").init
    assert "vision tower" in init["not_taken"]


def test_llama4_conditional_generation_with_a_foreign_tensor_is_refused(tmp_path) -> None:
    """A tensor neither the text model's nor the vision tower's: refused by name, before
    anything is written."""
    from safetensors.torch import load_file, save_file

    src = _llama4_released_layout(tmp_path / "vlm")
    tensors = load_file(str(src / "model.safetensors"))
    tensors["audio_model.proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"audio_model\.proj\.weight"):
        import_hf_checkpoint(src, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    config = json.loads((src / "config.json").read_text())
    del config["text_config"]
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="text_config"):
        open_init_source(str(src))
