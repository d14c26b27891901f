"""A kernel's launch geometry: grid, block, dynamic shared memory and cluster.

By default the grid is the first ``Out`` partition's tiles per axis (the
output-tile convention) and ``block``, ``shared_mem`` and ``cluster`` are ints
or functions of the generics (``cluster`` also of the grid).  A kernel that
does not follow the convention declares its geometry explicitly, each part an
int, a shape expression (shapes.py) or a tuple of them, or a Python function::

    Kernel(..., grid=("(N+255)//256", "B"), block=256)         # N, B: sizes the shapes name
    Kernel(..., grid=lambda g, out, x: (x.shape[0],), block="32*W", shared_mem="4*K")

Expressions read the generics, the sizes the shapes name and the int scalar
parameters; a ``grid`` function gets ``(g, *args)`` as ``validate`` does, with
``g`` holding the generics and those sizes.  What comes out is checked against
CUDA's limits (LaunchConfig) with the launch's values named in the error.
"""
from __future__ import annotations

import operator

import numpy as np

from ..errors import DeviceOpError, LaunchError
from ..runtime.launch import LaunchConfig
from .shapes import Expr, dim_names, parse
from .signature import run_rule

PARTS = ("grid", "block", "shared_mem", "cluster")


def parse_part(kernel_name: str, what: str, spec):
    """``spec`` of the geometry part ``what`` with its expressions parsed: None, a
    function, or an int / bare name / Expr, or a tuple of 1 to 3 of them."""
    if spec is None or callable(spec):
        return spec
    where = f"kernel {kernel_name}'s {what}"
    if isinstance(spec, (list, tuple)):
        if what == "shared_mem" or not 1 <= len(spec) <= 3:
            raise LaunchError(f"{where}: {'one int' if what == 'shared_mem' else '1 to 3 dimensions'} or a function, "
                              f"got {spec!r}")
        return tuple(_one(where, d) for d in spec)
    return _one(where, spec)


def _one(where: str, d):
    if isinstance(d, str):
        return parse(d, where)
    try:
        n = -1 if isinstance(d, (bool, np.bool_)) else operator.index(d)  # NumPy ints too; never a bool
    except TypeError:
        n = -1
    if n < 0:
        raise LaunchError(f"{where}: a dimension is a non-negative int or an expression string, got {d!r}")
    return n


def names(spec) -> set:
    """The names an expression geometry part reads (a function's are unknown: None)."""
    if spec is None:
        return set()
    if callable(spec):
        return None
    return {n for d in (spec if isinstance(spec, tuple) else (spec,)) for n in dim_names(d)}


def evaluate(spec, env):
    """A parsed part's value with the names of ``env``."""
    if isinstance(spec, tuple):
        return tuple(evaluate(d, env) for d in spec)
    if type(spec) is str:
        return env[spec]
    return spec.eval(env) if isinstance(spec, Expr) else spec


def explicit_config(kernel, values, launch_args, gen: tuple, env: dict) -> LaunchConfig:
    """The LaunchConfig of a kernel whose geometry reads more than the generics and the
    output's grid (an explicit ``grid=``, or parts naming sizes or scalars)."""
    g = dict(zip(kernel.generic_names, gen))
    full = {**env, **g}
    args = [v if p.role == "out" else t for p, v, t in zip(kernel.params, values, launch_args)]
    try:
        if kernel.grid_spec is None:
            grid = values[kernel.grid_index].grid
        elif callable(kernel.grid_spec):
            grid = run_rule(kernel, kernel.grid_spec, gen, dict(full), *args)
        else:
            grid = evaluate(kernel.grid_spec, full)
        parts = {"grid": grid}
        for what in ("block", "shared_mem"):
            spec = getattr(kernel, what)
            parts[what] = run_rule(kernel, spec, gen, g) if callable(spec) else evaluate(spec, full)
        spec = kernel.cluster
        parts["cluster"] = run_rule(kernel, spec, gen, g, grid) if callable(spec) else evaluate(spec, full)
        key = tuple(tuple(v) if isinstance(v, list) else v for v in parts.values())  # a function's [x, y] too
        try:
            cfg = kernel._configs.get(key)
        except TypeError:  # unhashable (an array): LaunchConfig takes or refuses it, uncached
            return LaunchConfig(*key)
        if cfg is None:
            cfg = kernel._configs[key] = LaunchConfig(*key)
        return cfg
    except DeviceOpError as exc:
        used = sorted({n for what in PARTS for n in (names(kernel._spec(what)) or ())})
        shown = ", ".join(f"{n}={full[n]}" for n in used if n in full)
        declared = ", ".join(f"{what}={kernel._shown(what)}" for what in PARTS if kernel._spec(what) is not None)
        raise type(exc)(f"{kernel.name}'s launch geometry ({declared}){f' with {shown}' if shown else ''}: "
                        f"{exc}") from None
