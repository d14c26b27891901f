"""The kernel launch primitive: a kernel, a launch shape and typed arguments.

A :class:`Function` knows its parameter list (its *signature*): ``ptr`` for a
device pointer (optionally of one dtype: ``ptr("float32")``) or a dtype for a
scalar.  The signature is checked against the CUBIN's own parameter layout
(``cuFuncGetParamInfo``) when the function is loaded, so a declaration that
disagrees with the kernel fails there rather than corrupting a launch
(``check_param_layout``: the reference device applies the same rule to the
layout it reads from the CUBIN).

At launch the arguments are converted (Tensor → device pointer, number →
the declared scalar type, range- and kind-checked), packed with one
``struct.pack_into`` into a buffer whose parameter addresses were computed
once, and handed to ``cuLaunchKernel``.  This is the whole hot path.

Which ``cuLaunchKernel`` wrapper Python calls matters as much as anything
deviceop does: on the H100's host, CuPy's (``launchKernel``: typed C ints in,
one C call) took 4.45 us a launch, cuda.bindings' 5.4-5.7 and cuda.core's
``launch`` 5.8, with the same prepacked parameters (2026-11-22;
``bench/launch_overhead.py`` measures them side by side).  Launches without
attributes use CuPy's (a dependency already);
PDL, cooperative and cluster launches need ``cuLaunchKernelEx``'s attribute
list and go through cuda.bindings.
"""
from __future__ import annotations

import ctypes
import struct
import threading
from functools import partial

from cuda.bindings import driver as cu

from ..dtypes import dtype as as_dtype
from ..errors import CudaError, DTypeError, LaunchError, StateError
from .driver import check, raise_error


class DriverCallError(Exception):
    """A cuLaunchKernel through cuda.bindings failed with ``status`` (a CUresult)."""

    def __init__(self, status):
        super().__init__(status)
        self.status = status


def _bindings_launch_kernel(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
    code = cu.cuLaunchKernel(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra)[0]
    if code:
        raise DriverCallError(code)


def _cheapest_launch_kernel():
    """``(launch_kernel, error type)``: the cuLaunchKernel launches without
    attributes call, ``launch_kernel(function, gx, gy, gz, bx, by, bz, smem,
    stream, params, extra)`` with every argument an int (see the module docstring)."""
    try:
        from cupy_backends.cuda.api.driver import CUDADriverError, launchKernel
    except ImportError:  # pragma: no cover - CuPy is a dependency; this keeps a broken install launching
        return _bindings_launch_kernel, DriverCallError
    return launchKernel, CUDADriverError


# Module globals (tests put a recorder here): launch_kernel is read when a Function
# builds its launchers and prepared launches, DriverError when a launch fails.
launch_kernel, DriverError = _cheapest_launch_kernel()


class ptr:
    """A device-pointer kernel parameter; ``ptr("float32")`` also checks the tensor's dtype."""

    __slots__ = ("dtype",)

    def __init__(self, dtype=None):
        self.dtype = None if dtype is None else as_dtype(dtype)

    def __repr__(self) -> str:
        return "ptr" if self.dtype is None else f"ptr({self.dtype.name})"

    def __eq__(self, other):
        return isinstance(other, ptr) and other.dtype == self.dtype

    def __hash__(self):
        return hash(("ptr", self.dtype))


def _normalize_param(spec):
    if spec is ptr:
        return ptr()
    if isinstance(spec, ptr):
        return spec
    if isinstance(spec, str) and spec in ("ptr", "pointer", "void*"):
        return ptr()
    try:
        return as_dtype(spec)
    except DTypeError:
        raise LaunchError(f"cannot read kernel parameter spec {spec!r}: use ptr, ptr(dtype) or a dtype") from None


def _dims(value, what: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, int) else tuple(value)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, int) and d >= 1 for d in dims):
        raise LaunchError(f"{what} must be 1 to 3 positive ints, got {value!r}")
    return dims + (1,) * (3 - len(dims))


_MISSING = object()  # an argument the caller did not pass


def _as_config(config) -> "LaunchConfig":
    if isinstance(config, tuple) and len(config) in (2, 3):
        return LaunchConfig(*config)
    raise LaunchError(f"expected a LaunchConfig or a (grid, block[, shared_mem]) tuple, got {config!r}")


class LaunchConfig:
    """Grid, block, dynamic shared memory and thread-block cluster of a launch, validated once.

    ``cluster`` (1 to 3 ints dividing the grid, at most 8 CTAs) groups the grid's
    CTAs into clusters the hardware schedules together on one GPC, so they may
    read each other's shared memory and wait at a cluster barrier (sm_90+); None
    (the default) launches without clusters."""

    __slots__ = ("grid", "block", "shared_mem", "cluster")

    def __init__(self, grid, block, shared_mem: int = 0, cluster=None):
        self.grid = _dims(grid, "grid")
        self.block = _dims(block, "block")
        threads = self.block[0] * self.block[1] * self.block[2]
        if threads > 1024:
            raise LaunchError(f"block {block} has {threads} threads; CUDA allows at most 1024 per block")
        if self.grid[1] > 65535 or self.grid[2] > 65535 or self.grid[0] > 2**31 - 1:
            raise LaunchError(f"grid {grid} exceeds CUDA's limits (x < 2^31, y and z <= 65535)")
        if not isinstance(shared_mem, int) or shared_mem < 0:
            raise LaunchError(f"shared_mem must be a non-negative int, got {shared_mem!r}")
        self.shared_mem = shared_mem
        self.cluster = None
        if cluster is not None:
            dims = _dims(cluster, "cluster")
            if any(g % c for g, c in zip(self.grid, dims)):
                raise LaunchError(f"cluster {dims} does not divide grid {self.grid}: every cluster must be whole")
            if dims[0] * dims[1] * dims[2] > 8:
                raise LaunchError(f"cluster {dims} has {dims[0] * dims[1] * dims[2]} CTAs; at most 8 are portable "
                                  "across GPUs: use a smaller cluster")
            self.cluster = None if dims == (1, 1, 1) else dims

    def __repr__(self) -> str:
        tail = f", cluster={self.cluster}" if self.cluster else ""
        return f"LaunchConfig(grid={self.grid}, block={self.block}, shared_mem={self.shared_mem}{tail})"


def _driver_call(attribute, indent: str) -> list:
    """The generated lines that launch (``gx`` ... ``smem``, ``params`` and ``stream``
    bound): cuLaunchKernelEx with the attribute's config, else ``launch_kernel``."""
    if attribute:
        lines = ["try:",
                 "    ex_config = fn._ex_config(attribute, config, stream.ptr)",
                 "except Exception as exc:",
                 "    fn._launch_failed(exc, stream, label)",
                 "code = cuLaunchKernelEx(ex_config, handle, params, 0)[0]",
                 "if code: raise_error(code, label)"]
    else:  # try costs nothing unless something is raised
        lines = ["try:",
                 "    launch_kernel(address, gx, gy, gz, bx, by, bz, smem, stream.ptr, params, 0)",
                 "except Exception as exc:",
                 "    fn._launch_failed(exc, stream, label)"]
    return [indent + line for line in lines]


class PreparedLaunch:
    """One launch with every argument fixed (``Function.prepared``): ``launch(stream)``.

    ``call(stream_address, params, 0)`` is the whole launch: for a launch
    without attributes CuPy's ``launchKernel`` with the function, grid, block
    and shared memory bound in a ``functools.partial`` (no Python frame), else a
    function calling cuLaunchKernelEx.  ``params`` is the address of the
    parameter pointers, into a buffer of this launch's own that never changes.
    Callers that cannot afford a frame (the eager path) call ``call``
    themselves and hand whatever it raised to ``failed``."""

    __slots__ = ("call", "params", "function", "_keep")

    def __init__(self, call, params: int, function: "Function", keep):
        self.call, self.params, self.function, self._keep = call, params, function, keep

    def __call__(self, stream) -> None:
        try:
            self.call(stream.ptr, self.params, 0)
        except Exception as exc:
            self.failed(exc, stream)

    def failed(self, exc: Exception, stream):
        """Raise the deviceop error of this launch on ``stream`` having raised ``exc``."""
        self.function._launch_failed(exc, stream, f"cuLaunchKernel({self.function.name})")


def param_offsets(signature) -> list[int]:
    """The byte offset of each parameter of ``signature`` (normalized: ptr or DType)
    in the kernel's parameter buffer, under C alignment rules."""
    offsets = []
    for i, spec in enumerate(signature):
        prefix = "@" + "".join("P" if isinstance(s, ptr) else s.pack for s in signature[:i])
        align = "P" if isinstance(spec, ptr) else spec.pack
        offsets.append(struct.calcsize(prefix + "0" + align))
    return offsets


def check_param_layout(name: str, signature, actual, offsets=None) -> None:
    """Refuse a declared ``signature`` that disagrees with the kernel's own parameter
    layout ``actual`` (``(offset, size)`` per parameter: cuFuncGetParamInfo of the
    loaded kernel on a GPU, the CUBIN's records on the reference device): the one
    rule for both, so a declaration that would corrupt a launch fails everywhere."""
    signature = tuple(_normalize_param(s) for s in signature)
    offsets = param_offsets(signature) if offsets is None else offsets
    declared = [(o, 8 if isinstance(s, ptr) else s.itemsize) for o, s in zip(offsets, signature)]
    actual = [tuple(a) for a in actual]
    if len(actual) != len(declared):
        raise LaunchError(f"kernel {name} takes {len(actual)} parameters but its declared "
                          f"signature has {len(declared)}: {list(signature)}")
    for i, (a, d) in enumerate(zip(actual, declared)):
        if a != d:
            raise LaunchError(f"parameter {i} of kernel {name} is {a[1]} bytes at offset {a[0]}, "
                              f"but the signature declares {signature[i]!r} ({d[1]} bytes at {d[0]})")


def pointer_of(value, spec: ptr, index: int, name: str) -> int:
    """The device address a pointer parameter receives for ``value``."""
    addr = getattr(value, "_ptr", None)  # deviceop Tensor: cached at construction
    if addr is not None:
        if spec.dtype is not None and value.dtype is not spec.dtype:
            raise DTypeError(f"argument {index} of {name} must be a {spec.dtype.name} tensor, "
                             f"got {value.dtype.name}")
        return addr
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if value is None:
        return 0
    cai = getattr(value, "__cuda_array_interface__", None)
    if cai is not None:
        return cai["data"][0]
    raise LaunchError(f"argument {index} of {name} is a device pointer: pass a deviceop Tensor, an "
                      f"object with __cuda_array_interface__, or an int address; got {type(value).__name__}")


class Function:
    """A kernel in a loaded module, with its parameter signature."""

    def __init__(self, module, handle, name: str, signature):
        self.module, self.handle, self.name = module, handle, name
        self.address = int(handle)  # what launch_kernel takes
        self.signature = tuple(_normalize_param(s) for s in signature)
        fmt = "@" + "".join("P" if isinstance(s, ptr) else s.pack for s in self.signature)
        offsets = param_offsets(self.signature)
        self._verify_layout(offsets)
        self.offsets = tuple(offsets)  # byte offset of each parameter in the packed buffer
        self._struct = struct.Struct(fmt)
        self._buffer = ctypes.create_string_buffer(max(self._struct.size, 1))
        base = ctypes.addressof(self._buffer)
        self._param_ptrs = (ctypes.c_void_p * max(len(offsets), 1))(*[base + o for o in offsets])
        self._params_addr = ctypes.addressof(self._param_ptrs)
        self._lock = threading.Lock()
        self._smem_limit = self._default_dynamic_shared_memory()
        self._ex_configs: dict = {}  # (attribute, LaunchConfig, stream handle) -> CUlaunchConfig
        self.launch = self._build_launcher()
        self.launch_pdl = self._build_launcher("pdl")
        self.launch_cooperative = self._build_launcher("cooperative")
        self.launch_cluster = self._build_launcher("cluster")

    def _verify_layout(self, offsets) -> None:
        """Compare the declared signature with the loaded kernel's parameter layout."""
        actual = []
        while True:
            code, offset, size = cu.cuFuncGetParamInfo(self.handle, len(actual))
            if code:
                break
            actual.append((offset, size))
        check_param_layout(self.name, self.signature, actual, offsets)

    def _default_dynamic_shared_memory(self) -> int:
        """The dynamic shared memory a launch may take before the opt-in attribute is
        raised: 48 KB less the kernel's static shared memory (the driver's default)."""
        return check(cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                           self.handle), "cuFuncGetAttribute")

    def set_max_dynamic_shared_memory(self, nbytes: int) -> None:
        dev = self.module.device
        static = check(cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                                             self.handle), "cuFuncGetAttribute")
        if nbytes + static > dev.max_shared_memory_per_block:
            raise LaunchError(f"{self.name} asks for {nbytes} bytes of dynamic shared memory on top of its "
                              f"{static} static; {dev.name} allows at most {dev.max_shared_memory_per_block} "
                              "per block in all")
        check(cu.cuFuncSetAttribute(self.handle,
                                    cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                    nbytes), "cuFuncSetAttribute")
        self._smem_limit = max(self._smem_limit, nbytes)

    def _slow_pointer(self, value, index: int) -> int:
        return pointer_of(value, self.signature[index], index, self.name)

    def _slow_scalar(self, value, index: int):
        try:
            return self.signature[index].coerce(value)
        except DTypeError as exc:
            raise DTypeError(f"argument {index} of {self.name}: {exc}") from None

    def _launch_failed(self, exc: Exception, stream, call: str):
        """Raise the deviceop error of a launch on ``stream`` that raised ``exc`` (every
        launch path's one mapping): the driver's refusal is a CudaError naming ``call``
        (without the wrapper's exception chained: it says no more); no live stream
        address (a closed stream's ptr is None, or no stream at all) is named; anything
        else is raised as it was."""
        if isinstance(exc, DriverError):
            try:
                raise_error(int(getattr(exc, "status", 999)), call)
            except CudaError as err:
                raise err from None
        if isinstance(exc, (AttributeError, TypeError)):
            if getattr(stream, "ptr", 0) is None:
                raise StateError(f"{self.name}: the stream was closed; launch on a live stream") from None
            raise LaunchError(f"{self.name} launches on a deviceop stream (device.new_stream(), or "
                              f"CudaStream.from_handle(device, handle) for a foreign one), "
                              f"got {type(stream).__name__}") from None
        raise exc

    def _arity_error_of(self, args):
        self._arity_error(sum(a is not _MISSING for a in args))

    def _arity_error(self, got: int):
        raise LaunchError(f"{self.name} takes {len(self.signature)} arguments "
                          f"({', '.join(map(repr, self.signature))}), got {got}")

    def _ex_config(self, attribute: str, config: "LaunchConfig", stream: int):
        """The cuLaunchKernelEx configuration of a launch with one attribute:

        * ``"pdl"``, programmatic stream serialization: the kernel may start before
          the previous one on the stream ends; it must ``griddepcontrol.wait``
          before reading that one's output;
        * ``"cooperative"``: every CTA of the grid is resident at once (the driver
          refuses a grid that cannot be), so the CTAs may wait for each other;
        * ``"cluster"``: the grid in thread-block clusters of ``config.cluster``.

        ``stream`` is the stream's address (0 for an occupancy query); anything
        else (a closed stream's None) raises TypeError."""
        if type(stream) is not int:
            raise TypeError(f"a stream address is an int, got {stream!r}")
        key = (attribute, config, stream)
        c = self._ex_configs.get(key)
        if c is None:
            c = cu.CUlaunchConfig()
            c.gridDimX, c.gridDimY, c.gridDimZ = config.grid
            c.blockDimX, c.blockDimY, c.blockDimZ = config.block
            c.sharedMemBytes, c.hStream = config.shared_mem, stream
            attr = cu.CUlaunchAttribute()
            if attribute == "pdl":
                attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
                attr.value.programmaticStreamSerializationAllowed = 1
            elif attribute == "cooperative":
                attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
                attr.value.cooperative = 1
            else:
                if config.cluster is None:
                    raise LaunchError(f"{self.name}: a cluster launch needs a LaunchConfig with cluster=(x, y, z)")
                attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = config.cluster
            c.attrs, c.numAttrs = [attr], 1
            if len(self._ex_configs) > 4096:
                self._ex_configs.clear()
            self._ex_configs[key] = c
        return c

    def _build_launcher(self, attribute: str | None = None):
        """Generate ``launch(stream, config, *args)`` for this signature.

        The generated code checks each argument with one ``type(...) is``
        test on the common path (a Tensor of the declared dtype, a float for a
        float parameter, an in-range int for an int parameter) and falls back
        to the full conversion otherwise; no loop, no per-argument call.
        Launching is the hot path: this is where the host microseconds go.
        """
        from ..tensor import Tensor
        n = len(self.signature)
        names = [f"a{i}" for i in range(n)]
        env = {"Tensor": Tensor, "LaunchConfig": LaunchConfig, "as_config": _as_config, "acquire": self._lock.acquire, "release": self._lock.release,
               "pack_into": self._struct.pack_into, "buf": self._buffer, "params": self._params_addr,
               "launch_kernel": launch_kernel, "address": self.address,
               "cuLaunchKernelEx": cu.cuLaunchKernelEx, "handle": self.handle, "raise_error": raise_error,
               "label": f"{'cuLaunchKernelEx' if attribute else 'cuLaunchKernel'}({self.name})", "fn": self,
               "MISSING": _MISSING, "attribute": attribute}
        # Arguments are named parameters defaulting to a sentinel: a missing one
        # is the sentinel, extras land in *extra; both cost one test each.
        params = "".join(f"{a}=MISSING, " for a in names)
        body = [f"def launch(stream, config, {params}*extra):"]
        if n:
            body.append(f"    if {names[-1]} is MISSING or extra: fn._arity_error_of(({', '.join(names)},) + extra)")
        else:
            body.append("    if extra: fn._arity_error_of(extra)")
        for i, spec in enumerate(self.signature):
            a = names[i]
            if isinstance(spec, ptr):
                if spec.dtype is None:
                    cond = f"type({a}) is Tensor"
                else:
                    env[f"D{i}"] = spec.dtype
                    cond = f"type({a}) is Tensor and {a}.dtype is D{i}"
                body.append(f"    {a} = {a}._ptr if {cond} else fn._slow_pointer({a}, {i})")
            elif spec.kind == "f" and spec.pack in "fde":
                body.append(f"    if type({a}) is not float: {a} = fn._slow_scalar({a}, {i})")
            elif spec.kind in "iu":
                lo, hi = spec.bounds
                body.append(f"    if type({a}) is not int or not ({lo} <= {a} <= {hi}): {a} = fn._slow_scalar({a}, {i})")
            else:  # bfloat16 (packed as its bits), bool
                body.append(f"    {a} = fn._slow_scalar({a}, {i})")
        body += [
            "    if type(config) is not LaunchConfig: config = as_config(config)",
            "    gx, gy, gz = config.grid",
            "    bx, by, bz = config.block",
            "    smem = config.shared_mem",
            "    if smem > fn._smem_limit: fn.set_max_dynamic_shared_memory(smem)",
            # one parameter buffer per Function, guarded while it is filled and the
            # driver copies it (acquire/release: a third of the cost of `with lock`)
            "    acquire()",
            "    try:",
            f"        pack_into(buf, 0{''.join(', ' + a for a in names)})",
            *_driver_call(attribute, "        "),
            "    finally:",
            "        release()",
        ]
        exec(compile("\n".join(body), f"<deviceop launcher {self.name}>", "exec"), env)
        launcher = env["launch"]
        launcher.__name__ = f"launch_{attribute}" if attribute else "launch"
        launcher.__doc__ = f"launch(stream, config, {', '.join(map(repr, self.signature))}): enqueue {self.name}"
        return launcher

    def prepared(self, attribute: str | None, config: "LaunchConfig", *args) -> PreparedLaunch:
        """This launch with every argument fixed now (see PreparedLaunch).

        The arguments are checked and packed once, into a parameter buffer of
        the launch's own, so each launch is one driver call: what a launch
        seen before costs (KernelLaunch caches these per argument layout).
        ``attribute`` is None, ``"pdl"``, ``"cooperative"`` or ``"cluster"``,
        as for the ``launch_*`` launchers."""
        if attribute not in (None, "pdl", "cooperative", "cluster"):
            raise LaunchError(f"{self.name}: no launch attribute {attribute!r}; "
                              "use None, 'pdl', 'cooperative' or 'cluster'")
        if attribute == "cluster" and config.cluster is None:
            raise LaunchError(f"{self.name}: a cluster launch needs a LaunchConfig with cluster=(x, y, z)")
        packed = self.pack(*args)
        if config.shared_mem > self._smem_limit:
            self.set_max_dynamic_shared_memory(config.shared_mem)
        buf, ptrs = self.param_buffer()
        ctypes.memmove(buf, packed, len(packed))
        if attribute is None:
            call = partial(launch_kernel, self.address, *config.grid, *config.block, config.shared_mem)
        else:
            ex_config, handle, label = self._ex_config, self.handle, f"cuLaunchKernelEx({self.name})"

            def call(stream, params, extra):
                code = cu.cuLaunchKernelEx(ex_config(attribute, config, stream), handle, params, extra)[0]
                if code:
                    raise_error(code, label)
        return PreparedLaunch(call, ctypes.addressof(ptrs), self, (buf, ptrs))

    def max_active_clusters(self, config: "LaunchConfig") -> int:
        """How many clusters of ``config.cluster`` CTAs (each with ``config``'s block and
        shared memory) the GPU keeps resident at once (cuOccupancyMaxActiveClusters):
        a GPC holds whole clusters only, so this can be well below SMs / cluster size."""
        if config.cluster is None:
            raise LaunchError(f"{self.name}: max_active_clusters needs a LaunchConfig with cluster=(x, y, z)")
        if config.shared_mem > self._smem_limit:
            self.set_max_dynamic_shared_memory(config.shared_mem)
        c = self._ex_config("cluster", config, 0)
        return int(check(cu.cuOccupancyMaxActiveClusters(self.handle, c), "cuOccupancyMaxActiveClusters"))

    def param_buffer(self):
        """A fresh parameter buffer for this signature: ``(buffer, void** address)``
        (what a graph kernel node's ``kernelParams`` points at)."""
        buf = ctypes.create_string_buffer(max(self._struct.size, 1))
        base = ctypes.addressof(buf)
        ptrs = (ctypes.c_void_p * max(len(self.offsets), 1))(*[base + o for o in self.offsets])
        return buf, ptrs

    def pack(self, *args) -> bytes:
        """The parameter bytes a launch with ``args`` would pass (checked like a launch)."""
        if len(args) != len(self.signature):
            self._arity_error(len(args))
        values = [self._slow_pointer(a, i) if isinstance(s, ptr) else self._slow_scalar(a, i)
                  for i, (a, s) in enumerate(zip(args, self.signature))]
        return self._struct.pack(*values)

    @property
    def attributes(self) -> dict:
        """Registers, static shared memory, local memory and max threads of this kernel."""
        A = cu.CUfunction_attribute
        get = lambda a: check(cu.cuFuncGetAttribute(a, self.handle), "cuFuncGetAttribute")
        return {"num_regs": get(A.CU_FUNC_ATTRIBUTE_NUM_REGS),
                "shared_bytes": get(A.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES),
                "local_bytes": get(A.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES),
                "max_threads_per_block": get(A.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)}

    def __repr__(self) -> str:
        return f"<Function {self.name}({', '.join(map(repr, self.signature))})>"
