"""Process layout: world = data-parallel x expert-parallel (x sequence-parallel); the only place
that creates groups.

Every rank reads its own data, so all ``world_size`` ranks are data-parallel for the dense
(non-expert) weights. Expert-parallel groups are blocks of ``ep_size`` consecutive ranks that
together hold every expert once; each expert is replicated over ``world_size // ep_size`` ranks
(its expert-data-parallel group). Example, world 4, ep 2::

    expert-parallel groups       [0, 1], [2, 3]   (all-to-all of routed tokens)
    expert-data-parallel groups  [0, 2], [1, 3]   (gradient reduction of expert weights)
    data-parallel group          [0, 1, 2, 3]     (gradient reduction of dense weights)

Sequence parallelism (``parallel.sp_size``) groups blocks of ``sp_size`` consecutive ranks that
hold consecutive slices of the same sequences (:mod:`moetrain.parallel.sequence_parallel`): the
loader's data-parallel rank is ``rank // sp_size`` of ``world_size // sp_size``
(:attr:`Topology.data_rank`, :attr:`Topology.data_world`), and every rank still counts as a
data-parallel rank for the gradient reduction (each rank's loss is the mean over its own
tokens, so DeepSpeed's average over every rank is the mean over the global batch). SP and EP
groups are both blocks of consecutive ranks, so with ``sp_size == ep_size`` they are the same
ranks. Example, world 4, sp 2, ep 2: SP groups and EP groups ``[0, 1], [2, 3]``, the loader's
data-parallel ranks 0, 0, 1, 1.

The groups are created through ``deepspeed.utils.groups._create_expert_and_data_parallel`` so
that DeepSpeed's engine and ZeRO optimizer reduce expert gradients over the same groups.

Every group honours ``parallel.timeout_minutes``: the default group gets it directly, and the
groups DeepSpeed creates later (``dist.new_group(ranks)`` without a timeout: the expert groups,
the engine's data-parallel clone of the world) take torch's default for new groups, which is
set to the same value first. Under torchrun's shared agent store the process group starts in a
namespace of its own (:mod:`moetrain.parallel.rendezvous`), so an in-place restart round never
reads what a killed round left in the store. A :class:`~moetrain.parallel.watchdog.RankWatch`
keeps each rank's heartbeat and phase in the store, to name the missing rank when a collective
fails.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from moetrain.config import Config
from moetrain.config.layout import check_layout
from moetrain.parallel.rendezvous import agent_store, agent_store_in_use, fresh_namespace
from moetrain.parallel.watchdog import CollectiveFailure, RankWatch
from moetrain.rank_env import read_rank_env


@dataclass
class Topology:
    """Ranks, sizes and process groups of one run (build with :func:`init_distributed`)."""

    rank: int
    world_size: int
    local_rank: int
    ep_size: int
    backend: str
    device: torch.device
    sp_size: int = 1  # sequence-parallel ranks per group (consecutive ranks)
    sp_group: Any = field(repr=False, default=None)  # this rank's sequence-parallel group
    ep_group: Any = field(repr=False, default=None)  # ranks holding different experts
    expert_dp_group: Any = field(repr=False, default=None)  # ranks holding the same experts
    created_process_group: bool = False
    watch: RankWatch | None = field(repr=False, default=None)  # heartbeat + phase (world > 1)
    nodes: tuple[int, ...] = ()  # node index of every rank (empty: all on one node)

    @property
    def dp_size(self) -> int:
        """Data-parallel size for dense weights and data sharding (every rank)."""
        return self.world_size

    @property
    def sp_rank(self) -> int:
        """This rank's index in its sequence-parallel group (its slice of every sequence)."""
        return self.rank % self.sp_size

    def sp_ranks(self) -> list[int]:
        base = self.rank - self.sp_rank
        return list(range(base, base + self.sp_size))

    @property
    def data_rank(self) -> int:
        """The loader's data-parallel rank: the sequence-parallel group's index."""
        return self.rank // self.sp_size

    @property
    def data_world(self) -> int:
        """The loader's data-parallel world: the number of sequence-parallel groups."""
        return self.world_size // self.sp_size

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_size

    @property
    def expert_dp_size(self) -> int:
        return self.world_size // self.ep_size

    @property
    def ep_group_name(self) -> str:
        """DeepSpeed's name for the expert groups (``param.group_name`` of expert weights)."""
        return f"ep_size_{self.ep_size}"

    def local_experts(self, num_experts: int) -> tuple[int, int]:
        """Global expert ids ``[start, stop)`` held by this rank."""
        n_local = num_experts // self.ep_size
        return self.ep_rank * n_local, (self.ep_rank + 1) * n_local

    def ep_ranks(self) -> list[int]:
        base = self.rank - self.ep_rank
        return list(range(base, base + self.ep_size))

    def expert_dp_ranks(self) -> list[int]:
        return list(range(self.ep_rank, self.world_size, self.ep_size))

    def ep_nodes(self) -> list[int]:
        """The node of each rank of this rank's expert-parallel group."""
        if not self.nodes:
            return [0] * self.ep_size
        return [self.nodes[r] for r in self.ep_ranks()]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def phase(self, what: str) -> None:
        """Record what this rank is doing (named by the watchdog if a collective fails)."""
        if self.watch is not None:
            self.watch.phase(what)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def honour_timeout_in_new_groups(timeout: timedelta) -> None:
    """Make ``timeout`` torch's default for groups created without one (DeepSpeed's)."""
    c10d = dist.distributed_c10d
    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
        if not hasattr(c10d, name):
            raise RuntimeError(
                f"torch.distributed.distributed_c10d.{name} is gone in torch {torch.__version__}: "
                "moetrain cannot give DeepSpeed's process groups parallel.timeout_minutes"
            )
        setattr(c10d, name, timeout)


def _start_process_group(backend: str, timeout: timedelta, device: torch.device | None) -> None:
    """``init_process_group`` from the launcher's environment; under the shared agent store of
    torchrun in a namespace of this launch's own (see the module docstring)."""
    if not agent_store_in_use():
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device)
        return
    env = read_rank_env()
    rank, world = env.rank, env.world_size
    base = agent_store(timeout)
    namespace = fresh_namespace(base, rank, world, timeout)
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"{namespace}/", base),
        rank=rank,
        world_size=world,
        timeout=timeout,
        device_id=device,
    )


def node_map() -> tuple[int, ...]:
    """The node index of every rank (numbered in order of their first rank): ranks share a node
    when they run on the same host under the same launcher agent (torchrun's ``GROUP_RANK``,
    so two torchrun agents on one machine count as two nodes). A collective: every rank calls it.
    """
    key = f"{socket.gethostname()}/{read_rank_env().agent}"
    keys: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, key)
    first: dict[str, int] = {}
    return tuple(first.setdefault(k, len(first)) for k in keys)


def init_distributed(cfg: Config) -> Topology:
    """Validate the layout, start (or join) the process group and create the EP groups.

    Works under torchrun, ``deepspeed``, ``accelerate launch`` and as a plain single process
    (a one-rank group on a free local port). Backend: NCCL on CUDA, gloo otherwise.
    """
    world = dist.get_world_size() if dist.is_initialized() else read_rank_env().world_size
    check_layout(cfg, world)

    created = False
    timeout = timedelta(minutes=cfg.parallel.timeout_minutes)
    honour_timeout_in_new_groups(timeout)
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            if world != 1:
                raise RuntimeError(
                    "WORLD_SIZE > 1 but MASTER_PORT is not set: start with a launcher"
                )
            os.environ["MASTER_PORT"] = str(_free_port())
        local_rank = read_rank_env().local_rank
        if use_cuda:
            torch.cuda.set_device(local_rank)
        _start_process_group(
            backend, timeout, torch.device("cuda", local_rank) if use_cuda else None
        )
        created = True
    else:
        backend = dist.get_backend()
    local_rank = read_rank_env().local_rank
    device = torch.device("cpu")
    if use_cuda and backend == "nccl":
        device = torch.device("cuda", local_rank)
        # also when a launcher started the group: kernels, NCCL and new tensors without an
        # explicit device use the current one, which is otherwise GPU 0 on every rank
        torch.cuda.set_device(device)

    import deepspeed
    from deepspeed.utils import groups, logger

    if not os.environ.get("MOETRAIN_DEEPSPEED_INFO"):
        logger.setLevel(logging.WARNING)  # DeepSpeed's per-rank INFO lines drown the progress
    ep, sp = cfg.parallel.ep_size, cfg.parallel.sp_size
    name = f"ep_size_{ep}"
    sp_group = None
    try:
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
        if name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(ep)
        if sp > 1:  # every rank creates every group, in the same order
            me = dist.get_rank()
            for base in range(0, dist.get_world_size(), sp):
                g = dist.new_group(list(range(base, base + sp)))
                if base <= me < base + sp:
                    sp_group = g
    except dist.DistError as e:  # a peer late beyond the timeout, or gone
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CollectiveFailure(
            f"rank {dist.get_rank()}: creating the expert-parallel groups failed: a rank did not "
            f"arrive within parallel.timeout_minutes={cfg.parallel.timeout_minutes:g} or went "
            f"away ({type(e).__name__}: {first})"
        ) from e
    topo = Topology(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        ep_size=ep,
        backend=backend,
        device=device,
        sp_size=sp,
        sp_group=sp_group,
        ep_group=groups._get_expert_parallel_group(name),
        expert_dp_group=groups._get_expert_data_parallel_group(name),
        created_process_group=created,
        nodes=node_map(),
    )
    if topo.world_size > 1:
        store = dist.distributed_c10d._get_default_store()
        topo.watch = RankWatch(store, topo.rank, topo.world_size).start()
    # DeepSpeed's own layout must be the one documented above.
    ds_ep = list(groups._get_expert_parallel_group_ranks(name))
    ds_edp = list(groups._get_expert_data_parallel_group_ranks(name))
    if ds_ep != topo.ep_ranks() or ds_edp != topo.expert_dp_ranks():
        raise RuntimeError(
            f"DeepSpeed created expert-parallel ranks {ds_ep} / expert-data-parallel ranks "
            f"{ds_edp}; moetrain expects {topo.ep_ranks()} / {topo.expert_dp_ranks()}"
        )
    return topo


def shutdown(topo: Topology | None, clean: bool = True) -> None:
    """Stop the heartbeat and destroy the process group if :func:`init_distributed` created it.

    ``clean``: every rank got here normally, so wait for the others first; after a failure the
    group may be broken and a barrier would only wait for the timeout.
    """
    if topo is None:
        return
    if topo.watch is not None:
        topo.watch.stop()
    if topo.created_process_group and dist.is_initialized():
        try:
            if clean:
                dist.barrier()
        finally:
            dist.destroy_process_group()
