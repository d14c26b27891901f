"""The launch plan: the key of a launch's whole argument signature, every check
of a launch, and one cache per kernel from the key to the plan.

``checked_launch`` is the one way a launch is checked: eager launches,
captured launches, node updates and loop bodies all come through it.  A plan
found by its key was checked; a key not seen runs every check (the safety
rule: whatever can reject a launch runs whenever its inputs change, and the
key holds every input).  An eager launch's plan is then *prepared* (packed
once), so the next launch with that key is one lookup and one driver call.
"""
from __future__ import annotations

import math

from ..errors import AliasingError, LaunchError
from ..runtime import codegen
from ..runtime.device import wrong_device
from ..runtime.launch import LaunchConfig
from ..tensor import SharedTensor, Tensor
from .signature import _as_tensor_arg, bind, check_arg, run_rule


def _attribute(fn, pdl: bool, cooperative: bool, config: LaunchConfig) -> str | None:
    """The launch attribute a launch needs (Function.launch_* / Function.prepared)."""
    if config.cluster is not None and (pdl or cooperative):
        raise LaunchError(f"{fn.name}: a launch in thread-block clusters cannot also be "
                          f"{'PDL' if pdl else 'cooperative'} (not supported)")
    return "pdl" if pdl else "cooperative" if cooperative else "cluster" if config.cluster is not None else None


def _launcher(fn, pdl: bool, cooperative: bool, config: LaunchConfig):
    """The Function's launcher for a launch's attributes, and its config."""
    attribute = _attribute(fn, pdl, cooperative, config)
    return (fn.launch if attribute is None else getattr(fn, f"launch_{attribute}")), config


class LaunchPlan:
    """What every launch with one key does: the function (compiled for the
    generics, inferred ones included), its launcher and config, and for eager
    launches the prepared launch (``call(stream address, params, 0)``)."""

    __slots__ = ("launcher", "config", "function", "generics", "attribute", "call", "params", "prepared")

    def __init__(self, fn, pdl: bool, cooperative: bool, config: LaunchConfig, generics: tuple):
        self.attribute = _attribute(fn, pdl, cooperative, config)
        self.launcher, self.config = _launcher(fn, pdl, cooperative, config)
        self.function, self.generics = fn, generics
        self.call = self.params = self.prepared = None

    def prepare(self, launch_args) -> None:
        """Pack this launch once (Function.prepared); the reference device's
        functions are not preparable (a prepared launch would keep its arrays)."""
        fn = self.function
        if fn.preparable and self.call is None:
            prepared = fn.prepared(self.attribute, self.config, *launch_args)
            self.prepared, self.params, self.call = prepared, prepared.params, prepared.call


def _launch_key_code(kernel, head) -> tuple[list[str], str]:
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
    key = [*head]
    unwrap = []
    for i, p in enumerate(kernel.params):
        if p.role == "out":  # a partition: its layout id stands for its tensor's and its tiles
            key.append(f"a{i}._sig_id")
        elif p.role == "in":  # a SharedTensor's tensor while the handle is live; else no key (the check names it)
            unwrap.append(f"t{i} = a{i}._tensor if type(a{i}) is SharedTensor and a{i}._live else a{i}")
            key.append(f"t{i}._sig_id")
        elif p.role == "inout":  # a Tensor; a SharedTensor has no key: whether it is held alone is checked each time
            unwrap.append(f"t{i} = a{i} if type(a{i}) is Tensor else None")
            key.append(f"t{i}._sig_id")
        elif p.dtype.kind == "f":
            key += [f"type(a{i})", f"a{i}", f"(a{i} or copysign(1.0, a{i}))"]
        else:
            key += [f"type(a{i})", f"a{i}"]
    return unwrap, f"({', '.join(key)})"


_KEY_ENV = {"SharedTensor": SharedTensor, "Tensor": Tensor, "copysign": math.copysign}


def _launch_key_function(kernel):
    """``key(device, generics, pdl, cooperative, a0, ...)``: the launch key (see
    ``_launch_key_code``); raises AttributeError, TypeError or ValueError for
    arguments that have none (not a tensor, a released handle, an array)."""
    unwrap, key = _launch_key_code(kernel, ("device", "gen", "pdl", "cooperative"))
    return codegen.generate(codegen.LAUNCH_KEY, "launch_key", _KEY_ENV, f"<deviceop launch key of {kernel.name}>",
                            args=", ".join(f"a{i}" for i in range(len(kernel.params))), unwrap=unwrap, key=key)


def check_launch(kernel, values, gen, label: str) -> tuple[list, tuple]:
    """Every check of a launch: roles, dtypes, the kernel's limits on its generics,
    shapes (against the generics, which are inferred when ``gen`` is None; the
    limits then follow), layouts, aliasing, the kernel's own rules.
    Returns the launch arguments (tensors for partitions and shared handles) and
    the generics."""
    return _check_launch(kernel, values, gen, label)[:2]


def _check_launch(kernel, values, gen, label: str) -> tuple[list, tuple, dict]:
    """check_launch, and the values of the names the shapes bound (for the geometry)."""
    params = kernel.params
    for p, v in zip(params, values):
        check_arg(kernel, p, v)
    launch_args = [v.tensor if p.role == "out" else _as_tensor_arg(v) for p, v in zip(params, values)]
    inferred = gen is None
    if kernel.limits is not None and not inferred:
        run_rule(kernel, kernel.limits, gen, dict(zip(kernel.generic_names, gen)))
    gen, env = bind(kernel, values, launch_args, gen)
    if kernel.limits is not None and inferred:
        run_rule(kernel, kernel.limits, gen, dict(zip(kernel.generic_names, gen)))
    written = [(p, t) for p, t in zip(params, launch_args) if p.writes]
    read = [(p, t) for p, t in zip(params, launch_args) if p.role == "in"]
    for i, (w, t) in enumerate(written):
        for other, u in written[i + 1:]:
            if t.overlaps(u):
                raise AliasingError(f"{label} writes {w.name} and {other.name}, which overlap; give each output "
                                    "its own buffer")
        for other, u in read:
            if t.overlaps(u):
                raise AliasingError(f"{label} writes {w.name} and reads {other.name} from overlapping memory; "
                                    "write into a separate buffer (a buffer read and written is one InOut)")
    if kernel.validate is not None:  # partitions for outputs, tensors for the rest
        run_rule(kernel, kernel.validate, gen, dict(zip(kernel.generic_names, gen)),
                 *[v if p.role == "out" else t for p, v, t in zip(params, values, launch_args)])
    return launch_args, gen, env


def checked_launch(kernel, head: tuple, values, describe, key=None) -> tuple[list, LaunchPlan]:
    """``(launch arguments, plan)`` of a launch whose arguments are ``values``:
    the plan looked up by the launch key (``head`` is its device, generics, pdl
    and cooperative) or, for a key not seen before (or arguments that have
    none), reached by running every check (``check_launch``, and the kernel's
    compile and load).  ``describe()`` names the launch in errors."""
    plans = kernel._plans
    try:
        if key is None:
            key = kernel._launch_key(*head, *values)
        plan = plans.get(key)
    except (AttributeError, TypeError, ValueError):  # an argument of the wrong kind, unhashable: checked below
        key = plan = None
    if plan is not None:
        # Plain loop: the partition's tensor and each live SharedTensor's tensor (the key had them all)
        launch_args = list(values)
        for i in kernel._out_positions:
            launch_args[i] = values[i].tensor
        for i in kernel._input_positions:
            t = launch_args[i]
            if type(t) is SharedTensor:
                launch_args[i] = t._tensor
        return launch_args, plan
    device, gen, pdl, cooperative = head
    launch_args, gen, env = _check_launch(kernel, values, gen, describe())
    for p, t in zip(kernel.params, launch_args):  # the key holds each tensor's device: checked once per key
        if type(t) is Tensor and t.device is not device:
            raise wrong_device(f"launching {describe()}", device, t.device, f"argument {p.name}")
    config = kernel.launch_config(values, launch_args, gen, env)  # before compiling: a refused geometry is cheap
    fn = kernel.function(device, gen)  # compiled, loaded and checked against the CUBIN once
    plan = LaunchPlan(fn, pdl, cooperative, config, gen)
    if key is not None:
        if len(plans) > 65536:
            plans.clear()
        plans[key] = plan
    return launch_args, plan
