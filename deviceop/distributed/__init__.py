"""deviceop.distributed: one process per GPU, communicators through NCCL
(nccl4py), collectives as DeviceOps, and a reference backend of thread-ranks
for machines without a GPU.  docs/distributed.md is the guide.

    import deviceop.distributed as dist
    with dist.init() as group:                 # torchrun, mpirun, srun, or explicit rank/world_size
        op = dist.all_reduce(group, x)         # lazy, like a kernel launch
        op.sync_on(group.stream)               # or captured: graph_on, CudaGraph.scope, dop.while_

    dist.run_reference(2, fn)                  # fn(group) on 2 thread-ranks, NumPy (CPU CI)
"""
from ..errors import DistributedError
from .group import Group, GroupClosedError, fingerprint
from .launch import init
from .ops import Collective, all_gather, all_reduce, broadcast, recv, reduce_scatter, send
from .peer import PeerBuffers
from .reference import run_reference

__all__ = ["DistributedError", "Group", "GroupClosedError", "fingerprint", "init", "Collective", "all_gather",
           "all_reduce", "broadcast", "recv", "reduce_scatter", "send", "run_reference", "PeerBuffers"]
