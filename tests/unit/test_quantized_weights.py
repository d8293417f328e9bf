"""Block-quantized releases: DeepSeek's fp8 weights with one scale per block (V3's fp32 scales,
V3.1 / V3.2's powers of two), and DeepSeek-V4's (float8_e8m0fnu scales named ``.scale``, FP4
experts, its released tensor names) read as the model that dequantizing them by a written-out
reference gives: the same weights exactly, transformers' logits on the dequantized model, each
expert-parallel rank reading only its experts (and their scales); a format moetrain does not
read, or a missing or mis-shaped scale, refused by key or by tensor and file before anything is
written."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from moetrain.checkpoint.format import CheckpointError
from moetrain.config import ConfigError, read_config_data
from moetrain.convert.hf_files import HFWeights
from moetrain.convert.importer import import_hf_checkpoint
from moetrain.convert.quantized import Quantization, quantization_of
from moetrain.init_from.source import resolve_config_data
from moetrain.init_from.unit_reads import UnitReads
from moetrain.init_from.weights import build_model
from tests.helpers.hf_models import save_hf_model
from tests.helpers.quantized_release import (
    EXPERT,
    RELEASES,
    SCALE,
    quantize_fp4,
    quantize_fp8,
    reference_fp4,
    reference_fp8,
    v4_released_name,
    write_dequantized,
    write_release,
)

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


# V3.2's powers-of-two scales run with -m long (V4's e8m0 scales cover that reading by default).
LONG_RELEASES = {"deepseek_v32"}


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(f, marks=pytest.mark.long) if f in LONG_RELEASES else f
        for f in sorted(RELEASES)
    ],
)
def release(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """(family, its quantized release, the same model dequantized by the reference, saved as
    transformers saves it)."""
    family, root = request.param, tmp_path_factory.mktemp(request.param)
    overrides = {"moe_intermediate_size": 32} if RELEASES[family].get("fp4") else None
    src = save_hf_model(family, root / "src", overrides=overrides)  # (FP4: 32-column groups)
    reference = write_release(src, root / "release", family)
    return family, root / "release", write_dequantized(src, root / "dequantized", reference)


def resolved(path: Path):
    return resolve_config_data(read_config_data(None, [f"checkpoint.init_from={path}"]))


def test_a_release_reads_as_its_dequantized_model(release, tmp_path, monkeypatch) -> None:
    family, quantized, plain = release
    cfg, source = resolved(quantized)
    assert source.quantization is not None
    assert not [n for n in source.weights().names() if SCALE.search(n)]  # (never unknown tensors)
    model = build_model(cfg, source).eval()
    want = build_model(*resolved(plain)).state_dict()
    got = model.state_dict()
    assert got.keys() == want.keys()
    for name, t in got.items():
        assert torch.equal(t, want[name]), name
    ids = torch.randint(0, 320, (2, 13), generator=torch.Generator().manual_seed(0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    with torch.no_grad():
        ref, ours = hf(input_ids=ids).logits, model(ids).logits
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    assert ref.abs().max() > 1e-2
    # each expert-parallel rank reads its experts and their scales, and no other rank's
    n = cfg.moe.num_experts
    reads: list[str] = []
    read = HFWeights._read
    monkeypatch.setattr(
        HFWeights, "_read", lambda self, rows: reads.extend(rows) or read(self, rows)
    )
    for start, stop in ((0, n // 2), (n // 2, n)):
        reads.clear()
        part = build_model(cfg, source, local_experts=(start, stop)).state_dict()
        for name, t in part.items():
            assert torch.equal(t, want[name][start:stop] if ".experts." in name else want[name])
        experts = {int(EXPERT.search(r).group(1)) for r in reads if EXPERT.search(r)}
        assert experts == set(range(start, stop)), (start, stop)
        assert any(EXPERT.search(r) and SCALE.search(r) for r in reads)
    monkeypatch.undo()
    # the ZeRO-3 build's reads, a block at a time, the second rank's experts
    unit = UnitReads(source, cfg, (n // 2, n))
    for i in range(cfg.model.n_layers):
        names = {k for k in want if k.startswith(f"layers.{i}.") and ".experts." not in k}
        for name, t in unit.read(names, i, True).items():
            assert torch.equal(t, want[name][n // 2 :] if ".experts." in name else want[name])
    if family == "deepseek_v32":
        return  # (its files are read as DeepSeek-V3's: imported below for V3 and V4)
    ckpt = import_hf_checkpoint(quantized, tmp_path / "ckpt")
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["init"]["dequantized"] == source.quantization.describe()
    assert "fp8 in blocks of 16x" in source.describe()
    again = build_model(*resolved(ckpt)).state_dict()
    assert all(torch.equal(t, want[name]) for name, t in again.items())


def test_deepseek_v4_release_names_are_its_files_and_transformers_reads_them(release) -> None:
    """DeepSeek-V4's released names (no ``model.`` prefix, ``embed``, ``attn.kv_norm``,
    ``hc_head_fn``) are the names its layout writes; transformers loads them as its own."""
    family, quantized, plain = release
    if family != "deepseek_v4":
        pytest.skip("DeepSeek-V4's names")
    from moetrain.convert.weight_map import WeightMap

    cfg, source = resolved(quantized)
    weights = WeightMap(cfg, family)
    parts = (None, *weights.moe_layers)
    written = {name for part in parts for name, _, _ in weights.hf_tensors(part)}
    stored = set(source.weights().names())
    assert written == {n for n in stored if not n.startswith("mtp.")}
    assert {"embed.weight", "head.weight", "hc_head_fn", "layers.1.attn.kv_norm.weight"} <= written
    renamed = plain.parent / "released-names"
    shutil.copytree(plain, renamed)
    tensors = safetensors_torch.load_file(plain / "model.safetensors")
    safetensors_torch.save_file(
        {v4_released_name(k): v for k, v in tensors.items()}, renamed / "model.safetensors"
    )
    theirs = transformers.AutoModelForCausalLM.from_pretrained(renamed).state_dict()
    saved = transformers.AutoModelForCausalLM.from_pretrained(plain).state_dict()
    assert all(torch.equal(theirs[k], saved[k]) for k in saved)


def test_any_rows_of_quantized_matrices_read_as_the_reference(tmp_path) -> None:
    """Partial blocks at the edges, stacked matrices, FP4 pairs with e8m0 scales: any rows
    read alone (a matrix's in whole blocks) equal the written-out dequantization."""
    g = torch.Generator().manual_seed(0)
    a, experts = torch.randn(40, 70, generator=g), torch.randn(3, 20, 36, generator=g)
    qa, sa = quantize_fp8(a, (16, 32), False)
    stacked = [quantize_fp8(m, (16, 32), False) for m in experts]
    qd, sd = quantize_fp4(torch.randn(4, 64, generator=g))
    safetensors_torch.save_file(
        {
            "a.weight": qa,
            "a.weight_scale_inv": sa,
            "experts.gate_up_proj": torch.stack([q for q, _ in stacked]),
            "experts.gate_up_proj_scale_inv": torch.stack([s for _, s in stacked]),
            "d.weight": qd,
            "d.scale": sd.to(torch.float8_e8m0fnu),
        },
        tmp_path / "model.safetensors",
    )
    files = HFWeights(tmp_path, quantization=Quantization((16, 32), "ue8m0", "fp4"))
    assert sorted(files.names()) == ["a.weight", "d.weight", "experts.gate_up_proj"]
    assert files.shapes["d.weight"] == (4, 64)
    full = reference_fp8(qa, sa, (16, 32))
    assert full.shape == (40, 70) and not torch.equal(full, qa.float())
    assert not torch.equal(
        reference_fp8(qa, sa.flip(0), (16, 32)), full
    )  # (a misplaced scale shows)
    assert torch.equal(files.load(["a.weight"])["a.weight"], full)
    for start, stop in ((0, 40), (5, 27), (16, 32), (33, 40)):
        assert torch.equal(files.load_rows("a.weight", start, stop), full[start:stop])
    want = torch.stack([reference_fp8(q, s, (16, 32)) for q, s in stacked])
    assert torch.equal(files.load_rows("experts.gate_up_proj", 1, 3), want[1:3])
    fp4 = reference_fp4(qd, sd)
    assert torch.equal(files.load(["d.weight"])["d.weight"], fp4)
    assert torch.equal(files.load_rows("d.weight", 1, 3), fp4[1:3])


BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}


@pytest.mark.parametrize(
    "config, key",
    [
        ({"quant_method": "compressed-tensors"}, "quantization_config.quant_method"),
        ({**BLOCK, "fmt": "e5m2"}, "quantization_config.fmt"),
        ({**BLOCK, "weight_block_size": None}, "quantization_config.weight_block_size"),
        ({**BLOCK, "weight_block_size": [128]}, "quantization_config.weight_block_size"),
        ({**BLOCK, "activation_scheme": "static"}, "quantization_config.activation_scheme"),
        ({**BLOCK, "scale_fmt": "int8"}, "quantization_config.scale_fmt"),
        ({**BLOCK, "expert_dtype": "int4"}, "quantization_config.expert_dtype"),
        ({**BLOCK, "group_size": 32}, "quantization_config.group_size"),
    ],
)
def test_formats_it_does_not_read_are_refused_by_key(config, key) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        quantization_of({"quantization_config": config})


def test_released_configs_are_read() -> None:
    v3 = {"quantization_config": {**BLOCK, "activation_scheme": "dynamic"}}
    assert quantization_of(v3) == Quantization((128, 128))
    v4 = {"expert_dtype": "fp4", "quantization_config": {**BLOCK, "scale_fmt": "ue8m0"}}
    assert quantization_of(v4) == Quantization((128, 128), "ue8m0", "fp4")
    minimax = {"quantization_config": {**BLOCK, "fmt": "float8_e4m3fn"}}
    assert quantization_of({}, minimax) == Quantization((128, 128))  # (inside a wrapper)
    assert quantization_of({}) is None


def _broken(release: Path, out: Path, config=None, tensors=None) -> Path:
    """A copy of ``release`` with its config.json and tensors changed (name -> tensor, None
    drops it)."""
    shutil.copytree(release, out)
    if config is not None:
        (out / "config.json").write_text(
            json.dumps(config(json.loads((out / "config.json").read_text())))
        )
    if tensors:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        files: dict[str, dict[str, torch.Tensor]] = {}
        for name, file in index["weight_map"].items():
            files.setdefault(file, {})[name] = None
        for file in files:
            files[file] = safetensors_torch.load_file(out / file)
        for name, t in tensors.items():
            file = index["weight_map"].setdefault(name, "model-00002-of-00002.safetensors")
            if t is None:
                del files[file][name], index["weight_map"][name]
            else:
                files[file][name] = t
        for file, held in files.items():
            safetensors_torch.save_file(held, out / file)
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def test_bad_releases_are_refused_naming_tensor_and_file(release, tmp_path) -> None:
    family, quantized, _ = release
    if family != "deepseek_v3":
        pytest.skip("one family's files")
    scale = "model.layers.1.self_attn.q_b_proj.weight_scale_inv"  # (64, 12) in blocks of 16
    weight = scale.removesuffix("_scale_inv")
    expert = "model.layers.1.mlp.experts.0.gate_proj.weight"  # (FP4-packed, undeclared)
    no_config = lambda c: {k: v for k, v in c.items() if k != "quantization_config"}  # noqa: E731
    cases = [
        (dict(tensors={scale: None}), rf"tensor {re.escape(weight)} is float8_e4m3fn without"),
        (dict(tensors={scale: torch.ones(4, 2)}), rf"scales {re.escape(scale)} .* needs \[4, 1\]"),
        (dict(config=no_config), "declares no quantization_config"),
        (dict(tensors={"model.norm.weight_scale_inv": torch.ones(1)}), "no float8 weight"),
        (dict(tensors={expert: torch.zeros(24, 16, dtype=torch.int8)}), "expert_dtype is 'fp8'"),
    ]
    for i, (change, match) in enumerate(cases):
        bad = _broken(quantized, tmp_path / f"bad{i}", **change)
        with pytest.raises(CheckpointError, match=match) as e:
            import_hf_checkpoint(bad, tmp_path / f"ckpt{i}")
        assert "model-0000" in str(e.value)  # (the file that holds it)
        assert not (tmp_path / f"ckpt{i}").exists()
    awq = lambda c: c | {"quantization_config": {"quant_method": "awq"}}  # noqa: E731
    with pytest.raises(ConfigError, match=r"quantization_config\.quant_method"):
        resolved(_broken(quantized, tmp_path / "awq", config=awq))
