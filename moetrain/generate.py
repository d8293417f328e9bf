"""Text generation with a KV cache from a moetrain checkpoint or a converted HF directory.

Prompts are encoded as in training (the tokenizer's ``encode(text)``, as ``prepare`` encodes a
document; documents end with EOS), and
an empty prompt starts after an EOS, i.e. at a document boundary. Generation stops at EOS, after
``max_new_tokens`` or at ``model.max_seq_len``. ``temperature = 0`` is greedy; otherwise logits
are divided by the temperature, cut to the ``top_k`` largest (0 = all) and to the smallest set
whose probability reaches ``top_p`` (1 = all), and sampled with a generator seeded by ``seed``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moetrain.data.tokenizer import AnyTokenizer, load_tokenizer
from moetrain.model.transformer import Transformer


def load_for_generation(path: str | Path) -> tuple[Transformer, AnyTokenizer]:
    """``(model in eval mode, tokenizer)`` from a checkpoint dir or a Hugging Face model dir."""
    from moetrain.checkpoint.format import STATE_FILE, TOKENIZER_FILE, tokenizer_path

    path = Path(path)
    if (path / STATE_FILE).is_file():
        from moetrain.checkpoint.read import load_model

        model, _ = load_model(path)
    elif (path / "config.json").is_file():
        from moetrain.convert.importer import load_hf_state_dict

        state, cfg = load_hf_state_dict(path)
        model = Transformer(cfg.model, cfg.moe)
        model.load_state_dict({k: v.float() for k, v in state.items()})
    else:
        raise FileNotFoundError(
            f"{path}: neither a moetrain checkpoint ({STATE_FILE}) nor a Hugging Face "
            "model directory (config.json)"
        )
    if tokenizer_path(path) is None:
        raise FileNotFoundError(f"{path}: no tokenizer ({TOKENIZER_FILE} or tokenizer.json)")
    return model.eval(), load_tokenizer(path)


def sample_next(
    logits_BV: torch.Tensor,
    temperature: float,
    top_p: float,
    top_k: int,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Next token ids (B,) from last-position logits."""
    logits_BV = logits_BV.float()
    if temperature == 0:
        return logits_BV.argmax(-1)
    logits_BV = logits_BV / temperature
    if 0 < top_k < logits_BV.shape[-1]:
        kth = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    if top_p < 1.0:
        sorted_BV, order_BV = torch.sort(logits_BV, descending=True, dim=-1)
        probs_BV = sorted_BV.softmax(-1)
        drop_BV = probs_BV.cumsum(-1) - probs_BV >= top_p  # keep until the mass reaches top_p
        sorted_BV = sorted_BV.masked_fill(drop_BV, float("-inf"))
        logits_BV = torch.full_like(logits_BV, float("-inf")).scatter(-1, order_BV, sorted_BV)
    probs_BV = logits_BV.softmax(-1)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def generate_ids(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    eos_id: int | None = None,
) -> list[int]:
    """New token ids after ``prompt_ids`` (an EOS, if produced, is the last one)."""
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0 or max_new_tokens < 0:
        raise ValueError(
            f"need temperature >= 0, 0 < top_p <= 1, top_k >= 0, max_new_tokens >= 0; got "
            f"{temperature}, {top_p}, {top_k}, {max_new_tokens}"
        )
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    max_len = model.cfg.max_seq_len
    if len(prompt_ids) >= max_len:
        raise ValueError(
            f"prompt has {len(prompt_ids)} tokens; the model computes {max_len} positions "
            "(model.max_seq_len)"
        )
    budget = min(max_new_tokens, max_len - len(prompt_ids))
    device = model.embed.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = model.new_cache(1, len(prompt_ids) + budget)
    x = torch.tensor([prompt_ids], device=device)
    out: list[int] = []
    for _ in range(budget):
        logits = model(x, cache=cache).logits[:, -1]
        nxt = sample_next(logits, temperature, top_p, top_k, gen)
        out.append(int(nxt[0]))
        if eos_id is not None and out[-1] == eos_id:
            break
        x = nxt[:, None]
    return out


def generate_text(
    path: str | Path,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
) -> str:
    """The completion of ``prompt`` (without the prompt) by the model at ``path`` (a moetrain
    checkpoint directory or a converted Hugging Face directory)."""
    model, tok = load_for_generation(path)
    ids = tok.encode(prompt) or [tok.eos_id]
    new = generate_ids(model, ids, max_new_tokens, temperature, top_p, top_k, seed, tok.eos_id)
    if new and new[-1] == tok.eos_id:
        new = new[:-1]
    head, full = tok.decode(ids), tok.decode(ids + new)  # keeps the space before a new word
    return full[len(head) :] if full.startswith(head) else tok.decode(new)
