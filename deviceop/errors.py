"""deviceop's exceptions.

Every error deviceop raises derives from :class:`DeviceOpError`, and each
message says what went wrong *and* what to do about it.  The subclasses let a
caller catch one family (``except dop.OwnershipError``) without string matching.
"""
from __future__ import annotations


class DeviceOpError(Exception):
    """Base class of every deviceop exception."""


class CudaError(DeviceOpError):
    """A CUDA driver call failed.  ``call`` names the driver function and
    ``code_name`` the CUDA error (e.g. ``CUDA_ERROR_INVALID_VALUE``)."""

    def __init__(self, call: str, code: int, code_name: str, description: str = "", hint: str = ""):
        self.call, self.code, self.code_name, self.description = call, code, code_name, description
        msg = f"{call} failed with {code_name} ({code})"
        if description:
            msg += f": {description}"
        if hint:
            msg += f". {hint}"
        super().__init__(msg)


class OutOfMemoryError(CudaError):
    """The device could not satisfy an allocation."""


KERNEL_FAULT_ADVICE = ("The CUDA context is now unusable (the error is sticky): restart the process, and find the "
                       "faulting access with `compute-sanitizer --tool memcheck python ...`")


class KernelFaultError(CudaError):
    """A kernel faulted on the device (an illegal or misaligned address, a trap).
    The driver reports it at a later call; ``kernels`` names the kernels the
    execution that was being waited for launched (empty when unknown).  The
    process's CUDA context stays unusable."""

    def __init__(self, call: str, code: int, code_name: str, description: str = "", hint: str = "",
                 kernels=()):
        self.kernels = tuple(kernels)
        super().__init__(call, code, code_name, description, hint)

    def naming(self, what: str, kernels) -> "KernelFaultError":
        """This error, saying which execution and kernels it came from."""
        kernels = list(dict.fromkeys(kernels))
        names = ", ".join(kernels) if kernels else "none recorded"
        return KernelFaultError(self.call, self.code, self.code_name, self.description,
                                f"A kernel launched by {what} faulted; its kernel(s): {names}. {KERNEL_FAULT_ADVICE}",
                                kernels)


class NoDeviceError(DeviceOpError):
    """An operation needs a CUDA device and this process has none."""


class CompileError(DeviceOpError):
    """NVRTC rejected a kernel's source.  ``log`` holds NVRTC's full log."""

    def __init__(self, message: str, log: str = ""):
        self.log = log
        super().__init__(message)


class CapabilityError(DeviceOpError):
    """The driver or device lacks a feature the operation needs (e.g. CUDA
    conditional graph nodes for a captured loop); the message names it."""


class ArchError(DeviceOpError):
    """A requested GPU architecture is unknown or unsupported by this NVRTC."""


class ShapeError(DeviceOpError, ValueError):
    """A tensor's shape does not fit where it is used."""


class DTypeError(DeviceOpError, TypeError):
    """A tensor or scalar has the wrong dtype."""


class LaunchError(DeviceOpError, TypeError):
    """A kernel was launched with arguments of the wrong kind or count,
    or with an impossible launch configuration."""


class OwnershipError(DeviceOpError):
    """A buffer was claimed for writing while another handle can still reach it."""


class AliasingError(DeviceOpError):
    """The same buffer is written and read by one launch."""


class CaptureError(DeviceOpError):
    """Something went wrong while a stream was capturing a graph."""


class CaptureSyncError(CaptureError, CudaError):
    """A host sync that a capture forbids (``stream.synchronize()``,
    ``tensor.numpy()`` ... while capturing; waiting on an event recorded in a
    capture): a CaptureError, and the CudaError the driver reports
    (``code_name``: ``CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`` ...), on the GPU
    and the reference device alike."""

    def __init__(self, message: str, call: str, code: int, code_name: str):
        self.call, self.code, self.code_name, self.description = call, code, code_name, ""
        DeviceOpError.__init__(self, message)


class GraphSafetyError(CaptureError):
    """An op that is not graph-safe (an allocation, a host sync) was recorded."""


class GraphUpdateError(CaptureError):
    """An instantiated graph could not be updated in place (e.g. a recapture
    changed its topology) and re-instantiation was not allowed."""


class ReentrancyError(DeviceOpError):
    """An op was executed from inside another op's execution."""


class StateError(DeviceOpError):
    """An object was used in a state that does not allow it (closed, capturing ...)."""


class DistributedError(DeviceOpError):
    """A multi-rank operation failed (deviceop.distributed): a rank failed, hung
    or disagreed with the others (configs, weights, the collectives it issued),
    a host-side rendezvous timed out, or the communicator was aborted.  Every
    rank gets one within the group's timeout; the message names the ranks and
    the operation.  A group that raised it is aborted: make a new one."""


class UnexecutedOpWarning(RuntimeWarning):
    """An op that does device work (a kernel launch, ``api.memcpy``,
    ``graph.launch()``) was garbage-collected without ever executing and without
    becoming part of a larger op: its work silently never ran, as a coroutine
    never awaited.  A RuntimeWarning, like asyncio's, so it shows by default."""
