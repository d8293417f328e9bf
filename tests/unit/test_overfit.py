"""One process, torch AdamW: the MoE transformer memorises a small fixed batch."""

from __future__ import annotations

import torch

from moetrain.model import Transformer
from tests.helpers.configs import tiny_config


def test_overfits_a_fixed_batch() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add contention on a shared machine
    try:
        torch.manual_seed(0)
        cfg = tiny_config(
            model__dense_hidden=1024,
            model__max_seq_len=32,
            moe__expert_hidden=32,
            moe__num_shared_experts=1,
        )
        model = Transformer(cfg.model, cfg.moe).train()
        ids = torch.randint(0, 64, (2, 16))
        labels = torch.roll(ids, -1, dims=1)
        labels[:, -1] = -100
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        losses = []
        for _ in range(80):
            out = model(ids, labels_BS=labels)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            opt.step()
            losses.append(out.ce_loss.item())
    finally:
        torch.set_num_threads(threads)
    assert losses[0] > 3.5  # ~ln(64) = 4.16 at init
    assert losses[-1] < 0.1, losses[-10:]
    assert all(torch.isfinite(s.aux_loss) for s in out.moe)
