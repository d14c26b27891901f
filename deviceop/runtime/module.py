"""Loaded CUBINs (``cuModuleLoadData``) and the kernels in them.

Load modules before a capture begins: loading is a context-wide operation
that a capturing stream in global mode refuses.  The kernel layer loads every
module when an op is built, never while it is being captured.
"""
from __future__ import annotations

from cuda.bindings import driver as cu

from ..errors import ArchError, CudaError
from .driver import check, error_name
from .launch import Function


def _arch_numbers(arch: str) -> tuple[int, int]:
    digits = "".join(ch for ch in arch.removeprefix("sm_") if ch.isdigit())
    return int(digits[:-1]), int(digits[-1])


class CudaModule:
    """One CUBIN loaded on one device; kept alive by every Function taken from it."""

    def __init__(self, device, program):
        device.require_gpu("loading a CUBIN")
        major, minor = _arch_numbers(program.arch)
        dmajor, dminor = device.compute_capability
        if major != dmajor or minor > dminor:
            raise ArchError(f"this CUBIN was compiled for {program.arch} but the device is {device.arch} "
                            f"({device.name}); compile with arch={device.arch!r} (the default)")
        self.device, self.program = device, program
        device.bind()
        self.handle = check(cu.cuModuleLoadData(program.cubin), "cuModuleLoadData")

    def get_function(self, name: str, signature, *, label: str | None = None, symbol: str | None = None):
        """The kernel ``name`` (an ``extern "C"`` name or a name expression
        given to the compile), launched with the argument ``signature``.  ``symbol``: its
        symbol as the asking program maps it (programs of one binary share the module, each
        with the names of its own kernel)."""
        symbol = symbol or self.program.symbol(name)
        code, handle = cu.cuModuleGetFunction(self.handle, symbol.encode())
        if code:
            known = ", ".join(self.program.lowered_names) or "none"
            raise CudaError(f"cuModuleGetFunction({name!r})", int(code), error_name(code),
                            f"no kernel {name!r} in this module (name expressions compiled: {known})",
                            'declare the kernel extern "C", or pass its template instantiation '
                            "as a name expression when compiling")
        return Function(self, handle, label or name, signature)

    def __del__(self):
        try:
            cu.cuModuleUnload(self.handle)
        except Exception:
            pass
