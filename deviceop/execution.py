"""Where an op executes: the ExecutionContext (device, stream, capture), the
thread's non-reentrant execution lock, the recursion limit, the process-wide
counters, and the once-cell behind shared ops."""
from __future__ import annotations

import itertools
import sys
import threading
import warnings
from threading import get_ident

from .errors import LaunchError, ReentrancyError, StateError, UnexecutedOpWarning
from .runtime.stream import captured_elsewhere, capturing, not_a_stream, stream_key
from .tensor import Partition, SharedTensor, Tensor

stats = {"launches": 0, "allocations": 0, "copies": 0}  # process-wide counters (tests, diagnostics)


class ExecutionContext:
    """Where an execution runs: the device and stream, whether a graph is being
    captured (then only graph-safe work is allowed), and the buffers it may read
    and not write (``guard``: a loop's index and count while its body runs).
    ``plain`` (neither): kernel launches may take the eager fast path.  ``body``: the
    conditional node (a captured loop or branch) whose body it records, which CUDA
    lets hold only kernels, copies, fills, child graphs and conditionals (no host nodes)."""

    __slots__ = ("device", "stream", "capture", "guard", "plain", "body")

    def __init__(self, stream, capture=None, guard=None, body=None):
        try:
            self.device = stream.device
        except AttributeError:
            raise not_a_stream("running an op (sync_on, async_on, graph.update ...)", stream) from None
        self.stream = stream
        self.capture = capture  # None, or the capture in progress (graph layer)
        self.guard = guard      # None, or the BodyGuard of the loop body it runs
        self.plain = capture is None and guard is None
        self.body = body        # None, or the label of the conditional node whose body is captured

    def __repr__(self) -> str:
        return f"ExecutionContext({self.stream!r}{', capturing' if self.capture else ''})"


def walk(op):
    """Each op of ``op``'s tree once, depth first (shared clones make the tree a DAG: walked
    as a tree it is exponential).  Ops a ``then`` callback returns are not in the tree."""
    stack, seen = [op], set()
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        yield o
        stack.extend(reversed(o.children()))  # children in their order: the first found is the first run


def tensors_device(op, what: str):
    """The device of the tensors ``op``'s tree holds before it runs (a graph launch: the
    graph's device), or None where it holds none; tensors of two devices are refused.
    ``op.sync()`` runs on this device's default stream: Device(0)'s for an op on GPU 1 would
    open GPU 0 and launch there with GPU 1's pointers (a fault that loses the context)."""
    device = None
    for o in walk(op):
        for d in _devices_in(o):
            if device is None:
                device = d
            elif d is not device:
                raise LaunchError(f"{what}: {op.describe()} uses tensors of {device.label} and of {d.label}, so "
                                  "it has no one default stream; execute it on a stream you choose: "
                                  "op.sync_on(stream) / op.graph_on(stream) / await op.on(stream)")
    return device


_slot_names: dict = {}  # op class -> (its slots that may hold tensors, whether it has home_device): once per class


def _devices_in(op) -> list:
    """The devices of the tensors an op holds (kernel arguments, copy and fill buffers, foreign
    reads and writes, values, a shared op's result once computed): whatever its public slots
    hold (a leading underscore marks an op's own state: generics, flags, builders), one level
    into tuples, lists and (key, value) pairs, so that every op class is covered without
    declaring them; and ``op.home_device()`` where the op defines it (a graph launch).  The
    slot names are read once per class: this runs for every op of an op.sync()'s tree."""
    cls = type(op)
    layout = _slot_names.get(cls)
    if layout is None:
        names = []
        for c in cls.__mro__:
            slots = c.__dict__.get("__slots__", ())
            names += [n for n in ((slots,) if isinstance(slots, str) else slots) if not n.startswith("_")]
        layout = _slot_names[cls] = (tuple(names), hasattr(cls, "home_device"))
    names, has_home = layout
    found = []
    for name in names:
        v = getattr(op, name, None)
        if type(v) is _SharedCore:  # a shared op computed already: its tree is gone, its result holds the tensors
            v = v.result if v.done else None
        if type(v) is tuple or type(v) is list:
            _devices_within(v, found, 4)
        else:
            d = _device_of(v)
            if d is not None:
                found.append(d)
    if has_home:
        found.append(op.home_device())
    return found


def _devices_within(items, found: list, depth: int) -> None:
    """The devices of the tensors in nested tuples and lists (a value of pairs of tensors,
    foreign ``(name, tensor)`` pairs), a few levels down."""
    for x in items:
        if type(x) is tuple or type(x) is list:
            if depth:
                _devices_within(x, found, depth - 1)
            continue
        d = _device_of(x)
        if d is not None:
            found.append(d)


def _device_of(v):
    """The device of a tensor, a partition's or a live SharedTensor's; None for anything else."""
    tv = type(v)
    if tv is Tensor:
        return v.device
    if tv is Partition:
        return v.tensor.device
    if tv is SharedTensor:
        return v._tensor.device if v._tensor is not None else None  # (a released handle holds none)
    return v.device if isinstance(v, Tensor) else None


def check_stream(what: str, stream) -> None:
    """Refuse what is not a stream before a capture begins (an execution finds out by itself)."""
    if getattr(stream, "device", None) is None:
        raise not_a_stream(what, stream)


# Ops are numbered as they are built (DeviceOp.__init__): a loop tells the ops its
# body function built from ones built before the call (graph/loops.py's refuse_prebuilt).
BIRTHS = itertools.count()


def births_mark() -> int:
    """A number below the birth of every op built from now on."""
    return next(BIRTHS)


# Executing an op recurses through its tree, a frame or a few per nested op.
# On Python 3.11+ those frames use no C stack (Python-to-Python calls run
# inline), so deviceop raises the recursion limit to this once, where it was
# lower, for chains of thousands of launches to execute.  Once, not around
# each execution: setrecursionlimit visits every thread, and raising and
# restoring it would add ~0.1 us to every eager execution.
RECURSION_LIMIT = 20_000 if sys.version_info >= (3, 11) else sys.getrecursionlimit()
if sys.getrecursionlimit() < RECURSION_LIMIT:
    sys.setrecursionlimit(RECURSION_LIMIT)


_SHOWN = 6  # wrappers a long chain's description shows at each end


def describe_chain(op) -> str:
    """The description of a wrapper op (``x.map.reshape[2, 3]``, ``shared(boxed(x))``), made
    without recursion: errors about a chain too deep to execute must describe it too.  A
    chain of more than ``2 * _SHOWN`` wrappers shows its innermost op, the wrappers at
    each end and how many are left out."""
    parts = []
    while True:
        wrapped = op._wrapped()
        if wrapped is None:
            break
        prefix, op, suffix = wrapped
        parts.append((prefix, suffix))
    if len(parts) > 2 * _SHOWN:
        parts = parts[:_SHOWN] + [("", f"...({len(parts) - 2 * _SHOWN} more)...")] + parts[-_SHOWN:]
    return "".join(p for p, _ in parts) + op.describe() + "".join(s for _, s in reversed(parts))


def too_deep(op, exc: RecursionError) -> StateError:
    """The error of an execution that ran past Python's recursion limit."""
    return StateError(
        f"executing {op.describe()} exceeded Python's recursion limit "
        f"({sys.getrecursionlimit()} frames: {exc}): an op "
        "tree this deep is a chain of thousands of ops, each nested in the next (or a callback that recurses). "
        "The tree is now partly executed: build it again, and compose long sequences side by side "
        "(DeviceOpVec / zip_ of ops that each take the previous result's buffer), run the chain in pieces, "
        "or raise the limit with sys.setrecursionlimit(...)")


SCOPE = "CudaGraph.scope"  # what an open capture scope holds the execution lock as

# How an op becomes a graph (DeviceOp.graph_on): CudaGraph.capture (graph/cudagraph.py), which
# deviceop/graph/__init__.py installs with set_capture when it is imported (``import deviceop``
# does).  This layer may not import the graph layer above it (tests/test_architecture.py).
_capture = None


def set_capture(capture) -> None:
    """Install ``capture(op, stream, parallel) -> CudaGraph`` as what ``capture_graph`` calls:
    deviceop/graph/__init__.py installs ``CudaGraph.capture`` (the one caller)."""
    global _capture
    _capture = capture


def capture_graph(op, stream, parallel: bool):
    """Capture ``op`` on ``stream`` into a replayable graph: ``CudaGraph.capture`` (see set_capture)."""
    return _capture(op, stream, parallel)


# thread ident -> the ``executing`` that holds that thread's execution lock.  A dict, not a
# thread-local: a capture beginning on a stream looks here for other threads' executions
# on it, and a scope collected on another thread can give its thread's lock back.
_running: dict = {}


def executing_now():
    """What holds this thread's execution lock (an ``executing``), or None."""
    return _running.get(get_ident())


def refuse_reentry(what, current) -> ReentrancyError:
    """The error of executing ``what`` while ``current`` (an ``executing``) runs on this thread."""
    what = what if isinstance(what, str) else what()
    current = current.what if isinstance(current.what, str) else current.what()
    fix = ("Inside a capture scope, record the op with s.record(op) (it runs as it is recorded), or "
           "execute it after the scope ends" if current == SCOPE else
           "Compose with .then(...) instead of executing inside a callback")
    if what.startswith("graph.replay()"):
        fix = "Replay the graph before or after that execution (or capture), not inside it"
    return ReentrancyError(f"{what} was called while {current} is executing on this thread; "
                           f"DeviceOp execution is non-reentrant. {fix}")


class executing:
    """Hold the thread's execution lock (non-reentrant, as in cutile-rs): ``what`` is a
    string, or a callable that makes one (only for the error).

    With a ``stream`` (eager executions) the execution is also work enqueued on that
    stream: it is refused while another thread captures the stream (``captured_elsewhere``).
    The execution is in ``_running`` before it looks for a capture, and a capture notes
    itself in ``capturing`` before it looks in ``_running`` (graph.CudaGraph._begin_or_abort):
    of the two, at least one sees the other.

    A class, not a @contextmanager generator: it is entered on every
    execution, and a generator-based context manager costs ~1 us more."""

    __slots__ = ("what", "stream", "ident", "thread")  # thread: set by a scope, which may outlive it

    def __init__(self, what, stream=None):
        self.what, self.stream = what, stream

    def __enter__(self):
        self.ident = ident = get_ident()
        current = _running.get(ident)
        if current is not None:
            holder = getattr(current, "thread", None)
            if holder is None or holder.is_alive():  # else a scope left open by a thread that ended: stale
                raise refuse_reentry(self.what, current)
        _running[ident] = self
        stream = self.stream
        if stream is not None and capturing:  # (a capture is open somewhere: is it on this stream?)
            owner = capturing.get(stream_key(stream))
            if owner is not None and owner[0] != ident:
                del _running[ident]
                raise captured_elsewhere(self.what if isinstance(self.what, str) else self.what(), owner)
        return self

    def __exit__(self, *exc):
        _running.pop(self.ident, None)
        return False

    def release_from_anywhere(self) -> None:
        """Give the lock back from any thread (a scope collected without ``__exit__``)."""
        if _running.get(self.ident) is self:
            _running.pop(self.ident, None)


def as_an_execution(label: str, fn):
    """``fn`` holding the thread's execution lock while it runs, unless an execution holds it
    already: the reference device runs a captured kernel's or foreign op's NumPy reference at
    every replay, outside any execution, where deviceop work inside it (``op.sync_on``,
    ``graph.replay()``) would run unrecorded; refused there as it is eagerly (ReentrancyError)."""
    def call(*args, **kwargs):
        if _running.get(get_ident()) is not None:
            return fn(*args, **kwargs)
        with executing(label):
            return fn(*args, **kwargs)
    return call


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

    __slots__ = ("op", "done", "failed", "result", "claims", "error", "born")

    def __init__(self, op):
        self.op, self.done, self.failed, self.result, self.claims = op, False, False, None, []
        self.born = next(BIRTHS)  # when .shared() made it: a branch tells a cell made before its function ran
        self.error = None  # what the op raised when it failed: every other consumer's error is chained to it

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
        self.result, self.claims, self.error = None, [], None

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

    def fail(self, exc: BaseException) -> None:
        """The run raised ``exc``: remember it (the waiters' errors are chained to it) and wake them."""
        self.error, self.failed = exc, True
        self.claims[0] = None
        self.wake()

    def _failed_error(self) -> StateError:
        """What every consumer but the one that ran the op sees: a StateError whose cause is the original."""
        cause = self.error
        why = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
        err = StateError(f"shared op {self.op.describe()} failed when it ran, so its clones have no result"
                         f"{why}, the cause of this error; build the op again")
        err.__cause__ = cause
        return err


def warn_if_unexecuted(op) -> None:
    """The ``__del__`` of the ops that do device work (kernel launches, memcpy, graph
    launches): one that was built, never executed, never taken into a larger op and
    never ``discard()``-ed did nothing, silently, so say so (as asyncio does for a
    coroutine never awaited).  Other ops need no check: their work is their children's."""
    try:
        if not op._armed or op._consumed:
            return
        what = op.describe()
    except Exception:  # a half-built op (its __init__ raised) never armed; nothing to say
        return
    warnings.warn(f"{what} was never executed, so its work never ran: call .sync_on(stream) (or "
                  "graph.replay() for a graph), or drop it deliberately with op.discard()",
                  UnexecutedOpWarning, stacklevel=2)
