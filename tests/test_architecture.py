"""The shape of the library, checked: deviceop's layers import only downward, no
module imports itself round a cycle (function-level imports count too), the
reference device lives in one backend, and no module grows past a readable size.
The kernel library (the kernels/ folder, imported as deviceop.kernels) is the top
layer: it is checked with the package, and nothing imports it as ``kernels``.
docs/architecture.md describes the layers."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "deviceop"
LIBRARY = ROOT / "kernels"   # installed and imported as deviceop.kernels (pyproject's package-dir)

# Bottom up; a module may import its own layer and those below it.
LAYERS = [
    ("foundation", ("deviceop.errors", "deviceop.dtypes")),
    ("runtime", ("deviceop.runtime",)),
    ("memory and compiler", ("deviceop.memory", "deviceop.tensor", "deviceop.interop", "deviceop.compile",
                             "deviceop.compile_inputs")),
    ("op algebra", ("deviceop.execution", "deviceop.bodies", "deviceop.values", "deviceop.op", "deviceop.api", "deviceop.foreign")),
    ("kernels", ("deviceop.kernel",)),
    ("graphs", ("deviceop.graph",)),
    ("distributed", ("deviceop.distributed",)),
    ("package", ("deviceop", "deviceop.__main__", "deviceop.testing")),
    ("kernel library", ("deviceop.kernels",)),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "kernels":
        parts.insert(0, "deviceop")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in [*PKG.rglob("*.py"), *LIBRARY.rglob("*.py")]}


def imports_of(name: str) -> set[str]:
    """The deviceop modules ``name`` imports, anywhere in its body (function level too)."""
    path = MODULES[name]
    return imports_in(path.read_text(), name, path.name == "__init__.py")


def imports_in(source: str, name: str, is_package: bool) -> set[str]:
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import sub`` imports the submodule sub; ``from mod import name`` the module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def layer_of(name: str) -> int:
    best = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if name == prefix or name.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (rank, len(prefix))
    assert best is not None, f"{name} belongs to no layer: add it to LAYERS (and docs/architecture.md)"
    return best[0]


def test_the_import_graph_has_no_cycle():
    cycles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_each_layer_imports_only_its_own_and_the_layers_below():
    upward = [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
              for a, targets in GRAPH.items() for b in targets if layer_of(b) > layer_of(a)]
    assert not upward, "imports against the layering: " + "; ".join(sorted(upward))


def test_the_checks_see_function_level_and_relative_imports():
    """What the checks above rely on: an import inside a function is an edge, and
    relative imports resolve to the module (or submodule) they name."""
    src = ("from ..errors import LaunchError\nfrom . import launch\n"
           "def f():\n    from ..graph import CudaGraph\n    import deviceop.op\n")
    assert imports_in(src, "deviceop.kernel.plan", False) == {
        "deviceop.errors", "deviceop.kernel.launch", "deviceop.graph", "deviceop.op"}


def test_the_kernel_library_is_in_the_import_graph():
    """The checks above see kernels/ under its import name, and its relative imports."""
    assert {"deviceop.kernels", "deviceop.kernels.conv", "deviceop.kernels._checks"} <= set(GRAPH)
    assert {"deviceop.kernels._checks", "deviceop.kernels.conv_kernels", "deviceop.kernels"} <= GRAPH["deviceop.kernels.conv"]
    assert layer_of("deviceop.kernels.conv") > layer_of("deviceop.kernel") == layer_of("deviceop.kernel.launch")


TOP_LEVEL_KERNELS = re.compile(r"^\s*(from\s+kernels[\s.]|import\s+kernels\b)", re.M)


def test_nothing_imports_the_kernel_library_as_a_top_level_kernels():
    """Code and docs say ``deviceop.kernels``: a top-level ``kernels`` is another project on PyPI
    (and, in a checkout, a second copy of every kernel declaration)."""
    sources = [p for d in ("deviceop", "kernels", "tests", "examples", "bench", "scripts", "docs")
               for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md") or p.parent.name == "scripts"]
    sources += [ROOT / "README.md"]
    found = [f"{p.relative_to(ROOT)}:{source[:m.start()].count(chr(10)) + 1}"
             for p in sources if p.is_file() for source in [p.read_text(errors="replace")]
             for m in TOP_LEVEL_KERNELS.finditer(source)]
    assert not found, f"import deviceop.kernels instead of kernels at {found}"


def test_the_reference_device_is_one_backend():
    """Only the runtime's device modules name ``is_reference``: every other layer
    asks the device, stream or function what to do, whichever it is."""
    naming = sorted(name for name, path in MODULES.items() if "is_reference" in path.read_text()
                    and layer_of(name) < layer_of("deviceop.kernels"))  # the library above may ask, as a user may
    assert naming == ["deviceop.runtime.device", "deviceop.runtime.reference"], naming


def test_no_module_is_over_450_lines():
    long = {name: n for name, path in MODULES.items()
            if path.is_relative_to(PKG) and (n := len(path.read_text().splitlines())) > 450}
    assert not long, f"split these modules by concern: {long}"


# What a layer gets from one above it, which it may not import: (the module that reads it, the
# name it reads, the registry function that sets it, the one module that calls that function).
INSTALLED = [("deviceop.execution", "_capture", "set_capture", "deviceop.graph"),
             ("deviceop.runtime.launch", "tensor_type", "set_tensor_type", "deviceop.tensor"),
             ("deviceop.runtime.device", "_fallback", "set_fallback", "deviceop.runtime.reference")]


def test_what_a_layer_gets_from_above_is_installed_through_one_documented_call():
    """op.graph_on's capture, the launchers' tensor type and Device's fallback are set by a call
    a reader can follow (execution.set_capture, launch.set_tensor_type, Device.set_fallback),
    from one module each, never by assigning another module's attribute."""
    import deviceop as dop
    from deviceop import execution
    from deviceop.runtime import device, launch

    assert execution._capture == dop.CudaGraph.capture
    assert launch.tensor_type is dop.Tensor
    assert device.Device._fallback is dop.ReferenceDevice
    for reader, name, setter, installer in INSTALLED:
        callers = sorted(m for m, path in MODULES.items()
                         if re.search(rf"\b{setter}\(", path.read_text()) and m != reader)
        assert callers == [installer], f"{setter}: called from {callers}"
        assigned = sorted(m for m, path in MODULES.items()
                          if m != reader for node in ast.walk(ast.parse(path.read_text()))
                          if isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.ctx, ast.Store))
        assert not assigned, f"{name} is assigned in {assigned}: call {setter} instead"
