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
import operator
import sys
import threading

from .errors import KernelFaultError, LaunchError, ReentrancyError, ShapeError, StateError
from .tensor import Partition, SharedTensor, Tensor

_tls = threading.local()
stats = {"launches": 0, "allocations": 0, "copies": 0}  # process-wide counters (tests, diagnostics)


class ExecutionContext:
    """Where an execution runs: the device and stream, and whether a graph
    is being captured (then only graph-safe work is allowed)."""

    __slots__ = ("device", "stream", "capture")

    def __init__(self, stream, capture=None):
        try:
            self.device = stream.device
        except AttributeError:
            raise not_a_stream("running an op (sync_on, async_on, graph.update ...)", stream) from None
        self.stream = stream
        self.capture = capture  # None, or the capture in progress (graph layer)

    def __repr__(self) -> str:
        return f"ExecutionContext({self.stream!r}{', capturing' if self.capture else ''})"


def not_a_stream(what: str, stream) -> LaunchError:
    return LaunchError(f"{what} needs a deviceop stream (device.new_stream(), or CudaStream.from_handle(...) for "
                       f"another library's), got {'None' if stream is None else type(stream).__name__}")


def check_stream(what: str, stream) -> None:
    """Refuse what is not a stream before a capture begins (an execution finds out by itself)."""
    if getattr(stream, "device", None) is None:
        raise not_a_stream(what, stream)


# Executing an op recurses through its tree, a frame or a few per nested op.
# On Python 3.11+ those frames use no C stack (Python-to-Python calls run
# inline), so deviceop raises the recursion limit to this once, where it was
# lower, for chains of thousands of launches to execute.  Once, not around
# each execution: setrecursionlimit visits every thread, and raising and
# restoring it would add ~0.1 us to every eager execution.
RECURSION_LIMIT = 20_000 if sys.version_info >= (3, 11) else sys.getrecursionlimit()
if sys.getrecursionlimit() < RECURSION_LIMIT:
    sys.setrecursionlimit(RECURSION_LIMIT)


def too_deep(op, exc: RecursionError) -> StateError:
    """The error of an execution that ran past Python's recursion limit."""
    return StateError(
        f"executing {op.describe()} exceeded Python's recursion limit "
        f"({sys.getrecursionlimit()} frames: {exc}): an op "
        "tree this deep is a chain of thousands of ops, each nested in the next (or a callback that recurses). "
        "The tree is now partly executed: build it again, and compose long sequences side by side "
        "(DeviceOpVec / zip_ of ops that each take the previous result's buffer), run the chain in pieces, "
        "or raise the limit with sys.setrecursionlimit(...)")


class executing:
    """Hold the thread's execution lock (non-reentrant, as in cutile-rs).

    A class, not a @contextmanager generator: it is entered on every
    execution, and a generator-based context manager costs ~1 us more."""

    __slots__ = ("what",)

    def __init__(self, what):
        self.what = what

    def __enter__(self):
        current = getattr(_tls, "executing", None)
        if current:
            what = self.what if isinstance(self.what, str) else self.what()
            current = current if isinstance(current, str) else current()
            raise ReentrancyError(
                f"{what} was called while {current} is "
                "executing on this thread; DeviceOp execution is non-reentrant. Compose with .then(...) "
                "instead of executing inside a callback")
        _tls.executing = self.what  # a string, or a callable that makes one (only for the error)
        return self

    def __exit__(self, *exc):
        _tls.executing = None
        return False


class DeviceOp:
    """A lazy value.  Subclasses implement ``_execute(ctx)``."""

    __slots__ = ("_consumed",)
    graph_safe = False    # may CudaGraph.scope record it? (kernel launches, memcpy, values)
    op_name = "op"

    def __init__(self):
        self._consumed = False

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

    def children(self) -> tuple:
        """The ops this one executes (for graph-safety checks and module preloading)."""
        return ()

    def unsafe_for_graphs(self, fresh: list | None = None):
        """The first op in this DAG that is not graph-safe, or None (each node visited once:
        shared clones make the tree a DAG, and walking it as a tree is exponential).

        ``fresh``, a list, receives the ops not executed yet (shared ops: those whose
        cell is unclaimed): what a capture must hand back if it fails."""
        stack, seen = [self], set()
        while stack:
            op = stack.pop()
            if id(op) in seen:
                continue
            seen.add(id(op))
            if not op.graph_safe:
                return op
            if fresh is not None and not op._consumed and (type(op) is not SharedOp or op.core.unclaimed):
                fresh.append(op)
            stack.extend(reversed(op.children()))
        return None

    def describe(self) -> str:
        return self.op_name

    def __repr__(self) -> str:
        return f"<DeviceOp {self.describe()}>"

    def sync_on(self, stream):
        """Execute on ``stream`` and wait for the device; returns the op's value."""
        with executing(lambda: f"sync_on({self.describe()})"):
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
        """Execute on the default stream (the device's own non-blocking stream) and wait."""
        return self.sync_on(_default_stream())

    def async_on(self, stream):
        """Enqueue the work on ``stream`` without waiting; the value's buffers are
        ready once the stream reaches this point."""
        with executing(lambda: f"async_on({self.describe()})"):
            try:
                return self._run(ExecutionContext(stream))
            except RecursionError as exc:
                raise too_deep(self, exc) from exc

    def __await__(self):
        return self._await_on(None).__await__()

    async def _await_on(self, stream):
        stream = stream if stream is not None else _default_stream()
        out = self.async_on(stream)
        event = stream.record_event(timing=False)
        if not event.query():  # wait in a worker thread: the event loop keeps running
            await asyncio.get_running_loop().run_in_executor(None, event.synchronize)
        return out

    def on(self, stream):
        """An awaitable that executes on ``stream``: ``await op.on(stream)``."""
        return self._await_on(stream)

    def graph_on(self, stream):
        """Capture this op on ``stream`` into a replayable CudaGraph (see deviceop.graph)."""
        from .graph import CudaGraph
        check_stream(f"graph_on({self.describe()})", stream)
        try:
            return CudaGraph.capture(self, stream)  # (the capture is ended, and the stream usable, on any error)
        except RecursionError as exc:
            raise too_deep(self, exc) from exc

    def graph(self):
        """``graph_on`` the default stream."""
        return self.graph_on(_default_stream())

    # -- combinators -------------------------------------------------------------
    def map(self, f) -> "DeviceOp":
        """A host-side transform of the value (no GPU work)."""
        return Map(self, f)

    def inspect(self, f) -> "DeviceOp":
        """Call ``f(value)`` for its side effect; the value passes through."""
        return Map(self, f, inspect=True)

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
        if len(shape) == 1 and not hasattr(shape[0], "__index__"):  # reshape([2, 3]) as well as reshape(2, 3)
            shape = shape[0]
        try:
            dims = tuple(operator.index(d) for d in shape)
        except TypeError:
            raise ShapeError(f"reshape() takes dimensions as ints, e.g. .reshape(2, 3) or .reshape([2, 3]); "
                             f"got {shape!r}") from None
        return Reshape(self, dims)

    def unzip(self, n: int | None = None) -> tuple:
        """Split an op producing an n-tuple into n ops; the op runs once."""
        arity = getattr(self, "arity", None)
        if n is None:
            n = arity
            if n is None:
                raise StateError(f"unzip() cannot tell how many values {self.describe()} produces; pass n")
        else:
            try:
                count = operator.index(n)
            except TypeError:
                count = -1
            if count < 0:
                raise ShapeError(f"unzip(n) takes the number of values as an int >= 0, got {n!r}")
            n = count
        if arity is not None and n != arity:
            raise ShapeError(f"unzip({n}) of {self.describe()}, which produces {arity} values: "
                             f"call unzip({arity}) (or unzip())")
        core = self.shared()
        return tuple(Map(core.clone(), _selector(i, n), name=f"select[{i}]") for i in range(n))

    def shared(self) -> "SharedOp":
        return SharedOp(_SharedCore(self))

    def boxed(self) -> "DeviceOp":
        return Boxed(self)


def launched_kernels(op) -> list:
    """The kernels an op tree launches, in order (a graph launch: its graph's kernel nodes).
    Kernels that a ``then`` callback returned are not in the tree and are not listed."""
    names, stack, seen = [], [op], set()
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        graph = getattr(o, "graph", None)
        if getattr(o, "kernel", None) is not None:
            names.append(o.describe())
        elif graph is not None and hasattr(graph, "_nodes"):
            names.extend(n.label for n in graph._nodes)
        stack.extend(reversed((o.core.op,) if isinstance(o, SharedOp) else o.children()))
    return names


def _selector(i: int, n: int):
    """``v[i]`` of a value unzipped into ``n`` parts."""
    def select(v):
        if not isinstance(v, (tuple, list)) or len(v) != n:
            got = f"{len(v)} values" if isinstance(v, (tuple, list)) else f"a {type(v).__name__}"
            raise ShapeError(f"unzip({n}) needs an op producing {n} values, got {got}; pass the op's arity")
        return v[i]
    return select


def _first(v):
    try:
        return v[0]
    except (TypeError, IndexError, KeyError):
        raise ShapeError(f"first() needs an op producing a tuple (a kernel launch's arguments), got "
                         f"{_what(v)}; call it on a launch, or use .map(...)") from None


def _last(v):
    try:
        return v[-1]
    except (TypeError, IndexError, KeyError):
        raise ShapeError(f"last() needs an op producing a tuple (a kernel launch's arguments), got "
                         f"{_what(v)}; call it on a launch, or use .map(...)") from None


def _what(v) -> str:
    return f"an empty {type(v).__name__}" if isinstance(v, (tuple, list)) else f"{v!r:.60} ({type(v).__name__})"


def _unpartition(v):
    if isinstance(v, Partition):
        return v.tensor
    raise StateError(f"unpartition() needs a Partition, got {type(v).__name__}; use it after .first() on a launch")


def _reshape(v, shape):
    if isinstance(v, SharedTensor):
        return v.view(shape)  # a view made through a handle: a borrow while it lives
    if isinstance(v, Tensor):
        return v.view(shape)
    raise ShapeError(f"reshape() needs an op producing a tensor, got {type(v).__name__}")


def _default_stream():
    from .runtime.device import Device
    return Device(0).default_stream()


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
    """``x`` as an op (ops pass through)."""
    return x if isinstance(x, DeviceOp) else Value(x)


def resolve(x, ctx):
    """The value of an argument: ops are executed, plain values pass through."""
    return x._run(ctx) if isinstance(x, DeviceOp) else x


class Map(DeviceOp):
    __slots__ = ("op", "f", "is_inspect", "name")
    graph_safe = True  # host work only; safety is the child's

    def __init__(self, op, f, inspect: bool = False, name: str | None = None):
        super().__init__()
        self.op, self.f, self.is_inspect, self.name = value(op), f, inspect, name

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

    def describe(self):
        return f"{self.op.describe()}.{self.name or ('inspect' if self.is_inspect else 'map')}"

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

    def describe(self):
        return f"{self.op.describe()}.reshape{list(self.shape)}"

    _execute = _run


class Then(DeviceOp):
    __slots__ = ("op", "f")
    graph_safe = True  # what f returns is checked when it runs

    def __init__(self, op, f):
        super().__init__()
        self.op, self.f = value(op), f

    def children(self):
        return (self.op,)

    def _execute(self, ctx):
        nxt = self.f(self.op._run(ctx))
        if isinstance(nxt, DeviceOp) and ctx.capture is not None:
            ctx.capture.check_graph_safe(nxt)
        return resolve(nxt, ctx)

    def describe(self):
        return f"{self.op.describe()}.then"


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


class _SharedCore:
    """The once-cell behind a shared op and all its clones (run by ``SharedOp._run``).

    Claimed without a lock (a lock's acquire and release were a fifth of an
    eager launch's host cost): an execution that finds the cell unclaimed
    appends its ExecutionContext to ``claims``, and since ``list.append`` is
    atomic, of executions racing there the one whose context lands first
    runs the op.  Any other appends an Event and waits; the runner sets every
    Event in ``claims`` once the op is done or failed.  An execution reaching
    the cell it is itself running (its context is ``claims[0]``) is a cycle.
    A context belongs to one thread (executions are non-reentrant, and a
    capture scope records only from the thread that opened it)."""

    __slots__ = ("op", "done", "failed", "result", "claims")

    def __init__(self, op):
        self.op, self.done, self.failed, self.result, self.claims = op, False, False, None, []

    def wake(self) -> None:
        """Wake the executions waiting for the run (``done`` or ``failed`` is set)."""
        for waiter in self.claims[1:]:
            if type(waiter) is threading.Event:
                waiter.set()

    @property
    def unclaimed(self) -> bool:
        """No execution has run, is running or failed the op."""
        return not (self.claims or self.done or self.failed)

    def reset(self) -> None:
        """Back to unclaimed, the result dropped: what a failed capture does to a
        cell it ran, whose result is a buffer only the discarded graph would fill."""
        self.done = self.failed = False
        self.result, self.claims = None, []

    def wait(self, ctx):
        """The result of a run another execution claimed (see the class docstring)."""
        if self.failed:  # raised before waiting: a failed op run again must not grow claims
            raise self._failed_error()
        if not self.done and self.claims[0] is ctx:
            raise StateError(f"shared op {self.op.describe()} depends on its own result")
        event = threading.Event()
        self.claims.append(event)
        while not (self.done or self.failed):  # done/failed are set before the runner wakes anyone
            event.wait()
        if not self.done:
            raise self._failed_error()
        return self.result

    def _failed_error(self) -> StateError:
        return StateError(f"shared op {self.op.describe()} failed when it ran, so its clones have no "
                          "result; build the op again")


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
                except BaseException:
                    core.failed = True
                    claims[0] = None
                    core.wake()
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

    def describe(self):
        return f"shared({self.core.op.describe()})"


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

    def describe(self):
        return f"boxed({self.op.describe()})"

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
