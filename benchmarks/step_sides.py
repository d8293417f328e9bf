"""The two sides of a training step compared in one process (``v4_step.py``,
``qwen3_next_step.py``): moetrain's model and the family's transformers class loaded from one
saved source model (``family_source.py``), the same batch of ``bench``'s shape, one forward +
backward of each returning its first cross-entropy, and the tools to time or profile a block
of either alone (its calls captured from one step and replayed)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
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


def _first(out):  # noqa: ANN001, ANN202
    """A module's main output tensor (modules return tuples of it and statistics)."""
    return out[0] if isinstance(out, tuple) else out


class Captured:
    """A module's call as the step made it: its positional and keyword arguments, the floating
    tensors detached as fresh leaves, and a fixed gradient for its output."""

    def __init__(self, module, args: tuple, kwargs: dict, out) -> None:  # noqa: ANN001
        import torch

        def leaf(x):  # noqa: ANN001, ANN202
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad:
                return x.detach().requires_grad_(True)
            return x

        self.module, self.args = module, tuple(leaf(a) for a in args)
        self.kwargs = {k: leaf(v) for k, v in kwargs.items()}
        gen = torch.Generator().manual_seed(1)
        self.grad = torch.randn(_first(out).shape, generator=gen, dtype=_first(out).dtype)

    def run(self) -> None:
        _first(self.module(*self.args, **self.kwargs)).backward(self.grad)


def capture(model, modules: dict[str, list], step: Callable[[], float]) -> dict[str, list]:  # noqa: ANN001
    """Each named module's call in one step of ``step``."""
    calls: dict[str, list[Captured]] = {name: [] for name in modules}
    hooks = []
    for name, mods in modules.items():
        for m in mods:

            def hook(mod, args, kwargs, out, name=name) -> None:  # noqa: ANN001
                calls[name].append(Captured(mod, args, kwargs, out))

            hooks.append(m.register_forward_hook(hook, with_kwargs=True))
    step()
    for h in hooks:
        h.remove()
    model.zero_grad(set_to_none=True)
    return calls


def cpu_ms(fn: Callable[[], object]) -> float:
    c = time.process_time()
    fn()
    return (time.process_time() - c) * 1e3


def compare_blocks(
    sides: dict[str, tuple], blocks: tuple[str, ...], rounds: int, profile: str | None
) -> None:
    """Per side (name -> (model, {block: [modules]}, step)): the first cross-entropy, then
    ``rounds`` rounds of the whole step and each block alone (its modules' calls in one step,
    replayed: forward and backward, summed), CPU time; printed as medians and the peer /
    moetrain ratio per block. ``profile``: a block's (or the ``step``'s) op table first."""
    print("first cross-entropy:", {k: round(s[2](), 7) for k, s in sides.items()})
    calls = {name: capture(*side) for name, side in sides.items()}
    for side_calls in calls.values():  # (warm-up)
        for cs in side_calls.values():
            for c in cs:
                c.run()
    if profile:
        profile_block(calls, {name: side[2] for name, side in sides.items()}, profile)
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for name, (model, _, step) in sides.items():
            times.setdefault((name, "step"), []).append(cpu_ms(step))
            model.zero_grad(set_to_none=True)
            for block, cs in calls[name].items():
                times.setdefault((name, block), []).append(sum(cpu_ms(c.run) for c in cs))
    if not rounds:
        return
    print(f"\nCPU ms per step, medians of {rounds} rounds; peer / moetrain per round")
    print("| block | moetrain | peer | peer / moetrain |")
    print("|---|---:|---:|---:|")
    for block in ("step", *blocks):
        m, p = times["moetrain", block], times["peer", block]
        ratios = [b / a for a, b in zip(m, p, strict=True)]
        print(
            f"| {block} | {statistics.median(m):.1f} | {statistics.median(p):.1f} | "
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x) |"
        )


def profile_block(
    calls: dict[str, dict[str, list]], steps: dict[str, Callable[[], float]], block: str
) -> None:
    """The op table of ``block`` (or the whole ``step``) on each side, by self CPU time; for
    the step also by total CPU time (where the top-level ops' time goes)."""
    from torch.profiler import ProfilerActivity, profile

    for name, side_calls in calls.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            if block == "step":
                steps[name]()
            else:
                for c in side_calls[block]:
                    c.run()
        print(f"\n{name}, {block}, forward and backward:")
        table = prof.key_averages().table
        print(table(sort_by="self_cpu_time_total", row_limit=30))
        if block == "step":
            print(table(sort_by="cpu_time_total", row_limit=40))
