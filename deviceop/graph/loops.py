"""Loops that stay on the device: ``loop(count, index, body)`` and ``while_(cond, body)``.

Executed eagerly, a loop is a host loop (the body rebuilt and run each
iteration).  Captured into a graph it becomes one CUDA *conditional WHILE
node*: the body is captured once into the node's child graph, and the loop
runs entirely on the GPU — T iterations, one graph launch, no host round trip.

How the capture is wired (driver API, CUDA >= 12.4):

* a conditional handle is created on the graph being captured;
* a one-thread control kernel, captured before the node, sets the handle
  (``loop``: writes ``index = 0`` and tests ``0 < count``; ``while_``: tests
  ``cond != 0``), and the WHILE node is added after it by hand, becoming the
  capturing stream's new dependency;
* the body is captured into the node's child graph on a second stream
  (``cuStreamBeginCaptureToGraph``), followed by the control kernel again
  (``loop``: ``index += 1``, test ``index < count``).  On sm_90 and newer that
  launch is a programmatic dependent launch: the control kernel starts while
  the body's last kernel finishes and waits (``griddepcontrol.wait``) for it to
  complete before it touches the index or the condition, so its launch latency
  is off each iteration's critical path.

``count`` is an int (baked into the graph) or an int32 device tensor of one
element, read by the control kernel at every test: change it between replays
and the same graph runs a different number of iterations.  After a ``loop``
the index holds the number of iterations run, in every mode; a device count
that is negative runs none (the index is 0), as a count of 0 does.

On the reference device a captured loop is a tape step that replays the
body's recorded tape with the same control logic (``_host_control``).
"""
from __future__ import annotations

import inspect

import numpy as np

from ..compile import compile_cubin
from ..errors import CapabilityError, DTypeError, LaunchError, ShapeError
from ..execution import BodyGuard, births_mark, walk
from ..foreign import refuse_host_nodes
from ..op import DeviceOp, ExecutionContext, SharedOp, value
from ..runtime.device import device_key, load_module, wrong_device
from ..runtime.launch import LaunchConfig, ptr
from ..memory import read_only_error
from ..tensor import SharedTensor, Tensor

_CONTROL_SOURCE = r"""
// Declared as cuda_device_runtime_api.h does (that header drags in internal
// ones NVRTC warns about); the driver resolves it when the module loads.
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle,
                                                                      unsigned int value);

// The control step of loop(count, index, body): one thread.  start=1 before
// the loop (index = 0), start=0 after each iteration (index += 1); then the
// WHILE node's condition = index < count (count from memory when given).
__device__ __forceinline__ void wait_for_the_body() {  // a no-op unless launched with PDL
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

extern "C" __global__ void deviceop_loop_for(cudaGraphConditionalHandle h, int* index,
                                             const int* count_ptr, int count, int start) {
    wait_for_the_body();
    int i = start ? 0 : *index + 1;
    *index = i;
    int n = count_ptr ? *count_ptr : count;
    cudaGraphSetConditional(h, i < n ? 1u : 0u);
}

// The control step of while_(cond, body): the condition is cond != 0.
extern "C" __global__ void deviceop_loop_while(cudaGraphConditionalHandle h, const int* cond) {
    wait_for_the_body();
    cudaGraphSetConditional(h, *cond != 0 ? 1u : 0u);
}
"""
_ONE_THREAD = LaunchConfig(1, 1)
_control: dict = {}  # (device type, ordinal) -> (loop_for, loop_while) Functions


def _control_functions(device):
    key = device_key(device)
    fns = _control.get(key)
    if fns is None:
        mod = load_module(compile_cubin(_CONTROL_SOURCE, arch=device.arch, filename="deviceop_loop.cu"), device)
        fns = _control[key] = (
            mod.get_function("deviceop_loop_for", ["uint64", ptr("int32"), ptr("int32"), "int32", "int32"]),
            mod.get_function("deviceop_loop_while", ["uint64", ptr("int32")]))
    return fns


def _control_launcher(stream, fn, start: bool):
    """How to launch a control kernel: after the body (``start`` False) on sm_90+,
    as a programmatic dependent launch (the kernel waits for the body itself)."""
    cc = stream.device.compute_capability
    return fn.launch if start or cc is None or cc < (9, 0) else fn.launch_pdl


def _int32_cell(x, what: str, example: str) -> Tensor:
    """``x`` as the one-element int32 device tensor a loop reads or writes."""
    t = x.tensor if isinstance(x, SharedTensor) else x
    if not isinstance(t, Tensor):
        raise DTypeError(f"{what} must be an int32 device tensor of one element (e.g. {example}), "
                         f"got {type(x).__name__}: the GPU reads it at every iteration, so it must live there")
    if t.dtype.name != "int32":
        raise DTypeError(f"{what} must be int32 (the loop's control kernel reads a 32-bit int), got {t.dtype.name}; "
                         f"e.g. {example}")
    if t.size != 1:
        raise ShapeError(f"{what} must hold exactly one element, got shape {list(t.shape)}")
    return t


def _body_builder(body, nargs: int = 1, what: str = "a loop body", example: str = "lambda i: kernel(...)"):
    if isinstance(body, DeviceOp) or not callable(body):
        if isinstance(body, DeviceOp):
            body.discard()  # refused: the error, not a warning when it is dropped, says so
        raise LaunchError(f"{what} is a function that builds the body op (an op runs once, and the body "
                          f"runs many times): pass e.g. {example}, not {type(body).__name__}")
    try:
        inspect.signature(body).bind(*range(nargs))
    except TypeError:  # refused here, before anything runs, rather than by the call mid-capture
        raise LaunchError(f"{what} is called with {nargs} argument(s) ({'the index' if nargs else 'none'}), and "
                          f"{getattr(body, '__name__', 'it')}{inspect.signature(body)} cannot take that: pass e.g. "
                          f"{example}") from None
    except ValueError:  # no signature to read (a builtin): the call itself will tell
        pass
    return body


def built_op(x, what: str) -> DeviceOp:
    """The op a body or branch function returned; anything else (``None``: a missing
    ``return``) is refused, as it would silently run nothing at every iteration."""
    if not isinstance(x, DeviceOp):
        raise LaunchError(f"{what} returned {type(x).__name__}, not an op: the function must return the op it "
                          "builds (a missing `return`?); for an empty body return dop.zip_()")
    return value(x)


def refuse_prebuilt(op: DeviceOp, mark: int, label: str) -> None:
    """Refuse a body holding an op built before its function was called (a closure's op,
    or a shared op's source; a shared op that has run is a value, welcome): captured, that
    op would run at every iteration, but eagerly an op runs once, so the two modes would
    part after the first iteration."""
    for o in walk(op):  # (a shared op comes before its source: its error names the fix that fits it)
        if isinstance(o, SharedOp) and not o.core.done and o.core.op._born < mark:
            raise LaunchError(f"the body of {label} holds {o.describe()}, which has not run and was built "
                              "before the body function was called: captured it would run at every iteration, "
                              "eagerly once. Run it before the loop (e.g. shared.clone().sync_on(stream)): a shared "
                              "op that has run is a value the body may hold; or build it in the body function")
        if o._born < mark and not (isinstance(o, SharedOp) and o.core.done):  # a done one is a value
            raise LaunchError(f"the body of {label} holds {o.describe()}, built before the body function was "
                              "called: an op runs once, and the body runs at every iteration, so the function "
                              "must build its ops each time it is called (e.g. lambda i: kernel(...), not "
                              "lambda i: op_built_earlier)")


def refuse_cells_elsewhere(ctx, cells, label: str) -> None:
    """Refuse a loop or branch whose control cells (count, index, condition) are another
    device's than the stream's: its control kernel, or the host reading them, would be
    given another GPU's pointers (as a kernel launch refuses)."""
    for t in cells:
        if t is not None and t.device is not ctx.device:
            raise wrong_device(f"executing {label}", ctx.device, t.device, "its count, index or condition")


class _Loop(DeviceOp):
    """The shared machinery of ``loop`` and ``while_``: eager host loop,
    conditional WHILE node when captured, tape loop on the reference device."""

    __slots__ = ("_body", "_label")
    graph_safe = True

    def __init__(self, body, label: str):
        super().__init__()
        nargs = len(self._body_args())
        self._body = _body_builder(body, nargs, f"the body of {label}",
                                   "lambda i: kernel(...)" if nargs else "lambda: kernel(...)")
        self._label = label

    def describe(self) -> str:
        return self._label

    # -- what subclasses define -----------------------------------------------------
    def _body_args(self) -> tuple:
        return ()

    def _eager_iterations(self, ctx):
        """Yield once per iteration, on the host (eager execution)."""
        raise NotImplementedError

    def _host_control(self, start: bool) -> bool:
        """What the control kernel does, on the host (the reference device runs this
        instead): ``start`` before the first iteration, then after each; go on?"""
        raise NotImplementedError

    def _launch_control(self, stream, handle, start: bool) -> None:
        raise NotImplementedError

    def _keep(self) -> tuple:
        return ()

    def _borrowed(self) -> tuple:
        """``(tensor, whose)`` pairs the body may read and not write (the count and index)."""
        return ()

    def writes(self) -> tuple:
        """The tensors the loop itself writes (not its body): a ``loop``'s index."""
        return ()

    # -- execution ----------------------------------------------------------------------
    def _build_body(self, guard, capture=None) -> DeviceOp:
        """The body op, checked by ``guard`` (BodyGuard.check_op); ``capture``: the capture
        it is recorded into (which notes the ops it runs, to hand them back if it fails)."""
        mark = births_mark()
        op = built_op(self._body(*self._body_args()), f"the body of {self._label}")
        try:
            refuse_prebuilt(op, mark, self._label)
            guard.check_op(op, capture.fresh if capture is not None else None, "captured" if capture else "run")
        except BaseException:
            op.discard()  # refused, so it never runs: that is the error's to say, not a warning's
            raise
        return op

    def _execute(self, ctx: ExecutionContext):
        refuse_cells_elsewhere(ctx, self._keep(), self._label)
        outer = ctx.guard
        if outer is not None:  # a loop inside another's body: it must not write what that one borrows
            for t in self.writes():
                outer.check(t, self._label)
        guard = BodyGuard(self._label, self._borrowed(), outer)
        if ctx.capture is None:
            op = self._build_body(guard)  # the first iteration's, checked before the loop begins
            body_ctx = ExecutionContext(ctx.stream, None, guard)
            for _ in self._eager_iterations(ctx):
                if op is None:
                    op = self._build_body(guard)
                op._run(body_ctx)
                op = None
            if op is not None:
                op.discard()  # no iteration ran: built to be checked, as a captured loop's body is
        else:
            supported, why = ctx.device.conditional_nodes()
            if not supported:
                raise CapabilityError(f"capturing {self._label} needs CUDA conditional graph nodes, and {why}. "
                                      "Run the loop eagerly instead (sync_on/async_on: a host loop), or update "
                                      "the driver to CUDA 12.4 or newer")
            capture = ctx.capture
            op = self._build_body(guard, capture)  # built and checked before the GPU adds the loop's node
            try:
                refuse_host_nodes(op, self._label)
                ctx.device.graphs.capture_while(
                    ctx.stream, self._label, self._launch_control, self._host_control,
                    lambda body_stream: op._run(ExecutionContext(body_stream, capture, guard, self._label)))
            except BaseException:
                op.discard()  # refused (or failed) with an error that says so
                raise
            capture.keep.append(self._keep())  # the body stream is only needed while capturing
        return None


class Loop(_Loop):
    """``loop(count, index, body)``; see the module docstring."""

    __slots__ = ("count", "count_tensor", "index")

    def __init__(self, count, index, body):
        if isinstance(index, SharedTensor):  # the loop writes the index: a shared one must be ours alone
            index.check_writable("dop.loop's index")
        self.index = _int32_cell(index, "the loop index", "dop.from_numpy(np.zeros(1, np.int32))")
        if self.index._alloc.read_only:
            raise read_only_error("dop.loop's index (the loop writes it)", self.index)
        if isinstance(count, (int, np.integer)) and not isinstance(count, bool):
            if count < 0 or count > 2**31 - 1:
                raise ShapeError(f"a loop count must be in [0, 2^31), got {count}")
            self.count, self.count_tensor = int(count), None
            label = f"loop({count})"
        elif isinstance(count, (float, np.floating)):
            raise DTypeError(f"a loop count is an int in [0, 2^31) or an int32 [1] device tensor, got the float "
                             f"{count}: pass int(count) if it is whole")
        else:
            self.count_tensor = _int32_cell(count, "the loop count", "dop.from_numpy(np.array([T], np.int32))")
            self.count, label = 0, "loop(count tensor)"
        if self.count_tensor is not None and self.count_tensor.overlaps(self.index):
            raise LaunchError("the loop's count and index are the same buffer; give the index its own")
        super().__init__(body, label)

    def _body_args(self) -> tuple:
        return (self.index,)

    def _borrowed(self) -> tuple:
        return ((self.index, "its index"), (self.count_tensor, "its count"))

    def writes(self) -> tuple:
        return (self.index,)

    def _count_now(self, ctx) -> int:
        if self.count_tensor is None:
            return self.count
        # a negative count runs no iteration and leaves index 0, as the captured
        # loop's test (index < count, from index 0) does
        return max(0, int(self.count_tensor.numpy(stream=ctx.stream).flat[0]))  # eager: the host reads it once

    def _set_index(self, ctx, i: int) -> None:
        ctx.stream.memset32(self.index.data_ptr, i, 1)

    def _eager_iterations(self, ctx):
        n = self._count_now(ctx)
        for i in range(n):
            self._set_index(ctx, i)
            yield i
        self._set_index(ctx, n)

    def _host_control(self, start: bool) -> bool:
        idx = self.index._array.reshape(-1)  # a view: the cell may be [1, 1] as well as [1]
        idx[0] = 0 if start else idx[0] + 1
        return bool(idx[0] < (self.count if self.count_tensor is None else self.count_tensor._array.flat[0]))

    def _launch_control(self, stream, handle, start: bool) -> None:
        fn = _control_functions(stream.device)[0]
        _control_launcher(stream, fn, start)(stream, _ONE_THREAD, int(handle), self.index, self.count_tensor,
                                             self.count, int(start))

    def _keep(self) -> tuple:
        return (self.index, self.count_tensor)


class While(_Loop):
    """``while_(cond, body)``; see the module docstring."""

    __slots__ = ("cond",)

    def __init__(self, cond, body):
        self.cond = _int32_cell(cond, "the loop condition", "dop.from_numpy(np.ones(1, np.int32))")
        super().__init__(body, "while_")

    def _eager_iterations(self, ctx):
        while self.cond.numpy(stream=ctx.stream).flat[0]:  # one host round trip per test
            yield

    def _host_control(self, start: bool) -> bool:
        return bool(self.cond._array.flat[0])

    def _launch_control(self, stream, handle, start: bool) -> None:
        fn = _control_functions(stream.device)[1]
        _control_launcher(stream, fn, start)(stream, _ONE_THREAD, int(handle), self.cond)

    def _keep(self) -> tuple:
        return (self.cond,)


def loop(count, index, body) -> DeviceOp:
    """Run ``body(index)`` ``count`` times; ``index`` (int32 [1] on the device)
    holds the iteration number, for the body's kernels to read.  ``count``: an
    int, or an int32 [1] device tensor read at run time (captured: at every
    test, so the same graph runs any count).  Captured, the whole loop is one
    conditional node: one graph launch runs every iteration."""
    return Loop(count, index, body)


def while_(cond, body) -> DeviceOp:
    """Run ``body()`` while ``cond`` (int32 [1] on the device) is non-zero; the
    body's kernels are what change ``cond``.  Eagerly the host reads ``cond``
    before each iteration; captured, the GPU does."""
    return While(cond, body)
