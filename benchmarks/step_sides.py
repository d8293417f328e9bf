"""The two sides of a training step compared in one process (``v4_step.py``,
``qwen3_next_step.py``): moetrain's model and the family's transformers class loaded from one
saved source model (``family_source.py``), the same batch of ``bench``'s shape, and one
forward + backward of each returning its first cross-entropy."""

from __future__ import annotations

from pathlib import Path

from family_source import save_family_source
from train_throughput import MICRO, SHAPES

RUNS = Path(__file__).resolve().parent.parent / "runs" / "bench-command"


def load_sides(family: str, attn_implementation: str):  # noqa: ANN201
    """(moetrain's Transformer, the transformers model, token ids (MICRO, seq + 1))."""
    import torch
    import transformers

    from moetrain.convert.importer import load_hf_state_dict
    from moetrain.model import Transformer

    source = save_family_source(family, RUNS / f"family-{family}")
    state, cfg = load_hf_state_dict(source)
    ours = Transformer(cfg.model, cfg.moe)
    ours.load_state_dict(state, strict=False)
    peer = transformers.AutoModelForCausalLM.from_pretrained(
        source, attn_implementation=attn_implementation
    )
    seq, vocab = SHAPES["bench"]["seq"], cfg.model.vocab_size
    ids = torch.randint(0, vocab, (MICRO, seq + 1), generator=torch.Generator().manual_seed(0))
    return ours, peer, ids


def moetrain_step(ours, ids) -> float:  # noqa: ANN001
    """One forward + backward of moetrain's model; its cross-entropy."""
    out = ours(ids[:, :-1], labels_BS=ids[:, 1:])
    out.loss.backward()
    return out.ce_loss.item()


def peer_step(peer, ids) -> float:  # noqa: ANN001
    """One forward + backward of the transformers model; its cross-entropy."""
    import torch

    logits = peer(input_ids=ids[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.item()
