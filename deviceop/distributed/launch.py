"""From the launcher's environment to a Group: who this process is (rank,
world size, local rank), which GPU it drives, and how ranks meet on the host.

| launcher | rank, world size, local rank | how ranks meet (the store) |
|---|---|---|
| torchrun | RANK, WORLD_SIZE, LOCAL_RANK | torch's TCPStore at MASTER_ADDR:MASTER_PORT (our own TCP store without torch) |
| mpirun (Open MPI) | OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK | MASTER_ADDR/PORT if set, else rank 0's address through mpi4py |
| srun (SLURM) | SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID | MASTER_ADDR:MASTER_PORT (the batch script exports them) |
| explicit | ``init(rank=, world_size=, store=)`` | ``store``: a directory path (a file store), ``"tcp://host:port"``, or a Store |

One process per GPU: the rank's device is GPU ``local_rank`` (its visible
GPUs; ``device=`` overrides).  Without a GPU only a one-rank group exists
here (the reference backend); several thread-ranks are ``run_reference``.
"""
from __future__ import annotations

import os

from ..errors import ConfigError, DistributedError
from ..runtime.device import CudaDevice, Device
from .group import check_timeout

DEFAULT_TIMEOUT = 120.0  # seconds; DEVICEOP_DIST_TIMEOUT overrides (NCCL's init over a network can take tens)
# Multicast (NVLS) stays off in every process deviceop starts or joins: it can take a shared host's GPUs out
# of service (the project's rule); the launcher should set these too, before NCCL is loaded.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

_LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("mpirun", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),  # MPICH / Intel MPI
    ("srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)


def from_environment(env=None) -> tuple[str, int, int, int] | None:
    """``(launcher, rank, world_size, local_rank)`` from the launcher's variables, or None."""
    env = os.environ if env is None else env
    for launcher, rank, size, local in _LAUNCHERS:
        if rank in env and size in env:
            try:
                r, n = int(env[rank]), int(env[size])
                lr = int(env.get(local, r))
            except ValueError:
                raise DistributedError(f"{launcher}'s {rank}={env[rank]!r} / {size}={env[size]!r} are not ints; "
                                       "launch with the launcher's own command (torchrun, mpirun, srun)") from None
            return launcher, r, n, lr
    return None


def _timeout(timeout) -> float:
    if timeout is None:
        text = os.environ.get("DEVICEOP_DIST_TIMEOUT")
        if text is None:
            return DEFAULT_TIMEOUT
        try:
            return check_timeout(float(text), "DEVICEOP_DIST_TIMEOUT")
        except (ValueError, DistributedError):
            raise ConfigError(f"DEVICEOP_DIST_TIMEOUT={text!r}: give the seconds every wait for another rank may "
                              f"take, a finite positive number (unset: {DEFAULT_TIMEOUT:g})") from None
    return check_timeout(timeout, "dist.init")


def init(*, rank: int | None = None, world_size: int | None = None, local_rank: int | None = None,
         store=None, device=None, backend: str | None = None, timeout: float | None = None):
    """This process's Group.  With no arguments, reads torchrun's, mpirun's or SLURM's
    environment (see the module docstring); with ``rank=`` and ``world_size=``, those
    (and ``store=``: a directory every rank can reach, ``"tcp://host:port"``, or a Store).
    ``backend``: ``"nccl"`` (the default on a GPU) or ``"reference"`` (one rank, no GPU).
    ``timeout`` (seconds, default 120 or ``DEVICEOP_DIST_TIMEOUT``) bounds every wait
    for other ranks.  Use it as ``with dist.init() as group:``."""
    for key, value in NO_MULTICAST.items():
        os.environ.setdefault(key, value)
    timeout = _timeout(timeout)
    found = from_environment()
    if rank is None and world_size is None:
        if found is None:
            launcher, rank, world_size, env_local = "single process", 0, 1, 0
        else:
            launcher, rank, world_size, env_local = found
    elif rank is None or world_size is None:
        raise DistributedError("dist.init: pass both rank= and world_size= (or neither, to read the launcher's "
                               "environment: torchrun, mpirun, srun)")
    else:
        launcher, env_local = "explicit", rank if found is None else found[3]
    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        raise DistributedError(f"dist.init: rank {rank!r} of world size {world_size!r} is not a rank of a group; "
                               "need 0 <= rank < world_size")
    local_rank = env_local if local_rank is None else local_rank
    if device is None:
        device = Device(local_rank) if isinstance(Device(0), CudaDevice) else Device(0)
    backend = backend or ("nccl" if isinstance(device, CudaDevice) else "reference")
    if backend == "reference":
        if world_size != 1:
            raise DistributedError(
                f"dist.init: {world_size} ranks need GPUs (NCCL), and {device.label} is the reference device: "
                "several ranks without a GPU are threads of one process: dist.run_reference(world_size, fn)")
        from .hub import Hub
        from .reference import reference_group
        return reference_group(0, Hub(1, timeout), device=device)
    if backend != "nccl":
        raise DistributedError(f"dist.init: unknown backend {backend!r}; use 'nccl' (GPUs) or 'reference'")
    device.require_gpu("the NCCL backend")
    from .nccl import nccl_group
    from .store import open_store
    store = open_store(store, launcher, rank, world_size, timeout)
    return nccl_group(rank, world_size, device, store, timeout, launcher)
