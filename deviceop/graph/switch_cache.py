"""GraphCache's SWITCH mode: one graph holds a branch for every padded batch size,
and the device picks the branch from the batch (``dop.switch``).

    cache = SwitchGraphCache(forward, stream=stream, max_size=64)   # GraphCache's arguments
    y = cache(x)           # x: [5, d] -> the size-8 branch of the one graph, y: [5, d]

What it changes against ``GraphCache``, which holds one graph per padded size:

* one capture per key (every size at once, largest first, so the sizes share
  the largest one's scratch), one executable graph, one upload;
* a call writes the branch index into a one-element device cell (one memset,
  ordered on the stream with the input copies) and replays that graph: a new
  batch size needs no other graph, so the host does the same work whatever
  the batch (what ``bench/graph_shapes.py`` measures against GraphCache).

Everything else is GraphCache's: padding (only up to the padded size: the
branch reads no further), outputs sliced to the batch, eager fallback above
the largest size, keys, bounds (a graph per key), ``copy``, the lock.  The
function ``fn(ws, *inputs)`` must build only kernel launches, copies and fills
(a branch is the body of a conditional node), as a loop body does.
"""
from __future__ import annotations

import time

import numpy as np

from ..interop import from_numpy
from .branches import switch
from .cache import GraphCache, Workspace, _Entry, _outputs_of


class _SwitchEntry(_Entry):
    __slots__ = ("cell", "branch", "by_size")


class SwitchGraphCache(GraphCache):
    """GraphCache in SWITCH mode: one graph per key, a branch per padded size (see the module docstring)."""

    @staticmethod
    def _slot(size: int, key) -> tuple:
        return (0, key)  # every size of a key is one graph

    def _capture(self, size, key, inputs) -> _Entry:
        t0 = time.perf_counter()
        top = self.sizes[-1]
        order = sorted(self.sizes, reverse=True)  # branch i is size order[i]: the largest is built first
        static, slots = [], []
        for i, x in enumerate(inputs):
            t, slot = self._scratch(("input", i, x.dtype), (top, *x.shape[1:]), x.dtype)
            static.append(t)
            slots.append(slot)
        cell = from_numpy(np.full(1, -1, np.int32), stream=self.stream)
        spaces, values = [], {}

        def branch(s):
            ws = Workspace(self, s, key[1], eager=False)
            spaces.append(ws)
            return self._build(ws, *[t[:s] for t in static]).inspect(lambda v: values.__setitem__(s, v))

        try:
            graph = switch(cell, [lambda s=s: branch(s) for s in order]).graph_on(self.stream)
        except BaseException as exc:
            exc.add_note(f"(while SwitchGraphCache captured sizes {list(self.sizes)}, key {key[1]!r})")
            self._trim_arena()
            raise
        try:
            by_size = {s: _outputs_of(values[s], s) for s in order}
        except BaseException:
            graph.close()
            self._trim_arena()
            raise
        entry = _SwitchEntry(key, top, graph, static, None, None, slots + [b for ws in spaces for b in ws.buffers])
        entry.cell, entry.branch, entry.by_size = cell, {s: i for i, s in enumerate(order)}, by_size
        self._entries[key] = entry
        self._stats.captures += 1
        self._stats.capture_seconds += time.perf_counter() - t0
        self._enforce_bounds(keep=entry)
        return entry

    def _replay(self, entry: _SwitchEntry, batch: int, inputs):
        size = self.size_for(batch)
        self._copy_inputs(entry, batch, size, inputs)
        self.stream.memset32(entry.cell.data_ptr, entry.branch[size], 1)  # the branch the graph takes
        entry.graph.replay(self.stream)
        return self._outputs(entry, batch, size, *entry.by_size[size])
