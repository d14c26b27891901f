"""deviceop: compose GPU work lazily, replay it as CUDA graphs.

This package's layers, bottom up, each importing only those below it
(docs/architecture.md): ``runtime`` (devices, streams, events, modules, the
launch primitive, the driver's graph work, and the reference device behind
the same interface), ``tensor`` and ``compile``, the op algebra (``op``,
``api``), ``kernel`` (declarations and the launch plan), ``graph`` (CudaGraph,
Scope, nodes, loops, GraphCache, GraphModel).  ``deviceop.kernels`` (the
kernel library, the ``kernels/`` folder) and ``examples/`` sit above them all.
"""


def _serve_the_kernels_folder() -> None:
    """In a source checkout, serve the top-level ``kernels/`` folder as ``deviceop.kernels``.

    The kernel library is imported as ``deviceop.kernels`` because a top-level
    ``kernels`` would collide with Hugging Face's PyPI package of that name.  A
    wheel and an editable install map the folder there (pyproject's package-dir);
    a bare checkout on PYTHONPATH (as scripts/gpu-check runs) has only this
    finder, which answers for that one name and nothing else.
    """
    import importlib.machinery
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    if (here / "kernels").is_dir() or not (here.parent / "kernels" / "__init__.py").is_file():
        return  # installed from a wheel (deviceop/kernels is there), or no kernel library beside this package
    folder = str(here.parent / "kernels")

    class KernelsFolder:
        kernels_folder = folder

        @staticmethod
        def find_spec(name, path=None, target=None):
            # PathFinder names the spec deviceop.kernels and searches submodules in the folder
            return importlib.machinery.PathFinder.find_spec(name, [str(here.parent)]) \
                if name == "deviceop.kernels" else None

    # first, so that the kernels beside this deviceop win over another checkout's editable install
    sys.meta_path[:] = [KernelsFolder] + [f for f in sys.meta_path if not hasattr(f, "kernels_folder")]


_serve_the_kernels_folder()
del _serve_the_kernels_folder
from . import dtypes
from .compile import CompiledProgram, cache_dir, compile_cubin, nvrtc_version
from .dtypes import (DType, bfloat16, bool_, dtype, float16, float32, float64, int8, int16, int32, int64,
                     uint8, uint32, uint64)
from .errors import (AliasingError, ArchError, CapabilityError, CaptureError, CompileError, ConfigError, CudaError,
                     DeviceOpError, DistributedError, DTypeError, GraphSafetyError, GraphUpdateError, KernelFaultError, LaunchError,
                     NoDeviceError, OutOfMemoryError, OwnershipError, ReentrancyError, ShapeError, StateError,
                     UnexecutedOpWarning)
from .runtime import (CudaDevice, CudaStream, Device, Event, Function, LaunchConfig, ReferenceDevice,
                      ReferenceStream, Stream, load_module, ptr)
from .tensor import Partition, SharedTensor, Tensor
from .interop import as_tensor, empty, from_dlpack, from_numpy, zeros
from .op import DeviceOp, DeviceOpVec, ExecutionContext, SharedOp, shared, value, zip_
from . import api
from .foreign import ForeignOp, HostCallback, foreign, host_callback
from .kernel import In, InOut, Kernel, KernelLaunch, Out, Scalar, precompile
from .graph import (CacheStats, ChildGraphNode, CudaGraph, GraphCache, GraphLaunch, GraphModel, KernelNode, MemcpyNode,
                    MemsetNode, Module, Scope, SwitchGraphCache, Workspace, default_sizes, if_, loop, switch, while_)

__version__ = "0.1.0"

__all__ = [
    "dtypes", "CompiledProgram", "cache_dir", "compile_cubin", "nvrtc_version",
    "DType", "bfloat16", "bool_", "dtype", "float16", "float32", "float64", "int8", "int16", "int32",
    "int64", "uint8", "uint32", "uint64",
    "AliasingError", "ArchError", "CapabilityError", "CaptureError", "CompileError", "ConfigError", "CudaError",
    "DeviceOpError",
    "DistributedError", "DTypeError", "GraphSafetyError", "GraphUpdateError", "KernelFaultError", "LaunchError", "NoDeviceError",
    "OutOfMemoryError",
    "OwnershipError", "ReentrancyError", "ShapeError", "StateError", "UnexecutedOpWarning",
    "CudaDevice", "CudaStream", "Device", "Event", "Function", "LaunchConfig", "ReferenceDevice",
    "ReferenceStream", "Stream", "load_module", "ptr",
    "Partition", "SharedTensor", "Tensor", "as_tensor", "empty", "from_dlpack", "from_numpy", "zeros",
    "DeviceOp", "DeviceOpVec", "ExecutionContext", "SharedOp", "shared", "value", "zip_",
    "ForeignOp", "HostCallback", "foreign", "host_callback",
    "In", "InOut", "Kernel", "KernelLaunch", "KernelNode", "MemcpyNode", "MemsetNode", "Out", "Scalar", "api",
    "precompile",
    "ChildGraphNode", "CudaGraph", "GraphLaunch", "GraphModel", "Module", "Scope",
    "CacheStats", "GraphCache", "SwitchGraphCache", "Workspace", "default_sizes", "if_", "loop", "switch", "while_",
]
zip = zip_  # dop.zip(...) reads like the seed's zip!; the builtin is untouched outside this namespace
