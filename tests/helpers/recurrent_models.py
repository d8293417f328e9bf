"""Checks every recurrent token mixer's hybrid model passes (Gated DeltaNet, Kimi Delta
Attention, Mamba-2 beside full attention): packed documents, generation from the recurrent
state, activation checkpointing and bf16, and the plan's saved-activation counts. Each takes the
test's config and its ``randomise`` (every parameter away from its constant initialisation);
:func:`check_family_both_ways` checks a hybrid family against transformers' model."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from moetrain.config import Config
from moetrain.generate import generate_ids
from moetrain.model import Transformer
from moetrain.parallel.apply import checkpoint_blocks
from moetrain.plan import activation_bytes_per_token, head_bytes_per_token
from tests.helpers.memory import saved_storages

Randomise = Callable[[torch.nn.Module], None]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference relative to ``b``'s largest value."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check_packed_documents(cfg: Config, randomise: Randomise, lengths: list[int]) -> None:
    """A row of documents of ``lengths``: logits and every parameter's gradient equal those of
    the documents run one by one; without document ids (the control) they do not."""
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.moe)
    randomise(model)
    ids = torch.randint(0, 64, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)

    def run(ids: torch.Tensor, docs: torch.Tensor | None) -> tuple[torch.Tensor, list]:
        model.zero_grad()
        logits = model(ids, doc_ids_BS=docs).logits
        logits.square().sum().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    packed, packed_grads = run(ids, doc_ids)
    alone, grads = [], None
    for piece in ids.split(lengths, dim=1):
        logits, g = run(piece, None)
        alone.append(logits)
        grads = g if grads is None else [a + b for a, b in zip(grads, g, strict=True)]
    assert rel(packed, torch.cat(alone, dim=1)) <= 1e-5
    for (name, _), a, b in zip(model.named_parameters(), packed_grads, grads, strict=True):
        assert rel(a, b) <= 1e-4, name
    leaked, _ = run(ids, None)  # control: the state and window carried across documents
    assert rel(leaked, torch.cat(alone, dim=1)) > 1e-2


def check_generation(model: Transformer, prompt_len: int, split: tuple[int, int]) -> None:
    """8 greedy tokens from a ``prompt_len`` prompt equal greedy decoding by full recomputation,
    and the logits of a prefill of ``split[0]`` tokens, then ``split[0]:split[1]`` continuing the
    state, then one token at a time, equal the full sequence's."""
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 64, (prompt_len,), generator=gen).tolist()
    new = generate_ids(model, prompt, max_new_tokens=8, temperature=0)
    seq = list(prompt)
    a, b = split
    with torch.no_grad():
        for _ in range(8):  # greedy by full recomputation
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert seq[len(prompt) :] == new
        full = model(torch.tensor([seq])).logits
        cache = model.new_cache(1, len(seq))
        first = model(torch.tensor([seq[:a]]), cache=cache).logits
        second = model(torch.tensor([seq[a:b]]), cache=cache).logits
        rest = [model(torch.tensor([[t]]), cache=cache).logits for t in seq[b:]]
    assert rel(torch.cat([first, second, *rest], dim=1), full) <= 1e-5


def check_checkpointing_and_bf16(cfg: Config, randomise: Randomise) -> None:
    """Activation checkpointing changes no loss or gradient; bf16 runs, finite, near fp32."""
    torch.manual_seed(4)
    model = Transformer(cfg.model, cfg.moe)
    randomise(model)
    ids, labels = torch.randint(0, 64, (2, 96)), torch.randint(0, 64, (2, 96))
    doc_ids = torch.tensor([[0] * 40 + [1] * 56, [0] * 96])

    def grads(m: Transformer) -> tuple[float, list[torch.Tensor]]:
        m.zero_grad()
        loss = m(ids, doc_ids_BS=doc_ids, labels_BS=labels, return_logits=False).loss
        loss.backward()
        return loss.item(), [p.grad.float().clone() for p in m.parameters()]

    loss, ref = grads(model)
    half = Transformer(cfg.model, cfg.moe)
    half.load_state_dict(model.state_dict())
    checkpoint_blocks(model)
    loss_ckpt, ckpt = grads(model)
    assert loss_ckpt == pytest.approx(loss, rel=1e-6)
    assert all(rel(a, b) <= 1e-5 for a, b in zip(ckpt, ref, strict=True))
    loss_bf16, bf16 = grads(half.to(torch.bfloat16))
    assert loss_bf16 == pytest.approx(loss, rel=2e-2)
    assert all(torch.isfinite(g).all() for g in bf16)


def check_plan_saved_tensors(cfg: Config, dtype: torch.dtype) -> None:
    """The whole model's saved tensors on 4 rows of ``data.seq_len`` against the plan's
    per-layer counts."""
    model = Transformer(cfg.model, cfg.moe).to(dtype)
    ids = torch.randint(0, 64, (4, cfg.data.seq_len))
    with saved_storages([*model.parameters(), *model.buffers()]) as seen:
        model(ids, labels_BS=ids, return_logits=False)
    a = 4 if dtype == torch.float32 else 2
    tokens = ids.numel()
    predicted = sum(activation_bytes_per_token(cfg, i, a) for i in range(cfg.model.n_layers))
    predicted += head_bytes_per_token(cfg, a) - 16  # (the labels are the ids here)
    predicted += 4 * cfg.model.vocab_size * cfg.model.d_model / tokens  # chunked loss
    assert sum(seen.values()) / tokens == pytest.approx(predicted, rel=0.01)


def check_family_both_ways(
    cfg: Config,
    model: Transformer,
    hf: torch.nn.Module,
    family: str,
    ids: torch.Tensor,
    lengths: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hf`` (transformers' model of ``model``'s export) gives ``model``'s logits on ``ids``,
    transformers' weights imported back give them too, and ``model``'s packed first row of
    documents of ``lengths`` equals each document through ``hf`` alone (1e-5 of the logits'
    scale, fp32). Returns (hf's logits, the documents' logits through hf, concatenated)."""
    from moetrain.convert.hf import from_hf_state_dict

    def close(got: torch.Tensor, ref: torch.Tensor) -> None:
        assert ref.abs().max() > 0.1
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))

    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        close(model(ids).logits, ref)
        imported = Transformer(cfg.model, cfg.moe).eval()
        imported.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg, family))
        close(imported(ids).logits, ref)
        docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
        packed = model(ids[:1], doc_ids_BS=docs).logits
        alone = torch.cat([hf(input_ids=p).logits for p in ids[:1].split(lengths, dim=1)], dim=1)
        close(packed, alone)
    return ref, alone
