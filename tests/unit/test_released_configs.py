"""Released model configurations (``tests/fixtures/released_configs/<model_type>/``: each
model's ``config.json`` as released, its flags kept and only its sizes shrunk; where each comes
from is in ``PROVENANCE.md`` there). Each is built by transformers as the release is stored
(random weights, bf16 safetensors, the released ``config.json`` with its legacy keys), then:

- a registered MoE family: imported (``moetrain import``) with transformers' logits on the same
  weights in fp32, and exported (``moetrain convert``) to a directory transformers loads with
  the same logits;
- a registered dense family: upcycled on import to 8 experts, top-2, computing the dense model,
  and exported to an MoE class that computes it too (refused where none does:
  :data:`NO_MOE_CLASS`);
- a family moetrain does not register: refused on import, naming its architecture.

Adding a family means adding its released configs: every registered family has one here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from moetrain.checkpoint.read import load_model
from moetrain.config import ConfigError
from moetrain.convert import formats
from moetrain.convert.export import convert_checkpoint
from moetrain.convert.families import FAMILIES, of_hf_config, unwrap, wrapper_of
from moetrain.convert.importer import import_hf_checkpoint
from moetrain.init_from.source import open_init_source
from moetrain.model import Transformer
from moetrain.model.cpu_matmul import use_cpu_matmul
from tests.helpers.hf_models import save_hf_tokenizer
from tests.helpers.random_constants import randomise_constants

transformers = pytest.importorskip("transformers")

CORPUS = Path(__file__).parents[1] / "fixtures" / "released_configs"
FILES = sorted(CORPUS.glob("*/*.json"))
UPCYCLE = ["moe.num_experts=8", "moe.top_k=2"]
# registered families without a released checkpoint known for certain (tiny configs only)
NO_RELEASE = {"granitemoeshared": "no released GraniteMoeSharedForCausalLM checkpoint is known"}
# dense families whose upcycled model no transformers MoE class computes (its export is refused)
NO_MOE_CLASS = {
    "olmo_hybrid": "Gated DeltaNet with negative eigenvalues beside post-norm attention layers"
}
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# routing keys that transformers' classes do not all read but serving engines do (vLLM's
# DeepSeek model takes the selection bias only with topk_method noaux_tc): an export writes
# them as the release does
ROUTING_KEYS = (
    "topk_method",
    "scoring_func",
    "n_group",
    "topk_group",
    "norm_topk_prob",
    "routed_scaling_factor",
    "moe_layer_freq",
)

# routing keys released as null that transformers' config writes as the value it reads them as
# (MiMo-V2-Flash's routed_scaling_factor)
NULL_AS = {"routed_scaling_factor": 1.0}


def _id(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


@pytest.fixture(autouse=True)
def torch_matmul():
    """moetrain multiplies with transformers' kernel (torch's) here, so that only the models'
    computations differ: oneDNN's inner product, moetrain's default on CPU, sums in another
    order, which moves the Gated DeltaNet hybrids' logits (weights x 4, strong decays, unit
    L2-normalised keys of small vectors) by up to 2e-5 of their scale."""
    use_cpu_matmul("torch")
    yield
    use_cpu_matmul("onednn")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    return save_hf_tokenizer(["def f(x):\n    return x + 1  # ü"] * 20, 300, out)


def _fits(hf: dict[str, Any]) -> dict[str, Any]:
    """The released config with the special-token ids that fall outside the shrunk vocabulary
    unset (an embedding's padding index must be one of its rows; a wrapper's in its family's
    config)."""
    w = wrapper_of(hf)
    if w is not None:
        return {**hf, w.config_key: _fits(hf[w.config_key])}

    def inside(v: Any) -> bool:
        return all(i < hf["vocab_size"] for i in (v if isinstance(v, list) else [v]))

    return {k: (v if k not in TOKEN_IDS or v is None or inside(v) else None) for k, v in hf.items()}


def transformers_type(hf: dict[str, Any]) -> str:
    """The model_type transformers builds ``hf`` as: its own, or for a release whose
    model_type transformers does not register (Kimi K2's ``kimi_k2``, a DeepSeek-V3
    architecture) its family's."""
    own = hf["model_type"]
    return own if own in transformers.CONFIG_MAPPING else of_hf_config(hf).name


def transformers_config(hf: dict[str, Any]) -> Any:
    return formats.transformers_config(hf, transformers_type(hf))


def save_released(hf: dict[str, Any], out: Path, tokenizer: Path) -> Path:
    """A random model of the released config ``hf`` saved as the release stores it: bf16
    safetensors and the released ``config.json`` itself, no tensor left constant (norms,
    biases, selection biases, a zero-initialised router: a dropped or swapped one shows)."""
    hf = _fits(hf)
    config = transformers_config(hf)
    torch.manual_seed(0)
    # a larger class holding the family's model (a vision tower beside it) is saved as it is
    auto = transformers.AutoModelForImageTextToText if wrapper_of(hf) else None
    model = (auto or transformers.AutoModelForCausalLM).from_config(config)
    drawn = set(randomise_constants(model))  # no tensor left constant (random_constants.py)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):  # Gated DeltaNet's decay
                p.uniform_(-1.0, 1.5)
            elif p.dim() >= 2 and name not in drawn:  # logits well above bf16's rounding
                p.mul_(4.0)
    model.to(torch.bfloat16).save_pretrained(out)
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    for f in tokenizer.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


def hf_logits(path: Path, ids: torch.Tensor) -> tuple[str, torch.Tensor]:
    """transformers' class and fp32 logits for the model directory ``path``."""
    config = transformers_config(json.loads((path / "config.json").read_text()))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        return type(hf).__name__, hf(input_ids=ids).logits


def close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal to 1e-5 of the logits' scale (fp32)."""
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("path", FILES, ids=_id)
def test_released_config_imports_and_exports_with_transformers_logits(
    path: Path, tokenizer: Path, tmp_path: Path
) -> None:
    hf = json.loads(path.read_text())
    assert transformers_type(hf) == path.parent.name
    arch = hf["architectures"][0]
    fam = of_hf_config(hf)
    if fam is None:  # the family is not registered (yet): refused by name, nothing written
        (tmp_path / "src").mkdir()
        (tmp_path / "src" / "config.json").write_text(json.dumps(hf))
        with pytest.raises(ConfigError, match=f"architecture '{arch}'.*not supported"):
            open_init_source(str(tmp_path / "src"))
        return
    src = save_released(hf, tmp_path / "src", tokenizer)
    vocab = unwrap(hf)["vocab_size"]
    ids = torch.randint(0, vocab, (2, 13), generator=torch.Generator().manual_seed(0))
    _, ref = hf_logits(src, ids)
    ckpt = import_hf_checkpoint(src, tmp_path / "ckpt", overrides=UPCYCLE if fam.dense else None)
    model, cfg = load_model(ckpt)
    with torch.no_grad():
        close(model.eval()(ids).logits, ref)
    if fam.dense:
        assert len(model.moe_layers()) == cfg.model.n_layers  # every FFN upcycled
    if fam.name in NO_MOE_CLASS:
        with pytest.raises(ConfigError, match="no Hugging Face class computes"):
            convert_checkpoint(ckpt, tmp_path / "hf")
        return
    out = convert_checkpoint(ckpt, tmp_path / "hf")
    exported, again = hf_logits(out, ids)
    written = json.loads((out / "config.json").read_text())
    target = of_hf_config(written)
    assert exported == target.architecture and not target.dense
    assert fam.dense or target is fam  # (its transformers class: Phi's remote-code name differs)
    # the class name as released (Phi-3.5-MoE's PhiMoEForCausalLM, vLLM's name for it), which
    # transformers loads as its own class (above)
    released_name = fam.architecture if wrapper_of(hf) else arch  # (an export is the text model)
    assert fam.dense or written["architectures"] == [released_name]
    released = {k: hf[k] for k in ROUTING_KEYS if k in hf and not fam.dense}
    released |= {k: v for k, v in NULL_AS.items() if k in released and released[k] is None}
    assert {k: written.get(k) for k in released} == released
    close(again, ref)


LLAMA4 = sorted(CORPUS.glob("llama4_text/*.json"))


@pytest.mark.long  # (the tiny Llama 4 case of test_convert_logits.py binds each in the default suite)
@pytest.mark.parametrize("path", LLAMA4, ids=_id)
def test_llama4_released_configs_where_chunks_and_temperature_bind(
    path: Path, tokenizer: Path, tmp_path: Path
) -> None:
    """Llama 4's shrunk chunk and temperature floor (32 positions) bind only past the test
    above's 13 tokens: 70 tokens (three chunks, the NoPE layer's temperature at 1 and 2
    floors) imported with transformers' logits."""
    hf = json.loads(path.read_text())
    assert hf["attention_chunk_size"] == hf["floor_scale"] == 32
    src = save_released(hf, tmp_path / "src", tokenizer)
    ids = torch.randint(0, hf["vocab_size"], (1, 70), generator=torch.Generator().manual_seed(1))
    _, ref = hf_logits(src, ids)
    model, cfg = load_model(import_hf_checkpoint(src, tmp_path / "ckpt"))
    assert cfg.model.attention_chunk_size == 32 and cfg.model.nope_layers == [3]
    with torch.no_grad():
        got = model.eval()(ids).logits
        close(got, ref)
        for off in (  # each binds here: without it, other logits
            {"attention_chunk_size": None, "layer_types": None},
            {"attn_temperature_floor": None, "attn_temperature_scale": None},
        ):
            plain = Transformer(dataclasses.replace(cfg.model, **off), cfg.moe).eval()
            plain.load_state_dict(model.state_dict())
            assert (plain(ids).logits - got).abs().max() > 1e-3 * ref.abs().max(), off


@pytest.mark.long  # (test_convert_rope.py's Phi-3.5-MoE case binds it past 32 positions)
def test_phi_moe_continues_past_its_original_context(tokenizer: Path, tmp_path: Path) -> None:
    """Phi-3.5-MoE's LongRoPE past original_max_position_embeddings (4096, as released), as
    transformers 5.25's class computes it (the short factors kept, times long_mscale): 4100
    tokens imported with transformers' logits. (The fixture's factors, the released lists'
    first eight, are all 1.0: the two regimes coincide here.)"""
    hf = json.loads((CORPUS / "phimoe" / "Phi-3.5-MoE-instruct.json").read_text())
    assert hf["rope_scaling"]["original_max_position_embeddings"] == 4096
    src = save_released(hf, tmp_path / "src", tokenizer)
    ids = torch.randint(0, hf["vocab_size"], (1, 4100), generator=torch.Generator().manual_seed(2))
    _, ref = hf_logits(src, ids)
    model, cfg = load_model(import_hf_checkpoint(src, tmp_path / "ckpt"))
    assert cfg.model.rope_long_regime == "short"
    with torch.no_grad():
        close(model.eval()(ids).logits, ref)


def test_every_registered_family_has_a_released_config() -> None:
    """Adding a family means adding its released configs (or saying why there is none)."""
    families = [of_hf_config(json.loads(p.read_text())) for p in FILES]  # (a wrapper's too)
    have = {f.name for f in families if f is not None}
    assert set(NO_RELEASE) <= set(FAMILIES) and not set(NO_RELEASE) & have
    assert set(FAMILIES) - set(NO_RELEASE) <= have, set(FAMILIES) - set(NO_RELEASE) - have
    listed = (CORPUS / "PROVENANCE.md").read_text()
    for p in FILES:
        assert f"`{_id(p)}.json`" in listed, f"{_id(p)}.json has no line in PROVENANCE.md"
