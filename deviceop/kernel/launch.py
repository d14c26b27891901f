"""Kernel launch ops: a lazy launch of a kernel, whose value is the tuple of
its arguments, and the ``first()`` node that gives its output partition.

A launch asks its execution context to run it (eager) or to record it (a
capture, which decides what node it becomes); the plan module checks it.
"""
from __future__ import annotations

import numpy as np

from ..errors import DeviceOpError, LaunchError
from ..op import DeviceOp, stats, warn_if_unexecuted
from ..tensor import Partition, SharedTensor, Tensor
from .plan import check_launch, checked_launch
from .signature import Param, check_arg


class _Output(DeviceOp):
    """``launch.first()`` and ``launch.first().unpartition()`` as one node: the launch's
    (first) output partition, wherever it sits among the kernel's parameters."""

    __slots__ = ("launch", "as_tensor")
    graph_safe = True

    def __init__(self, launch, as_tensor: bool):
        super().__init__()
        self.launch, self.as_tensor = launch, as_tensor
        launch._armed = False  # this node answers for the launch now
        self._armed = True

    __del__ = warn_if_unexecuted

    def children(self):
        return (self.launch,)

    def unpartition(self) -> DeviceOp:
        self._armed = False  # replaced by the node returned
        return type(self)(self.launch, True) if not self.as_tensor else super().unpartition()

    def _run(self, ctx):  # the consumption check inlined: this is the hot path
        if self._consumed:
            self._already_executed()
        self._consumed = True
        kernel = self.launch.kernel
        part = self.launch._run(ctx)[kernel.grid_index]
        return part.tensor if self.as_tensor and kernel.first_is_partition else part

    def describe(self):
        return f"{self.launch.describe()}.first(){'.unpartition()' if self.as_tensor else ''}"

    _execute = _run

class KernelLaunch(DeviceOp):
    """One lazy launch of a kernel; value = the tuple of its arguments."""

    __slots__ = ("kernel", "args", "_generics", "_dynamic", "_mutable", "_pdl", "_cooperative", "__weakref__")
    graph_safe = True
    _output_type = _Output  # what first() makes (the generated launch classes make their own)

    def __init__(self, kernel, args, dynamic: tuple):
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
            else:
                a._armed = False  # run by this launch
        self._armed = True

    __del__ = warn_if_unexecuted

    @property
    def arity(self) -> int:
        return len(self.args)

    def first(self) -> "DeviceOp":
        """The (first) output partition, at whatever position the kernel takes it
        (one node, not a map: launches are the hot path)."""
        return self._output_type(self, False)

    def generics(self, values) -> "KernelLaunch":
        """Pick the template arguments, e.g. ``.generics([2048, 256])``."""
        try:
            self._generics = self.kernel.check_generics(values)
        except DeviceOpError:
            self._armed = False  # the error says this launch is unusable: no warning on top when it is dropped
            raise
        return self

    def dynamic(self, *names) -> "KernelLaunch":
        """Mark arguments (by name; none = all) that may change between replays of
        a graph this launch is captured into: ``graph.node(launch).set(name=...)``.
        A new output partition changes the grid."""
        index = self.kernel.param_index
        unknown = [n for n in names if n not in index]
        if unknown:
            self._armed = False
            raise LaunchError(f"{self.kernel.name} has no argument(s) {', '.join(map(repr, unknown))}; "
                              f"its arguments are {', '.join(index)}")
        mutable = frozenset(index[n] for n in names) if names else frozenset(index.values())
        fixed = [self.kernel.params[i].name for i in sorted(mutable & self.kernel.geometry_params)]
        if fixed:
            self._armed = False
            raise LaunchError(f"{self.kernel.name}'s launch geometry reads {', '.join(fixed)} (its declared grid=, "
                              "block=, shared_mem= or cluster=), which a captured node cannot recompute: mark only "
                              "the other arguments dynamic, and recapture for new values of these")
        self._mutable = mutable
        return self

    def _switch(self, what: str, enabled) -> bool:
        """``enabled`` as a bool: a bool or 0/1 (NumPy's too); ``"no"`` or ``None`` was read as truthy or falsy."""
        if isinstance(enabled, (int, np.integer, np.bool_)) and enabled in (0, 1):  # bool is an int
            return bool(enabled)
        self._armed = False
        raise LaunchError(f"{self.kernel.name}: .{what}() takes True or False, got {enabled!r}: write .{what}() to turn "
                          f"it on, .{what}(False) to leave it off")

    def pdl(self, enabled: bool = True) -> "KernelLaunch":
        """Launch with programmatic dependent launch: the kernel may start while the
        previous kernel on the stream is still running (in a graph: a programmatic
        edge).  Only for kernels that execute ``griddepcontrol.wait`` before reading
        anything the previous kernels wrote (kernels/fused.cu does)."""
        self._pdl = self._switch("pdl", enabled)
        if self._pdl and self._cooperative:
            self._armed = False
            raise LaunchError(f"{self.kernel.name}: a launch is either PDL or cooperative, not both")
        return self

    def cooperative(self, enabled: bool = True) -> "KernelLaunch":
        """Launch cooperatively: all CTAs of the grid are resident at once, so they may
        wait for each other (a grid barrier); the driver refuses a grid too large to
        be (CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE) instead of letting it hang."""
        self._cooperative = self._switch("cooperative", enabled)
        if self._pdl and self._cooperative:
            self._armed = False
            raise LaunchError(f"{self.kernel.name}: a launch is either PDL or cooperative, not both")
        return self

    def children(self):
        return tuple(a for a in self.args if isinstance(a, DeviceOp))

    def writes(self) -> tuple:
        """The tensors this launch writes (its Out and InOut arguments), as far as they are
        known before it runs (an argument that is an op is known when it has run)."""
        out = []
        for i in self.kernel._written_positions:
            a = self.args[i]
            t = a.tensor if isinstance(a, (Partition, SharedTensor)) and getattr(a, "_live", True) else a
            if isinstance(t, Tensor):
                out.append(t)
        return tuple(out)

    def describe(self) -> str:
        return self.kernel.name_expression(self._generics) if self._generics is not None else self.kernel.name

    def _check_arg(self, p: Param, a):
        check_arg(self.kernel, p, a)

    def infer_generics(self):
        """The generics this launch's arguments determine, or None (not all known
        yet: some are ops; or they do not fit, which the launch will say)."""
        kernel = self.kernel
        if not kernel.infers_generics or self._dynamic:
            return None
        try:
            return check_launch(kernel, self.args, None, kernel.name)[1]
        except DeviceOpError:
            return None

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
        launch_args, plan, head = self._check(ctx, values, key)
        if ctx.guard is not None:  # inside a loop's body: no output or in-out into the loop's index or count
            for i in self.kernel._written_positions:
                ctx.guard.check(launch_args[i], self.describe)
        if ctx.capture is None:
            plan.launcher(ctx.stream, plan.config, *launch_args)
        else:  # the capture records it, and decides what node it becomes
            ctx.capture.record_launch(ctx.stream, self, head, values, launch_args, plan)
        stats["launches"] += 1
        return tuple(values)

    def _check(self, ctx, values, key):
        """``(launch arguments, plan, head)`` of this launch (plan.checked_launch);
        the head's generics are the plan's, inferred ones included."""
        gen = self._generics
        if gen is None and not self.kernel.infers_generics:
            raise LaunchError(f"{self.kernel.name} needs generics <{', '.join(self.kernel.generic_names)}>: "
                              f"call .generics([...]) on the launch (the shapes of its parameters do not "
                              f"determine them all)")
        launch_args, plan = checked_launch(self.kernel, (ctx.device, gen, self._pdl, self._cooperative), values,
                                           self.describe, key)
        return launch_args, plan, (ctx.device, plan.generics, self._pdl, self._cooperative)

    def _launch_and_prepare(self, ctx, values, key):
        """An eager launch not prepared yet: checked and launched by the general
        path, then prepared, so the next launch with its key costs one lookup and
        one driver call."""
        launch_args, plan, _ = self._check(ctx, values, key)
        plan.launcher(ctx.stream, plan.config, *launch_args)
        stats["launches"] += 1
        plan.prepare(launch_args)
        return tuple(values)

    _execute = _run
