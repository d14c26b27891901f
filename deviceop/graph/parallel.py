"""Parallel capture: a graph whose edges are the data's dependencies
(``op.graph_on(stream, parallel=True)``, ``CudaGraph.scope(stream, parallel=True)``).

A serial capture records every node after the one before it, as the stream
runs them.  A parallel capture gives each kernel, copy and fill node exactly
the dependencies its buffers need: the last writers of what it reads, and the
readers and writers since of what it writes (the ownership rule deviceop
already checks: ops that share no written buffer do not depend on each
other).  So the branches of a ``zip_`` (K and V, four matvecs) become parallel
branches of the graph, in any op tree, without forked streams: before each
node the capture sets the capturing stream's dependencies
(``cuStreamUpdateCaptureDependencies``), which is what forked streams joined by
events would make, from the buffers rather than from the tree's shape.

* Deterministic: nodes are recorded in the op's execution order, edges are a
  function of the buffers; a redundant edge (implied through another) is left out.
* Conservative where it cannot see: work recorded without a footprint (a loop,
  a branch, foreign work, a collective, a host callback, a child graph) is a
  *barrier*: it follows everything before it, and everything after follows it.
  Between nodes the stream's dependencies are all the open branches joined, so
  such work is ordered as in a serial capture.
* A node update that would make two unordered nodes share a written buffer is
  refused (GraphUpdateError): the edges were made for the captured buffers.

The state is one ``Dag`` per capturing stream (the capture's, and each body of
a loop or branch, whose nodes live in the body's graph).
"""
from __future__ import annotations

from ..errors import GraphUpdateError


def kernel_footprint(params, launch_args) -> tuple:
    """``((lo, hi, writes), ...)``: the byte ranges a launch reads and writes (its tensor arguments)."""
    return tuple((*t.memory_range(), p.writes) for p, t in zip(params, launch_args) if p.role != "scalar")


def copy_footprint(dst, src) -> tuple:
    return ((*src.memory_range(), False), (*dst.memory_range(), True))


def fill_footprint(dst) -> tuple:
    return ((*dst.memory_range(), True),)


_PAGE = 16         # the byte ranges recorded are indexed by 64 KiB page (address >> _PAGE) ...
_WIDE = 64         # ... unless one spans more pages than this: those are looked at by every node


class _Open:
    """The byte ranges ``(lo, hi, writes, item)`` recorded since the last barrier, found by
    address: a node is compared with those on the pages its own ranges touch (and the wide
    ones), not with every range before it, so a capture costs about the same per node
    however many came before (comparing with every earlier range makes a capture quadratic)."""

    __slots__ = ("pages", "wide", "count")

    def __init__(self):
        self.pages, self.wide, self.count = {}, [], 0

    def add(self, lo: int, hi: int, w: bool, item: int) -> None:
        if lo >= hi:  # an empty range touches nothing
            return
        entry, first, last = (lo, hi, w, item), lo >> _PAGE, (hi - 1) >> _PAGE
        self.count += 1
        if last - first >= _WIDE:
            self.wide.append(entry)
            return
        pages = self.pages
        for p in range(first, last + 1):
            held = pages.get(p)
            if held is None:
                pages[p] = [entry]
            else:
                held.append(entry)

    def conflicts(self, footprint) -> set:
        """The items whose ranges share a byte with ``footprint``'s, one of the two writing."""
        found = set()
        for lo, hi, w in footprint:
            if lo >= hi:
                continue
            first, last = lo >> _PAGE, (hi - 1) >> _PAGE
            if last - first >= _WIDE:  # a wide range: every page held, rather than every page it spans
                groups = [self.wide, *self.pages.values()]
            else:
                groups = [self.wide, *(self.pages.get(p, ()) for p in range(first, last + 1))]
            for group in groups:
                for lo2, hi2, w2, item in group:
                    if (w or w2) and lo < hi2 and lo2 < hi:
                        found.add(item)
        return found


def _conflict(a, b) -> bool:
    """Do two footprints touch a common byte that at least one of them writes?"""
    for lo, hi, w in a:
        for lo2, hi2, w2 in b:
            if (w or w2) and lo < hi2 and lo2 < hi:
                return True
    return False


class Dag:
    """The dependencies of the nodes recorded on one capturing stream (see the module docstring).

    Items are the recorded nodes (and the barriers), by index: ``done[i]`` the nodes
    item i left as the stream's dependencies (its node), ``anc[i]`` the items it
    follows (a bit mask, transitively), ``footprints[i]`` its byte ranges (None: a barrier)."""

    __slots__ = ("graphs", "done", "ids", "anc", "footprints", "labels", "open", "floor", "tips", "joined")

    def __init__(self, graphs):
        self.graphs = graphs
        self.done, self.ids, self.anc, self.footprints, self.labels = [], [], [], [], []  # ids: done's, as _ids
        self.open = _Open()  # the byte ranges of the items recorded since the last barrier
        self.floor = None    # the last barrier: every later item follows it
        self.tips = set()    # the items no later item follows
        self.joined = frozenset()  # the stream's dependencies as left after the last item (node ids)

    def _ids(self, nodes) -> frozenset:
        return frozenset(map(self.graphs.node_id, nodes))

    def _add(self, done, anc: int, footprint, label: str, deps=None) -> int:
        """Note item i (``deps``: the items it directly follows; None: a barrier, which follows all)."""
        i = len(self.done)
        self.done.append(done)
        self.ids.append(self._ids(done))
        self.anc.append(anc)
        self.footprints.append(footprint)
        self.labels.append(label)
        if deps is None:
            self.tips = {i}
        else:  # a tip the item follows through another is no tip: only its direct deps can be tips
            self.tips.difference_update(deps)
            self.tips.add(i)
        return i

    def before(self, stream, footprint) -> list[int]:
        """Set the stream's dependencies for a node with ``footprint``; its items are returned."""
        graphs = self.graphs
        now = graphs.capture_deps(stream)
        if self._ids(now) != self.joined:  # recorded without a footprint since the last item: a barrier
            self.floor = self._add(now, (1 << len(self.done)) - 1, None, "work recorded without a footprint")
            self.open = _Open()
            self.joined = self.ids[self.floor]
        found = self.open.conflicts(footprint)
        if self.floor is not None:
            found.add(self.floor)
        anc = self.anc
        deps = sorted(i for i in found if not any(anc[j] >> i & 1 for j in found))
        nodes = [n for i in deps for n in self.done[i]]
        if self._ids(nodes) != self.joined:
            graphs.set_capture_deps(stream, nodes)
        return deps

    def after(self, stream, deps: list[int], footprint, label: str):
        """Note the node just recorded (``deps``: what ``before`` returned); then join every
        open branch as the stream's dependencies.  Returns ``(its node or None, its item)``."""
        graphs = self.graphs
        done = graphs.capture_deps(stream)
        anc = 0
        for d in deps:
            anc |= self.anc[d] | (1 << d)
        i = self._add(done, anc, footprint, label, deps)
        for lo, hi, w in footprint:
            self.open.add(lo, hi, w, i)
        if len(self.tips) == 1:
            self.joined = self.ids[i]
        else:
            tips = sorted(self.tips)
            graphs.set_capture_deps(stream, [n for j in tips for n in self.done[j]])
            self.joined = frozenset().union(*[self.ids[j] for j in tips])
        return (done[0] if len(done) == 1 else None), i

    def copy_for_child(self) -> "Dag":
        """The dependencies as a child-graph node's copy of this graph holds them: the same
        edges, the buffers each node uses now, updated from then on apart from this graph's
        (graph/child.py: the copy's nodes are set on their own)."""
        twin = Dag.__new__(Dag)
        twin.graphs, twin.done, twin.ids, twin.anc, twin.labels = self.graphs, (), (), self.anc, self.labels
        twin.footprints, twin.open, twin.floor, twin.tips, twin.joined = list(self.footprints), None, None, set(), frozenset()
        return twin

    def ordered(self, i: int, j: int) -> bool:
        """Does one of items i and j follow the other?"""
        return bool(self.anc[i] >> j & 1 or self.anc[j] >> i & 1)

    def check_update(self, i: int, footprint, label: str) -> None:
        """Refuse new buffers for node i that a node it is not ordered with uses (one of them
        writing): nothing in the graph would order the two.  (The node notes them in
        ``footprints[i]`` once the driver took them.)"""
        for j, other in enumerate(self.footprints):
            if j != i and other is not None and not self.ordered(i, j) and _conflict(footprint, other):
                raise GraphUpdateError(
                    f"{label}: the new buffers overlap those of {self.labels[j]}, a node on a parallel branch of "
                    "this graph (captured with parallel=True: the two shared no written buffer then, so nothing "
                    "orders them, and they may run at the same time). Recapture (graph.recapture(op)) so that the "
                    "capture orders them, or capture with parallel=False")
