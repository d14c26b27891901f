"""deviceop: compose GPU work lazily, replay it as CUDA graphs.

This package's layers, bottom up, each importing only those below it
(docs/architecture.md): ``runtime`` (devices, streams, events, modules, the
launch primitive, the driver's graph work, and the reference device behind
the same interface), ``tensor`` and ``compile``, the op algebra (``op``,
``api``), ``kernel`` (declarations and the launch plan), ``graph`` (CudaGraph,
Scope, nodes, loops, GraphCache, GraphModel).  ``kernels/`` and ``examples/``
use only what this module exports.
"""
from . import dtypes
from .compile import CompiledProgram, cache_dir, compile_cubin, nvrtc_version
from .dtypes import (DType, bfloat16, bool_, dtype, float16, float32, float64, int8, int16, int32, int64,
                     uint8, uint32, uint64)
from .errors import (AliasingError, ArchError, CapabilityError, CaptureError, CompileError, CudaError,
                     DeviceOpError, DTypeError, GraphSafetyError, GraphUpdateError, KernelFaultError, LaunchError,
                     NoDeviceError, OutOfMemoryError, OwnershipError, ReentrancyError, ShapeError, StateError,
                     UnexecutedOpWarning)
from .runtime import (CudaDevice, CudaStream, Device, Event, Function, LaunchConfig, ReferenceDevice,
                      ReferenceStream, Stream, load_module, ptr)
from .tensor import Partition, SharedTensor, Tensor
from .interop import as_tensor, empty, from_dlpack, from_numpy, zeros
from .op import DeviceOp, DeviceOpVec, ExecutionContext, SharedOp, shared, value, zip_
from . import api
from .kernel import In, Kernel, KernelLaunch, Out, Scalar, precompile
from .graph import (CacheStats, CudaGraph, GraphCache, GraphLaunch, GraphModel, KernelNode, Module, Scope, Workspace,
                    default_sizes, loop, while_)

__version__ = "0.1.0"

__all__ = [
    "dtypes", "CompiledProgram", "cache_dir", "compile_cubin", "nvrtc_version",
    "DType", "bfloat16", "bool_", "dtype", "float16", "float32", "float64", "int8", "int16", "int32",
    "int64", "uint8", "uint32", "uint64",
    "AliasingError", "ArchError", "CapabilityError", "CaptureError", "CompileError", "CudaError", "DeviceOpError",
    "DTypeError", "GraphSafetyError", "GraphUpdateError", "KernelFaultError", "LaunchError", "NoDeviceError",
    "OutOfMemoryError",
    "OwnershipError", "ReentrancyError", "ShapeError", "StateError", "UnexecutedOpWarning",
    "CudaDevice", "CudaStream", "Device", "Event", "Function", "LaunchConfig", "ReferenceDevice",
    "ReferenceStream", "Stream", "load_module", "ptr",
    "Partition", "SharedTensor", "Tensor", "as_tensor", "empty", "from_dlpack", "from_numpy", "zeros",
    "DeviceOp", "DeviceOpVec", "ExecutionContext", "SharedOp", "shared", "value", "zip_",
    "In", "Kernel", "KernelLaunch", "KernelNode", "Out", "Scalar", "api", "precompile",
    "CudaGraph", "GraphLaunch", "GraphModel", "Module", "Scope",
    "CacheStats", "GraphCache", "Workspace", "default_sizes", "loop", "while_",
]
zip = zip_  # dop.zip(...) reads like the seed's zip!; the builtin is untouched outside this namespace
