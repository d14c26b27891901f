"""The runtime layer: devices, streams, events, modules and the launch primitive.

A thin layer over ``cuda.bindings.driver``; everything above it (tensors, ops,
graphs) talks to CUDA only through here.
"""
from .device import CudaDevice, Device, ReferenceDevice, current_device
from .driver import check, driver_available, driver_version, probe
from .launch import Function, LaunchConfig, ptr
from .module import CudaModule, load_module
from .stream import CudaEvent, CudaStream, Event, ReferenceEvent, ReferenceStream, Stream

__all__ = ["CudaDevice", "Device", "ReferenceDevice", "current_device", "check", "driver_available",
           "driver_version", "probe", "Function", "LaunchConfig", "ptr", "CudaModule", "load_module",
           "CudaEvent", "CudaStream", "Event", "ReferenceEvent", "ReferenceStream", "Stream"]
