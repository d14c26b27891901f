"""Peer memory: a device buffer that other processes' GPUs of the same machine
store into directly (NVLink or PCIe peer access), through CUDA IPC.

``device.peer_memory(nbytes)`` returns one (the reference device returns its
host twin, runtime/reference.py's ``HostPeerMemory``, with the same methods):

    mem = device.peer_memory(nbytes)   # zeroed; mem.address is this rank's buffer
    ident = mem.export()               # picklable: hand it to the other ranks
    addresses = mem.open(idents, rank) # every rank's buffer, mapped here, in rank order
    mem.release(barrier)               # unmap the peers', barrier(), free this one

The buffer is cuMemAlloc'd (IPC exports only such memory, not CuPy's pool
sub-allocations) and stays outside deviceop's tensors: its lifetime is the
ranks' agreement, which ``release`` keeps with a barrier between unmapping and
freeing.
"""
from __future__ import annotations

import ctypes
import os

from cuda.bindings import driver as cu

from ..errors import DistributedError
from .driver import check

_HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE


class IpcPeerMemory:
    def __init__(self, device, nbytes: int):
        self.device, self.nbytes = device, nbytes
        device.bind()
        self.address = int(check(cu.cuMemAlloc(nbytes), "cuMemAlloc"))
        self._opened: list[int] = []
        check(cu.cuMemsetD32(self.address, 0, nbytes // 4), "cuMemsetD32")
        check(cu.cuCtxSynchronize(), "cuCtxSynchronize")  # zero before any peer can store into it

    def export(self):
        handle = check(cu.cuIpcGetMemHandle(self.address), "cuIpcGetMemHandle")
        return (os.getpid(), ctypes.string_at(handle.getPtr(), _HANDLE_BYTES))

    def open(self, idents, rank: int) -> list[int]:
        """Map every other rank's buffer (``idents``: every rank's ``export()``, in rank order)."""
        addresses = []
        for r, (pid, raw) in enumerate(idents):
            if r == rank:
                addresses.append(self.address)
                continue
            if pid == os.getpid():
                raise DistributedError("peer memory needs one process per GPU (CUDA IPC cannot map a buffer into "
                                       "the process that made it); launch with torchrun or mpirun")
            handle = cu.CUipcMemHandle()
            ctypes.memmove(handle.getPtr(), raw, _HANDLE_BYTES)
            code, ptr = cu.cuIpcOpenMemHandle(handle, cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
            if code:
                raise DistributedError(f"cannot map rank {r}'s peer memory on {self.device.label} "
                                       f"(cuIpcOpenMemHandle: {code.name}): these GPUs have no peer access to "
                                       "each other; use NCCL's path (algorithm='nccl')")
            self._opened.append(int(ptr))
            addresses.append(int(ptr))
        return addresses

    def release(self, barrier) -> None:
        """Unmap the peers' buffers, wait at ``barrier`` until every rank has, free this one.
        ``barrier=None`` (the ranks cannot meet any more): leak it, since a peer might still
        store into it."""
        if barrier is None:
            return
        self.device.bind()
        for p in self._opened:
            check(cu.cuIpcCloseMemHandle(p), "cuIpcCloseMemHandle")
        self._opened = []
        barrier()
        check(cu.cuMemFree(self.address), "cuMemFree")
