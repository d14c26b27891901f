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

from ..errors import ConfigError, DistributedError, NoDeviceError
from ..runtime import driver
from ..runtime.device import CudaDevice, Device
from .args import plain_int
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
        if (rank in env) != (size in env) and launcher != "srun":  # (a batch script's one process has no NTASKS)
            there, missing = (rank, size) if rank in env else (size, rank)
            if rank.startswith(("RANK", "OMPI")):  # torchrun and Open MPI always set both
                raise DistributedError(f"{there}={env[there]!r} is set but {missing} is not: {launcher} sets both; "
                                       f"launch with {launcher}, or set both, or unset {there} for a single process")
        if rank not in env or size not in env:
            continue
        try:
            r, n = int(env[rank]), int(env[size])
        except ValueError:
            raise DistributedError(f"{launcher}'s {rank}={env[rank]!r} / {size}={env[size]!r} are not ints; "
                                   "launch with the launcher's own command (torchrun, mpirun, srun)") from None
        if not 0 <= r < n:
            raise DistributedError(f"{launcher}'s {rank}={r} is not a rank of {size}={n}: need 0 <= {rank} < {size}; "
                                   "launch with the launcher's own command, or fix the variables")
        try:
            lr = int(env.get(local, r))
        except ValueError:
            raise DistributedError(f"{launcher}'s {local}={env[local]!r} is not an int: it names this process's GPU "
                                   f"on its node (0, 1, ...); launch with {launcher}, or fix {local}") from None
        if lr < 0:
            raise DistributedError(f"{launcher}'s {local}={lr} names no GPU: the local rank is 0, 1, ... on each "
                                   f"node; fix {local}")
        return launcher, r, n, lr
    return None


def _local_device(local_rank: int, what: str):
    """GPU ``local_rank``: the one this process drives (one process per GPU)."""
    try:
        return Device(local_rank)
    except NoDeviceError as exc:
        raise DistributedError(f"dist.init: {what}={local_rank} names GPU {local_rank}, but this process sees no GPU "
                               f"by that number ({exc}). One process per GPU: start at most as many processes per node "
                               "as it has GPUs, and check CUDA_VISIBLE_DEVICES") from None


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
    local_var = "local_rank"
    if rank is None and world_size is None:
        if found is None:
            launcher, rank, world_size, env_local = "single process", 0, 1, 0
        else:
            launcher, rank, world_size, env_local = found
            local_var = next(f"{name}'s {loc}" for name, rv, sv, loc in _LAUNCHERS
                             if rv in os.environ and sv in os.environ)
    elif rank is None or world_size is None:
        raise DistributedError("dist.init: pass both rank= and world_size= (or neither, to read the launcher's "
                               "environment: torchrun, mpirun, srun)")
    else:
        launcher, env_local = "explicit", rank if found is None else found[3]
    r, n = plain_int(rank), plain_int(world_size)
    if r is None or n is None or not 0 <= r < n:
        raise DistributedError(f"dist.init: rank {rank!r} of world size {world_size!r} is not a rank of a group; "
                               "need ints with 0 <= rank < world_size")
    rank, world_size = r, n
    if local_rank is None:
        local_rank = env_local
    else:
        local_var, local_rank = "local_rank", plain_int(local_rank)
        if local_rank is None or local_rank < 0:
            raise DistributedError("dist.init: local_rank= names this process's GPU on its node: an int >= 0")
    if device is not None and not isinstance(device, Device):
        ordinal = plain_int(device)
        if ordinal is None:
            raise DistributedError(f"dist.init(device={device!r}): pass a deviceop Device (dop.Device(n)) or its "
                                   "ordinal n, or leave it out for the launcher's local rank's GPU")
        device = _local_device(ordinal, "device")
    if device is None:  # (without a GPU, several ranks are refused below, naming run_reference)
        # whether there are GPUs, asked of the driver: Device(0) would open a context on GPU 0 in every
        # rank's process (each one's memory on GPU 0, whatever GPU the rank drives)
        on_gpu = driver.driver_available()
        device = _local_device(local_rank, local_var) if on_gpu or world_size == 1 else Device(0)
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
