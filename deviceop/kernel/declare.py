"""Kernel declarations: a CUDA C++ kernel, its generics, its typed signature,
its launch shape and its NumPy reference.

A kernel is CUDA C++ (a ``.cu`` file or a string) plus a declaration:

* its entry name and template parameters (``generics``; a launch picks values
  with ``.generics([...])``, compiled as the NVRTC name expression
  ``entry<v0, v1, ...>``),
* the role of each parameter, in the order the kernel takes them: ``Out`` (a
  partition the kernel writes; the first Out gives the grid, one block per
  tile), ``InOut`` (a tensor it reads and writes), ``In`` (a tensor it reads),
  ``Scalar``; any number of outputs and in-outs, at any position; a tensor
  parameter's layout is dense (C-contiguous) unless declared ``layout="strided"``,
* its launch geometry: by default the grid is the first Out's tiles per axis,
  and the block, dynamic shared memory and optional thread-block cluster are
  ints, shape expressions or functions of the generics (the cluster's also of
  the grid); a kernel that does not follow the output-tile convention declares
  ``grid=`` (geometry.py),
* its rules: ``limits(g)`` on the generics alone (ranges), checked before the
  shapes, and ``validate(g, *args)`` on the arguments (alignment, ranges of
  sizes, what shapes cannot say), after them,
* a NumPy reference that computes the same output — what the reference
  device runs, and what tests compare the GPU against.

Calling the kernel builds a lazy launch op; its value is the tuple of all the
arguments, ``first()`` its (first) output partition, its grid that partition's
tiles per axis.

The entry is the kernel's plain C++ name (``entry=`` when it differs from
``name``): an ``extern "C"`` kernel, a C++ one (``scale``, ``ns::scale``) or a
template, whose generics complete it (``scale<256>``).  Its NVRTC name
expression is generated, and NVRTC gives the mangled symbol to load; an
``entry`` that is already a mangled symbol (``_Z5scalePfPKff``) is loaded as it is.

A kernel another compiler built is declared the same way from its binary:
``Kernel.from_binary`` (nvcc's CUBIN, fatbin or PTX) and ``Kernel.from_triton``
(prebuilt.py).
"""
from __future__ import annotations

import threading
from os import PathLike
from pathlib import Path

from ..compile import compile_cubin, normalize_arch
from ..errors import CompileError, CudaError, LaunchError
from ..execution import as_an_execution
from ..foreign import refuse_uncallable
from ..op import DeviceOp
from ..runtime.device import default_arch, device_key
from ..runtime.launch import LaunchConfig, check_param_layout, ptr
from . import geometry, prebuilt
from .fast import _fast_launch_type
from .launch import KernelLaunch
from .plan import _launch_key_function
from .shapes import dim_names
from .signature import Param, _dims_text, _generic_text, check_generics, check_names, inferable, run_rule, scalar_names


# deviceop's own CUDA headers (#include <deviceop/pdl.cuh>): on every kernel's include path,
# so the kernel library above (kernels/) and deviceop's kernels share them.
INCLUDE_DIR = Path(__file__).resolve().parent.parent / "include"


def _shapes_name_scalars(g, *args) -> None:
    """The rule of a kernel whose shapes name scalars: bind checked them already."""


def _checked_declaration(name, source, params, generics, entry, options, include_dirs, **rules) -> tuple:
    """``(params, generics, options, include_dirs)`` as tuples, the declaration's kinds checked: what ``tuple()`` would take
    apart (a str of generics, options or include dirs: one per character) or take as something it
    is not (a Param given alone, a rule that is no function) is refused, naming the argument."""
    if not isinstance(name, str) or not name:
        raise LaunchError(f"a Kernel's name is a non-empty str (the kernel's, in every error), got {name!r}")
    if entry is not None and (not isinstance(entry, str) or not entry):
        raise LaunchError(f"kernel {name}: entry= is the kernel's name in its source or binary (a non-empty str), "
                          f"got {entry!r}")
    if source is not None and not isinstance(source, (str, Path)):
        raise LaunchError(f"kernel {name}: the source is CUDA C++ as a str, or a .cu file's Path, got "
                          f"{type(source).__name__}")
    for what, value in (("params", params), ("generics", generics), ("options", options),
                        ("include_dirs", include_dirs)):
        if isinstance(value, (str, bytes, Param)) or not hasattr(value, "__iter__"):
            raise LaunchError(f"kernel {name}: {what}= is a list, got {value!r}; e.g. {what}=[{value!r}]")
    params, generics, options, include_dirs = tuple(params), tuple(generics), tuple(options), tuple(include_dirs)
    for what, given, kinds, shown in (("options", options, str, "a str each (options=['-DN=4', '-O3'])"),
                                      ("include_dirs", include_dirs, (str, PathLike), "a str or Path each")):
        odd = [v for v in given if not isinstance(v, kinds)]
        if odd:  # a raw AttributeError/TypeError at the first compile
            raise LaunchError(f"kernel {name}: {what}= is {shown}, got {odd[0]!r} in {list(given)!r}")
    bad = [p for p in params if not isinstance(p, Param)]
    if bad:
        raise LaunchError(f"kernel {name}: each parameter is declared with Out(...), InOut(...), In(...) or "
                          f"Scalar(...), in the kernel's order; got {bad[0]!r}")
    names = [p.name for p in params] + list(generics)
    odd = [n for n in names if not isinstance(n, str) or not n.isidentifier()]
    if odd:
        raise LaunchError(f"kernel {name}: parameter and generic names are identifiers (a shape expression names "
                          f"them, set(name=...) takes them), got {odd[0]!r}")
    for what, given in (("parameter", [p.name for p in params]), ("generic", generics)):
        twice = sorted({n for n in given if given.count(n) > 1})
        if twice:
            raise LaunchError(f"kernel {name} declares the {what} {', '.join(twice)} more than once: give each "
                              f"{what} its own name")
    for what, rule in rules.items():
        if rule is not None and not callable(rule):
            raise LaunchError(f"kernel {name}: {what}= is a function (or None), got {type(rule).__name__} {rule!r}")
    return params, generics, options, include_dirs


class Kernel:
    """A CUDA C++ kernel and its declaration (see the module docstring)."""

    def __init__(self, name: str, source, params, *, generics=(), block=256, reference=None, validate=None,
                 entry: str | None = None, options=(), include_dirs=(), shared_mem=0, cluster=None, grid=None,
                 limits=None):
        params, generics, options, include_dirs = _checked_declaration(
            name, source, params, generics, entry, options, include_dirs,
            reference=reference, validate=validate, limits=limits)
        self.name = name
        self.entry = entry or name
        if isinstance(source, Path):
            self.source_path = source
            try:
                self.source = source.read_text()
            except (OSError, UnicodeDecodeError) as exc:  # a missing file, a directory, a binary
                reason = exc.strerror or str(exc) if isinstance(exc, OSError) else "it is not UTF-8 text"
                raise LaunchError(f"kernel {name}: cannot read its source {source} ({reason}): pass the path of a "
                                  "CUDA C++ file (or the source as a str); a CUBIN, fatbin or PTX file is declared "
                                  "with Kernel.from_binary") from None
            include_dirs = (source.parent, *include_dirs)
        else:
            self.source_path, self.source = None, source
        self.params = params
        self.generic_names = generics
        self.grid_spec = geometry.parse_part(name, "grid", grid)
        outs = [i for i, p in enumerate(self.params) if p.role == "out"]
        written = [i for i, p in enumerate(self.params) if p.writes]
        if not outs and self.grid_spec is None:
            raise LaunchError(f"kernel {name} declares no Out(...): the launch grid is an output partition's tiles, "
                              "so declare the output the grid is cut from as Out (at its position in the kernel's "
                              "parameters), or declare the grid (grid=...); other outputs may be Out or InOut, anywhere")
        if not written:
            raise LaunchError(f"kernel {name} declares nothing it writes: declare each tensor the kernel writes as "
                              "Out (a partition) or InOut (a tensor read and written)")
        # the output partition the grid comes from (and launch.first()); with a declared grid and no
        # Out, the first InOut (launch.first() is that tensor)
        self.grid_index = outs[0] if outs else written[0]
        self.first_is_partition = bool(outs)
        self._out_positions = tuple(outs)
        self._written_positions = tuple(written)  # every Out and InOut: what a loop's guard checks
        check_names(name, self.params, self.generic_names)
        # may a launch omit .generics()?  (when the parameters' shapes determine every generic)
        self.infers_generics = bool(self.generic_names) and inferable(self.params, self.generic_names)
        # validate(g, *args): the kernel's rules on its arguments, after the shapes; limits(g): its
        # rules on the generics alone (ranges), before the shapes, which an out-of-range generic
        # would make name the wrong fix ("pass a q of shape [2048]" for G=16, not "G is in [1, 8]")
        self.reference, self.validate, self.limits = reference, validate, limits
        self.block = geometry.parse_part(name, "block", block)
        self.shared_mem = geometry.parse_part(name, "shared_mem", shared_mem)
        self.cluster = geometry.parse_part(name, "cluster", cluster)
        self._check_geometry_names()
        if self.validate is None and self._named_scalars:
            # a scalar a shape names is a rule: a captured node sets a scalar unchecked only for
            # kernels without rules (graph/nodes.py reads .validate), so give this one a rule
            self.validate = _shapes_name_scalars
        self.options, self.include_dirs = tuple(options), tuple(include_dirs)
        self.signature = [ptr(p.dtype) if p.role != "scalar" else p.dtype for p in self.params]
        # a kernel another compiler built (from_binary, from_triton): its binary and its entry's symbol there
        self.binary = self.binary_symbol = None
        self._functions: dict = {}
        self._compiled: set = set()  # (arch, generics) compiled and checked without a driver: see check_compiled
        self._configs: dict = {}
        # launch key -> LaunchPlan of a checked launch (plan.checked_launch); cleared, never
        # replaced: the generated fast path holds this dict
        self._plans: dict = {}
        # the input tensors (a verdict hit unwraps their SharedTensors; an in-out one has no launch key)
        self._input_positions = tuple(i for i, p in enumerate(self.params) if p.role == "in")
        self.param_index = {p.name: i for i, p in enumerate(self.params)}
        self._lock = threading.Lock()
        self._launch_types: dict = {}  # positions of the arguments that are ops -> launch class
        self._launch_key = _launch_key_function(self)  # (device, generics, pdl, cooperative, *args) -> key

    # What is made per process (the loaded functions, the checked plans, the generated launch code,
    # the lock) is not pickled: a copy in another process compiles and checks anew.  A deep copy is
    # the kernel itself, as a function's is: a declaration has no state a copy could keep apart.
    _PER_PROCESS = ("_functions", "_compiled", "_configs", "_plans", "_lock", "_launch_types", "_launch_key")

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in self._PER_PROCESS}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._functions, self._compiled, self._configs, self._plans = {}, set(), {}, {}
        self._lock, self._launch_types = threading.Lock(), {}
        self._launch_key = _launch_key_function(self)

    def __deepcopy__(self, memo) -> "Kernel":
        return self

    def _spec(self, what: str):
        return self.grid_spec if what == "grid" else getattr(self, what)

    def _shown(self, what: str) -> str:
        spec = self._spec(what)
        return getattr(spec, "__name__", "a function") if callable(spec) else \
            _dims_text(spec) if isinstance(spec, tuple) else str(spec)

    def _check_geometry_names(self) -> None:
        """Refuse geometry expressions that read unknown names; find what the geometry reads:
        the int scalars the shapes and geometry name (bind gives their values) and the
        arguments a captured node may not change (``geometry_params``)."""
        scalars, generics = scalar_names(self.params), set(self.generic_names)
        named = {i: {n for dims in (p.shape, p.tile) for d in dims or () for n in dim_names(d)}
                 for i, p in enumerate(self.params)}
        sizes = set().union(*named.values())
        read = set()  # the sizes and scalars the geometry reads
        for what in geometry.PARTS:
            used = geometry.names(self._spec(what))
            if used is None:
                continue
            unknown = sorted(used - sizes - scalars - generics)
            if unknown:
                raise LaunchError(f"kernel {self.name}'s {what}={self._shown(what)} reads {', '.join(unknown)}: an "
                                  "expression of the geometry names generics, sizes the shapes name, or int scalar "
                                  "parameters")
            read |= used - generics
        self._named_scalars = tuple((i, p.name) for i, p in enumerate(self.params)
                                    if p.name in scalars and p.name in read | sizes)
        # Does the geometry read the arguments (not only the generics and the output's grid)?  Then
        # each plan computes it (geometry.explicit_config), and a captured node cannot (.dynamic refuses
        # those arguments): every tensor's for a declared grid, a grid function's every argument's
        self._explicit_geometry = self.grid_spec is not None or bool(read)
        if callable(self.grid_spec):
            reads = set(range(len(self.params)))
        elif self.grid_spec is not None:
            reads = {i for i, p in enumerate(self.params) if p.role != "scalar"}
        else:
            reads = {i for i, ns in named.items() if ns & read}
        self.geometry_params = frozenset(reads | {i for i, p in enumerate(self.params) if p.name in read})

    @classmethod
    def from_binary(cls, name: str, binary, params, *, entry: str | None = None, reference=None, validate=None,
                    limits=None, grid=None, block=256, shared_mem=0, cluster=None) -> "Kernel":
        """The kernel ``entry`` (default ``name``) of a binary nvcc (or ptxas) built: ``binary`` is
        the path of a CUBIN, fatbin or PTX file, its bytes, or PTX text.  ``params`` and the rest are
        declared as for ``Kernel(...)``, no generics (the binary has its template arguments).
        ``entry`` is an ``extern "C"`` name, a C++ kernel's plain name (the one symbol the binary
        has for it) or a mangled symbol.  The declaration is checked against the binary's
        parameter layouts now, its code against the device's arch when it is loaded; on the
        reference device ``reference=`` runs, and is required (prebuilt.py)."""
        return prebuilt.binary_kernel(cls, name, binary, params, entry=entry, reference=reference,
                                      validate=validate, limits=limits, grid=grid, block=block,
                                      shared_mem=shared_mem, cluster=cluster)

    @classmethod
    def from_triton(cls, compiled, params, *, name: str | None = None, grid=None, reference=None, validate=None,
                    limits=None) -> "Kernel":
        """A Triton-compiled kernel: ``compiled`` is a ``CompiledKernel`` (``triton.compile(...)``,
        ``fn.warmup(...)``) or the ``.json`` of an entry of Triton's cache (its ``.cubin``
        beside it).  ``params`` are the compiled signature's parameters (the constexprs and
        the ints Triton specialized to 1 are not in it); its scratch pointers are added, and
        passed NULL.  The block is ``num_warps`` warps, the dynamic shared memory Triton's;
        the grid is ``grid=`` (or the first Out's tiles).  As ``from_binary`` otherwise."""
        return prebuilt.triton_kernel(cls, compiled, params, name=name, grid=grid, reference=reference,
                                      validate=validate, limits=limits)

    def __call__(self, /, *args, **by_name) -> "KernelLaunch":  # (positional-only: a parameter may be `self`)
        if by_name:  # add(x=a, y=b, out=p): the parameters by their declared names
            args = self._bind_names(args, by_name)
        if len(args) != len(self.params):
            return KernelLaunch(self, args, ())  # raises, naming the parameters
        dynamic = tuple([i for i, a in enumerate(args) if isinstance(a, DeviceOp)])
        cls = self._launch_types.get(dynamic)
        if cls is None:
            cls = self._launch_types.setdefault(dynamic, _fast_launch_type(self, dynamic))
        return cls(self, args, dynamic)

    def _bind_names(self, args: tuple, by_name: dict) -> tuple:
        """``args`` then ``by_name``'s values, in the declared order; a name unknown, given twice
        or left out is a LaunchError that shows the signature."""
        names = [p.name for p in self.params]
        wrong = ([f"no parameter {n!r}" for n in by_name if n not in names]
                 + [f"{n!r} given twice (by position and by name)" for n in names[:len(args)] if n in by_name]
                 + [f"{n!r} missing" for n in names[len(args):] if n not in by_name])
        if wrong:
            raise LaunchError(f"{self.name}({', '.join(names)}) called with {', '.join(wrong)}: pass each "
                              f"parameter once, by position or by name ({self!r})")
        return args + tuple(by_name[n] for n in names[len(args):])

    def __repr__(self) -> str:
        gen = f"<{', '.join(self.generic_names)}>" if self.generic_names else ""
        return f"Kernel {self.name}{gen}({', '.join(p.describe() for p in self.params)})"

    # -- generics -----------------------------------------------------------------
    def check_generics(self, values, fix: str = ".generics({})") -> tuple:
        """``values`` checked as this kernel's generics (signature.check_generics)."""
        return check_generics(self, values, fix)

    def name_expression(self, values) -> str:
        if not self.generic_names:
            return self.entry
        return f"{self.entry}<{', '.join(_generic_text(v) for v in values)}>"

    # -- compiled forms (cached) ----------------------------------------------------
    def compile(self, values=(), arch=None):
        """NVRTC → CUBIN for one set of generics (no GPU needed).  The entry's name
        expression is always generated (NVRTC mangles a C++ name, leaves an extern "C"
        one), except for an entry that is a mangled symbol already."""
        if self.binary is not None:  # nothing to compile: the binary for arch (the driver unknown here)
            return prebuilt.program(self, normalize_arch(arch) if arch is not None else default_arch(), None)
        if self.source is None:
            raise LaunchError(f"kernel {self.name} has no source to compile (source=None): pass its CUDA C++ as a str "
                              "or a .cu file's Path, or declare a kernel another compiler built with "
                              "Kernel.from_binary or Kernel.from_triton")
        expr = self.name_expression(values)
        mangled = self.entry.startswith("_Z") and not self.generic_names  # no C++ name starts with _Z
        # a source file's own path: NVRTC looks for a quoted #include beside the file it compiles, and for a
        # bare name that is the working directory, whose c.cuh then won over the one beside the .cu
        filename = str(self.source_path.resolve()) if self.source_path else f"{self.name}.cu"
        try:
            prog = compile_cubin(self.source, arch=arch, name_expressions=[] if mangled else [expr],
                                 options=self.options, include_dirs=(*self.include_dirs, INCLUDE_DIR),
                                 filename=filename)
        except CompileError as exc:
            raise self._entry_hint(exc, expr) from None
        return prog, expr

    def _entry_hint(self, exc: CompileError, expr: str) -> CompileError:
        """``exc`` with the fix added where NVRTC could not resolve the entry's name expression."""
        log = exc.log or ""
        if "__nv_name_map" not in log:
            return exc
        if "overloaded function" in log:
            fix = (f"the source overloads {self.entry}: give the overload to launch its own name, or pass entry= "
                   "its mangled symbol (cuobjdump -symbols lists them)")
        elif "function template" in log and not self.generic_names:
            fix = (f"the source's {self.entry} is a template: declare its template parameters, generics=[...], "
                   "and pick them at each launch with .generics([...])")
        elif "function template" in log:
            fix = (f"the generics {expr[len(self.entry):]} do not instantiate the template {self.entry}: declare "
                   "generics= as its template parameters, in order, and give each a value of its kind (an int, "
                   "a bool, a C++ type name)")
        elif "is undefined" in log:
            fix = (f"the source defines no kernel {self.entry}: pass entry= the __global__ function's C++ name "
                   "(ns::name for one in a namespace), or rename the Kernel")
        else:
            fix = f"NVRTC could not resolve the name expression {expr!r}: check entry= and the generics"
        return CompileError(f"{self.name}: {fix}\n{exc}", log)

    def function(self, device, values=()):
        """The loaded kernel for ``device`` and these generics (compiled and loaded once)."""
        key = (*device_key(device), values)
        fn = self._functions.get(key)
        if fn is None:
            with self._lock:
                fn = self._functions.get(key)
                if fn is None:
                    prog, expr = self._program(device, values)
                    self._check_program(prog, expr, layout=False)  # the layout is the loader's to check
                    try:
                        reference = None if self.reference is None else as_an_execution(self.name, self.reference)
                        fn = device.load_function(prog, expr, self.signature, reference,
                                                  dict(zip(self.generic_names, values)))
                    except CudaError as exc:
                        if self.binary is None:
                            raise
                        raise prebuilt.load_error(self, exc) from None
                    if self.reference is not None:  # after the layout: a declaration the code disagrees with
                        # says so first; else a raw TypeError at a launch, or at the first replay when captured
                        refuse_uncallable(f"kernel {self.name}", "reference", self.reference,
                                          ["g", *(p.name for p in self.params)], [],
                                          "a kernel's reference is reference(g, *args): the generics, then an array "
                                          "or value for each parameter, in the kernel's order")
                    written = getattr(fn, "declare_written", None)  # the reference device's functions ask
                    if written is not None:
                        written(tuple(i for i, p in enumerate(self.params) if p.writes))
                    self._functions[key] = fn
        return fn

    def _program(self, device, values):
        """``(program, name)`` of this kernel for ``device``: compiled, or its binary's."""
        if self.binary is not None:
            return prebuilt.program_for(self, device)
        return self.compile(values, arch=device.arch)

    def check_compiled(self, arch: str, values=()) -> None:
        """Compile for ``arch`` and check the declared signature against the CUBIN,
        without a driver: what loading the kernel checks on a GPU (a CompileError
        for source NVRTC rejects, a LaunchError for a kernel the CUBIN lacks or whose
        parameters disagree with the declaration)."""
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
                              f"compiled: {known}), so no GPU can load it; pass entry= the kernel's C++ name (its "
                              "name expression is generated) or its exact mangled symbol")
        if layout:
            check_param_layout(expr, self.signature, params)

    def config(self, grid: tuple, values=()) -> LaunchConfig:
        """The launch shape of the output-tile convention: ``grid`` (the output's tiles)
        and the block, shared memory and cluster the generics ``values`` give."""
        key = (grid, values)
        cfg = self._configs.get(key)
        if cfg is None:
            if self._explicit_geometry:
                raise LaunchError(f"{self.name}'s launch geometry reads its arguments (grid={self._shown('grid')}, "
                                  f"block={self._shown('block')}, shared_mem={self._shown('shared_mem')}): it has no "
                                  "config from a grid and the generics alone; launch the kernel, whose plan has one")
            g = dict(zip(self.generic_names, values))
            block = run_rule(self, self.block, values, g) if callable(self.block) else geometry.evaluate(self.block, g)
            smem = run_rule(self, self.shared_mem, values, g) if callable(self.shared_mem) else \
                geometry.evaluate(self.shared_mem, g)
            if len(grid) > 3:
                raise LaunchError(f"{self.name}: an output partition of rank {len(grid)} has no CUDA grid (max 3 axes)")
            cluster = run_rule(self, self.cluster, values, g, grid) if callable(self.cluster) else \
                geometry.evaluate(self.cluster, g)
            try:
                cfg = self._configs[key] = LaunchConfig(grid, block, smem, cluster)
            except LaunchError as exc:  # (a block function that returned None ...): name the kernel
                shown = f" with generics <{', '.join(map(str, values))}>" if values else ""
                raise LaunchError(f"{self.name}'s launch geometry (block={self._shown('block')}, shared_mem="
                                  f"{self._shown('shared_mem')}, cluster={self._shown('cluster')}){shown}: "
                                  f"{exc}") from None
        return cfg

    def launch_config(self, values, launch_args, gen: tuple, env: dict) -> LaunchConfig:
        """The launch shape of one checked launch (``env``: the values bind found)."""
        if self._explicit_geometry:
            return geometry.explicit_config(self, values, launch_args, gen, env)
        return self.config(values[self.grid_index].grid, gen)
