"""Branches that a device value picks: ``if_(cond, then, else_=None)`` and
``switch(index, branches)``.

Executed eagerly, a branch is a host branch: the host reads the value (one
round trip) and runs the branch it picks.  Captured into a graph it becomes
a CUDA *conditional node*: every branch is captured once into a body of the
node, and at every replay the GPU runs the one the value picks then, with no
host involvement.  Change the value between replays (a kernel writes it, or
``api.memcpy``) and the same graph takes another branch.

How the capture is wired (driver API; the loops of loops.py are the same):

* a one-thread control kernel, captured before the node, reads the value and
  sets the node's conditional handle (``if_``: ``cond != 0``; ``switch``: the
  index, a negative one meaning none);
* the node is added after it by hand, and each branch is captured into its
  body on a stream of its own (``cuStreamBeginCaptureToGraph``).
* On CUDA 12.8 drivers and up that is one node: IF (one body), IF/ELSE (two)
  or SWITCH (one body per branch).  Older drivers (12.4 to 12.7) have IF
  nodes of one body only: each branch is then an IF node of its own, and the
  control kernel, launched once per branch before the first node, sets each
  handle to "this branch?", so a branch that changes the value does not make
  a second one run.

The value is a one-element int32 device tensor, as a loop's condition is.
``switch`` runs no branch for an index outside ``[0, len(branches))``;
``if_`` without ``else_`` runs nothing when ``cond`` is 0.  Each branch is a
function that builds its op (called with no argument): eagerly only the
picked branch is built; captured, every branch is built and recorded once.

On the reference device a captured branch is a tape step that runs the tape
of the branch the value picks (``_host_select``).
"""
from __future__ import annotations

from ..compile import compile_cubin
from ..errors import CapabilityError, GraphSafetyError, LaunchError
from ..foreign import refuse_host_nodes
from ..bodies import BodyGuard
from ..execution import births_mark, walk
from ..op import DeviceOp, ExecutionContext, SharedOp, value
from ..runtime.device import device_key, load_module
from ..runtime.launch import LaunchConfig, ptr
from .loops import _body_builder, _int32_cell, built_op, refuse_cells_elsewhere

_SELECT_SOURCE = r"""
// Declared as cuda_device_runtime_api.h does (see loops.py).
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle,
                                                                      unsigned int value);

// The control step of if_/switch: one thread.  The branch the value picks is
// 0 (then) or 1 (else) for if_, the index for switch (a negative one: none).
// one_node: the handle of the node that holds every branch (IF: cond != 0,
// SWITCH: the branch).  Else the handle of branch `which`'s own IF node.
extern "C" __global__ void deviceop_select(cudaGraphConditionalHandle h, const int* value, int is_if,
                                           int one_node, int which) {
    int v = *value;
    unsigned int picked = is_if ? (v != 0 ? 0u : 1u) : (v < 0 ? 0xFFFFFFFFu : (unsigned int)v);
    if (one_node)
        cudaGraphSetConditional(h, is_if ? (v != 0 ? 1u : 0u) : picked);
    else
        cudaGraphSetConditional(h, picked == (unsigned int)which ? 1u : 0u);
}
"""
_SELECT_SIGNATURE = ["uint64", ptr("int32"), "int32", "int32", "int32"]
_ONE_THREAD = LaunchConfig(1, 1)
_select: dict = {}  # (device type, ordinal) -> the deviceop_select Function


def _select_function(device):
    key = device_key(device)
    fn = _select.get(key)
    if fn is None:
        mod = load_module(compile_cubin(_SELECT_SOURCE, arch=device.arch, filename="deviceop_select.cu"), device)
        fn = _select[key] = mod.get_function("deviceop_select", _SELECT_SIGNATURE)
    return fn


def _branch_builders(fns, names) -> list:
    """The branch functions, checked: each builds its branch's op (an op itself is refused,
    and every op given is dropped without a warning: the error says why)."""
    for fn, what in zip(fns, names):
        if isinstance(fn, DeviceOp) or not callable(fn):
            for other in fns:
                if isinstance(other, DeviceOp):
                    other.discard()
            raise LaunchError(f"{what} is a function that builds the branch's op (captured, every branch is "
                              "built and recorded; eagerly, only the one the value picks): pass e.g. "
                              f"lambda: kernel(...), not {type(fn).__name__}")
    for fn, what in zip(fns, names):
        _body_builder(fn, 0, what, "lambda: kernel(...)")  # called with no argument: refused now if it can't be
    return list(fns)


def refuse_op_in_two_branches(ops, label: str) -> None:
    """Refuse one op held by two branches (``[lambda: op] * 2``): captured, every branch is
    recorded, and an op is recorded once (eagerly only the branch taken runs it, so only a
    capture finds this)."""
    held = {}
    for i, op in enumerate(ops):
        for o in walk(op):
            if type(o) is SharedOp and o.core.done:  # a value: any branch may hand it on
                continue
            j = held.setdefault(id(o), i)
            if j != i:
                raise LaunchError(f"branches {j} and {i} of {label} both hold {o.describe()}: captured, every branch "
                                  "is recorded and an op runs (is recorded) once. Build it in each branch function "
                                  "(e.g. [lambda: kernel(...), lambda: kernel(...)], not [lambda: op] * 2)")


class _Branches(DeviceOp):
    """The machinery of ``if_`` and ``switch``: a host branch eagerly, a conditional
    node when captured, a tape branch on the reference device."""

    __slots__ = ("value", "_builders", "_label", "_is_if")
    graph_safe = True

    def __init__(self, cell, builders, label: str, is_if: bool):
        super().__init__()
        self.value, self._builders, self._label, self._is_if = cell, builders, label, is_if

    def describe(self) -> str:
        return self._label

    def _pick(self, v: int):
        """The branch the value ``v`` picks (None: none), as the control kernel decides."""
        if self._is_if:
            i = 0 if v != 0 else 1
        else:
            i = v
        return i if 0 <= i < len(self._builders) else None

    def _host_select(self):
        return self._pick(int(self.value._array.flat[0]))

    def _launch_select(self, stream, handle, which: int) -> None:
        _select_function(stream.device).launch(stream, _ONE_THREAD, int(handle), self.value, int(self._is_if),
                                               int(which < 0), max(which, 0))

    def _build(self, i: int, outer, capture=None) -> tuple:
        """Branch i's op, checked, and the BodyGuard it runs under (``outer``: the enclosing
        loop's or branch's, or None): what a ``then`` in it returns is checked as the op is."""
        what = f"branch {i} of {self._label}"
        guard = BodyGuard(what, (), outer)
        guard.branch_mark, guard.branch_label = births_mark(), what
        if guard.mark is not None:  # in a loop's body: built at every iteration
            guard.mark_label = f"{guard.mark_label} ({what})"
        op = built_op(self._builders[i](), what)
        capturing = capture is not None
        try:
            guard.check_built_before(op)
            bad = op.unsafe_for_graphs(capture.fresh if capturing else None)
            if bad is not None:
                where = "captured" if capturing else "run"
                raise GraphSafetyError(f"{what} contains {bad.describe()}, which allocates or synchronizes; a branch "
                                       f"may only launch kernels, copy and fill (it is {where} as the body of a "
                                       "conditional graph node): allocate before and pass buffers in")
        except BaseException:
            op.discard()  # refused, so it never runs: the error says so, not a warning on top
            raise
        return op, guard

    def _execute(self, ctx: ExecutionContext):
        refuse_cells_elsewhere(ctx, (self.value,), self._label)
        if ctx.capture is None:
            chosen = self._pick(int(self.value.numpy(stream=ctx.stream).flat[0]))  # eagerly the host reads it once
            if chosen is not None:
                op, guard = self._build(chosen, ctx.guard)
                op._run(ExecutionContext(ctx.stream, None, guard))
            return None
        supported, why = ctx.device.conditional_nodes()
        if not supported:
            raise CapabilityError(f"capturing {self._label} needs CUDA conditional graph nodes, and {why}. Run it "
                                  "eagerly instead (sync_on/async_on: a host branch), or update the driver to CUDA "
                                  "12.4 or newer")
        several = ctx.device.conditional_branches()[0]
        capture = ctx.capture
        ops, guards = [], []  # every branch built and checked before the GPU adds the conditional node(s)
        try:
            for i in range(len(self._builders)):
                op, guard = self._build(i, ctx.guard, capture)
                ops.append(op)
                guards.append(guard)
                refuse_host_nodes(op, self._label)
            refuse_op_in_two_branches(ops, self._label)
            ctx.device.graphs.capture_branches(
                ctx.stream, self._label, "if" if self._is_if else "switch", len(self._builders), several,
                self._launch_select, self._host_select,
                lambda i, body_stream: ops[i]._run(ExecutionContext(body_stream, capture, guards[i], self._label)))
        except BaseException:
            for op in ops:
                op.discard()  # refused (or failed) with an error that says so
            raise
        capture.keep.append((self.value,))  # every replay's control kernel reads it
        return None


def if_(cond, then, else_=None) -> DeviceOp:
    """Run ``then()``'s op when ``cond`` (int32 [1] on the device) is non-zero, else
    ``else_()``'s (if given).  Eagerly the host reads ``cond``; captured, the GPU
    does at every replay: one IF (or IF/ELSE) conditional node."""
    fns, names = ([then], ["then"]) if else_ is None else ([then, else_], ["then", "else_"])
    builders = _branch_builders(fns, names)
    cell = _int32_cell(cond, "the if_ condition", "dop.from_numpy(np.ones(1, np.int32))")
    return _Branches(cell, builders, "if_" if else_ is None else "if_/else_", True)


def switch(index, branches) -> DeviceOp:
    """Run ``branches[i]()``'s op, ``i`` the value of ``index`` (int32 [1] on the device);
    none when ``i`` is outside ``[0, len(branches))``.  Eagerly the host reads
    ``index``; captured, the GPU does at every replay: one SWITCH conditional node."""
    if not isinstance(branches, (list, tuple)):
        if isinstance(branches, DeviceOp):
            branches.discard()
        raise LaunchError(f"switch takes a list of functions, one per branch (branch i runs when the index is "
                          f"i), e.g. [lambda: kernel_a(...), lambda: kernel_b(...)]; got {type(branches).__name__}")
    if not branches:
        raise LaunchError("switch needs at least one branch: pass a list of functions, one per index value")
    builders = _branch_builders(branches, [f"branch {i}" for i in range(len(branches))])
    cell = _int32_cell(index, "the switch index", "dop.from_numpy(np.zeros(1, np.int32))")
    return _Branches(cell, builders, f"switch({len(builders)})", False)
