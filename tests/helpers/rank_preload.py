"""What every rank of :func:`tests.helpers.distributed.run_distributed` imports, loaded once.

The ranks are forked from one server process (multiprocessing's forkserver) that imports this
module first, so each rank starts with torch, DeepSpeed and moetrain's training modules already
imported and DeepSpeed's shm comm op already loaded (DeepSpeed caches loaded ops per process:
``deepspeed.comm`` then takes it from that cache instead of running ninja and loading it again).
Started one by one, each rank spent seconds of CPU on the same imports. Nothing here computes
or starts a thread: the server only imports, and every rank sets its own threads and process
group after the fork.
"""

from __future__ import annotations

import torch  # noqa: F401
import torch._dynamo  # noqa: F401  (imported by every optimizer's first step)
import torch.distributed  # noqa: F401
from deepspeed.accelerator import get_accelerator
from deepspeed.ops import __compatible_ops__
from deepspeed.runtime.zero.utils import is_zero_supported_optimizer  # noqa: F401

import moetrain.train.trainer  # noqa: F401

# DeepSpeed's ZeRO code imports this module in every rank (it imports torch's compiler: ~1.5
# CPU-s): the engine's optimizer check, BF16_Optimizer and stage 3 when built, ZeRO-1/2 at the
# first gradient-bucket reduction
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401  # isort: skip

_SHM = get_accelerator().create_op_builder("ShareMemCommBuilder")
if _SHM is not None and __compatible_ops__.get(_SHM.NAME, False):
    _SHM.load(verbose=False)  # as deepspeed.comm.torch.build_shm_op loads it
