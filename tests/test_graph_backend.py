"""The graph backend is one interface on both devices: runtime/graphs.py (the GPU's driver
calls) and the reference device's TapeGraphs (runtime/tape.py) each provide every member of
GraphBackend (runtime/graph_backend.py) with the same parameters, and nothing public besides.
A function added to one side only, or a parameter renamed, reordered or given a default on
one side, fails here on a machine without a GPU, instead of on the device that lacks it."""
import inspect

import deviceop as dop
from deviceop.runtime import graphs as driver_graphs
from deviceop.runtime.graph_backend import GraphBackend, members
from deviceop.runtime.reference import ReferenceDevice
from deviceop.runtime.tape import TapeGraphs

# shared by both sides, not called by the graph layer: the one wording of a broken capture
HELPERS = {"capture_failed"}


def parameters(fn) -> list[tuple]:
    """What a caller relies on: each parameter's name, kind and default."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def interface(name: str) -> list[tuple]:
    return parameters(getattr(GraphBackend, name))[1:]  # without self


def public_names(backend) -> set[str]:
    if inspect.ismodule(backend):
        return {n for n, f in vars(backend).items() if not n.startswith("_") and inspect.isfunction(f)
                and f.__module__ == backend.__name__} - HELPERS
    return {n for n in dir(type(backend)) if not n.startswith("_")}


def mismatches(backend) -> list[str]:
    """How ``backend`` (a module or an instance) departs from GraphBackend."""
    found = []
    for name in members():
        fn = getattr(backend, name, None)
        if not callable(fn):
            found.append(f"{name}: missing")
        elif parameters(fn) != interface(name):
            found.append(f"{name}{inspect.signature(fn)}: GraphBackend says {name}"
                         f"{inspect.signature(getattr(GraphBackend, name))}")
    found += [f"{name}: not in GraphBackend" for name in sorted(public_names(backend) - set(members()))]
    return found


def test_the_interface_names_every_function_the_graph_layer_calls():
    assert {"begin", "abort", "end", "instantiate", "launch", "update", "destroy", "close", "last_node", "node_id",
            "capture_deps", "set_capture_deps", "capture_while", "capture_branches", "add_child", "set_kernel_node",
            "set_enabled", "set_memcpy_node", "set_memset_node", "update_child", "clone", "define_kernel_node",
            "define_memcpy_node", "define_memset_node", "nodes", "edges", "dot"} == set(members())


def test_the_driver_graphs_match_the_interface():
    assert mismatches(driver_graphs) == []
    assert isinstance(driver_graphs, GraphBackend)


def test_the_reference_tapes_match_the_interface():
    tapes = ReferenceDevice.graphs
    assert type(tapes) is TapeGraphs
    assert mismatches(tapes) == []
    assert isinstance(tapes, GraphBackend)
    assert dop.Device(0).graphs in (driver_graphs, tapes)  # whichever device this machine has


def test_drift_on_either_side_is_caught():
    class Drifted(TapeGraphs):
        edges = None                                # removed (one side forgot it)

        @staticmethod
        def end(stream, name: str):                 # a parameter renamed
            pass

        @staticmethod
        def launch(exec_, stream, sync=False):      # a parameter added, with a default
            pass

        @staticmethod
        def set_priority(exec_, value):             # a function the interface does not have
            pass

    found = mismatches(Drifted(None))
    assert [f.split("(")[0].split(":")[0] for f in found] == ["end", "launch", "edges", "set_priority"], found
