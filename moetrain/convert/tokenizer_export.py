"""A checkpoint's tokenizer -> Hugging Face tokenizer files with identical ids: a Hugging Face
tokenizer is copied as it is; a SentencePiece model is rebuilt as follows.

Built directly with the ``tokenizers`` library (not ``LlamaTokenizer(vocab_file=...)``, which in
transformers v5 can silently build a 3-token vocab, and whose converter hard-codes Llama's
unk id 0): a BPE model with the SentencePiece vocab and merges, byte fallback, and the
normaliser SentencePiece applies here (identity rules + a dummy ``▁`` prefix + spaces as ``▁``).
Saved as ``tokenizer.json`` + ``tokenizer_config.json`` (class ``PreTrainedTokenizerFast``, so
``AutoTokenizer`` loads the pipeline as written), with ``add_bos_token`` / ``add_eos_token`` set
explicitly to false: moetrain trains on ``sp.encode(text)`` (no BOS) with EOS between documents.
The original ``tokenizer.model`` is copied alongside.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from moetrain.data.errors import DataError
from moetrain.data.tokenizer import MODEL_FILE, Tokenizer, load_tokenizer, tokenizer_files

SPIECE_UNDERLINE = "\u2581"


def _check_supported(tok: Tokenizer) -> bool:
    """Refuse models whose normaliser the exported pipeline does not reproduce; return
    whether a dummy prefix is added."""
    from sentencepiece import sentencepiece_model_pb2 as pb2

    proto = pb2.ModelProto()
    proto.ParseFromString(tok.path.read_bytes())
    t, n = proto.trainer_spec, proto.normalizer_spec
    problems = []
    if t.model_type != pb2.TrainerSpec.BPE:
        problems.append(f"model_type {t.model_type} (only BPE exports)")
    if n.name not in ("identity",) or n.precompiled_charsmap:
        problems.append(f"normalization rule {n.name!r} (only identity exports exactly)")
    if n.remove_extra_whitespaces:
        problems.append("remove_extra_whitespaces=true")
    if t.treat_whitespace_as_suffix:
        problems.append("treat_whitespace_as_suffix=true")
    if problems:
        raise DataError(f"{tok.path}: cannot export to a Hugging Face tokenizer: {problems}")
    return n.add_dummy_prefix


def build_hf_tokenizer(model_path: str | Path):  # noqa: ANN201 (PreTrainedTokenizerFast)
    """A ``PreTrainedTokenizerFast`` giving the same ids as the SentencePiece model."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    tok = Tokenizer(model_path)
    dummy_prefix = _check_supported(tok)
    spec = SentencePieceExtractor(str(tok.path)).extract(models.BPE)
    vocab, merges = spec["vocab"], spec["merges"]
    sp = tok.sp
    unk = sp.id_to_piece(sp.unk_id())
    bpe = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    hf = HFTokenizer(bpe)
    steps = [normalizers.Prepend(SPIECE_UNDERLINE)] if dummy_prefix else []
    hf.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPIECE_UNDERLINE)])
    dec = [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if dummy_prefix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    hf.decoder = decoders.Sequence(dec)
    special = {
        name: sp.id_to_piece(i)
        for name, i in (
            ("bos_token", sp.bos_id()),
            ("eos_token", sp.eos_id()),
            ("unk_token", sp.unk_id()),
            ("pad_token", sp.pad_id()),
        )
        if i >= 0
    }
    # ids exactly as in training: no BOS/EOS added, special pieces in text stay text
    as_trained = {"add_bos_token": False, "add_eos_token": False, "split_special_tokens": True}
    untouched = {"clean_up_tokenization_spaces": False, "model_max_length": int(1e30)}
    return PreTrainedTokenizerFast(tokenizer_object=hf, **as_trained, **untouched, **special)


def export_tokenizer(model_path: str | Path, out_dir: str | Path) -> list[Path]:
    """Write ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json`` and a
    copy of ``tokenizer.model`` into ``out_dir``; returns the written paths. A Hugging Face
    tokenizer (``model_path`` a ``tokenizer.json``) is copied as it is, with the files that
    configure it: the converted model tokenizes exactly as the data was tokenized."""
    out_dir = Path(out_dir)
    if load_tokenizer(model_path).kind == "huggingface":
        written = []
        for f in tokenizer_files(model_path):
            shutil.copyfile(f, out_dir / f.name)
            written.append(out_dir / f.name)
        return written
    fast = build_hf_tokenizer(model_path)
    written = [Path(p) for p in fast.save_pretrained(str(out_dir))]
    cfg_file = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(
        tokenizer_class="PreTrainedTokenizerFast",
        add_bos_token=False,
        add_eos_token=False,
        split_special_tokens=True,
    )
    cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")
    src = Tokenizer(model_path).path
    shutil.copyfile(src, out_dir / MODEL_FILE)  # the SentencePiece model, for slow tokenizers
    written.append(out_dir / MODEL_FILE)
    return sorted(set(written))
