"""DeviceOp: lazy GPU work and the combinators that compose it.

Building an op runs nothing and allocates nothing on the device; executing
it (``sync_on``, ``async_on``, ``await``, or a graph capture) issues its work,
in order, on one stream.  The model is cutile-rs's DeviceOp:

* An op describes one execution and is consumed by it (executing it twice is
  an error), except ``shared()`` ops: they run at most once, whatever the
  number of clones that consume them, and every clone — also one executed
  later, e.g. to fetch a graph's output after capture — sees that result.
* Execution is non-reentrant: a ``sync_on`` from inside a ``map``/``then``
  callback (or a capture scope) raises ReentrancyError.
* A kernel launch op's value is the tuple of all its arguments; ``first()`` is
  the output partition and ``unpartition()`` gives the tensor back.
"""
from __future__ import annotations

import asyncio

from .errors import KernelFaultError, StateError
from .runtime.device import Device
from .tensor import Tensor
from .values import (_first, _last, _reshape, _selector, _unpartition, checked_fn, launched_kernels, reshape_dims,
                     unzip_count)
from .execution import (BIRTHS, RECURSION_LIMIT, ExecutionContext, _SharedCore, capture_graph, check_stream,  # noqa: F401
                        describe_chain, executing, not_a_stream, stats, tensors_device, too_deep, walk,
                        warn_if_unexecuted)

class DeviceOp:
    """A lazy value.  Subclasses implement ``_execute(ctx)``."""

    # _armed: set by ops doing device work, cleared by value() and discard(); see warn_if_unexecuted
    __slots__ = ("_consumed", "_armed", "_born")
    graph_safe = False    # may CudaGraph.scope record it? (kernel launches, memcpy, values)
    # why an op that is not graph-safe cannot be recorded: the GraphSafetyError says it
    unsafe_reason = ("it is not graph-safe (its class sets graph_safe = False); only kernel launches, "
                     "api.memcpy, loops and values can be recorded: run it before or after the capture")
    op_name = "op"

    def __init__(self):
        self._consumed = False
        self._born = next(BIRTHS)

    # -- execution -------------------------------------------------------------
    def _execute(self, ctx: ExecutionContext):  # pragma: no cover - abstract
        raise NotImplementedError

    def _run(self, ctx: ExecutionContext):
        if self._consumed:
            self._already_executed()
        self._consumed = True
        return self._execute(ctx)

    def _already_executed(self):
        raise StateError(f"{self.describe()} was already executed: an op describes one execution. "
                         "Build it again, or make it .shared() to reuse its result")

    def __reduce_ex__(self, protocol):  # what copy.copy, copy.deepcopy and pickle call
        raise StateError(f"copying or pickling {self.describe()}: an op runs once; build it again, or .shared() it")

    def discard(self) -> None:
        """Drop this op deliberately: it will never execute, and collecting it does not warn."""
        self._armed = False

    def children(self) -> tuple:
        """The ops this one executes (for graph-safety checks and module preloading)."""
        return ()

    def unsafe_for_graphs(self, fresh: list | None = None):
        """The first op in this DAG that is not graph-safe, or None (each node visited once:
        shared clones make the tree a DAG, and walking it as a tree is exponential).

        ``fresh``, a list, receives the ops not executed yet (shared ops: those whose
        cell is unclaimed): what a capture must hand back if it fails."""
        for op in walk(self):
            if not op.graph_safe:
                return op
            if fresh is not None and not op._consumed and (type(op) is not SharedOp or op.core.unclaimed):
                fresh.append(op)
        return None

    def describe(self) -> str:
        return self.op_name if self._wrapped() is None else describe_chain(self)

    def _wrapped(self):
        """``(prefix, inner op, suffix)`` when this op is described as a wrapper of one
        inner op (map, reshape, then, boxed, shared), else None: see ``describe_chain``."""
        return None

    def __repr__(self) -> str:
        return f"<DeviceOp {self.describe()}>"

    def sync_on(self, stream):
        """Execute on ``stream`` and wait for the device; returns the op's value."""
        self._armed = False  # handed to an execution: if it cannot run, the error says so
        with executing(lambda: f"sync_on({self.describe()})", stream):
            try:
                out = self._run(ExecutionContext(stream))
            except RecursionError as exc:
                raise too_deep(self, exc) from exc
            try:
                stream.synchronize()
            except KernelFaultError as exc:  # the driver cannot say which kernel: name the ones this op launched
                raise exc.naming(self.describe(), launched_kernels(self)) from None
        return out

    def sync(self):
        """Execute on the default stream (its own non-blocking stream) of the device the op's
        tensors live on (Device(0) for an op naming none), and wait."""
        return self.sync_on(_default_stream(self, "op.sync()"))

    def async_on(self, stream):
        """Enqueue the work on ``stream`` without waiting; the value's buffers are
        ready once the stream reaches this point."""
        self._armed = False
        with executing(lambda: f"async_on({self.describe()})", stream):
            try:
                return self._run(ExecutionContext(stream))
            except RecursionError as exc:
                raise too_deep(self, exc) from exc

    def __await__(self):
        return self._await_on(None).__await__()

    async def _await_on(self, stream):
        stream = stream if stream is not None else _default_stream(self, "await op")
        out = self.async_on(stream)
        event = stream.record_event(timing=False)
        if not event.query():  # wait in a worker thread: the event loop keeps running
            await asyncio.get_running_loop().run_in_executor(None, event.synchronize)
        return out

    def on(self, stream):
        """An awaitable that executes on ``stream``: ``await op.on(stream)``."""
        return self._await_on(stream)

    def graph_on(self, stream, parallel: bool = False):
        """Capture this op on ``stream`` into a replayable CudaGraph (see deviceop.graph).
        ``parallel``: ops that share no written buffer become parallel branches of the
        graph, instead of following each other in execution order (graph/parallel.py)."""
        self._armed = False
        check_stream(f"graph_on({self.describe()})", stream)
        try:
            # CudaGraph.capture, installed by deviceop/graph/__init__.py (execution.set_capture); the
            # capture is ended, and the stream usable, on any error
            return capture_graph(self, stream, parallel)
        except RecursionError as exc:
            raise too_deep(self, exc) from exc

    def graph(self, parallel: bool = False):
        """``graph_on`` the default stream of the op's device (see ``sync``)."""
        return self.graph_on(_default_stream(self, "op.graph()"), parallel)

    # -- combinators -------------------------------------------------------------
    def map(self, f) -> "DeviceOp":
        """A host-side transform of the value (no GPU work)."""
        return Map(self, f)

    def inspect(self, f) -> "DeviceOp":
        """Call ``f(value)`` for its side effect; the value passes through."""
        return Map(self, checked_fn(f, 'inspect'), inspect=True)

    def then(self, f) -> "DeviceOp":
        """``f(value)`` returns an op (or a plain value), executed on the same stream."""
        return Then(self, f)

    def first(self) -> "DeviceOp":
        return Map(self, _first, name="first")

    def last(self) -> "DeviceOp":
        return Map(self, _last, name="last")

    def unpartition(self) -> "DeviceOp":
        return Map(self, _unpartition, name="unpartition")

    def reshape(self, *shape) -> "DeviceOp":
        return Reshape(self, reshape_dims(shape))

    def unzip(self, n: int | None = None) -> tuple:
        """Split an op producing an n-tuple into n ops; the op runs once."""
        n = unzip_count(self, n)
        core = self.shared()
        return tuple(Map(core.clone(), _selector(i, n), name=f"select[{i}]") for i in range(n))

    def shared(self) -> "SharedOp":
        self._armed = False  # the shared cell answers for it now
        return SharedOp(_SharedCore(self))

    def boxed(self) -> "DeviceOp":
        return Boxed(self)


def _default_stream(op, what: str):
    """The default stream of the device ``op``'s tensors live on (execution.tensors_device);
    Device(0)'s when it names none (an op of allocations only)."""
    device = tensors_device(op, what)
    return (device if device is not None else Device(0)).default_stream()


# -- the ops -----------------------------------------------------------------------

class Value(DeviceOp):
    """An already-computed value."""

    __slots__ = ("value",)
    graph_safe = True
    op_name = "value"

    def __init__(self, value):
        super().__init__()
        self.value = value

    def _execute(self, ctx):
        return self.value


def value(x) -> DeviceOp:
    """``x`` as an op (ops pass through, adopted: the op taking them in answers for their execution)."""
    if isinstance(x, DeviceOp):
        x._armed = False
        return x
    return Value(x)


def resolve(x, ctx):
    """The value of an argument: ops are executed, plain values pass through."""
    return x._run(ctx) if isinstance(x, DeviceOp) else x


class Map(DeviceOp):
    __slots__ = ("op", "f", "is_inspect", "name")
    graph_safe = True  # host work only; safety is the child's

    def __init__(self, op, f, inspect: bool = False, name: str | None = None):
        super().__init__()
        self.op, self.f, self.is_inspect, self.name = value(op), checked_fn(f, name or 'map'), inspect, name

    def children(self):
        return (self.op,)

    def _run(self, ctx):  # the consumption check inlined: this is the hot path
        if self._consumed:
            self._already_executed()
        self._consumed = True
        v = self.op._run(ctx)
        if self.is_inspect:
            self.f(v)
            return v
        return self.f(v)

    def _wrapped(self):
        return "", self.op, f".{self.name or ('inspect' if self.is_inspect else 'map')}"

    _execute = _run


class Reshape(DeviceOp):
    """``op.reshape(shape)``: a view of the tensor the op produces (its own node:
    it sits on the hot path of every model that reshapes between kernels)."""

    __slots__ = ("op", "shape")
    graph_safe = True

    def __init__(self, op, shape: tuple):
        super().__init__()
        self.op, self.shape = value(op), shape

    def children(self):
        return (self.op,)

    def _run(self, ctx):  # the consumption check inlined: this is the hot path
        if self._consumed:
            self._already_executed()
        self._consumed = True
        t = self.op._run(ctx)
        if type(t) is Tensor:
            views = t._views
            v = views.get(self.shape) if views is not None else None
            return v if v is not None else t.view(self.shape)
        return _reshape(t, self.shape)

    def _wrapped(self):
        return "", self.op, f".reshape{list(self.shape)}"

    _execute = _run


class Then(DeviceOp):
    __slots__ = ("op", "f")
    graph_safe = True  # what f returns is checked when it runs

    def __init__(self, op, f):
        super().__init__()
        self.op, self.f = value(op), checked_fn(f, 'then')

    def children(self):
        return (self.op,)

    def _execute(self, ctx):
        nxt = self.f(self.op._run(ctx))
        if isinstance(nxt, DeviceOp):
            nxt._armed = False  # taken in: executed below, or refused with an error that says so
            if ctx.capture is not None:
                ctx.capture.check_graph_safe(nxt)
            if ctx.guard is not None:  # in a loop's body (eager too): the body's rules
                ctx.guard.check_op(nxt)
        return resolve(nxt, ctx)

    def _wrapped(self):
        return "", self.op, ".then"


class Zip(DeviceOp):
    """Executes its ops in order on one stream; the value is the tuple of theirs."""

    __slots__ = ("ops",)
    graph_safe = True
    op_name = "zip"

    def __init__(self, ops):
        super().__init__()
        self.ops = tuple(value(o) for o in ops)

    @property
    def arity(self):
        return len(self.ops)

    def children(self):
        return self.ops

    def _run(self, ctx):  # the consumption check inlined: this is the hot path
        if self._consumed:
            self._already_executed()
        self._consumed = True
        return tuple([o._run(ctx) for o in self.ops])

    _execute = _run


def zip_(*ops) -> DeviceOp:
    """Combine ops of any arity into one whose value is the tuple of their values."""
    return Zip(ops)


class SharedOp(DeviceOp):
    """A handle to a shared op: clones share one execution and one result."""

    __slots__ = ("core",)
    graph_safe = True

    def __init__(self, core: _SharedCore):
        super().__init__()
        self.core = core

    def clone(self) -> "SharedOp":
        return SharedOp(self.core)

    def children(self):
        return () if self.core.done else (self.core.op,)

    def _run(self, ctx):  # handles may be executed again: the result is cached
        core = self.core
        if core.done:
            return core.result
        claims = core.claims
        if not claims:
            claims.append(ctx)
            if claims[0] is ctx:  # this execution runs the op
                try:
                    core.result = result = core.op._run(ctx)
                except BaseException as exc:
                    core.fail(exc)
                    raise
                core.done = True
                claims[0] = None  # the cell does not keep the context alive
                if len(claims) > 1:  # read after done is set: a waiter appends, then reads done
                    core.wake()
                return result
        return core.wait(ctx)

    _execute = _run

    @property
    def is_done(self) -> bool:
        return self.core.done

    def _wrapped(self):
        return "shared(", self.core.op, ")"


def shared(x) -> SharedOp:
    """A shared op: of an op, or an already-computed value (a Tensor becomes a SharedTensor)."""
    if isinstance(x, SharedOp):
        return x
    if isinstance(x, DeviceOp):
        return x.shared()
    if isinstance(x, Tensor):
        x = x.into_shared()
    core = _SharedCore(Value(x))
    core.result, core.done = x, True
    return SharedOp(core)


class Boxed(DeviceOp):
    """Type erasure in Rust; in Python a named wrapper kept for API parity."""

    __slots__ = ("op",)
    graph_safe = True

    def __init__(self, op):
        super().__init__()
        self.op = value(op)

    def children(self):
        return (self.op,)

    def _run(self, ctx):  # the consumption check inlined: this is the hot path
        if self._consumed:
            self._already_executed()
        self._consumed = True
        return self.op._run(ctx)

    def _wrapped(self):
        return "boxed(", self.op, ")"

    _execute = _run


class DeviceOpVec(DeviceOp):
    """A list of ops executed in order on one stream; the value is the list of values."""

    __slots__ = ("ops",)
    graph_safe = True
    op_name = "DeviceOpVec"

    def __init__(self, ops=()):
        super().__init__()
        self.ops = [value(o) for o in ops]

    def push(self, op) -> None:
        self.ops.append(value(op))

    def __len__(self) -> int:
        return len(self.ops)

    def children(self):
        return tuple(self.ops)

    def _execute(self, ctx):
        return [o._run(ctx) for o in self.ops]
