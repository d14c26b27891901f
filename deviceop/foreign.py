"""Other libraries' GPU work as ops: ``dop.foreign`` and ``dop.host_callback``.

``foreign(body, reads=[...], writes=[...])`` is an op whose ``body(stream, *reads,
*writes)`` enqueues any GPU work on the stream it is handed: a cuBLAS GEMM
through torch or CuPy, a Triton kernel, an NCCL collective, a kernel someone
else compiled.  deviceop cannot see inside the body, so the op declares what
the body reads and writes, and those take part in ownership exactly as a
kernel's arguments do.  Eagerly the body runs on the op's stream; captured
(``graph_on``, a scope, ``recapture``), its work becomes one child-graph node
and every replay runs it again (runtime/foreign.py says how the capture is
checked).  On the reference device the op's NumPy ``reference`` runs instead,
and a captured one is replayed.

``host_callback(fn)`` runs ``fn()`` on the host once the stream's work before it
is done: eagerly once, captured at every replay (a HOST node).
"""
from __future__ import annotations

import inspect
import types
import warnings

import numpy as np

from .errors import AliasingError, GraphSafetyError, LaunchError
from .execution import as_an_execution, executing, executing_now, walk
from .memory import read_only_error
from .op import DeviceOp, resolve, warn_if_unexecuted
from .runtime.device import wrong_device
from .tensor import Partition, SharedTensor, Tensor


def _declared(role: str, given) -> list:
    """``(key, value)`` pairs of a reads= or writes= declaration: a list gives the body
    positional arguments (keys are indices), a dict keyword arguments (keys are names)."""
    if given is None:
        return []
    if isinstance(given, dict):
        bad = [k for k in given if not (isinstance(k, str) and k.isidentifier())]
        if bad:
            raise LaunchError(f"{role}= as a dict names the body's keyword arguments; {bad[0]!r} is not a name")
        return list(given.items())
    if isinstance(given, (list, tuple)):
        return list(enumerate(given))
    raise LaunchError(f"{role}= is a list of tensors (the body's positional arguments) or a dict of them (its "
                      f"keyword arguments), got a {type(given).__name__}; e.g. {role}=[x]")


# Plain functions known to fit a call, by what decides it: reading and binding a signature
# costs ~7 us, and an eager loop's body function builds its foreign ops at every iteration
# (a lambda made anew each time has the same code, so it hits too)
_FITS: set = set()
_OWN_SIGNATURE = ("__signature__", "_partialmethod", "__partialmethod__", "_is_coroutine_marker")  # what inspect reads


def _fit_key(fn, positional: list, keywords: list):
    """What decides whether ``fn`` fits this call, where that is its code and its defaults (a
    plain function with no ``__signature__``, partialmethod or coroutine mark of its own), else None."""
    if type(fn) is not types.FunctionType or any(k in fn.__dict__ for k in _OWN_SIGNATURE):
        return None
    return fn.__code__, len(fn.__defaults__ or ()), tuple(fn.__kwdefaults__ or ()), len(positional), tuple(keywords)


def refuse_uncallable(label: str, what: str, fn, positional: list, keywords: list, fix: str) -> None:
    """Refuse ``fn`` now, before anything runs, if it cannot be called with ``positional``
    and ``keywords`` (their names): a body the GPU would call with the wrong arguments
    fails there with a raw TypeError, and the reference device, which never calls the
    body, would accept it.  A callable without a signature (a builtin) is called as is; a
    decorated one is checked as the wrapper it is, not as what functools.wraps says it wraps
    (a decorator may supply arguments itself: the stream, bound values)."""
    key = _fit_key(fn, positional, keywords)
    if key in _FITS:  # (only a plain def that fit is there: no async one)
        return
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise LaunchError(f"{label}'s {what} {getattr(fn, '__name__', type(fn).__name__)} is an async function: "
                          "calling it runs none of its code (it makes a coroutine that nothing awaits); make it a "
                          "plain def, and do its work on the stream it is handed")
    try:
        signature = inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*positional, **dict.fromkeys(keywords))
        if key is not None:
            if len(_FITS) >= 4096:  # (functions made by exec each time would grow it without end)
                _FITS.clear()
            _FITS.add(key)
    except TypeError as exc:
        call = ", ".join([*positional, *(f"{k}=..." for k in keywords)])
        raise LaunchError(f"{label}'s {what} {getattr(fn, '__name__', type(fn).__name__)}{signature} cannot be "
                          f"called as {what}({call}) ({exc}); {fix}") from None


def _on_its_own(label: str, fn):
    """The reference ``fn`` as its own execution (``as_an_execution``: deviceop work inside it is
    refused at a replay as eagerly), returning None where it returned its write arrays (``_written``)."""
    inner = as_an_execution(label, fn)

    def call(*args, **kwargs):
        out = inner(*args, **kwargs)
        return None if _written(out, (*args, *kwargs.values())) else out
    return call


def _written(out, arrays) -> bool:
    """Is ``out`` one of the write arrays (or a tuple of them), as NumPy's ``out=`` returns it
    (``np.matmul(x, w, out=y)``)?  The writes are the writable ``arrays``: the reads are
    read-only, and overlap none of them (the op refused that)."""
    if isinstance(out, tuple) and out:
        return all(_written(o, arrays) for o in out)
    return isinstance(out, np.ndarray) and any(a.flags.writeable and np.may_share_memory(out, a) for a in arrays)


def _stray(out, writes) -> str | None:
    """What of ``out``, a body's return value, is an array outside its ``writes`` (its type
    name), or None.  A library's out= returns the output it wrote (torch, CuPy), and a Triton
    launch returns its compiled kernel: those are fine; a new array (``torch.matmul(a, b)``
    without out=) holds the result, which then reaches no write.  Of a tuple, only when none
    of it lies in a write: ``(out, lse)`` with a new ``lse`` (flash attention) wrote its result."""
    if isinstance(out, (tuple, list)):
        strays = [_stray(o, writes) for o in out]
        wrote = any(s is None and (isinstance(o, Tensor) or hasattr(o, "__cuda_array_interface__"))
                    for s, o in zip(strays, out))
        return None if wrote else next((s for s in strays if s), None)
    if isinstance(out, Tensor):
        return None if out.size == 0 or any(out.overlaps(w) for w in writes) else "Tensor"
    try:
        cai = out.__cuda_array_interface__
        pointer = int(cai["data"][0])
    except Exception:  # noqa: BLE001 - no array (or none that says where it lives): not a result
        return None
    if pointer == 0 or 0 in tuple(cai.get("shape", ())):  # an empty array holds no result
        return None
    inside = any(lo <= pointer < hi for lo, hi in (w.memory_range() for w in writes))
    return None if inside else type(out).__name__


def _writing(label: str, body, writes: list):
    """``body`` refusing to return its result instead of writing it (``writes``: the tensors of
    the writes, filled in once the op's inputs ran): eagerly that result was lost, silently, as
    the reference device refuses a reference that returns it."""
    def call(stream, *args, **kwargs):
        out = body(stream, *args, **kwargs)
        stray = _stray(out, writes)
        if stray is not None:
            raise LaunchError(f"{label}'s body returned a {stray} that is none of its writes=: the work's result went "
                              "into a new array, which nothing reads (e.g. torch.matmul(a, b) without out=). Write "
                              "it into a declared write: out=torch.from_dlpack(y), out=y.to_cupy(), or copy it in")
        return out
    return call


def _name(role: str, key) -> str:
    return f"{role}[{key}]" if isinstance(key, int) else key


def _read(label: str, name: str, v) -> Tensor:
    if isinstance(v, SharedTensor):
        return v.tensor
    if isinstance(v, Tensor):
        return v
    hint = (" (a partition is how a kernel writes: declare the buffer in writes=, or read partition.tensor)"
            if isinstance(v, Partition) else
            " (host data: copy it to the device with dop.from_numpy(array))" if hasattr(v, "__array_interface__")
            else " (a kernel launch's value is the tuple of its arguments: pass launch.first().unpartition())"
            if isinstance(v, tuple) else "")
    raise LaunchError(f"{label} reads {name}, which must be a Tensor or SharedTensor, got {type(v).__name__}{hint}")


def _write(label: str, name: str, v) -> Tensor:
    """The tensor behind a write: a SharedTensor only when nothing else can reach its
    buffer (as ``try_partition`` would claim it); a Tensor or Partition is a mutable
    borrow its caller vouches for, as ``tensor.partition`` is for a kernel."""
    t = v.check_writable(f"{label} writes {name}") if isinstance(v, SharedTensor) else \
        v.tensor if isinstance(v, Partition) else v if isinstance(v, Tensor) else None
    if t is not None:
        if t._alloc.read_only:
            raise read_only_error(f"{label} writes {name}", t)
        return t
    hint = " (host data: copy it to the device with dop.from_numpy(array))" \
        if hasattr(v, "__array_interface__") else ""
    raise LaunchError(f"{label} writes {name}, which must be a Tensor, a Partition or a SharedTensor held alone, "
                      f"got {type(v).__name__}{hint}")


class ForeignOp(DeviceOp):
    """Another library's GPU work as an op (see :func:`foreign`); its value is the
    tuple of its writes, as given."""

    __slots__ = ("body", "declared_reads", "declared_writes", "reference", "warmup", "name")
    graph_safe = True

    def __init__(self, body, reads, writes, reference, warmup, name):
        super().__init__()
        if isinstance(body, DeviceOp) or not callable(body):
            if isinstance(body, DeviceOp):
                body.discard()
            raise LaunchError("dop.foreign(body, ...) takes a function body(stream, *reads, *writes) that enqueues "
                              f"GPU work on the stream, got a {type(body).__name__}")
        for what, f in (("reference", reference), ("warmup", warmup)):
            if f is not None and f is not True and not callable(f):
                raise LaunchError(f"dop.foreign's {what}= is a function (or, for warmup, True), got {f!r}")
        self.body, self.reference, self.warmup = body, reference, warmup
        self.name = name if name is not None else getattr(body, "__name__", type(body).__name__)
        self.declared_reads, self.declared_writes = _declared("reads", reads), _declared("writes", writes)
        keys = [k for k, _ in self.declared_reads + self.declared_writes if isinstance(k, str)]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise LaunchError(f"{self.describe()} declares {twice[0]!r} in both reads= and writes=; a buffer the "
                              "body reads and writes (in place) is declared once, in writes=")
        declared = self.declared_reads + self.declared_writes
        positional = [_name("reads" if i < len(self.declared_reads) else "writes", k)
                      for i, (k, _) in enumerate(declared) if isinstance(k, int)]
        keywords = [k for k, _ in declared if isinstance(k, str)]
        order = ("it takes the reads, then the writes, as declared (a list's as positional arguments, "
                 "a dict's as keyword arguments)")
        try:
            refuse_uncallable(self.describe(), "body", body, ["stream", *positional], keywords,
                               f"a body is body(stream, *reads, *writes): {order}")
            if callable(warmup):
                refuse_uncallable(self.describe(), "warmup", warmup, ["stream", *positional], keywords,
                                   f"a warm-up is called as the body is, warmup(stream, *reads, *writes): {order}")
            if reference is not None:
                refuse_uncallable(self.describe(), "reference", reference, positional, keywords,
                                   f"a reference is reference(*reads, *writes), without the stream: {order}, as "
                                   "NumPy arrays")
        except LaunchError:
            for _, v in declared:  # the ops it was given will never run: no warning that they did not
                if isinstance(v, DeviceOp):
                    v.discard()
            raise
        values = [v for _, v in declared]
        if not any(isinstance(v, DeviceOp) for v in values):
            self._tensors(values[:len(self.declared_reads)], values[len(self.declared_reads):])  # refused now, before anything runs
        for v in values:
            if isinstance(v, DeviceOp):
                v._armed = False  # run by this op
        self._armed = True

    __del__ = warn_if_unexecuted

    def children(self):
        return tuple(v for _, v in self.declared_reads + self.declared_writes if isinstance(v, DeviceOp))

    def describe(self) -> str:
        return f"dop.foreign({self.name})"

    def writes(self) -> tuple:
        """The tensors this op writes that are known before it runs (a loop body's checks)."""
        return tuple(v._tensor if isinstance(v, SharedTensor) else v.tensor if isinstance(v, Partition) else v
                     for _, v in self.declared_writes if isinstance(v, (Tensor, SharedTensor, Partition)))

    def _tensors(self, reads, writes) -> list:
        """The tensors of the reads and writes, in order, checked: a write needs its
        buffer (a shared one alone), and no write overlaps another or a read."""
        label = self.describe()
        rs = [(_name("reads", k), _read(label, _name("reads", k), v)) for (k, _), v in zip(self.declared_reads, reads)]
        ws = [(_name("writes", k), _write(label, _name("writes", k), v)) for (k, _), v in zip(self.declared_writes, writes)]
        for i, (wname, w) in enumerate(ws):
            for how, others in (("writes", ws[i + 1:]), ("reads", rs)):
                for other, t in others:
                    if w.overlaps(t):
                        raise AliasingError(f"{label} writes {wname} and {how} {other} from overlapping memory; "
                                            "give each write its own buffer (a buffer read and written in place "
                                            "is declared once, in writes=)")
        return [t for _, t in rs + ws]

    def _execute(self, ctx):
        device = ctx.device
        reference = None if self.reference is None else _on_its_own(self.describe(), self.reference)
        written: list = []  # the writes' tensors, for the body's return value (known below)
        runner = device.foreign(self.describe(), _writing(self.describe(), self.body, written), reference,
                                self.warmup)
        reads = [resolve(v, ctx) for _, v in self.declared_reads]
        writes = [resolve(v, ctx) for _, v in self.declared_writes]
        tensors = self._tensors(reads, writes)  # checked again: clones may have been made since
        written.extend(tensors[len(reads):])
        for t in tensors:  # the body's libraries would run on the stream's GPU with another GPU's pointers
            if t.device is not device:
                raise wrong_device(f"executing {self.describe()}", device, t.device, "a tensor of its reads/writes")
        if ctx.guard is not None:  # in a loop's body: not into the loop's index or count
            for t in tensors[len(reads):]:
                ctx.guard.check(t, self.describe)
        keys = [k for k, _ in self.declared_reads + self.declared_writes]

        def arguments(values):
            args = [v for k, v in zip(keys, values) if isinstance(k, int)]
            return args, {k: v for k, v in zip(keys, values) if isinstance(k, str)}

        def bind(stream):  # the tensors, at home on the body's stream: a DLPack import there waits on nothing else
            homed = []
            for t in tensors:
                twin = t._twin()
                twin._home_stream = stream
                homed.append(twin)
            return arguments(homed)

        def arrays():  # for the NumPy reference: reads read-only, writes written in place
            views = [t._array.view() for t in tensors]
            for a in views[:len(reads)]:
                a.flags.writeable = False
            return arguments(views)

        runner.run(ctx.stream, bind, arrays, ctx.capture)
        if ctx.capture is not None:
            ctx.capture.keep.append(tensors)  # every replay reads and writes these buffers
        return tuple(writes)


def foreign(body, *, reads=(), writes=(), reference=None, warmup=None, name=None) -> ForeignOp:
    """Another library's GPU work as an op: ``body(stream, *reads, *writes)`` enqueues
    it on ``stream`` (a cuBLAS GEMM through torch or CuPy, a Triton kernel, an NCCL
    call, a kernel from another compiler).

    Named for what it holds: work foreign to deviceop, declared at its boundary,
    as a foreign function interface (JAX's ``ffi_call``) declares code of another
    language.  Not "external": CUDA libraries use that word for a stream or memory
    another library owns (``torch.cuda.ExternalStream``), which this op is handed.

    * ``reads`` / ``writes``: the tensors the body reads and writes, a list (the
      body's positional arguments, reads first) or a dict (keyword arguments);
      an op in either runs first and gives its tensor.  They are checked as a
      kernel's arguments are: a write is a Tensor or Partition (a mutable borrow
      the caller vouches for) or a SharedTensor held alone (else OwnershipError);
      a write overlapping another write or a read is an AliasingError.  A buffer
      updated in place is declared once, in ``writes``.  The body gets them as
      deviceop Tensors: ``torch.from_dlpack(t)`` and ``t.to_cupy()`` view them
      without a copy.  The body writes its results into the writes and returns
      nothing (or the writes, as ``out=`` returns them): a new array returned is
      a LaunchError, its result reaching no write.
    * ``stream``, the body's first argument, is a deviceop CUDA stream: it has
      ``__cuda_stream__`` (cuda.core, CuPy, nccl4py take it), ``.ptr`` (its handle
      as an int), ``.torch`` (a ``torch.cuda.ExternalStream``: ``with
      torch.cuda.stream(stream.torch):`` runs torch ops and Triton kernels on it)
      and ``.cupy`` (``with stream.cupy:``).  Enqueue everything on it: work on
      another stream is not ordered with the op, and is not captured.
    * Eagerly the body runs once on the op's stream.  Captured, it runs once on
      a stream deviceop captures in CUDA's thread-local mode; its work becomes
      one child-graph node, re-run by every replay.  What a graph cannot replay
      is a CaptureError naming the cause and the fix, the capture ended and
      nothing recorded: an allocation, a synchronization, work on the legacy
      default stream, an allocation through torch's caching allocator, a body
      that captured nothing (its work went to another stream) or that enqueued
      on the capturing stream itself.  An exception from the body ends the
      capture the same way, and goes on unchanged.
    * ``warmup``: True runs the body once more, eagerly, just before it is
      captured (on the stream the capture uses, after the work queued before the
      capture, and waited for): where cuBLAS allocates its workspace, Triton
      compiles and a library loads its modules.  A function runs instead of the
      body for that.  The warm-up computes: it writes the writes.
    * ``reference``: a NumPy function ``reference(*reads, *writes)`` (same order
      and names) that writes its results into the write arrays; the reference
      device runs it where a GPU runs the body (and the warm-up), and a captured
      one at every replay.  Without it the reference device refuses the op
      (NoDeviceError, naming ``reference=``).
    * ``name``: what errors and graph nodes call it (default: the body's name).

    The op's value is the tuple of its writes, as given (``.first()`` is the first).
    """
    return ForeignOp(body, reads, writes, reference, warmup, name)


class HostCallback(DeviceOp):
    """``fn()`` on the host, in stream order (see :func:`host_callback`); value None."""

    __slots__ = ("fn", "name")
    graph_safe = True

    def __init__(self, fn, name):
        super().__init__()
        if isinstance(fn, DeviceOp) or not callable(fn):
            if isinstance(fn, DeviceOp):
                fn.discard()
            raise LaunchError(f"dop.host_callback(fn) takes a function of no arguments, got a {type(fn).__name__}")
        self.fn = fn
        refuse_uncallable(f"dop.host_callback({getattr(fn, '__name__', type(fn).__name__)})", "fn", fn, [], [],
                           "a host callback is called with no arguments at every run: bind what it needs "
                           "first (functools.partial(fn, x), or a closure)")
        self.name = name if name is not None else getattr(fn, "__name__", type(fn).__name__)
        self._armed = True

    __del__ = warn_if_unexecuted

    def describe(self) -> str:
        return f"dop.host_callback({self.name})"

    @property
    def host_node(self) -> str:
        """What this op records that a conditional node's body cannot hold (see refuse_host_nodes)."""
        return self.describe()

    def _execute(self, ctx):
        label, fn = self.describe(), self.fn
        if ctx.capture is not None:
            if ctx.body is not None:
                raise in_conditional_body(label, ctx.body)
            ctx.capture.hosts.append(label)  # a graph launched inside a conditional body later is refused for it

        def call():  # a driver thread runs it: an exception cannot reach the caller, so it is reported
            try:
                if executing_now() is None:  # deviceop work inside it (a replay, an op) is refused, as the
                    with executing(label):   # driver refuses CUDA calls from a host function, on both devices
                        fn()
                else:  # run inline by an execution on this thread (the reference device): already refused
                    fn()
            except Exception as exc:
                warnings.warn(f"{label} raised {type(exc).__name__}: {exc}; a host callback cannot stop the "
                              "stream's work, which went on", RuntimeWarning, stacklevel=2)

        registration = ctx.device.launch_host_func(ctx.stream, call, label)
        if registration is not None:  # captured: the function must stay callable while the graph lives
            (ctx.capture.keep if ctx.capture is not None else _captured_elsewhere).append(registration)
        return None


def refuse_host_nodes(op, body: str) -> None:
    """Refuse ``op``, the body of the conditional node ``body``, if its tree holds a host node (an op
    with a ``host_node``: a host callback, the launch of a graph holding one), before the node is
    added: refused alike where the GPU adds the node before recording its body and where the
    reference device does not.  (One a ``then`` returns is refused when it runs.)"""
    for o in walk(op):
        what = getattr(o, "host_node", None)
        if what:
            raise in_conditional_body(what, body)


def in_conditional_body(what: str, body: str) -> GraphSafetyError:
    """The error of a host node (a host callback, a graph holding one) in a captured loop's or branch's body."""
    return GraphSafetyError(f"{what} cannot be captured in the body of {body}: a captured loop or branch is a CUDA "
                            "conditional node, whose body may hold kernels, copies, fills, child graphs and "
                            "conditionals, and no host node (CUDA's rule, through child graphs too). Record the host "
                            "work before or after the loop or branch, or run the loop or branch eagerly")


_captured_elsewhere: list = []  # host functions captured by a capture deviceop did not begin: kept for good


def host_callback(fn, *, name=None) -> HostCallback:
    """``fn()`` runs on the host once the work enqueued on the stream before it is
    done, and the stream's later work waits for it (``cuLaunchHostFunc``).  Eagerly
    it runs once; captured it is a HOST node that runs at every replay — the place
    for host work a replay must repeat (a counter, a timestamp, a log line).

    Limits: ``fn`` runs on a driver thread and must not call CUDA, or anything that
    waits for the GPU (no CuPy or torch calls, no ``tensor.numpy()``): the driver may
    refuse it or deadlock.  It should be short, as the stream waits for it.  An
    exception it raises cannot stop the GPU: it becomes a RuntimeWarning.  A CUDA
    conditional node's body (a captured loop or branch) holds no host node: refused there."""
    return HostCallback(fn, name)
