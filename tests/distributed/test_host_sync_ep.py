"""Host syncs of one expert-parallel MoE layer (2 gloo ranks), counted on CPU by the ops that
would make a CUDA host wait: exactly one per forward (the split sizes of the all-to-all), with or
without capacity drops, and one more when activation checkpointing runs the forward again."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.slow

D = 8


def _job(rank: int, world: int) -> dict[str, dict[str, int]]:
    from torch.utils.checkpoint import checkpoint

    from moetrain.config import MoEConfig
    from moetrain.model.cpu_matmul import use_cpu_matmul
    from moetrain.model.moe.layer import MoELayer
    from moetrain.monitor.host_sync import HostSyncCounter
    from moetrain.parallel.expert_parallel import AllToAllDispatcher, slice_experts

    # the counts stand for a CUDA run: torch's kernels, as on a GPU (the CPU-only oneDNN path
    # reads the expert offsets on the host, where nothing waits)
    use_cpu_matmul("torch")
    out = {}
    for name, cf, recompute in [
        ("dropless", 0.0, False),
        ("capacity", 1.0, False),
        ("dropless_checkpointed", 0.0, True),
    ]:
        torch.manual_seed(0)
        cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=16, capacity_factor=cf)
        layer = MoELayer(cfg, D)
        slice_experts(layer.experts, 2 * rank, 2 * rank + 2)
        layer.dispatcher = AllToAllDispatcher(4, world, rank, None)
        x = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        with HostSyncCounter() as c:
            if recompute:
                y = checkpoint(lambda h, m=layer: m(h)[0], x, use_reentrant=False)
            else:
                y = layer(x)[0]
            y.square().sum().backward()
        assert x.grad is not None and layer.experts.w13.grad is not None
        out[name] = dict(c.counts)
    return out


def test_one_host_sync_per_expert_parallel_layer() -> None:
    for counts in run_distributed(_job, 2):
        assert counts == {
            "dropless": {"tolist": 1},
            "capacity": {"tolist": 1},
            "dropless_checkpointed": {"tolist": 2},
        }
