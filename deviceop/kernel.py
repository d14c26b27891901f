"""Kernel declarations and launch ops.

A kernel is CUDA C++ (a ``.cu`` file or a string) plus a declaration:

* its entry name and template parameters (``generics``; a launch picks values
  with ``.generics([...])``, compiled as the NVRTC name expression
  ``entry<v0, v1, ...>``),
* the role of each parameter, output first: ``Out`` (a partition the kernel
  writes, one block per tile), ``In`` (a tensor it reads), ``Scalar``; a
  tensor parameter's layout is dense (C-contiguous) unless declared
  ``layout="strided"``,
* its block shape and dynamic shared memory (functions of the generics), and
  optionally its thread-block cluster (a function of the generics and the grid),
* a NumPy reference that computes the same output — what the reference
  device runs, and what tests compare the GPU against.

Calling the kernel builds a lazy launch op; its value is the tuple of all the
arguments, its grid is the output partition's tiles per axis.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path

from .compile import compile_cubin
from .dtypes import DType, dtype as as_dtype
from .errors import AliasingError, DTypeError, LaunchError, ShapeError
from .nodes import KernelNode
from .op import DeviceOp, stats
from .runtime.launch import LaunchConfig, check_param_layout, ptr
from .runtime.module import load_module
from .tensor import Partition, SharedTensor, Tensor


LAYOUTS = ("dense", "strided")


@dataclass(frozen=True)
class Param:
    name: str
    role: str              # "out" | "in" | "scalar"
    dtype: DType
    rank: int | None = None
    # what the kernel assumes of a tensor's memory: "dense" (C-contiguous: the kernel
    # receives a bare pointer and indexes it row-major) or "strided" (any strides: a
    # kernel that takes the strides some other way, and reads them)
    layout: str = "dense"

    def describe(self) -> str:
        if self.role == "scalar":
            return f"{self.name}: {self.dtype.name}"
        rank = f", rank {self.rank}" if self.rank is not None else ""
        layout = f", {self.layout}" if self.layout != "dense" else ""
        return f"{self.name}: {'out ' if self.role == 'out' else ''}{self.dtype.name}{rank}{layout}"


def _tensor_param(name: str, role: str, dtype, rank, layout) -> Param:
    if layout not in LAYOUTS:
        raise LaunchError(f"parameter {name}: layout must be one of {', '.join(map(repr, LAYOUTS))}, "
                          f"got {layout!r}")
    return Param(name, role, as_dtype(dtype), rank, layout)


def Out(name: str, dtype, rank: int | None = None, layout: str = "dense") -> Param:
    """The output partition (always the first parameter).  ``layout="dense"`` (the
    default) refuses a tensor that is not C-contiguous; ``"strided"`` accepts any."""
    return _tensor_param(name, "out", dtype, rank, layout)


def In(name: str, dtype, rank: int | None = None, layout: str = "dense") -> Param:
    """An input tensor the kernel reads (``layout`` as for ``Out``)."""
    return _tensor_param(name, "in", dtype, rank, layout)


def Scalar(name: str, dtype) -> Param:
    return Param(name, "scalar", as_dtype(dtype))


def _generic_text(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str) and v:
        return v
    raise LaunchError(f"a generic is an int, a bool or a C++ type name, got {v!r}")


class Kernel:
    """A CUDA C++ kernel and its declaration (see the module docstring)."""

    def __init__(self, name: str, source, params, *, generics=(), block=256, reference=None, validate=None,
                 entry: str | None = None, options=(), include_dirs=(), shared_mem=0, cluster=None):
        self.name = name
        self.entry = entry or name
        if isinstance(source, Path):
            self.source_path = source
            self.source = source.read_text()
            include_dirs = (source.parent, *include_dirs)
        else:
            self.source_path, self.source = None, source
        self.params = tuple(params)
        if not self.params or self.params[0].role != "out" or any(p.role == "out" for p in self.params[1:]):
            raise LaunchError(f"kernel {name}: the first parameter, and only the first, must be Out(...)")
        self.generic_names = tuple(generics)
        self.block, self.reference, self.validate = block, reference, validate
        self.shared_mem, self.cluster = shared_mem, cluster
        self.options, self.include_dirs = tuple(options), tuple(include_dirs)
        self.signature = [ptr(p.dtype) if p.role != "scalar" else p.dtype for p in self.params]
        self._functions: dict = {}
        self._compiled: set = set()  # (arch, generics) compiled and checked without a driver: see check_compiled
        self._configs: dict = {}
        self._verified: dict = {}  # launch key -> plan (launcher, LaunchConfig) of a checked launch: checked_launch
        self._prepared: dict = {}  # eager launch key -> prepared launch; see _fast_launch_type
        # the tensor parameters after the output (a verdict hit unwraps their SharedTensors)
        self._input_positions = tuple(i for i, p in enumerate(self.params) if i and p.role != "scalar")
        self.param_index = {p.name: i for i, p in enumerate(self.params)}
        self._lock = threading.Lock()
        self._launch_types: dict = {}  # positions of the arguments that are ops -> launch class
        self._launch_key = _launch_key_function(self)  # (device, generics, pdl, cooperative, *args) -> key

    def __call__(self, *args) -> "KernelLaunch":
        if len(args) != len(self.params):
            return KernelLaunch(self, args, ())  # raises, naming the parameters
        dynamic = tuple([i for i, a in enumerate(args) if isinstance(a, DeviceOp)])
        cls = self._launch_types.get(dynamic)
        if cls is None:
            cls = self._launch_types.setdefault(dynamic, _fast_launch_type(self, dynamic))
        return cls(self, args, dynamic)

    def __repr__(self) -> str:
        gen = f"<{', '.join(self.generic_names)}>" if self.generic_names else ""
        return f"Kernel {self.name}{gen}({', '.join(p.describe() for p in self.params)})"

    # -- generics -----------------------------------------------------------------
    def check_generics(self, values) -> tuple:
        values = tuple(values)
        if len(values) != len(self.generic_names):
            raise LaunchError(f"{self.name} takes {len(self.generic_names)} generics "
                              f"<{', '.join(self.generic_names)}>, got {len(values)}: {list(values)}")
        for v in values:
            _generic_text(v)
        return values

    def name_expression(self, values) -> str:
        if not self.generic_names:
            return self.entry
        return f"{self.entry}<{', '.join(_generic_text(v) for v in values)}>"

    # -- compiled forms (cached) ----------------------------------------------------
    def compile(self, values=(), arch=None):
        """NVRTC → CUBIN for one set of generics (no GPU needed)."""
        expr = self.name_expression(values)
        filename = self.source_path.name if self.source_path else f"{self.name}.cu"
        return compile_cubin(self.source, arch=arch, name_expressions=[expr] if self.generic_names else [],
                             options=self.options, include_dirs=self.include_dirs, filename=filename), expr

    def function(self, device, values=()):
        """The loaded kernel for ``device`` and these generics (compiled and loaded once)."""
        key = (device.ordinal, values)
        fn = self._functions.get(key)
        if fn is None:
            with self._lock:
                fn = self._functions.get(key)
                if fn is None:
                    prog, expr = self.compile(values, arch=device.arch)
                    # refused as on the reference device; the parameter layout is the driver's to check
                    self._check_program(prog, expr, layout=False)
                    fn = load_module(prog, device).get_function(expr, self.signature, label=expr)
                    self._functions[key] = fn
        return fn

    def check_compiled(self, arch: str, values=()) -> None:
        """Compile for ``arch`` and check the declared signature against the CUBIN,
        without a driver: what loading the kernel checks on a GPU (a CompileError
        for source NVRTC rejects, a LaunchError for a kernel the CUBIN lacks or whose
        parameters disagree with the declaration).  The reference device calls this
        before it first runs a launch's NumPy reference for these generics."""
        key = (arch, values)
        if key not in self._compiled:
            self._check_program(*self.compile(values, arch=arch))
            self._compiled.add(key)

    def _check_program(self, prog, expr: str, layout: bool = True) -> None:
        """Refuse a compiled program without the kernel ``expr``, or (``layout``) whose
        parameters disagree with the declared signature (the rule of check_param_layout)."""
        try:
            params = prog.param_layout(expr)
        except ValueError:  # a CUBIN this reader does not understand: the GPU checks it at load
            return
        if params is None:
            known = ", ".join(prog.lowered_names) or "none"
            raise LaunchError(f"{self.name}: the compiled CUBIN has no kernel {expr!r} (name expressions "
                              f"compiled: {known}), so no GPU can load it; declare the kernel "
                              f'extern "C" under its entry name, or give its template parameters as generics')
        if layout:
            check_param_layout(expr, self.signature, params)

    def config(self, grid: tuple, values=()) -> LaunchConfig:
        key = (grid, values)
        cfg = self._configs.get(key)
        if cfg is None:
            g = dict(zip(self.generic_names, values))
            block = self.block(g) if callable(self.block) else self.block
            smem = self.shared_mem(g) if callable(self.shared_mem) else self.shared_mem
            if len(grid) > 3:
                raise LaunchError(f"{self.name}: an output partition of rank {len(grid)} has no CUDA grid (max 3 axes)")
            cluster = self.cluster(g, grid) if callable(self.cluster) else self.cluster
            cfg = self._configs[key] = LaunchConfig(grid, block, smem, cluster)
        return cfg


class _Output(DeviceOp):
    """``launch.first()`` and ``launch.first().unpartition()`` as one node."""

    __slots__ = ("launch", "as_tensor")
    graph_safe = True

    def __init__(self, launch, as_tensor: bool):
        super().__init__()
        self.launch, self.as_tensor = launch, as_tensor

    def children(self):
        return (self.launch,)

    def unpartition(self) -> DeviceOp:
        return type(self)(self.launch, True) if not self.as_tensor else super().unpartition()

    def _run(self, ctx):  # the consumption check inlined: this is the hot path
        if self._consumed:
            self._already_executed()
        self._consumed = True
        part = self.launch._run(ctx)[0]
        return part.tensor if self.as_tensor else part

    def describe(self):
        return f"{self.launch.describe()}.first(){'.unpartition()' if self.as_tensor else ''}"

    _execute = _run


def _attribute(fn, pdl: bool, cooperative: bool, config: LaunchConfig) -> str | None:
    """The launch attribute a launch needs (Function.launch_* / Function.prepared)."""
    if config.cluster is not None and (pdl or cooperative):
        raise LaunchError(f"{fn.name}: a launch in thread-block clusters cannot also be "
                          f"{'PDL' if pdl else 'cooperative'} (not supported)")
    return "pdl" if pdl else "cooperative" if cooperative else "cluster" if config.cluster is not None else None


def _launcher(fn, pdl: bool, cooperative: bool, config: LaunchConfig):
    """The plan of a launch: the Function's launcher for its attributes, and its config."""
    attribute = _attribute(fn, pdl, cooperative, config)
    return (fn.launch if attribute is None else getattr(fn, f"launch_{attribute}")), config


def _as_tensor_arg(v):
    return v.tensor if isinstance(v, SharedTensor) else v


class KernelLaunch(DeviceOp):
    """One lazy launch of a kernel; value = the tuple of its arguments."""

    __slots__ = ("kernel", "args", "_generics", "_dynamic", "_mutable", "_pdl", "_cooperative", "__weakref__")
    graph_safe = True
    _output_type = _Output  # what first() makes (the generated launch classes make their own)

    def __init__(self, kernel: Kernel, args, dynamic: tuple):
        super().__init__()
        self.kernel, self.args = kernel, tuple(args)
        self._generics = () if not kernel.generic_names else None
        self._mutable = frozenset()  # argument positions a captured node may change (.dynamic)
        self._pdl = self._cooperative = False
        self._dynamic = dynamic  # positions of the arguments that are ops, run first (found by Kernel.__call__)
        if len(self.args) != len(kernel.params):
            raise LaunchError(f"{kernel.name} takes {len(kernel.params)} arguments "
                              f"({', '.join(p.describe() for p in kernel.params)}), got {len(self.args)}")
        # arguments known now are checked now, before anything runs
        for p, a in zip(kernel.params, self.args):
            if not isinstance(a, DeviceOp):
                self._check_arg(p, a)

    @property
    def arity(self) -> int:
        return len(self.args)

    def first(self) -> "DeviceOp":
        """The output partition (one node, not a map: launches are the hot path)."""
        return self._output_type(self, False)

    def generics(self, values) -> "KernelLaunch":
        """Pick the template arguments, e.g. ``.generics([2048, 256])``."""
        self._generics = self.kernel.check_generics(values)
        return self

    def dynamic(self, *names) -> "KernelLaunch":
        """Mark arguments (by name; none = all) that may change between replays of
        a graph this launch is captured into: ``graph.node(launch).set(name=...)``.
        A new output partition changes the grid."""
        index = self.kernel.param_index
        unknown = [n for n in names if n not in index]
        if unknown:
            raise LaunchError(f"{self.kernel.name} has no argument(s) {', '.join(map(repr, unknown))}; "
                              f"its arguments are {', '.join(index)}")
        self._mutable = frozenset(index[n] for n in names) if names else frozenset(index.values())
        return self

    def pdl(self, enabled: bool = True) -> "KernelLaunch":
        """Launch with programmatic dependent launch: the kernel may start while the
        previous kernel on the stream is still running (in a graph: a programmatic
        edge).  Only for kernels that execute ``griddepcontrol.wait`` before reading
        anything the previous kernels wrote (kernels/fused.cu does)."""
        self._pdl = bool(enabled)
        if self._pdl and self._cooperative:
            raise LaunchError(f"{self.kernel.name}: a launch is either PDL or cooperative, not both")
        return self

    def cooperative(self, enabled: bool = True) -> "KernelLaunch":
        """Launch cooperatively: all CTAs of the grid are resident at once, so they may
        wait for each other (a grid barrier); the driver refuses a grid too large to
        be (CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE) instead of letting it hang."""
        self._cooperative = bool(enabled)
        if self._pdl and self._cooperative:
            raise LaunchError(f"{self.kernel.name}: a launch is either PDL or cooperative, not both")
        return self

    def children(self):
        return tuple(a for a in self.args if isinstance(a, DeviceOp))

    def describe(self) -> str:
        return self.kernel.name_expression(self._generics) if self._generics is not None else self.kernel.name

    def _check_arg(self, p: Param, a):
        check_arg(self.kernel, p, a)

    def _run(self, ctx):  # the consumption check inlined: this is the hot path
        if self._consumed:
            self._already_executed()
        self._consumed = True
        values = self.args
        if self._dynamic:
            values = list(values)
            for i in self._dynamic:
                values[i] = values[i]._run(ctx)
        return self._launch(ctx, values)

    def _launch(self, ctx, values, key=None):
        """Check (or find checked) and launch, the arguments' ops already run.

        The general path: every launch on the reference device, every launch
        captured into a graph, and the first eager launch of each argument
        set.  Eager launches seen before take the kernel's generated ``_run``
        (``_fast_launch_type``) instead; ``key`` is the launch key when that
        path has built it already."""
        gen = self._generics
        if gen is None:
            raise LaunchError(f"{self.kernel.name} needs generics <{', '.join(self.kernel.generic_names)}>: "
                              f"call .generics([...]) on the launch")
        kernel, device = self.kernel, ctx.device
        launch_args, plan = checked_launch(kernel, (device, gen, self._pdl, self._cooperative), values,
                                           self.describe, key)
        launcher, config = plan
        if launcher is None:  # the reference device
            self._run_reference(ctx, gen, launch_args, values)
        else:
            launcher(ctx.stream, config, *launch_args)
            if ctx.capture is not None:  # a node of the graph: its handle, its arguments (kept alive)
                ctx.capture.add_kernel_node(self, KernelNode(
                    kernel, gen, self.describe(), values, launch_args, self._mutable,
                    kernel.function(device, gen), config, ctx.capture.last_node(ctx.stream),
                    head=(device, gen, self._pdl, self._cooperative)))
        stats["launches"] += 1
        return tuple(values)

    def _launch_and_prepare(self, ctx, values, key):
        """An eager launch not prepared yet: launched by the general path (which
        checks it), then prepared for ``key``, so the next launch like it costs
        one dict lookup and one driver call."""
        out = self._launch(ctx, values, key)
        device = ctx.device
        if not device.is_reference:
            kernel, gen, part = self.kernel, self._generics, values[0]
            fn, config = kernel.function(device, gen), kernel.config(part.grid, gen)
            args = [part.tensor] + [_as_tensor_arg(v) for v in values[1:]]
            prepared = kernel._prepared
            if len(prepared) > 65536:
                prepared.clear()
            launch = fn.prepared(_attribute(fn, self._pdl, self._cooperative, config), config, *args)
            prepared[key] = (launch.call, launch.params, launch)  # a plain tuple: the cheapest to unpack
        return out

    def _run_reference(self, ctx, gen, launch_args, values) -> None:
        kernel = self.kernel
        if kernel.reference is None:
            raise LaunchError(f"{kernel.name} has no NumPy reference, so the reference device cannot run it")
        if ctx.capture is None:
            kernel.reference(dict(zip(kernel.generic_names, gen)), *[t._array if isinstance(t, Tensor) else t
                                                                      for t in launch_args])
            return
        node = KernelNode(kernel, gen, self.describe(), values, launch_args, self._mutable,
                          head=(ctx.device, gen, self._pdl, self._cooperative))
        ctx.capture.add_kernel_node(self, node)
        step = node._replay_reference  # recorded, run at each replay (with the node's current arguments)
        ctx.capture.tape.append(_TapeStep(step, ("kernel", self.describe())))

    _execute = _run


def _launch_key_code(kernel: Kernel, head) -> tuple[list[str], str]:
    """The launch key of ``kernel`` as source code: ``(unwrap lines, key expression)``
    over the arguments ``a0`` ... ``a{n-1}``, after the four ``head`` expressions
    (device, generics, pdl, cooperative).  The one definition of the key, used by
    the eager fast path (inlined) and by every other path (``_launch_key_function``).

    Why it is exact: a partition's and a tensor's layout id stand for their
    (pointer, shape, strides, dtype[, tile]), so equal keys mean equal checks and
    equal parameter bytes.  A scalar keys on its type and value, and a float
    zero on its sign too (0.0 == -0.0, but their bytes differ).  So every input
    of every check of a launch (roles, dtypes, ranks, layouts, aliasing, the
    kernel's ``validate``, which may read scalars) is in the key."""
    key = [*head, "a0._sig_id"]
    unwrap = []
    for i, p in enumerate(kernel.params[1:], 1):
        if p.role == "in":  # a SharedTensor's tensor while the handle is live; else no key (the check names it)
            unwrap.append(f"t{i} = a{i}._tensor if type(a{i}) is SharedTensor and a{i}._live else a{i}")
            key.append(f"t{i}._sig_id")
        elif p.dtype.kind == "f":
            key += [f"type(a{i})", f"a{i}", f"(a{i} or copysign(1.0, a{i}))"]
        else:
            key += [f"type(a{i})", f"a{i}"]
    return unwrap, f"({', '.join(key)})"


_KEY_ENV = {"SharedTensor": SharedTensor, "copysign": math.copysign}


def _launch_key_function(kernel: Kernel):
    """``key(device, generics, pdl, cooperative, a0, ...)``: the launch key (see
    ``_launch_key_code``); raises AttributeError, TypeError or ValueError for
    arguments that have none (not a tensor, a released handle, an array)."""
    args = [f"a{i}" for i in range(len(kernel.params))]
    unwrap, key = _launch_key_code(kernel, ("device", "gen", "pdl", "cooperative"))
    body = [f"def launch_key(device, gen, pdl, cooperative, {', '.join(args)}):",
            *[f"    {line}" for line in unwrap], f"    return {key}"]
    scope = dict(_KEY_ENV)
    exec(compile("\n".join(body), f"<deviceop launch key of {kernel.name}>", "exec"), scope)
    return scope["launch_key"]


def _fast_launch_type(kernel: Kernel, dynamic: tuple) -> type:
    """A KernelLaunch subclass for ``kernel`` whose arguments at positions
    ``dynamic`` are ops, with ``_run`` generated for its parameter list, and the
    ``first()`` node to go with it (whose ``_run`` is the same code inlined: one
    frame per launch fewer).  An eager launch whose arguments were all seen
    before is one key (``_launch_key_code``: every tensor's layout id, every
    scalar's type and value), one lookup in ``kernel._prepared`` and one
    prepared driver call (Function.prepared): no loop, no argument list, no
    re-packing.  Anything else (a first launch, a graph capture, the reference
    device, a bad argument) takes the general ``KernelLaunch._launch``, which
    checks everything the key has not been checked for and names what is wrong."""
    n = len(kernel.params)
    a = [f"a{i}" for i in range(n)]
    unwrap, key = _launch_key_code(kernel, ("ctx.device", "op._generics", "op._pdl", "op._cooperative"))
    unwrap = [f"            {line}" for line in unwrap]
    values = f"[{', '.join(a)}]"

    def run(head: list, result: str) -> list:
        """The body of a ``_run``: ``op`` is the launch, ``result`` its value."""
        return ["def _run(self, ctx):",
                *head,
                f"    {', '.join(a)}, = op.args",
                *[f"    a{i} = a{i}._run(ctx)" for i in dynamic],
                "    if ctx.capture is None:",
                "        try:",
                *unwrap,
                f"            key = {key}",
                "            call, params, launch = prepared[key]",
                "        except KeyError:",
                f"            op._launch_and_prepare(ctx, {values}, key)",
                f"            return {result}",
                "        except (AttributeError, TypeError, ValueError):  # not a tensor, unhashable, ...",
                f"            op._launch(ctx, {values})",
                f"            return {result}",
                "        try:  # the driver call with no frame of ours (see PreparedLaunch)",
                "            call(ctx.stream.ptr, params, 0)",
                "        except Exception as exc:",
                "            launch.failed(exc, ctx.stream)",
                "        stats['launches'] += 1",
                f"        return {result}",
                f"    op._launch(ctx, {values})",
                f"    return {result}"]

    consume = ["    if self._consumed:",
               "        self._already_executed()",
               "    self._consumed = True"]
    launch_run = run(consume + ["    op = self"], f"({', '.join(a)},)")
    output_run = run(consume + ["    op = self.launch",
                                "    if op._consumed:",
                                "        op._already_executed()",
                                "    op._consumed = True"], "a0.tensor if self.as_tensor else a0")
    env = {**_KEY_ENV, "stats": stats, "prepared": kernel._prepared}
    made = []
    for body in (launch_run, output_run):
        scope = dict(env)
        exec(compile("\n".join(body), f"<deviceop launch of {kernel.name}>", "exec"), scope)
        made.append(scope["_run"])
    output = type("_Output", (_Output,), {"__slots__": (), "_run": made[1], "_execute": made[1],
                                          "__module__": __name__, "__doc__": _Output.__doc__})
    return type("KernelLaunch", (KernelLaunch,), {"__slots__": (), "_run": made[0], "_execute": made[0],
                                                  "_output_type": output, "__module__": __name__,
                                                  "__doc__": KernelLaunch.__doc__})


class _TapeStep:
    """A recorded step of a reference-device "graph": a callable with its node's (type, name)."""

    __slots__ = ("run", "node")

    def __init__(self, run, node):
        self.run, self.node = run, node

    def __call__(self):
        self.run()


def check_arg(kernel: Kernel, p: Param, a) -> None:
    """Is ``a`` a valid value for parameter ``p`` (role, dtype, rank, layout)?"""
    k = kernel.name
    if p.role == "out":
        if not isinstance(a, Partition):
            hint = " (a plain tensor: pass tensor.partition(tile), or shared.try_partition(tile))" \
                if isinstance(a, (Tensor, SharedTensor)) else ""
            raise LaunchError(f"argument 0 ({p.name}) of {k} must be a Partition{hint}, got {type(a).__name__}")
        t = a.tensor
    elif p.role == "in":
        t = _as_tensor_arg(a)
        if not isinstance(t, Tensor):
            raise LaunchError(f"argument {p.name} of {k} must be a Tensor, got {type(a).__name__}")
    else:
        try:
            p.dtype.coerce(a)
        except DTypeError as exc:
            raise DTypeError(f"argument {p.name} of {k}: {exc}") from None
        return
    if t.dtype is not p.dtype:
        raise DTypeError(f"argument {p.name} of {k} must be {p.dtype.name}, got a {t.dtype.name} tensor")
    if p.rank is not None and t.ndim != p.rank:
        raise ShapeError(f"argument {p.name} of {k} must have rank {p.rank}, got shape {t.shape}; "
                         f"reshape it (e.g. .reshape(...)) first")
    if p.layout == "dense" and not t._contig:
        # the kernel gets a bare pointer and indexes it row-major: a reversed, broadcast (stride 0),
        # every-other-element or row-strided view would have it read the wrong elements, or past the end
        raise ShapeError(f"argument {p.name} of {k} must be dense (C-contiguous), got shape {t.shape} with "
                         f"strides {t.strides} (in elements); pass a contiguous copy: t.contiguous()")


def check_launch(kernel: Kernel, values, gen, label: str) -> list:
    """Every check of a launch: roles, dtypes, ranks, layouts, aliasing, the kernel's own rules.
    Returns the launch arguments (tensors for partitions and shared handles)."""
    params = kernel.params
    for p, v in zip(params, values):
        check_arg(kernel, p, v)
    launch_args = [values[0].tensor] + [_as_tensor_arg(v) for v in values[1:]]
    out = launch_args[0]
    for p, t in zip(params[1:], launch_args[1:]):
        if p.role == "in" and t.overlaps(out):
            raise AliasingError(f"{label} writes {params[0].name} and reads {p.name} from "
                                "overlapping memory; write into a separate buffer")
    if kernel.validate is not None:
        kernel.validate(dict(zip(kernel.generic_names, gen)), values[0], *launch_args[1:])
    return launch_args


def checked_launch(kernel: Kernel, head: tuple, values, describe, key=None) -> tuple[list, tuple]:
    """``(launch arguments, plan)`` of a launch whose arguments are ``values``:
    the verdict of every check, looked up by the launch key (``head`` is its
    device, generics, pdl and cooperative) or, for a key not seen before (or
    arguments that have none), reached by running them all (``check_launch``,
    and on the reference device the kernel's compile).  The plan is the
    Function's launcher and LaunchConfig, ``(None, LaunchConfig)`` on the reference
    device.  ``describe()`` names the launch in errors.  Used by every launch
    not prepared already, and by ``KernelNode.set``: one verdict cache, one key."""
    verified = kernel._verified
    try:
        if key is None:
            key = kernel._launch_key(*head, *values)
        plan = verified.get(key)
    except (AttributeError, TypeError, ValueError):  # an argument of the wrong kind, unhashable: checked below
        key = plan = None
    if plan is not None:
        # Plain loop: the partition's tensor and each live SharedTensor's tensor (the key had them all)
        launch_args = list(values)
        launch_args[0] = values[0].tensor
        for i in kernel._input_positions:
            t = launch_args[i]
            if type(t) is SharedTensor:
                launch_args[i] = t._tensor
        return launch_args, plan
    device, gen, pdl, cooperative = head
    launch_args = check_launch(kernel, values, gen, describe())
    if device.is_reference:
        kernel.check_compiled(device.arch, gen)  # what loading it would refuse on a GPU
        plan = (None, kernel.config(values[0].grid, gen))  # the block and grid limits CUDA would refuse
    else:
        plan = _launcher(kernel.function(device, gen), pdl, cooperative, kernel.config(values[0].grid, gen))
    if key is not None:
        if len(verified) > 65536:
            verified.clear()
        verified[key] = plan
    return launch_args, plan
