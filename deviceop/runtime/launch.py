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

Which ``cuLaunchKernel`` wrapper is called matters as much as anything deviceop
does (docs/architecture.md, "The eager hot path", has the H100 measurements):
launches without attributes use CuPy's ``launchKernel`` (typed C ints in, one
C call; CuPy is a dependency already); PDL, cooperative and cluster launches
need ``cuLaunchKernelEx``'s attribute list and go through cuda.bindings.
"""
from __future__ import annotations

import ctypes
import threading
from functools import partial

from cuda.bindings import driver as cu

from ..errors import CudaError, LaunchError
from . import codegen
from .driver import check, raise_error
from .params import _MISSING, LaunchConfig, ParamLayout, _as_config, check_param_layout, ptr
from .stream import closed_stream


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


# The tensor type whose ``_ptr`` the generated launchers read without a call (set_tensor_type):
# deviceop/tensor.py installs its Tensor when it is imported; the runtime, a layer below it,
# knows tensors only by that duck type.  Until then no argument takes the fast path.
tensor_type: type = type(None)


def set_tensor_type(cls: type) -> None:
    """Make ``cls`` (whose ``_ptr`` is its device address) what the launchers built from now
    on test for with ``type(arg) is``; deviceop/tensor.py installs ``Tensor`` (the one caller)."""
    global tensor_type
    tensor_type = cls


class Function(ParamLayout):
    """A kernel in a loaded module, with its parameter signature."""

    preparable = True  # launches may be packed once and replayed (Function.prepared)

    def __init__(self, module, handle, name: str, signature):
        super().__init__(name, signature)
        self.module, self.handle = module, handle
        self.address = int(handle)  # what launch_kernel takes
        self._verify_layout(list(self._all_offsets))
        self._buffer, self._param_ptrs = self.param_buffer()
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
        check_param_layout(self.name, self.full_signature, actual, offsets)

    def _default_dynamic_shared_memory(self) -> int:
        """The dynamic shared memory a launch may take before the opt-in attribute is
        raised: 48 KB less the kernel's static shared memory (the driver's default)."""
        return check(cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                           self.handle), "cuFuncGetAttribute")

    def set_max_dynamic_shared_memory(self, nbytes: int) -> None:
        dev = self.module.device
        dev.bind()  # a function's attributes are set in its module's context
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
                raise closed_stream(f"launching {self.name}") from None
            raise LaunchError(f"{self.name} launches on a deviceop stream (device.new_stream(), or "
                              f"CudaStream.from_handle(device, handle) for a foreign one), "
                              f"got {type(stream).__name__}") from None
        raise exc

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
        """Generate ``launch(stream, config, *args)`` for this signature (codegen.LAUNCHER).

        Each argument is checked with one ``type(...) is`` test on the common
        path (a Tensor of the declared dtype, a float for a float parameter, an
        in-range int for an int parameter), falling back to the full conversion
        otherwise.  Arguments are parameters defaulting to a sentinel: a missing
        one is the sentinel, extras land in ``*extra``; both cost one test."""
        names = [f"a{i}" for i in range(len(self.signature))]
        # Tensor: deviceop.tensor.Tensor, installed by deviceop/tensor.py (set_tensor_type)
        env = {"Tensor": tensor_type, "LaunchConfig": LaunchConfig, "as_config": _as_config,
               "acquire": self._lock.acquire, "release": self._lock.release,
               "pack_into": self._struct.pack_into, "buf": self._buffer, "params": self._params_addr,
               "launch_kernel": launch_kernel, "address": self.address,
               "cuLaunchKernelEx": cu.cuLaunchKernelEx, "handle": self.handle, "raise_error": raise_error,
               "label": f"{'cuLaunchKernelEx' if attribute else 'cuLaunchKernel'}({self.name})", "fn": self,
               "MISSING": _MISSING, "attribute": attribute}
        convert = []
        for i, (a, spec) in enumerate(zip(names, self.signature)):
            if isinstance(spec, ptr):
                env[f"D{i}"] = spec.dtype
                dtype_test = "" if spec.dtype is None else f" and {a}.dtype is D{i}"
                convert.append(f"{a} = {a}._ptr if type({a}) is Tensor{dtype_test} else fn._slow_pointer({a}, {i})")
            elif spec.kind == "f" and spec.pack in "fde":
                convert.append(f"if type({a}) is not float: {a} = fn._slow_scalar({a}, {i})")
            elif spec.kind in "iu":
                lo, hi = spec.bounds
                convert.append(f"if type({a}) is not int or not ({lo} <= {a} <= {hi}): "
                               f"{a} = fn._slow_scalar({a}, {i})")
            else:  # bfloat16 (packed as its bits), bool
                convert.append(f"{a} = fn._slow_scalar({a}, {i})")
        arity = (f"if {names[-1]} is MISSING or extra: fn._arity_error_of(({', '.join(names)},) + extra)" if names
                 else "if extra: fn._arity_error_of(extra)")
        launcher = codegen.generate(
            codegen.LAUNCHER, "launch", env, f"<deviceop launcher {self.name}>",
            params="".join(f"{a}=MISSING, " for a in names), arity_check=arity, convert=convert,
            args_tail="".join(f", {a}" for a in names),
            driver_call=codegen.lines(codegen.EX_CALL if attribute else codegen.PLAIN_CALL))
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
        self.module.device.bind()  # the query's stream 0 is the current context's: this kernel's device
        return int(check(cu.cuOccupancyMaxActiveClusters(self.handle, c), "cuOccupancyMaxActiveClusters"))

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
