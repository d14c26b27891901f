"""The memcpy and memset nodes of a captured graph: ``api.memcpy`` and ``api.fill``
become one MEMCPY or MEMSET node each, which ``graph.node(op)`` hands out.

Between replays a node can be pointed at other buffers (and a memset at
another value) without recapturing or re-instantiating: one driver call
(cuGraphExecMemcpyNodeSetParams, cuGraphExecMemsetNodeSetParams) with the
node's captured parameters and the new addresses.  The new buffers are
checked as the op checks them (dtype, size, contiguity, overlap, ownership),
and must be as large as the captured ones: the driver keeps what it planned
for the node's size.  Every check runs before the driver is called; a refused
update leaves the node as it was.  ``enabled`` switches either off and on.
"""
from __future__ import annotations

from ..api import _check_copy, _destination, _tensor_of, fill_pattern
from ..errors import AliasingError, DTypeError, LaunchError, ShapeError
from .nodes import Node
from .parallel import copy_footprint, fill_footprint


def _same_buffer_kind(node: Node, new, old, what: str) -> None:
    """``new`` may replace ``old`` in ``node``: same dtype, element count and device."""
    if new.device is not old.device:
        raise LaunchError(f"{node.label}: the new {what} lives on {new.device!r}, the captured one on "
                          f"{old.device!r}; a graph's nodes use its own device's memory")
    if new.dtype is not old.dtype:
        raise DTypeError(f"{node.label}: the new {what} is {new.dtype.name}, the captured one {old.dtype.name}; "
                         "a node keeps its dtype: pass a buffer like the captured one, or recapture")
    if new.size != old.size:
        raise ShapeError(f"{node.label}: the new {what} has shape {list(new.shape)} ({new.size} elements), the "
                         f"captured one {list(old.shape)} ({old.size}); a node keeps its size: pass a buffer of "
                         f"{old.size} elements, or recapture")


def _refuse_extra(node: Node, names: tuple, extra: tuple, unknown: dict) -> None:
    """Refuse what ``set`` does not take (a raw TypeError from Python, the kernel node's way)."""
    if extra or unknown:
        given = f"{len(names) + len(extra)} positional arguments" if extra else f"argument {next(iter(unknown))!r}"
        raise LaunchError(f"{node.label}: set() takes {' and '.join(names)} (by name, or in that order; either "
                          f"may be left out), got {given}; e.g. node.set({names[0]}=...)")


class MemcpyNode(Node):
    """The MEMCPY node of one ``api.memcpy(dst, src)``: ``set(dst=..., src=...)``."""

    __slots__ = ("dst", "src")

    def __init__(self, dst, src, handle):
        super().__init__(f"api.memcpy({dst.dtype.name} x {dst.size})", handle)
        self.dst, self.src = dst, src  # the graph keeps them (through its nodes) while the node copies them

    def set(self, dst=None, src=None, *extra, **unknown) -> None:
        """Copy from ``src`` into ``dst`` at the next replays (either may be left as it is)."""
        _refuse_extra(self, ("dst", "src"), extra, unknown)
        graph = self._live_graph()
        new_dst = self.dst if dst is None else _destination(dst)
        new_src = self.src if src is None else _tensor_of(src, "memcpy source")
        _same_buffer_kind(self, new_dst, self.dst, "destination")
        _same_buffer_kind(self, new_src, self.src, "source")
        _check_copy(new_dst, new_src)
        if new_dst.data_ptr == new_src.data_ptr:
            raise AliasingError(f"{self.label}: the new source and destination are the same buffer; a copy node "
                                "copies between two buffers")
        self._check_handle("updated")
        self._check_buffers(copy_footprint(new_dst, new_src))
        self._in_exec(graph, self._driver(graph).set_memcpy_node, new_dst.data_ptr, new_src.data_ptr, new_dst.nbytes,
                      graph._device, self.label)
        self.dst, self.src = new_dst, new_src
        self._note_buffers(copy_footprint(new_dst, new_src))

    def __repr__(self) -> str:
        return f"<MemcpyNode {self.index}: {self.label}{'' if self._enabled else ', disabled'}>"


class MemsetNode(Node):
    """The MEMSET node of one ``api.fill(dst, value)``: ``set(dst=..., value=...)``."""

    __slots__ = ("dst", "value")

    def __init__(self, dst, value, handle):
        super().__init__(f"api.fill({dst.dtype.name} x {dst.size})", handle)
        self.dst, self.value = dst, value

    def set(self, dst=None, value=None, *extra, **unknown) -> None:
        """Set every element of ``dst`` to ``value`` at the next replays (either may be left as it is)."""
        _refuse_extra(self, ("dst", "value"), extra, unknown)
        graph = self._live_graph()
        new_dst = self.dst if dst is None else _destination(dst)
        new_value = self.value if value is None else value
        _same_buffer_kind(self, new_dst, self.dst, "destination")
        bits, size, count = fill_pattern(new_dst, new_value)
        self._check_handle("updated")
        self._check_buffers(fill_footprint(new_dst))
        self._in_exec(graph, self._driver(graph).set_memset_node, new_dst.data_ptr, bits, size, count, graph._device,
                      self.label)
        self.dst, self.value = new_dst, new_value
        self._note_buffers(fill_footprint(new_dst))

    def __repr__(self) -> str:
        return f"<MemsetNode {self.index}: {self.label}{'' if self._enabled else ', disabled'}>"
