"""The runtime layer: devices, streams, events, modules, the launch primitive
and the driver's graph work.

A thin layer over ``cuda.bindings.driver``; everything above it (tensors, ops,
graphs) talks to CUDA only through here.  The reference device
(``reference.py``) implements the same interface on the host.
"""
from .device import CudaDevice, Device, Event, current_device, load_module
from .driver import check, driver_available, driver_version, probe
from .launch import Function, LaunchConfig, ptr
from .module import CudaModule
from .reference import ReferenceDevice, ReferenceEvent, ReferenceStream
from .stream import CudaEvent, CudaStream, Stream

__all__ = ["CudaDevice", "Device", "ReferenceDevice", "current_device", "check", "driver_available",
           "driver_version", "probe", "Function", "LaunchConfig", "ptr", "CudaModule", "load_module",
           "CudaEvent", "CudaStream", "Event", "ReferenceEvent", "ReferenceStream", "Stream"]
