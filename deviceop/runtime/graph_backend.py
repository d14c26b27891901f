"""The graph backend: what a device's ``graphs`` does for the graph layer above.

A CUDA device's ``graphs`` is the module runtime/graphs.py (driver calls); the
reference device's is a ``TapeGraphs`` (runtime/tape.py: a graph is a tape of
host steps).  deviceop/graph/ talks only to this interface, so it never asks
which device it runs on.  ``GraphBackend`` writes the interface down:
tests/test_graph_backend.py checks that both sides provide every member with
the same parameters, and nothing public besides, so that a function added to
one side and forgotten on the other fails there, not on the other device.

What the types are is each side's own: a *graph* is a CUgraph or a tape, an
*exec* a CUgraphExec or the tape itself, a *node* (``handle``) a CUgraphNode
or a tape step.  Every ``label`` names the work in the errors raised.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable


@runtime_checkable
class GraphBackend(Protocol):
    """A device's graph work (``device.graphs``); see the module docstring."""

    # -- capture, instantiate, replay ------------------------------------------------
    def begin(self, stream) -> None:
        """Begin a relaxed-mode capture on ``stream``."""

    def abort(self, stream) -> None:
        """End a failed capture on ``stream`` and destroy whatever it recorded."""

    def end(self, stream, label: str) -> Any:
        """End a capture that went well: the graph (CaptureError if the capture broke)."""

    def instantiate(self, stream, graph, label: str) -> Any:
        """The executable graph of ``graph``, uploaded (``graph`` destroyed if that fails)."""

    def launch(self, exec_, stream) -> None:
        """Replay ``exec_`` on ``stream``."""

    def update(self, exec_, graph, label: str) -> str | None:
        """Make ``exec_`` do ``graph``'s work in place: None when it did, else why not."""

    def destroy(self, graph) -> None:
        """Destroy a graph definition (None: nothing)."""

    def close(self, exec_, graphs) -> None:
        """Destroy an executable graph and the graph definitions behind it."""

    # -- nodes of a capture in progress ----------------------------------------------------
    def last_node(self, stream) -> Any:
        """The node the capturing stream's last work made (None when it has several tips)."""

    def node_id(self, node) -> int:
        """What identifies a node (two wrappers of one node give one id)."""

    def capture_deps(self, stream) -> list:
        """The nodes the capturing ``stream``'s next work will depend on."""

    def set_capture_deps(self, stream, nodes) -> None:
        """Make the capturing ``stream``'s next work depend on exactly ``nodes``."""

    def capture_while(self, stream, label: str, launch_control: Callable, host_control: Callable,
                      run_body: Callable) -> None:
        """Record a conditional WHILE node (runtime/graphs.py says what each callable does)."""

    def capture_branches(self, stream, label: str, kind: str, count: int, several: bool, launch_select: Callable,
                         host_select: Callable, run_branch: Callable) -> None:
        """Record ``count`` branches of which a device value picks one: IF or SWITCH nodes."""

    def add_child(self, stream, source, label: str) -> Any:
        """Add a child-graph node running a copy of ``source`` after the capturing ``stream``'s work."""

    # -- nodes of an executable graph ---------------------------------------------------------
    def set_kernel_node(self, exec_, handle, params, launch_args, label: str) -> None:
        """New parameters for one kernel node of ``exec_``."""

    def set_enabled(self, exec_, handle, on: bool, label: str) -> None:
        """Switch one kernel, memcpy or memset node of ``exec_`` on or off."""

    def set_memcpy_node(self, exec_, handle, dst: int, src: int, nbytes: int, device, label: str) -> None:
        """Point one memcpy node of ``exec_`` at other buffers."""

    def set_memset_node(self, exec_, handle, dst: int, value: int, size: int, count: int, device,
                        label: str) -> None:
        """Point one memset node of ``exec_`` at another buffer and value."""

    def update_child(self, exec_, child, source, label: str) -> None:
        """Make ``exec_``'s child-graph node do what ``source`` (updated since) now says."""

    # -- graph definitions (a child graph's source) --------------------------------------------
    def clone(self, graph, exec_, handles) -> tuple:
        """``(a copy of the graph, the copies of handles in it)``."""

    def define_kernel_node(self, handle, params, launch_args) -> None:
        """New parameters for a kernel node of a graph definition."""

    def define_memcpy_node(self, handle, dst: int, src: int, nbytes: int) -> None:
        """New addresses and width for a memcpy node of a graph definition."""

    def define_memset_node(self, handle, dst: int, value: int, size: int, count: int) -> None:
        """New buffer and value for a memset node of a graph definition."""

    # -- inspection ---------------------------------------------------------------------------
    def nodes(self, graph) -> list[dict]:
        """One dict per node: its type and, for kernels, the kernel's name."""

    def edges(self, graph) -> list[tuple[int, int, str]]:
        """The dependency edges ``(i, j, kind)``: node j runs after node i."""

    def dot(self, graph, verbose: bool) -> str:
        """The graph as Graphviz DOT."""


def members() -> list[str]:
    """The names of the interface's members, in the order written above."""
    return [name for name in GraphBackend.__dict__ if not name.startswith("_") and callable(GraphBackend.__dict__[name])]
